"""Processors that stream at different rates (KernelOptions.processor_slowness): the schedule gives
each task to the processor that finishes it soonest, a one-round matrix-vector product's columns are
dealt in proportion to the processors' rates, the plan still computes the graph's values bit for bit,
and the slowness is measured from a profiled timeline."""

from __future__ import annotations

import json

import numpy as np
import pytest

import megaloop as ml
from megaloop.errors import GraphBuildError, PlanFormatError
from megaloop.frontend.ops._tilings import MIN_BLOCK_N, TASK_COST_WEIGHTS, balanced_columns
from megaloop.models import LlamaConfig, build_llama_generator, random_parameters
from megaloop.plan import KernelOptions, Plan, make_plan
from megaloop.plan.schedule import list_schedule
from megaloop.reference.interpreter import run_plan
from megaloop.runtime import trace


def slowness(processors: int, seed: int) -> tuple[float, ...]:
    """Groups of processors 10-25 % slower than the rest, as an H200 shows under full load."""
    rng = np.random.default_rng(seed)
    s = rng.uniform(0.9, 0.95, processors)
    s[rng.permutation(processors)[: processors // 4]] = rng.uniform(1.1, 1.25, processors // 4)
    return tuple(round(float(v), 3) for v in s)


@pytest.mark.parametrize("seed", range(6))
def test_balanced_columns_cover_the_product_and_finish_sooner(seed: int) -> None:
    rng = np.random.default_rng(seed)
    processors = int(rng.integers(8, 140))
    n = int(rng.integers(processors, 40 * processors))
    k = int(rng.choice([512, 2048, 8192]))
    width = max(MIN_BLOCK_N, -(-n // processors // MIN_BLOCK_N) * MIN_BLOCK_N)
    s = slowness(processors, seed)
    runs = balanced_columns(n, width, k, s)
    fixed = max(1, TASK_COST_WEIGHTS // k)
    even = sorted(s)[min(processors, -(-n // width)) - 1] * (width + fixed)
    if runs is None:
        return
    assert sum(runs) == n and len(runs) <= processors and runs == sorted(runs, reverse=True)
    assert all(r % MIN_BLOCK_N == 0 for r in runs[:-1]) and runs[-1] > 0
    # widest on the fastest: the makespan the schedule will find
    balanced = max((r + fixed) * v for r, v in zip(runs, sorted(s)))
    print(f"{processors} processors, {n} columns: {balanced:.1f} against {even:.1f} even")
    assert balanced < even


def test_even_processors_keep_even_tiles() -> None:
    assert balanced_columns(8192, 64, 2048, (1.0,) * 132) is None


def test_the_schedule_gives_slow_processors_fewer_tasks() -> None:
    # 12 equal tasks on 3 processors, the last twice as slow: 5, 5 and 2 (even: 4 each)
    sched = list_schedule([0] * 12, [1.0] * 12, [[] for _ in range(12)], 3, 1, slowness=(1.0, 1.0, 2.0))
    assert [len(lst) for lst in sched.lists[0]] == [5, 5, 2]
    assert sched.makespan_ns == 5.0
    even = list_schedule([0] * 12, [1.0] * 12, [[] for _ in range(12)], 3, 1)
    assert [len(lst) for lst in even.lists[0]] == [4, 4, 4]


CFG = LlamaConfig(hidden=256, heads=4, kv_heads=2, intermediate=1024, layers=2, max_seq=32, vocab=512)


def _generator_plans(processors: int = 24) -> tuple[ml.Graph, Plan, Plan, tuple[float, ...]]:
    g = build_llama_generator(CFG, 1)
    s = slowness(processors, 7)
    even = make_plan(g, processors=processors)
    balanced = make_plan(g, processors=processors, options=KernelOptions(processor_slowness=s))
    return g, even, balanced, s


def test_a_balanced_generator_deals_wide_tiles_to_fast_processors_and_computes_the_same() -> None:
    _, even, balanced, s = _generator_plans()
    rp = balanced.ranks[0]
    where = trace.Timeline(balanced, 0, np.zeros((1, len(rp.tasks), 2)), "x").processor_of()
    ops = {o.id: o for o in rp.ops}
    uneven = 0
    for op in ops.values():
        tasks = [t for t in rp.tasks if t.op == op.id]
        if op.op not in ("swiglu_linear", "matmul") or len(tasks) < 2:
            continue
        widths = [t.writes[0].box.hi[-1] - t.writes[0].box.lo[-1] for t in tasks]
        if len(set(widths)) > 1:
            uneven += 1
            rates = [s[where[t.id]] for t in tasks]
            wide = np.mean([r for r, w in zip(rates, widths) if w == max(widths)])
            narrow = np.mean([r for r, w in zip(rates, widths) if w < max(widths)])
            print(f"{op.name}: widths {sorted(set(widths))}, slowness {wide:.3f} widest, {narrow:.3f} narrower")
            assert wide < narrow, f"{op.name}: its widest tiles are on slower processors than its narrower ones"
    assert uneven, "no matrix-vector op got tiles of its processors' rates"
    state = {"token": np.array([[3]]), "position": np.array([[5]])}
    params = random_parameters(CFG, seed=1)
    outs = [run_plan(p, None, params, state, iterations=3, seed=seed) for p in (even, balanced) for seed in (0, 1)]
    for got in outs[1:]:
        for name in outs[0].state:
            assert got.state[name].tobytes() == outs[0].state[name].tobytes(), f"state {name} differs"


def test_slowness_is_saved_in_the_plan_and_checked(tmp_path) -> None:
    _, even, balanced, s = _generator_plans()
    path = tmp_path / "plan.json"
    balanced.save(path)
    assert Plan.load(path).options.processor_slowness == s
    even.save(path)
    doc = json.loads(path.read_text())
    del doc["options"]["processor_slowness"]  # a plan saved before the option: scheduled evenly
    path.write_text(json.dumps(doc))
    assert Plan.load(path).options.processor_slowness == ()
    g = build_llama_generator(CFG, 1)
    with pytest.raises(GraphBuildError, match="processor_slowness: has 3 values but the plan has 24"):
        make_plan(g, processors=24, options=KernelOptions(processor_slowness=(1.0, 1.0, 1.0)))
    with pytest.raises(GraphBuildError, match=r"processor_slowness: must be a tuple of numbers in \[0.1, 10\]"):
        make_plan(g, processors=24, options=KernelOptions(processor_slowness=(0.0,) * 24))
    doc["options"]["processor_slowness"] = "fast"
    path.write_text(json.dumps(doc))
    with pytest.raises(PlanFormatError, match="processor_slowness"):
        Plan.load(path, verify=False)


def test_slowness_is_measured_from_a_timeline() -> None:
    """A timeline whose streaming tasks take their processor's slowness times the nominal cost gives
    that slowness back (scaled to a mean of 1)."""
    _, even, _, _ = _generator_plans()
    rp = even.ranks[0]
    true = np.array(slowness(even.processors, 11))
    times = np.zeros((2, len(rp.tasks), 2))
    clock = np.zeros(even.processors)
    for k in range(2):
        for p, lst in enumerate(rp.processors):
            for tid in lst:
                times[k, tid] = clock[p], clock[p] + rp.tasks[tid].cost_ns * true[p]
                clock[p] += rp.tasks[tid].cost_ns * true[p]
    tl = trace.Timeline(even, 0, times, "synthetic")
    measured = np.array(trace.processor_slowness(tl, min_cost_ns=0.0))
    ran = np.array([bool(lst) for lst in rp.processors])
    want = true / true[ran].mean()
    assert np.abs(measured[ran] - want[ran]).max() < 2e-3, np.abs(measured[ran] - want[ran]).max()

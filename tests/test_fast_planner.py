"""The level-at-a-time planner and verifier give exactly what their per-task loops gave: the same
waits, in the same order, for every task (``megaloop.plan.deps.derive_waits`` against
``tests.slow_planner.derive_waits``), and the same vector clocks (``megaloop.plan.verify._clocks``
against ``tests.slow_planner.clocks``), on plans of several kinds: a model with embedding and head,
its prefill and generator, random programs, collectives over three ranks, pushing all_reduces (with
meetings). Damage the clocks would miss is covered by tests/test_plan_verifier.py's mutations."""

from __future__ import annotations

import numpy as np
import pytest

import megaloop as ml
from megaloop.models import LlamaConfig, build_llama
from megaloop.models.llama import build_llama_generator, build_llama_prefill
from megaloop.plan import make_plan, memory, verify_plan
from megaloop.plan import verify as verify_module
from megaloop.plan.build import plan_layout, requirements
from megaloop.plan.deps import hb_order
from megaloop.plan.hazards import task_bases
from megaloop.plan.model import Plan
from tests import slow_planner
from tests.random_graphs import random_graph
from tests.test_plan_interpreter import collective_program, small_tiles
from tests.test_push_all_reduce import chain

CFG = LlamaConfig(hidden=32, heads=4, kv_heads=2, intermediate=48, layers=2, max_seq=16, vocab=40)


def _random_program(seed: int) -> ml.Graph:
    g = ml.Graph(f"random{seed}")
    rng = np.random.default_rng(seed)
    for i in range(3):
        random_graph(rng, g, f"p{i}.")
    return g


PUSH = {"all_reduce": {"push": 1, "push_elements": 8, "elements": 8}}
CASES = {  # graphs, processors, tiles (None: small tiles for every op, many tasks each)
    "llama": lambda: ([build_llama(CFG, 1, 2)], 7, None),
    "prefill": lambda: ([build_llama_prefill(CFG, 2, 4)], 12, None),
    "generator": lambda: ([build_llama_generator(CFG, 2, eos_ids=(3,))], 9, None),
    "random": lambda: ([_random_program(5)], 4, None),
    "random_default_tiles": lambda: ([_random_program(11)], 3, {}),
    "collectives": lambda: (ml.spmd(collective_program, 3), 5, None),
    "push_all_reduce": lambda: (chain(2, 40), 8, PUSH),
    "prefill_reuse": lambda: ([build_llama_prefill(CFG, 2, 4)], 12, None),
    "collectives_reuse": lambda: (ml.spmd(collective_program, 3), 5, None),
}


def _plan(case: str) -> Plan:
    """``*_reuse``: every intermediate may share bytes (ordered by groups, megaloop.plan.deps.Groups)."""
    graphs, processors, tiles = CASES[case]()
    old = memory.REUSE_MIN_BYTES
    memory.REUSE_MIN_BYTES = 0 if case.endswith("_reuse") else old
    try:
        plan = make_plan(
            graphs,
            processors=processors,
            tiles=small_tiles(graphs) if tiles is None else tiles,
            scratch_budget=0 if case.endswith("_reuse") else memory.SCRATCH_BUDGET,
        )
    finally:
        memory.REUSE_MIN_BYTES = old
    if case.endswith("_reuse"):
        assert any(rp.memory.scratch_bytes < rp.memory.scratch_unshared for rp in plan.ranks), "expected reuse"
    return plan


@pytest.mark.parametrize("case", sorted(CASES))
def test_waits_equal_the_per_task_derivation(case: str) -> None:
    plan = _plan(case)
    base = task_bases(plan)
    seq = [plan.ranks[r].ops[t.op].seq for r, rp in enumerate(plan.ranks) for t in rp.tasks]
    req0, req1, groups = requirements(plan, base, seq)
    layout = plan_layout(plan)
    assert len(groups.before) or not case.endswith("_reuse"), "expected groups of buffers sharing bytes"
    grouped_order = hb_order(layout, req0, groups)
    dense0, dense1 = groups.dense(len(seq))  # the groups spelled out, task by task
    req0 = [a + b for a, b in zip(req0, dense0)]
    req1 = [a + b for a, b in zip(req1, dense1)]
    assert hb_order(layout, req0) == grouped_order
    want = slow_planner.derive_waits(layout, req0, req1, hb_order(layout, req0))
    got = [[(base[w.rank] + w.counter, w.lag) for w in t.waits] for rp in plan.ranks for t in rp.tasks]
    assert all(t.signal == t.id for rp in plan.ranks for t in rp.tasks)
    diff = [g for g in range(len(want)) if got[g] != want[g]]
    assert not diff, f"{len(diff)} tasks differ; task {diff[0] if diff else 0}: {got[diff[0]]} vs {want[diff[0]]}"
    assert sum(map(len, want)) > 5, "expected a plan with waits"


@pytest.mark.parametrize("case", sorted(CASES))
def test_clocks_equal_the_per_task_clocks(case: str) -> None:
    plan = _plan(case)
    base = task_bases(plan)
    layout = plan_layout(plan)
    n = len(layout.proc)
    last = verify_module._counters(plan, base, layout.proc, layout.index)
    edges = verify_module._wait_edges(plan, base, last, verify_module._flat_waits(plan, base))
    level = verify_module._levels(plan, base, layout.lists, edges, n)
    got = verify_module._clocks(level, layout.proc, layout.index, layout.lists, edges, n)
    rows = [[] for _ in range(n)]
    for c, s, lag in zip(edges.dst.tolist(), edges.src.tolist(), edges.lag.tolist()):
        rows[c].append((s, lag))
    order = [int(c) for c in np.argsort(level, kind="stable")]
    want = slow_planner.clocks(order, layout.proc, layout.index, layout.lists, rows, n)
    for it in (0, 1):
        bad = np.argwhere(got[it] != want[it])
        assert not len(bad), f"iteration {it}: {len(bad)} entries differ, first (task, processor) {bad[0].tolist()}"
    verify_plan(plan)

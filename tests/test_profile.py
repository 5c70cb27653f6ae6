"""Timelines: the cost model's estimate obeys the plan (program order, waits), the Chrome trace has
one event per task and iteration on its processor's track, raw kernel stamps are checked, and
``megaloop profile`` writes the trace and the PNG without a GPU."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

import megaloop as ml
from megaloop.cli import main
from megaloop.models import LlamaConfig, build_llama
from megaloop.plan import make_plan
from megaloop.runtime import trace

CFG = LlamaConfig(hidden=32, heads=4, kv_heads=2, intermediate=48, layers=1, max_seq=8, vocab=40)


@pytest.fixture(scope="module")
def plan():
    g = build_llama(CFG, 1, 3)
    apart = ml.FuseOptions(off=("rmsnorm_linear", "swiglu_linear"))  # (its norms tasks of their own)
    return make_plan(g, processors=5, tiles={"matmul": {"block_m": 2, "block_n": 8}}, fusion=apart)


def test_estimate_respects_program_order_and_waits(plan) -> None:
    tl = trace.estimated_timeline(plan, iterations=2)
    rp, times = tl.rp, tl.times_ns
    assert times.shape == (2, len(rp.tasks), 2)
    cost = np.array([t.cost_ns for t in rp.tasks])
    np.testing.assert_allclose(times[0, :, 1] - times[0, :, 0], cost)
    for lst in rp.processors:
        for a, b in itertools.pairwise(lst):
            assert times[0, b, 0] >= times[0, a, 1] - 1e-9, f"{rp.task_name(rp.tasks[b])} overlaps its predecessor"
    last_signal: dict[int, float] = {}
    for t in rp.tasks:
        last_signal[t.signal] = max(last_signal.get(t.signal, 0.0), times[0, t.id, 1])
    for t in rp.tasks:
        for w in t.waits:
            if w.lag == 0:
                assert times[0, t.id, 0] >= last_signal[w.counter] - 1e-9, f"{rp.task_name(t)} starts before its wait"
    assert times[1, :, 0].min() >= times[0, :, 1].max() - 1e-9  # iterations back to back


def test_chrome_trace_has_every_task_on_its_processor(plan, tmp_path) -> None:
    tl = trace.estimated_timeline(plan, iterations=2)
    data = json.loads(trace.save_chrome_trace(tl, tmp_path / "t.json").read_text())
    spans = [e for e in data["traceEvents"] if e["ph"] == "X"]
    rp = tl.rp
    assert len(spans) == 2 * len(rp.tasks)
    where = {t: p for p, lst in enumerate(rp.processors) for t in lst}
    for e in spans:
        t = rp.tasks[e["args"]["task"]]
        assert e["tid"] == where[t.id] and e["name"] == rp.task_name(t) and e["cat"] == rp.ops[t.op].op
        assert e["ts"] == pytest.approx(tl.times_ns[e["args"]["iteration"], t.id, 0] / 1e3)
    names = {e["args"]["name"] for e in data["traceEvents"] if e["name"] == "thread_name"}
    assert names == {f"processor {p}" for p in range(len(rp.processors))}
    assert "estimated" in data["otherData"]["source"]
    summary = trace.format_summary(tl)
    assert "matmul" in summary and "estimated" in summary


def test_kernel_stamps_are_checked(plan) -> None:
    n = len(plan.ranks[0].tasks)
    rng = np.random.default_rng(0)
    start = 10**12 + rng.integers(0, 10**6, (2, n))
    stamps = np.stack([start, start + rng.integers(1, 1000, (2, n))], axis=-1).astype(np.uint64)
    tl = trace.measured_timeline(plan, stamps, "measured on a test")
    assert tl.times_ns.min() == 0 and tl.span_ns == float(stamps[..., 1].max() - stamps[..., 0].min())
    missing = stamps.copy()
    missing[1, 3] = 0
    with pytest.raises(trace.TraceError, match=r"no timestamps for iteration 1"):
        trace.measured_timeline(plan, missing, "x")
    backwards = stamps.copy()
    backwards[0, 2, 1] = backwards[0, 2, 0] - 1
    with pytest.raises(trace.TraceError, match=r"ends before it starts in iteration 0"):
        trace.measured_timeline(plan, backwards, "x")
    with pytest.raises(trace.TraceError, match=r"expected \(iterations, \d+, 2\)"):
        trace.measured_timeline(plan, stamps[:, :-1], "x")


def simulated(plan, gaps: np.ndarray, iterations: int = 2) -> np.ndarray:
    """A run of the plan as a loop kernel would make it: each task starts gaps[task] ns (gaps[k, task]
    for a 2-D array) after the last of its predecessors ends (the task before it on its processor, the
    last iteration's last task for the first one, and every signaller of the counters it waits on), and
    takes its estimated cost."""
    gaps = np.broadcast_to(gaps, (iterations, len(plan.ranks[0].tasks)))
    rp = plan.ranks[0]
    signalers: dict[int, list[int]] = {}
    for t in rp.tasks:
        signalers.setdefault(t.signal, []).append(t.id)
    times = np.full((iterations, len(rp.tasks), 2), np.nan)
    progress = True
    while progress:
        progress = False
        for k in range(iterations):
            for lst in rp.processors:
                for i, tid in enumerate(lst):
                    if not np.isnan(times[k, tid, 0]):
                        continue
                    ready = [times[k, lst[i - 1], 1]] if i else ([times[k - 1, lst[-1], 1]] if k else [0.0])
                    for w in rp.tasks[tid].waits:
                        if w.lag <= k:
                            ready += [times[k - w.lag, p, 1] for p in signalers[w.counter]]
                    if np.isnan(ready).any():
                        break
                    start = max(ready) + gaps[k, tid]
                    times[k, tid] = start, start + rp.tasks[tid].cost_ns
                    progress = True
    assert not np.isnan(times).any()
    return times


def test_the_critical_path_is_the_chain_that_ended_the_iteration(plan) -> None:
    """On a run with known handoffs (each task starts its gap after its last predecessor ends), the path
    ends at the iteration's last task, each step's predecessor is the latest-ending of its waits and its
    processor's previous task, its handoff is that task's gap, and the steps tile the time from the first
    step's start to the iteration's end. A task given a long gap is on it, with that gap."""
    rp = plan.ranks[0]
    rng = np.random.default_rng(3)
    gaps = rng.uniform(300, 2000, len(rp.tasks))
    slow = next(t.id for t in rp.tasks if rp.ops[t.op].op == "rmsnorm")
    gaps[slow] = 50_000.0  # 50 us: on the critical path whatever else
    times = simulated(plan, gaps)
    tl = trace.Timeline(plan, 0, times - times[..., 0].min(), "simulated")
    path = trace.critical_path(tl)
    assert path[-1].task == int(np.argmax(tl.times_ns[1, :, 1])) and all(st.iteration == 1 for st in path)
    for a, b in itertools.pairwise(path):
        assert b.ready_ns == pytest.approx(a.end_ns) and b.handoff_ns == pytest.approx(gaps[b.task])
    span = path[-1].end_ns - path[0].start_ns
    assert sum(st.end_ns - st.start_ns for st in path) + sum(st.handoff_ns for st in path[1:]) == pytest.approx(span)
    step = next(st for st in path if st.task == slow)
    assert step.handoff_ns == pytest.approx(50_000.0)
    text = trace.format_critical_path(tl)
    assert rp.ops[rp.tasks[slow].op].name in text and "handoffs" in text
    with pytest.raises(trace.TraceError, match="iteration 5"):
        trace.critical_path(tl, 5)


def test_the_path_starts_where_the_previous_iteration_held_it(plan) -> None:
    """No barrier between iterations: a processor still on the last iteration's task holds its first
    task of this one. The path starts there (after "order", its handoff the gap), not at a producer of
    this iteration that ended earlier (a review found the walk going through one)."""
    rp = plan.ranks[0]
    gaps = np.full((2, len(rp.tasks)), 500.0)
    late = next(lst for lst in rp.processors if len(lst) > 1)
    gaps[0, late[-1]] = 100_000.0  # this processor ends iteration 0 100 us late
    times = simulated(plan, gaps)
    tl = trace.Timeline(plan, 0, times - times[..., 0].min(), "simulated")
    path = trace.critical_path(tl)
    first = path[0]
    assert first.task == late[0] and first.after == "order", (rp.task_name(rp.tasks[first.task]), first.after)
    assert first.ready_ns == pytest.approx(tl.times_ns[0, late[-1], 1]) and first.handoff_ns == pytest.approx(500.0)


def test_a_generators_path_starts_at_a_wait_on_the_last_iteration(tmp_path) -> None:
    """A self-feeding generator's tasks wait (lag 1) on the previous iteration's (the token, the position,
    the caches). With one such producer on another processor 100 us late, iteration 2's path starts at
    its consumer, after that wait. The table's columns add up to its sums (tasks, handoffs and their
    count), which tile the time from that producer's end to the iteration's end."""
    from megaloop.models import build_llama_generator

    cfg = LlamaConfig(hidden=32, heads=4, kv_heads=2, intermediate=48, layers=1, max_seq=16, vocab=40)
    gen = make_plan(build_llama_generator(cfg, 1, argmax_splits=None), processors=4)
    rp = gen.ranks[0]
    where = {t: p for p, lst in enumerate(rp.processors) for t in lst}
    signalers: dict[int, list[int]] = {}
    for t in rp.tasks:
        signalers.setdefault(t.signal, []).append(t.id)
    consumer, producer = next(  # the model's first task, waiting for the token (the history's cast waits too)
        (t.id, q)
        for t in rp.tasks
        if rp.ops[t.op].op == "embedding"
        for w in t.waits
        if w.lag == 1
        for q in signalers[w.counter]
        if where[q] != where[t.id]
    )
    gaps = np.full((3, len(rp.tasks)), 400.0)
    gaps[1, producer] = 100_000.0
    times = simulated(gen, gaps, iterations=3)
    tl = trace.Timeline(gen, 0, times - times[..., 0].min(), "simulated")
    path = trace.critical_path(tl, 2)
    assert all(st.iteration == 2 for st in path) and path[-1].end_ns == pytest.approx(tl.times_ns[2, :, 1].max())
    first = path[0]
    assert (first.task, first.after) == (consumer, "wait"), rp.task_name(rp.tasks[first.task])
    assert first.ready_ns == pytest.approx(tl.times_ns[1, producer, 1])
    text = trace.format_critical_path(tl, 2)
    rows = [line.split() for line in text.splitlines()[2:-1]]
    total = text.splitlines()[-1].split()  # "tasks X us, handoffs Y us (N of them)"
    assert abs(sum(float(r[3]) for r in rows) - float(total[1])) < 0.01 * len(rows)
    assert abs(sum(float(r[4]) for r in rows) - float(total[4])) < 0.01 * len(rows)
    assert int(total[6].lstrip("(")) == len(path)  # every step's, the first one's from iteration 1
    span = path[-1].end_ns - first.ready_ns
    assert sum(st.end_ns - st.start_ns + st.handoff_ns for st in path) == pytest.approx(span)


def test_profile_command_writes_trace_and_png(tmp_path, capsys) -> None:
    out = tmp_path / "prof"
    assert main(["profile", "--preset", "tiny", "--estimate", "--iterations", "2", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "estimated by the cost model" in text and "trace.json" in text
    assert "critical path of iteration 1" in text and "handoffs" in text
    assert json.loads((out / "trace.json").read_text())["traceEvents"]
    assert (out / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

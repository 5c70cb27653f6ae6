"""Timelines: the cost model's estimate obeys the plan (program order, waits), the Chrome trace has
one event per task and iteration on its processor's track, raw kernel stamps are checked, and
``megaloop profile`` writes the trace and the PNG without a GPU."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from megaloop.cli import main
from megaloop.models import LlamaConfig, build_llama
from megaloop.plan import make_plan
from megaloop.runtime import trace

CFG = LlamaConfig(hidden=32, heads=4, kv_heads=2, intermediate=48, layers=1, max_seq=8, vocab=40)


@pytest.fixture(scope="module")
def plan():
    return make_plan(build_llama(CFG, 1, 3), processors=5, tiles={"matmul": {"block_m": 2, "block_n": 8}})


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


def test_profile_command_writes_trace_and_png(tmp_path, capsys) -> None:
    out = tmp_path / "prof"
    assert main(["profile", "--preset", "tiny", "--estimate", "--iterations", "2", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "estimated by the cost model" in text and "trace.json" in text
    assert json.loads((out / "trace.json").read_text())["traceEvents"]
    assert (out / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

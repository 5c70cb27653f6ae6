"""The loop's own cost on a GPU (KernelOptions task_records, completion_word, doorbell_reads,
round_trip_stamps; docs/runtime.md, "The loop's own cost"): each setting gives the reference's
results, 100 runs bitwise identical, a watchdog that names the stuck wait, program switches, and
stamps in the order the loop makes them. `scripts/gpu_check.sh loopcost` runs these and the A/B."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import megaloop as ml
import megaloop.frontend.ops as ops
from megaloop.models import LlamaConfig, build_llama, random_parameters
from megaloop.plan import KernelOptions, make_plan
from megaloop.plan.cache import make_programs
from megaloop.runtime.device import gpus
from tests.helpers import assert_watchdog_names_the_stuck_wait

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpus()[0], reason="no GPU: " + gpus()[1])]

SETTINGS = {
    "records": KernelOptions(task_records=1),
    "completion": KernelOptions(completion_word=1),
    "doorbell4": KernelOptions(doorbell_reads=4),
    "all": KernelOptions(task_records=1, completion_word=1, doorbell_reads=4, round_trip_stamps=1),
}
SMALL = LlamaConfig(hidden=128, heads=4, kv_heads=2, intermediate=256, layers=2, max_seq=32, vocab=500)


def kernel(plan, params=None, state=None, **kw):
    from megaloop.runtime.loop import LoopKernel

    return LoopKernel(plan, params, state, **kw)


def _close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    g64, w64 = got.astype(np.float64), want.astype(np.float64)
    rel = np.linalg.norm(g64 - w64) / max(np.linalg.norm(w64), 1e-30)
    assert rel < 1e-2, f"{what}: relative L2 difference {rel:.2e} between GPU and CPU reference"


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_llama_prefill_and_decode_match_the_reference(setting: str) -> None:
    params = random_parameters(SMALL, seed=3)
    rng = np.random.default_rng(4)
    prefill, decode = build_llama(SMALL, 2, 12, "prefill"), build_llama(SMALL, 2, 1, "decode")
    feeds = {"tokens": rng.integers(0, 500, (2, 12)), "positions": np.tile(np.arange(12), (2, 1))}
    ref = ml.evaluate(prefill, feeds, params)
    with kernel(make_plan(prefill, processors=132, options=SETTINGS[setting]), params) as k:
        out = k.run(feeds)
        state = k.state()
    _close(out["logits"], ref.outputs["logits"], f"{setting}: prefill logits")
    ref_state = ref.state
    with kernel(make_plan(decode, processors=132, options=SETTINGS[setting]), params, state) as k:
        for step in range(3):
            f = {"tokens": rng.integers(0, 500, (2, 1)), "positions": np.full((2, 1), 12 + step)}
            out = k.run(f)
            r = ml.evaluate(decode, f, params, ref_state)
            ref_state = r.state
            _close(out["logits"], r.outputs["logits"], f"{setting}: decode step {step}")


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("processors", [1, 5, 132])
def test_state_feedback_over_grants_of_every_size(setting: str, processors: int) -> None:
    """Iterations in one grant, one a grant, and grants asked for before the last one finished: the
    arrival counter and the records' wrap from the last task to the next iteration's first."""
    g = ml.Graph("loop")
    tok = g.state("token", (2,), ml.int64, init=[1, 3])
    table = g.parameter("table", (6, 8), ml.float32)
    g.assign(tok, ml.argmax(ml.embedding(table, tok) @ table.T, axis=-1))
    g.output("tok", tok + 0)
    params = {"table": np.random.default_rng(0).standard_normal((6, 8))}
    with kernel(make_plan(g, processors=processors, options=SETTINGS[setting]), params) as k:
        k.run({}, iterations=50)
        for _ in range(7):
            k.run({}, iterations=1)
        k.start(3)
        k.start(4)  # a second grant while the first runs
        k.wait()
        got = k.state()["token"]
    want = ml.evaluate(g, {}, params, iterations=64).state["token"]
    assert np.array_equal(got, want), f"{setting}, {processors} processors: token {got}, want {want}"


def test_hundred_runs_are_bitwise_identical_with_every_option() -> None:
    g = build_llama(SMALL, 1, 8)
    feeds = {"tokens": np.arange(8)[None], "positions": np.arange(8)[None]}
    with kernel(make_plan(g, processors=132, options=SETTINGS["all"]), random_parameters(SMALL, seed=1)) as k:
        first = k.run(feeds)["logits"].tobytes()
        for run in range(99):
            assert k.run(feeds)["logits"].tobytes() == first, f"run {run + 1} differs from the first"


def test_watchdog_names_the_stuck_wait_with_every_option() -> None:
    """The stuck wait's waits are read from the task's record (task_records): the record is built from
    the edited table, so the edit reaches the kernel and the report names it."""
    assert_watchdog_names_the_stuck_wait(SETTINGS["all"])


def _counting(name: str, rows: int) -> ml.Graph:
    g = ml.Graph(name)
    acc = g.state("acc", (4, 8), "int64", init=np.arange(32, dtype=np.int64).reshape(4, 8))
    steps = g.state("steps", (1, 1), "int64")
    y = acc[:rows] * 3 + steps
    g.assign(acc, y if rows == 4 else ops.concat([y, acc[rows:]], 0))
    g.assign(steps, steps + rows)
    g.output("y", y * 1)
    return g


def test_program_switches_refill_the_records() -> None:
    from megaloop.runtime.loop import LoopKernel

    graphs = {"four": _counting("four", 4), "one": _counting("one", 1)}
    gpu = gpus()[0][0]
    plan = make_programs(graphs, processors=min(gpu.sm_count, 8), arch=gpu.plan_arch, options=SETTINGS["all"])
    state = None
    with LoopKernel(plan) as k:
        for step, (name, n) in enumerate([("one", 2), ("four", 1), ("four", 3), ("one", 1), ("four", 2)]):
            want = ml.evaluate(graphs[name], {}, {}, state, iterations=n)
            state = want.state
            out = k.run(iterations=n, program=name)
            assert np.array_equal(out["y"], want.outputs["y"]), f"run {step} ({name} x{n}): y {out['y']}"


@pytest.mark.parametrize("doorbell_reads", [0, 4])
def test_round_trip_stamps_come_in_the_loops_order(doorbell_reads: int) -> None:
    from megaloop.runtime.loop import HOST_NS
    from megaloop.runtime.stamps import STAMP_FIELDS

    f = {n: i for i, n in enumerate(STAMP_FIELDS)}
    cfg = LlamaConfig(hidden=64, heads=4, kv_heads=2, intermediate=96, layers=1, max_seq=8, vocab=50)
    options = KernelOptions(round_trip_stamps=1, doorbell_reads=doorbell_reads, completion_word=1)
    plan = make_plan(build_llama(cfg, 1, 1), processors=16, options=options)
    feeds = {"tokens": [[3]], "positions": [[0]]}
    with kernel(plan, random_parameters(cfg), profile_iterations=5) as k:
        for _ in range(5):
            k.control[HOST_NS] = 12345
            k.run(feeds)
        s = k.grant_ns().astype(np.int64)  # (iteration, block, field)
        tasks = k.profile_ns().astype(np.int64)
    b0 = s[:, 0]
    assert (b0[:, f["issued"]] > 0).all() and (b0[:, f["host"]] == 12345).all(), b0
    order = ["issued", "seen", "published", "done", "reported"]
    for a, b in itertools.pairwise(order):
        assert (b0[:, f[b]] >= b0[:, f[a]]).all(), f"block 0: {a} after {b}: {b0}"
    others = s[:, 1:, f["seen"]]
    assert (others >= b0[:, None, f["published"]]).all(), "a block saw its grant before block 0 published it"
    assert (s[:, :, f["reported"]] >= s[:, :, f["done"]]).all()
    ends = tasks[:, :, 1].max(1)
    assert (s[:, :, f["done"]].max(1) >= ends).all(), "an iteration ended before its last task"

"""Several ranks of a plan on ONE GPU, its SMs split between them (LoopKernelGroup(plan,
devices=[0] * world), each rank a loop kernel of processors = SMs // world), exchanging through the
GPU's own memory (skipped without a GPU): every collective (all_reduce one-shot, two-step, pushed and
pulled; all_gather; reduce_scatter; send/recv pulled and pushed) on 2, 3 and 4 ranks bitwise against
the CPU reference, a state passed around the ring for 50 iterations, the TP MLP 100 runs bitwise,
ml.parallelize's TP2, PP2 and DP2 of a Llama against the single-device reference, a rank that never
sends named by its peer's watchdog, and processors that do not fit refused at once. The host side of
the same paths runs in CI: tests/test_runtime_fake_gpu.py."""

from __future__ import annotations

import time

import numpy as np
import pytest

import megaloop as ml
from megaloop.codegen import generate
from megaloop.models import LlamaConfig, build_llama, random_parameters
from megaloop.plan import make_plan
from megaloop.reference.interpreter import run_plan
from megaloop.runtime.compile import compile_many
from megaloop.runtime.device import gpus
from tests.helpers import tp_mlp
from tests.test_codegen import packed_exchange_graphs
from tests.test_push_send_recv import chain

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpus()[0], reason="no GPU: " + gpus()[1])]

PULL = {"all_reduce": {"push": 0}}
PUSH = {"all_reduce": {"push": 1}, "recv": {"push": 1}, "send": {"elements": 64}}
TP_LLAMA = LlamaConfig(hidden=256, heads=8, kv_heads=2, intermediate=688, layers=2, max_seq=64, vocab=1000)


def sms() -> int:
    return gpus()[0][0].sm_count


def one_gpu(plan, params=None, state=None, **kw):
    from megaloop.runtime.group import LoopKernelGroup

    return LoopKernelGroup(plan, params, state, devices=[0] * plan.world_size, **kw)


def every_collective(world: int) -> list[ml.Graph]:
    """Every exchange once, in layouts the element-by-element paths take: all_reduce one-shot (sum,
    and max of int32), two-step (reduce_scatter + all_gather), all_gather of a transposed view,
    reduce_scatter, and send/recv around the ring."""

    def build(g: ml.Graph) -> None:
        r, n = g.rank, g.world_size
        x = g.input("x", (n * 4, 6), ml.bfloat16)
        g.output("a", ml.all_reduce(x * 2.0, algorithm="one_shot"))
        g.output("t", ml.all_reduce(g.input("f", (n * 6, 10), ml.float32), algorithm="two_step"))
        g.output("m", ml.all_reduce(g.input("i", (3, 5), ml.int32), op="max"))
        g.output("b", ml.all_gather(x[:2].T, axis=0))
        c = ml.reduce_scatter(x, axis=0)
        g.output("c", c)
        ml.send(c * 3.0, (r + 1) % n)
        g.output("r", ml.recv(g, (r - 1) % n, c.shape, ml.bfloat16))

    return ml.spmd(build, world)


CASES = [(b, w, m) for b in ("every", "packed") for w in (2, 3, 4) for m in ("pull", "push")]
BUILDERS = {"every": every_collective, "packed": packed_exchange_graphs}


def case_plan(builder: str, world: int, mode: str):
    graphs = BUILDERS[builder](world)
    return graphs, make_plan(graphs, processors=sms() // world, tiles=PULL if mode == "pull" else PUSH)


@pytest.fixture(scope="module", autouse=True)
def compiled() -> None:
    """Every kernel of the module compiled at once, in parallel (a group compiles only its own)."""
    plans = [case_plan(*c)[1] for c in CASES]
    plans += [make_plan(ml.spmd(chain, w), processors=sms() // w, tiles=t) for w in (2, 4) for t in (PULL, PUSH)]
    plans += [make_plan(tp_mlp(2, 8, 256, 1024, 0.05, 0)[0], processors=sms() // 2)]
    plans += [make_plan(split_llama(s, t).graphs, processors=sms() // 2) for _, s in SPLITS for t in (12, 1)]
    compile_many([generate(p, r).source for p in plans for r in range(p.world_size)], gpus()[0][0].arch)


def feeds_for(graphs, rng) -> list[dict]:
    return [
        {
            n: (rng.integers(-50, 50, t.shape) if t.dtype.is_int else rng.standard_normal(t.shape))
            for n, t in g.inputs.items()
        }
        for g in graphs
    ]


def bitwise(got: list[dict], ref, what: str) -> None:
    for r, want in enumerate(ref):
        for name, value in want.outputs.items():
            assert got[r][name].tobytes() == value.tobytes(), f"{what}: rank {r} {name} differs from the reference"


@pytest.mark.parametrize(("builder", "world", "mode"), CASES)
def test_every_collective_on_ranks_sharing_one_gpu(builder: str, world: int, mode: str) -> None:
    graphs, plan = case_plan(builder, world, mode)
    rng = np.random.default_rng(world)
    feeds = feeds_for(graphs, rng)
    ref = ml.evaluate(graphs, feeds)
    if world == 2:  # the plan interpreter on this very plan agrees with the graph evaluation
        bitwise([e.outputs for e in run_plan(plan, feeds, seed=3)], ref, "run_plan")
    with one_gpu(plan) as gr:
        for _ in range(3):  # the same inputs again: later iterations must not read stale peer data
            bitwise(gr.run(feeds), ref, f"{builder} x{world} {mode}")
        for _ in range(3):
            fresh = feeds_for(graphs, rng)
            bitwise(gr.run(fresh, iterations=2), ml.evaluate(graphs, fresh), f"{builder} x{world} {mode} fresh")


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_a_state_passed_around_the_ring_for_fifty_iterations(world: int, mode: str) -> None:
    """Each iteration's data differs, so a send overwriting what its peer has not read yet shows."""
    graphs = ml.spmd(chain, world)
    ref = ml.evaluate(graphs, [{}] * world, iterations=50)
    plan = make_plan(graphs, processors=sms() // world, tiles=PULL if mode == "pull" else PUSH)
    with one_gpu(plan) as gr:
        gr.run([{}] * world, iterations=50)
        for r, st in enumerate(gr.state()):
            assert st["s"].tobytes() == ref[r].state["s"].tobytes(), f"{mode} chain x{world}: rank {r}"


@pytest.mark.parametrize(("dtype", "n"), [(ml.int64, 70001), (ml.float32, 2_000_003)])
def test_pushed_all_reduce_lines_and_chunks_on_one_gpu(dtype, n: int) -> None:
    """Both pushed tile kinds (LL lines for int64's small tiles, bulk chunks for float32's)."""
    graphs = ml.spmd(lambda g: g.output("s", ml.all_reduce(g.input("x", (n,), dtype))), 2)
    rng = np.random.default_rng(n)
    with one_gpu(make_plan(graphs, processors=sms() // 2)) as gr:
        for _ in range(3):
            feeds = feeds_for(graphs, rng)
            bitwise(gr.run(feeds, iterations=2), ml.evaluate(graphs, feeds), f"{dtype.short} {n}")


def test_tensor_parallel_mlp_on_one_gpu_hundred_runs_bitwise() -> None:
    graphs, x, params = tp_mlp(2, tokens=8, hidden=256, ffn=1024, scale=0.05, seed=0)
    ref = ml.evaluate(graphs, [{"x": x}] * 2, params)
    with one_gpu(make_plan(graphs, processors=sms() // 2), params) as gr:
        first = gr.run([{"x": x}] * 2)
        w = ref[0].outputs["y"].astype(np.float64)
        d = np.abs(first[0]["y"].astype(np.float64) - w).max()
        assert d <= 0.02 * np.abs(w).max(), f"TP MLP: max difference {d:.3e} from the CPU reference"
        assert first[0]["y"].tobytes() == first[1]["y"].tobytes(), "ranks disagree on the all-reduced result"
        start = time.perf_counter()
        for _ in range(100):
            again = gr.run([{"x": x}] * 2)
            assert again[0]["y"].tobytes() == first[0]["y"].tobytes() == again[1]["y"].tobytes()
        print(f"TP MLP on one GPU, 2 ranks of {sms() // 2} SMs: {(time.perf_counter() - start) * 1e4:.1f} us a run()")


def close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    g64, w64 = got.astype(np.float64), want.astype(np.float64)
    rel = np.linalg.norm(g64 - w64) / max(np.linalg.norm(w64), 1e-30)
    assert rel < 1e-2, f"{what}: relative L2 difference {rel:.2e} between GPU and CPU reference"


SPLITS = [("tp2", "tp"), ("pp2", "pp"), ("dp2", "dp")]


def split_llama(strategy: str, tokens: int) -> ml.Partition:
    """A 2-sequence Llama step split over 2 ranks by ml.parallelize."""
    return ml.parallelize(build_llama(TP_LLAMA, 2, tokens), 2, strategy)


@pytest.mark.parametrize(("label", "strategy"), SPLITS, ids=[s[0] for s in SPLITS])
def test_split_llama_on_one_gpu_against_the_reference(label: str, strategy: str) -> None:
    """ml.parallelize's TP2, PP2 and DP2 of a Llama on one GPU (two ranks of half its SMs): a 12-token
    prefill, then 3 decode steps on the caches the prefill left (handed from one partition to the
    other through the host), against the single-device model on the CPU reference; the decode step
    100 times bitwise the same."""
    full = random_parameters(TP_LLAMA, seed=3)
    rng = np.random.default_rng(4)
    prefill, decode = split_llama(strategy, 12), split_llama(strategy, 1)
    feed = {"tokens": rng.integers(0, 1000, (2, 12)), "positions": np.tile(np.arange(12), (2, 1))}
    ref = ml.evaluate(prefill.original, feed, full)
    plan = make_plan(prefill.graphs, processors=sms() // 2)
    with one_gpu(plan, prefill.shard_parameters(full)) as gr:
        out = prefill.gather_outputs(gr.run(prefill.shard_inputs(feed)))
        state = prefill.gather_state(gr.state())
    close(out["logits"], ref.outputs["logits"], f"{label} prefill")
    for name, want in ref.state.items():
        close(state[name], want, f"{label} prefill {name}")
    ref_state = ref.state
    plan = make_plan(decode.graphs, processors=sms() // 2)
    with one_gpu(plan, decode.shard_parameters(full), decode.shard_state(state)) as gr:
        for step in range(3):
            f = {"tokens": rng.integers(0, 1000, (2, 1)), "positions": np.array([[12 + step], [12 + step]])}
            raw = gr.run(decode.shard_inputs(f))
            want = ml.evaluate(decode.original, f, full, ref_state)
            ref_state = want.state
            close(decode.gather_outputs(raw)["logits"], want.outputs["logits"], f"{label} decode step {step}")
        first = decode.gather_outputs(raw)["logits"].tobytes()
        start = time.perf_counter()
        for _ in range(100):  # the same tokens at the same positions: the caches rewritten with the same values
            assert decode.gather_outputs(gr.run(decode.shard_inputs(f)))["logits"].tobytes() == first
        print(f"{label} Llama decode on one GPU: {(time.perf_counter() - start) * 1e4:.1f} us a run()")


def ring(g: ml.Graph) -> None:
    r, n = g.rank, g.world_size
    y = g.input("x", (6, 250), ml.float32) * 0.5  # exact: the check after the watchdog is bitwise
    ml.send(y * 2.0, (r + 1) % n)
    g.output("z", ml.recv(g, (r - 1) % n, (6, 250), ml.float32) + y)


@pytest.mark.parametrize(
    ("build", "tiles", "named"),
    [
        (ring, PULL, r"counter \d+ of rank 1 \(its loop kernel shares this GPU: is it running\?\)"),
        (ring, PUSH, r"counter \d+ of rank 1 \(its loop kernel shares this GPU: is it running\?\)"),
        (
            lambda g: g.output("y", ml.all_reduce(g.input("x", (64,), ml.float32) * 2.0)),
            {"all_reduce": {"push": 1}},
            r"the tile rank 1 pushes to it never arrived \(its loop kernel shares this GPU",
        ),
    ],
    ids=["recv-pulled", "recv-pushed", "all_reduce-pushed"],
)
def test_a_rank_that_never_sends_is_named_by_its_peers_watchdog(build, tiles, named: str) -> None:
    """Rank 1's kernel leaves after a first run; rank 0's next run waits on what rank 1 would have
    sent: its watchdog must name rank 1, and the GPU runs a new group afterwards."""
    from megaloop.runtime.loop import LoopKernelError

    graphs = ml.spmd(build, 2)
    feeds = feeds_for(graphs, np.random.default_rng(0))
    plan = make_plan(graphs, processors=sms() // 2, tiles=tiles)
    with one_gpu(plan, timeout_s=1.0) as gr:
        gr.run(feeds)
        r0, r1 = gr.kernels
        r1._halt()
        r0._stage_inputs(feeds[0], 1)
        r0.start(1)
        start = time.monotonic()
        with pytest.raises(LoopKernelError, match=r"watchdog: rank 0 .*" + named):
            gr.wait()
        assert time.monotonic() - start < 10, "the watchdog took too long"
    with one_gpu(plan) as gr:
        bitwise(gr.run(feeds), ml.evaluate(graphs, feeds), "after the watchdog")


def test_processors_that_cannot_all_be_resident_are_refused_at_once() -> None:
    from megaloop.runtime.resident import ResidencyError

    graphs = ml.spmd(lambda g: g.output("y", ml.all_reduce(g.input("x", (64,), ml.float32))), 2)
    plan = make_plan(graphs, processors=sms() // 2 + 1)
    start = time.monotonic()
    with pytest.raises(ResidencyError, match=rf"{sms()} SMs; make the plan with processors <= {sms() // 2}"):
        one_gpu(plan)
    assert time.monotonic() - start < 5

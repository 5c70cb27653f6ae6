"""Several GPUs driven from one process (skipped without two): every exchange and a tensor-parallel
MLP against the CPU reference, bitwise reproducibility across runs and ranks, and a stopped peer
reported by name. Then one process per GPU under torchrun: the TP MLP with each peer memory, and a
rank killed between runs named by the survivor's watchdog. scripts/gpu_check.sh runs these on the
two-GPU machine."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import megaloop as ml
from megaloop.plan import make_plan
from megaloop.runtime.device import gpus
from tests.helpers import tp_mlp
from tests.test_codegen import exchange_graphs, packed_exchange_graphs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(len(gpus()[0]) < 2, reason="needs 2 GPUs: " + (gpus()[1] or f"{len(gpus()[0])} found")),
]


def group(plan, params=None, state=None, **kw):
    from megaloop.runtime.group import LoopKernelGroup

    return LoopKernelGroup(plan, params, state, **kw)


def feeds_for(graphs, rng) -> list[dict]:
    return [
        {
            n: (rng.integers(-50, 50, t.shape) if t.dtype.is_int else rng.standard_normal(t.shape))
            for n, t in g.inputs.items()
        }
        for g in graphs
    ]


def same(got: list[dict], ref, what: str) -> None:
    """Exchanges are bitwise the reference (sums of two in float32, copies); the matmul within 1%."""
    for r in range(2):
        for name, want in ref[r].outputs.items():
            if name == "y":
                w = want.astype(np.float64)
                d = np.abs(got[r][name].astype(np.float64) - w).max()
                assert d <= 0.01 * np.abs(w).max() + 1e-3, f"{what} rank {r} y: max difference {d:.3e}"
            else:
                assert got[r][name].tobytes() == want.tobytes(), f"{what} rank {r} {name}: differs from the reference"


@pytest.mark.parametrize("processors", [4, 132])
@pytest.mark.parametrize("build", [exchange_graphs, packed_exchange_graphs])
def test_every_exchange_matches_the_reference(processors: int, build) -> None:
    graphs = build(2)
    rng = np.random.default_rng(processors)
    feeds = feeds_for(graphs, rng)
    ref = ml.evaluate(graphs, feeds)
    with group(make_plan(graphs, processors=processors)) as gr:
        for _ in range(3):  # the same inputs again: later iterations must not read stale peer data
            same(gr.run(feeds), ref, "same inputs")
        feeds2 = feeds_for(graphs, rng)
        same(gr.run(feeds2), ml.evaluate(graphs, feeds2), "fresh inputs")


@pytest.mark.parametrize(
    ("dtype", "n", "op"), [(ml.float32, 2_000_003, "sum"), (ml.int64, 70001, "max"), (ml.bfloat16, 3 << 20, "sum")]
)
def test_pushed_all_reduce_in_lines_and_in_chunks(dtype, n: int, op: str) -> None:
    """Pushed tiles of both kinds (megaloop/exchange.cuh), bitwise the reference: LL lines (int64: 1024
    elements a tile) and bulk chunks of 32 KB, two a tile, with a ragged last tile (float32: 60 KB tiles)
    and without (bfloat16: 48 KB tiles)."""
    from megaloop.plan.rendezvous import inboxes

    graphs = ml.spmd(lambda g: g.output("s", ml.all_reduce(g.input("x", (n,), dtype), op)), 2)
    plan = make_plan(graphs, processors=132)
    (box,) = inboxes(plan, 0).values()
    assert box.ll == (dtype == ml.int64)
    rng = np.random.default_rng(n)
    with group(plan) as gr:
        for _ in range(3):  # fresh data each run: a stale slot would show
            feeds = feeds_for(graphs, rng)
            same(gr.run(feeds, iterations=2), ml.evaluate(graphs, feeds), f"{dtype.short} {op} {n}")


def test_pushed_send_recv_matches_the_reference() -> None:
    """The send's tiles store into the peer's recv output and release their counters there
    (tests/test_push_send_recv.py): a ring with fresh inputs each run, then a state passed around the ring
    for 50 iterations (a send overwriting what the peer has not read yet would change it)."""
    from tests.test_push_send_recv import PUSH, chain, ring

    graphs = ml.spmd(ring, 2)
    rng = np.random.default_rng(5)
    with group(make_plan(graphs, processors=132, tiles=PUSH)) as gr:
        for _ in range(3):
            feeds = feeds_for(graphs, rng)
            same(gr.run(feeds, iterations=2), ml.evaluate(graphs, feeds), "pushed ring")
    graphs = ml.spmd(chain, 2)
    ref = ml.evaluate(graphs, [{}, {}], iterations=50)
    with group(make_plan(graphs, processors=132, tiles=PUSH)) as gr:
        gr.run([{}, {}], iterations=50)
        for r, st in enumerate(gr.state()):
            assert st["s"].tobytes() == ref[r].state["s"].tobytes(), f"pushed state chain rank {r}"


def test_tensor_parallel_mlp_and_hundred_runs_bitwise() -> None:
    world = 2
    graphs, x, params = tp_mlp(world, tokens=8, hidden=256, ffn=1024, scale=0.05, seed=0)
    ref = ml.evaluate(graphs, [{"x": x}] * world, params)
    with group(make_plan(graphs, processors=132), params) as gr:
        first = gr.run([{"x": x}] * world)
        w = ref[0].outputs["y"].astype(np.float64)
        d = np.abs(first[0]["y"].astype(np.float64) - w).max()
        assert d <= 0.02 * np.abs(w).max(), f"TP MLP: max difference {d:.3e} from the CPU reference"
        assert first[0]["y"].tobytes() == first[1]["y"].tobytes(), "ranks disagree on the all-reduced result"
        for _ in range(99):
            again = gr.run([{"x": x}] * world)
            assert again[0]["y"].tobytes() == first[0]["y"].tobytes()


@pytest.mark.parametrize("push", [1, 0])
def test_a_stopped_peer_is_named_by_the_watchdog(push: int) -> None:
    """Every wait that can block here is on the other rank: its pushed tile (push 1), or its counters
    (push 0: the all-reduce on its product, the next product on its readers), so the watchdog must name
    rank 1."""
    from megaloop.runtime.loop import LoopKernelError

    graphs = ml.spmd(lambda g: g.output("y", ml.all_reduce(g.input("x", (64,), ml.float32) * 2.0)), 2)
    feeds = [{"x": np.ones(64)}, {"x": np.ones(64)}]
    with group(make_plan(graphs, processors=2, tiles={"all_reduce": {"push": push}}), timeout_s=1.0) as gr:
        gr.run(feeds)
        r0, r1 = gr.kernels
        r1._halt()  # rank 1's kernel leaves: rank 0 will wait for counters nobody bumps
        r0._stage_inputs(feeds[0], 1)
        r0.start(1)
        named = r"the tile rank 1 pushes to it never arrived \(a peer GPU" if push else r"of rank 1 \(a peer GPU"
        with pytest.raises(LoopKernelError, match=r"watchdog: rank 0 .* " + named):
            gr.wait()


def torchrun(script: str, peer_memory: str | None) -> subprocess.CompletedProcess:
    """``tests/<script>`` on both GPUs, one process each; ``peer_memory`` None: the default ("auto")."""
    root = Path(__file__).parent.parent
    env = {**os.environ, "PYTHONPATH": str(root), "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    env.pop("MEGALOOP_PEER_MEMORY", None)
    if peer_memory is not None:
        env["MEGALOOP_PEER_MEMORY"] = peer_memory
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(root / "tests" / script)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.parametrize(("asked", "used"), [(None, "symmetric"), ("ipc", "ipc")])
def test_torchrun_one_process_per_gpu(asked: str | None, used: str) -> None:
    """By default the ranks share memory through torch symmetric memory (this image's torch has it);
    asked for, through legacy CUDA IPC handles."""
    done = torchrun("torchrun_tp_mlp.py", asked)
    tail = done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode == 0 and "OK" in done.stdout, tail
    assert f"OK peer_memory={used}" in done.stdout, tail


@pytest.mark.parametrize("peer_memory", ["symmetric", "ipc"])
def test_torchrun_killed_peer_is_named_by_the_watchdog(peer_memory: str) -> None:
    """Rank 1 is SIGKILLed between runs; rank 0's next run waits in its pushing all-reduce tile for rank
    1's data and the watchdog must say so: rank 0, the tile it waited in (all_reduce_N[0]) and rank 1.
    torchrun itself fails (a worker died), so only rank 0's line counts."""
    done = torchrun("torchrun_killed_peer.py", peer_memory)
    tail = done.stdout[-3000:] + done.stderr[-3000:]
    line = next((x[x.index("KILLED-PEER") :] for x in done.stdout.splitlines() if "KILLED-PEER" in x), None)
    assert line is not None, "rank 0 reported nothing:\n" + tail
    assert line.startswith(f"KILLED-PEER peer_memory={peer_memory} error after "), tail
    named = (
        r"watchdog: rank 0 processor \d+ waited more than 2 s in iteration \d+ in all_reduce_\d+\[0\]: "
        r"the tile rank 1 pushes to it never arrived \(a peer GPU: is it running\?\); its LL line flag stayed at"
    )
    assert re.search(named, line), tail

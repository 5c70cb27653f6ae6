"""Pushed send/recv (the recv's tile parameter push): the send's tiles store into the recv's output on
the destination rank and release their counters there; the recv has no tiles. Checked against the
graph reference under random interleavings of 2, 3, 4 and 8 ranks, with the cross-rank waits it needs
removed (verifier and interpreter refuse), through a plan file, and compiled. The GPU run is
tests/test_gpu_multi.py's."""

from __future__ import annotations

import numpy as np
import pytest

import megaloop as ml
from megaloop import errors
from megaloop.codegen import generate
from megaloop.plan import make_plan
from megaloop.plan.format import plan_from_dict, plan_to_dict
from megaloop.plan.verify import verify_plan
from megaloop.reference.interpreter import run_plan
from megaloop.runtime.compile import compile_cubin, spills

SEEDS = 20
PUSH = {"recv": {"push": 1}, "send": {"elements": 256}}  # several tiles a send


def ring(g: ml.Graph) -> None:
    """Each rank sends exp(x) to the next and adds what the previous one sent to its own."""
    r, n = g.rank, g.world_size
    x = g.input("x", (6, 250), ml.float32)
    y = ml.exp(x * 0.1)
    ml.send(y * 2.0, (r + 1) % n)
    g.output("z", ml.recv(g, (r - 1) % n, (6, 250), ml.float32) + y)


def chain(g: ml.Graph) -> None:
    """A state passed around the ring every iteration: each iteration's data differs, so a send that
    overwrote the recv's output before its readers were done would change the result."""
    r, n = g.rank, g.world_size
    s = g.state("s", (4, 96), ml.bfloat16, init=np.full((4, 96), r + 1.0, np.float32))
    ml.send(s * 1.5, (r + 1) % n)
    g.assign(s, ml.recv(g, (r - 1) % n, (4, 96), ml.bfloat16) * 0.5 + s)
    g.output("s", s + 0.0)


def _feeds(n: int) -> list[dict]:
    return [{"x": np.random.default_rng(100 + r).standard_normal((6, 250))} for r in range(n)]


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_pushed_ring_matches_the_reference(n: int) -> None:
    gs = ml.spmd(ring, n)
    ref = ml.evaluate(gs, _feeds(n))
    plan = make_plan(gs, processors=5, tiles=PUSH)
    for seed in range(SEEDS):
        got = run_plan(plan, _feeds(n), seed=seed, iterations=2)
        for r in range(n):
            assert np.array_equal(got[r].outputs["z"], ref[r].outputs["z"]), f"{n} ranks, rank {r}, seed {seed}"


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_pushed_state_chain_matches_the_reference_over_iterations(n: int) -> None:
    gs = ml.spmd(chain, n)
    ref = ml.evaluate(gs, [{}] * n, iterations=4)
    plan = make_plan(gs, processors=3, tiles=PUSH)
    for seed in range(SEEDS):
        got = run_plan(plan, [{}] * n, seed=seed, iterations=4)
        for r in range(n):
            want, have = ref[r].state["s"].astype(np.float64), got[r].state["s"].astype(np.float64)
            assert np.array_equal(have, want), (
                f"{n} ranks, rank {r}, seed {seed}: worst difference {np.abs(have - want).max()}"
            )


def test_the_send_has_the_tiles_and_writes_the_peers_recv_output() -> None:
    plan = make_plan(ml.spmd(ring, 2), processors=4, tiles=PUSH)
    pulled = make_plan(ml.spmd(ring, 2), processors=4)
    for r, rp in enumerate(plan.ranks):
        ops = {op.op: op for op in rp.ops}
        sends = [t for t in rp.tasks if t.op == ops["send"].id]
        assert len(sends) == 6 and not [t for t in rp.tasks if t.op == ops["recv"].id]
        dst = (r + 1) % 2
        out = plan.ranks[dst].tensor_of[next(n for n in plan.ranks[dst].graph.nodes if n.op.name == "recv").outputs[0]]
        assert {(a.rank, a.tensor) for t in sends for a in t.writes} == {(dst, out)}
        assert plan.ranks[dst].buffers[plan.ranks[dst].tensors[out].buffer].peer, "the recv's output is not peer memory"
        # the consumer waits on the sender's tiles; the first send tile on each processor waits for the
        # previous iteration's reader there (the later ones follow it in program order)
        add = next(t for t in rp.tasks if rp.ops[t.op].op == "add")
        assert {(w.rank, w.lag) for w in add.waits} >= {((r - 1) % 2, 0)}
        send_ids = {t.id for t in sends}
        for lst in rp.processors:
            first = next((rp.tasks[i] for i in lst if i in send_ids), None)
            assert first is None or any(w.rank == dst and w.lag == 1 for w in first.waits), rp.task_name(first)
    assert not any(op.op == "send" for rp in pulled.ranks for op in rp.ops), "a pulled send has an op"


@pytest.mark.parametrize("lag", [0, 1])
def test_dropped_cross_rank_waits_are_caught(lag: int) -> None:
    # lag 0: the consumer no longer waits for the sender's stores; lag 1: the sender no longer waits
    # for the previous iteration's reader before overwriting
    gs = ml.spmd(chain, 2)
    plan = make_plan(gs, processors=3, tiles=PUSH)
    dropped = 0
    for r, rp in enumerate(plan.ranks):
        for t in rp.tasks:
            keep = [w for w in t.waits if not (w.rank != r and w.lag == lag)]
            dropped += len(t.waits) - len(keep)
            t.waits = keep
    assert dropped
    with pytest.raises(errors.PlanError):
        verify_plan(plan)
    with pytest.raises(errors.InterpreterError):
        for seed in range(SEEDS):
            run_plan(plan, [{}] * 2, seed=seed, iterations=4)


def test_a_pushed_recv_into_a_state_is_copied_at_the_end() -> None:
    # the send stores before the recv's place in the order: writing the state there directly could
    # overwrite the old value before this rank's readers of it
    plan = make_plan(ml.spmd(chain, 2), processors=3, tiles=PUSH)
    assert all(any(op.name == "assign:s" for op in rp.ops) for rp in plan.ranks)


def test_a_pushed_plan_survives_its_file() -> None:
    plan = make_plan(ml.spmd(ring, 3), processors=4, tiles=PUSH)
    again = plan_from_dict(plan_to_dict(plan))
    for a, b in zip(plan.ranks, again.ranks):
        assert [(t.writes, t.waits) for t in a.tasks] == [(t.writes, t.waits) for t in b.tasks]
    got = run_plan(again, _feeds(3), seed=1)
    ref = ml.evaluate(ml.spmd(ring, 3), _feeds(3))
    assert all(np.array_equal(got[r].outputs["z"], ref[r].outputs["z"]) for r in range(3))


@pytest.mark.parametrize("dtype", [ml.bfloat16, ml.float32])
def test_pushed_send_tiles_compile_and_store_into_the_peer(dtype) -> None:
    def build(g: ml.Graph) -> None:
        x = g.input("x", (8, 1024), dtype)
        ml.send(ml.exp(x), (g.rank + 1) % 2)
        g.output("z", ml.recv(g, (g.rank + 1) % 2, (8, 1024), dtype) + 1.0)

    plan = make_plan(ml.spmd(build, 2), processors=16, tiles={"recv": {"push": 1}})
    for r in range(2):
        src = generate(plan, r).source
        assert f"(a.arenas[{1 - r}] + off[1]);  // rank {1 - r}'s recv output" in src
        assert "packed path" in src or "ml::store_pack" in src, "the send's stores are not 16-byte packs"
        assert compile_cubin(src, "sm_90a", use_cache=False)[:4] == b"\x7fELF"
        assert spills(src, "sm_90a") == {}

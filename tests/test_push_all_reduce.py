"""Pushing all_reduce (megaloop/plan/rendezvous.py, megaloop/codegen/include/megaloop/exchange.cuh) on
the CPU: the plan interpreter against the reference for 2, 3, 4 and 8 ranks under 20 random
interleavings, pushed and pulled; meetings placed out of order are a deadlock for the verifier and the
interpreter; members that disagree are refused; the tile functions compile without spills; the inboxes
never overlap the plan's buffers or each other. The GPU checks are tests/test_gpu_multi.py."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import megaloop as ml
from megaloop import errors
from megaloop.codegen import generate
from megaloop.plan import make_plan
from megaloop.plan.rendezvous import LL_MAX_TILE_BYTES, exchange_region, inboxes, meetings, pushes
from megaloop.plan.stats import plan_stats
from megaloop.plan.verify import verify_plan
from megaloop.reference.interpreter import run_plan
from megaloop.runtime.compile import compile_cubin, spills
from megaloop.runtime.loop import memory_sizes

SEEDS = 20


def chain(world: int, n: int, dtype=ml.bfloat16, depth: int = 3):
    """``depth`` all-reduces, each of the previous one's result times 0.5 (so that the sums stay
    finite), the last one the next iteration's state: every hop depends on the one before."""

    def build(g: ml.Graph) -> None:
        s = g.state("s", (n,), dtype, init=np.random.default_rng([n, g.rank]).standard_normal(n).astype(np.float32))
        y = s
        for _ in range(depth):
            y = ml.all_reduce(y * 0.5)
        g.output("y", y)
        g.assign(s, y)

    return ml.spmd(build, world)


def check(graphs, plan, iterations: int = 3, seeds: int = SEEDS) -> None:
    ref = ml.evaluate(graphs, None, iterations=iterations)
    for seed in range(seeds):
        got = run_plan(plan, None, iterations=iterations, seed=seed)
        for r, (a, b) in enumerate(zip(got, ref)):
            assert a.outputs["y"].tobytes() == b.outputs["y"].tobytes(), f"seed {seed} rank {r}: differs"


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("push", [1, 0])
def test_chains_of_all_reduces_match_the_reference_in_any_interleaving(world: int, push: int) -> None:
    graphs = chain(world, 40)
    tiles = {"all_reduce": {"push": push, "push_elements": 8, "elements": 8}}
    plan = make_plan(graphs, processors=8, tiles=tiles)  # 40 elements: five tiles of 8
    pushed = [pushes(plan.ranks[0], op) for op in plan.ranks[0].ops if op.op == "all_reduce"]
    assert pushed == [bool(push)] * 3
    if push:
        assert len(meetings(plan)) == 3 * 5  # three ops of five tiles
        remote = [w for rp in plan.ranks for t in rp.tasks for w in t.waits if w.rank != rp.rank]
        assert not remote, "a pushed all-reduce needs no wait on another rank"
    check(graphs, plan)


def test_a_meeting_out_of_order_deadlocks() -> None:
    """Two independent all-reduces on one processor: rank 0 runs the second before the first, rank 1
    the other way round; each waits in its first tile for the other rank's, which never starts."""

    def build(g: ml.Graph) -> None:
        g.output("y", ml.all_reduce(g.input("x", (64,), ml.float32)))
        g.output("z", ml.all_reduce(g.input("w", (64,), ml.float32)))

    plan = make_plan(ml.spmd(build, 2), processors=1)
    rp = plan.ranks[0]
    lst = rp.processors[0]
    at = [i for i, t in enumerate(lst) if rp.ops[rp.tasks[t].op].op == "all_reduce"]
    assert len(at) == 2
    lst[at[0]], lst[at[1]] = lst[at[1]], lst[at[0]]
    with pytest.raises(errors.DeadlockError, match="meeting"):
        verify_plan(plan)
    feeds = [{"x": np.ones(64, np.float32), "w": np.ones(64, np.float32)}] * 2
    with pytest.raises(errors.DeadlockError, match="pushed boxes of"):
        run_plan(plan, feeds)


def test_members_that_disagree_are_refused() -> None:
    graphs = ml.spmd(lambda g: g.output("y", ml.all_reduce(g.input("x", (64,), ml.float32))), 2)
    (node,) = [n for n in graphs[1].nodes if n.op.name == "all_reduce"]
    node.scope = "only_rank_1"  # node names are per rank: an override can reach one member only
    with pytest.raises(errors.PlanError, match="give the tile parameter push the same value"):
        make_plan(graphs, processors=2, tiles={node.name: {"push": 0}})
    with pytest.raises(errors.PlanError, match="different tiles"):
        make_plan(graphs, processors=8, tiles={node.name: {"push_elements": 16}})


def test_what_cannot_push_pulls() -> None:
    """x a strided view, or a run not on a 16-byte line: the tiles read the members' boxes."""

    def build(g: ml.Graph) -> None:
        x = g.input("x", (8, 6), ml.bfloat16)
        g.output("a", ml.all_reduce(x.T))  # strided
        g.output("b", ml.all_reduce(x[1:]))  # starts 12 bytes in
        g.output("c", ml.all_reduce(x))  # contiguous, on a line: pushes

    plan = make_plan(ml.spmd(build, 2), processors=2)
    rp = plan.ranks[0]
    kinds = {rp.tensors[op.outputs[0]].name: pushes(rp, op) for op in rp.ops if op.op == "all_reduce"}
    assert sorted(kinds.values()) == [False, False, True], kinds


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize(
    ("dtype", "n", "op"),
    [(ml.bfloat16, 3000, "sum"), (ml.float32, 1 << 20, "max"), (ml.int32, 1000, "max"), (ml.int64, 70000, "sum")],
)
def test_pushed_tiles_compile_without_spills(world: int, dtype, n: int, op: str) -> None:
    graphs = ml.spmd(lambda g: g.output("y", ml.all_reduce(g.input("x", (n,), dtype), op)), world)
    plan = make_plan(graphs, processors=132)
    (box,) = inboxes(plan, 0).values()
    tile_bytes = max(t.writes[0].box.size for t in plan.ranks[0].tasks) * dtype.itemsize
    assert box.ll == (tile_bytes <= LL_MAX_TILE_BYTES)
    src = generate(plan, world - 1).source
    assert f"push_all_reduce_{'ll' if box.ll else 'bulk'}<" in src
    assert compile_cubin(src, "sm_90a")[:4] == b"\x7fELF"
    assert spills(src, "sm_90a") == {}, "the pushed tile spills"


def test_inboxes_sit_after_the_plan_and_apart() -> None:
    def build(g: ml.Graph) -> None:
        x = g.input("x", (5000,), ml.float32)
        g.output("y", ml.all_reduce(ml.all_reduce(x) + 1.0))
        g.output("z", ml.all_reduce(g.input("big", (1 << 20,), ml.bfloat16)))

    plan = make_plan(ml.spmd(build, 2), processors=16)
    for rank in range(2):
        boxes = sorted(inboxes(plan, rank).values(), key=lambda b: b.offset)
        assert len(boxes) == 3 and {b.ll for b in boxes} == {True, False}
        start, total = exchange_region(plan, rank)
        assert start >= plan.ranks[rank].arena_bytes and boxes[0].offset == start
        for a, b in itertools.pairwise(boxes):
            assert a.offset + a.nbytes <= b.offset, "inboxes overlap"
        assert boxes[-1].offset + boxes[-1].nbytes <= start + total <= memory_sizes(plan, rank)[0]
        stats = plan_stats(plan)[rank]  # what `megaloop plan` reports counts them
        assert stats.region_bytes["inboxes"] == total and stats.arena_bytes == start + total
    # the same layout on both members: each pushes into the other's at its own offsets
    assert inboxes(plan, 0) == inboxes(plan, 1)

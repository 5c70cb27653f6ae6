"""N-rank reference: collectives and send/recv for 2, 3, 4 and 8 simulated ranks, against numpy
float64 and against the fixed reduction order (rank 0 + rank 1 + ... in float32, rounded once)."""

from __future__ import annotations

import numpy as np
import pytest

import megaloop as ml
from megaloop.frontend.opdef import REGISTRY
from tests.helpers import assert_close, random_values

WORLDS = [2, 3, 4, 8]
DTYPES = ["float32", "bfloat16", "float16", "int32"]


def rank_values(world: int, shape: tuple[int, ...], dtype: ml.DType, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [random_values(rng, shape, dtype) for _ in range(world)]


def fixed_order(values: list[np.ndarray], op: str, dtype: ml.DType) -> np.ndarray:
    """The promised order: accumulate rank by rank in float32 (int64 for ints), round once."""
    wide = np.int64 if dtype.is_int else np.float32
    acc = values[0].astype(wide)
    for v in values[1:]:
        acc = acc + v.astype(wide) if op == "sum" else np.maximum(acc, v.astype(wide))
    return ml.dtypes.round_to(acc, dtype)


def run(world: int, build, feeds: list[dict]) -> list[ml.Evaluation]:
    graphs = ml.spmd(build, world, name="collective")
    first = ml.evaluate(graphs, feeds)
    again = ml.evaluate(graphs, feeds)
    for a, b in zip(first, again):  # bitwise reproducible run to run
        for name in a.outputs:
            assert a.outputs[name].tobytes() == b.outputs[name].tobytes(), f"{name} differs between runs"
    return first


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["sum", "max"])
def test_all_reduce(world: int, dtype: str, op: str) -> None:
    dt = ml.as_dtype(dtype)
    shape = (3, 5)
    for seed in range(3):
        xs = rank_values(world, shape, dt, seed + 100 * world)

        def build(g: ml.Graph) -> None:
            g.output("y", ml.all_reduce(g.input("x", shape, dt), op))

        outs = run(world, build, [{"x": x} for x in xs])
        expected = fixed_order(xs, op, dt)
        ref64 = np.sum([x.astype(np.float64) for x in xs], 0) if op == "sum" else np.max(xs, 0).astype(np.float64)
        for r, o in enumerate(outs):
            assert o.outputs["y"].tobytes() == expected.tobytes(), f"rank {r} is not the fixed-order result"
            if dt.is_float:
                assert_close(
                    o.outputs["y"],
                    ref64,
                    dt,
                    REGISTRY["all_reduce"].accuracy,
                    world,
                    f"all_reduce {op} world {world} rank {r}",
                )
            else:
                np.testing.assert_array_equal(o.outputs["y"], ref64.astype(np.int32))


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_all_gather(world: int, axis: int) -> None:
    dt = ml.bfloat16
    xs = rank_values(world, (2, 3), dt, world)

    def build(g: ml.Graph) -> None:
        g.output("y", ml.all_gather(g.input("x", (2, 3), dt), axis))

    outs = run(world, build, [{"x": x} for x in xs])
    expected = np.concatenate(xs, axis=axis)
    for o in outs:
        np.testing.assert_array_equal(o.outputs["y"], expected)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reduce_scatter(world: int, axis: int, dtype: str) -> None:
    dt = ml.as_dtype(dtype)
    shape = (world * 2, 3) if axis == 0 else (3, world * 3)
    xs = rank_values(world, shape, dt, 7 * world)

    def build(g: ml.Graph) -> None:
        g.output("y", ml.reduce_scatter(g.input("x", shape, dt), axis))

    outs = run(world, build, [{"x": x} for x in xs])
    total = fixed_order(xs, "sum", dt)
    ref64 = np.sum([x.astype(np.float64) for x in xs], 0)
    for r, o in enumerate(outs):
        piece = np.split(total, world, axis=axis)[r]
        assert o.outputs["y"].tobytes() == np.ascontiguousarray(piece).tobytes()
        assert_close(
            o.outputs["y"],
            np.split(ref64, world, axis=axis)[r],
            dt,
            REGISTRY["reduce_scatter"].accuracy,
            world,
            f"reduce_scatter rank {r}",
        )


@pytest.mark.parametrize("world", WORLDS)
def test_send_recv_ring_and_pipeline(world: int) -> None:
    """Each rank passes its tensor to the next (a ring), and a pipeline carries a running sum from
    rank 0 to the last rank, each stage adding its own input."""
    xs = rank_values(world, (4,), ml.float32, 11)

    def build(g: ml.Graph) -> None:
        r, n = g.rank, g.world_size
        x = g.input("x", (4,), ml.float32)
        ml.send(x, (r + 1) % n, tag=1)
        g.output("from_prev", ml.recv(g, (r - 1) % n, (4,), ml.float32, tag=1))
        carried = x if r == 0 else ml.recv(g, r - 1, (4,), ml.float32, tag=2) + x
        if r < n - 1:
            ml.send(carried, r + 1, tag=2)
        else:
            g.output("total", carried)

    outs = run(world, build, [{"x": x} for x in xs])
    for r, o in enumerate(outs):
        np.testing.assert_array_equal(o.outputs["from_prev"], xs[(r - 1) % world])
    expected = xs[0]
    for x in xs[1:]:
        expected = (expected + x).astype(np.float32)
    np.testing.assert_array_equal(outs[-1].outputs["total"], expected)


@pytest.mark.parametrize("world", [4, 8])
def test_groups_of_a_2d_mesh(world: int) -> None:
    """Ranks form a (world/2) x 2 mesh: all_reduce within rows (tensor-parallel pairs), then all_gather
    down the columns (data-parallel groups)."""
    xs = rank_values(world, (2, 2), ml.float32, 5)

    def build(g: ml.Graph) -> None:
        r = g.rank
        row = (r - r % 2, r - r % 2 + 1)
        col = tuple(range(r % 2, world, 2))
        y = ml.all_reduce(g.input("x", (2, 2), ml.float32), group=row)
        g.output("y", ml.all_gather(y, 0, group=col))

    outs = run(world, build, [{"x": x} for x in xs])
    for o in outs:
        pairs = [(xs[c] + xs[c + 1]).astype(np.float32) for c in range(0, world, 2)]
        np.testing.assert_array_equal(o.outputs["y"], np.concatenate(pairs, 0))


def test_independent_sends_do_not_deadlock() -> None:
    """Both ranks receive before they send in build order; the data does not depend on it, so the
    program is legal (dataflow, not program order) and must evaluate."""

    def build(g: ml.Graph) -> None:
        peer = 1 - g.rank
        got = ml.recv(g, peer, (2,), ml.float32)
        ml.send(g.input("x", (2,), ml.float32), peer)
        g.output("got", got)

    outs = run(2, build, [{"x": np.array([1.0, 2.0])}, {"x": np.array([3.0, 4.0])}])
    np.testing.assert_array_equal(outs[0].outputs["got"], [3.0, 4.0])
    np.testing.assert_array_equal(outs[1].outputs["got"], [1.0, 2.0])


def test_single_rank_collectives_are_identities() -> None:
    g = ml.Graph("one")
    x = g.input("x", (4, 2), ml.bfloat16)
    g.output("a", ml.all_reduce(x))
    g.output("b", ml.all_gather(x, 1))
    g.output("c", ml.reduce_scatter(x, 0))
    arr = ml.dtypes.round_to(np.random.default_rng(0).standard_normal((4, 2)), ml.bfloat16)
    out = ml.evaluate(g, {"x": arr}).outputs
    for k in "abc":
        np.testing.assert_array_equal(out[k], arr)


@pytest.mark.parametrize("world", [3, 4, 8])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_step_all_reduce_is_bitwise_the_one_shot(world: int, dtype: str) -> None:
    """reduce_scatter + all_gather combines each element in rank order and rounds once, as the
    one-shot form does: the results are the same bits, through the reference and through a plan."""
    from megaloop.plan import make_plan
    from megaloop.reference.interpreter import run_plan

    rng = np.random.default_rng(world)
    shape = (world * 3, 5)
    xs = [random_values(rng, shape, ml.as_dtype(dtype)) for _ in range(world)]

    def build(algorithm: str):
        def body(g: ml.Graph) -> None:
            y = ml.all_reduce(g.input("x", shape, dtype)[::-1] * 1.0, algorithm=algorithm)  # a view first
            g.output("y", y)

        return ml.spmd(body, world)

    one = ml.evaluate(build("one_shot"), [{"x": x} for x in xs])
    two_graphs = build("two_step")
    assert any(n.op.name == "reduce_scatter" for n in two_graphs[0].nodes)
    two = ml.evaluate(two_graphs, [{"x": x} for x in xs])
    planned = run_plan(make_plan(two_graphs, processors=3), [{"x": x} for x in xs], seed=1)
    for r in range(world):
        want = one[r].outputs["y"].tobytes()
        assert two[r].outputs["y"].tobytes() == want and planned[r].outputs["y"].tobytes() == want, f"rank {r}"


def test_all_reduce_algorithm_choice_and_errors() -> None:
    big = (1 << 20) // 4  # float32 elements in 1 MiB

    def kinds(world: int, n: int, **kw) -> set[str]:
        graphs = ml.spmd(lambda g: g.output("y", ml.all_reduce(g.input("x", (n,), ml.float32), **kw)), world)
        return {node.op.name for node in graphs[0].nodes}

    assert "all_reduce" in kinds(4, 1024)  # small: one shot
    assert "reduce_scatter" in kinds(4, big)  # large, more than two members: two steps
    assert "all_reduce" in kinds(2, big)  # two members: one shot moves no more
    assert "all_reduce" in kinds(4, big + 1)  # does not divide: one shot
    with pytest.raises(ml.errors.ShapeError, match="does not divide by 4"):
        kinds(4, 10, algorithm="two_step")
    with pytest.raises(ml.errors.GraphBuildError, match="algorithm must be one of"):
        kinds(2, 10, algorithm="ring")

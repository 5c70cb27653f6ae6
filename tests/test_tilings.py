"""What the tilings make: large memory-bound ops get larger tiles (a bounded number of tasks per
processor), small ones keep the ``elements`` parameter, and every output element is written by
exactly one task."""

from __future__ import annotations

import numpy as np
import pytest

import megaloop as ml
from megaloop.plan import make_plan


def graph(op: str, shape: tuple[int, ...]) -> ml.Graph:
    g = ml.Graph(op)
    x = g.input("x", shape, ml.bfloat16)
    y = {
        "add": lambda: x + x,
        "rmsnorm": lambda: ml.rmsnorm(x, g.parameter("w", shape[-1:], ml.bfloat16)),
        "sum": lambda: ml.sum(x, axis=-1),
    }[op]()
    g.output("y", y)
    return g


def tasks_of(plan, op: str) -> list:
    rp = plan.ranks[0]
    return [t for t in rp.tasks if rp.ops[t.op].op == op]


@pytest.mark.parametrize("op", ["add", "rmsnorm", "sum"])
def test_large_ops_make_a_bounded_number_of_tasks_that_cover_the_output(op: str) -> None:
    shape = (4096, 1024)  # 4 M elements: 512 tiles of 8K elements without the bound
    for processors, waves in ((4, 8), (16, 2)):
        plan = make_plan(graph(op, shape), processors=processors, tiles={op: {"waves": waves}})
        tasks = tasks_of(plan, op)
        assert len(tasks) <= processors * waves + 1, f"{len(tasks)} tasks on {processors} processors"
        out = plan.ranks[0].tensors[plan.ranks[0].ops[tasks[0].op].outputs[0]]
        written = np.zeros(out.shape, np.int64)
        for t in tasks:
            written[tuple(slice(lo, hi) for lo, hi in zip(t.writes[0].box.lo, t.writes[0].box.hi))] += 1
        assert (written == 1).all(), f"{op}: elements written {written.min()}..{written.max()} times"


@pytest.mark.parametrize("op", ["add", "rmsnorm", "sum"])
@pytest.mark.parametrize("rows", [32768, 30001, 4097])
def test_large_ops_fill_their_last_round_of_processors(op: str, rows: int) -> None:
    """A big op's tasks come in rounds over the processors; the busiest processor's share of rows must
    be within a few percent of an even split (32768 rows in the old tiles of 31: 279 rows against 248,
    a ninth round for 2 of 132 processors)."""
    processors, cols = 132, 8192
    plan = make_plan(graph(op, (rows, cols)), processors=processors)
    tasks = tasks_of(plan, op)
    sizes = [t.writes[0].box.hi[0] - t.writes[0].box.lo[0] for t in tasks]
    rounds = -(-len(tasks) // processors)
    busiest = rounds * max(sizes)  # tasks are equal but the last: a processor's rows, at most
    even = rows / processors
    print(f"{op} {rows} rows: {len(tasks)} tasks of {max(sizes)} rows, {rounds} rounds, {busiest} vs {even:.1f}")
    assert len(tasks) <= processors * 8 + 1
    assert busiest <= even * 1.04 + 1, f"{busiest} rows on the busiest processor against {even:.1f} evenly"


def test_small_ops_keep_the_elements_parameter() -> None:
    plan = make_plan(graph("add", (64, 512)), processors=132, tiles={"add": {"elements": 4096}})
    assert len(tasks_of(plan, "add")) == 64 * 512 // 4096


def test_attention_partial_with_an_empty_key_range() -> None:
    """5 keys in 4 ranges of 2: the last range is empty; its tile reads no key and writes m = -inf."""
    from megaloop.reference.interpreter import run_plan

    g = ml.Graph("p")
    q = g.input("q", (1, 2, 1, 4), ml.float32)
    k = g.input("k", (1, 1, 5, 4), ml.float32)
    v = g.input("v", (1, 1, 5, 4), ml.float32)
    g.output("y", ml.attention_partial(q, k, v, splits=4))
    feeds = {n: np.random.default_rng(0).standard_normal(t.shape) for n, t in g.inputs.items()}
    got = run_plan(make_plan(g, processors=3), feeds, seed=0).outputs["y"]
    assert np.array_equal(got, ml.evaluate(g, feeds).outputs["y"], equal_nan=True)
    assert np.isneginf(got[..., 3, 4]).all() and (got[..., 3, 5] == 0).all()


@pytest.mark.parametrize("shape", [(3, 1_000_000), (1_638_400,), (1 << 22,)])
def test_chunks_of_the_last_axis_stay_on_whole_packs(shape: tuple[int, ...]) -> None:
    """Balanced chunks that split the last axis start on a multiple of 64 elements and are whole 64-element
    runs but at the axis' end (the generated code's 16-byte packs; an odd size made every element take the
    one-at-a-time path)."""
    plan = make_plan(graph("add", shape), processors=132)
    for t in tasks_of(plan, "add"):
        lo, hi = t.writes[0].box.lo[-1], t.writes[0].box.hi[-1]
        assert lo % 64 == 0 and (hi % 64 == 0 or hi == shape[-1]), f"{shape}: a task writes [{lo}, {hi})"

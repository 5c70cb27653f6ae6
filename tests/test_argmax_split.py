"""argmax split over tiles (megaloop.frontend.ops.argmax_split): the same index as argmax, ties and
NaNs included, through the reference, the plan interpreter's random orders and the generated kernel
(compile-only here; tests/test_gpu.py's every-op test runs op_table's rows on a GPU); bad pairs refused
at build time; a Llama generator's next token split into ranges."""

from __future__ import annotations

import numpy as np
import pytest

import megaloop as ml
from megaloop.errors import AxisError, GraphBuildError, ShapeError
from megaloop.frontend.ops._build import apply
from megaloop.frontend.ops.argmax_split import ARGMAX_COMBINE, split_ranges
from megaloop.plan import make_plan
from megaloop.reference.interpreter import run_plan


@pytest.mark.parametrize("n,splits", [(17, 2), (100, 7), (128256, 128), (1000, 999), (4100, 33)])
def test_ranges_cover_the_axis_in_whole_packs(n: int, splits: int) -> None:
    ranges, chunk = split_ranges(n, splits)
    assert chunk % 8 == 0 and 2 <= ranges <= splits, (ranges, chunk)
    assert (ranges - 1) * chunk < n <= ranges * chunk  # every range non-empty


def values(rng: np.random.Generator, shape: tuple[int, ...], case: str, axis: int) -> np.ndarray:
    v = rng.integers(-3, 3, shape).astype(np.float32)  # many ties
    if case == "nan":  # NaNs in some rows: the first NaN wins, as numpy's argmax
        v.reshape(-1)[rng.choice(v.size, max(1, v.size // 500), replace=False)] = np.nan
    elif case == "-inf":  # rows of only -inf: index 0 (a range of -inf must still be a candidate)
        v[...] = -np.inf
    elif case == "last":  # the largest in the last, short range (along the split axis)
        v[(slice(None),) * (axis % len(shape)) + (-1,)] = 100.0
    return v


@pytest.mark.parametrize("case", ["ties", "nan", "-inf", "last"])
@pytest.mark.parametrize(
    "shape,axis,splits,keepdims,dtype",
    [
        ((1, 1, 128256), -1, 128, False, "bfloat16"),  # Llama-3.2's vocabulary
        ((3, 1000), 1, 7, True, "float32"),
        ((5, 37, 4), 1, 6, False, "float16"),  # a middle axis: strided ranges
        ((4, 2, 4100), 2, 33, True, "bfloat16"),
    ],
)
def test_split_argmax_is_argmax(shape, axis, splits, keepdims, dtype, case) -> None:
    rng = np.random.default_rng(len(shape) * 7 + splits)
    g = ml.Graph("argmax-split")
    x = g.input("x", shape, dtype)
    g.output("i", ml.argmax(x, axis, keepdims=keepdims, splits=splits))
    assert [n.op.name for n in g.nodes][-2:] == ["argmax_partial", "argmax_combine"]
    v = ml.dtypes.round_to(values(rng, shape, case, axis), ml.as_dtype(dtype))
    want = np.argmax(v.astype(np.float64), axis=axis, keepdims=keepdims)  # float64: NaN first, as numpy
    assert np.array_equal(ml.evaluate(g, {"x": v}).outputs["i"], want)
    plan = make_plan(g, processors=16)
    for seed in range(3):
        got = run_plan(plan, {"x": v}, seed=seed).outputs["i"]
        assert np.array_equal(got, want), f"seed {seed}: {np.argwhere(got != want)[:4].tolist()}"


def test_integers_split_too() -> None:
    rng = np.random.default_rng(3)
    v = rng.integers(-(2**31), 2**31 - 1, (3, 5000), dtype=np.int64).astype(np.int32)
    v[1] = 7  # all tied: index 0
    g = ml.Graph("argmax-int")
    g.output("i", ml.argmax(g.input("x", (3, 5000), "int32"), 1, splits=9))
    got = run_plan(make_plan(g, processors=8), {"x": v}, seed=1).outputs["i"]
    assert np.array_equal(got, np.argmax(v, axis=1)) and got[1] == 0


def test_the_lm_head_case_makes_a_round_of_ranges_and_compiles() -> None:
    """128 ranges of 1008 logits (build_llama_generator's "auto": 126 of 1024): 128 partial tiles (one
    round of 132 processors), each waiting only for the LM head tiles over its range, and one combine;
    the kernel compiles without spills."""
    from megaloop.codegen.kernel import generate
    from megaloop.runtime.compile import spills

    g = ml.Graph("lm-head-argmax")
    h = g.input("h", (1, 1, 2048), "bfloat16")
    logits = ml.linear(h, g.parameter("w", (128256, 2048), "bfloat16"))
    g.output("token", ml.argmax(logits, -1, splits=128))
    plan = make_plan(g, processors=132)
    rp = plan.ranks[0]
    ops = {op.op: op.id for op in rp.ops}
    partial = [t for t in rp.tasks if t.op == ops["argmax_partial"]]
    assert len(partial) == 128 and len([t for t in rp.tasks if t.op == ops["argmax_combine"]]) == 1
    head = [t for t in rp.tasks if t.op == ops["matmul"]]
    # a partial tile waits on the few head tiles over its 1008 columns, not on all 518
    assert max(len(t.waits) for t in partial) <= 6, max(len(t.waits) for t in partial)
    assert len(head) == 518
    assert spills(generate(plan).source) == {}


def test_bad_pairs_are_refused_at_build_time() -> None:
    g = ml.Graph("bad")
    x = g.input("x", (2, 100), "float32")
    with pytest.raises(AxisError, match="splits needs one int axis"):
        ml.argmax(x, None, splits=4)
    with pytest.raises(GraphBuildError, match="splits must be >= 1"):
        ml.argmax(x, 1, splits=0)
    with pytest.raises(GraphBuildError, match="must be argmax_partial's output"):
        ml.argmax_combine(x, g.input("p", (2, 4), "int64"), 1)
    partial = ml.argmax_partial(x, 1, splits=4)
    with pytest.raises(ShapeError, match="do not cover"):
        apply(ARGMAX_COMBINE, [x, partial], axis=1, keepdims=False, splits=4, chunk=8)
    other = g.input("y", (3, 100), "float32")
    with pytest.raises(ShapeError, match="needs"):  # (ml.argmax_combine refuses it sooner: another x)
        apply(ARGMAX_COMBINE, [other, partial], axis=1, keepdims=False, splits=4, chunk=32)


def test_a_partial_of_another_tensor_or_axis_is_refused() -> None:
    g = ml.Graph("mismatch")
    x, y = g.input("x", (2, 100), "float32"), g.input("y", (2, 100), "float32")
    with pytest.raises(GraphBuildError, match="not of x"):
        ml.argmax_combine(x, ml.argmax_partial(y, 1, splits=4), 1)
    square = g.input("s", (100, 100), "float32")
    with pytest.raises(GraphBuildError, match="not of x"):
        ml.argmax_combine(square, ml.argmax_partial(square, 0, splits=4), 1)


def test_many_ranges_compile_without_spills() -> None:
    """The combine loads a batch of ranges a lane at a time (a rolled loop over batches): 2048 ranges
    spilled when every range of a lane was unrolled at once (a helper's review)."""
    from megaloop.codegen.kernel import generate
    from megaloop.runtime.compile import spills

    g = ml.Graph("wide")
    x = g.input("x", (1, 1 << 20), "float32")
    g.output("i", ml.argmax(x, 1, splits=2048))
    plan = make_plan(g, processors=132)
    assert spills(generate(plan).source) == {}
    rng = np.random.default_rng(9)
    v = rng.integers(-50, 50, (1, 1 << 20)).astype(np.float32)
    assert run_plan(plan, {"x": v}, seed=1).outputs["i"][0] == np.argmax(v)

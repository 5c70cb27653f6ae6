"""Property-based tests (hypothesis) for broadcasting, reductions and view layouts."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import megaloop as ml
from megaloop.frontend.opdef import REGISTRY
from megaloop.frontend.shapes import reshape_strides
from tests.helpers import assert_close

# derandomize: CI runs the same examples every time; raise HYPOTHESIS_EXAMPLES locally to explore further
SETTINGS = settings(
    max_examples=int(os.environ.get("HYPOTHESIS_EXAMPLES", "150")),
    deadline=None,
    derandomize=os.environ.get("HYPOTHESIS_EXAMPLES") is None,
    suppress_health_check=[HealthCheck.too_slow],
)
dims = st.integers(1, 5)
shapes = st.lists(dims, min_size=0, max_size=4).map(tuple)


@SETTINGS
@given(st.lists(shapes, min_size=2, max_size=3), st.integers(0, 2**32 - 1))
def test_broadcast_matches_numpy(shape_list: list[tuple[int, ...]], seed: int) -> None:
    """Building add/where succeeds exactly when numpy broadcasts, with numpy's shape and values."""
    try:
        expected = np.broadcast_shapes(*shape_list)
    except ValueError:
        expected = None
    g = ml.Graph("bcast")
    xs = [g.input(f"x{i}", s, ml.float32) for i, s in enumerate(shape_list)]
    if expected is None:
        with pytest.raises(ml.errors.BroadcastError, match="cannot be broadcast"):
            out = xs[0]
            for x in xs[1:]:
                out = out + x
        return
    out = xs[0]
    for x in xs[1:]:
        out = out + x
    assert out.shape == expected
    rng = np.random.default_rng(seed)
    vals = {f"x{i}": rng.standard_normal(s).astype(np.float32) for i, s in enumerate(shape_list)}
    g.output("y", out)
    got = ml.evaluate(g, vals).outputs["y"]
    ref = vals["x0"]
    for i in range(1, len(shape_list)):
        ref = (ref + vals[f"x{i}"]).astype(np.float32)  # float32 adds, in the same order: exact
    np.testing.assert_array_equal(got, ref)


reduce_case = shapes.filter(lambda s: len(s) >= 1).flatmap(
    lambda s: st.tuples(
        st.just(s),
        st.one_of(
            st.none(),
            st.integers(-len(s), len(s) - 1),
            st.lists(st.integers(0, len(s) - 1), min_size=1, max_size=len(s), unique=True).map(tuple),
        ),
        st.booleans(),
        st.sampled_from(["sum", "mean", "max", "min"]),
        st.sampled_from(["float32", "bfloat16", "float16"]),
    )
)


@SETTINGS
@given(reduce_case, st.integers(0, 2**32 - 1))
def test_reductions_match_numpy_float64(case: tuple, seed: int) -> None:
    shape, axis, keepdims, op, dtype = case
    dt = ml.as_dtype(dtype)
    rng = np.random.default_rng(seed)
    x = ml.dtypes.round_to(rng.standard_normal(shape), dt)
    g = ml.Graph("reduce")
    y = getattr(ml, op)(g.input("x", shape, dt), axis, keepdims=keepdims)
    g.output("y", y)
    got = ml.evaluate(g, {"x": x}).outputs["y"]
    np_axis = axis if not isinstance(axis, list) else tuple(axis)
    ref = getattr(np, {"max": "amax", "min": "amin"}.get(op, op))(x.astype(np.float64), axis=np_axis, keepdims=keepdims)
    assert got.shape == np.shape(ref) == y.shape
    axes = range(len(shape)) if axis is None else [axis] if isinstance(axis, int) else axis
    n = int(np.prod([shape[a] for a in axes]))
    # the terms' magnitude, which bounds the accumulation error when the result cancels
    scale = float(np.max(np.sum(np.abs(x.astype(np.float64)), axis=np_axis))) / (n if op == "mean" else 1)
    what = f"{op}{shape} axis={axis} keepdims={keepdims}"
    assert_close(got, np.asarray(ref), dt, REGISTRY[op].accuracy, n, what, scale=scale)


@SETTINGS
@given(shapes.filter(lambda s: len(s) >= 1), st.data())
def test_views_of_views_read_the_right_elements(shape: tuple[int, ...], data: st.DataObject) -> None:
    """Random chains of permute / slice / reshape / broadcast: values equal numpy's (the evaluator also
    checks every view's declared strides and offset against its values)."""
    g = ml.Graph("views")
    x = g.input("x", shape, ml.int32)
    arr = np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape)
    t, ref = x, arr
    for _ in range(data.draw(st.integers(1, 4))):
        kind = data.draw(st.sampled_from(["permute", "slice", "reshape", "broadcast"]))
        if kind == "permute":
            perm = data.draw(st.permutations(range(t.ndim)))
            t, ref = t.permute(perm), np.transpose(ref, perm)
        elif kind == "slice" and t.ndim:
            axis = data.draw(st.integers(0, t.ndim - 1))
            n = t.shape[axis]
            step = data.draw(st.sampled_from([1, 2, -1, -2]))
            start = data.draw(st.integers(0, n - 1))
            index = [slice(None)] * t.ndim
            index[axis] = slice(start, None, step)
            t, ref = t[tuple(index)], ref[tuple(index)]
        elif kind == "reshape":
            new = (-1,) if data.draw(st.booleans()) else (*ref.shape[:1], -1)
            t, ref = t.reshape(new), ref.reshape(new)
        elif kind == "broadcast" and t.ndim < 4:
            target = (data.draw(st.integers(1, 3)), *t.shape)
            t, ref = ml.broadcast_to(t, target), np.broadcast_to(ref, target)
    g.output("y", t)
    got = ml.evaluate(g, {"x": arr}).outputs["y"]
    np.testing.assert_array_equal(got, ref)


@SETTINGS
@given(st.lists(st.integers(1, 4), min_size=1, max_size=4), st.data())
def test_reshape_strides_is_a_view_exactly_when_numpy_can(shape: list[int], data: st.DataObject) -> None:
    """reshape_strides agrees with numpy on when a strided array reshapes without a copy, and on the
    strides themselves."""
    arr = np.zeros(shape, np.int8)
    perm = data.draw(st.permutations(range(len(shape))))
    view = np.transpose(arr, perm)
    size = view.size
    divisors = [d for d in range(1, size + 1) if size % d == 0]
    first = data.draw(st.sampled_from(divisors))
    new = (first, size // first)
    try:
        expected = np.array(view, copy=False).reshape(new, copy=False).strides
    except (ValueError, TypeError):
        expected = None
    got = reshape_strides(view.shape, view.strides, new)
    if expected is None:
        assert got is None
    else:
        assert got is not None
        for d, a, b in zip(new, got, expected):
            assert d == 1 or a == b

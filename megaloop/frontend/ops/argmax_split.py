"""argmax along one long axis split over tiles, for when the outputs are few and the axis long (a
language model's next token: the argmax of 128256 logits on one processor, even with the whole block
on it, is a long stage of every token).

``argmax_partial`` gives, for each of ``splits`` consecutive ranges of ``chunk`` elements of the axis
(the last one possibly shorter), the index along the whole axis of the range's first largest value (or
first NaN), int64, the axis replaced by the ranges. ``argmax_combine`` reads those indices and the
values of x at them and picks the first largest (or first NaN): argmax's result exactly, ties and NaNs
included, since the ranges are in order. ``ml.argmax(x, axis, splits=S)`` builds the pair. Each
partial tile starts as soon as its range of x is written (an LM head's tiles end one after another),
and the combine reads 2 x splits values, not the axis.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from megaloop import dtypes
from megaloop.errors import AxisError, DtypeError, GraphBuildError, ShapeError
from megaloop.frontend.opdef import Accuracy, Fast, Lowering, OpCall, OpDef, OutSpec, register
from megaloop.frontend.ops import _placements, _tilings
from megaloop.frontend.ops._build import apply, require_bool, require_int
from megaloop.frontend.ops._fast import VALUES_ONLY, Kernel
from megaloop.frontend.ops.elementwise import check_kinds, to_compute
from megaloop.frontend.ops.reduce import ARGMAX, reduced_shape
from megaloop.frontend.shapes import format_shape
from megaloop.frontend.tensor import Tensor

# a range is a whole number of 16-byte packs of any dtype (8 x 16-bit, 4 x 32-bit, 2 x 64-bit), so
# that every range of a row starts where the row's alignment allows packed loads
CHUNK_MULTIPLE = 8


def split_ranges(n: int, splits: int) -> tuple[int, int]:
    """(ranges, elements a range) for ``n`` elements in at most ``splits`` ranges of a multiple of
    CHUNK_MULTIPLE elements each, every range non-empty."""
    per_range = -(-n // splits)
    chunk = -(-per_range // CHUNK_MULTIPLE) * CHUNK_MULTIPLE
    return -(-n // chunk), chunk


def _check_ranges(call: OpCall, n: int) -> tuple[int, int]:
    splits, chunk = call.attrs["splits"], call.attrs["chunk"]
    if chunk < 1 or splits < 1 or not (splits - 1) * chunk < n <= splits * chunk:
        raise call.error(
            ShapeError,
            f"{splits} ranges of {chunk} elements do not cover the {n} elements of axis {call.attrs['axis']} "
            "with every range non-empty",
            hint="build the pair with ml.argmax(x, axis, splits=...)",
        )
    return splits, chunk


def _other_axes(node: Any) -> list[_placements.Dim]:
    """Every axis but the one searched (x's, the partial indices' and the output's)."""
    a, x = node.attrs["axis"], node.inputs[0]
    keep = node.attrs.get("keepdims", True) or node.op.name == "argmax_partial"
    dims = []
    for i in range(x.ndim):
        if i == a:
            continue
        j = i if keep or i < a else i - 1
        axes = [(s, i, 1) for s in range(len(node.inputs))]
        dims.append(_placements.Dim(x.shape[i], (*axes, (_placements.OUT, j, 1)), label=f"axis {i}"))
    return dims


def _partial_infer(call: OpCall) -> list[OutSpec]:
    check_kinds(call, call.dtype(0), "fi")
    shape = call.shape(0)
    a = call.attrs["axis"] = call.axis(call.attrs["axis"], len(shape))
    splits, _ = _check_ranges(call, shape[a])
    return [OutSpec(shape[:a] + (splits,) + shape[a + 1 :], dtypes.int64)]


def _partial_reference(arrays: list[np.ndarray], attrs: dict[str, Any]) -> np.ndarray:
    x = to_compute(arrays[0])
    a, chunk = attrs["axis"], attrs["chunk"]
    n = x.shape[a]
    parts = [np.argmax(np.take(x, range(lo, min(n, lo + chunk)), axis=a), axis=a) + lo for lo in range(0, n, chunk)]
    return np.stack(parts, axis=a).astype(np.int64)


def _partial_fast(node: Any) -> Kernel:
    """The whole ranges as rows of one argmax (the first largest or first NaN of each), the last,
    shorter range apart."""
    a, chunk, splits = node.attrs["axis"], node.attrs["chunk"], node.attrs["splits"]

    def run(arrays: list[np.ndarray]) -> list[np.ndarray]:
        x = np.moveaxis(arrays[0], a, -1)
        whole = min(splits, x.shape[-1] // chunk)
        rows = x[..., : whole * chunk].reshape(*x.shape[:-1], whole, chunk)
        found = [np.argmax(rows, axis=-1) + np.arange(0, whole * chunk, chunk)]
        if whole < splits:
            found.append(np.argmax(x[..., whole * chunk :], axis=-1)[..., None] + whole * chunk)
        return [np.moveaxis(np.concatenate(found, axis=-1).astype(np.int64), -1, a)]

    return run


ARGMAX_PARTIAL = register(
    OpDef(
        name="argmax_partial",
        kind="compute",
        category="reduction",
        doc="for each of `splits` ranges of `chunk` elements along `axis`, the index (along the whole axis) "
        "of the range's first largest value or first NaN, int64; see megaloop.frontend.ops.argmax_split.",
        operands=("x",),
        attrs={"axis": "int", "splits": "count", "chunk": "count"},
        infer=_partial_infer,
        reference=_partial_reference,
        fast=Fast(_partial_fast),
        accuracy=Accuracy(ulps=0.0),
        tiling=_tilings.ARGMAX_PARTIAL,
        lowering=Lowering("argmax_partial"),
        placement=_placements.rule(lambda node: _other_axes(node)),
    )
)


def _combine_infer(call: OpCall) -> list[OutSpec]:
    check_kinds(call, call.dtype(0), "fi")
    shape = call.shape(0)
    a = call.attrs["axis"] = call.axis(call.attrs["axis"], len(shape))
    splits, _ = _check_ranges(call, shape[a])
    want = shape[:a] + (splits,) + shape[a + 1 :]
    partial = call.operands[1]
    if partial.dtype != dtypes.int64:
        raise call.error(DtypeError, f"partial must be argmax_partial's int64 indices, got {partial.dtype.name}")
    if partial.shape != want:
        raise call.error(
            ShapeError,
            f"partial has shape {format_shape(partial.shape)} but x {format_shape(shape)} split into "
            f"{splits} ranges along axis {a} needs {format_shape(want)}",
        )
    return [OutSpec(reduced_shape(shape, (a,), call.attrs["keepdims"]), dtypes.int64)]


def _combine_reference(arrays: list[np.ndarray], attrs: dict[str, Any]) -> np.ndarray:
    x, a = to_compute(arrays[0]), attrs["axis"]
    # (argmax_partial's indices are in range; the plan interpreter hands a task poison outside the boxes
    # it declared, whose results it drops: clipped so that they can be looked up at all)
    partial = np.clip(arrays[1].astype(np.int64), 0, x.shape[a] - 1)
    values = np.take_along_axis(x, partial, axis=a)  # the ranges' best values, in range order
    best = np.expand_dims(np.argmax(values, axis=a), a)  # the first largest (or first NaN) range
    out = np.take_along_axis(partial, best, axis=a)
    return out if attrs["keepdims"] else np.squeeze(out, axis=a)


ARGMAX_COMBINE = register(
    OpDef(
        name="argmax_combine",
        kind="compute",
        category="reduction",
        doc="argmax along `axis` from argmax_partial's indices (x's values read at them); see "
        "megaloop.frontend.ops.argmax_split.",
        operands=("x", "partial"),
        attrs={"axis": "int", "keepdims": "bool", "splits": "count", "chunk": "count"},
        infer=_combine_infer,
        reference=_combine_reference,
        fast=VALUES_ONLY,
        accuracy=Accuracy(ulps=0.0),
        tiling=_tilings.ARGMAX_COMBINE,
        lowering=Lowering("argmax_combine"),
        placement=_placements.rule(lambda node: _other_axes(node)),
    )
)


def _ranges(x: Tensor, axis: int, splits: int) -> tuple[int, tuple[int, int]]:
    """(axis as a non-negative index, split_ranges of its length); an axis out of range is left to the
    ops' own check (call.axis), which names it."""
    a = axis + x.ndim if -x.ndim <= axis < 0 else axis
    return a, split_ranges(x.shape[a], splits) if 0 <= a < x.ndim else (splits, 1)


def argmax(x: Tensor, axis: int | None = None, *, keepdims: bool = False, splits: int | None = None) -> Tensor:
    """``splits``: split the axis into that many ranges (at most; whole 16-byte packs each) whose
    argmaxes separate tiles find, then one combine (this module's two ops): the same result,
    for an argmax of few outputs over a long axis (a language model's next token)."""
    keepdims = require_bool(ARGMAX, "keepdims", keepdims)
    if splits is not None:
        splits = require_int(ARGMAX, "splits", splits, minimum=1)
    if splits is None or splits == 1:
        return apply(ARGMAX, [x], axis=axis, keepdims=keepdims)
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
        raise AxisError(
            f"argmax: splits needs one int axis, got axis={axis!r}; for the flattened tensor, "
            "reshape x to one axis (x.reshape(-1)) and pass axis=0"
        )
    axis = int(axis)
    _, (ranges, chunk) = _ranges(x, axis, splits)
    if ranges == 1:  # the axis is one range: the plain argmax
        return apply(ARGMAX, [x], axis=axis, keepdims=keepdims)
    partial = apply(ARGMAX_PARTIAL, [x], axis=axis, splits=ranges, chunk=chunk)
    return apply(ARGMAX_COMBINE, [x, partial], axis=axis, keepdims=keepdims, splits=ranges, chunk=chunk)


def argmax_partial(x: Tensor, axis: int, *, splits: int) -> Tensor:
    """The first half on its own (tests, and graphs that combine ranges themselves)."""
    _, (ranges, chunk) = _ranges(x, axis, splits)
    return apply(ARGMAX_PARTIAL, [x], axis=axis, splits=ranges, chunk=chunk)


def argmax_combine(x: Tensor, partial: Tensor, axis: int, *, keepdims: bool = False) -> Tensor:
    """argmax of ``x`` along ``axis`` from ``partial``, argmax_partial's indices of the same x and axis."""
    node = partial.node
    if node.op.name != "argmax_partial":
        raise GraphBuildError(f"argmax_combine: partial must be argmax_partial's output, got {node.op.name}'s")
    if node.inputs[0] is not x or node.attrs["axis"] != _ranges(x, axis, 1)[0]:
        raise GraphBuildError(
            f"argmax_combine: partial is argmax_partial of {node.inputs[0]!r} along axis {node.attrs['axis']}, "
            f"not of x {x!r} along axis {axis}"
        )
    splits, chunk = node.attrs["splits"], node.attrs["chunk"]
    return apply(ARGMAX_COMBINE, [x, partial], axis=axis, keepdims=keepdims, splits=splits, chunk=chunk)

"""Reductions over one or more axes: sum, mean, max, min (with keepdims) and argmax.

Floating reductions accumulate in float32 whatever the storage dtype, and round once to it.
Integer sums accumulate in int64 and wrap to the input dtype.
"""

from __future__ import annotations

import builtins
import math
from dataclasses import replace
from typing import Any

import numpy as np

from megaloop import dtypes
from megaloop.errors import AxisError, ShapeError
from megaloop.frontend.opdef import Accuracy, Lowering, OpCall, OpDef, OutSpec, VjpCall, register
from megaloop.frontend.ops import _placements, _tilings
from megaloop.frontend.ops._build import apply, require_bool
from megaloop.frontend.ops._fast import VALUES_ONLY
from megaloop.frontend.ops._grad import f32
from megaloop.frontend.ops.elementwise import cast, check_kinds, equal, greater, mul, not_equal, to_compute, where
from megaloop.frontend.placement import REPLICATE, LocalCall, Shard, Strategy, bounds, even_sizes
from megaloop.frontend.shapes import normalize_axes
from megaloop.frontend.tensor import BUILDERS as B
from megaloop.frontend.tensor import Tensor


def reduced_shape(shape: tuple[int, ...], axes: tuple[int, ...], keepdims: bool) -> tuple[int, ...]:
    if keepdims:
        return tuple(1 if i in axes else d for i, d in enumerate(shape))
    return tuple(d for i, d in enumerate(shape) if i not in axes)


def _expand(call: VjpCall, g: Tensor) -> Tensor:
    """``g`` (of a reduction's output) spread back over the reduced axes of its operand (a view)."""
    x, axes = call.inputs[0], call.attrs["axis"]
    kept = reduced_shape(x.shape, axes, True)
    return B.broadcast_to(B.reshape(g, kept), x.shape)


def _sum_vjp(call: VjpCall) -> list[Tensor]:
    return [_expand(call, call.cotangent())]


def _mean_vjp(call: VjpCall) -> list[Tensor]:
    x = call.inputs[0]
    count = math.prod(x.shape[a] for a in call.attrs["axis"])
    return [_expand(call, B.cast(f32(call.cotangent()) * (1.0 / count), x.dtype))]


def _extreme_vjp(call: VjpCall) -> list[Tensor]:
    """max / min: the gradient shared equally by the elements that equal the result (PyTorch's amax)."""
    x = call.inputs[0]
    hit = B.equal(x, _expand(call, call.outputs[0]))
    ties = B.sum(B.cast(hit, "float32"), call.attrs["axis"], keepdims=True)
    share = _expand(call, f32(call.cotangent())) / B.broadcast_to(ties, x.shape)
    return [B.cast(B.where(hit, share, 0.0), x.dtype)]


def _reduction(name: str, doc: str, fn: Any, kinds: str, accuracy: Accuracy, placement: Any, vjp: Any = None) -> OpDef:
    def infer(call: OpCall) -> list[OutSpec]:
        check_kinds(call, call.dtype(0), kinds)
        axes = call.axes(call.attrs["axis"], len(call.shape(0)))
        call.attrs["axis"] = axes  # canonical form for later layers
        out = reduced_shape(call.shape(0), axes, call.attrs["keepdims"])
        if name in ("max", "min") and math.prod(out) and not math.prod(call.shape(0)[a] for a in axes):
            raise call.error(
                ShapeError,
                f"{name} over axes {list(axes)} of {list(call.shape(0))}: an empty axis has no {name} "
                "(numpy raises: no identity)",
                hint="slice so that the reduced axes are not empty",
            )
        return [OutSpec(out, call.dtype(0))]

    def reference(arrays: list[np.ndarray], attrs: dict[str, Any]) -> np.ndarray:
        x = arrays[0]
        axes = normalize_axes(attrs["axis"], x.ndim)
        if x.dtype.kind in "iu" and name == "sum":
            return np.sum(x.astype(np.int64), axis=axes, keepdims=attrs["keepdims"]).astype(x.dtype)
        if name == "mean" and not math.prod(x.shape[a] for a in axes):  # numpy's NaN, without its warning
            return np.full(reduced_shape(x.shape, axes, attrs["keepdims"]), np.nan, np.float32)
        return fn(to_compute(x), axis=axes, keepdims=attrs["keepdims"])

    return register(
        OpDef(
            name=name,
            kind="compute",
            category="reduction",
            doc=doc,
            operands=("x",),
            attrs={"axis": "axes", "keepdims": "bool"},
            infer=infer,
            reference=reference,
            fast=VALUES_ONLY,
            accuracy=accuracy,
            tiling=_tilings.REDUCTION,
            lowering=Lowering("reduction"),
            placement=placement,
            vjp=vjp,
        )
    )


def _mean_part(call: LocalCall) -> tuple[Tensor, ...]:
    """A member's share of a mean over an axis it holds a piece of: its sum over the whole count."""
    node = call.node
    total = math.prod(node.inputs[0].shape[a] for a in node.attrs["axis"])
    return (mul(sum(call.operands[0], node.attrs["axis"], keepdims=node.attrs["keepdims"]), 1.0 / total),)


def _mean_dims(node: Any) -> list[_placements.Dim]:
    dims = _placements.reduction_dims(node, "sum")
    return [replace(d, build=_mean_part) if d.reduce else d for d in dims]


def _partial_passes(op: str) -> Any:
    return lambda node, members, given: _placements.partial_through(node, given, (0,), op)


SUM = _reduction(
    "sum",
    "Sum over axes (None: all), float32 accumulation.",
    np.sum,
    "fi",
    Accuracy(ulps=1.0, per_reduction=True),
    _placements.rule(lambda node: _placements.reduction_dims(node, "sum"), _partial_passes("sum")),
    _sum_vjp,
)
MEAN = _reduction(
    "mean",
    "Mean over axes (None: all); floats only.",
    np.mean,
    "f",
    Accuracy(ulps=1.0, per_reduction=True),
    _placements.rule(_mean_dims, _partial_passes("sum")),
    _mean_vjp,
)
MAX = _reduction(
    "max",
    "Maximum over axes (None: all); NaN propagates.",
    np.max,
    "fi",
    Accuracy(ulps=0.0),
    _placements.rule(lambda node: _placements.reduction_dims(node, "max"), _partial_passes("max")),
    _extreme_vjp,
)
MIN = _reduction(
    "min",
    "Minimum over axes (None: all); NaN propagates.",
    np.min,
    "fi",
    Accuracy(ulps=0.0),
    _placements.rule(lambda node: _placements.reduction_dims(node, None)),
    _extreme_vjp,
)


def _axis_arg(axis: Any) -> Any:
    return tuple(axis) if isinstance(axis, list) else axis


def sum(x: Tensor, axis: int | tuple[int, ...] | None = None, *, keepdims: bool = False) -> Tensor:
    return apply(SUM, [x], axis=_axis_arg(axis), keepdims=require_bool(SUM, "keepdims", keepdims))


def mean(x: Tensor, axis: int | tuple[int, ...] | None = None, *, keepdims: bool = False) -> Tensor:
    return apply(MEAN, [x], axis=_axis_arg(axis), keepdims=require_bool(MEAN, "keepdims", keepdims))


def max(x: Tensor, axis: int | tuple[int, ...] | None = None, *, keepdims: bool = False) -> Tensor:
    return apply(MAX, [x], axis=_axis_arg(axis), keepdims=require_bool(MAX, "keepdims", keepdims))


def min(x: Tensor, axis: int | tuple[int, ...] | None = None, *, keepdims: bool = False) -> Tensor:
    return apply(MIN, [x], axis=_axis_arg(axis), keepdims=require_bool(MIN, "keepdims", keepdims))


def _argmax_infer(call: OpCall) -> list[OutSpec]:
    check_kinds(call, call.dtype(0), "fi")
    axis, keepdims = call.attrs["axis"], call.attrs["keepdims"]
    shape = call.shape(0)
    if axis is None:
        if not math.prod(shape):
            raise call.error(ShapeError, f"argmax of an empty tensor {list(shape)}: it has no largest value")
        return [OutSpec(tuple(1 for _ in shape) if keepdims else (), dtypes.int64)]
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
        raise call.error(
            AxisError,
            f"axis must be one int or None, got {axis!r}",
            hint="argmax reduces a single axis; reshape to merge axes first",
        )
    a = call.attrs["axis"] = call.axis(axis, len(shape))
    if shape[a] == 0 and math.prod(d for i, d in enumerate(shape) if i != a):
        raise call.error(ShapeError, f"argmax over axis {a} of size 0: an empty axis has no largest value")
    return [OutSpec(reduced_shape(shape, (a,), keepdims), dtypes.int64)]


def _argmax_split(node: Any, members: int, given: Any) -> list[Strategy]:
    """The axis cut over the members: each finds its first largest value and that value's index along
    the whole axis; the candidates are gathered and the first largest (or first NaN) wins."""
    axis, x = node.attrs["axis"], node.inputs[0]
    if axis is None:
        return []
    found = []
    for sizes in {even_sizes(x.shape[axis], members), *_given_sizes(given[0], axis)}:
        if builtins.min(sizes) >= 1:
            found.append(Strategy((Shard(axis, sizes),), (REPLICATE,), "split argmax", _argmax_part, collective=True))
    return found


def _given_sizes(p: Any, axis: int) -> list[tuple[int, ...]]:
    return [p.sizes] if isinstance(p, Shard) and p.axis == axis and p.sizes else []


def _argmax_part(call: LocalCall) -> tuple[Tensor, ...]:
    x, node = call.operands[0], call.node
    a, keep = node.attrs["axis"], node.attrs["keepdims"]
    lo = bounds(call.strategy.inputs[0].sizes)[call.member][0]
    values = call.collectives.all_gather(max(x, a, keepdims=True), a)
    index = call.collectives.all_gather(apply(ARGMAX, [x], axis=a, keepdims=True) + lo, a)
    nan = not_equal(values, values)
    best = where(
        greater(max(cast(nan, "int32"), a, keepdims=True), 0), nan, equal(values, max(values, a, keepdims=True))
    )
    return (min(where(best, index, node.inputs[0].shape[a]), a, keepdims=keep),)


def _argmax_ref(arrays: list[np.ndarray], attrs: dict[str, Any]) -> np.ndarray:
    x = to_compute(arrays[0])
    axis, keepdims = attrs["axis"], attrs["keepdims"]
    if axis is None:
        out = np.asarray(np.argmax(x))
        return out.reshape((1,) * x.ndim) if keepdims else out
    return np.argmax(x, axis=axis, keepdims=keepdims)


ARGMAX = register(
    OpDef(
        name="argmax",
        kind="compute",
        category="reduction",
        doc="Index of the largest value along one axis (None: of the flattened tensor), int64; "
        "ties and NaNs give the first index.",
        operands=("x",),
        attrs={"axis": "axes", "keepdims": "bool"},
        infer=_argmax_infer,
        reference=_argmax_ref,
        fast=VALUES_ONLY,
        accuracy=Accuracy(ulps=0.0),
        tiling=_tilings.REDUCTION,
        lowering=Lowering("reduction"),
        placement=_placements.rule(lambda node: _placements.reduction_dims(node, None), _argmax_split),
    )
)


# ``ml.argmax``, the builder, is in argmax_split.py: with splits it builds that module's two ops.

"""Layout ops: reshape, permute/transpose, slice (with steps), broadcast_to, split, concat, copy.

reshape, permute, slice, broadcast_to and split are *views*: they move no data, only describe the
same storage with other strides and offset (in elements). When a reshape cannot be expressed as a
view of a strided tensor (e.g. flattening a transposed matrix), the builder inserts a ``copy`` first,
so ``reshape`` itself is always a view. ``concat`` and ``copy`` write new contiguous tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from megaloop.errors import AxisError, DtypeError, GraphBuildError, ShapeError
from megaloop.frontend.opdef import Accuracy, Fast, Lowering, OpCall, OpDef, OutSpec, ViewSpec, VjpCall, register
from megaloop.frontend.ops import _placements, _tilings, _torch
from megaloop.frontend.ops._build import (
    apply,
    apply_multi,
    axes_arg,
    axis_arg,
    require_int,
    require_ints,
    require_shape,
    require_tensor,
)
from megaloop.frontend.ops._fast import MOVES_VALUES
from megaloop.frontend.ops._grad import unbroadcast, zeros
from megaloop.frontend.placement import LocalCall, Shard
from megaloop.frontend.shapes import (
    broadcast_shapes,
    format_shape,
    numel,
    reshape_strides,
)
from megaloop.frontend.tensor import BUILDERS as B
from megaloop.frontend.tensor import Tensor
from megaloop.frontend.validate import as_ints, is_int

_EXACT = Accuracy(ulps=0.0)


def _view_op(
    name: str,
    doc: str,
    infer: Any,
    reference: Any,
    attrs: dict[str, Any],
    placement: Any,
    operands: tuple[str, ...] = ("x",),
    vjp: Any = None,
    on_torch: Any = None,
) -> OpDef:
    """``on_torch(x, attrs)``: the view of a torch tensor (else the reference on numpy views of it)."""
    fast = MOVES_VALUES if on_torch is None else Fast(MOVES_VALUES.make, torch=lambda node: _torch_view(node, on_torch))
    return register(
        OpDef(
            name=name,
            kind="view",
            category="layout",
            doc=doc,
            operands=operands,
            attrs=attrs,
            infer=infer,
            reference=reference,
            fast=fast,
            accuracy=_EXACT,
            placement=placement,
            vjp=vjp,
        )
    )


def _torch_view(node: Any, view: Any) -> Any:
    attrs = node.attrs
    return lambda arrays: [view(arrays[0], attrs)]


def _reshape_part(call: LocalCall) -> tuple[Tensor, ...]:
    """A member's piece reshaped: a copy first if its layout needs one (as ``reshape`` does)."""
    return (reshape(call.operands[0], call.out_shape()),)


def _slice_part(call: LocalCall) -> tuple[Tensor, ...]:
    """The slice of a member's piece: the axis it holds a piece of is whole in the slice."""
    attrs = call.attrs()
    p = call.strategy.inputs[0]
    if isinstance(p, Shard):
        starts, stops = list(attrs["starts"]), list(attrs["stops"])
        starts[p.axis] = stops[p.axis] = None
        attrs["starts"], attrs["stops"] = tuple(starts), tuple(stops)
    return call.graph.apply(SLICE, call.operands, attrs)


def _unslice(call: VjpCall) -> Tensor:
    """A slice's gradient: the cotangent put back at the sliced places of x's shape, zeros elsewhere."""
    x, g = call.inputs[0], call.cotangent()
    for axis, (start, stop, step) in enumerate(zip(call.attrs["starts"], call.attrs["stops"], call.attrs["steps"])):
        size = x.shape[axis]
        start, stop, step = slice(start, stop, step).indices(size)
        n = g.shape[axis]
        if n == size and step == 1:
            continue
        if step < 0:  # the same places in ascending order: the cotangent reversed
            g = slice_(g, *_along(g.ndim, axis, None, None, -1))
            start, step = start + (n - 1) * step, -step
        g = _spread(g, axis, step)  # n * step places from start
        g = _pad(g, axis, start, size)
    return g


def _along(ndim: int, axis: int, start: int | None, stop: int | None, step: int) -> tuple[tuple, tuple, tuple]:
    """slice_'s starts, stops and steps taking [start:stop:step] of one axis, the others whole."""
    starts, stops, steps = [None] * ndim, [None] * ndim, [1] * ndim
    starts[axis], stops[axis], steps[axis] = start, stop, step
    return tuple(starts), tuple(stops), tuple(steps)


def _spread(g: Tensor, axis: int, step: int) -> Tensor:
    """g's entries along ``axis`` each followed by step - 1 zeros."""
    if step == 1:
        return g
    n = g.shape[axis]
    g = reshape(g, (*g.shape[: axis + 1], 1, *g.shape[axis + 1 :]))
    gap = zeros(g, (*g.shape[: axis + 1], step - 1, *g.shape[axis + 2 :]))
    both = B.concat([g, gap], axis + 1)
    return reshape(both, (*both.shape[:axis], n * step, *both.shape[axis + 2 :]))


def _pad(g: Tensor, axis: int, before: int, size: int) -> Tensor:
    """g placed at ``before`` along ``axis`` of a zero tensor ``size`` long there (cut where it overhangs)."""
    if before + g.shape[axis] > size:
        g = slice_(g, *_along(g.ndim, axis, 0, size - before, 1))
    after = size - before - g.shape[axis]
    pieces = [zeros(g, (*g.shape[:axis], before, *g.shape[axis + 1 :]))] if before else []
    pieces.append(g)
    if after:
        pieces.append(zeros(g, (*g.shape[:axis], after, *g.shape[axis + 1 :])))
    return B.concat(pieces, axis) if len(pieces) > 1 else g


# ---- reshape ----------------------------------------------------------------------------------


def _resolve_shape(x: Tensor, shape: Sequence[Any]) -> tuple[int, ...]:
    """Replace one -1 by the size that keeps the element count; ShapeError naming the problem."""
    dims = list(as_ints(shape, f"reshape: {x!r} to {shape!r:.60}: shape", error=ShapeError))
    for d in dims:
        if d < 0 and d != -1:
            raise ShapeError(f"reshape: {x!r} to {tuple(shape)}: sizes must be ints >= 0 (one may be -1)")
    if dims.count(-1) > 1:
        raise ShapeError(f"reshape: {x!r} to {tuple(shape)}: only one size can be -1")
    if -1 in dims:
        known = numel(tuple(d for d in dims if d != -1))
        if known == 0:  # (numpy's rule: any size would do)
            raise ShapeError(f"reshape: cannot infer -1 in {tuple(shape)}: the other sizes hold no element")
        if x.size % known:
            raise ShapeError(f"reshape: cannot infer -1 in {tuple(shape)} for {x.size} elements of {x!r}")
        dims[dims.index(-1)] = x.size // known
    return tuple(int(d) for d in dims)


def _reshape_infer(call: OpCall) -> list[OutSpec]:
    x = call.operands[0]
    shape = call.attrs["shape"]
    if numel(shape) != x.size:
        raise call.error(
            ShapeError, f"cannot reshape {x.size} elements into {format_shape(shape)} ({numel(shape)} elements)"
        )
    strides = reshape_strides(x.shape, x.strides, shape)
    if strides is None:
        raise call.error(
            ShapeError,
            "this layout cannot be reshaped without a copy",
            hint="megaloop.reshape inserts the copy itself; this node was built by hand",
        )
    return [OutSpec(shape, x.dtype, ViewSpec(strides, x.offset))]


RESHAPE = _view_op(
    "reshape",
    "Same elements in row-major order, new shape (one size may be -1); a view, with a "
    "copy inserted first when the input's strides do not allow one.",
    _reshape_infer,
    lambda arrays, attrs: np.reshape(arrays[0], attrs["shape"]),
    {"shape": "shape"},
    _placements.rule(_placements.reshape_dims, _placements.partial_unary, build=_reshape_part),
    vjp=lambda call: [B.reshape(call.cotangent(), call.inputs[0].shape)],
    on_torch=lambda x, attrs: x.reshape(attrs["shape"]),
)


def reshape(x: Tensor, shape: Sequence[int]) -> Tensor:
    require_tensor(RESHAPE, "x", x)
    if is_int(shape):
        shape = (shape,)
    new_shape = _resolve_shape(x, shape)
    if new_shape == x.shape:
        return x
    if numel(new_shape) == x.size and reshape_strides(x.shape, x.strides, new_shape) is None:
        x = copy(x)
    return apply(RESHAPE, [x], shape=new_shape)


def unsqueeze(x: Tensor, axis: int) -> Tensor:
    """Insert a size-1 axis at ``axis`` (counted in the result, as in torch)."""
    require_tensor(RESHAPE, "x", x)
    a = axis_arg("unsqueeze", x, axis, x.ndim + 1)
    return reshape(x, (*x.shape[:a], 1, *x.shape[a:]))


def squeeze(x: Tensor, axis: int | tuple[int, ...] | None = None) -> Tensor:
    """Drop size-1 axes (all of them, or the given ones, which must have size 1)."""
    require_tensor(RESHAPE, "x", x)
    if axis is None:
        axes = tuple(i for i, d in enumerate(x.shape) if d == 1)
    else:
        axes = axes_arg("squeeze", x, axis)
        for a in axes:
            if x.shape[a] != 1:
                raise ShapeError(f"squeeze: axis {a} of {x!r} has size {x.shape[a]}, not 1")
    return reshape(x, tuple(d for i, d in enumerate(x.shape) if i not in axes))


# ---- permute / transpose ------------------------------------------------------------------------


def _permute_infer(call: OpCall) -> list[OutSpec]:
    x = call.operands[0]
    axes = call.attrs["axes"]
    norm = tuple(call.axis(a, x.ndim) for a in axes)
    if sorted(norm) != list(range(x.ndim)):
        raise call.error(AxisError, f"axes {tuple(axes)} must be a permutation of 0..{x.ndim - 1}")
    call.attrs["axes"] = norm
    return [OutSpec(tuple(x.shape[a] for a in norm), x.dtype, ViewSpec(tuple(x.strides[a] for a in norm), x.offset))]


PERMUTE = _view_op(
    "permute",
    "Reorder axes (a view): out.shape[i] = x.shape[axes[i]].",
    _permute_infer,
    lambda arrays, attrs: np.transpose(arrays[0], attrs["axes"]),
    {"axes": "ints"},
    _placements.rule(_placements.permute_dims, _placements.partial_unary),
    vjp=lambda call: [B.permute(call.cotangent(), tuple(int(i) for i in np.argsort(call.attrs["axes"])))],
    on_torch=lambda x, attrs: x.permute(attrs["axes"]),
)


def permute(x: Tensor, axes: Sequence[int]) -> Tensor:
    return apply(PERMUTE, [x], axes=require_ints(PERMUTE, "axes", axes))


def transpose(x: Tensor, axis0: int = -2, axis1: int = -1) -> Tensor:
    """Swap two axes (a view)."""
    require_tensor(PERMUTE, "x", x)
    perm = list(range(x.ndim))
    a, b = axis_arg("transpose", x, axis0), axis_arg("transpose", x, axis1)
    perm[a], perm[b] = perm[b], perm[a]
    return permute(x, perm)


# ---- slice / getitem ----------------------------------------------------------------------------


def _slice_infer(call: OpCall) -> list[OutSpec]:
    x = call.operands[0]
    starts, stops, steps = call.attrs["starts"], call.attrs["stops"], call.attrs["steps"]
    if not len(starts) == len(stops) == len(steps) == x.ndim:
        raise call.error(ShapeError, f"starts/stops/steps need one entry per axis ({x.ndim})")
    shape, strides, offset = [], [], x.offset
    for axis, (start, stop, step, size, stride) in enumerate(zip(starts, stops, steps, x.shape, x.strides)):
        if step == 0:
            raise call.error(GraphBuildError, f"step of axis {axis} is 0")
        start, stop, step = slice(start, stop, step).indices(size)
        n = len(range(start, stop, step))
        shape.append(n)
        strides.append(stride * step)
        offset += start * stride
    return [OutSpec(tuple(shape), x.dtype, ViewSpec(tuple(strides), offset))]


def _slice_ref(arrays: list[np.ndarray], attrs: dict[str, Any]) -> np.ndarray:
    index = tuple(slice(a, b, c) for a, b, c in zip(attrs["starts"], attrs["stops"], attrs["steps"]))
    return arrays[0][index]


SLICE = _view_op(
    "slice",
    "Python slicing per axis, start:stop:step (negative steps too); a view.",
    _slice_infer,
    _slice_ref,
    {"starts": "bounds", "stops": "bounds", "steps": "ints"},
    _placements.rule(_placements.slice_dims, _placements.partial_unary, build=_slice_part),
    vjp=lambda call: [_unslice(call)],
)


def slice_(
    x: Tensor, starts: Sequence[int | None], stops: Sequence[int | None], steps: Sequence[int | None] | None = None
) -> Tensor:
    """x[starts[0]:stops[0]:steps[0], ...] with Python's rules for None and negative values."""
    require_tensor(SLICE, "x", x)
    starts = require_ints(SLICE, "starts", starts, allow_none=True)
    stops = require_ints(SLICE, "stops", stops, allow_none=True)
    steps = (1,) * len(starts) if steps is None else require_ints(SLICE, "steps", steps, allow_none=True)
    return apply(SLICE, [x], starts=starts, stops=stops, steps=tuple(1 if s is None else s for s in steps))


def getitem(x: Tensor, index: Any) -> Tensor:
    """numpy basic indexing: ints, slices, ``...`` and ``None``. Advanced (array) indexing is refused:
    use ``embedding`` to gather rows."""
    require_tensor(SLICE, "x", x)
    items = list(index) if isinstance(index, tuple) else [index]
    for it in items:
        if isinstance(it, bool) or not (it is None or it is Ellipsis or isinstance(it, (int, np.integer, slice))):
            raise GraphBuildError(
                f"indexing {x!r} with {type(it).__name__} {it!r:.60} is not supported; "
                "use ints, slices, ... and None (gather rows with megaloop.embedding)"
            )
    if items.count(Ellipsis) > 1:
        raise GraphBuildError(f"indexing {x!r}: only one ... is allowed")
    used = sum(1 for it in items if it is not None and it is not Ellipsis)
    if used > x.ndim:
        raise AxisError(f"indexing {x!r} with {used} indices, but it has only {x.ndim} axes")
    if Ellipsis in items:
        k = items.index(Ellipsis)
        items[k : k + 1] = [slice(None)] * (x.ndim - used)
    else:
        items += [slice(None)] * (x.ndim - used)
    starts, stops, steps, out_shape = [], [], [], []
    axis = 0
    for it in items:
        if it is None:
            out_shape.append(1)
            continue
        size = x.shape[axis]
        if isinstance(it, slice):
            starts.append(it.start)
            stops.append(it.stop)
            steps.append(1 if it.step is None else it.step)
            if steps[-1] != 0:
                out_shape.append(len(range(*it.indices(size))))
        else:
            i = int(it)
            if not -size <= i < size:
                raise AxisError(f"index {i} is out of range for axis {axis} of {x!r} (size {size})")
            i %= size
            starts.append(i)
            stops.append(i + 1)
            steps.append(1)
        axis += 1
    y = x
    if any(not (a in (None, 0) and b is None and c == 1) for a, b, c in zip(starts, stops, steps)):
        y = slice_(x, starts, stops, steps)
    return reshape(y, tuple(out_shape)) if tuple(out_shape) != y.shape else y


# ---- broadcast_to -------------------------------------------------------------------------------


def _broadcast_infer(call: OpCall) -> list[OutSpec]:
    x = call.operands[0]
    shape = call.attrs["shape"]
    if len(shape) < x.ndim or broadcast_shapes(x.shape, shape) != shape:
        raise call.error(
            ShapeError,
            f"cannot broadcast {format_shape(x.shape)} to {format_shape(shape)}",
            hint="each axis of x must be 1 or equal the target size, aligned from the right",
        )
    lead = len(shape) - x.ndim
    strides = [0] * lead + [0 if (d == 1 and s != 1) else st for d, s, st in zip(x.shape, shape[lead:], x.strides)]
    return [OutSpec(tuple(shape), x.dtype, ViewSpec(tuple(strides), x.offset))]


BROADCAST_TO = _view_op(
    "broadcast_to",
    "Repeat size-1 (or missing leading) axes to a larger shape without copying (stride 0).",
    _broadcast_infer,
    lambda arrays, attrs: np.broadcast_to(arrays[0], attrs["shape"]),
    {"shape": "shape"},
    _placements.rule(_placements.broadcast_dims, _placements.partial_unary),
    vjp=lambda call: [unbroadcast(call.cotangent(), call.inputs[0].shape)],
)


def broadcast_to(x: Tensor, shape: Sequence[int]) -> Tensor:
    shape = require_shape(BROADCAST_TO, "shape", shape)
    if isinstance(x, Tensor) and shape == x.shape:
        return x
    return apply(BROADCAST_TO, [x], shape=shape)


# ---- split ------------------------------------------------------------------------------------


def _split_infer(call: OpCall) -> list[OutSpec]:
    x = call.operands[0]
    axis = call.axis(call.attrs["axis"], x.ndim)
    call.attrs["axis"] = axis
    sizes = call.attrs["sizes"]
    if sum(sizes) != x.shape[axis] or any(s < 1 for s in sizes):
        raise call.error(
            ShapeError, f"sizes {list(sizes)} must be >= 1 and add up to axis {axis}'s size {x.shape[axis]}"
        )
    outs, start = [], 0
    for s in sizes:
        shape = x.shape[:axis] + (s,) + x.shape[axis + 1 :]
        outs.append(OutSpec(shape, x.dtype, ViewSpec(x.strides, x.offset + start * x.strides[axis])))
        start += s
    return outs


def _split_ref(arrays: list[np.ndarray], attrs: dict[str, Any]) -> list[np.ndarray]:
    return np.split(arrays[0], np.cumsum(attrs["sizes"])[:-1], axis=attrs["axis"])


SPLIT = _view_op(
    "split",
    "Cut one axis into consecutive pieces of the given sizes (views).",
    _split_infer,
    _split_ref,
    {"axis": "int", "sizes": "ints"},
    _placements.rule(lambda node: _placements.along_dims(node, node.attrs["axis"]), _placements.partial_unary),
    vjp=lambda call: [B.concat([call.cotangent(i) for i in range(len(call.outputs))], call.attrs["axis"])],
)


def split(x: Tensor, sections: int | Sequence[int], axis: int = 0) -> tuple[Tensor, ...]:
    """``sections`` is a number of equal pieces, or the list of piece sizes."""
    require_tensor(SPLIT, "x", x)
    a = axis_arg("split", x, axis)
    if isinstance(sections, (int, np.integer)):
        n = require_int(SPLIT, "sections", sections, minimum=1)
        if x.shape[a] % n:
            raise ShapeError(
                f"split: axis {a} of {x!r} has size {x.shape[a]}, which {n} pieces cannot share "
                "equally; pass a list of sizes"
            )
        sizes = (x.shape[a] // n,) * n
    elif isinstance(sections, (list, tuple)):
        sizes = tuple(require_int(SPLIT, f"sections[{i}]", s) for i, s in enumerate(sections))
    else:
        raise GraphBuildError(
            f"split: sections must be an int (equal pieces) or a list of piece sizes, got "
            f"{type(sections).__name__} {sections!r:.60}"
        )
    return apply_multi(SPLIT, [x], axis=a, sizes=sizes)


# ---- concat / copy ------------------------------------------------------------------------------


def _concat_infer(call: OpCall) -> list[OutSpec]:
    first = call.operands[0]
    axis = call.axis(call.attrs["axis"], first.ndim)
    call.attrs["axis"] = axis
    total = 0
    for i, t in enumerate(call.operands):
        if t.dtype != first.dtype:
            raise call.error(DtypeError, f"{call.name(i)} is {t.dtype.name} but {call.name(0)} is {first.dtype.name}")
        if t.ndim != first.ndim or any(a != b for k, (a, b) in enumerate(zip(t.shape, first.shape)) if k != axis):
            raise call.error(
                ShapeError,
                f"{call.name(i)} {format_shape(t.shape)} must match {call.name(0)} "
                f"{format_shape(first.shape)} on every axis but {axis}",
            )
        total += t.shape[axis]
    return [OutSpec(first.shape[:axis] + (total,) + first.shape[axis + 1 :], first.dtype)]


CONCAT = register(
    OpDef(
        name="concat",
        kind="compute",
        category="layout",
        doc="Join tensors of one dtype along an axis (all other sizes equal).",
        operands=("*tensors",),
        attrs={"axis": "int"},
        infer=_concat_infer,
        reference=lambda arrays, attrs: np.concatenate(arrays, axis=attrs["axis"]),
        fast=MOVES_VALUES,
        accuracy=_EXACT,
        tiling=_tilings.CONCAT,
        lowering=Lowering("concat"),
        placement=_placements.rule(
            lambda node: _placements.along_dims(node, node.attrs["axis"]), _placements.partial_all
        ),
        vjp=lambda call: list(
            B.split(call.cotangent(), [t.shape[call.attrs["axis"]] for t in call.inputs], call.attrs["axis"])
        ),
    )
)


def concat(tensors: Sequence[Tensor], axis: int = 0) -> Tensor:
    if isinstance(tensors, Tensor) or not isinstance(tensors, (list, tuple)):
        raise GraphBuildError(
            "concat takes a list of tensors: concat([x, y], axis=0), not concat(x, y); its first argument is "
            + (repr(tensors) if isinstance(tensors, Tensor) else f"{type(tensors).__name__} {tensors!r:.60}")
        )
    tensors = list(tensors)
    if not tensors:
        raise GraphBuildError("concat: needs at least one tensor")
    if len(tensors) == 1:
        x = require_tensor(CONCAT, "tensors[0]", tensors[0])
        axis_arg("concat", x, axis)
        return x
    return apply(CONCAT, tensors, axis=axis)


COPY = register(
    OpDef(
        name="copy",
        kind="compute",
        category="layout",
        doc="Materialise x as a new contiguous tensor (same values).",
        operands=("x",),
        infer=lambda call: [OutSpec(call.shape(0), call.dtype(0))],
        reference=lambda arrays, attrs: np.array(arrays[0], copy=True),
        fast=Fast(MOVES_VALUES.make, torch=lambda node: lambda arrays: [_torch.copied(arrays[0])]),
        accuracy=_EXACT,
        tiling=_tilings.ELEMENTWISE,
        lowering=Lowering("elementwise", "a"),
        placement=_placements.rule(_placements.elementwise_dims, _placements.partial_unary),
        vjp=lambda call: [call.cotangent()],
    )
)


def copy(x: Tensor) -> Tensor:
    return apply(COPY, [x])

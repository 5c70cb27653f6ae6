"""Shape and stride arithmetic shared by the op definitions.

Functions here return ``None`` or raise ``ValueError`` on bad input; the op definitions turn that
into a megaloop error that names the op and operand, since only they know which op is asking.
Strides and offsets are counted in elements, not bytes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

Shape = tuple[int, ...]


def broadcast_shapes(*shapes: Shape) -> Shape | None:
    """numpy's broadcasting rule; ``None`` when the shapes are incompatible."""
    ndim = max((len(s) for s in shapes), default=0)
    out: list[int] = []
    for i in range(ndim):
        size = 1
        for s in shapes:
            d = s[len(s) - ndim + i] if len(s) - ndim + i >= 0 else 1
            if d == 1:
                continue
            if size not in (1, d):
                return None
            size = d
        out.append(size)
    return tuple(out)


def normalize_axis(axis: int, ndim: int) -> int:
    """Map a possibly negative axis into ``range(ndim)``; ``ValueError`` when out of range."""
    if isinstance(axis, np.integer):
        axis = int(axis)
    if not isinstance(axis, int) or isinstance(axis, bool):
        raise ValueError(f"axis must be an int, got {type(axis).__name__} {axis!r}")
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} is out of range for a tensor of rank {ndim} (valid: {-ndim}..{ndim - 1})")
    return axis % ndim


def normalize_axes(axes: int | Sequence[int] | None, ndim: int) -> tuple[int, ...]:
    """Axes as a sorted tuple of distinct non-negative ints; ``None`` means every axis."""
    if axes is None:
        return tuple(range(ndim))
    if isinstance(axes, (int, np.integer)):
        axes = (axes,)
    if not isinstance(axes, (tuple, list)):
        raise ValueError(f"axis must be an int, a tuple of ints or None, got {type(axes).__name__} {axes!r}")
    out = tuple(normalize_axis(a, ndim) for a in axes)
    if len(set(out)) != len(out):
        raise ValueError(f"axes {tuple(axes)} name the same axis twice")
    return tuple(sorted(out))


def contiguous_strides(shape: Shape) -> Shape:
    """Row-major (C order) strides in elements."""
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    return tuple(strides)


def is_contiguous(shape: Shape, strides: Shape) -> bool:
    """True when the layout is row-major dense (size-1 dimensions may carry any stride)."""
    expected = 1
    for size, stride in zip(reversed(shape), reversed(strides)):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def numel(shape: Shape) -> int:
    return math.prod(shape)


def reshape_strides(shape: Shape, strides: Shape, new_shape: Shape) -> Shape | None:
    """Strides that view a ``(shape, strides)`` layout as ``new_shape`` without copying.

    ``None`` when no such strides exist (the reshape then needs a copy). The rule: split both
    shapes into runs of dimensions whose product matches; each old run must be internally
    contiguous (stride[i] == stride[i+1] * size[i+1]), and the new run's strides are then the
    contiguous strides of the new sizes scaled by the run's innermost stride.
    """
    if 0 in new_shape:  # no element: any layout views it (contiguous strides, as a fresh tensor's)
        return contiguous_strides(new_shape)
    old = [(s, st) for s, st in zip(shape, strides) if s != 1]
    new_strides = [0] * len(new_shape)
    oi = 0
    ni = 0
    while ni < len(new_shape):
        if new_shape[ni] == 1:
            new_strides[ni] = 1  # any stride works for a size-1 dimension
            ni += 1
            continue
        # Grow an old run and a new run until their products agree.
        o_start, n_start = oi, ni
        o_prod = old[oi][0]
        n_prod = new_shape[ni]
        oi += 1
        ni += 1
        while o_prod != n_prod:
            if o_prod < n_prod:
                o_prod *= old[oi][0]
                oi += 1
            else:
                n_prod *= new_shape[ni]
                ni += 1
        for k in range(o_start, oi - 1):
            if old[k][1] != old[k + 1][1] * old[k + 1][0]:
                return None
        stride = old[oi - 1][1]
        for k in range(ni - 1, n_start - 1, -1):
            if new_shape[k] == 1:
                new_strides[k] = 1
                continue
            new_strides[k] = stride
            stride *= new_shape[k]
    return tuple(new_strides)


def format_shape(shape: Shape) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"

"""Tile templates of the reductions (sum, mean, max, min, argmax over one or more axes): a warp per
output element, or the whole block per output element where the reduced elements are a long
contiguous run (megaloop.frontend.ops.reduce has the semantics: float32 accumulation, NaN propagation,
argmax's first index). The loops and the warps' combination are megaloop/reduce.cuh's; Python picks
the path and writes the layouts as template arguments."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from megaloop.codegen.emit import Operand, pointers

REDUCE_OPS = {
    "sum": "ml::RED_SUM",
    "mean": "ml::RED_MEAN",
    "max": "ml::RED_MAX",
    "min": "ml::RED_MIN",
    "argmax": "ml::RED_ARGMAX",
}


def _at(strides: Sequence[int], pointer: str) -> str:
    """``ml::at<strides...>(pointer)`` (megaloop/elementwise.cuh): strides in the output's index space."""
    return f"ml::at<{', '.join(str(s) for s in strides)}>({pointer})"


def reduction(op: str, attrs: dict[str, Any], x: Operand, out: Operand) -> list[str]:
    """``ml::reduce_warps`` (a warp an output element) or, for a long contiguous run of reduced
    elements, ``ml::reduce_block`` (the whole block on each output element)."""
    axis = attrs["axis"]
    axes = tuple(range(len(x.shape))) if axis is None else (axis,) if isinstance(axis, int) else tuple(axis)
    keep = attrs["keepdims"]
    # x's stride along each output axis: a kept axis's own, 0 along the reduced ones kept as size 1
    in_out = [0] * len(out.shape)
    j = 0
    for d in range(len(x.shape)):
        if d in axes:
            j += keep
        else:
            in_out[j] = x.strides[d]
            j += 1
    total = math.prod(x.shape[d] for d in axes)
    operands = f"{_at(out.strides, 'out0')}, {_at(in_out, 'in0')}"
    body = pointers([x, out], 1)
    if total >= BLOCK_REDUCTION_MIN and _contiguous_run(x, axes):
        width = 16 // x.dtype.itemsize
        return [
            *body,
            f"// the whole block on each output element: {total} consecutive elements, {width} a 16-byte pack",
            f"ml::reduce_block<{REDUCE_OPS[op]}, {total}, {BLOCK_REDUCTION_PACKS}>(t, {operands});",
        ]
    if _contiguous_run(x, axes):  # r is the offset itself (no 64-bit divisions an element)
        red = "ml::Run"
    else:
        red = f"ml::Axes<{', '.join(f'ml::Dim<{x.shape[d]}, {x.strides[d]}>' for d in axes)}>"
    path = "reduce_threads" if total <= THREAD_REDUCTION_MAX else "reduce_warps"
    return [*body, f"ml::{path}<{REDUCE_OPS[op]}, {total}, {red}>(t, {operands});"]


# Reductions of at least this many elements an output element take the whole block per output element
# (16-byte packs, several in flight a thread), not a warp: the argmax over a Llama-3.2 vocabulary
# (128256 logits) took one warp's scalar loads 296 us of a 1.7 ms generation step (H200).
BLOCK_REDUCTION_MIN = 8192
BLOCK_REDUCTION_PACKS = 4  # 16-byte packs a thread loads before it folds them in
# At most this many elements an output element take a thread each (in index order), not a warp: a
# warp summing a split-K product's 4 partials would leave 28 of its lanes idle.
THREAD_REDUCTION_MAX = 16


def _contiguous_run(x: Operand, axes: tuple[int, ...]) -> bool:
    """The reduced axes of ``x`` are one row-major run of memory: the elements of an output element are
    ``total`` consecutive ones from its base."""
    ordered = sorted(axes)
    if not ordered:  # no axis reduced: the one element at base
        return True
    if ordered != list(range(ordered[0], ordered[0] + len(ordered))):
        return False
    step = 1
    for d in reversed(ordered):
        if x.shape[d] > 1 and x.strides[d] != step:
            return False
        step *= x.shape[d]
    return True


def argmax_partial(attrs: dict[str, Any], x: Operand, out: Operand) -> list[str]:
    """argmax_partial: the whole block on each range of the axis (megaloop.frontend.ops.argmax_split),
    its index along the whole axis stored."""
    a, chunk, n = attrs["axis"], attrs["chunk"], x.shape[attrs["axis"]]
    in_out = [0 if d == a else s for d, s in enumerate(x.strides)]
    return [
        *pointers([x, out], 1),
        f"// the whole block on each range of {chunk} elements of axis {a} ({n} in all; the last range shorter)",
        f"ml::argmax_partial<{a}, {n}, {chunk}, {x.strides[a]}, {BLOCK_REDUCTION_PACKS}>(t, "
        f"{_at(out.strides, 'out0')}, {_at(in_out, 'in0')});",
    ]


COMBINE_BATCH = 4  # ranges a lane of argmax_combine loads at once (128 ranges: one batch, two trips)


def argmax_combine(attrs: dict[str, Any], x: Operand, partial: Operand, out: Operand) -> list[str]:
    """argmax_combine: a warp an output element, a lane a few ranges: their indices loaded together,
    then x's values at them together (two trips, not one a range), folded in range order, the lanes
    combined (ties to the smaller index: the earlier range)."""
    a, keep, splits = attrs["axis"], attrs["keepdims"], attrs["splits"]
    per_lane = min(COMBINE_BATCH, -(-splits // 32))  # ranges a lane loads at once (a batch)
    # x's and partial's strides along each output axis: the same with keepdims, shifted past a without
    out_of = {d: d if keep or d < a else d - 1 for d in range(len(x.shape)) if d != a}

    def in_out(o: Operand) -> list[int]:
        strides = [0] * len(out.shape)
        for d, j in out_of.items():
            strides[j] = o.strides[d]
        return strides

    return [
        *pointers([x, partial, out], 2),
        f"ml::argmax_combine<{splits}, {per_lane}, {x.strides[a]}, {partial.strides[a]}>(t, "
        f"{_at(out.strides, 'out0')}, {_at(in_out(x), 'in0')}, {_at(in_out(partial), 'in1')});",
    ]

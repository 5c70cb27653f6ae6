"""The optimizer's tiles (megaloop/codegen/include/megaloop/optim.cuh, optim_norm.cuh): one call each of
``ml::opt::<op>`` for the in-place updates (megaloop/frontend/ops/optim.py; the elementwise loop of
megaloop/elementwise.cuh with the tile's scalars computed once), ``ml::opt::square_sum`` and
``ml::opt::lr_schedule`` (megaloop/frontend/ops/optim_norm.py). Python writes the operands' strides, the
packed path's width, the ranges' rows and the op's constants (its Lowering gives them, as C++)."""

from __future__ import annotations

from typing import Any

from megaloop.codegen.emit import Operand, _at, _elementwise_packs, pointers
from megaloop.frontend.shapes import contiguous_strides


def update(op: str, attrs: dict[str, Any], constants: str, ins: list[Operand], out: Operand) -> list[str]:
    """``ml::opt::<op><W, U>(t, out, operands..., constants)``: every operand in the output's index space
    (the 0-d scalars with no strides that move); the packed path sized over the tensors alone."""
    nd = len(out.shape)
    tensors = [o for o in ins if o.shape]
    width, unroll = _elementwise_packs(tensors, out, attrs.get("codegen", {}))
    operands = [_at(out.strides, "out0")] + [
        _at(o.strides if o.shape else (0,) * nd, f"in{k}", nd) for k, o in enumerate(ins)
    ]
    return [
        *pointers(ins + [out], len(ins)),
        f"// {op}: in place, an element a thread (megaloop/optim.cuh)",
        *([f"// packed path: {width} elements a load, {unroll} per operand in flight"] if width else []),
        f"ml::opt::{op}<{width}, {unroll}>(t, {', '.join(operands)}, {constants});",
    ]


SQUARE_SUM_SHARED = 32 * 4  # optim_norm.cuh's square_sum: a float a warp (at most 32 warps)


def square_sum(attrs: dict[str, Any], x: Operand, out: Operand) -> list[str]:
    """``ml::opt::square_sum``: a range of x's rows a tile (a 0-d x as one row)."""
    shape, strides = (x.shape, x.strides) if x.shape else ((1,), (1,))
    rows, splits = shape[0], attrs["splits"]
    per = -(-rows // splits)
    contiguous = tuple(strides) == tuple(contiguous_strides(shape))
    inner = ", ".join(str(d) for d in shape[1:])
    return [
        *pointers([x, out], 1),
        f"// sums of squares of {splits} ranges of {per} rows of x{list(x.shape)} (megaloop/optim_norm.cuh)",
        f"ml::opt::square_sum<{rows}, {per}, {'true' if contiguous else 'false'}, ml::opt::Dims<{inner}>>(t, "
        f"{_at(out.strides, 'out0')}, {_at(strides, 'in0')});",
    ]


def lr_schedule(constants: str, counter: Operand, out: Operand) -> list[str]:
    return [
        *pointers([counter, out], 1),
        "// the learning rate of the step counter's update (megaloop/optim_norm.cuh)",
        f"ml::opt::lr_schedule(t, ml::at<>(out0), ml::at<>(in0), {constants});",
    ]

"""rmsnorm_linear: rmsnorm(x [+ residual], norm_weight) @ w.T as one op, so that on a decode step
the projections' own tiles norm their few rows and the norm is no stage of its own (made by the fuse
stage, megaloop/fuse/rules/rmsnorm_linear.py, for one sequence of at most NORMED_ROWS rows)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np

from megaloop.dtypes import as_dtype, round_to
from megaloop.errors import ShapeError
from megaloop.frontend.opdef import Accuracy, Fast, Lowering, OpCall, OpDef, OutSpec, register
from megaloop.frontend.ops import _placements, _tilings
from megaloop.frontend.ops._build import apply
from megaloop.frontend.ops._fast import Kernel, rounder, weight_product
from megaloop.frontend.ops._torch import of, torch
from megaloop.frontend.ops.elementwise import check_kinds, tensor_dtype, to_compute
from megaloop.frontend.ops.normalization import RMSNORM, _eps, _rmsnorm_ref, rms_rows, rmsnorm_torch
from megaloop.frontend.shapes import format_shape
from megaloop.frontend.tensor import Tensor
from megaloop.frontend.tiling import Box, Read, Tile, Tiling

NORMED_ROWS = 4  # rows a tile norms itself (the weight ring's tiles take at most 4: codegen/emit_matmul.py)
OPERANDS = ("x", "w", "norm_weight", "residual")


def _infer(call: OpCall) -> list[OutSpec]:
    x, w, g = call.operands[:3]
    dtype = tensor_dtype(call)
    check_kinds(call, dtype, "f")
    if x.ndim < 2 or w.ndim != 2:
        raise call.error(
            ShapeError,
            f"x must be [..., rows, K] and w [N, K]; got x {format_shape(x.shape)}, w {format_shape(w.shape)}",
        )
    k = x.shape[-1]
    if w.shape[1] != k:
        raise call.error(ShapeError, f"w is {format_shape(w.shape)} but must be [N, {k}] (x's last axis is {k})")
    if g.shape != (k,):
        raise call.error(ShapeError, f"norm_weight is {format_shape(g.shape)} but must be [{k}]")
    if len(call.operands) > 3 and call.operands[3].shape != x.shape:
        raise call.error(
            ShapeError, f"residual is {format_shape(call.operands[3].shape)} but must be x's {format_shape(x.shape)}"
        )
    return [OutSpec((*x.shape[:-1], w.shape[0]), dtype)]


def _reference(arrays: list[np.ndarray], attrs: dict[str, Any]) -> np.ndarray:
    """The rows rmsnorm would store (rounded to the dtype), times w.T."""
    x, w, g, *residual = arrays
    normed = _rmsnorm_ref([x, g, *residual], {"eps": attrs["eps"]})
    return np.matmul(to_compute(round_to(normed, as_dtype(x.dtype))), np.swapaxes(to_compute(w), -1, -2))


def _fast(node: Any) -> Kernel:
    """The reference's values from compute-form operands, the weight not copied."""
    finish = rounder(node.outputs[0].dtype, in_place=True)
    normed = rms_rows(node, node.attrs["eps"], rounder(node.inputs[0].dtype, in_place=True))

    def run(arrays: list[np.ndarray]) -> list[np.ndarray]:
        x, w, g, *residual = arrays
        rows = normed(x, g, residual[0] if residual else None)
        return [weight_product(rows, w, finish)]

    return run


def _on_torch(node: Any) -> Any:
    """rmsnorm's torch kernel, then torch's product (the weight in its dtype, not converted)."""
    x, residual = node.inputs[0], node.inputs[3:]
    norm = rmsnorm_torch(node.attrs["eps"], (x.dtype, node.inputs[2].dtype, x.dtype), 1, 2 if residual else None)
    dtype = node.outputs[0].dtype

    def run(arrays: list[Any]) -> list[Any]:
        rows = norm([arrays[0], arrays[2], *arrays[3:]])[0]
        return [torch().matmul(of(rows, dtype), of(arrays[1], dtype).mT)]

    return run


def _as_matmul(node: Any, inputs: Any) -> Any:
    """The node as the matmul x @ w.T that the matmul tiling and placement rules read."""
    return SimpleNamespace(inputs=inputs, outputs=node.outputs, attrs={"transpose_a": False, "transpose_b": True})


def _tiles(node: Any, params: dict[str, int], ctx: Any) -> list[Tile]:
    """The matmul's tiles, each also reading the norm's weight and its rows' residual."""
    k = node.inputs[0].shape[-1]
    tiles = []
    for t in _tilings.MATMUL.make(_as_matmul(node, node.inputs[:2]), params, ctx):
        extra = (Read(2, Box((0,), (k,))),) + ((Read(3, t.reads[0].box),) if len(node.inputs) > 3 else ())
        tiles.append(t._replace(reads=t.reads + extra))
    return tiles


def _dims(node: Any) -> list[Any]:
    # rows and columns can be cut (x, its residual, w's rows); never K: every tile norms whole rows
    a_slots = (0, 3) if len(node.inputs) > 3 else (0,)
    return _placements.matmul_dims(_as_matmul(node, node.inputs), a_slots, 1, k=False)


RMSNORM_LINEAR = register(
    OpDef(
        name="rmsnorm_linear",
        kind="compute",
        category="matmul",
        doc="rmsnorm(x, norm_weight, eps, residual) @ w.T in one op: the rows rmsnorm would store (x + "
        "residual rounded first where given; the normed rows rounded to the dtype), times the weight "
        "[N, K] transposed. On the GPU each tile norms its own rows (decode steps: few rows).",
        operands=OPERANDS,
        attrs={"eps": "number"},
        infer=_infer,
        reference=_reference,
        fast=Fast(_fast, torch=_on_torch),
        accuracy=Accuracy(ulps=2.0, per_reduction=True),
        tiling=Tiling(
            _tilings.MATMUL.params,
            _tiles,
            "the matmul's tiles (x @ w.T), each norming its rows: " + _tilings.MATMUL.doc,
            flags=_tilings.MATMUL.flags,
            saved_without=_tilings.MATMUL.saved_without,
        ),
        lowering=Lowering("rmsnorm_linear"),
        placement=_placements.rule(_dims),
    )
)


def rmsnorm_linear(
    x: Tensor, w: Tensor, norm_weight: Tensor, *, eps: float = 1e-5, residual: Tensor | None = None
) -> Tensor:
    """rmsnorm(x, norm_weight, eps=eps, residual=residual) @ w.T, the norm made by the product's tiles."""
    operands = [x, w, norm_weight] + ([residual] if residual is not None else [])
    return apply(RMSNORM_LINEAR, operands, eps=_eps(RMSNORM, eps))

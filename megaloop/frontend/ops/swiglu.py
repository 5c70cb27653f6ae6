"""swiglu_linear: silu(x @ gate.T) * (x @ up.T) as one op, optionally of rmsnorm(x [+ residual]), so
that on a decode step the gate and up projections' tiles make SwiGLU's product in their epilogue and
silu_mul is no stage of its own (made by the fuse stage, megaloop/fuse/rules/swiglu_linear.py, for a
few rows of one sequence)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from megaloop.dtypes import as_dtype, round_to
from megaloop.errors import GraphBuildError, ShapeError
from megaloop.frontend.opdef import Accuracy, Fast, Lowering, OpCall, OpDef, OutSpec, register
from megaloop.frontend.ops import _placements, _tilings
from megaloop.frontend.ops._build import apply
from megaloop.frontend.ops._fast import Kernel, dense, rounder, weight_product
from megaloop.frontend.ops.elementwise import _sigmoid, check_kinds, silu_times, tensor_dtype, to_compute
from megaloop.frontend.ops.norm_linear import _as_matmul
from megaloop.frontend.ops.normalization import RMSNORM, _eps, _rmsnorm_ref, rms_rows
from megaloop.frontend.shapes import format_shape
from megaloop.frontend.tensor import Tensor
from megaloop.frontend.tiling import Box, Read, Tile, Tiling

OPERANDS = ("x", "gate", "up", "norm_weight", "residual")


def _infer(call: OpCall) -> list[OutSpec]:
    x, gate, up = call.operands[:3]
    dtype = tensor_dtype(call)
    check_kinds(call, dtype, "f")
    if x.ndim < 2 or gate.ndim != 2:
        raise call.error(
            ShapeError,
            f"x must be [..., rows, K] and gate [N, K]; got x {format_shape(x.shape)}, gate {format_shape(gate.shape)}",
        )
    k = x.shape[-1]
    if gate.shape[1] != k:
        raise call.error(ShapeError, f"gate is {format_shape(gate.shape)} but must be [N, {k}] (x's last axis is {k})")
    if up.shape != gate.shape:
        raise call.error(ShapeError, f"up is {format_shape(up.shape)} but must be gate's {format_shape(gate.shape)}")
    if len(call.operands) > 3:
        if "eps" not in call.attrs:
            raise call.error(GraphBuildError, "a norm_weight needs the norm's eps attribute")
        if call.operands[3].shape != (k,):
            raise call.error(ShapeError, f"norm_weight is {format_shape(call.operands[3].shape)} but must be [{k}]")
    if len(call.operands) > 4 and call.operands[4].shape != x.shape:
        raise call.error(
            ShapeError, f"residual is {format_shape(call.operands[4].shape)} but must be x's {format_shape(x.shape)}"
        )
    return [OutSpec((*x.shape[:-1], gate.shape[0]), dtype)]


def _reference(arrays: list[np.ndarray], attrs: dict[str, Any]) -> np.ndarray:
    """silu_mul of the two products as matmuls would store them (rounded to the dtype), of the rows
    rmsnorm would store where a norm_weight is given."""
    x, gate, up, *norm = arrays
    dtype = as_dtype(x.dtype)
    rows = round_to(_rmsnorm_ref([x, *norm], {"eps": attrs["eps"]}), dtype) if norm else x
    a = to_compute(rows)
    g = to_compute(round_to(np.matmul(a, to_compute(gate).T), dtype))
    u = to_compute(round_to(np.matmul(a, to_compute(up).T), dtype))
    return g * _sigmoid(g) * u


def _fast(node: Any) -> Kernel:
    """The reference's values from compute-form operands, the weights not copied."""
    stored, finish = rounder(node.inputs[0].dtype, True), rounder(node.outputs[0].dtype, True)
    normed = rms_rows(node, node.attrs.get("eps", 0.0), stored)

    def run(arrays: list[np.ndarray]) -> list[np.ndarray]:
        x, gate, up, *norm = arrays
        a = normed(x, norm[0], norm[1] if len(norm) > 1 else None) if norm else dense(x)
        g = weight_product(a, gate, stored)
        return [finish(silu_times(g, weight_product(a, up, stored)))]

    return run


def _tiles(node: Any, params: dict[str, int], ctx: Any) -> list[Tile]:
    """The gate matmul's tiles, each also reading up's rows of its columns (twice the bytes and flops),
    the norm's weight whole and its rows' residual."""
    k = node.inputs[0].shape[-1]
    tiles = []
    for t in _tilings.MATMUL.make(_as_matmul(node, node.inputs[:2]), params, ctx):
        extra = (Read(2, t.reads[1].box),)
        if len(node.inputs) > 3:
            extra += (Read(3, Box((0,), (k,))),)
        if len(node.inputs) > 4:
            extra += (Read(4, t.reads[0].box),)
        doubled = {"flops": 2 * t.flops, "streamed": 2 * t.streamed, "streamed_once": 2 * t.streamed_once}
        tiles.append(t._replace(reads=t.reads + extra, **doubled))
    return tiles


def _dims(node: Any) -> list[Any]:
    # rows and columns can be cut (x and its residual; gate's and up's rows together); never K
    a_slots = (0, 4) if len(node.inputs) > 4 else (0,)
    dims = _placements.matmul_dims(_as_matmul(node, node.inputs), a_slots, 1, k=False)
    columns = dims[-1]
    dims[-1] = dataclasses.replace(columns, axes=((2, 0, 1), *columns.axes))
    return dims


SWIGLU_LINEAR = register(
    OpDef(
        name="swiglu_linear",
        kind="compute",
        category="matmul",
        doc="silu(x @ gate.T) * (x @ up.T) in one op, each product rounded to the dtype first (what two "
        "matmuls and silu_mul store); with norm_weight (and eps, and a residual), of the rows "
        "rmsnorm(x, norm_weight, eps, residual) stores. On the GPU each tile makes both products of its "
        "columns and SwiGLU's product in its epilogue (decode steps: few rows).",
        operands=OPERANDS,
        attrs={"eps": "number"},
        optional_attrs=frozenset({"eps"}),
        infer=_infer,
        reference=_reference,
        fast=Fast(_fast),
        accuracy=Accuracy(ulps=4.0, per_reduction=True),
        tiling=Tiling(
            _tilings.MATMUL.params,
            _tiles,
            "the gate matmul's tiles (x @ gate.T), each with up's rows of its columns: " + _tilings.MATMUL.doc,
            flags=_tilings.MATMUL.flags,
            saved_without=_tilings.MATMUL.saved_without,
        ),
        lowering=Lowering("swiglu_linear"),
        placement=_placements.rule(_dims),
    )
)


def swiglu_linear(
    x: Tensor,
    gate: Tensor,
    up: Tensor,
    *,
    norm_weight: Tensor | None = None,
    eps: float = 1e-5,
    residual: Tensor | None = None,
) -> Tensor:
    """silu(h @ gate.T) * (h @ up.T), h = x, or rmsnorm(x, norm_weight, eps=eps, residual=residual)
    where ``norm_weight`` is given (a residual only with it)."""
    if residual is not None and norm_weight is None:
        raise GraphBuildError("swiglu_linear: a residual is added before the norm; give norm_weight too")
    operands = [x, gate, up] + ([norm_weight] if norm_weight is not None else [])
    operands += [residual] if residual is not None else []
    if norm_weight is None:
        return apply(SWIGLU_LINEAR, operands)
    return apply(SWIGLU_LINEAR, operands, eps=_eps(RMSNORM, eps))

"""Matrix multiplication: 2-D and batched, batch dims broadcast, either side transposed."""

from __future__ import annotations

from typing import Any

import numpy as np

from megaloop.errors import ShapeError
from megaloop.frontend.opdef import Accuracy, Lowering, OpCall, OpDef, OutSpec, register
from megaloop.frontend.ops import _placements, _tilings
from megaloop.frontend.ops._build import apply, require_bool
from megaloop.frontend.ops.elementwise import check_kinds, tensor_dtype, to_compute
from megaloop.frontend.shapes import broadcast_shapes, format_shape
from megaloop.frontend.tensor import Tensor


def _infer(call: OpCall) -> list[OutSpec]:
    a, b = call.operands
    dtype = tensor_dtype(call)
    check_kinds(call, dtype, "f")
    for i, t in enumerate((a, b)):
        if t.ndim < 2:
            raise call.error(
                ShapeError,
                f"{call.name(i)} must have at least 2 dimensions, got {format_shape(t.shape)}",
                hint="reshape a vector to [1, K] or [K, 1]",
            )
    ta, tb = call.attrs["transpose_a"], call.attrs["transpose_b"]
    m, k = (a.shape[-1], a.shape[-2]) if ta else (a.shape[-2], a.shape[-1])
    kb, n = (b.shape[-1], b.shape[-2]) if tb else (b.shape[-2], b.shape[-1])
    if k != kb:
        ka_desc = "a.shape[-2] (a is transposed)" if ta else "a.shape[-1]"
        kb_desc = "b.shape[-1] (b is transposed)" if tb else "b.shape[-2]"
        raise call.error(
            ShapeError,
            f"inner dimensions differ: {ka_desc} = {k} but {kb_desc} = {kb}",
            hint="check transpose_a/transpose_b or the operand order",
        )
    batch = broadcast_shapes(a.shape[:-2], b.shape[:-2])
    if batch is None:
        raise call.error(
            ShapeError,
            f"batch dimensions {format_shape(a.shape[:-2])} and {format_shape(b.shape[:-2])} cannot be broadcast",
        )
    return [OutSpec((*batch, m, n), dtype)]


def _reference(arrays: list[np.ndarray], attrs: dict[str, Any]) -> np.ndarray:
    a, b = (to_compute(x) for x in arrays)
    if attrs["transpose_a"]:
        a = np.swapaxes(a, -1, -2)
    if attrs["transpose_b"]:
        b = np.swapaxes(b, -1, -2)
    return np.matmul(a, b)


MATMUL = register(
    OpDef(
        name="matmul",
        kind="compute",
        category="matmul",
        doc="a @ b over the last two axes (transpose_a/transpose_b swap them first); leading "
        "batch axes broadcast. Float inputs of one dtype, float32 accumulation.",
        operands=("a", "b"),
        attrs={"transpose_a": "bool", "transpose_b": "bool"},
        infer=_infer,
        reference=_reference,
        accuracy=Accuracy(ulps=1.0, per_reduction=True),
        tiling=_tilings.MATMUL,
        lowering=Lowering("matmul"),
        placement=_placements.rule(_placements.matmul_dims, _placements.partial_each),
    )
)


def matmul(a: Tensor, b: Tensor, *, transpose_a: bool = False, transpose_b: bool = False) -> Tensor:
    return apply(
        MATMUL,
        [a, b],
        transpose_a=require_bool(MATMUL, "transpose_a", transpose_a),
        transpose_b=require_bool(MATMUL, "transpose_b", transpose_b),
    )


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x @ weight.T (+ bias), with weight stored [out_features, in_features] as in PyTorch checkpoints."""
    y = matmul(x, weight, transpose_b=True)
    if bias is None:
        return y
    if not isinstance(bias, Tensor) or bias.shape != (y.shape[-1],):
        raise ShapeError(
            f"linear: bias must have shape [{y.shape[-1]}] (out_features), got "
            f"{format_shape(bias.shape) if isinstance(bias, Tensor) else type(bias).__name__}"
        )
    return y + bias

"""Matrix multiplication: 2-D and batched, batch dims broadcast, either side transposed."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from megaloop.errors import ShapeError
from megaloop.frontend.opdef import Accuracy, Fast, Lowering, OpCall, OpDef, OutSpec, VjpCall, register
from megaloop.frontend.ops import _placements, _tilings
from megaloop.frontend.ops import layout as _layout
from megaloop.frontend.ops import reduce as _reduce
from megaloop.frontend.ops._build import apply, require_bool
from megaloop.frontend.ops._fast import Kernel, blas_ready, rounder, weight_product
from megaloop.frontend.ops._grad import unbroadcast
from megaloop.frontend.ops._torch import of, onednn_linear, torch
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


def _vjp(call: VjpCall) -> list[Tensor | None]:
    """C = op(A) @ op(B): dop(A) = dC op(B)^T and dop(B) = op(A)^T dC, each one matmul with the
    operands' transposes folded in; broadcast batch axes summed back."""
    a, b = call.inputs
    ta, tb = call.attrs["transpose_a"], call.attrs["transpose_b"]
    g = call.cotangent()
    da = db = None
    if call.needs[0]:
        da = matmul(b, g, transpose_a=tb, transpose_b=True) if ta else matmul(g, b, transpose_b=not tb)
        da = unbroadcast(da, a.shape)
    if call.needs[1]:
        db = _product(g, a, True, ta, b.shape) if tb else _product(a, g, not ta, False, b.shape)
        db = unbroadcast(db, b.shape)
    return [da, db]


def _product(x: Tensor, y: Tensor, tx: bool, ty: bool, want: tuple[int, ...]) -> Tensor:
    """x' @ y' for a gradient of shape ``want``; where ``want`` is one matrix and x, y carry batch axes
    over the contracted rows (a linear layer's weight), they are folded into those rows first."""
    if len(want) == 2 and x.ndim > 2 and y.ndim == x.ndim and x.shape[:-2] == y.shape[:-2] and tx and not ty:
        x = _layout.reshape(x, (-1, x.shape[-1]))
        y = _layout.reshape(y, (-1, y.shape[-1]))
    return matmul(x, y, transpose_a=tx, transpose_b=ty)
def _fast(node: Any) -> Kernel:
    """The reference's product on the operands as they are (a weight is not copied each step)."""
    ta, tb = node.attrs["transpose_a"], node.attrs["transpose_b"]
    finish = rounder(node.outputs[0].dtype, in_place=True)  # (a product is a new array)
    if tb and not ta:  # x @ w.T: a linear layer's, or its ranges of K (_fast.weight_product)
        return lambda arrays: [weight_product(arrays[0], arrays[1], finish)]

    def run(arrays: list[np.ndarray]) -> list[np.ndarray]:
        a, b = blas_ready(arrays[0]), blas_ready(np.asarray(arrays[1]))  # (a weight's view: not copied)
        return [finish(np.matmul(np.swapaxes(a, -1, -2) if ta else a, np.swapaxes(b, -1, -2) if tb else b))]

    return run


def _on_torch(node: Any) -> Any:
    """torch's product in the output's dtype (bfloat16: float32 sums rounded once, matmul's contract).
    A linear layer's by oneDNN where torch has it (docs/generate.md): float32 as it is (10-20% faster
    than MKL's sgemm there); bfloat16 with its weight packed for it by ``run.prepare`` (FastGraph.prepare,
    a setup phase: 147 ms for a 135M model, 5% off each prefill), else by torch.matmul."""
    ta, tb, dtype = node.attrs["transpose_a"], node.attrs["transpose_b"], node.outputs[0].dtype
    x, w = node.inputs[:2]
    linear = onednn_linear() if tb and not ta and w.ndim == 2 and w.node.op.name == "parameter" else None
    if linear is not None and dtype.name == "float32":
        return lambda arrays: [linear(of(arrays[0], dtype), of(arrays[1], dtype), None, "none", [], "")]
    packed: list[Any] = [None, None]  # (the weight, its packed form)

    def run(arrays: list[Any]) -> list[Any]:
        a, b = of(arrays[0], dtype), of(arrays[1], dtype)
        if packed[0] is b:
            return [linear(a, packed[1], None, "none", [], "")]
        return [torch().matmul(a.mT if ta else a, b.mT if tb else b)]

    def prepare(fixed: list[Any]) -> None:
        if linear is not None and fixed[1] is not None:
            b = of(fixed[1], dtype)
            packed[:] = [b, torch().ops.mkldnn._reorder_linear_weight(b, math.prod(x.shape[:-1]))]

    run.prepare = prepare  # type: ignore[attr-defined]
    return run


# auto_k_splits: the tiles a wave of the processors takes (132 on an H200), the output tile they are
# counted in, the shortest K range worth a tile of its own, the most ranges (partials to sum)
SPLIT_K_TILES, SPLIT_K_TILE, SPLIT_K_MIN_RANGE, SPLIT_K_MAX = 128, (128, 64), 512, 8
SPLIT_K_MIN_ROWS, SPLIT_K_STEP = 16, 64

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
        fast=Fast(_fast, torch=_on_torch),
        accuracy=Accuracy(ulps=1.0, per_reduction=True),
        tiling=_tilings.MATMUL,
        lowering=Lowering("matmul"),
        placement=_placements.rule(_placements.matmul_dims, _placements.partial_each),
        vjp=lambda call: _vjp(call),
    )
)


def matmul(a: Tensor, b: Tensor, *, transpose_a: bool = False, transpose_b: bool = False) -> Tensor:
    return apply(
        MATMUL,
        [a, b],
        transpose_a=require_bool(MATMUL, "transpose_a", transpose_a),
        transpose_b=require_bool(MATMUL, "transpose_b", transpose_b),
    )


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, k_splits: int | None = None) -> Tensor:
    """x @ weight.T (+ bias), with weight stored [out_features, in_features] as in PyTorch checkpoints.
    ``k_splits``: in_features cut into that many equal ranges (split_k_linear); None or 1: one product."""
    y = matmul(x, weight, transpose_b=True) if k_splits in (None, 1) else split_k_linear(x, weight, k_splits)
    if bias is None:
        return y
    if not isinstance(bias, Tensor) or bias.shape != (y.shape[-1],):
        raise ShapeError(
            f"linear: bias must have shape [{y.shape[-1]}] (out_features), got "
            f"{format_shape(bias.shape) if isinstance(bias, Tensor) else type(bias).__name__}"
        )
    return y + bias


def split_k_linear(x: Tensor, weight: Tensor, splits: int) -> Tensor:
    """x @ weight.T as ``splits`` products over equal ranges of K, one batch index each of one matmul
    on views of x and weight (no copies), then their sum (float32 accumulation). For few rows (a short
    prompt's prefill), whose output tiles alone leave processors idle; each partial is rounded to x's
    dtype before the sum, so the result has about one rounding more than the single product."""
    if not isinstance(x, Tensor) or not isinstance(weight, Tensor) or x.ndim < 2 or weight.ndim != 2:
        raise ShapeError("split_k_linear: x needs at least 2 dimensions and weight exactly 2 ([out, in])")
    k = x.shape[-1]
    if not isinstance(splits, int) or splits < 1 or k % splits or weight.shape[-1] != k:
        raise ShapeError(
            f"split_k_linear: k_splits={splits!r} must be a positive divisor of in_features {k} "
            f"(x {format_shape(x.shape)}, weight {format_shape(weight.shape)})"
        )
    lead, part = x.ndim - 1, k // splits
    xs = _layout.reshape(x, (*x.shape[:-1], splits, part))  # [..., M, S, K/S]
    xs = _layout.permute(xs, (lead, *range(lead), lead + 1))  # [S, ..., M, K/S]
    ws = _layout.permute(_layout.reshape(weight, (weight.shape[0], splits, part)), (1, 0, 2))  # [S, N, K/S]
    ws = _layout.reshape(ws, (splits, *[1] * (lead - 1), weight.shape[0], part))
    return _reduce.sum(matmul(xs, ws, transpose_b=True), axis=0)


def auto_k_splits(
    rows: int, out_features: int, in_features: int, batches: int = 1, tiles: int = SPLIT_K_TILES
) -> int | None:
    """The k_splits that brings ``batches`` products of ``rows`` x ``out_features`` (a tile takes one
    batch index) to about ``tiles`` output tiles of SPLIT_K_TILE (None where they have them already),
    each range at least SPLIT_K_MIN_RANGE long and a multiple of SPLIT_K_STEP (a tensor-core tile's K
    slice: the ranges' offsets stay aligned).
    Fewer than MMA rows (decode) never split: their matrix-vector tiles narrow their columns instead."""
    if rows < SPLIT_K_MIN_ROWS:
        return None
    grid = batches * -(-rows // SPLIT_K_TILE[0]) * -(-out_features // SPLIT_K_TILE[1])
    splits = 1
    while (
        splits * 2 * grid <= tiles
        and in_features % (splits * 2 * SPLIT_K_STEP) == 0
        and in_features // (splits * 2) >= SPLIT_K_MIN_RANGE
        and splits * 2 <= SPLIT_K_MAX
    ):
        splits *= 2
    return splits if splits > 1 else None

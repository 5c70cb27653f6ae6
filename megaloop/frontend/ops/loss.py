"""The cross-entropy loss over logits, fused with the log-softmax: a row's loss is
logsumexp(row) - row[target], computed in float32 from the logits alone, so no probability matrix is
ever stored; its gradient (softmax(row) - onehot(target)) * the row's cotangent is one more op that
recomputes the row's softmax. Targets equal to ``ignore_index`` (padding) count for nothing.

``cross_entropy`` (the builder) reduces the per-token losses: "mean" over the tokens not ignored (0
when every token is: PyTorch gives NaN there), "sum", or "none".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from megaloop.dtypes import float32
from megaloop.errors import DataError, DtypeError, GraphBuildError, ShapeError
from megaloop.frontend.opdef import Accuracy, Lowering, OpCall, OpDef, OutSpec, VjpCall, first_bad, register
from megaloop.frontend.ops import _placements
from megaloop.frontend.ops._build import apply, require_int
from megaloop.frontend.ops._tilings import ROW_WAVES, _chunk_elements, _streaming
from megaloop.frontend.ops.elementwise import to_compute
from megaloop.frontend.shapes import format_shape
from megaloop.frontend.tensor import BUILDERS as B
from megaloop.frontend.tensor import Tensor
from megaloop.frontend.tiling import Box, Read, Tile, TileContext, Write, chunks

REDUCTIONS = ("mean", "sum", "none")


def _check(call: OpCall) -> tuple[Tensor, Tensor]:
    logits, targets = call.operands[:2]
    if not logits.dtype.is_float or logits.ndim < 1:
        raise call.error(DtypeError, f"logits must be a float tensor [..., vocab], got {logits!r}")
    if not targets.dtype.is_int or targets.shape != logits.shape[:-1]:
        raise call.error(
            ShapeError if targets.dtype.is_int else DtypeError,
            f"targets must be int32 or int64 of logits' shape without its last axis, "
            f"{format_shape(logits.shape[:-1])}; got {targets.dtype.name}{format_shape(targets.shape)}",
        )
    return logits, targets


def _loss_infer(call: OpCall) -> list[OutSpec]:
    _check(call)
    return [OutSpec(call.shape(1), float32)]


def _grad_infer(call: OpCall) -> list[OutSpec]:
    logits, targets = _check(call)
    seed = call.operands[2]
    if seed.dtype != float32 or seed.shape != targets.shape:
        raise call.error(
            ShapeError if seed.dtype == float32 else DtypeError,
            f"cotangent must be float32{format_shape(targets.shape)}, got {seed!r}",
        )
    return [OutSpec(logits.shape, logits.dtype)]


def _check_data(arrays: list[np.ndarray], attrs: dict[str, Any], known: Sequence[np.ndarray | None]) -> None:
    vocab, targets = arrays[0].shape[-1], arrays[1]
    bad = ((targets < 0) | (targets >= vocab)) & (targets != attrs["ignore_index"])
    where = first_bad(bad, known[1])
    if where is not None:
        raise DataError(
            f"target {int(targets[where])} at index {where} is outside the vocabulary of {vocab} logits and is "
            f"not the ignore_index {attrs['ignore_index']}"
        )


def _rows(arrays: list[np.ndarray], attrs: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float32 logits, the ignored rows, each row's log-sum-exp and its target (clamped into range)."""
    x = to_compute(arrays[0]).astype(np.float32)
    ignored = arrays[1] == attrs["ignore_index"]
    target = np.clip(np.where(ignored, 0, arrays[1]), 0, x.shape[-1] - 1)[..., None]
    top = np.max(x, axis=-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0).astype(np.float32)
    lse = top + np.log(np.sum(np.exp(x - top), axis=-1, keepdims=True, dtype=np.float32))
    return x, ignored, lse, target


def _loss_reference(arrays: list[np.ndarray], attrs: dict[str, Any]) -> np.ndarray:
    x, ignored, lse, target = _rows(arrays, attrs)
    loss = (lse - np.take_along_axis(x, target, axis=-1))[..., 0]
    return np.where(ignored, np.float32(0), loss).astype(np.float32)


def _grad_reference(arrays: list[np.ndarray], attrs: dict[str, Any]) -> np.ndarray:
    x, ignored, lse, target = _rows(arrays, attrs)
    p = np.exp(x - lse)
    np.put_along_axis(p, target, np.take_along_axis(p, target, axis=-1) - 1.0, axis=-1)
    scale = np.where(ignored, np.float32(0), arrays[2].astype(np.float32))[..., None]
    return p * scale


def _row_tiles(node: Any, params: dict[str, int], ctx: TileContext) -> list[Tile]:
    """Blocks of whole rows: each reads its rows of logits and their targets (and cotangents) and writes
    their losses (or their rows of the gradient)."""
    logits = node.inputs[0]
    outer, vocab = logits.shape[:-1], logits.shape[-1]
    tiles = []
    for i, box in enumerate(chunks(outer, _chunk_elements(params, outer, ctx, vocab))):
        rows = Box(box.lo + (0,), box.hi + (vocab,))
        reads = (Read(0, rows),) + tuple(Read(k, box) for k in range(1, len(node.inputs)))
        out = rows if node.outputs[0].shape == logits.shape else box
        tiles.append(Tile((i,), reads, (Write(0, out),), flops=6 * rows.size))
    return tiles


_ROW_TILING = _streaming(_row_tiles, "blocks of whole rows of the logits", ROW_WAVES)


def _row_dims(node: Any) -> list[_placements.Dim]:
    """Any axis but the vocabulary's: every operand and the output are cut along it alike."""
    return [
        _placements.Dim(
            size, (*[(i, a, 1) for i in range(len(node.inputs))], (_placements.OUT, a, 1)), label=f"rows (axis {a})"
        )
        for a, size in enumerate(node.inputs[1].shape)
    ]


def _loss_vjp(call: VjpCall) -> list[Tensor | None]:
    logits, targets = call.inputs
    grad = apply(CROSS_ENTROPY_GRAD, [logits, targets, call.cotangent()], ignore_index=call.attrs["ignore_index"])
    return [grad, None]


CROSS_ENTROPY = register(
    OpDef(
        name="cross_entropy",
        kind="compute",
        category="loss",
        doc="Each row's logsumexp(logits) - logits[target] (float32), 0 where the target is ignore_index; "
        "fused with the log-softmax, no probabilities stored.",
        operands=("logits", "targets"),
        attrs={"ignore_index": "int"},
        infer=_loss_infer,
        reference=_loss_reference,
        check_data=_check_data,
        accuracy=Accuracy(ulps=4.0, per_reduction=True),
        tiling=_ROW_TILING,
        lowering=Lowering("cross_entropy"),
        placement=_placements.rule(_row_dims),
        vjp=_loss_vjp,
    )
)
CROSS_ENTROPY_GRAD = register(
    OpDef(
        name="cross_entropy_grad",
        kind="compute",
        category="loss",
        doc="cross_entropy's gradient: (softmax(logits) - onehot(target)) * cotangent of each row, zeros "
        "where the target is ignore_index; the softmax recomputed, rounded once to the logits' dtype.",
        operands=("logits", "targets", "cotangent"),
        attrs={"ignore_index": "int"},
        infer=_grad_infer,
        reference=_grad_reference,
        check_data=_check_data,
        accuracy=Accuracy(ulps=4.0, per_reduction=True),
        tiling=_ROW_TILING,
        lowering=Lowering("cross_entropy"),
        placement=_placements.rule(_row_dims),
    )
)


def cross_entropy(logits: Tensor, targets: Tensor, *, ignore_index: int = -100, reduction: str = "mean") -> Tensor:
    """The cross-entropy of ``logits`` [..., vocab] against integer ``targets`` [...] (PyTorch's
    F.cross_entropy with the classes last), float32: reduction "mean" over the targets that are not
    ``ignore_index`` (0 if there are none), "sum", or "none" (per token)."""
    if reduction not in REDUCTIONS:
        raise GraphBuildError(f"cross_entropy: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    per_token = apply(
        CROSS_ENTROPY, [logits, targets], ignore_index=require_int(CROSS_ENTROPY, "ignore_index", ignore_index)
    )
    if reduction == "none":
        return per_token
    total = B.sum(per_token)
    if reduction == "sum":
        return total
    counted = B.sum(B.cast(B.not_equal(targets, ignore_index), "float32"))
    return total / B.maximum(counted, 1.0)


def cross_entropy_grad(logits: Tensor, targets: Tensor, cotangent: Tensor, *, ignore_index: int = -100) -> Tensor:
    """The gradient of ``cross_entropy(..., reduction="none")`` for a float32 ``cotangent`` of each row
    (what ``megaloop.grad`` builds)."""
    ignore_index = require_int(CROSS_ENTROPY_GRAD, "ignore_index", ignore_index)
    return apply(CROSS_ENTROPY_GRAD, [logits, targets, cotangent], ignore_index=ignore_index)

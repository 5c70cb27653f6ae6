"""combine_linear: attention_combine's merge of the key ranges, then a product of the merged heads
(concatenated, [..., rows, heads * v_dim]) with w.T, as one op: on a decode step the o projection's
tiles merge the ranges of their rows themselves, so the combine is no stage of its own.

The values are those of the two ops apart: the merged heads rounded to ``dtype`` (as
attention_combine stores them), then the matmul's float32 sums rounded to ``dtype``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np

from megaloop.dtypes import as_dtype, float32, round_to
from megaloop.errors import ShapeError
from megaloop.frontend.opdef import Accuracy, Fast, Lowering, OpCall, OpDef, OutSpec, register
from megaloop.frontend.ops import _placements, _tilings
from megaloop.frontend.ops._build import apply
from megaloop.frontend.ops._fast import Kernel, rounder, weight_product
from megaloop.frontend.ops.attention_split import _combine_reference
from megaloop.frontend.ops.elementwise import to_compute
from megaloop.frontend.shapes import format_shape
from megaloop.frontend.tensor import Tensor
from megaloop.frontend.tiling import Box, Read, Tile, Tiling

OPERANDS = ("partial", "w")


def _infer(call: OpCall) -> list[OutSpec]:
    x, w = call.operands
    dtype = call.attrs["dtype"]
    if x.dtype != float32 or x.ndim != 5 or x.shape[4] < 3:
        raise call.error(
            ShapeError,
            "partial must be attention_partial's float32 [batch, heads, q_len, splits, v_dim + 2], got "
            f"{x.dtype.name}{format_shape(x.shape)}",
        )
    b, heads, rows, _, width = x.shape
    k = heads * (width - 2)
    if w.ndim != 2 or w.shape[1] != k:
        raise call.error(
            ShapeError, f"w must be [N, heads * v_dim] = [N, {k}], got {w.dtype.name}{format_shape(w.shape)}"
        )
    if w.dtype != dtype:
        raise call.error(ShapeError, f"w is {w.dtype.name} but the merged heads are rounded to {dtype.name}")
    return [OutSpec((b, rows, w.shape[0]), dtype)]


def merged_rows(partial: np.ndarray, dtype: Any) -> np.ndarray:
    """attention_combine's output as the product's rows: [b, rows, heads * v_dim], rounded to dtype."""
    merged = round_to(_combine_reference([partial], {}), as_dtype(dtype))  # [b, heads, rows, v_dim]
    b, heads, rows, dv = merged.shape
    return np.ascontiguousarray(merged.transpose(0, 2, 1, 3)).reshape(b, rows, heads * dv)


def _reference(arrays: list[np.ndarray], attrs: dict[str, Any]) -> np.ndarray:
    x, w = arrays
    return np.matmul(to_compute(merged_rows(x, attrs["dtype"])), np.swapaxes(to_compute(w), -1, -2))


def _fast(node: Any) -> Kernel:
    """The reference's values, the weight not copied."""
    dtype, finish = node.attrs["dtype"], rounder(node.outputs[0].dtype)

    def run(arrays: list[np.ndarray]) -> list[np.ndarray]:
        rows = merged_rows(arrays[0], dtype).astype(np.float32)
        return [finish(weight_product(rows, arrays[1]))]

    return run


def _as_matmul(node: Any) -> Any:
    """The node as the matmul rows @ w.T (rows [b, q_len, heads * v_dim]) the matmul tiling reads."""
    x, w = node.inputs
    b, heads, rows, _, width = x.shape
    a = SimpleNamespace(shape=(b, rows, heads * (width - 2)), dtype=w.dtype, ndim=3)
    return SimpleNamespace(inputs=[a, w], outputs=node.outputs, attrs={"transpose_a": False, "transpose_b": True})


def _tiles(node: Any, params: dict[str, int], ctx: Any) -> list[Tile]:
    """The matmul's tiles, each reading every head and key range of its rows of the partial results."""
    x = node.inputs[0]
    tiles = []
    for t in _tilings.MATMUL.make(_as_matmul(node), params, ctx):
        (b0, r0, _), (b1, r1, _) = t.reads[0].box.lo, t.reads[0].box.hi
        rows = Read(0, Box((b0, 0, r0, 0, 0), (b1, x.shape[1], r1, x.shape[3], x.shape[4])))
        tiles.append(t._replace(reads=(rows, *t.reads[1:])))
    return tiles


def _dims(node: Any) -> list[Any]:
    # sequences and columns can be cut; never the heads (every tile merges whole rows)
    out = node.outputs[0]
    return [
        _placements.Dim(out.shape[0], ((0, 0, 1), (_placements.OUT, 0, 1)), label="batch axis 0"),
        _placements.Dim(out.shape[2], ((1, 0, 1), (_placements.OUT, 2, 1)), label="column-parallel"),
    ]


COMBINE_LINEAR = register(
    OpDef(
        name="combine_linear",
        kind="compute",
        category="matmul",
        doc="attention_combine(partial, dtype) with its heads concatenated, times w.T, in one op: the merged "
        "heads rounded to dtype as attention_combine stores them. On the GPU each tile merges the key "
        "ranges of its own rows (decode steps: the o projection with no combine stage).",
        operands=OPERANDS,
        attrs={"dtype": "dtype"},
        infer=_infer,
        reference=_reference,
        fast=Fast(_fast),
        accuracy=Accuracy(ulps=2.0, per_reduction=True),
        tiling=Tiling(
            _tilings.MATMUL.params,
            _tiles,
            "the matmul's tiles (rows @ w.T), each merging its rows: " + _tilings.MATMUL.doc,
            flags=_tilings.MATMUL.flags,
            saved_without=_tilings.MATMUL.saved_without,
        ),
        lowering=Lowering("combine_linear"),
        placement=_placements.rule(_dims),
    )
)


def combine_linear(partial: Tensor, w: Tensor, dtype: Any = None) -> Tensor:
    """attention_combine(partial, dtype) [b, heads, q_len, v_dim] as rows [b, q_len, heads * v_dim], times
    w.T: attention's output projection fed by the key ranges directly. ``dtype``: w's by default."""
    return apply(COMBINE_LINEAR, [partial, w], dtype=as_dtype(w.dtype if dtype is None else dtype))

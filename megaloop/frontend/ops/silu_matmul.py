"""SwiGLU's down projection making its own A: ``silu_mul_matmul(gate, b, up)`` is
``matmul(silu_mul(gate, up), b)`` with silu_mul's output never stored: each tile computes the rows it
multiplies (at most FUSED_MATMUL_MAX_ROWS, a decode step's) into shared memory with silu_mul's own
tile code, then multiplies them (megaloop/codegen/emit_fused_matmul.py). One dependent stage fewer
between a layer's gate/up and down projections (silu_mul's task, 1.7-1.8 us on an H200, and its
handoff), for each of the down projection's tiles reading gate and up (2 x 16 KB a row at
Llama-3.2-1B's 8192) from L2. ``silu_mul_linear`` picks it where it applies, else the two ops.
Unlike rmsnorm_matmul's rows these need no reduction: each element is silu(gate) * up on its own.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from megaloop.dtypes import as_dtype, round_to
from megaloop.errors import DtypeError, ShapeError
from megaloop.frontend.opdef import Accuracy, CudaTile, OpCall, OpDef, OutSpec, register
from megaloop.frontend.ops import _placements
from megaloop.frontend.ops._build import apply, require_bool
from megaloop.frontend.ops._fused_matmul import FUSED_MATMUL_MAX_ROWS, check_a_and_b, fused_tiling, rows_fit
from megaloop.frontend.ops.elementwise import SILU_MUL, silu_mul, to_compute
from megaloop.frontend.ops.matmul import _reference as _matmul_reference
from megaloop.frontend.ops.matmul import linear
from megaloop.frontend.shapes import format_shape
from megaloop.frontend.tensor import Tensor
from megaloop.frontend.tiling import Read, Tile


def _infer(call: OpCall) -> list[OutSpec]:
    gate, b, up = call.operands
    n = check_a_and_b(call, "use silu_mul_linear (it falls back to silu_mul then linear) or the two ops")
    if up.shape != gate.shape:
        raise call.error(ShapeError, f"up is {format_shape(up.shape)} but must be gate's {format_shape(gate.shape)}")
    for i, t in ((1, b), (2, up)):
        if t.dtype != gate.dtype:
            raise call.error(DtypeError, f"{call.name(i)} is {t.dtype.name} but gate is {gate.dtype.name}")
    return [OutSpec(gate.shape[:-1] + (n,), gate.dtype)]


def _reference(arrays: list[np.ndarray], attrs: dict[str, Any]) -> np.ndarray:
    gate, b, up = arrays
    a = to_compute(round_to(SILU_MUL.reference([gate, up], {}), as_dtype(gate.dtype)))  # silu_mul's stored output
    return _matmul_reference([a, b], {"transpose_a": False, "transpose_b": attrs["transpose_b"]})


def _tile_reads(node: Any, t: Tile) -> Tile:
    """A tile also reads up where it reads gate (its rows, all of K)."""
    box = t.reads[0].box
    up = node.inputs[2]
    return t._replace(
        reads=t.reads + (Read(2, box),),
        flops=t.flops + 6 * box.size,
        streamed=t.streamed + box.size * up.dtype.itemsize,  # up's rows, beside gate's
    )


SILU_MUL_MATMUL = register(
    OpDef(
        name="silu_mul_matmul",
        kind="compute",
        category="matmul",
        doc="matmul(silu_mul(gate, up), b) for gate and up of at most "
        f"{FUSED_MATMUL_MAX_ROWS} rows (a decode step's): each tile computes its rows (rounded to gate's "
        "dtype, as silu_mul stores them) in shared memory and multiplies them; b a 2-D weight (transpose_b: "
        "stored [N, K]).",
        operands=("gate", "b", "up"),
        attrs={"transpose_a": "bool", "transpose_b": "bool"},
        infer=_infer,
        reference=_reference,
        accuracy=Accuracy(ulps=3.0, per_reduction=True),
        tiling=fused_tiling(_tile_reads),
        cuda=CudaTile("fused_matmul"),
        # gate and up are A: silu_mul is elementwise, so K can be cut too (partial sums)
        placement=_placements.rule(lambda node: _placements.matmul_dims(node, a_slots=(0, 2))),
    )
)


def silu_mul_matmul(gate: Tensor, b: Tensor, up: Tensor, *, transpose_b: bool = False) -> Tensor:
    """``matmul(silu_mul(gate, up), b, transpose_b=transpose_b)`` as one op, for gate and up of at most
    FUSED_MATMUL_MAX_ROWS rows (FUSED_MATMUL_MAX_BYTES of them) and b a 2-D weight."""
    transpose_b = require_bool(SILU_MUL_MATMUL, "transpose_b", transpose_b)
    return apply(SILU_MUL_MATMUL, [gate, b, up], transpose_a=False, transpose_b=transpose_b)


def silu_mul_linear(gate: Tensor, up: Tensor, weight: Tensor) -> Tensor:
    """``linear(silu_mul(gate, up), weight)``: one op (silu_mul_matmul) where it applies (tensors of one
    shape and dtype, a decode step's few rows that fit a tile's shared memory, a 2-D weight), else the
    two ops, whose errors then name the arguments."""
    ok = (
        all(isinstance(t, Tensor) for t in (gate, up, weight))
        and gate.dtype.is_float
        and rows_fit(gate)
        and weight.ndim == 2
        and weight.shape[1] == gate.shape[-1]
        and up.shape == gate.shape
        and up.dtype == gate.dtype == weight.dtype
    )
    if not ok:
        return linear(silu_mul(gate, up), weight)
    return silu_mul_matmul(gate, weight, up, transpose_b=True)

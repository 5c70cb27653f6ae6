"""combine_linear's tiles (megaloop/frontend/ops/combine_linear.py): the block merges the key ranges of
its tile's rows into shared memory first (ml::CombinedRows, megaloop/matvec.cuh), then its warps sum
whole weight rows against them, the weights from the weight ring where the kernel has one, else from
global memory; any other layout merges a row at a time and takes a warp an output element
(ml::combine_linear_elements)."""

from __future__ import annotations

from typing import Any

from megaloop.codegen.emit import Operand, pointers
from megaloop.codegen.emit_matmul import matvec_call, matvec_rows, ring_stream
from megaloop.codegen.emit_norm_linear import AS_MATMUL, packed_rows


def combine_linear(
    attrs: dict[str, Any], ins: list[Operand], out: Operand
) -> tuple[list[str], int, tuple[int, int, int] | None]:
    """The tile function's body, its dynamic shared memory and its ring stream (or None)."""
    x, w = ins
    hints = attrs["codegen"]
    mm = {**AS_MATMUL, "codegen": hints}
    _, heads, _, splits, width = x.shape
    dv = width - 2
    k = heads * dv
    rows = rows_operand(x, w.dtype)
    body = pointers([*ins, out], len(ins))
    stage = [
        "extern __shared__ float4 ml_smem4[];  // the tile's merged rows",
        f"{w.ctype}* stage = reinterpret_cast<{w.ctype}*>(ml_smem4);",
    ]
    if x.strides[-1] != 1 or not packed_rows(hints, rows, [w], None, None, out):
        return body + stage + _elements(x, w, out, splits, dv), k * w.dtype.itemsize, None
    ring = ring_stream(mm, rows, w, out)
    pieces = k * w.dtype.itemsize // 16
    n_rows = matvec_rows(hints)
    policy = (
        f"ml::CombinedRows<{w.ctype}, {pieces}, {n_rows}, {splits}, {dv}>{{in0 + (ml::i64)t.lo[1] * {x.strides[2]}, "
        f"{x.strides[2]}, {x.strides[1]}, {x.strides[3]}, reinterpret_cast<ml::Pack<{w.ctype}, "
        f"{16 // w.dtype.itemsize}>*>(stage)}}"
    )
    return body + stage + matvec_call(mm, rows, w, out, ring, policy), n_rows * pieces * 16, ring


def rows_operand(x: Operand, dtype: Any) -> Operand:
    """The merged heads as the product's rows of A: [b, q_len, heads * v_dim], contiguous."""
    b, heads, q_len, _, width = x.shape
    k = heads * (width - 2)
    return Operand(dtype, (b, q_len, k), (q_len * k, k, 1))


def _elements(x: Operand, w: Operand, out: Operand, splits: int, dv: int) -> list[str]:
    xs, ws, os_ = x.strides, w.strides, out.strides
    return [
        "// any layout: each row's heads merged into shared memory, then a warp an output element",
        "const int nt = t.hi[1] - t.lo[1];",
        f"ml::combine_linear_elements<{w.ctype}, {splits}, {dv}>(stage, (t.hi[0] - t.lo[0]) * nt, "
        f"t.hi[2] - t.lo[2], {x.shape[1]},",
        f"    [&](int r, int h, int s, int i) {{ return in0[(ml::i64)(t.lo[0] + r / nt) * {xs[0]} + (ml::i64)h * "
        f"{xs[1]} + (ml::i64)(t.lo[1] + r % nt) * {xs[2]} + (ml::i64)s * {xs[3]} + (ml::i64)i * {xs[4]}]; }},",
        f"    [&](int c, int i) {{ return ml::load(in1 + (ml::i64)(t.lo[2] + c) * {ws[0]} + (ml::i64)i * {ws[1]}); }},",
        f"    [&](int r, int c, float v) {{ ml::store(out0 + (ml::i64)(t.lo[0] + r / nt) * {os_[0]} + (ml::i64)"
        f"(t.lo[1] + r % nt) * {os_[1]} + (ml::i64)(t.lo[2] + c) * {os_[2]}, v); }});",
    ]

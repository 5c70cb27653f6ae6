"""rmsnorm_linear's tiles (megaloop/frontend/ops/norm_linear.py): the block norms its tile's rows into
shared memory once and its warps sum whole weight rows against them (ml::NormedRows, megaloop/matvec.cuh), the weights
from the weight ring where the kernel has one, else from global memory; any other layout takes the
element-by-element path (ml::norm_linear_elements)."""

from __future__ import annotations

import math
from typing import Any

from megaloop.codegen.emit import Operand, float_literal, pointers
from megaloop.codegen.emit_matmul import RING_MAX_ROWS, matvec_call, matvec_rows, ring_stream

AS_MATMUL = {"transpose_a": False, "transpose_b": True}


def rmsnorm_linear(
    attrs: dict[str, Any], ins: list[Operand], out: Operand
) -> tuple[list[str], int, tuple[int, int, int] | None]:
    """The tile function's body, its dynamic shared memory and its ring stream (or None)."""
    x, w, g = ins[:3]
    res = ins[3] if len(ins) > 3 else None
    hints = attrs["codegen"]
    mm = {**AS_MATMUL, "codegen": hints}
    body = pointers([*ins, out], len(ins))
    if not packed_rows(hints, x, [w], g, res, out):
        return body + _elements(attrs, x, res, w, g, out), 0, None
    ring = ring_stream(mm, x, w, out)
    pieces = x.shape[-1] * x.dtype.itemsize // 16
    rows = matvec_rows(hints)
    r_ = len(out.shape) - 2
    residual = f"in3 + (ml::i64)t.lo[{r_}] * {res.strides[-2]}, {res.strides[-2]}" if res else "nullptr, 0"
    policy = (
        f"ml::NormedRows<{x.ctype}, {pieces}, {rows}, {'true' if res else 'false'}>{{in0 + ab, {{a_step}}, "
        f"{residual}, in2, {float_literal(attrs['eps'])}, stage}}"
    )
    stage = [
        "extern __shared__ float4 ml_smem4[];  // the tile's normed rows",
        f"ml::Pack<{x.ctype}, {16 // x.dtype.itemsize}>* stage = reinterpret_cast<ml::Pack<{x.ctype}, "
        f"{16 // x.dtype.itemsize}>*>(ml_smem4);",
    ]
    shared = norm_stage_bytes(rows, pieces, hints["warps"])
    return body + stage + matvec_call(mm, x, w, out, ring, policy), shared, ring


def packed_rows(
    hints: dict[str, Any], x: Operand, weights: list[Operand], g: Operand | None, res: Operand | None, out: Operand
) -> bool:
    """Whole 16-byte pieces: K-contiguous rows starting on 16 bytes, no batch axes, few rows a tile."""
    size = x.dtype.itemsize
    rows = [x, *weights] + ([res] if res else [])
    return bool(
        hints.get("aligned")
        and math.prod(out.shape[:-2]) == 1
        and all(t.strides[-1] == 1 and (t.strides[-2] * size) % 16 == 0 for t in rows)
        and (g is None or g.strides[-1] == 1)
        and (x.shape[-1] * size) % 16 == 0
        and 1 <= hints.get("tile", (0, 0))[0] <= RING_MAX_ROWS
    )


def norm_stage_bytes(rows: int, pieces: int, warps: int) -> int:
    """ml::NormedRows's shared memory: the tile's normed rows, then the warps' sums of squares."""
    return rows * pieces * 16 + -(-rows * warps * 4 // 16) * 16


def _row_offset(t: Operand, nd: int) -> str:
    """A lambda: the offset of flat row r of the tile's box (its leading axes, the last varying fastest)."""
    lines = ["[&](int r) { ml::i64 o = 0;"]
    for d in reversed(range(nd - 1)):
        extent = f"(t.hi[{d}] - t.lo[{d}])"
        lines.append(f"o += (ml::i64)(t.lo[{d}] + r % {extent}) * {t.strides[d]}; r /= {extent};")
    return " ".join(lines) + " return o; }"


def _elements(
    attrs: dict[str, Any], x: Operand, res: Operand | None, w: Operand, g: Operand, out: Operand
) -> list[str]:
    nd = len(out.shape)
    c_ = nd - 1
    rows = " * ".join(f"(t.hi[{d}] - t.lo[{d}])" for d in range(nd - 1))
    at = f"in0 + xo(r) + (ml::i64)i * {x.strides[-1]}"
    value = f"ml::load({at})" if res is None else f"ml::add_rounded({at}, in3 + ro(r) + (ml::i64)i * {res.strides[-1]})"
    lines = [
        "// any layout: a warp an output element",
        f"auto xo = {_row_offset(x, nd)};",
        f"auto oo = {_row_offset(out, nd)};",
    ]
    if res is not None:
        lines.append(f"auto ro = {_row_offset(res, nd)};")
    lines += [
        f"ml::norm_linear_elements<{x.ctype}>({rows}, t.hi[{c_}] - t.lo[{c_}], {x.shape[-1]}, "
        f"{float_literal(attrs['eps'])},",
        f"    [&](int r, int i) {{ return {value}; }},",
        f"    [&](int i) {{ return ml::load(in2 + (ml::i64)i * {g.strides[-1]}); }},",
        f"    [&](int c, int i) {{ return ml::load(in1 + (ml::i64)(t.lo[{c_}] + c) * {w.strides[0]} "
        f"+ (ml::i64)i * {w.strides[1]}); }},",
        f"    [&](int r, int c, float v) {{ ml::store(out0 + oo(r) + (ml::i64)(t.lo[{c_}] + c) * {out.strides[-1]}, "
        "v); });",
    ]
    return lines

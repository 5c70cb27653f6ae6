"""swiglu_linear's tiles (megaloop/frontend/ops/swiglu.py): the block prepares its tile's rows (as
they are, or rmsnormed: ml::NormedRows), its warps sum whole gate rows and then whole up rows against
them (from the weight ring where the kernel has one, else from global memory) into shared memory, and
after a barrier the block stores silu(gate) * up (ml::silu_mul_sums, megaloop/matvec.cuh). Any other
layout takes a warp an output element (ml::swiglu_elements)."""

from __future__ import annotations

from typing import Any

from megaloop.codegen.emit import Operand, float_literal, pointers
from megaloop.codegen.emit_matmul import RUN_COLUMNS, matvec_rows, ring_stream
from megaloop.codegen.emit_norm_linear import _row_offset, norm_stage_bytes, packed_rows

AS_MATMUL = {"transpose_a": False, "transpose_b": True}
Ring = tuple[int, int, int]


def swiglu_linear(attrs: dict[str, Any], ins: list[Operand], out: Operand) -> tuple[list[str], int, list[Ring]]:
    """The tile function's body, its dynamic shared memory and its ring streams (gate's, up's; or none)."""
    x, gate, up = ins[:3]
    norm = ins[3] if len(ins) > 3 else None
    res = ins[4] if len(ins) > 4 else None
    hints = attrs["codegen"]
    body = pointers([*ins, out], len(ins))
    if not packed_rows(hints, x, [gate, up], norm, res, out):
        return body + _elements(attrs, x, gate, up, norm, res, out), 0, []
    mm = {**AS_MATMUL, "codegen": hints}
    rings = [ring_stream(mm, x, w, out) for w in (gate, up)]
    streams = rings if all(rings) and rings[0][2] == rings[1][2] else []  # type: ignore[index]
    pieces = x.shape[-1] * x.dtype.itemsize // 16
    rows, ct, n = matvec_rows(hints), x.ctype, 16 // x.dtype.itemsize
    cols = hints["tile"][1]
    r_, c_ = len(out.shape) - 2, len(out.shape) - 1
    a_step = x.strides[-2]
    stage_bytes = 0
    lines = [
        "extern __shared__ float4 ml_smem4[];  // the two products' sums, then (normed) the tile's rows",
        "float* gate_sums = reinterpret_cast<float*>(ml_smem4);",
        f"float* up_sums = gate_sums + {rows * cols};",
        f"const ml::i64 ab = (ml::i64)t.lo[{r_}] * {a_step};",
        f"const int cols = t.hi[{c_}] - t.lo[{c_}], nr = t.hi[{r_}] - t.lo[{r_}];",
    ]
    sums_bytes = -(-2 * rows * cols * 4 // 16) * 16
    if norm is None:
        lines.append(f"ml::PlainRows<{ct}> rows{{in0 + ab, {a_step}}};")
    else:
        residual = f"in4 + (ml::i64)t.lo[{r_}] * {res.strides[-2]}, {res.strides[-2]}" if res else "nullptr, 0"
        lines += [
            f"ml::Pack<{ct}, {n}>* stage = reinterpret_cast<ml::Pack<{ct}, {n}>*>(ml_smem4 + {sums_bytes // 16});",
            f"ml::NormedRows<{ct}, {pieces}, {rows}, {'true' if res else 'false'}> rows{{in0 + ab, {a_step}, "
            f"{residual}, in3, {float_literal(attrs['eps'])}, stage}};",
        ]
        stage_bytes = norm_stage_bytes(rows, pieces, hints["warps"])
    lines.append(f"rows.prepare(nr, {pieces});")
    for w, operand, sums in ((gate, 1, "gate_sums"), (up, 2, "up_sums")):
        w_step = w.strides[0] * w.dtype.itemsize
        weights = f"reinterpret_cast<const unsigned char*>(in{operand} + (ml::i64)t.lo[{c_}] * {w.strides[0]})"
        store = f"[&](int r, int c, float v) {{ {sums}[r * cols + c] = v; }}"
        if streams:
            first = "0" if operand == 1 else f"(cols + {streams[0][2] - 1}) / {streams[0][2]}"
            lines.append(
                f"ml::ring_columns<{ct}, {pieces}, {rows}>(a, t, tid, k, proc, {first}, cols, {streams[0][2]}, "
                f"{weights}, {w_step}, rows, nr, {store});"
            )
        else:
            lines.append(
                f"ml::direct_columns<{ct}, {pieces}, {rows}>(cols, {RUN_COLUMNS}, {weights}, {w_step}, rows, nr, "
                f"{store});"
            )
    o_row, o_col = out.strides[-2:]
    lines += [
        "ml::block_sync();",
        f"{out.ctype}* o = out0 + (ml::i64)t.lo[{r_}] * {o_row} + (ml::i64)t.lo[{c_}] * {o_col};",
        f"ml::silu_mul_sums<{ct}>(gate_sums, up_sums, nr, cols, "
        f"[&](int r, int c, float v) {{ ml::store(o + (ml::i64)r * {o_row} + (ml::i64)c * {o_col}, v); }});",
    ]
    return body + lines, sums_bytes + stage_bytes, streams  # type: ignore[return-value]


def _elements(
    attrs: dict[str, Any],
    x: Operand,
    gate: Operand,
    up: Operand,
    norm: Operand | None,
    res: Operand | None,
    out: Operand,
) -> list[str]:
    nd = len(out.shape)
    c_ = nd - 1
    rows = " * ".join(f"(t.hi[{d}] - t.lo[{d}])" for d in range(nd - 1))
    at = f"in0 + xo(r) + (ml::i64)i * {x.strides[-1]}"
    value = f"ml::load({at})" if res is None else f"ml::add_rounded({at}, in4 + ro(r) + (ml::i64)i * {res.strides[-1]})"
    lines = [
        "// any layout: a warp an output element",
        f"auto xo = {_row_offset(x, nd)};",
        f"auto oo = {_row_offset(out, nd)};",
    ]
    if res is not None:
        lines.append(f"auto ro = {_row_offset(res, nd)};")
    weight = "[&](int i) { return 1.0f; }"
    if norm is not None:
        weight = f"[&](int i) {{ return ml::load(in3 + (ml::i64)i * {norm.strides[-1]}); }}"
    col = f"(ml::i64)(t.lo[{c_}] + c)"
    eps = float_literal(attrs["eps"]) if norm is not None else "0.0f"
    lines += [
        f"ml::swiglu_elements<{x.ctype}, {'true' if norm is not None else 'false'}>({rows}, t.hi[{c_}] - t.lo[{c_}], "
        f"{x.shape[-1]}, {eps},",
        f"    [&](int r, int i) {{ return {value}; }},",
        f"    {weight},",
        *(
            f"    [&](int c, int i) {{ return ml::load(in{n} + {col} * {w.strides[0]} + (ml::i64)i * {w.strides[1]}); "
            "},"
            for n, w in ((1, gate), (2, up))
        ),
        f"    [&](int r, int c, float v) {{ ml::store(out0 + oo(r) + {col} * {out.strides[-1]}, v); }});",
    ]
    return lines

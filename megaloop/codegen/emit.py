"""C++ for one tile of each op: one function per distinct op signature.

Every function has the same shape, ``void sig_N(const ml::Args& a, const ml::Task& t, int tid,
const ml::i64* off)``: ``off[k]`` is the byte offset in the arena of operand k (inputs, then outputs)
and ``t.lo/t.hi`` the box of the output the task writes. Shapes, strides, dtypes and op constants
are compile-time constants written into the body, so two ops with the same signature (the same layer
of every transformer block) share one function. Each template follows the numpy reference of its op
(megaloop/frontend/ops): float32 arithmetic for every float dtype, one rounding at the store.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from megaloop.dtypes import DType, round_to
from megaloop.frontend.ops.rope import inv_frequencies

CTYPE = {
    "float32": "float",
    "float16": "ml::f16",
    "bfloat16": "ml::bf16",
    "int32": "int",
    "int64": "ml::i64",
    "bool": "bool",
}


def compute_type(dtype: DType) -> str:
    return "float" if dtype.is_float else "ml::i64" if dtype.is_int else "bool"


def converter(dtype: DType) -> str:
    return "ml::to_compute_float" if dtype.is_float else "ml::to_compute_int" if dtype.is_int else "ml::to_compute_bool"


@dataclass(frozen=True)
class Operand:
    """What the emitters know about one operand tensor."""

    dtype: DType
    shape: tuple[int, ...]
    strides: tuple[int, ...]

    @property
    def ctype(self) -> str:
        return CTYPE[self.dtype.name]


def float_literal(value: float) -> str:
    """An exact C++ literal for a float32 value (hex float, cast to float)."""
    f = struct.unpack("f", struct.pack("f", float(value)))[0]
    return f"((float){float(f).hex()})"


def double_literal(value: float) -> str:
    return float(value).hex()


def index_expr(strides: Sequence[int], dims: Sequence[str | None]) -> str:
    """sum(index * stride) as C++, skipping axes that do not move (broadcast or size 1)."""
    terms = [f"(ml::i64){d} * {s}" for d, s in zip(dims, strides) if d is not None and s != 0]
    return " + ".join(terms) if terms else "0"


def broadcast_dims(out_ndim: int, operand: Operand, var: str = "i") -> list[str | None]:
    """The output's index variables that address each axis of a broadcast operand (right-aligned)."""
    lead = out_ndim - len(operand.shape)
    return [None if size == 1 else f"{var}[{lead + d}]" for d, size in enumerate(operand.shape)]


def pointers(operands: Sequence[Operand], n_inputs: int) -> list[str]:
    lines = []
    for k, o in enumerate(operands):
        const = "const " if k < n_inputs else ""
        name = f"in{k}" if k < n_inputs else f"out{k - n_inputs}"
        lines.append(f"[[maybe_unused]] {const}{o.ctype}* {name} = ({const}{o.ctype}*)(a.arena + off[{k}]);")
    return lines


def box_var(n: int) -> str:
    return str(max(n, 0))


# ---- templates ------------------------------------------------------------------------------------


def elementwise(op: str, attrs: dict[str, Any], expr: str, ins: list[Operand], out: Operand) -> list[str]:
    """Any op of one expression over broadcast operands (and Python numbers). A vectorised path (16-byte
    packs along the last axis, several packs in flight per thread) runs when strides and the tile allow it;
    the per-element path is the fallback and the definition."""
    scalars = attrs.get("scalars", {})
    slots = len(ins) + len(scalars)
    tensor_slots = [s for s in range(slots) if s not in scalars]
    compare = out.dtype.is_bool and not all(o.dtype.is_bool for o in ins)
    value_dtype = ins[-1].dtype if ins else out.dtype  # dtype the scalars stand in for
    names = "abc"
    body = pointers(ins + [out], len(ins))
    fast = _elementwise_fast(
        expr, ins, out, scalars, tensor_slots, slots, compare, value_dtype, attrs.get("codegen", {})
    )
    body += fast
    body.append(f"ml::for_box<{box_var(len(out.shape))}>(t, [&](const int* i) {{")
    for s in range(slots):
        if s in scalars:
            body.append(
                f"    const {compute_type(value_dtype)} {names[s]} = {_scalar(scalars[s], value_dtype, compare)};"
            )
        else:
            k = tensor_slots.index(s)
            o = ins[k]
            body.append(
                f"    const {compute_type(o.dtype)} {names[s]} = ml::load(in{k} + "
                f"{index_expr(o.strides, broadcast_dims(len(out.shape), o))});"
            )
    dims = [f"i[{d}]" for d in range(len(out.shape))]
    body.append(f"    ml::store(out0 + {index_expr(out.strides, dims)}, {converter(out.dtype)}({expr}));")
    body.append("});")
    return body


def _elementwise_fast(
    expr: str,
    ins: list[Operand],
    out: Operand,
    scalars: dict,
    tensor_slots: list[int],
    slots: int,
    compare: bool,
    value_dtype: DType,
    hints: dict[str, int],
) -> list[str]:
    """The packed path, or nothing when the layout rules it out at compile time. ``hints``: the op's
    largest tile (``elements``) and the block's ``threads``, where the generator knows them."""
    nd = len(out.shape)
    if nd == 0 or out.strides[-1] != 1:
        return []
    width = 16 // max([o.dtype.itemsize for o in ins] + [out.dtype.itemsize])
    if width < 2:
        return []
    kinds = []
    for o in ins:
        if not o.shape or o.shape[-1] == 1:
            kinds.append("row")  # one value per row of the tile
        elif o.strides[-1] == 1 and all(s % width == 0 for s in o.strides[:-1]):
            kinds.append("vec")
        else:
            return []
    if not all(s % width == 0 for s in out.strides[:-1]):
        return []
    # packs in flight per thread: 8 of each operand for up to two vector operands (4 reached 0.76 of copy
    # bandwidth on an H200 at one 256-thread block per SM), 4 with more (registers)
    unroll = 8 if kinds.count("vec") <= 2 else 4
    if hints.get("elements") and hints.get("threads"):
        # no more packs a thread than the largest tile has: a decode-sized op (one tile of a few thousand
        # elements) ran 8 unrolled copies of its body, most of them on clamped duplicates, and its code
        # (up to 46 KB for a silu) is fetched into the instruction cache afresh every iteration
        unroll = max(1, min(unroll, -(-hints["elements"] // (width * hints["threads"]))))
    declare, loads = [], []
    for k, (o, kd) in enumerate(zip(ins, kinds)):
        offset = index_expr(o.strides, broadcast_dims(nd, o))
        if kd == "vec":
            declare.append(f"ml::Pack<{o.ctype}, {width}> p{k}[{unroll}];")
            loads.append(f"p{k}[u] = ml::load_pack<{o.ctype}, {width}>(in{k} + {offset});")
        else:
            declare.append(f"{compute_type(o.dtype)} r{k}[{unroll}];")
            loads.append(f"r{k}[u] = ml::load(in{k} + {offset});")
    values = []
    for s in range(slots):
        if s in scalars:
            values.append(
                f"const {compute_type(value_dtype)} {'abc'[s]} = {_scalar(scalars[s], value_dtype, compare)};"
            )
        else:
            k = tensor_slots.index(s)
            src = f"ml::get(p{k}[u], j)" if kinds[k] == "vec" else f"r{k}[u]"
            values.append(f"const {compute_type(ins[k].dtype)} {'abc'[s]} = {src};")
    stores = [
        f"ml::Pack<{out.ctype}, {width}> po;",
        "#pragma unroll",
        f"for (int j = 0; j < {width}; ++j) {{",
        *["    " + v for v in values],
        f"    ml::set(po, j, {converter(out.dtype)}({expr}));",
        "}",
        f"ml::store_pack<{out.ctype}, {width}>(out0 + at[u], po);",
    ]
    vec_in = [(f"in{k}", o) for k, (o, kd) in enumerate(zip(ins, kinds)) if kd == "vec"]
    return packed_loop(out, width, unroll, vec_in, declare, loads, stores)


def packed_loop(
    out: Operand,
    width: int,
    unroll: int,
    pointers_in: list[tuple[str, Operand]],
    declare: list[str],
    loads: list[str],
    stores: list[str],
) -> list[str]:
    """The tile's box in packs of ``width`` along the last axis, ``unroll`` packs per thread in flight:
    ``loads`` run for each pack u with its index i[] (and at[u], its output offset) before any of
    ``stores`` run; ``pointers_in`` are the inputs read in packs (checked aligned, as out0 is). Packs
    past the box's end load the box's last pack again (never stored): every pack is defined without a
    branch. Undefined tail packs made ptxas spill (up to 124 B a function); zeroing them instead made
    it wait for each load before issuing the next (add fell from 0.76 to 0.44 of copy bandwidth).
    Falls through (to the caller's per-element path) when the box is not whole packs or has 2^31
    packs or more (32-bit index arithmetic: a 64-bit division costs ~4x)."""
    nd = len(out.shape)
    last = nd - 1
    checks = [
        f"t.lo[{last}] % {width} == 0",
        f"(t.hi[{last}] - t.lo[{last}]) % {width} == 0",
        f"ml::aligned(out0, {width * out.dtype.itemsize})",
    ] + [f"ml::aligned({p}, {width * o.dtype.itemsize})" for p, o in pointers_in]
    return [
        f"if ({' && '.join(checks)}) {{  // packed path: {width} elements a load, {unroll} per operand in flight",
        f"    const int c0 = t.lo[{last}];",
        f"    const ml::i64 vpr = (t.hi[{last}] - c0) / {width};",
        "    ml::i64 rows = 1;",
        f"    for (int d = 0; d < {last}; ++d) rows *= t.hi[d] - t.lo[d];",
        "    if (rows * vpr <= 0x7fffffff) {  // 32-bit index arithmetic",
        "        const unsigned vpr32 = (unsigned)vpr, total = (unsigned)(rows * vpr);",
        f"        for (unsigned e0 = threadIdx.x; e0 < total; e0 += {unroll} * blockDim.x) {{",
        *["            " + line for line in declare],
        f"            ml::i64 at[{unroll}];",
        "#pragma unroll",
        f"            for (int u = 0; u < {unroll}; ++u) {{",
        "                const unsigned e = min(e0 + u * blockDim.x, total - 1);",
        f"                int i[{nd}];",
        f"                i[{last}] = c0 + (int)(e % vpr32) * {width};",
        "                unsigned r = e / vpr32;",
        f"                for (int d = {last - 1}; d >= 0; --d) {{ const unsigned ext = t.hi[d] - t.lo[d]; "
        "i[d] = t.lo[d] + (int)(r % ext); r /= ext; }",
        *["                " + line for line in loads],
        f"                at[u] = {index_expr(out.strides, [f'i[{d}]' for d in range(nd)])};",
        "            }",
        "#pragma unroll",
        f"            for (int u = 0; u < {unroll}; ++u) {{",
        "                if (e0 + u * blockDim.x >= total) break;",
        *["                " + line for line in stores],
        "            }",
        "        }",
        "        return;",
        "    }",
        "}",
    ]


def _scalar(value: float | int, dtype: DType, compare: bool) -> str:
    if dtype.is_int:
        return f"(ml::i64){int(value)}LL"
    if compare:  # comparisons see the number rounded to the tensor's dtype
        value = float(round_to(np.asarray(float(value)), dtype).astype(np.float32))
    return float_literal(value)


def reduction(op: str, attrs: dict[str, Any], x: Operand, out: Operand) -> list[str]:
    axis = attrs["axis"]
    axes = tuple(range(len(x.shape))) if axis is None else (axis,) if isinstance(axis, int) else tuple(axis)
    keep = attrs["keepdims"]
    kept = [d for d in range(len(x.shape)) if d not in axes]
    # output index of each kept input axis
    out_axis, j = {}, 0
    for d in range(len(x.shape)):
        if d in axes:
            j += keep
        else:
            out_axis[d] = j
            j += 1
    total = math.prod(x.shape[d] for d in axes)
    ct = compute_type(x.dtype)
    body = pointers([x, out], 1)
    body.append(f"ml::for_box_warps<{box_var(len(out.shape))}>(t, [&](const int* o, int lane) {{")
    body.append(
        f"    const ml::i64 base = {index_expr([x.strides[d] for d in kept], [f'o[{out_axis[d]}]' for d in kept])};"
    )
    if op == "argmax":
        init = "ml::neg_inf()" if x.dtype.is_float else "(ml::i64)(-9223372036854775807LL - 1)"
        body.append(f"    {ct} best = {init};")
        body.append("    ml::i64 best_i = 9223372036854775807LL;")
    else:
        init = {"sum": "0", "mean": "0", "max": "ml::neg_inf()", "min": "ml::pos_inf()"}[op]
        if x.dtype.is_int:
            init = {"sum": "0", "max": "(ml::i64)(-9223372036854775807LL - 1)", "min": "9223372036854775807LL"}[op]
        body.append(f"    {ct} acc = {init};")
    body.append(f"    for (ml::i64 r = lane; r < {total}LL; r += 32) {{")
    body.append("        ml::i64 rest = r, at = base;")
    for d in reversed(axes):
        body.append(f"        at += (rest % {x.shape[d]}) * {x.strides[d]}; rest /= {x.shape[d]};")
    body.append(f"        const {ct} v = ml::load(in0 + at);")
    if op == "argmax":
        better = "(v != v) ? (best == best) : (v > best)" if x.dtype.is_float else "v > best"
        body.append(f"        if (best_i == 9223372036854775807LL || {better}) {{ best = v; best_i = r; }}")
    elif op in ("sum", "mean"):
        body.append("        acc += v;")
    elif op == "max":
        body.append("        acc = (v > acc || v != v) ? v : acc;")
    else:
        body.append("        acc = (v < acc || v != v) ? v : acc;")
    body.append("    }")
    odims = [f"o[{d}]" for d in range(len(out.shape))]
    where = index_expr(out.strides, odims)
    if op == "argmax":
        body.append("    ml::warp_argmax(best, best_i);")
        body.append(f"    if (lane == 0) ml::store(out0 + {where}, best_i);")
    else:
        reduce = {"sum": "ml::warp_sum", "mean": "ml::warp_sum", "max": "ml::warp_max", "min": "ml::warp_min"}[op]
        body.append(f"    acc = {reduce}(acc);")
        final = f"acc / (float){total}" if op == "mean" else "acc"
        body.append(f"    if (lane == 0) ml::store(out0 + {where}, {final});")
    body.append("});")
    return body


# A row of at least this many 16-byte packs is spread over the whole block (held in registers, one
# DRAM read, block-wide reductions); shorter rows get a warp each. Decode's rmsnorm over 2048 bf16 on
# one warp took 7.7 us of a 550 us step; 8192-wide rows on a warp each reached 0.3 of copy bandwidth.
BLOCK_ROW_PACKS = 128
BLOCK_ROW_MAX_PACKS_PER_THREAD = 16  # register budget: 16 packs of 16 bytes = 64 registers
BLOCK_ROW_MIN_THREADS = 256  # the block path's registers are sized for at least this many threads
# The next rows stream into a ring of row slots in shared memory (cp.async) while one row is reduced:
# up to ROW_RING_ROWS rows in ROW_RING_BYTES (two rows where they are longer), and never more than
# three quarters of the plan's shared memory (one slot on an RTX card for 64 KB rows: no read-ahead).
# Rows held in registers instead left rmsnorm at 0.48 of copy bandwidth on an H200 whether 2 or 4 rows
# were in flight: each row's block reduction (a barrier) waited for every load into registers still
# in flight, so nothing streamed across it. A cp.async copy in flight is not waited for by a barrier.
ROW_RING_ROWS = 8
ROW_RING_BYTES = 96 * 1024
SOFTMAX_KEPT_EXPS = 32  # floats a thread keeps between softmax's sum and store passes


def _block_row_layout(attrs: dict[str, Any], ins: list[Operand], out: Operand) -> tuple[int, int, int] | None:
    """(width, packs, packs per thread) of the packed paths' rows, or None when a row is not whole
    aligned packs along the last axis."""
    x = ins[0]
    nd = len(x.shape)
    axis = attrs.get("axis", nd - 1)
    width = 16 // max(o.dtype.itemsize for o in ins + [out])
    packed = (
        axis == nd - 1
        and x.shape[axis] % width == 0
        and x.strides[-1] == 1
        and out.strides[-1] == 1
        and all(st % width == 0 for st in x.strides[:-1] + out.strides[:-1])
        and all(o.strides[0] == 1 for o in ins[1:])
    )
    if not packed:
        return None
    packs = x.shape[axis] // width
    return width, packs, -(-packs // BLOCK_ROW_MIN_THREADS)


def row_ring(attrs: dict[str, Any], ins: list[Operand], out: Operand) -> int:
    """Rows in the block-per-row path's shared-memory ring, 0 when the op does not take that path
    (``attrs["codegen"]``: the plan's ``shared_memory`` per block, ``threads``, the largest tile's
    ``elements``)."""
    hints = attrs.get("codegen", {})
    layout = _block_row_layout(attrs, ins, out)
    if layout is None or hints.get("threads", BLOCK_ROW_MIN_THREADS) < BLOCK_ROW_MIN_THREADS:
        return 0  # (a block of fewer threads never takes the block path: no ring to reserve)
    width, packs, per_thread = layout
    if packs < BLOCK_ROW_PACKS or per_thread > BLOCK_ROW_MAX_PACKS_PER_THREAD:
        return 0
    row = packs * 16
    ring = min(ROW_RING_ROWS, max(ROW_RING_BYTES, 2 * row) // row, hints.get("shared_memory", 0) * 3 // 4 // row)
    # no more slots than the op's largest tile has rows (decode: one row, one slot; the ring's loop is
    # unrolled once per slot, and that code is fetched afresh every iteration)
    elements = hints.get("elements")
    return max(1, min(ring, -(-elements // (packs * width)))) if elements and ring else ring


def rows_shared_bytes(attrs: dict[str, Any], ins: list[Operand], out: Operand) -> int:
    layout = _block_row_layout(attrs, ins, out)
    return row_ring(attrs, ins, out) * layout[1] * 16 if layout else 0


def rows(op: str, attrs: dict[str, Any], ins: list[Operand], out: Operand) -> list[str]:
    """softmax / log_softmax along an axis, layernorm / rmsnorm along the last: a warp per row, or
    the whole block per row for long rows, with packed loads when the row is contiguous and aligned.
    ``attrs["codegen"]`` (see ``row_ring``) sizes the block path's row ring."""
    x = ins[0]
    nd = len(x.shape)
    axis = attrs.get("axis", nd - 1)
    n = x.shape[axis]
    body = pointers(ins + [out], len(ins))
    body.append("ml::Task rowt = t;")
    body.append(f"rowt.hi[{axis}] = rowt.lo[{axis}] + 1;  // iterate the box without the row axis")
    layout = _block_row_layout(attrs, ins, out)
    if layout:
        width, _, per_thread = layout
        checks = " && ".join(
            f"ml::aligned({p}, {width * o.dtype.itemsize})"
            for p, o in [(f"in{k}", o) for k, o in enumerate(ins)] + [("out0", out)]
        )
        ring = row_ring(attrs, ins, out)
        if ring:
            body.append(
                f"if ({checks} && blockDim.x >= {BLOCK_ROW_MIN_THREADS}) {{  // a block per row, {per_thread} "
                f"pack(s) of {width} per thread, {ring} rows streaming through shared memory"
            )
            body.append("    __shared__ float red[128];  // the warps' partial results, two halves (ml::block_sum)")
            body += ["    " + line for line in _row_program(op, attrs, ins, out, axis, n, width, per_thread, ring)]
            body.append("    return;")
            body.append("}")
        body.append(f"if ({checks}) {{  // packed path: a warp per row, {width} elements per load")
        body += ["    " + line for line in _row_program(op, attrs, ins, out, axis, n, width)]
        body.append("    return;")
        body.append("}")
    body += _row_program(op, attrs, ins, out, axis, n, 1)
    return body


def _row_program(
    op: str,
    attrs: dict[str, Any],
    ins: list[Operand],
    out: Operand,
    axis: int,
    n: int,
    width: int,
    held: int = 0,
    ring: int = 0,
) -> list[str]:
    """The row loop. ``width`` > 1 walks the row in packs of that many elements; ``held`` > 0 spreads
    each row over the block, every thread holding up to ``held`` packs in registers (one read of the
    row), with block-wide reductions instead of warp-wide ones, the next ``ring`` - 1 rows arriving
    in shared memory meanwhile."""
    x = ins[0]
    nd = len(x.shape)
    others = [f"o[{d}]" if d != axis else None for d in range(nd)]
    xs, os_ = x.strides[axis], out.strides[axis]
    if held:
        packs = n // width
        pack = f"ml::Pack<{x.ctype}, {width}>"
        # every thread holds exactly `held` packs (the plan's block size divides the row): no guards, no
        # placeholder packs (a select per pack and per 16-bit element, on every row); at 16 packs
        # a thread the guarded form is kept: unguarded, ptxas spilled the layernorm's 64 row registers
        full = packs == held * attrs.get("codegen", {}).get("threads", 0) and held < BLOCK_ROW_MAX_PACKS_PER_THREAD
        head = [
            f"const int nrows = ml::box_count<{nd}>(rowt);",
            "auto row_at = [&](int e, ml::i64& xb, ml::i64& ob) {",
            f"    int o[{nd + 1}];",
            f"    ml::box_index<{nd}>(rowt, e, o);",
            f"    xb = {index_expr(x.strides, others)};",
            f"    ob = {index_expr(out.strides, others)};",
            "};",
            "int rk = 0;  // block reductions so far: which half of red the next one uses (one barrier each)",
        ]
        lines = [
            f"// a ring of {ring} row slots in shared memory, row e in slot e % {ring}; each thread copies and",
            "// reads back only its own packs (pk = threadIdx.x + u * blockDim.x), so no barrier guards a slot",
            "extern __shared__ float4 ml_smem4[];",
            f"{pack}* slots = reinterpret_cast<{pack}*>(ml_smem4);",
            "auto fetch = [&](int e, int slot) {  // one commit group a row, empty past the last row (the count",
            "    if (e < nrows) {                 // of groups in flight stays in step with the rows)",
            "        ml::i64 xb, ob;",
            "        row_at(e, xb, ob);",
            "#pragma unroll",
            f"        for (int u = 0; u < {held}; ++u) {{",
            "            const int pk = threadIdx.x + u * blockDim.x;",
            f"            {'' if full else f'if (pk < {packs}) '}ml::cp_async16(slots + slot * {packs} + pk, in0 + xb + pk * "
            f"{width}, true);",
            "        }",
            "    }",
            "    ml::cp_async_commit();",
            "};",
            "#pragma unroll",
            f"for (int d = 0; d < {ring}; ++d) fetch(d, d);",
            f"for (int e0 = 0; e0 < nrows; e0 += {ring}) {{",
            "#pragma unroll",
            f"for (int d = 0; d < {ring}; ++d) {{",
            "    const int e = e0 + d;",
            "    if (e >= nrows) break;",
            "    ml::i64 xb, ob;",
            "    row_at(e, xb, ob);",
            f"    ml::cp_async_wait<{ring - 1}>();  // this thread's packs of row e have landed",
            f"    {pack} px[{held}];  // row e",
            "#pragma unroll",
            f"    for (int u = 0; u < {held}; ++u) {{",
            "        const int pk = threadIdx.x + u * blockDim.x;",
            f"        px[u] = slots[d * {packs} + pk];"
            if full
            else f"        px[u] = pk < {packs} ? slots[d * {packs} + pk] : {pack}{{}};",
            "    }",
        ]
        refill = [
            f"    fetch(e + {ring}, d);  // row e + {ring} into row e's slot: this thread's packs of row e are in px, used",
        ]
        footer = ["}", "}"]
    else:
        head, refill, full = [], [], False
        lines = [
            f"ml::for_box_warps<{nd}>(rowt, [&](const int* o, int lane) {{",
            f"    const ml::i64 xb = {index_expr(x.strides, others)};",
            f"    const ml::i64 ob = {index_expr(out.strides, others)};",
        ]
        footer = ["});"]

    def held_packs(*body: str) -> list[str]:
        """``body`` for each pack pk of the row this thread holds (px[u])."""
        return [
            "#pragma unroll",
            f"    for (int u = 0; u < {held}; ++u) {{",
            "        const int pk = threadIdx.x + u * blockDim.x;",
            *([] if full else [f"        if (pk >= {n // width}) break;"]),
            *[("" if line.startswith("#") else "        ") + line for line in body],
            "    }",
        ]

    def reduce(kind: str, value: str) -> str:
        return f"ml::block_{kind}({value}, red, rk++)" if held else f"ml::warp_{kind}({value})"

    def each(statement: str, need_v: bool = True) -> list[str]:
        """Run ``statement`` for every element j of the row, with v = x[j] (float) when asked."""
        if held:
            return held_packs(
                "#pragma unroll",
                f"for (int q = 0; q < {width}; ++q) {{ const int j = pk * {width} + q; (void)j; "
                f"{'const float v = ml::get(px[u], q); ' if need_v else ''}{statement} }}",
            )
        if width == 1:
            load = f"const float v = ml::load(in0 + xb + (ml::i64)j * {xs}); " if need_v else ""
            return [f"    for (int j = lane; j < {n}; j += 32) {{ {load}{statement} }}"]
        out_lines = [f"    for (int j0 = lane * {width}; j0 < {n}; j0 += 32 * {width}) {{"]
        if need_v:
            out_lines.append(
                f"        const ml::Pack<{x.ctype}, {width}> px = ml::load_pack<{x.ctype}, {width}>(in0 + xb + j0);"
            )
        out_lines.append("#pragma unroll")
        out_lines.append(
            f"        for (int q = 0; q < {width}; ++q) {{ const int j = j0 + q; (void)j; "
            f"{'const float v = ml::get(px, q); ' if need_v else ''}{statement} }}"
        )
        out_lines.append("    }")
        return out_lines

    def store_each(value: str, per_pack: tuple[str, ...] = ()) -> list[str]:
        """out[j] = value for every j; packed stores on the packed paths (``per_pack``: statements run
        once per pack before its elements, on the block-per-row path)."""
        if held:
            return held_packs(
                *per_pack,
                f"ml::Pack<{out.ctype}, {width}> po;",
                "#pragma unroll",
                f"for (int q = 0; q < {width}; ++q) {{ const int j = pk * {width} + q; "
                f"const float v = ml::get(px[u], q); ml::set(po, q, {value}); }}",
                f"ml::store_pack<{out.ctype}, {width}>(out0 + ob + pk * {width}, po);",
            )
        if width == 1:
            return each(f"ml::store(out0 + ob + (ml::i64)j * {os_}, {value});")
        return [
            f"    for (int j0 = lane * {width}; j0 < {n}; j0 += 32 * {width}) {{",
            f"        const ml::Pack<{x.ctype}, {width}> px = ml::load_pack<{x.ctype}, {width}>(in0 + xb + j0);",
            f"        ml::Pack<{out.ctype}, {width}> po;",
            "#pragma unroll",
            f"        for (int q = 0; q < {width}; ++q) {{ const int j = j0 + q; const float v = ml::get(px, q); "
            f"ml::set(po, q, {value}); }}",
            f"        ml::store_pack<{out.ctype}, {width}>(out0 + ob + j0, po);",
            "    }",
        ]

    hoisted: list[str] = []  # loaded once per task, before the rows (block-per-row path)
    if op in ("softmax", "log_softmax") and held:
        # one barrier a row: each warp takes its exponentials relative to its own max and sums them,
        # the warps' (max, sum) pairs are combined once (two block reductions in turn, each behind a
        # barrier, left the row's processing longer than its transfer). A NaN needs no max of its own:
        # it reaches every output through the sum, as in torch.
        lines.append("    float m = ml::neg_inf();")
        lines += each("m = fmaxf(m, v);")
        lines += refill
        lines.append("    m = ml::warp_fmax(m);")
        lines.append("    const float mt = m == ml::neg_inf() ? 0.0f : m;  // a warp of -inf only: exps of 0")
        lines.append("    float s = 0.0f;")
        if out.dtype.itemsize == 2:
            # results rounded to 8 or 11 bits: 2^((v - mt) log2 e) to ~2 float32 ulps in three
            # instructions (expf's range reduction made these rows issue-bound: 0.40 of copy bandwidth).
            # Not fmaf(v, log2 e, -mt log2 e): mt log2 e overflows for a bf16 row masked with
            # finfo(bf16).min (every exp inf, the row NaN) and is inexact for huge |mt|
            exp = "ml::exp2_approx((v - mt) * 1.4426950408889634f)"
        else:
            exp = "expf(v - mt)"
        # softmax keeps each exponential for the store pass (registers: at most SOFTMAX_KEPT_EXPS a
        # thread) instead of computing it twice; same values
        keep = op == "softmax" and held * width <= SOFTMAX_KEPT_EXPS
        if keep:
            lines.append(f"    float ex[{held}][{width}];  // exp(v - mt) of each element this thread holds")
            lines += each(f"const float e_ = {exp}; ex[u][q] = e_; s += e_;")
        else:
            lines += each(f"s += {exp};")
        lines += [
            "    s = ml::warp_sum(s);",
            "    float mx = m, sx = s;",
            "    ml::warps_max_sumexp(mx, sx, red, rk++);  // the row's max, and its sum of exp(x - max)",
        ]
        if op == "softmax":
            # the warp's exps are relative to mt: rescaled to the row's max with the sum's reciprocal;
            # nothing to rescale where they are all 0, unless the whole row is -inf (NaN, as torch)
            lines.append("    const float c = (s == 0.0f && mx != ml::neg_inf()) ? 0.0f : expf(m - mx) / sx;")
            lines += store_each(("ex[u][q]" if keep else exp) + " * c")
        else:
            lines += store_each("(v - mx) - logf(sx)")
    elif op in ("softmax", "log_softmax"):
        lines.append("    float m = ml::neg_inf();")
        lines += each("m = (v > m || v != v) ? v : m;")
        lines += [f"    m = {reduce('max', 'm')};", "    float s = 0.0f;"]
        lines += each("s += expf(v - m);")
        # one division a row, a multiplication an element: at 8 warps an SM, a division per element
        # (an instruction sequence) made these rows issue-bound (softmax 0.21 of copy bandwidth)
        lines.append(f"    s = {reduce('sum', 's')};")
        lines.append("    const float inv_s = 1.0f / s;")
        lines += store_each("expf(v - m) * inv_s" if op == "softmax" else "(v - m) - logf(s)")
    else:
        absent = attrs.get("absent", ())
        names = ("weight", "bias") if op == "layernorm" else ("weight",)
        present = [nm for k, nm in enumerate(names, start=1) if k not in absent]
        wk = {nm: present.index(nm) + 1 for nm in present}
        eps = float_literal(attrs["eps"])
        if op == "layernorm":
            lines.append("    float s = 0.0f;")
            lines += each("s += v;")
            lines += refill
            lines += [f"    const float mean = {reduce('sum', 's')} / (float){n};", "    float q2 = 0.0f;"]
            lines += each("const float d = v - mean; q2 += d * d;")
            lines.append(f"    const float inv = 1.0f / sqrtf({reduce('sum', 'q2')} / (float){n} + {eps});")
            y = "(v - mean) * inv"
        else:
            lines.append("    float q2 = 0.0f;")
            lines += each("q2 += v * v;")
            lines += refill
            lines.append(f"    const float inv = 1.0f / sqrtf({reduce('sum', 'q2')} / (float){n} + {eps});")
            y = "v * inv"

        per_pack: list[str] = []
        # the weight's and bias's packs stay in registers for the whole task where they fit beside the
        # row's (at most BLOCK_ROW_MAX_PACKS_PER_THREAD packs a thread in all: more spilled)
        keep_params = held * (1 + len(present)) <= BLOCK_ROW_MAX_PACKS_PER_THREAD

        def param(name: str) -> str:
            """The weight's or bias's element j: on the block-per-row path from packs each thread loads
            once per task (its columns are the same in every row; a load per row put an L2 round trip
            between each row's reduction and its stores) or, where they do not fit, once per pack of
            the row (one 16-byte load, not one per element), else a load of its own."""
            k = wk[name]
            if held and not keep_params:
                per_pack.append(
                    f"const ml::Pack<{ins[k].ctype}, {width}> pw{k} = ml::load_pack<{ins[k].ctype}, {width}>"
                    f"(in{k} + pk * {width});"
                )
                return f"ml::get(pw{k}, q)"
            if held:
                hoisted.extend(
                    [
                        f"ml::Pack<{ins[k].ctype}, {width}> pw{k}[{held}];  // {name}: this thread's packs",
                        "#pragma unroll",
                        f"for (int u = 0; u < {held}; ++u)",
                        f"    pw{k}[u] = ml::load_pack<{ins[k].ctype}, {width}>(in{k} + min((int)threadIdx.x + u * "
                        f"(int)blockDim.x, {n // width - 1}) * {width});",
                    ]
                )
                return f"ml::get(pw{k}[u], q)"
            return f"ml::load(in{k} + (ml::i64)j * {ins[k].strides[0]})"

        if "weight" in wk:
            y = f"({y}) * {param('weight')}"
        if "bias" in wk:
            y = f"({y}) + {param('bias')}"
        lines += store_each(y, tuple(per_pack))
    return head + hoisted + lines + footer


def embedding(op: str, attrs: dict[str, Any], table: Operand, ids: Operand, out: Operand) -> list[str]:
    nd = len(out.shape)
    vocab = table.shape[0]
    body = pointers([table, ids, out], 2)
    body.append(f"ml::for_box<{nd}>(t, [&](const int* i) {{")
    body.append(
        f"    const ml::i64 id = ml::load(in1 + {index_expr(ids.strides, [f'i[{d}]' for d in range(nd - 1)])});"
    )
    body.append(
        f"    if (id < 0 || id >= {vocab}) {{ ml::fail(a, ml::DATA, blockIdx.x, tid, t.op, id, {vocab}, 0, 0); "
        "return; }"
    )
    body.append(
        f"    ml::store(out0 + {index_expr(out.strides, [f'i[{d}]' for d in range(nd)])}, "
        f"ml::load(in0 + id * {table.strides[0]} + (ml::i64)i[{nd - 1}] * {table.strides[1]}));"
    )
    body.append("});")
    return body


def rope(op: str, attrs: dict[str, Any], x: Operand, pos: Operand, out: Operand) -> list[str]:
    nd = len(x.shape)
    rd = attrs["rotary_dim"]
    inv = inv_frequencies(rd, attrs["theta"], attrs["scaling"])
    table = ", ".join(double_literal(v) for v in inv)
    # static: one table in global memory; a plain local constexpr array indexed at run time was copied
    # into every thread's local memory on every call (64 stores a thread per tile)
    body = [f"static constexpr double inv_freq[{len(inv)}] = {{{table}}};"]
    body += pointers([x, pos, out], 2)
    # a thread's elements are blockDim apart, so with 128-wide heads it meets the same frequency (and in
    # decode the same position) again and again: the double sincos, ~0.5 us of dependent instructions
    # (8 of them in turn per thread at 16 heads), is taken again only when the pair changes
    body.append("double memo_pos = 0.0, memo_s = 0.0, memo_c = 1.0;")
    body.append("int memo_f = -1;  // none yet")
    body.append(f"ml::for_box<{nd}>(t, [&](const int* i) {{")
    d = f"i[{nd - 1}]"
    xb = index_expr(x.strides[:-1], [f"i[{k}]" for k in range(nd - 1)])
    ob = index_expr(out.strides[:-1], [f"i[{k}]" for k in range(nd - 1)])
    body.append(f"    const ml::i64 xb = {xb}, ob = {ob};")
    body.append(f"    const int d = {d};")
    body.append(
        f"    if (d >= {rd}) {{ ml::store(out0 + ob + (ml::i64)d * {out.strides[-1]}, "
        f"ml::load(in0 + xb + (ml::i64)d * {x.strides[-1]})); return; }}"
    )
    if attrs["layout"] == "neox":
        half = rd // 2
        body.append(f"    const int f = d % {half}; const int p = d < {half} ? d + {half} : d - {half};")
        body.append(f"    const double sign = d < {half} ? -1.0 : 1.0;")
    else:
        body.append("    const int f = d / 2; const int p = d ^ 1; const double sign = (d & 1) ? 1.0 : -1.0;")
    pdims = broadcast_dims(nd - 1, pos)
    body.append(f"    const double pv = (double)ml::load(in1 + {index_expr(pos.strides, pdims)});")
    body.append("    if (f != memo_f || pv != memo_pos) {")
    body.append("        double s_, c_;")
    body.append("        sincos(pv * inv_freq[f], &s_, &c_);")
    body.append("        memo_s = s_;")
    body.append("        memo_c = c_;")
    body.append("        memo_f = f;")
    body.append("        memo_pos = pv;")
    body.append("    }")
    body.append("    const double s = memo_s, c = memo_c;")
    body.append(
        f"    const double v = (double)ml::load(in0 + xb + (ml::i64)d * {x.strides[-1]}) * c + "
        f"sign * (double)ml::load(in0 + xb + (ml::i64)p * {x.strides[-1]}) * s;"
    )
    body.append(f"    ml::store(out0 + ob + (ml::i64)d * {out.strides[-1]}, (float)v);")
    body.append("});")
    return body


def kv_update(op: str, attrs: dict[str, Any], cache: Operand, new: Operand, pos: Operand, out: Operand) -> list[str]:
    """Rows of new into the cache slab of the task's (batch, head), at their positions (in place)."""
    _, _, s, dim = cache.shape
    tokens = new.shape[2]
    body = pointers([cache, new, pos, out], 3)
    body.append("const int b = t.lo[0], h = t.lo[1];")
    body.append(f"for (int e = threadIdx.x; e < {tokens * dim}; e += blockDim.x) {{")
    body.append(f"    const int tok = e / {dim}, d = e % {dim};")
    body.append(
        f"    const ml::i64 p = ml::load(in2 + (ml::i64)b * {pos.strides[0]} + (ml::i64)tok * {pos.strides[1]});"
    )
    body.append(f"    if (p < 0 || p >= {s}) {{ ml::fail(a, ml::DATA, blockIdx.x, tid, t.op, p, {s}, 1, 0); break; }}")
    body.append(
        f"    ml::store(out0 + (ml::i64)b * {out.strides[0]} + (ml::i64)h * {out.strides[1]} + p * {out.strides[2]}"
        f" + (ml::i64)d * {out.strides[3]}, ml::load(in1 + (ml::i64)b * {new.strides[0]} + (ml::i64)h * "
        f"{new.strides[1]} + (ml::i64)tok * {new.strides[2]} + (ml::i64)d * {new.strides[3]}));"
    )
    body.append("}")
    return body


def concat(op: str, attrs: dict[str, Any], ins: list[Operand], out: Operand) -> list[str]:
    axis = attrs["axis"]
    nd = len(out.shape)
    body = pointers(ins + [out], len(ins))
    body.append(f"ml::for_box<{nd}>(t, [&](const int* i) {{")
    body.append(f"    const ml::i64 o = {index_expr(out.strides, [f'i[{d}]' for d in range(nd)])};")
    body.append(f"    const int c = i[{axis}];")
    start = 0
    for k, t in enumerate(ins):
        dims = [f"i[{d}]" if d != axis else f"(c - {start})" for d in range(nd)]
        cond = f"c < {start + t.shape[axis]}"
        body.append(
            f"    {'if' if k == 0 else 'else if'} ({cond}) ml::store(out0 + o, ml::load(in{k} + {index_expr(t.strides, dims)}));"
        )
        start += t.shape[axis]
    body.append("});")
    return body

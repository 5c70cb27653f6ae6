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

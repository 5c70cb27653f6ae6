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
from megaloop.frontend.ops._tilings import ELEMENTS
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


# ---- templates ------------------------------------------------------------------------------------


def elementwise(op: str, attrs: dict[str, Any], expr: str, ins: list[Operand], out: Operand) -> list[str]:
    """Any op of one expression over broadcast operands (and Python numbers): ``ml::elementwise``
    (megaloop/elementwise.cuh) with the expression as a lambda over the tensors' compute values (the
    numbers are constants in it), each operand's strides in the output's index space, and the packed
    path's width and packs in flight where the layout allows it (width 0: element by element only)."""
    scalars = attrs.get("scalars", {})
    slots = len(ins) + len(scalars)
    tensor_slots = [s for s in range(slots) if s not in scalars]
    compare = out.dtype.is_bool and not all(o.dtype.is_bool for o in ins)
    value_dtype = ins[-1].dtype if ins else out.dtype  # dtype the scalars stand in for
    names = "abc"
    params = ", ".join(f"const {compute_type(o.dtype)} {names[s]}" for s, o in zip(tensor_slots, ins))
    consts = "".join(
        f"const {compute_type(value_dtype)} {names[s]} = {_scalar(v, value_dtype, compare)}; "
        for s, v in sorted(scalars.items())
    )
    nd = len(out.shape)
    width, unroll = _elementwise_packs(ins, out, attrs.get("codegen", {}))
    operands = [_at(out.strides, "out0")] + [
        _at([0 if d is None else o.strides[k] for k, d in enumerate(broadcast_dims(nd, o))], f"in{k}", nd)
        for k, o in enumerate(ins)
    ]
    return [
        *pointers(ins + [out], len(ins)),
        f"const auto f = []({params}) {{ {consts}return {converter(out.dtype)}({expr}); }};",
        *([f"// packed path: {width} elements a load, {unroll} per operand in flight"] if width else []),
        f"ml::elementwise<{width}, {unroll}>(t, f, {', '.join(operands)});",
    ]


def _at(strides: Sequence[int], pointer: str, nd: int | None = None) -> str:
    """``ml::at<strides...>(pointer)``: an operand's strides right-aligned to the output's ``nd`` axes."""
    full = [0] * ((nd or len(strides)) - len(strides)) + list(strides)
    return f"ml::at<{', '.join(str(s) for s in full)}>({pointer})"


def _elementwise_packs(ins: list[Operand], out: Operand, hints: dict[str, int]) -> tuple[int, int]:
    """(elements a pack, packs an operand in flight) of the packed path, or (0, 1) when the layout rules
    it out at compile time. ``hints``: the op's largest tile (``elements``) and the block's ``threads``,
    where the generator knows them."""
    nd = len(out.shape)
    if nd == 0 or out.strides[-1] != 1:
        return 0, 1
    width = 16 // max([o.dtype.itemsize for o in ins] + [out.dtype.itemsize])
    if width < 2:
        return 0, 1
    vectors = 0
    for o in ins:
        if o.shape and o.shape[-1] != 1:  # (else one value per row of the tile)
            if not (o.strides[-1] == 1 and all(s % width == 0 for s in o.strides[:-1])):
                return 0, 1
            vectors += 1
    if not all(s % width == 0 for s in out.strides[:-1]):
        return 0, 1
    # packs in flight per thread: 8 of each operand for up to two vector operands (fewer stay short of
    # copy bandwidth at one 256-thread block per SM), 4 with more (registers)
    unroll = 8 if vectors <= 2 else 4
    if hints.get("elements") and hints.get("threads"):
        # no more packs a thread than the largest tile has: a decode-sized op (one tile of a few thousand
        # elements) ran 8 unrolled copies of its body, most of them on clamped duplicates, and its code
        # (up to 46 KB for a silu) is fetched into the instruction cache afresh every iteration
        unroll = max(1, min(unroll, -(-hints["elements"] // (width * hints["threads"]))))
    return width, unroll


def _scalar(value: float | int, dtype: DType, compare: bool) -> str:
    if dtype.is_int:
        return f"(ml::i64){int(value)}LL"
    if compare:  # comparisons see the number rounded to the tensor's dtype
        value = float(round_to(np.asarray(float(value)), dtype).astype(np.float32))
    return float_literal(value)


# Packs of a table row each thread of the embedding's packed path has in flight (its id, then the row)
EMBEDDING_UNROLL = 4


def embedding(op: str, attrs: dict[str, Any], table: Operand, ids: Operand, out: Operand) -> list[str]:
    """out[..., d] = table[ids[...], d] (``ml::embedding``, megaloop/gather.cuh): rows copied in 16-byte
    packs where table and out hold whole packs (element by element, a row of 2048 bf16 values costs a
    thread 8 dependent trips to memory on every token's critical path; a pack a thread is one trip),
    else element by element. An id outside the table is a data error naming it."""
    vocab = table.shape[0]
    width = 16 // out.dtype.itemsize
    packed = (
        table.dtype == out.dtype
        and table.strides[1] == 1
        and table.strides[0] % width == 0
        and out.strides[-1] == 1
        and all(st % width == 0 for st in out.strides[:-1])
    )
    if not packed:
        width = 0
    return [
        *pointers([table, ids, out], 2),
        f"const auto bad = [&](ml::i64 id) {{ ml::fail(a, ml::DATA, blockIdx.x, tid, t.op, id, {vocab}, 0, 0); }};",
        *([f"// packed path: a row in packs of {width}, {EMBEDDING_UNROLL} a thread in flight"] if packed else []),
        f"ml::embedding<{vocab}, {width}, {EMBEDDING_UNROLL}>(t, bad, {_at(out.strides, 'out0')}, "
        f"{_at(table.strides, 'in0')}, {_at(ids.strides, 'in1')});",
    ]


# ---- rope ---------------------------------------------------------------------------------------------

# sin(r) and cos(r) for |r| <= pi/4 in float32: the minimax polynomials of Cephes' sinf/cosf, at most
# 0.73 ulp (sin) and 0.88 ulp (cos) from the truth for every float32 in [0, pi/4] (measured with the
# arithmetic below written out in numpy, as tests/test_rope_kv_codegen.py models it). Short, branch-free
# and without sincosf's large-argument path, which the reduced angle never needs.
ROPE_SIN = (-1.95152959e-4, 8.33216087e-3, -1.66666546e-1)
ROPE_COS = (2.44331571e-5, -1.38873163e-3, 4.16666457e-2)
# pi/2 as a double and the double nearest to what it leaves out (Cody-Waite): k quarter turns come off
# the angle with an error of k * 6e-33, nothing next to float32's resolution for any k below
PIO2_HI = math.pi / 2
PIO2_LO = 6.123233995736766e-17
# 1.5 * 2^52: adding it rounds a float64 below 2^51 to an integer (the sum's ulp is 1)
ROUND_MAGIC = 1.5 * 2.0**52
# threads a block and elements of the largest task when an emitter is called without the generator's
# hints (megaloop.codegen.kernel passes them): the plan's default 8 warps and sm_90 task size
DEFAULT_THREADS = 256


def rope_frequencies(attrs: dict[str, Any]) -> str:
    """C++: rope's frequencies (rotary_dim / 2 of them, float64) as the table ``inv_freq``. Static: one
    table in global memory; a plain local constexpr array indexed at run time was copied into every
    thread's local memory on every call (64 stores a thread per tile)."""
    inv = inv_frequencies(attrs["rotary_dim"], attrs["theta"], attrs["scaling"])
    return f"static constexpr double inv_freq[{len(inv)}] = {{{', '.join(double_literal(v) for v in inv)}}};"


def rope_angle() -> list[str]:
    """C++ lambda ``angle(pv, w, s, c)``: sin and cos of pv * w, the reference's own float64 product."""
    sin = [float_literal(v) for v in ROPE_SIN]
    cos = [float_literal(v) for v in ROPE_COS]
    return [
        "// The product is float64 (as the reference: at position 1e6 float32 would be off by 0.03 rad) and so",
        "// is its reduction by whole quarter turns k; float32 polynomials then take the rest, |r| <= pi/4, and",
        "// the quarter turns become swaps and signs. A float64 sincos per element is far slower; a float32",
        "// sinf of the whole angle would lose its reduction's precision to rounding.",
        "const auto angle = [](double pv, double w, float& s, float& c) {",
        "    const double ang = pv * w;",
        "    // k = ang / (pi/2) to the nearest integer, the integer part of t (whole below 2^51 quarter turns,",
        "    // positions below 3e15 at frequency 1), which saves a float64 rint and a conversion per angle",
        f"    const double t = fma(ang, {double_literal(2 / math.pi)}, {double_literal(ROUND_MAGIC)});",
        f"    const double k = t - {double_literal(ROUND_MAGIC)};",
        f"    const float r = (float)fma(-k, {double_literal(PIO2_LO)}, fma(-k, {double_literal(PIO2_HI)}, ang));",
        "    const float z = r * r;",
        f"    const float sr = fmaf(fmaf(fmaf({sin[0]}, z, {sin[1]}), z, {sin[2]}) * z, r, r);",
        f"    const float cr = fmaf(fmaf(fmaf(fmaf({cos[0]}, z, {cos[1]}), z, {cos[2]}), z, -0.5f), z, 1.0f);",
        "    long long bits;",
        "    memcpy(&bits, &t, sizeof bits);",
        "    const int q = (int)(bits & 3);  // k mod 4: t's last bits (the magic number is a multiple of 4)",
        "    s = (q & 1) ? cr : sr;",
        "    c = (q & 1) ? sr : cr;",
        "    if (q & 2) s = -s;",
        "    if ((q + 1) & 2) c = -c;",
        "};",
    ]


def rope(op: str, attrs: dict[str, Any], x: Operand, pos: Operand, out: Operand) -> list[str]:
    """out[d] = x[d] cos - x[p] sin and out[p] = x[p] cos + x[d] sin for each pair (d, p) of the rotary
    dims, both rounded from float32 fmas, the angle as ``rope_angle``; dims past rotary_dim copied. A
    per-pair path (``_rope_pairs``) runs where the layout allows, the per-element path is the fallback
    and computes the same values."""
    nd = len(x.shape)
    rd = attrs["rotary_dim"]
    body = [rope_frequencies(attrs)]
    body += pointers([x, pos, out], 2)
    body += rope_angle()
    body += _rope_pairs(attrs, x, pos, out)
    body.append(f"ml::for_box<{nd}>(t, [&](const int* i) {{")
    xb = index_expr(x.strides[:-1], [f"i[{k}]" for k in range(nd - 1)])
    ob = index_expr(out.strides[:-1], [f"i[{k}]" for k in range(nd - 1)])
    body.append(f"    const ml::i64 xb = {xb}, ob = {ob};")
    body.append(f"    const int d = i[{nd - 1}];")
    body.append(
        f"    if (d >= {rd}) {{ ml::store(out0 + ob + (ml::i64)d * {out.strides[-1]}, "
        f"ml::load(in0 + xb + (ml::i64)d * {x.strides[-1]})); return; }}"
    )
    if attrs["layout"] == "neox":
        half = rd // 2
        body.append(f"    const int f = d % {half}; const int p = d < {half} ? d + {half} : d - {half};")
        body.append(f"    const float sign = d < {half} ? -1.0f : 1.0f;")
    else:
        body.append("    const int f = d / 2; const int p = d ^ 1; const float sign = (d & 1) ? 1.0f : -1.0f;")
    body.append(
        f"    const double pv = (double)ml::load(in1 + {index_expr(pos.strides, broadcast_dims(nd - 1, pos))});"
    )
    body.append("    float s, c;")
    body.append("    angle(pv, inv_freq[f], s, c);")
    body.append(
        f"    const float xd = ml::load(in0 + xb + (ml::i64)d * {x.strides[-1]}), "
        f"xp = ml::load(in0 + xb + (ml::i64)p * {x.strides[-1]});"
    )
    body.append(f"    ml::store(out0 + ob + (ml::i64)d * {out.strides[-1]}, fmaf(xd, c, sign * (xp * s)));")
    body.append("});")
    return body


def _rope_width(x: Operand, out: Operand, rd: int, neox: bool, rows: int, threads: int) -> int:
    """Elements a load for the per-pair path (0: not taken): the widest pack (16 bytes down to one
    element, two for interleaved pairs) that the layout allows and that still gives a task's ``rows``
    at least one item per thread; the narrowest allowed one when none does (decode: 8 heads of 64 make
    32 items of 16-byte packs, a single warp's work)."""
    hd = x.shape[-1]
    if x.strides[-1] != 1 or out.strides[-1] != 1:
        return 0
    row_strides = [s for o in (x, out) for s, n in zip(o.strides[:-1], o.shape[:-1]) if n > 1]
    rotated = rd // 2 if neox else rd  # the first elements of the pairs: packs hold whole runs of them
    chosen, w = 0, 16 // x.dtype.itemsize
    while w >= (1 if neox else 2):
        if rotated % w == 0 and (hd - rd) % w == 0 and all(s % w == 0 for s in row_strides):
            chosen = w
            if rows * (rotated + hd - rd) // w >= threads:
                break
        w //= 2
    return chosen


def _rope_pairs(attrs: dict[str, Any], x: Operand, pos: Operand, out: Operand) -> list[str]:
    """The per-pair path, or nothing when the layout rules it out at compile time. An item is one pack
    of W elements of a row and its partners: neox loads the pack at j*W and its partner pack at
    half + j*W (W pairs), interleaved one pack of W/2 pairs; items past the rotary dims copy a pack.
    Each pair's angle is taken once (the per-element path takes it for both elements), and a thread's
    U items are loaded (x and position) before any is computed and stored: a store may alias the next
    load, so one element at a time waited the full memory latency each."""
    last = len(x.shape) - 1
    hd, rd, neox = x.shape[-1], attrs["rotary_dim"], attrs["layout"] == "neox"
    hints = attrs.get("codegen", {})
    threads = hints.get("threads") or DEFAULT_THREADS
    elements = hints.get("elements") or max(ELEMENTS.values())  # the tiling's task size
    rows = min(math.prod(x.shape[:-1]), max(1, elements // hd))  # of the largest task
    w = _rope_width(x, out, rd, neox, rows, threads)
    if not w:
        return []
    half, rotated = rd // 2, rd // 2 if neox else rd
    rot_items, items = rotated // w, (rotated + hd - rd) // w  # per row
    unroll = max(1, min(4, -(-rows * items // threads)))
    pack = f"ml::Pack<{x.ctype}, {w}>"
    # outer axes that move (size 1 has index 0): the item's row from its number, innermost first
    outer = [d for d in range(last) if x.shape[d] > 1]
    dims = [f"i[{d}]" if d in outer else None for d in range(last)]
    decompose = []
    for n, d in enumerate(reversed(outer)):
        if n == len(outer) - 1:
            decompose.append(f"i[{d}] = t.lo[{d}] + (int)r;")
        else:
            decompose.append(
                f"{{ const unsigned ext = t.hi[{d}] - t.lo[{d}]; i[{d}] = t.lo[{d}] + (int)(r % ext); r /= ext; }}"
            )
    pdims = [dims[len(dims) - len(pos.shape) + k] if n > 1 else None for k, n in enumerate(pos.shape)]
    loads = [f"pv[u] = (double)ml::load(in1 + {index_expr(pos.strides, pdims)});"]

    def get(p: str, k: str) -> str:  # ml::get reads a 16-bit element from its 32-bit word: packs of 2+
        return f"ml::get({p}, {k})" if w > 1 else f"ml::load(&{p}.v[{k}])"

    if neox:
        # a copied item's pack is its "partner" pack (half + j*W); its own load reads the same address
        first = f"j * {w}" if rot_items == items else f"(j < {rot_items} ? j * {w} : {half} + j * {w})"
        loads += [
            f"pa[u] = ml::load_pack<{x.ctype}, {w}>(in0 + xb + {first});",
            f"pb[u] = ml::load_pack<{x.ctype}, {w}>(in0 + xb + {half} + j * {w});",
        ]
        rotate = [
            f"{pack} qa, qb;",
            "#pragma unroll",
            f"for (int k = 0; k < {w}; ++k) {{",
            "    float s, c;",
            f"    angle(pv[u], inv_freq[j * {w} + k], s, c);",
            f"    const float x1 = {get('pa[u]', 'k')}, x2 = {get('pb[u]', 'k')};",
            "    ml::set(qa, k, fmaf(x1, c, -(x2 * s)));",
            "    ml::set(qb, k, fmaf(x2, c, x1 * s));",
            "}",
            f"ml::store_pack<{x.ctype}, {w}>(o + j * {w}, qa);",
            f"ml::store_pack<{x.ctype}, {w}>(o + {half} + j * {w}, qb);",
        ]
        copy = f"ml::store_pack<{x.ctype}, {w}>(o + {half} + j * {w}, pb[u]);"
    else:
        loads.append(f"pa[u] = ml::load_pack<{x.ctype}, {w}>(in0 + xb + j * {w});")
        rotate = [
            f"{pack} qa;",
            "#pragma unroll",
            f"for (int k = 0; k < {w // 2}; ++k) {{",
            "    float s, c;",
            f"    angle(pv[u], inv_freq[j * {w // 2} + k], s, c);",
            "    const float x1 = ml::get(pa[u], 2 * k), x2 = ml::get(pa[u], 2 * k + 1);",
            "    ml::set(qa, 2 * k, fmaf(x1, c, -(x2 * s)));",
            "    ml::set(qa, 2 * k + 1, fmaf(x2, c, x1 * s));",
            "}",
            f"ml::store_pack<{x.ctype}, {w}>(o + j * {w}, qa);",
        ]
        copy = f"ml::store_pack<{x.ctype}, {w}>(o + j * {w}, pa[u]);"
    if rot_items == items:
        compute = rotate
    else:
        compute = [
            f"if (j < {rot_items}) {{",
            *["    " + s for s in rotate],
            "} else {  // past rotary_dim",
            "    " + copy,
            "}",
        ]
    checks = [
        f"t.lo[{last}] == 0",
        f"t.hi[{last}] == {hd}",
        f"ml::aligned(in0, {w * x.dtype.itemsize})",
        f"ml::aligned(out0, {w * out.dtype.itemsize})",
    ]
    count = " * ".join(f"(ml::i64)(t.hi[{d}] - t.lo[{d}])" for d in outer) or "1"
    return [
        f"// per-pair path: whole rows, {w} elements a load, {unroll} item(s) a thread in flight",
        f"if ({' && '.join(checks)}) {{",
        f"    const ml::i64 rows = {count};",
        f"    if (rows * {items} <= 0x7fffffff) {{  // 32-bit index arithmetic",
        f"        const unsigned total = (unsigned)(rows * {items});",
        f"        for (unsigned e0 = threadIdx.x; e0 < total; e0 += {unroll} * blockDim.x) {{",
        f"            {pack} pa[{unroll}]{f', pb[{unroll}]' if neox else ''};",
        f"            double pv[{unroll}];",
        f"            ml::i64 ob[{unroll}];",
        f"            int jj[{unroll}];",
        "#pragma unroll",
        f"            for (int u = 0; u < {unroll}; ++u) {{",
        # past the end: the last item again, loaded but never stored (defined without a branch)
        "                const unsigned e = min(e0 + u * blockDim.x, total - 1);",
        f"                const int j = (int)(e % {items}u);",
        f"                [[maybe_unused]] unsigned r = e / {items}u;",
        f"                [[maybe_unused]] int i[{max(last, 1)}];",
        *["                " + s for s in decompose],
        f"                const ml::i64 xb = {index_expr(x.strides[:-1], dims)};",
        f"                ob[u] = {index_expr(out.strides[:-1], dims)};",
        "                jj[u] = j;",
        *["                " + s for s in loads],
        "            }",
        "#pragma unroll",
        f"            for (int u = 0; u < {unroll}; ++u) {{",
        "                if (e0 + u * blockDim.x >= total) break;",
        "                const int j = jj[u];",
        f"                {out.ctype}* o = out0 + ob[u];",
        *["                " + s for s in compute],
        "            }",
        "        }",
        "        return;",
        "    }",
        "}",
    ]


# ---- kv_cache_update ------------------------------------------------------------------------------------


def kv_update(op: str, attrs: dict[str, Any], cache: Operand, new: Operand, pos: Operand, out: Operand) -> list[str]:
    """Rows of new into the cache slab of the task's (batch, head), at their positions (in place). A
    position outside [0, max_len) is reported (ml::DATA) and never written (a negative one skipped
    where the op ignores negative positions)."""
    _, _, s, dim = cache.shape
    tokens = new.shape[2]
    body = pointers([cache, new, pos, out], 3)
    body.append("const int b = t.lo[0], h = t.lo[1];")
    body += _kv_update_packed(attrs, new, pos, out)
    body.append(f"for (int e = threadIdx.x; e < {tokens * dim}; e += blockDim.x) {{")
    body.append(f"    const int tok = e / {dim}, d = e % {dim};")
    body.append(
        f"    const ml::i64 p = ml::load(in2 + (ml::i64)b * {pos.strides[0]} + (ml::i64)tok * {pos.strides[1]});"
    )
    if attrs.get("ignore_negative"):
        body.append("    if (p < 0) continue;  // a negative position writes nothing")
    body.append(f"    if (p < 0 || p >= {s}) {{ ml::fail(a, ml::DATA, blockIdx.x, tid, t.op, p, {s}, 1, 0); break; }}")
    body.append(
        f"    ml::store(out0 + (ml::i64)b * {out.strides[0]} + (ml::i64)h * {out.strides[1]} + p * {out.strides[2]}"
        f" + (ml::i64)d * {out.strides[3]}, ml::load(in1 + (ml::i64)b * {new.strides[0]} + (ml::i64)h * "
        f"{new.strides[1]} + (ml::i64)tok * {new.strides[2]} + (ml::i64)d * {new.strides[3]}));"
    )
    body.append("}")
    return body


# items (a rotary pair, or a dim past rotary_dim) a thread loads, with their positions, before it
# stores any (a store may alias the next load: one at a time paid the memory latency per item); fewer
# where the task has fewer items than its threads have (decode: 32 pairs a head)
ROPE_KV_ITEMS = 4


def rope_kv_update(
    op: str, attrs: dict[str, Any], cache: Operand, new: Operand, pos: Operand, out: Operand
) -> list[str]:
    """rope_kv_cache_update: the rows of new of the task's (batch, head), each rotary pair rotated at its
    token's position with rope's formula (``rope``: the same fmas, so the same bits as rope's output)
    and stored at that position of the cache slab, dims past rotary_dim copied bit for bit. A position
    outside [0, max_len) is reported (ml::DATA), never written, and ends the thread's part of the task
    (as kv_update's)."""
    _, _, s, dim = cache.shape
    tokens = new.shape[2]
    rd = attrs["rotary_dim"]
    half = rd // 2
    per_token = half + dim - rd  # items: the rotary pairs, then the dims passed through
    total = tokens * per_token
    threads = attrs.get("codegen", {}).get("threads") or DEFAULT_THREADS
    u = max(1, min(ROPE_KV_ITEMS, -(-total // threads)))
    neox = attrs["layout"] == "neox"
    first, second = ("f", f"f + {half}") if neox else ("2 * f", "2 * f + 1")  # the pair's dims
    at_new = f"(ml::i64)b * {new.strides[0]} + (ml::i64)h * {new.strides[1]}"
    at_out = f"(ml::i64)b * {out.strides[0]} + (ml::i64)h * {out.strides[1]}"
    body = [rope_frequencies(attrs)]
    body += pointers([cache, new, pos, out], 3)
    body += rope_angle()
    body += [
        "const int b = t.lo[0], h = t.lo[1];",
        f"// {tokens} token(s) x ({half} rotary pairs + {dim - rd} dims copied), {u} item(s) a thread at a time",
        f"for (ml::i64 e0 = threadIdx.x; e0 < {total}LL; e0 += {u} * (ml::i64)blockDim.x) {{",
        f"    int d0[{u}], d1[{u}];  // the item's dims (d1 < 0: a dim copied)",
        f"    ml::i64 p[{u}];",
        f"    {new.ctype} x0[{u}], x1[{u}];  // as stored: a copied dim keeps its bits (NaN payloads too)",
        f"    double w[{u}];  // the pair's frequency",
        "#pragma unroll",
        f"    for (int k = 0; k < {u}; ++k) {{  // every load out before any store",
        f"        const ml::i64 e = min(e0 + k * (ml::i64)blockDim.x, {total - 1}LL);",
        f"        const int tok = (int)(e / {per_token}), f = (int)(e % {per_token});",
        f"        d0[k] = f < {half} ? {first} : {rd} + (f - {half});",
        f"        d1[k] = f < {half} ? {second} : -1;",
        f"        w[k] = inv_freq[f < {half} ? f : 0];",
        f"        p[k] = ml::load(in2 + (ml::i64)b * {pos.strides[0]} + (ml::i64)tok * {pos.strides[1]});",
        f"        const ml::i64 row = {at_new} + (ml::i64)tok * {new.strides[2]};",
        f"        x0[k] = in1[row + (ml::i64)d0[k] * {new.strides[3]}];",
        f"        x1[k] = in1[row + (ml::i64)(d1[k] >= 0 ? d1[k] : d0[k]) * {new.strides[3]}];",
        "    }",
        "#pragma unroll",
        f"    for (int k = 0; k < {u}; ++k) {{",
        f"        if (e0 + k * (ml::i64)blockDim.x >= {total}LL) break;",
        f"        if (p[k] < 0 || p[k] >= {s}) {{ ml::fail(a, ml::DATA, blockIdx.x, tid, t.op, p[k], {s}, 1, 0); return; }}",
        f"        {out.ctype}* o = out0 + {at_out} + p[k] * {out.strides[2]};",
        "        if (d1[k] < 0) {",
        f"            o[(ml::i64)d0[k] * {out.strides[3]}] = x0[k];",
        "        } else {",
        "            float sn, cs;",
        "            angle((double)p[k], w[k], sn, cs);",
        "            const float a0 = ml::load(&x0[k]), a1 = ml::load(&x1[k]);",
        "            // rope's formula (its pair path's fmas): the same bits as rope's output",
        f"            ml::store(o + (ml::i64)d0[k] * {out.strides[3]}, fmaf(a0, cs, -(a1 * sn)));",
        f"            ml::store(o + (ml::i64)d1[k] * {out.strides[3]}, fmaf(a1, cs, a0 * sn));",
        "        }",
        "    }",
        "}",
    ]
    return body


def _kv_update_packed(attrs: dict[str, Any], new: Operand, pos: Operand, out: Operand) -> list[str]:
    """The batched path: packs of W elements along head_dim (16 bytes where the layout allows, down to
    one element at any stride), copied bit for bit, U packs and their positions loaded by a thread
    before any is stored. A per-element loop pays the full memory latency per element (a store may
    alias the next load, so neither compiler nor hardware overlaps them)."""
    _, _, s, dim = out.shape
    tokens = new.shape[2]
    w = 16 // out.dtype.itemsize
    while w > 1 and not (
        dim % w == 0
        and new.strides[3] == 1
        and out.strides[3] == 1
        and (tokens == 1 or new.strides[2] % w == 0)
        and (s == 1 or out.strides[2] % w == 0)
    ):
        w //= 2
    per_row = dim // w
    total = tokens * per_row
    if not 0 < total < 2**30:  # 32-bit index arithmetic
        return []
    threads = attrs.get("codegen", {}).get("threads") or DEFAULT_THREADS
    unroll = max(1, min(8, -(-total // threads)))
    pack = f"ml::Pack<{out.ctype}, {w}>"
    return [
        f"const {new.ctype}* src = in1 + (ml::i64)b * {new.strides[0]} + (ml::i64)h * {new.strides[1]};",
        f"{out.ctype}* dst = out0 + (ml::i64)b * {out.strides[0]} + (ml::i64)h * {out.strides[1]};",
        f"const {pos.ctype}* ps = in2 + (ml::i64)b * {pos.strides[0]};",
        f"// batched path: {w} elements a copy, {unroll} copy(ies) a thread in flight",
        f"if (ml::aligned(src, {w * new.dtype.itemsize}) && ml::aligned(dst, {w * out.dtype.itemsize})) {{",
        f"    for (unsigned e0 = threadIdx.x; e0 < {total}u; e0 += {unroll} * blockDim.x) {{",
        f"        {pack} v[{unroll}];",
        f"        ml::i64 p[{unroll}];",
        f"        int c[{unroll}];",
        "#pragma unroll",
        f"        for (int u = 0; u < {unroll}; ++u) {{",
        # past the end: the last pack again, loaded but never stored (defined without a branch)
        f"            const unsigned e = min(e0 + u * blockDim.x, {total - 1}u);",
        f"            const int tok = (int)(e / {per_row}u);",
        f"            c[u] = (int)(e % {per_row}u);",
        f"            p[u] = ml::load(ps + (ml::i64)tok * {pos.strides[1]});",
        f"            v[u] = ml::load_pack<{new.ctype}, {w}>(src + (ml::i64)tok * {new.strides[2]} + "
        f"(ml::i64)c[u] * {w * new.strides[3]});",
        "        }",
        "#pragma unroll",
        f"        for (int u = 0; u < {unroll}; ++u) {{",
        f"            if (e0 + u * blockDim.x >= {total}u) break;",
        *(
            ["            if (p[u] < 0) continue;  // a negative position writes nothing"]
            if attrs.get("ignore_negative")
            else []
        ),
        f"            if (p[u] < 0 || p[u] >= {s}) {{",
        f"                ml::fail(a, ml::DATA, blockIdx.x, tid, t.op, p[u], {s}, 1, 0);",
        "                return;  // as the per-element loop: reported, never written",
        "            }",
        f"            ml::store_pack<{out.ctype}, {w}>(dst + p[u] * {out.strides[2]} + "
        f"(ml::i64)c[u] * {w * out.strides[3]}, v[u]);",
        "        }",
        "    }",
        "    return;",
        "}",
    ]


def concat(op: str, attrs: dict[str, Any], ins: list[Operand], out: Operand) -> list[str]:
    """The inputs one after another along the axis (``ml::concat``, megaloop/gather.cuh)."""
    sizes = ", ".join(str(t.shape[attrs["axis"]]) for t in ins)
    operands = ", ".join([_at(out.strides, "out0")] + [_at(t.strides, f"in{k}") for k, t in enumerate(ins)])
    return [*pointers(ins + [out], len(ins)), f"ml::concat<{attrs['axis']}, {sizes}>(t, {operands});"]

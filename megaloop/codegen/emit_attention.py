"""CUDA tile code for attention: tensor cores (megaloop/attention.cuh, FlashAttention-2 style) for
blocks of 16 queries or more of 16-bit heads, the split-key path (flash-decoding inside one tile) for
packed, aligned heads (decode), and a warp per (head, query) with an online softmax for the rest.
Part of megaloop/codegen/emit.py."""

from __future__ import annotations

import math
from typing import Any

from megaloop.codegen.emit import Operand, float_literal, pointers


def attention(op: str, attrs: dict[str, Any], ins: list[Operand], out: Operand) -> list[str]:
    """A warp per (query head, query): online softmax over the visible keys in float32, the head and
    value vectors spread over the lanes (see megaloop/frontend/ops/attention.py for the mask)."""
    q, k, v = ins[:3]
    absent = attrs.get("absent", ())
    optional = [s for s in (3, 4) if s not in absent]
    qpos = ins[3 + optional.index(3)] if 3 in optional else None
    lens = ins[3 + optional.index(4)] if 4 in optional else None
    group = q.shape[1] // k.shape[1]
    scale = float_literal(attrs["scale"])
    body = pointers(ins + [out], len(ins))
    body += _attention_mma(attrs, ins, out, qpos, lens, optional)
    body += _attention_split(attrs, ins, out, qpos, lens, optional, group, scale)
    body += _online_rows(attrs, ins, None)
    dv, vl = v.shape[3], (v.shape[3] + 31) // 32
    body.append(
        f"    const ml::i64 ob = (ml::i64)bi * {out.strides[0]} + (ml::i64)h * {out.strides[1]} + (ml::i64)i * {out.strides[2]};"
    )
    body.append(
        f"    for (int c = 0; c < {vl}; ++c) {{ const int dd = lane + 32 * c; "
        f"if (dd < {dv}) ml::store(out0 + ob + (ml::i64)dd * {out.strides[3]}, l > 0.0f ? acc[c] / l : 0.0f); }}"
    )
    body.append("});")
    return body


def attention_partial(op: str, attrs: dict[str, Any], ins: list[Operand], out: Operand) -> list[str]:
    """The same rows over one key range (the tile's split): the unnormalised output, then m and l,
    as float32 (megaloop/frontend/ops/attention_split.py)."""
    k, v = ins[1], ins[2]
    tk, dv = k.shape[2], v.shape[3]
    chunk = -(-tk // attrs["splits"])
    vl = (dv + 31) // 32
    absent = attrs.get("absent", ())
    optional = [s for s in (3, 4) if s not in absent]
    qpos = ins[3 + optional.index(3)] if 3 in optional else None
    lens = ins[3 + optional.index(4)] if 4 in optional else None
    group = ins[0].shape[1] // k.shape[1]
    body = pointers(ins + [out], len(ins))
    body += _attention_split(attrs, ins, out, qpos, lens, optional, group, float_literal(attrs["scale"]), chunk)
    body += _online_rows(attrs, ins, chunk)
    body.append(
        f"    const ml::i64 ob = (ml::i64)bi * {out.strides[0]} + (ml::i64)h * {out.strides[1]} + (ml::i64)i * "
        f"{out.strides[2]} + (ml::i64)o[3] * {out.strides[3]};"
    )
    body.append(
        f"    for (int c = 0; c < {vl}; ++c) {{ const int dd = lane + 32 * c; "
        f"if (dd < {dv}) out0[ob + (ml::i64)dd * {out.strides[4]}] = acc[c]; }}"
    )
    body.append(
        f"    if (lane == 0) {{ out0[ob + (ml::i64){dv} * {out.strides[4]}] = m; "
        f"out0[ob + (ml::i64){dv + 1} * {out.strides[4]}] = l; }}"
    )
    body.append("});")
    return body


COMBINE_HELD_SPLITS = 16  # key ranges whose m, l and weight attention_combine keeps in registers


def attention_combine(op: str, attrs: dict[str, Any], ins: list[Operand], out: Operand) -> list[str]:
    """A warp per (batch, head, query): the largest m over the key ranges, then the weighted sums of
    the outputs (lanes over the value vector) and of l; zeros when no range saw a key."""
    x = ins[0]
    splits, dv = x.shape[3], x.shape[4] - 2
    xs = x.strides
    body = pointers(ins + [out], len(ins))
    body.append("ml::Task rowt = t;")
    body.append("rowt.hi[3] = rowt.lo[3] + 1;  // a warp per (batch, head, query)")
    body.append("ml::for_box_warps<4>(rowt, [&](const int* o, int lane) {")
    body.append(f"    const ml::i64 xb = (ml::i64)o[0] * {xs[0]} + (ml::i64)o[1] * {xs[1]} + (ml::i64)o[2] * {xs[2]};")
    if splits <= COMBINE_HELD_SPLITS:
        # every load before any store (out0 may alias in0 as far as the compiler knows, so a store between
        # them kept the next loads from starting: ~6 dependent L2 round trips a warp), each range's weight
        # computed once; the same operations in the same order as the reference loop, so the same bits
        chunks = -(-dv // 32)
        body.append(f"    float ms[{splits}], ls[{splits}], w[{splits}];  // each range's m, l and weight")
        body.append("#pragma unroll")
        body.append(
            f"    for (int s = 0; s < {splits}; ++s) {{ const ml::i64 sb = xb + (ml::i64)s * {xs[3]}; "
            f"ms[s] = in0[sb + {dv * xs[4]}]; ls[s] = in0[sb + {(dv + 1) * xs[4]}]; }}"
        )
        body.append("    float top = ml::neg_inf();")
        body.append("#pragma unroll")
        body.append(f"    for (int s = 0; s < {splits}; ++s) top = ms[s] > top ? ms[s] : top;")
        body.append("    const float base = top == ml::neg_inf() ? 0.0f : top;")
        body.append("    float total = 0.0f;")
        body.append("#pragma unroll")
        body.append(f"    for (int s = 0; s < {splits}; ++s) {{ w[s] = expf(ms[s] - base); total += ls[s] * w[s]; }}")
        body.append(
            f"    const ml::i64 ob = (ml::i64)o[0] * {out.strides[0]} + (ml::i64)o[1] * {out.strides[1]} + (ml::i64)o[2] * {out.strides[2]};"
        )
        body.append(f"    float acc[{chunks}];  // the lane's values dd = lane + 32 j")
        body.append("#pragma unroll")
        body.append(f"    for (int j = 0; j < {chunks}; ++j) {{")
        body.append("        const int dd = lane + 32 * j;")
        body.append("        acc[j] = 0.0f;")
        body.append(f"        if (dd >= {dv}) continue;")
        body.append("#pragma unroll")
        body.append(
            f"        for (int s = 0; s < {splits}; ++s) acc[j] += in0[xb + (ml::i64)s * {xs[3]} + (ml::i64)dd * {xs[4]}] * w[s];"
        )
        body.append("    }")
        body.append("#pragma unroll")
        body.append(f"    for (int j = 0; j < {chunks}; ++j) {{")
        body.append("        const int dd = lane + 32 * j;")
        body.append(
            f"        if (dd < {dv}) ml::store(out0 + ob + (ml::i64)dd * {out.strides[3]}, total > 0.0f ? acc[j] / total : 0.0f);"
        )
        body.append("    }")
    else:  # too many ranges to keep in registers: each weight recomputed where it is used
        body.append("    float top = ml::neg_inf();")
        body.append(
            f"    for (int s = 0; s < {splits}; ++s) {{ const float m = in0[xb + (ml::i64)s * {xs[3]} + {dv * xs[4]}]; top = m > top ? m : top; }}"
        )
        body.append("    const float base = top == ml::neg_inf() ? 0.0f : top;")
        body.append("    float total = 0.0f;")
        body.append(
            f"    for (int s = 0; s < {splits}; ++s) {{ const ml::i64 sb = xb + (ml::i64)s * {xs[3]}; "
            f"total += in0[sb + {(dv + 1) * xs[4]}] * expf(in0[sb + {dv * xs[4]}] - base); }}"
        )
        body.append(
            f"    const ml::i64 ob = (ml::i64)o[0] * {out.strides[0]} + (ml::i64)o[1] * {out.strides[1]} + (ml::i64)o[2] * {out.strides[2]};"
        )
        body.append(f"    for (int dd = lane; dd < {dv}; dd += 32) {{")
        body.append("        float acc = 0.0f;")
        body.append(
            f"        for (int s = 0; s < {splits}; ++s) {{ const ml::i64 sb = xb + (ml::i64)s * {xs[3]}; "
            f"acc += in0[sb + (ml::i64)dd * {xs[4]}] * expf(in0[sb + {dv * xs[4]}] - base); }}"
        )
        body.append(
            f"        ml::store(out0 + ob + (ml::i64)dd * {out.strides[3]}, total > 0.0f ? acc / total : 0.0f);"
        )
        body.append("    }")
    body.append("});")
    return body


def _visible_keys(attrs: dict[str, Any], qpos: Operand | None, optional: list[int], tq: int, pad: str) -> list[str]:
    """C++ lines declaring qp (query i of batch bi's position) and [begin, end), the keys it sees, from
    len (the rule of megaloop/frontend/ops/attention.py); ``pad`` indents them."""
    if qpos is not None:
        lines = [
            f"const ml::i64 qp = ml::load(in{3 + optional.index(3)} + (ml::i64)bi * {qpos.strides[0]} + "
            f"(ml::i64)i * {qpos.strides[1]});"
        ]
    else:
        lines = [f"const ml::i64 qp = len - {tq} + i;"]
    if attrs["causal"]:
        window = attrs["window"]
        lines += [
            "ml::i64 end = qp + 1 < len ? qp + 1 : len;",
            f"ml::i64 begin = {'qp - ' + str(window) + ' + 1' if window is not None else '0'};",
            "if (begin < 0) begin = 0;",
        ]
    else:
        lines.append("ml::i64 begin = 0, end = len;")
    return [pad + line for line in lines]


def _online_rows(attrs: dict[str, Any], ins: list[Operand], chunk: int | None) -> list[str]:
    """The warp-per-row loop up to the end of the key loop: in scope after it are bi, h, i, lane,
    the row's m and l and acc[] (the lanes' share of the unnormalised output). With ``chunk``, the
    tile is one key range of attention_partial (its split index in o[3])."""
    q, k, v = ins[:3]
    absent = attrs.get("absent", ())
    optional = [s for s in (3, 4) if s not in absent]
    qpos = ins[3 + optional.index(3)] if 3 in optional else None
    lens = ins[3 + optional.index(4)] if 4 in optional else None
    _, hq, tq, d = q.shape
    hkv, tk, dv = k.shape[1], k.shape[2], v.shape[3]
    group = hq // hkv
    dl, vl = (d + 31) // 32, (dv + 31) // 32
    scale = float_literal(attrs["scale"])
    nd = 4 if chunk is None else 5
    body = ["ml::Task rowt = t;"]
    body.append("rowt.hi[3] = rowt.lo[3] + 1;  // a warp per (batch, head, query)")
    if chunk is not None:
        body.append("rowt.hi[4] = rowt.lo[4] + 1;  // (and this tile's key range)")
    body.append(f"ml::for_box_warps<{nd}>(rowt, [&](const int* o, int lane) {{")
    body.append("    const int bi = o[0], h = o[1], i = o[2];")
    body.append(f"    const int kh = h / {group};")
    if lens is not None:
        body.append(f"    const ml::i64 len = ml::load(in{3 + optional.index(4)} + (ml::i64)bi * {lens.strides[0]});")
        body.append(
            f"    if (len < 0 || len > {tk}) {{ if (lane == 0) ml::fail(a, ml::DATA, blockIdx.x, tid, t.op, len, {tk}, 2, 0); return; }}"
        )
    else:
        body.append(f"    const ml::i64 len = {tk};")
    body += _visible_keys(attrs, qpos, optional, tq, "    ")
    if chunk is not None:
        body.append(f"    const ml::i64 lo = (ml::i64)o[3] * {chunk}, hi = lo + {chunk};  // this tile's keys")
        body.append("    if (begin < lo) begin = lo;")
        body.append("    if (end > hi) end = hi;")
    body.append(f"    float qv[{dl}], acc[{vl}];")
    body.append(
        f"    const ml::i64 qb = (ml::i64)bi * {q.strides[0]} + (ml::i64)h * {q.strides[1]} + (ml::i64)i * {q.strides[2]};"
    )
    body.append(
        f"    for (int c = 0; c < {dl}; ++c) {{ const int dd = lane + 32 * c; "
        f"qv[c] = dd < {d} ? ml::load(in0 + qb + (ml::i64)dd * {q.strides[3]}) : 0.0f; }}"
    )
    body.append(f"    for (int c = 0; c < {vl}; ++c) acc[c] = 0.0f;")
    body.append("    float m = ml::neg_inf(), l = 0.0f;")
    body.append(f"    const ml::i64 kb = (ml::i64)bi * {k.strides[0]} + (ml::i64)kh * {k.strides[1]};")
    body.append(f"    const ml::i64 vb = (ml::i64)bi * {v.strides[0]} + (ml::i64)kh * {v.strides[1]};")
    body.append("    for (ml::i64 j = begin; j < end; ++j) {")
    body.append("        float s = 0.0f;")
    body.append(
        f"        for (int c = 0; c < {dl}; ++c) {{ const int dd = lane + 32 * c; "
        f"if (dd < {d}) s += qv[c] * ml::load(in1 + kb + j * {k.strides[2]} + (ml::i64)dd * {k.strides[3]}); }}"
    )
    body.append(f"        s = ml::warp_sum(s) * {scale};")
    body.append("        const float mn = s > m ? s : m;")
    body.append("        const float corr = expf(m - mn), p = expf(s - mn);")
    body.append("        l = l * corr + p;")
    body.append(
        f"        for (int c = 0; c < {vl}; ++c) {{ const int dd = lane + 32 * c; "
        f"acc[c] = acc[c] * corr + (dd < {dv} ? p * ml::load(in2 + vb + j * {v.strides[2]} + (ml::i64)dd * "
        f"{v.strides[3]}) : 0.0f); }}"
    )
    body.append("        m = mn;")
    body.append("    }")
    return body


def attention_shared_bytes(attrs: dict[str, Any], ins: list[Operand], warps: int) -> int:
    """Dynamic shared memory the tensor-core and split-key attention paths need (0 when neither applies)."""
    split = warps * (ins[0].shape[3] + 2) * 4 if _split_applies(ins) else 0
    if not _mma_applies(attrs, ins):
        return split
    return max(split, attention_mma_bytes(ins[0].shape[3], attention_mma_split(attrs, ins)))


ATT_BK = 64  # keys staged a block (attention.cuh)
MMA_MIN_QUERIES = 16  # a warp's unit of queries: fewer (decode) take the split-key path


def attention_mma_bytes(d: int, split: int = 1) -> int:
    """attention.cuh's attention_mma_shared_bytes: two stages of ``split`` K and V blocks each, rows
    padded by 8."""
    return 2 * 2 * split * ATT_BK * (d + 8) * 2 + 256


def attention_mma_split(attrs: dict[str, Any], ins: list[Operand]) -> int:
    """Warps a unit of 16 queries may take (attention.cuh's SPLIT): 2 where the plan's shared memory
    holds stages of two key blocks, so a tile of fewer units than half its warps keeps them all busy,
    each warp of a pair on every other key block (else a prefill tile of 64 queries, 4 units, leaves 4
    of 8 warps idle)."""
    hints = attrs.get("codegen", {})
    fits = attention_mma_bytes(ins[0].shape[3], 2) + MMA_STATIC_RESERVE <= hints.get("shared_memory", 227 * 1024)
    return 2 if fits and hints.get("warps", MMA_MAX_WARPS) >= 2 else 1


MMA_MAX_WARPS = 8  # above, __launch_bounds__ leaves a thread too few registers: 16 warps spilled 0.5 KB a thread
MMA_STATIC_RESERVE = 8 * 1024  # the kernel's static shared memory, out of the plan's budget (as for wgmma)


def _mma_applies(attrs: dict[str, Any], ins: list[Operand]) -> bool:
    """The tensor-core path: 16-bit q, k, v of one type, head dimensions equal, 16..128 in steps of 16,
    contiguous, 16-byte aligned rows, blocks of at least 16 queries (not a split form: attention_partial
    keeps its own path), at most MMA_MAX_WARPS warps, and the stages within the plan's shared memory."""
    q, k, v = ins[:3]
    d = q.shape[3]
    hints = attrs.get("codegen", {})
    return (
        "splits" not in attrs
        and hints.get("warps", MMA_MAX_WARPS) <= MMA_MAX_WARPS
        and attention_mma_bytes(d) + MMA_STATIC_RESERVE <= hints.get("shared_memory", 227 * 1024)
        and q.dtype == k.dtype == v.dtype
        and q.dtype.name in ("bfloat16", "float16")
        and v.shape[3] == d
        and d % 16 == 0
        and 16 <= d <= 128
        and q.shape[2] >= MMA_MIN_QUERIES
        and q.strides[3] == k.strides[3] == v.strides[3] == 1
        and all(st % 8 == 0 for st in q.strides[:3] + k.strides[:3] + v.strides[:3])
    )


def _attention_mma(
    attrs: dict[str, Any],
    ins: list[Operand],
    out: Operand,
    qpos: Operand | None,
    lens: Operand | None,
    optional: list[int],
) -> list[str]:
    """The tile on tensor cores (ml::attention_mma): each query's visible keys from the same rule as
    the other paths (see megaloop/frontend/ops/attention.py), written as the range callback."""
    if not _mma_applies(attrs, ins):
        return []
    q, k, v = ins[:3]
    d, tq, tk = q.shape[3], q.shape[2], k.shape[2]
    group = q.shape[1] // k.shape[1]
    scale_log2 = float_literal(attrs["scale"] * math.log2(math.e))
    o = out.strides
    lines = [
        "if (ml::aligned(in0, 16) && ml::aligned(in1, 16) && ml::aligned(in2, 16)) {  // tensor cores",
        "    extern __shared__ float4 ml_smem4[];",
        "    const int bi = t.lo[0], h0 = t.lo[1], s0 = t.lo[2];",
        f"    const int kh = h0 / {group};  // the tile's heads share it",
    ]
    if lens is not None:
        lines += [
            f"    const ml::i64 len = ml::load(in{3 + optional.index(4)} + (ml::i64)bi * {lens.strides[0]});",
            f"    const bool bad_len = len < 0 || len > {tk};",
            f"    if (bad_len && threadIdx.x == 0) ml::fail(a, ml::DATA, blockIdx.x, tid, t.op, len, {tk}, 2, 0);",
        ]
    else:
        lines += [f"    const ml::i64 len = {tk};", "    const bool bad_len = false;"]
    lines.append("    auto range = [&](int r, ml::i64& first, ml::i64& last) {")
    lines.append("        const int i = s0 + r;")
    lines += _visible_keys(attrs, qpos, optional, tq, "        ")
    lines += [
        "        first = begin;",
        "        last = bad_len ? begin : end;  // a bad length is reported above; nothing is read",
        "    };",
        f"    ml::attention_mma<{q.ctype}, {d}, {attention_mma_split(attrs, ins)}>(in0 + (ml::i64)bi * {q.strides[0]} + (ml::i64)h0 * {q.strides[1]} + "
        f"(ml::i64)s0 * {q.strides[2]}, {q.strides[1]}, {q.strides[2]}, t.hi[1] - h0, t.hi[2] - s0,",
        f"        in1 + (ml::i64)bi * {k.strides[0]} + (ml::i64)kh * {k.strides[1]}, {k.strides[2]},",
        f"        in2 + (ml::i64)bi * {v.strides[0]} + (ml::i64)kh * {v.strides[1]}, {v.strides[2]}, {tk}, {scale_log2},",
        "        ml_smem4, range, [&](int hh, int r, int dd, float val) {",
        f"            ml::store(out0 + (ml::i64)bi * {o[0]} + (ml::i64)(h0 + hh) * {o[1]} + (ml::i64)(s0 + r) * {o[2]} + "
        f"(ml::i64)dd * {o[3]}, val);",
        "        });",
        "    return;",
        "}",
    ]
    return lines


def _split_applies(ins: list[Operand]) -> bool:
    q, k, v = ins[:3]
    d = q.shape[3]
    width = 16 // q.dtype.itemsize
    lanes = d // width if d % width == 0 else 0
    return (
        lanes > 0
        and 32 % lanes == 0
        and v.shape[3] == d
        and q.dtype == k.dtype == v.dtype
        and q.strides[3] == k.strides[3] == v.strides[3] == 1
        and all(st % width == 0 for st in q.strides[:3] + k.strides[:3] + v.strides[:3])
    )


def _split_store(out: Operand, chunk: int | None) -> list[str]:
    """The merged (head, query) of the split-key path: normalised (attention), or the unnormalised
    sum with its max and exp-sum (attention_partial, float32 [..., split, D + 2])."""
    o = out.strides
    ob = f"(ml::i64)bi * {o[0]} + (ml::i64)h * {o[1]} + (ml::i64)i * {o[2]}"
    if chunk is None:
        store = f"ml::store(out0 + ob + (ml::i64)dd * {o[3]}, lsum > 0.0f ? o / lsum : 0.0f);"
    else:
        ob += f" + (ml::i64)t.lo[3] * {o[3]}"
        store = f"out0[ob + (ml::i64)dd * {o[4]}] = o;"
    lines = [
        f"            const ml::i64 ob = {ob};",
        "            for (int dd = lane; dd < D; dd += 32) {",
        "                float o = 0.0f;",
        "                for (int p2 = 0; p2 < split; ++p2) { const float* sl = part + (warp + p2) * (D + 2); o += mx == ml::neg_inf() ? 0.0f : sl[dd] * expf(sl[D] - mx); }",
        f"                {store}",
        "            }",
    ]
    if chunk is not None:
        lines.append(
            f"            if (lane == 0) {{ out0[ob + (ml::i64)D * {o[4]}] = mx; out0[ob + (ml::i64)(D + 1) * {o[4]}] = lsum; }}"
        )
    return lines


def _attention_split(
    attrs: dict[str, Any],
    ins: list[Operand],
    out: Operand,
    qpos: Operand | None,
    lens: Operand | None,
    optional: list[int],
    group: int,
    scale: str,
    chunk: int | None = None,
) -> list[str]:
    """Keys split over the block's warps (flash-decoding inside one tile), each warp taking several keys
    at once (lanes split the head dimension in packs), partial softmax states merged in shared memory."""
    if not _split_applies(ins):
        return []
    q, k, v = ins[:3]
    d = q.shape[3]
    width = 16 // q.dtype.itemsize
    lpk = d // width  # lanes per key
    kpw = 32 // lpk  # keys per warp step
    tk, tq = k.shape[2], q.shape[2]
    ct = q.ctype
    lines = [
        "if (ml::aligned(in0, 16) && ml::aligned(in1, 16) && ml::aligned(in2, 16)) {  // split-key path",
        "    extern __shared__ float4 ml_smem4[];",
        "    float* part = reinterpret_cast<float*>(ml_smem4);",
        f"    constexpr int W = {width}, LPK = {lpk}, KPW = {kpw}, D = {d};",
        "    const int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;",
        "    const int g = lane / LPK, r = lane % LPK;",
        "    const int bi = t.lo[0], nh = t.hi[1] - t.lo[1], nq = t.hi[2] - t.lo[2], pairs = nh * nq;",
        "    const int split = warps >= pairs ? warps / pairs : 1;",
        "    const int per_round = warps / split;",
        "    for (int base = 0; base < pairs; base += per_round) {",
        "        const int pair = base + warp / split, piece = warp % split;",
        "        const bool active = warp < per_round * split && pair < pairs;",
        "        float m = ml::neg_inf(), l = 0.0f, acc[W];",
        "#pragma unroll",
        "        for (int w = 0; w < W; ++w) acc[w] = 0.0f;",
        "        int h = 0, i = 0;",
        "        if (active) {",
        "            h = t.lo[1] + pair / nq; i = t.lo[2] + pair % nq;",
        f"            const int kh = h / {group};",
    ]
    if lens is not None:
        lines += [
            f"            const ml::i64 len = ml::load(in{3 + optional.index(4)} + (ml::i64)bi * {lens.strides[0]});",
            f"            if (len < 0 || len > {tk}) {{ if (lane == 0) ml::fail(a, ml::DATA, blockIdx.x, tid, t.op, len, {tk}, 2, 0); }}",
        ]
    else:
        lines.append(f"            const ml::i64 len = {tk};")
    lines += _visible_keys(attrs, qpos, optional, tq, "            ")
    if chunk is not None:  # attention_partial: only this tile's key range (its split index in t.lo[3])
        lines += [
            f"            const ml::i64 range_lo = (ml::i64)t.lo[3] * {chunk}, range_hi = range_lo + {chunk};",
            "            if (begin < range_lo) begin = range_lo;",
            "            if (end > range_hi) end = range_hi;",
        ]
    # one step: its keys' scores (a key's lanes summed by shuffles), then the online softmax over them (kc,
    # vv: the step's packs of keys and values)
    step = [
        "                float s = 0.0f;",
        "                if (live) s = ml::dot(qpk, kc);",
        "#pragma unroll",
        "                for (int o = LPK / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o, LPK);",
        "                if (live) {",
        f"                    s *= {scale};",
        "                    const float mn = s > m ? s : m;",
        "                    const float corr = expf(m - mn), p = expf(s - mn);",
        "                    l = l * corr + p;",
        "#pragma unroll",
        "                    for (int w = 0; w < W; ++w) acc[w] = acc[w] * corr + p * ml::get(vv, w);",
        "                    m = mn;",
        "                }",
    ]
    lines += (
        [
            f"            if (end > {tk}) end = {tk};",
            "            const ml::i64 n = end > begin ? end - begin : 0, chunk = (n + split - 1) / split;",
            "            const ml::i64 j_lo = begin + piece * chunk, j_hi = j_lo + chunk < end ? j_lo + chunk : end;",
            f"            const ml::Pack<{ct}, W> qpk = ml::load_pack<{ct}, W>(in0 + (ml::i64)bi * {q.strides[0]} + (ml::i64)h * {q.strides[1]} + (ml::i64)i * {q.strides[2]} + r * W);",
            f"            const {ct}* kp = in1 + (ml::i64)bi * {k.strides[0]} + (ml::i64)kh * {k.strides[1]} + r * W;",
            f"            const {ct}* vp = in2 + (ml::i64)bi * {v.strides[0]} + (ml::i64)kh * {v.strides[1]} + r * W;",
            # One step of keys ahead: neither the keys' latency (rings of 4-8 steps in flight) nor the steps'
            # width (more keys a warp step) bounds this tile (docs/experiments.md).
        ]
        + [
            "            // each step's key and value packs are loaded a step ahead, so that a memory round trip runs",
            "            // behind the step before instead of one starting every step (decode: ~9 steps a warp in",
            f"            // turn); rows past the end are clamped to the last ({tk - 1}): loaded, never used",
            f"            ml::Pack<{ct}, W> kn = ml::load_pack<{ct}, W>(kp + (j_lo + g < {tk} ? j_lo + g : {tk - 1}) * {k.strides[2]});",
            f"            ml::Pack<{ct}, W> vn = ml::load_pack<{ct}, W>(vp + (j_lo + g < {tk} ? j_lo + g : {tk - 1}) * {v.strides[2]});",
            "            // every lane runs the same number of steps (the shuffles below need the whole warp);",
            "            // lanes past the end of their piece contribute nothing",
            "            for (ml::i64 j0 = j_lo; j0 < j_hi; j0 += KPW) {",
            "                const ml::i64 j = j0 + g;",
            "                const bool live = j < j_hi;",
            f"                const ml::Pack<{ct}, W> kc = kn, vv = vn;",
            f"                const ml::i64 jn = j + KPW < {tk} ? j + KPW : {tk - 1};",
            f"                kn = ml::load_pack<{ct}, W>(kp + jn * {k.strides[2]});",
            f"                vn = ml::load_pack<{ct}, W>(vp + jn * {v.strides[2]});",
            *step,
            "            }",
            "        }",
        ]
        + [
            "        // merge the KPW key groups of the warp (lanes with the same r)",
            "#pragma unroll",
            "        for (int o = LPK; o < 32; o <<= 1) {",
            "            const float m2 = __shfl_xor_sync(0xffffffffu, m, o), l2 = __shfl_xor_sync(0xffffffffu, l, o);",
            "            const float mx = m2 > m ? m2 : m;",
            "            const float c1 = mx == ml::neg_inf() ? 0.0f : expf(m - mx), c2 = mx == ml::neg_inf() ? 0.0f : expf(m2 - mx);",
            "            l = l * c1 + l2 * c2;",
            "#pragma unroll",
            "            for (int w = 0; w < W; ++w) acc[w] = acc[w] * c1 + __shfl_xor_sync(0xffffffffu, acc[w], o) * c2;",
            "            m = mx;",
            "        }",
            "        if (active && g == 0) {",
            "            float* slot = part + warp * (D + 2);",
            "#pragma unroll",
            "            for (int w = 0; w < W; ++w) slot[r * W + w] = acc[w];",
            "            if (r == 0) { slot[D] = m; slot[D + 1] = l; }",
            "        }",
            "        __syncthreads();",
            "        if (active && piece == 0) {  // combine the pieces of this (head, query)",
            "            float mx = ml::neg_inf();",
            "            for (int p2 = 0; p2 < split; ++p2) { const float mp = part[(warp + p2) * (D + 2) + D]; mx = mp > mx ? mp : mx; }",
            "            float lsum = 0.0f;",
            "            for (int p2 = 0; p2 < split; ++p2) { const float* sl = part + (warp + p2) * (D + 2); lsum += mx == ml::neg_inf() ? 0.0f : sl[D + 1] * expf(sl[D] - mx); }",
            *_split_store(out, chunk),
            "        }",
            "        __syncthreads();",
            "    }",
            "    return;",
            "}",
        ]
    )
    return lines

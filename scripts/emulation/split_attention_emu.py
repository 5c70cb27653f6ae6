"""Emulate the split-key path of attention_partial tiles (megaloop/attention.cuh's attention_split_keys,
with the constants of the generated call) in numpy float32."""
from __future__ import annotations

import re
import sys
import numpy as np
import ml_dtypes
import megaloop as ml
from megaloop.plan import make_plan
from megaloop.codegen import generate
from megaloop.frontend.ops.attention_split import _partial_reference

F32 = np.float32
NEG_INF = F32(-np.inf)


def f32(x):
    return np.asarray(x, dtype=np.float32)


def shfl_xor(v, mask, width=32):
    """__shfl_xor_sync(0xffffffff, v, mask, width) for a [32, ...] array of lane values."""
    lane = np.arange(32)
    src = lane ^ mask
    ok = src < (lane // width + 1) * width  # a later group's lane: own value
    src = np.where(ok, src, lane)
    return v[src]


class Block:
    pass


def extract_split_block(src: str, sig: int) -> list[str]:
    """The lines of tile function sig_<sig> (its pointers and its ml::attention_partial call)."""
    start = src.index(f"__device__ __noinline__ void sig_{sig}(")
    body = src[start:]
    return body[: body.index("\n}\n")].splitlines()[1:]


ITEM_BYTES = {"ml::bf16": 2, "ml::f16": 2, "float": 4}
CALL = re.compile(
    r"ml::attention_partial<ml::AttnShape<(\d+), (\d+), (\d+), (\d+), (\d+), (true|false), (\d+)>, (\d+), true>"
    r"\(a, t, tid, \(\(float\)([-0-9a-fx.p+]+)\), ml::at<([^>]*)>\(out0\), ml::at<([^>]*)>\(in0\), "
    r"ml::at<([^>]*)>\(in1\), ml::at<([^>]*)>\(in2\), (ml::Absent\{\}|ml::at<[^>]*>\(in\d\)), "
    r"(ml::Absent\{\}|ml::at<[^>]*>\(in\d\))\);"
)


def parse(lines):
    """The split-key path's constants (megaloop/attention.cuh's attention_split_keys), every one read
    from the tile function's ml::attention_partial call and its pointers."""
    P = Block()
    txt = "\n".join(lines)
    call = CALL.search(txt)
    assert call, "no split-key ml::attention_partial call:\n" + txt
    group, tq, tk, d, dv, causal, window, chunk = (int(x) if x.isdigit() else x for x in call.groups()[:8])
    ctype = re.search(r"const (\S+)\* in0 = ", txt).group(1)
    P.W = 16 // ITEM_BYTES[ctype]
    P.D, P.LPK = d, d // P.W
    P.KPW = 32 // P.LPK
    assert dv == d
    P.group = group
    strides = [tuple(int(x) for x in call.group(n).split(", ")) for n in (10, 11, 12, 13)]
    os_, qs, ks, vs = strides

    def optional(text):
        found = re.fullmatch(r"ml::at<([^>]*)>\(in(\d)\)", text)
        return (int(found.group(2)), *(int(x) for x in found.group(1).split(", "))) if found else None

    P.qpos, P.lens = optional(call.group(14)), optional(call.group(15))
    P.len_max = P.len_lit = P.tk_clamp = tk
    P.tq_lit = tq
    P.causal = causal == "true"
    P.window = window or None
    P.chunk_lo = P.chunk_hi = chunk
    P.qs, P.ks, P.vs = qs[:3], ks[:2], vs[:2]
    P.kj, P.vj = ks[2], vs[2]
    assert qs[3] == ks[3] == vs[3] == 1
    P.scale = F32(float.fromhex(call.group(9)))
    P.os, P.od = os_[:4], os_[4]
    return P


def normalized(lines):
    return "\n".join(re.sub(r"\d+", "#", l) for l in lines)


def dot_pack(a, b):
    """ml::dot: s = 0; for i: s += a[i] * b[i] (float32, no FMA contraction)."""
    s = np.zeros(a.shape[0], F32)
    for w in range(a.shape[1]):
        s = f32(s + f32(a[:, w] * b[:, w]))
    return s


def emulate_tile(P, warps, lo, hi, bufs, out, counts, shared_floats, log):
    """One block running one tile's split-key path. bufs: {slot: flat array}; out: flat float32."""
    W, LPK, KPW, D = P.W, P.LPK, P.KPW, P.D
    lane = np.arange(32)
    g, r = lane // LPK, lane % LPK
    part = np.full(shared_floats, np.nan, F32)
    bi, nh, nq = lo[0], hi[1] - lo[1], hi[2] - lo[2]
    pairs = nh * nq
    split = warps // pairs if warps >= pairs else 1
    per_round = warps // split
    q, k, v = bufs[0], bufs[1], bufs[2]

    def ld(buf, idx):
        idx = np.asarray(idx)
        assert np.all(idx >= 0) and np.all(idx < buf.size), "out-of-bounds load"
        val = buf[idx]
        assert not np.any(np.isnan(val)), "load of an element outside the tensor"
        return val

    def st(idx, val):
        assert 0 <= idx < out.size, "out-of-bounds store"
        out[idx] = val
        counts[idx] += 1

    base = 0
    while base < pairs:
        written = np.zeros(shared_floats, bool)
        st_active, st_piece = [], []
        for warp in range(warps):
            pair, piece = base + warp // split, warp % split
            active = warp < per_round * split and pair < pairs
            st_active.append(active), st_piece.append(piece)
            m = np.full(32, NEG_INF, F32)
            l = np.zeros(32, F32)
            acc = np.zeros((32, W), F32)
            if active:
                h, i = lo[1] + pair // nq, lo[2] + pair % nq
                kh = h // P.group
                if P.lens is not None:
                    ln = int(ld(bufs[P.lens[0]], bi * P.lens[1]))
                    if ln < 0 or ln > P.len_max:
                        log.append(("fail", ln))
                else:
                    ln = P.len_lit
                if P.qpos is not None:
                    qp = int(ld(bufs[P.qpos[0]], bi * P.qpos[1] + i * P.qpos[2]))
                else:
                    qp = ln - P.tq_lit + i
                if P.causal:
                    end = qp + 1 if qp + 1 < ln else ln
                    begin = qp - P.window + 1 if P.window is not None else 0
                    if begin < 0:
                        begin = 0
                else:
                    begin, end = 0, ln
                range_lo = lo[3] * P.chunk_lo
                range_hi = range_lo + P.chunk_hi
                if begin < range_lo:
                    begin = range_lo
                if end > range_hi:
                    end = range_hi
                if end > P.tk_clamp:
                    end = P.tk_clamp
                n = end - begin if end > begin else 0
                chunk = (n + split - 1) // split  # n >= 0, split >= 1: C and Python division agree
                j_lo = begin + piece * chunk
                j_hi = j_lo + chunk if j_lo + chunk < end else end
                qoff = bi * P.qs[0] + h * P.qs[1] + i * P.qs[2]
                qpk = ld(q, qoff + r[:, None] * W + np.arange(W)[None, :])
                kbase = bi * P.ks[0] + kh * P.ks[1]
                vbase = bi * P.vs[0] + kh * P.vs[1]
                j0 = j_lo
                while j0 < j_hi:
                    j = j0 + g
                    live = j < j_hi
                    s = np.zeros(32, F32)
                    vv = np.full((32, W), np.nan, F32)  # uninitialised where not live
                    if live.any():
                        jl = j[live]
                        kk = ld(k, kbase + r[live][:, None] * W + jl[:, None] * P.kj + np.arange(W)[None, :])
                        s[live] = dot_pack(qpk[live], kk)
                        vv[live] = ld(v, vbase + r[live][:, None] * W + jl[:, None] * P.vj + np.arange(W)[None, :])
                    o = LPK // 2
                    while o > 0:
                        s = f32(s + shfl_xor(s, o, LPK))
                        o >>= 1
                    s = np.where(live, f32(s * P.scale), s)
                    mn = np.where(s > m, s, m)
                    with np.errstate(invalid="ignore", over="ignore"):
                        corr = f32(np.exp(f32(m - mn)))
                        p = f32(np.exp(f32(s - mn)))
                    nl = f32(f32(l * corr) + p)
                    nacc = f32(f32(acc * corr[:, None]) + f32(p[:, None] * vv))
                    l = np.where(live, nl, l)
                    acc = np.where(live[:, None], nacc, acc)
                    m = np.where(live, mn, m)
                    j0 += KPW
            o = LPK
            while o < 32:
                m2, l2 = shfl_xor(m, o), shfl_xor(l, o)
                mx = np.where(m2 > m, m2, m)
                with np.errstate(invalid="ignore"):
                    c1 = np.where(mx == NEG_INF, F32(0), f32(np.exp(f32(m - mx))))
                    c2 = np.where(mx == NEG_INF, F32(0), f32(np.exp(f32(m2 - mx))))
                l = f32(f32(l * c1) + f32(l2 * c2))
                acc = f32(f32(acc * c1[:, None]) + f32(shfl_xor(acc, o) * c2[:, None]))
                m = mx
                o <<= 1
            if active:
                slot = warp * (D + 2)
                for ln_ in range(32):
                    if g[ln_] == 0:
                        for w in range(W):
                            ix = slot + r[ln_] * W + w
                            assert not written[ix], "shared slot written twice"
                            part[ix] = acc[ln_, w]
                            written[ix] = True
                        if r[ln_] == 0:
                            for ix, val in ((slot + D, m[ln_]), (slot + D + 1, l[ln_])):
                                assert not written[ix]
                                part[ix] = val
                                written[ix] = True
        # __syncthreads()
        for warp in range(warps):
            pair, piece = base + warp // split, warp % split
            if not (st_active[warp] and piece == 0):
                continue
            h, i = lo[1] + pair // nq, lo[2] + pair % nq

            def rd(ix):
                assert 0 <= ix < shared_floats and written[ix], f"stale/unwritten shared read {ix}"
                return part[ix]

            mx = NEG_INF
            for p2 in range(split):
                mp = rd((warp + p2) * (D + 2) + D)
                mx = mp if mp > mx else mx
            lsum = F32(0)
            for p2 in range(split):
                sl = (warp + p2) * (D + 2)
                lsum = F32(lsum + (F32(0) if mx == NEG_INF else F32(rd(sl + D + 1) * F32(np.exp(F32(rd(sl + D) - mx))))))
            ob = bi * P.os[0] + h * P.os[1] + i * P.os[2] + lo[3] * P.os[3]
            for ln_ in range(32):
                dd = ln_
                while dd < D:
                    o_ = F32(0)
                    for p2 in range(split):
                        sl = (warp + p2) * (D + 2)
                        o_ = F32(o_ + (F32(0) if mx == NEG_INF else F32(rd(sl + dd) * F32(np.exp(F32(rd(sl + D) - mx))))))
                    st(ob + dd * P.od, o_)
                    dd += 32
            st(ob + D * P.od, mx)
            st(ob + (D + 1) * P.od, lsum)
        # __syncthreads()
        base += per_round
    return dict(pairs=pairs, split=split, per_round=per_round)


def layout(arr, strides, fill):
    """A flat buffer holding arr at the given element strides (elsewhere `fill`)."""
    size = 1 + sum((n - 1) * s for n, s in zip(arr.shape, strides)) if arr.size else 1
    buf = np.full(size, fill, dtype=np.float32 if fill is not None and np.isnan(fill) else np.int64)
    idx = sum(np.indices(arr.shape)[d] * strides[d] for d in range(arr.ndim))
    buf[idx] = arr
    return buf

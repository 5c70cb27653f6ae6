"""Emulate the split-key path of attention_partial tiles (generated CUDA) in numpy float32."""
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
INT = r"(-?\d+)"


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
    start = src.index(f"__device__ __noinline__ void sig_{sig}(")
    body = src[start:]
    a = body.index("// split-key path")
    b = body.index("    return;\n", a)
    return body[a:b].splitlines()


def grab(lines, pat, n=1, required=True):
    rx = re.compile(pat)
    hits = [rx.search(l) for l in lines]
    hits = [h for h in hits if h]
    if not hits:
        if required:
            raise AssertionError(f"pattern not found: {pat}")
        return None
    assert len(hits) == n or n is None, (pat, len(hits))
    return hits[0]


def parse(lines):
    """Constants of the generated split block (every one read from the source)."""
    P = Block()
    txt = "\n".join(lines)
    h = grab(lines, r"constexpr int W = (\d+), LPK = (\d+), KPW = (\d+), D = (\d+);")
    P.W, P.LPK, P.KPW, P.D = map(int, h.groups())
    P.group = int(grab(lines, r"const int kh = h / (\d+);").group(1))
    h = grab(lines, r"const ml::i64 len = ml::load\(in(\d+) \+ \(ml::i64\)bi \* (\d+)\);", required=False)
    if h:
        P.lens = (int(h.group(1)), int(h.group(2)))
        h2 = grab(lines, r"if \(len < 0 \|\| len > (\d+)\)")
        P.len_max = int(h2.group(1))
    else:
        P.lens = None
        P.len_lit = int(grab(lines, r"const ml::i64 len = (\d+);").group(1))
    h = grab(lines, r"const ml::i64 qp = ml::load\(in(\d+) \+ \(ml::i64\)bi \* (\d+) \+ \(ml::i64\)i \* (\d+)\);", required=False)
    if h:
        P.qpos = tuple(map(int, h.groups()))
    else:
        P.qpos = None
        P.tq_lit = int(grab(lines, r"const ml::i64 qp = len - (\d+) \+ i;").group(1))
    P.causal = "ml::i64 end = qp + 1 < len ? qp + 1 : len;" in txt
    if P.causal:
        h = grab(lines, r"ml::i64 begin = qp - (\d+) \+ 1;", required=False)
        P.window = int(h.group(1)) if h else None
        if not h:
            assert "ml::i64 begin = 0;" in txt
        assert "if (begin < 0) begin = 0;" in txt
    else:
        assert "ml::i64 begin = 0, end = len;" in txt
    h = grab(lines, r"range_lo = \(ml::i64\)t\.lo\[3\] \* (\d+), range_hi = range_lo \+ (\d+);")
    P.chunk_lo, P.chunk_hi = int(h.group(1)), int(h.group(2))
    assert "if (begin < range_lo) begin = range_lo;" in txt and "if (end > range_hi) end = range_hi;" in txt
    h = grab(lines, r"if \(end > (\d+)\) end = (\d+);")
    assert h.group(1) == h.group(2)
    P.tk_clamp = int(h.group(1))
    h = grab(lines, r"ml::load_pack<[^>]*>\(in0 \+ \(ml::i64\)bi \* (\d+) \+ \(ml::i64\)h \* (\d+) \+ \(ml::i64\)i \* (\d+) \+ r \* W\)")
    P.qs = tuple(map(int, h.groups()))
    h = grab(lines, r"\* kp = in1 \+ \(ml::i64\)bi \* (\d+) \+ \(ml::i64\)kh \* (\d+) \+ r \* W;")
    P.ks = tuple(map(int, h.groups()))
    h = grab(lines, r"\* vp = in2 \+ \(ml::i64\)bi \* (\d+) \+ \(ml::i64\)kh \* (\d+) \+ r \* W;")
    P.vs = tuple(map(int, h.groups()))
    # the key / value row strides (of the loads a step ahead)
    P.kj = int(grab(lines, r"load_pack<[^>]*>\(kp \+ jn \* (\d+)\)").group(1))
    P.vj = int(grab(lines, r"load_pack<[^>]*>\(vp \+ jn \* (\d+)\)").group(1))
    P.scale = F32(float.fromhex(grab(lines, r"s \*= \(\(float\)([-0-9a-fx.p+]+)\);").group(1)))
    h = grab(lines, r"const ml::i64 ob = \(ml::i64\)bi \* (\d+) \+ \(ml::i64\)h \* (\d+) \+ \(ml::i64\)i \* (\d+) \+ \(ml::i64\)t\.lo\[3\] \* (\d+);")
    P.os = tuple(map(int, h.groups()))
    P.od = int(grab(lines, r"out0\[ob \+ \(ml::i64\)dd \* (\d+)\] = o;").group(1))
    h = grab(lines, r"out0\[ob \+ \(ml::i64\)D \* (\d+)\] = mx; out0\[ob \+ \(ml::i64\)\(D \+ 1\) \* (\d+)\] = lsum;")
    assert int(h.group(1)) == P.od == int(h.group(2))
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

// megaloop/attention_grad.cuh: the tiles of attention_grad (megaloop/frontend/ops/attention_grad.py),
// attention's backward with the scores recomputed from q and k one key at a time (float32), never
// stored. CUDA cores, a warp per row, the head's dims over the lanes; deterministic (no atomics):
// - rows: a warp per (batch, head, query): log-sum-exp of its scores and delta = rowsum(P dP), online;
// - dq:   a warp per (batch, head, query): dQ = sum over its keys of dS K;
// - dkv:  a warp per (batch, kv head, key): dK = sum of dS Q and dV = sum of P dO over every query of
//   the kv head's query heads that sees the key (grouped-query attention's sum stays in the warp).
#pragma once
#include "megaloop/attention.cuh"

namespace ml {

// The softcapped, masked score of a query and key whose lanes' partial dot products are s (summed
// here), and the softcap's derivative 1 - tanh^2 (1 without a softcap). -inf: hidden by the mask.
template <class S, class M>
__device__ __forceinline__ float grad_score(float s, float scale, const M& mask, int bi, int h, int i, i64 j,
                                            float& slope) {
    const float capped = softcap<S::cap_bits>(warp_sum(s) * scale);
    slope = 1.0f;
    if constexpr (S::cap_bits != 0u) {
        constexpr unsigned bits = S::cap_bits;
        float c;
        memcpy(&c, &bits, sizeof c);
        const float turned = capped / c;
        slope = 1.0f - turned * turned;
    }
    return with_mask(capped, mask, bi, h, i, j);
}

// lane's part of the dot product of a row of N dims held by the lanes (x) and a row in memory
template <int N, class P>
__device__ __forceinline__ float lane_dot(const float (&x)[(N + 31) / 32], const P* row, i64 stride, int lane) {
    float s = 0.0f;
#pragma unroll
    for (int c = 0; c < (N + 31) / 32; ++c) {
        const int dd = lane + 32 * c;
        if (dd < N) s += x[c] * load(row + (i64)dd * stride);
    }
    return s;
}

// a row of N dims into the lanes (zeros past N)
template <int N, class P>
__device__ __forceinline__ void lane_row(float (&x)[(N + 31) / 32], const P* row, i64 stride, int lane) {
#pragma unroll
    for (int c = 0; c < (N + 31) / 32; ++c) {
        const int dd = lane + 32 * c;
        x[c] = dd < N ? load(row + (i64)dd * stride) : 0.0f;
    }
}

// batch item bi's key count, a data error (false) where outside [0, Tk]
template <class S, class L>
__device__ __forceinline__ bool grad_length(const Args& a, const Task& t, int tid, const L& lens, int bi, int lane,
                                            i64& len) {
    len = kv_length<S::tk>(lens, bi);
    if constexpr (is_present<L>::value) {
        if (len < 0 || len > S::tk) {
            if (lane == 0) fail(a, DATA, blockIdx.x, tid, t.op, len, S::tk, 2, 0);
            return false;
        }
    }
    return true;
}

// out [B, Hq, Tq, 2] float32: each row's log-sum-exp (+inf where it sees no key) and rowsum(P dP).
template <class S, class O, class Q, class K, class V, class G, class QP, class L, class M>
__device__ __forceinline__ void attention_grad_rows(const Args& a, const Task& t, int tid, float scale, O out, Q q,
                                                    K k, V v, G dout, QP qpos, L lens, M mask) {
    constexpr int D = S::d, DV = S::dv, DL = (D + 31) / 32, VL = (DV + 31) / 32;
    Task rowt = t;
    rowt.hi[3] = rowt.lo[3] + 1;
    for_box_warps<4>(rowt, [&](const int* o, int lane) {
        const int bi = o[0], h = o[1], i = o[2], kh = h / S::group;
        i64 len, begin, end;
        if (!grad_length<S>(a, t, tid, lens, bi, lane, len)) return;
        visible_keys<S>(qpos, bi, i, len, begin, end);
        float qv[DL], gv[VL];
        lane_row<D>(qv, q.p + (i64)bi * stride_of<0, Q> + (i64)h * stride_of<1, Q> + (i64)i * stride_of<2, Q>,
                    stride_of<3, Q>, lane);
        lane_row<DV>(gv, dout.p + (i64)bi * stride_of<0, G> + (i64)h * stride_of<1, G> + (i64)i * stride_of<2, G>,
                     stride_of<3, G>, lane);
        const auto* kb = k.p + (i64)bi * stride_of<0, K> + (i64)kh * stride_of<1, K>;
        const auto* vb = v.p + (i64)bi * stride_of<0, V> + (i64)kh * stride_of<1, V>;
        float m = neg_inf(), l = 0.0f, dots = 0.0f;
        for (i64 j = begin; j < end; ++j) {
            float slope;
            const float s = grad_score<S>(lane_dot<D>(qv, kb + j * stride_of<2, K>, stride_of<3, K>, lane),
                                          scale, mask, bi, h, i, j, slope);
            if (s == neg_inf()) continue;  // hidden by the mask (the warp agrees)
            const float dp = warp_sum(lane_dot<DV>(gv, vb + j * stride_of<2, V>, stride_of<3, V>, lane));
            const float mn = s > m ? s : m;
            const float corr = expf(m - mn), p = expf(s - mn);
            l = l * corr + p;
            dots = dots * corr + p * dp;
            m = mn;
        }
        if (lane == 0) {
            float* dst = out.p + (i64)bi * stride_of<0, O> + (i64)h * stride_of<1, O> + (i64)i * stride_of<2, O>;
            dst[0] = l > 0.0f ? m + logf(l) : __int_as_float(0x7f800000);
            dst[stride_of<3, O>] = l > 0.0f ? dots / l : 0.0f;
        }
    });
}

// row (lse, delta) of query i of head h from the rows part R [B, Hq, Tq, 2]
template <class R>
__device__ __forceinline__ void row_stats(const R& r, int bi, int h, int i, float& lse, float& delta) {
    const float* p = r.p + (i64)bi * stride_of<0, R> + (i64)h * stride_of<1, R> + (i64)i * stride_of<2, R>;
    lse = p[0];
    delta = p[stride_of<3, R>];
}

// out [B, Hq, Tq, D] float32: dQ of each row, sum over its keys of P (dP - delta) slope scale K.
template <class S, class O, class Q, class K, class V, class G, class R, class QP, class L, class M>
__device__ __forceinline__ void attention_grad_dq(const Args& a, const Task& t, int tid, float scale, O out, Q q, K k,
                                                  V v, G dout, R rows, QP qpos, L lens, M mask) {
    constexpr int D = S::d, DV = S::dv, DL = (D + 31) / 32, VL = (DV + 31) / 32;
    Task rowt = t;
    rowt.hi[3] = rowt.lo[3] + 1;
    for_box_warps<4>(rowt, [&](const int* o, int lane) {
        const int bi = o[0], h = o[1], i = o[2], kh = h / S::group;
        i64 len, begin, end;
        if (!grad_length<S>(a, t, tid, lens, bi, lane, len)) return;
        visible_keys<S>(qpos, bi, i, len, begin, end);
        float qv[DL], gv[VL], acc[DL], lse, delta;
        lane_row<D>(qv, q.p + (i64)bi * stride_of<0, Q> + (i64)h * stride_of<1, Q> + (i64)i * stride_of<2, Q>,
                    stride_of<3, Q>, lane);
        lane_row<DV>(gv, dout.p + (i64)bi * stride_of<0, G> + (i64)h * stride_of<1, G> + (i64)i * stride_of<2, G>,
                     stride_of<3, G>, lane);
        row_stats(rows, bi, h, i, lse, delta);
#pragma unroll
        for (int c = 0; c < DL; ++c) {
            acc[c] = 0.0f;
        }
        const auto* kb = k.p + (i64)bi * stride_of<0, K> + (i64)kh * stride_of<1, K>;
        const auto* vb = v.p + (i64)bi * stride_of<0, V> + (i64)kh * stride_of<1, V>;
        for (i64 j = begin; j < end; ++j) {
            float slope;
            const auto* kr = kb + j * stride_of<2, K>;
            const float s = grad_score<S>(lane_dot<D>(qv, kr, stride_of<3, K>, lane), scale, mask, bi, h, i, j, slope);
            if (s == neg_inf()) continue;
            const float dp = warp_sum(lane_dot<DV>(gv, vb + j * stride_of<2, V>, stride_of<3, V>, lane));
            const float ds = expf(s - lse) * (dp - delta) * slope * scale;
#pragma unroll
            for (int c = 0; c < DL; ++c) {
                const int dd = lane + 32 * c;
                if (dd < D) acc[c] += ds * load(kr + (i64)dd * stride_of<3, K>);
            }
        }
        float* dst = out.p + (i64)bi * stride_of<0, O> + (i64)h * stride_of<1, O> + (i64)i * stride_of<2, O>;
#pragma unroll
        for (int c = 0; c < DL; ++c) {
            const int dd = lane + 32 * c;
            if (dd < D) dst[(i64)dd * stride_of<3, O>] = acc[c];
        }
    });
}

// out [B, Hkv, Tk, D + Dv] float32: a key's dK (sum of dS Q) then dV (sum of P dO) over the queries of
// its kv head's query heads that see it, in the order (head, query).
template <class S, class O, class Q, class K, class V, class G, class R, class QP, class L, class M>
__device__ __forceinline__ void attention_grad_dkv(const Args& a, const Task& t, int tid, float scale, O out, Q q, K k,
                                                   V v, G dout, R rows, QP qpos, L lens, M mask) {
    constexpr int D = S::d, DV = S::dv, DL = (D + 31) / 32, VL = (DV + 31) / 32;
    Task rowt = t;
    rowt.hi[3] = rowt.lo[3] + 1;
    for_box_warps<4>(rowt, [&](const int* o, int lane) {
        const int bi = o[0], kh = o[1], j = o[2];
        float kv[DL], vv[VL], dk[DL], dv[VL];
#pragma unroll
        for (int c = 0; c < DL; ++c) {
            dk[c] = 0.0f;
        }
#pragma unroll
        for (int c = 0; c < VL; ++c) {
            dv[c] = 0.0f;
        }
        i64 len;
        if (!grad_length<S>(a, t, tid, lens, bi, lane, len)) return;
        lane_row<D>(kv, k.p + (i64)bi * stride_of<0, K> + (i64)kh * stride_of<1, K> + (i64)j * stride_of<2, K>,
                    stride_of<3, K>, lane);
        lane_row<DV>(vv, v.p + (i64)bi * stride_of<0, V> + (i64)kh * stride_of<1, V> + (i64)j * stride_of<2, V>,
                     stride_of<3, V>, lane);
        for (int hh = 0; hh < S::group && j < len; ++hh) {
            const int h = kh * S::group + hh;
            for (int i = 0; i < S::tq; ++i) {
                i64 begin, end;
                visible_keys<S>(qpos, bi, i, len, begin, end);
                if (j < begin || j >= end) continue;
                const auto* qr = q.p + (i64)bi * stride_of<0, Q> + (i64)h * stride_of<1, Q> + (i64)i * stride_of<2, Q>;
                const auto* gr =
                    dout.p + (i64)bi * stride_of<0, G> + (i64)h * stride_of<1, G> + (i64)i * stride_of<2, G>;
                float slope;
                const float s = grad_score<S>(lane_dot<D>(kv, qr, stride_of<3, Q>, lane), scale, mask, bi,
                                              h, i, j, slope);
                if (s == neg_inf()) continue;
                float lse, delta;
                row_stats(rows, bi, h, i, lse, delta);
                const float p = expf(s - lse);
                const float dp = warp_sum(lane_dot<DV>(vv, gr, stride_of<3, G>, lane));
                const float ds = p * (dp - delta) * slope * scale;
#pragma unroll
                for (int c = 0; c < DL; ++c) {
                    const int dd = lane + 32 * c;
                    if (dd < D) dk[c] += ds * load(qr + (i64)dd * stride_of<3, Q>);
                }
#pragma unroll
                for (int c = 0; c < VL; ++c) {
                    const int dd = lane + 32 * c;
                    if (dd < DV) dv[c] += p * load(gr + (i64)dd * stride_of<3, G>);
                }
            }
        }
        float* dst = out.p + (i64)bi * stride_of<0, O> + (i64)kh * stride_of<1, O> + (i64)j * stride_of<2, O>;
#pragma unroll
        for (int c = 0; c < DL; ++c) {
            const int dd = lane + 32 * c;
            if (dd < D) dst[(i64)dd * stride_of<3, O>] = dk[c];
        }
#pragma unroll
        for (int c = 0; c < VL; ++c) {
            const int dd = lane + 32 * c;
            if (dd < DV) dst[(i64)(D + dd) * stride_of<3, O>] = dv[c];
        }
    });
}

}  // namespace ml

// megaloop/cache.cuh: the KV cache updates' tiles, kv_cache_update and rope_kv_cache_update
// (megaloop/codegen/emit.py instantiates them). A task is one (batch, head) slab of the cache [B, H,
// S, Dim]: the new rows [B, H, Tokens, Dim] go to their positions pos[b, token] (in place).
#pragma once
#include "megaloop/rope.cuh"

namespace ml {

// Rows of nw into the task's cache slab at their positions, bit for bit: packs of W (U loaded before any
// is stored: a store may alias the next load), else element by element. A position outside [0, S) is
// reported (DATA) and not written; where SkipNegative (ignore_negative) a negative one writes nothing.
template <i64 S, int Tokens, int Dim, bool SkipNegative, int W, int U, class O, class N, class P>
__device__ __forceinline__ void kv_update(const Args& a, const Task& t, int tid, O out, N nw, P pos) {
    using T = typename O::type;
    using TN = typename N::type;
    constexpr i64 NS0 = stride_along<0, N>::value, NS1 = stride_along<1, N>::value, NS2 = stride_along<2, N>::value;
    constexpr i64 NS3 = stride_along<3, N>::value, OS0 = stride_along<0, O>::value, OS1 = stride_along<1, O>::value;
    constexpr i64 OS2 = stride_along<2, O>::value, OS3 = stride_along<3, O>::value;
    constexpr i64 PS0 = stride_along<0, P>::value, PS1 = stride_along<1, P>::value;
    static_assert(O::rank == 4 && N::rank == 4 && P::rank == 2, "kv_update: [B, H, S, Dim] and pos [B, T]");
    const int b = t.lo[0], h = t.lo[1];
    if constexpr (W > 0) {
        constexpr unsigned PER_ROW = Dim / W, TOTAL = Tokens * PER_ROW;
        const TN* src = nw.p + (i64)b * NS0 + (i64)h * NS1;
        T* dst = out.p + (i64)b * OS0 + (i64)h * OS1;
        const auto* ps = pos.p + (i64)b * PS0;
        if (aligned(src, W * (int)sizeof(TN)) & aligned(dst, W * (int)sizeof(T))) {  // (one test, no branch)
            for (unsigned e0 = threadIdx.x; e0 < TOTAL; e0 += U * ml::block_threads()) {
                Pack<T, W> v[U];
                i64 p[U];
                int c[U];
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    // past the end: the last pack again, loaded but never stored (defined without a branch)
                    const unsigned e = u == 0 ? e0 : min(e0 + u * ml::block_threads(), TOTAL - 1);
                    const int tok = (int)(e / PER_ROW);
                    c[u] = (int)(e % PER_ROW);
                    p[u] = load(ps + (i64)tok * PS1);
                    v[u] = load_pack<TN, W>(src + (i64)tok * NS2 + (i64)c[u] * (W * NS3));
                }
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    if (u > 0 && e0 + u * ml::block_threads() >= TOTAL) break;
                    if (SkipNegative && p[u] < 0) continue;  // a negative position writes nothing
                    if (p[u] < 0 || p[u] >= S) {
                        fail(a, DATA, blockIdx.x, tid, t.op, p[u], S, 1, 0);
                        return;  // as the per-element loop: reported, never written
                    }
                    store_pack<T, W>(dst + p[u] * OS2 + (i64)c[u] * (W * OS3), v[u]);
                }
            }
            return;
        }
    }
    for (int e = threadIdx.x; e < Tokens * Dim; e += ml::block_threads()) {
        const int tok = e / Dim, d = e % Dim;
        const i64 p = load(pos.p + (i64)b * PS0 + (i64)tok * PS1);
        if (SkipNegative && p < 0) continue;  // a negative position writes nothing
        if (p < 0 || p >= S) {
            fail(a, DATA, blockIdx.x, tid, t.op, p, S, 1, 0);
            break;
        }
        store(out.p + (i64)b * OS0 + (i64)h * OS1 + p * OS2 + (i64)d * OS3,
              load(nw.p + (i64)b * NS0 + (i64)h * NS1 + (i64)tok * NS2 + (i64)d * NS3));
    }
}

// rope_kv_cache_update: kv_update's rows with each rotary pair turned by rope's fmas (rope's bits), dims
// past RD copied bit for bit; U items (a pair or a dim) loaded before any is stored. A position outside
// [0, S) is reported (DATA), not written, and ends the thread's part of the task.
template <i64 S, int Tokens, int Dim, int RD, bool Neox, int U, class O, class N, class P>
__device__ __forceinline__ void rope_kv_update(const Args& a, const Task& t, int tid, const double* inv_freq, O out,
                                               N nw, P pos) {
    using T = typename N::type;
    using TO = typename O::type;
    constexpr i64 NS0 = stride_along<0, N>::value, NS1 = stride_along<1, N>::value, NS2 = stride_along<2, N>::value;
    constexpr i64 NS3 = stride_along<3, N>::value, OS0 = stride_along<0, O>::value, OS1 = stride_along<1, O>::value;
    constexpr i64 OS2 = stride_along<2, O>::value, OS3 = stride_along<3, O>::value;
    constexpr i64 PS0 = stride_along<0, P>::value, PS1 = stride_along<1, P>::value;
    static_assert(O::rank == 4 && N::rank == 4 && P::rank == 2, "rope_kv_update: [B, H, S, Dim], pos [B, T]");
    constexpr int HALF = RD / 2, PER_TOKEN = HALF + Dim - RD;  // the rotary pairs, then the dims copied
    constexpr i64 TOTAL = (i64)Tokens * PER_TOKEN;
    const int b = t.lo[0], h = t.lo[1];
    for (i64 e0 = threadIdx.x; e0 < TOTAL; e0 += U * (i64)ml::block_threads()) {
        int d0[U], d1[U];  // the item's dims (d1 < 0: a dim copied)
        i64 p[U];
        T x0[U], x1[U];  // as stored: a copied dim keeps its bits (NaN payloads too)
        double w[U];  // the pair's frequency
#pragma unroll
        for (int k = 0; k < U; ++k) {  // every load out before any store
            const i64 e = k == 0 ? e0 : min(e0 + k * (i64)ml::block_threads(), TOTAL - 1);
            const int tok = (int)(e / PER_TOKEN), f = (int)(e % PER_TOKEN);
            d0[k] = f < HALF ? (Neox ? f : 2 * f) : RD + (f - HALF);
            d1[k] = f < HALF ? (Neox ? f + HALF : 2 * f + 1) : -1;
            w[k] = inv_freq[f < HALF ? f : 0];
            p[k] = load(pos.p + (i64)b * PS0 + (i64)tok * PS1);
            const i64 row = (i64)b * NS0 + (i64)h * NS1 + (i64)tok * NS2;
            x0[k] = nw.p[row + (i64)d0[k] * NS3];
            x1[k] = nw.p[row + (i64)(d1[k] >= 0 ? d1[k] : d0[k]) * NS3];
        }
#pragma unroll
        for (int k = 0; k < U; ++k) {
            if (k > 0 && e0 + k * (i64)ml::block_threads() >= TOTAL) break;
            if (p[k] < 0 || p[k] >= S) {
                fail(a, DATA, blockIdx.x, tid, t.op, p[k], S, 1, 0);
                return;
            }
            TO* o = out.p + (i64)b * OS0 + (i64)h * OS1 + p[k] * OS2;
            if (d1[k] < 0) {
                o[(i64)d0[k] * OS3] = x0[k];
            } else {
                float sn, cs;
                rope_angle((double)p[k], w[k], sn, cs);
                const float a0 = load(&x0[k]), a1 = load(&x1[k]);
                // rope's formula (its pair path's fmas): the same bits as rope's output
                store(o + (i64)d0[k] * OS3, fmaf(a0, cs, -(a1 * sn)));
                store(o + (i64)d1[k] * OS3, fmaf(a1, cs, a0 * sn));
            }
        }
    }
}

}  // namespace ml

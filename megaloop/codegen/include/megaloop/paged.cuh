// megaloop/paged.cuh: the paged KV cache's tiles, paged_kv_cache_update and paged_attention
// (megaloop/frontend/ops/paged.py defines them; megaloop/codegen/emit_paged.py instantiates them).
// A pool is [Pages, Hkv, P, Dim]; the page table [Slots, PerSlot] names the page of each slot's
// positions [j P, (j + 1) P); a row (b, t) of the step belongs to slot slots[b, t] at position
// pos[b, t] (negative: unused). A page, slot or position out of range is reported (DATA), never used.
#pragma once
#include "megaloop/attention_lanes.cuh"
#include "megaloop/elementwise.cuh"
#include "megaloop/rope.cuh"

namespace ml {

// data error kinds, as megaloop/runtime/report.py names them
constexpr i64 PAGED_POSITION = 1, PAGED_PAGE = 4, PAGED_SLOT = 5;

// The page that holds position p of row (b, t)'s slot s, or -1 after reporting what was out of range.
template <int Pages, int P, int Slots, int PerSlot, class PT>
__device__ __forceinline__ i64 page_of(const Args& a, const Task& t, int tid, const PT& table, i64 s, i64 p) {
    if (s < 0 || s >= Slots) {
        fail(a, DATA, blockIdx.x, tid, t.op, s, Slots, PAGED_SLOT, 0);
        return -1;
    }
    if (p >= (i64)PerSlot * P) {
        fail(a, DATA, blockIdx.x, tid, t.op, p, (i64)PerSlot * P, PAGED_POSITION, 0);
        return -1;
    }
    const i64 page = load(table.p + s * stride_of<0, PT> + (p / P) * stride_of<1, PT>);
    if (page < 0 || page >= Pages) {
        fail(a, DATA, blockIdx.x, tid, t.op, page, Pages, PAGED_PAGE, 0);
        return -1;
    }
    return page;
}

// paged_kv_cache_update: the task's kv head h (its box [0:Pages, h, 0:P, 0:Dim] of the pool, in place):
// element (b, t, d) of every row copied, bit for bit, to its page and offset. Rows [B, Tokens]. RD > 0
// (rope_paged_kv_cache_update): dims below RD rotated at the row's position first (rope's bits).
template <int B, int Tokens, int Dim, int Pages, int P, int Slots, int PerSlot, int RD, bool Neox, class O, class N,
          class PT, class SL, class PS>
__device__ __forceinline__ void paged_write(const Args& a, const Task& t, int tid, const double* inv_freq, O out, N nw,
                                            PT table, SL slots, PS pos) {
    static_assert(O::rank == 4 && N::rank == 4 && PT::rank == 2 && SL::rank == 2 && PS::rank == 2,
                  "paged_kv_update: pool [Pages, H, P, Dim], new [B, H, Tokens, Dim], table [Slots, PerSlot], "
                  "slots and positions [B, Tokens]");
    const int h = t.lo[1];
    constexpr i64 TOTAL = (i64)B * Tokens * Dim;
    for (i64 e = threadIdx.x; e < TOTAL; e += ml::block_threads()) {
        const int d = (int)(e % Dim);
        const int tok = (int)((e / Dim) % Tokens), b = (int)(e / ((i64)Dim * Tokens));
        const i64 p = load(pos.p + (i64)b * stride_of<0, PS> + (i64)tok * stride_of<1, PS>);
        if (p < 0) continue;  // an unused row writes nothing
        const i64 s = load(slots.p + (i64)b * stride_of<0, SL> + (i64)tok * stride_of<1, SL>);
        const i64 page = page_of<Pages, P, Slots, PerSlot>(a, t, tid, table, s, p);
        if (page < 0) return;
        auto* dst = out.p + page * stride_of<0, O> + (i64)h * stride_of<1, O> + (p % P) * stride_of<2, O> +
                    (i64)d * stride_of<3, O>;
        const auto* row = nw.p + (i64)b * stride_of<0, N> + (i64)h * stride_of<1, N> + (i64)tok * stride_of<2, N>;
        if constexpr (RD > 0) {
            if (d < RD) {
                store(dst, rope_head_dim<RD, Neox>(row, stride_of<3, N>, d, (double)p, inv_freq));
                continue;
            }
        }
        *dst = row[(i64)d * stride_of<3, N>];
    }
}

template <int B, int Tokens, int Dim, int Pages, int P, int Slots, int PerSlot, class O, class N, class PT, class SL,
          class PS>
__device__ __forceinline__ void paged_kv_update(const Args& a, const Task& t, int tid, O out, N nw, PT table, SL slots,
                                                PS pos) {
    paged_write<B, Tokens, Dim, Pages, P, Slots, PerSlot, 0, true>(a, t, tid, nullptr, out, nw, table, slots, pos);
}

// keys [s0, s0 + n) of slot s's kv head kh into the staged rows (attention_lanes.cuh's
// lanes_stage_rows), each through its page (one out of range is reported and its row left zero)
template <class T, int D, int DV, class LN, int Pages, int P, int Slots, int PerSlot, class K, class V, class PT>
__device__ __forceinline__ void paged_stage(const Args& a, const Task& t, int tid, T* ks, T* vs, const K& k,
                                            const V& v, const PT& table, i64 s, int kh, i64 s0, int n) {
    lanes_stage_rows<T, D, DV, LN>(ks, vs, k.p, [&](bool key, int r) -> const T* {
        const i64 j = s0 + r, page = r < n ? page_of<Pages, P, Slots, PerSlot>(a, t, tid, table, s, j) : -1;
        if (page < 0) return nullptr;
        return key ? k.p + page * stride_of<0, K> + (i64)kh * stride_of<1, K> + (j % P) * stride_of<2, K>
                   : v.p + page * stride_of<0, V> + (i64)kh * stride_of<1, V> + (j % P) * stride_of<2, V>;
    });
}

// The lanes-over-keys tile (megaloop/attention_lanes.cuh) over a slot's pages, a row of the task at a
// time (its query heads of one kv head): the row's visible keys staged through the page table, LN::keys
// at a time, then attention_lanes' scores, softmax and merge. The caller checked that the pools are
// 16-byte aligned.
template <class S, class LN, int Pages, int P, int Slots, int PerSlot, class O, class Q, class K, class V, class PT,
          class SL, class PS>
__device__ __forceinline__ void paged_attention_lanes(const Args& a, const Task& t, int tid, float scale, O out, Q q,
                                                      K k, V v, PT table, SL slots, PS pos) {
    using T = typename Q::type;
    using Sm = LanesSmem<T, S::d, S::dv, LN>;
    constexpr int D = S::d, DV = S::dv, R = LN::per_warp, VPL = DV / 32;
    static_assert(LN::rows >= S::group, "paged_attention_lanes: a tile's rows are the query heads of one kv head");
    const auto views = Sm::views();
    T *ks = views.ks, *vs = views.vs;
    float *qs = views.qs, *ps = views.ps, *part = views.part;
    const int warp = threadIdx.x >> 5, rg = warp / LN::blocks, kh = t.lo[1] / S::group, bi = t.lo[0];
    const int nrows = t.hi[1] - t.lo[1];
    const bool computes = warp < LN::warps;
    for (int i = t.lo[2]; i < t.hi[2]; ++i) {
        Task row = t;
        row.lo[2] = i;
        row.hi[2] = i + 1;
        const i64 p = load(pos.p + (i64)bi * stride_of<0, PS> + (i64)i * stride_of<1, PS>);
        const i64 s = p >= 0 ? load(slots.p + (i64)bi * stride_of<0, SL> + (i64)i * stride_of<1, SL>) : 0;
        const bool row_ok = p >= 0 && page_of<Pages, P, Slots, PerSlot>(a, t, tid, table, s, p) >= 0;
        i64 lo = S::window > 0 ? p - S::window + 1 : 0;
        if (lo < 0) lo = 0;
        const i64 hi = row_ok ? p + 1 : 0;
        if (lo < hi) {
            const int n = hi - lo < LN::keys ? (int)(hi - lo) : LN::keys;
            paged_stage<T, D, DV, LN, Pages, P, Slots, PerSlot>(a, t, tid, ks, vs, k, v, table, s, kh, lo, n);
        }
        lanes_queries<S, LN>(row, qs, (T*)nullptr, (T*)nullptr, q, -1, Absent{});
        float m[R], l[R], acc[R][VPL];
        i64 begin[R], end[R];
#pragma unroll
        for (int x = 0; x < R; ++x) {
            m[x] = neg_inf();
            l[x] = 0.0f;
#pragma unroll
            for (int c = 0; c < VPL; ++c) acc[x][c] = 0.0f;
            begin[x] = lo;
            end[x] = hi;
        }
        for (i64 s0 = lo; s0 < hi; s0 += LN::keys) {
            if (s0 > lo) {  // a later stage: the last one's keys all read
                ml::block_sync();
                const int n = hi - s0 < LN::keys ? (int)(hi - s0) : LN::keys;
                paged_stage<T, D, DV, LN, Pages, P, Slots, PerSlot>(a, t, tid, ks, vs, k, v, table, s, kh, s0, n);
            }
            cp_async_wait<0>();
            ml::block_sync();
            if (computes) {
                lanes_keys<S, LN, false>(row, scale, Absent{}, qs, ks, vs, (const T*)nullptr, (const T*)nullptr, ps, s0,
                                         hi, -1, nrows, begin, end, m, l, acc);
            }
        }
        lanes_merge<S, 0, LN>(row, out, part, computes, rg, nrows, m, l, acc);  // (ends with a block barrier)
    }
}

// paged_attention_warps: a warp per (b, query head, row) of the task's box of out [B, Hq, Tokens, Dv]. The
// lanes take different keys (flash-decoding inside the warp): G = ceil(D / 64) lanes a key, each with
// D / G of q's dims, 32 / G keys a step, so a lane's keys need no shuffle but the G-lane sum of a dot;
// each lane keeps its own online softmax (m, l, acc), merged over the lanes at the end. A page's table
// entry is read once per key a lane takes from it. Zeros for a row that sees no key. Packs: a lane's
// dims of a key in 16-byte loads (emit_paged.py proved them consecutive and pack-aligned; the pools'
// starts are checked here), where one load an element costs a cache wavefront per lane and element.
template <int Group, int D, int Dv, int Pages, int P, int Slots, int PerSlot, int Window, bool Packs, class O, class Q,
          class K, class V, class PT, class SL, class PS>
__device__ __forceinline__ void paged_attention_warps(const Args& a, const Task& t, int tid, float scale, O out, Q q,
                                                      K k, V v, PT table, SL slots, PS pos) {
    static_assert(O::rank == 4 && Q::rank == 4 && K::rank == 4 && V::rank == 4,
                  "paged_attention: out and q [B, H, Tokens, D], pools [Pages, Hkv, P, D]");
    constexpr int G = D <= 64 ? 1 : D <= 128 ? 2 : 4, KW = 32 / G;  // lanes a key, keys a step
    constexpr int DL = (D + G - 1) / G, VL = (Dv + G - 1) / G;      // dims a lane
    static_assert(D <= 256, "paged_attention: head_dim up to 256");
    using T = typename K::type;
    constexpr int W = 16 / (int)sizeof(T);  // elements a pack
    static_assert(!Packs || (DL * G == D && VL * G == Dv && DL % W == 0 && VL % W == 0),
                  "paged_attention: packs need whole packs of a lane's dims (emit_paged.py's _packs)");
    const bool packed = Packs && aligned(k.p, 16) && aligned(v.p, 16);
    Task rowt = t;
    rowt.hi[3] = rowt.lo[3] + 1;  // a warp per (batch, head, row)
    for_box_warps<4>(rowt, [&](const int* o, int lane) {
        const int bi = o[0], h = o[1], i = o[2], kh = h / Group, part = lane % G, key = lane / G;
        const i64 p = load(pos.p + (i64)bi * stride_of<0, PS> + (i64)i * stride_of<1, PS>);
        float acc[VL], qv[DL];
#pragma unroll
        for (int c = 0; c < VL; ++c) acc[c] = 0.0f;
        float m = neg_inf(), l = 0.0f;
        // (every lane runs every step and shuffle: the warp stays converged; a bad page skips the math)
        const i64 s = p >= 0 ? load(slots.p + (i64)bi * stride_of<0, SL> + (i64)i * stride_of<1, SL>) : 0;
        const bool row_ok = p >= 0 && page_of<Pages, P, Slots, PerSlot>(a, t, tid, table, s, p) >= 0;
        const i64 qb = (i64)bi * stride_of<0, Q> + (i64)h * stride_of<1, Q> + (i64)i * stride_of<2, Q>;
#pragma unroll
        for (int c = 0; c < DL; ++c) {
            const int dd = part * DL + c;
            qv[c] = row_ok && dd < D ? load(q.p + qb + (i64)dd * stride_of<3, Q>) : 0.0f;
        }
        i64 begin = Window > 0 ? p - Window + 1 : 0;
        if (begin < 0) begin = 0;
        const i64 end = row_ok ? p + 1 : 0;
        for (i64 j0 = begin; j0 < end; j0 += KW) {
            const i64 j = j0 + key;
            const i64 page = j < end ? page_of<Pages, P, Slots, PerSlot>(a, t, tid, table, s, j) : -1;
            const i64 kb = page * stride_of<0, K> + (i64)kh * stride_of<1, K> + (j % P) * stride_of<2, K>;
            float sc = 0.0f;
            if (page >= 0) {
                if constexpr (Packs) {
                    if (packed) {
#pragma unroll
                        for (int c = 0; c < DL; c += W) {
                            const Pack<T, W> kp = load_pack<T, W>(k.p + kb + part * DL + c);
#pragma unroll
                            for (int w = 0; w < W; ++w) sc += qv[c + w] * get(kp, w);
                        }
                    }
                }
                if (!packed) {
#pragma unroll
                    for (int c = 0; c < DL; ++c) {
                        const int dd = part * DL + c;
                        if (dd < D) sc += qv[c] * load(k.p + kb + (i64)dd * stride_of<3, K>);
                    }
                }
            }
            sc = lanes_sum<G>(sc) * scale;  // (loop.cuh: over the key's G lanes)
            if (page >= 0) {
                const i64 vb = page * stride_of<0, V> + (i64)kh * stride_of<1, V> + (j % P) * stride_of<2, V>;
                const float mn = sc > m ? sc : m;
                const float corr = expf(m - mn), e = expf(sc - mn);
                l = l * corr + e;
                if constexpr (Packs) {
                    if (packed) {
#pragma unroll
                        for (int c = 0; c < VL; c += W) {
                            const Pack<T, W> vp = load_pack<T, W>(v.p + vb + part * VL + c);
#pragma unroll
                            for (int w = 0; w < W; ++w) acc[c + w] = acc[c + w] * corr + e * get(vp, w);
                        }
                    }
                }
                if (!packed) {
#pragma unroll
                    for (int c = 0; c < VL; ++c) {
                        const int dd = part * VL + c;
                        acc[c] = acc[c] * corr + (dd < Dv ? e * load(v.p + vb + (i64)dd * stride_of<3, V>) : 0.0f);
                    }
                }
                m = mn;
            }
        }
        // the lanes' softmax states merged over the keys' lanes (those of one part of the dims)
#pragma unroll
        for (int x = G; x < 32; x <<= 1) {
            const float m2 = __shfl_xor_sync(0xffffffffu, m, x), l2 = __shfl_xor_sync(0xffffffffu, l, x);
            const float mn = m2 > m ? m2 : m;
            const float c1 = m == neg_inf() ? 0.0f : expf(m - mn), c2 = m2 == neg_inf() ? 0.0f : expf(m2 - mn);
            l = l * c1 + l2 * c2;
#pragma unroll
            for (int c = 0; c < VL; ++c) acc[c] = acc[c] * c1 + __shfl_xor_sync(0xffffffffu, acc[c], x) * c2;
            m = mn;
        }
        if (key == 0) {
            const i64 ob = (i64)bi * stride_of<0, O> + (i64)h * stride_of<1, O> + (i64)i * stride_of<2, O>;
#pragma unroll
            for (int c = 0; c < VL; ++c) {
                const int dd = part * VL + c;
                if (dd < Dv) store(out.p + ob + (i64)dd * stride_of<3, O>, l > 0.0f ? acc[c] / l : 0.0f);
            }
        }
    });
}

// The same (noinline): the lanes tile's fallback, its registers kept out of the lanes path's function
template <int Group, int D, int Dv, int Pages, int P, int Slots, int PerSlot, int Window, bool Packs, class O, class Q,
          class K, class V, class PT, class SL, class PS>
__device__ __noinline__ void paged_attention_warps_apart(const Args& a, const Task& t, int tid, float scale, O out,
                                                         Q q, K k, V v, PT table, SL slots, PS pos) {
    paged_attention_warps<Group, D, Dv, Pages, P, Slots, PerSlot, Window, Packs>(a, t, tid, scale, out, q, k, v, table,
                                                                                 slots, pos);
}

// paged_attention: out [B, Hq, Tokens, Dv] of the task's box. LN a Lanes: paged_attention_lanes where the
// pools are 16-byte aligned, else (and with NoLanes) paged_attention_warps.
template <int Group, int D, int Dv, int Pages, int P, int Slots, int PerSlot, int Window, bool Packs, class LN,
          class O, class Q, class K, class V, class PT, class SL, class PS>
__device__ __forceinline__ void paged_attention(const Args& a, const Task& t, int tid, float scale, O out, Q q, K k,
                                                V v, PT table, SL slots, PS pos) {
    if constexpr (LN::present) {
        if (aligned(k.p, 16) && aligned(v.p, 16)) {
            using S = AttnShape<Group, 1, PerSlot * P, D, Dv, true, Window>;
            paged_attention_lanes<S, LN, Pages, P, Slots, PerSlot>(a, t, tid, scale, out, q, k, v, table, slots, pos);
        } else {
            paged_attention_warps_apart<Group, D, Dv, Pages, P, Slots, PerSlot, Window, Packs>(a, t, tid, scale, out, q,
                                                                                               k, v, table, slots, pos);
        }
    } else {
        paged_attention_warps<Group, D, Dv, Pages, P, Slots, PerSlot, Window, Packs>(a, t, tid, scale, out, q, k, v,
                                                                                     table, slots, pos);
    }
}

}  // namespace ml

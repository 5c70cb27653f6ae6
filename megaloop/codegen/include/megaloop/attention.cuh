// megaloop/attention.cuh: the tiles of attention, attention_partial and attention_combine;
// megaloop/codegen/emit_attention.py instantiates them with the op's shapes and mask (AttnShape), the
// operands' strides (At, elementwise.cuh) and the paths it chose.
//
// Four paths compute a tile of (query head, query) rows, each in float32 with an online softmax:
// - lanes over keys (attention_lanes, megaloop/attention_lanes.cuh): decode tiles built for latency,
//   where KernelOptions.decode_attention asks for it;
// - tensor cores (attention_mma, mma.sync m16n8k16, sm_80 on): the FlashAttention-2 scheme inside one
//   tile, for blocks of 16 queries or more of 16-bit heads;
// - split keys (attention_split_keys): flash-decoding inside one tile, the keys of each row split over
//   the block's warps, for packed, aligned heads (decode);
// - a warp per row (attention_warp_rows): any strides, the definition the others keep to.
// attention_partial runs the last two over one key range (its split), attention_combine merges them;
// its append form (AttnAppend) rotates q on load and takes the key at q's position from k_new.
#pragma once
#include "megaloop/attention_keys.cuh"
#include "megaloop/attention_lanes.cuh"
#include "megaloop/elementwise.cuh"
#include "megaloop/math.cuh"
#include "megaloop/mma.cuh"
#include "megaloop/rope.cuh"
#include "megaloop/types.cuh"
#include "megaloop/vec.cuh"

namespace ml {

// The tensor-core path's mask (attention_mma's Bias): row(hh, r) is the mask row of head hh, query r
// of the tile, its term of key j row(j); found once a unit of queries, so the loop over keys adds
// only j's offset. NoMask: none.
template <class M>
struct MaskRow {
    const typename M::type* p;
    __device__ __forceinline__ float operator()(i64 j) const { return mask_score(load(p + j * stride_of<3, M>)); }
};
template <class M>
struct MaskRows {
    static constexpr bool present = true;
    M mask;
    int bi, h0, s0;
    __device__ __forceinline__ MaskRow<M> row(int hh, int r) const {
        return {mask.p + (i64)bi * stride_of<0, M> + (i64)(h0 + hh) * stride_of<1, M> + (i64)(s0 + r) * stride_of<2, M>};
    }
};
struct NoMask {
    static constexpr bool present = false;
    __device__ __forceinline__ NoMask row(int, int) const { return {}; }
    __device__ __forceinline__ float operator()(i64) const { return 0.0f; }
};
template <class M, bool = is_present<M>::value> struct mask_rows_of { using type = MaskRows<M>; };
template <class M> struct mask_rows_of<M, false> { using type = NoMask; };

// for (int C = 0; C < N; ++C) { ... }, written once without a loop where N is 1 (up to 32 dims): a
// one-trip loop left to the optimiser came out a few instructions longer
#define ML_CHUNKS(C, N, ...)            \
    if constexpr ((N) == 1) {           \
        constexpr int C = 0;            \
        __VA_ARGS__                     \
    } else {                            \
        for (int C = 0; C < (N); ++C) { \
            __VA_ARGS__                 \
        }                               \
    }

// A warp per (batch, head, query): the scores one key at a time (the head's dims over the lanes, a
// warp sum), the online softmax over [begin, end). Chunk > 0: attention_partial's key range o[3]
// (out: [..., split, Dv + 2], unnormalised, then m and l), else the normalised output.
template <class S, int Chunk, class O, class Q, class K, class V, class QP, class L, class M, class App = Absent>
__device__ __forceinline__ void attention_warp_rows(const Args& a, const Task& t, int tid, float scale, O out, Q q,
                                                    K k, V v, QP qpos, L lens, M mask, App app = {}) {
    constexpr bool APPEND = is_present<App>::value;
    static_assert(!APPEND || (Chunk > 0 && is_present<QP>::value), "append form: attention_partial's, with positions");
    constexpr int D = S::d, DV = S::dv, TK = S::tk, DL = (D + 31) / 32, VL = (DV + 31) / 32;
    Task rowt = t;
    rowt.hi[3] = rowt.lo[3] + 1;  // a warp per (batch, head, query)
    if constexpr (Chunk > 0) rowt.hi[4] = rowt.lo[4] + 1;  // (and this tile's key range)
    for_box_warps<(Chunk > 0 ? 5 : 4)>(rowt, [&](const int* o, int lane) {
        const int bi = o[0], h = o[1], i = o[2];
        const int kh = h / S::group;
        const auto len = kv_length<TK>(lens, bi);
        if constexpr (is_present<L>::value) {
            if (len < 0 || len > TK) {
                if (lane == 0) fail(a, DATA, blockIdx.x, tid, t.op, len, TK, 2, 0);
                return;
            }
        }
        i64 begin, end;
        visible_keys<S>(qpos, bi, i, len, begin, end);
        if constexpr (Chunk > 0) {
            const i64 lo = (i64)o[3] * Chunk, hi = lo + Chunk;  // this tile's keys
            if (begin < lo) begin = lo;
            if (end > hi) end = hi;
        }
        float qv[DL], acc[VL];
        const i64 qb = (i64)bi * stride_of<0, Q> + (i64)h * stride_of<1, Q> + (i64)i * stride_of<2, Q>;
        i64 pn = -1;  // the append form: q's position, then -1 unless this tile's visible keys hold it
        if constexpr (APPEND) {  // q rotated at its position; that key comes from app.k, after the loop
            pn = query_position(qpos, bi, i);
            ML_CHUNKS(c, DL, const int dd = lane + 32 * c;
                      qv[c] = dd < D ? rope_head_dim<App::rd, App::neox>(q.p + qb, stride_of<3, Q>, dd, (double)pn,
                                                                         app.inv_freq)
                                     : 0.0f;)
        } else {
            ML_CHUNKS(c, DL, const int dd = lane + 32 * c;
                      qv[c] = dd < D ? load(q.p + qb + (i64)dd * stride_of<3, Q>) : 0.0f;)
        }
        if constexpr (APPEND) {
            if (pn >= begin && pn < end) end = pn;
            else pn = -1;
        }
        ML_CHUNKS(c, VL, acc[c] = 0.0f;)
        float m = neg_inf(), l = 0.0f;
        const i64 kb = (i64)bi * stride_of<0, K> + (i64)kh * stride_of<1, K>;
        const i64 vb = (i64)bi * stride_of<0, V> + (i64)kh * stride_of<1, V>;
        for (i64 j = begin; j < end; ++j) {
            float s = 0.0f;
            ML_CHUNKS(c, DL, const int dd = lane + 32 * c;
                      if (dd < D) s += qv[c] * load(k.p + kb + j * stride_of<2, K> + (i64)dd * stride_of<3, K>);)
            s = with_mask(softcap<S::cap_bits>(warp_sum(s) * scale), mask, bi, h, i, j);
            if (is_present<M>::value && s == neg_inf()) continue;  // hidden by the mask (the warp agrees)
            const float mn = s > m ? s : m;
            const float corr = expf(m - mn), p = expf(s - mn);
            l = l * corr + p;
            ML_CHUNKS(c, VL, const int dd = lane + 32 * c;
                      acc[c] = acc[c] * corr +
                               (dd < DV ? p * load(v.p + vb + j * stride_of<2, V> + (i64)dd * stride_of<3, V>) : 0.0f);)
            m = mn;
        }
        if constexpr (APPEND) {
            if (pn >= 0) {  // the new key: rope(k_new) as the cache will hold it, and v_new
                using KN = decltype(app.k);
                using VN = decltype(app.v);
                const auto* kr = app.k.p + (i64)bi * stride_of<0, KN> + (i64)kh * stride_of<1, KN>;
                const auto* vr = app.v.p + (i64)bi * stride_of<0, VN> + (i64)kh * stride_of<1, VN>;
                float s = 0.0f;
                ML_CHUNKS(c, DL, const int dd = lane + 32 * c;
                          if (dd < D) s += qv[c] * rope_head_dim<App::rd, App::neox>(kr, stride_of<3, KN>, dd,
                                                                                     (double)pn, app.inv_freq);)
                s = with_mask(softcap<S::cap_bits>(warp_sum(s) * scale), mask, bi, h, i, pn);
                if (!is_present<M>::value || s != neg_inf()) {
                    const float mn = s > m ? s : m;
                    const float corr = expf(m - mn), p = expf(s - mn);
                    l = l * corr + p;
                    ML_CHUNKS(c, VL, const int dd = lane + 32 * c;
                              acc[c] = acc[c] * corr + (dd < DV ? p * load(vr + (i64)dd * stride_of<3, VN>) : 0.0f);)
                    m = mn;
                }
            }
        }
        const i64 ob = (i64)bi * stride_of<0, O> + (i64)h * stride_of<1, O> + (i64)i * stride_of<2, O> +
                       (Chunk > 0 ? (i64)o[3] * stride_of<3, O> : 0);
        if constexpr (Chunk > 0) {
            ML_CHUNKS(c, VL, const int dd = lane + 32 * c;
                      if (dd < DV) out.p[ob + (i64)dd * stride_of<4, O>] = acc[c];)
            if (lane == 0) {
                out.p[ob + (i64)DV * stride_of<4, O>] = m;
                out.p[ob + (i64)(DV + 1) * stride_of<4, O>] = l;
            }
        } else {
            ML_CHUNKS(c, VL, const int dd = lane + 32 * c;
                      if (dd < DV) store(out.p + ob + (i64)dd * stride_of<3, O>, l > 0.0f ? acc[c] / l : 0.0f);)
        }
    });
}

// Split keys (flash-decoding inside one tile): each (head, query) of the tile takes `split` warps, each
// warp a piece of its keys, KPW keys a step (lanes split the head in packs of W), the pieces' softmax
// states merged in shared memory (a warp's slot of D + 2 floats). Chunk as for attention_warp_rows.
// One key of the online softmax: its scaled score s and its value pack folded into m, l and acc.
template <class T, int W>
__device__ __forceinline__ void fold_key(float s, const Pack<T, W>& v, float& m, float& l, float (&acc)[W]) {
    const float mn = s > m ? s : m;
    const float corr = expf(m - mn), p = expf(s - mn);
    l = l * corr + p;
#pragma unroll
    for (int w = 0; w < W; ++w) acc[w] = acc[w] * corr + p * get(v, w);
    m = mn;
}

template <class S, int Chunk, class O, class Q, class K, class V, class QP, class L, class M, class App = Absent>
__device__ __forceinline__ void attention_split_keys(const Args& a, const Task& t, int tid, float scale, O out, Q q,
                                                     K k, V v, QP qpos, L lens, M mask, App app = {}) {
    constexpr bool APPEND = is_present<App>::value;
    static_assert(!APPEND || (Chunk > 0 && is_present<QP>::value), "append form: attention_partial's, with positions");
    using T = typename Q::type;
    constexpr int W = 16 / (int)sizeof(T), D = S::d, LPK = D / W, KPW = 32 / LPK, TK = S::tk;
    static_assert(D % W == 0 && LPK > 0 && 32 % LPK == 0 && S::dv == D, "split keys: heads of whole packs");
    constexpr i64 K2 = stride_of<2, K>, V2 = stride_of<2, V>;
    extern __shared__ float4 ml_smem4[];
    float* part = reinterpret_cast<float*>(ml_smem4);
    const int warps = ml::block_threads() >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane / LPK, r = lane % LPK;
    const int bi = t.lo[0], nh = t.hi[1] - t.lo[1], nq = t.hi[2] - t.lo[2], pairs = nh * nq;
    const int split = warps >= pairs ? warps / pairs : 1;
    const int per_round = warps / split;
    for (int base = 0; base < pairs; base += per_round) {
        const int pair = base + warp / split, piece = warp % split;
        const bool active = warp < per_round * split && pair < pairs;
        float m = neg_inf(), l = 0.0f, acc[W];
#pragma unroll
        for (int w = 0; w < W; ++w) acc[w] = 0.0f;
        int h = 0, i = 0;
        if (active) {
            h = t.lo[1] + pair / nq;
            i = t.lo[2] + pair % nq;
            const int kh = h / S::group;
            const auto len = kv_length<TK>(lens, bi);
            if constexpr (is_present<L>::value) {
                if (len < 0 || len > TK) {
                    if (lane == 0) fail(a, DATA, blockIdx.x, tid, t.op, len, TK, 2, 0);
                }
            }
            i64 begin, end;
            visible_keys<S>(qpos, bi, i, len, begin, end);
            if constexpr (Chunk > 0) {  // attention_partial: only this tile's key range (t.lo[3])
                const i64 range_lo = (i64)t.lo[3] * Chunk, range_hi = range_lo + Chunk;
                if (begin < range_lo) begin = range_lo;
                if (end > range_hi) end = range_hi;
            }
            if (end > TK) end = TK;
            i64 pn = -1;  // the append form's new key, where this tile's visible keys hold it (piece 0 takes it)
            if constexpr (APPEND) {
                pn = query_position(qpos, bi, i);
                if (pn >= begin && pn < end) end = pn;
                else pn = -1;
            }
            const i64 n = end > begin ? end - begin : 0, chunk = (n + split - 1) / split;
            const i64 j_lo = begin + piece * chunk, j_hi = j_lo + chunk < end ? j_lo + chunk : end;
            const T* qrow = q.p + (i64)bi * stride_of<0, Q> + (i64)h * stride_of<1, Q> + (i64)i * stride_of<2, Q>;
            Pack<T, W> qpk;
            if constexpr (APPEND) {  // rotated at its position, rounded as rope would store it
                qpk = rope_head_pack<App::rd, App::neox, W>(qrow, r, (double)query_position(qpos, bi, i),
                                                            app.inv_freq);
            } else {
                qpk = load_pack<T, W>(qrow + r * W);
            }
            const T* kp = k.p + (i64)bi * stride_of<0, K> + (i64)kh * stride_of<1, K> + r * W;
            const T* vp = v.p + (i64)bi * stride_of<0, V> + (i64)kh * stride_of<1, V> + r * W;
            // each step's key and value packs are loaded a step ahead, so that a memory round trip runs
            // behind the step before (decode: ~9 steps a warp in turn; a deeper ring measured no gain);
            // rows past the end are clamped to the last: loaded, never used
            Pack<T, W> kn = load_pack<T, W>(kp + (j_lo + g < TK ? j_lo + g : TK - 1) * K2);
            Pack<T, W> vn = load_pack<T, W>(vp + (j_lo + g < TK ? j_lo + g : TK - 1) * V2);
            // every lane runs the same number of steps (the shuffles need the whole warp); lanes past
            // the end of their piece contribute nothing
            for (i64 j0 = j_lo; j0 < j_hi; j0 += KPW) {
                const i64 j = j0 + g;
                const bool live = j < j_hi;
                const Pack<T, W> kc = kn, vv = vn;
                const i64 jn = j + KPW < TK ? j + KPW : TK - 1;
                kn = load_pack<T, W>(kp + jn * K2);
                vn = load_pack<T, W>(vp + jn * V2);
                float s = 0.0f;
                if (live) s = dot(qpk, kc);
#pragma unroll
                for (int o = LPK / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o, LPK);
                if (live) {
                    const float sm = with_mask(softcap<S::cap_bits>(s * scale), mask, bi, h, i, j);
                    if (!is_present<M>::value || sm != neg_inf()) fold_key(sm, vv, m, l, acc);
                }
            }
            if constexpr (APPEND) {
                if (pn >= 0 && piece == 0) {  // the new key (rope(k_new), as the cache will hold it) and v_new
                    using KN = decltype(app.k);
                    using VN = decltype(app.v);
                    const T* kr = app.k.p + (i64)bi * stride_of<0, KN> + (i64)kh * stride_of<1, KN>;
                    const Pack<T, W> kc = rope_head_pack<App::rd, App::neox, W>(kr, r, (double)pn, app.inv_freq);
                    const Pack<T, W> vv = load_pack<T, W>(app.v.p + (i64)bi * stride_of<0, VN> +
                                                          (i64)kh * stride_of<1, VN> + r * W);
                    float s = dot(qpk, kc);
#pragma unroll
                    for (int o = LPK / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o, LPK);
                    const float sm = with_mask(softcap<S::cap_bits>(s * scale), mask, bi, h, i, pn);
                    if (g == 0 && (!is_present<M>::value || sm != neg_inf())) {  // one key group takes it
                        fold_key(sm, vv, m, l, acc);  // (the merge below adds the groups)
                    }
                }
            }
        }
        // merge the KPW key groups of the warp (lanes with the same r)
#pragma unroll
        for (int o = LPK; o < 32; o <<= 1) {
            const float m2 = __shfl_xor_sync(0xffffffffu, m, o), l2 = __shfl_xor_sync(0xffffffffu, l, o);
            const float mx = m2 > m ? m2 : m;
            const float c1 = mx == neg_inf() ? 0.0f : expf(m - mx), c2 = mx == neg_inf() ? 0.0f : expf(m2 - mx);
            l = l * c1 + l2 * c2;
#pragma unroll
            for (int w = 0; w < W; ++w) acc[w] = acc[w] * c1 + __shfl_xor_sync(0xffffffffu, acc[w], o) * c2;
            m = mx;
        }
        if (active && g == 0) {
            float* slot = part + warp * (D + 2);
#pragma unroll
            for (int w = 0; w < W; ++w) slot[r * W + w] = acc[w];
            if (r == 0) {
                slot[D] = m;
                slot[D + 1] = l;
            }
        }
        ml::block_sync();
        if (active && piece == 0) {  // combine the pieces of this (head, query)
            float mx = neg_inf();
            for (int p2 = 0; p2 < split; ++p2) {
                const float mp = part[(warp + p2) * (D + 2) + D];
                mx = mp > mx ? mp : mx;
            }
            float lsum = 0.0f;
            for (int p2 = 0; p2 < split; ++p2) {
                const float* sl = part + (warp + p2) * (D + 2);
                lsum += mx == neg_inf() ? 0.0f : sl[D + 1] * expf(sl[D] - mx);
            }
            const i64 ob = (i64)bi * stride_of<0, O> + (i64)h * stride_of<1, O> + (i64)i * stride_of<2, O> +
                           (Chunk > 0 ? (i64)t.lo[3] * stride_of<3, O> : 0);
            for (int dd = lane; dd < D; dd += 32) {
                float o = 0.0f;
                for (int p2 = 0; p2 < split; ++p2) {
                    const float* sl = part + (warp + p2) * (D + 2);
                    o += mx == neg_inf() ? 0.0f : sl[dd] * expf(sl[D] - mx);
                }
                if constexpr (Chunk > 0) out.p[ob + (i64)dd * stride_of<4, O>] = o;
                else store(out.p + ob + (i64)dd * stride_of<3, O>, lsum > 0.0f ? o / lsum : 0.0f);
            }
            if constexpr (Chunk > 0) {
                if (lane == 0) {
                    out.p[ob + (i64)D * stride_of<4, O>] = mx;
                    out.p[ob + (i64)(D + 1) * stride_of<4, O>] = lsum;
                }
            }
        }
        ml::block_sync();
    }
}

// ---- tensor cores ---------------------------------------------------------------------------------

//
// A warp owns a unit of 16 queries of one head at a time (units in turn when the tile has more than the
// block has warps; with SPLIT 2 and at most half as many units as warps, two warps a unit, each on every
// other block of keys, their partial results merged at the end): the queries' fragments stay in
// registers, and for every block of ATT_BK keys staged in shared memory (K and V, double-buffered by
// cp.async, every thread copying, SPLIT blocks a stage) it computes the 16 x 64
// scores S = Q K^T on tensor cores, masks them by each query's visible range, updates the running row
// maxima and sums (online softmax, float32, exp2 with the scale folded in), and adds P V on tensor cores
// with P as two 16-bit parts (split_pair: float32-like accuracy at twice the P V work). Fragment layouts as in megaloop/mma.cuh:
// the C fragment of S is, pair for pair, the A fragment P needs, so P never leaves registers. K's
// fragments come from ldmatrix (keys are rows, the head dimension contiguous: B "col" layout); V's from
// ldmatrix.trans (keys are rows, but V's n is the head dimension).

constexpr int ATT_BK = 64;  // keys a block stages and a warp's scores cover

// Shared memory attention_mma<T, D, SPLIT> needs: two stages of SPLIT K and V blocks each, rows padded
// by 8 elements (ldmatrix's 8 row addresses fall in distinct banks), plus the warps' key ranges. (The
// split warps' partial results pass through the stages' space once the keys are done: 32 lanes x
// (D / 2 + 4) floats, 16 x (D + 8), a unit; at most half the warps' units, 8 warps' fill two K blocks.)
__host__ __device__ constexpr int attention_mma_shared_bytes(int d, int split = 1) {
    return 2 * 2 * split * ATT_BK * (d + 8) * 2 + 256;
}

// Keys [j0, j0 + ATT_BK) of X (row stride ld, D contiguous, rows 16-byte aligned) into s[ATT_BK][D + 8];
// rows at or past tk are zeros (masked anyway; zeros keep 0 * V finite).
template <typename T, int D>
__device__ __forceinline__ void attention_stage(T* s, const T* x, i64 ld, int j0, int tk) {
    constexpr int CHUNKS = D / 8;
    for (int c = threadIdx.x; c < ATT_BK * CHUNKS; c += ml::block_threads()) {
        const int r = c / CHUNKS, col = (c % CHUNKS) * 8, j = j0 + r;
        const bool ok = j < tk;
        cp_async16(s + r * (D + 8) + col, ok ? x + (i64)j * ld + col : x, ok);
    }
}

__device__ __forceinline__ u32 pack_pair(float lo, float hi, bf16) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
__device__ __forceinline__ u32 pack_pair(float lo, float hi, f16) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
__device__ __forceinline__ float low_half(u32 x, bf16) { return __uint_as_float(x << 16); }
__device__ __forceinline__ float high_half(u32 x, bf16) { return __uint_as_float(x & 0xffff0000u); }
__device__ __forceinline__ float low_half(u32 x, f16) { return to_float(f16{(u16)(x & 0xffffu)}); }
__device__ __forceinline__ float high_half(u32 x, f16) { return to_float(f16{(u16)(x >> 16)}); }

// Two probabilities as a sum of two 16-bit pairs, hi + lo, lo the rounding error of hi: P V as
// P_hi V + P_lo V keeps P to ~16 bits, where P in one 16-bit value (FlashAttention's choice) strays
// by 2^-9 of a weight and outputs that cancel (values of both signs) miss the float32 accuracy the
// other attention paths keep (measured: 1e-3 errors on outputs of 5e-4 in bf16).
template <typename T>
__device__ __forceinline__ void split_pair(float a, float b, u32& hi, u32& lo) {
    hi = pack_pair(a, b, T{});
    lo = pack_pair(a - low_half(hi, T{}), b - high_half(hi, T{}), T{});
}

// q: query 0 of head 0 of the tile (heads q_head apart, queries q_row apart, D contiguous); k, v: key 0
// of the tile's kv head (keys k_row / v_row apart); nh heads x nq queries; tk keys in all.
// range(r, begin, end): the keys [begin, end) query r (0 <= r < nq, the same for every head) sees.
// store(head, r, dim, value) writes the normalised output (zeros for a query that sees no key).
// mask: MaskRows (its row(head, r)(key) added to each visible score, natural units; -inf hides it) or NoMask.
template <typename T, int D, int SPLIT, unsigned Cap = 0u, typename Range, typename Store, typename Mask = NoMask>
__device__ __forceinline__ void attention_mma(const T* q, i64 q_head, i64 q_row, int nh, int nq, const T* k, i64 k_row,
                                              const T* v, i64 v_row, int tk, float scale_log2, void* smem,
                                              Range range, Store store, Mask mask = {}) {
    static_assert(D % 16 == 0 && D <= 128, "head dimensions of 16..128 in steps of 16");
    static_assert(SPLIT == 1 || SPLIT == 2, "a unit's keys over one or two warps");
    constexpr int LD = D + 8, KS = D / 16, NT = ATT_BK / 8, DT = D / 8;
    T* sk = reinterpret_cast<T*>(smem);  // [2][SPLIT][ATT_BK][LD]
    T* sv = sk + 2 * SPLIT * ATT_BK * LD;  // [2][SPLIT][ATT_BK][LD]
    int* ranges = reinterpret_cast<int*>(sv + 2 * SPLIT * ATT_BK * LD);  // [warps][2]
    const int warps = ml::block_threads() >> 5, warp_id = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, qd = lane & 3;
    // ldmatrix row addresses, as shared-space byte offsets (constant offsets then fold into the
    // instructions): K's lane l reads key (l % 8) + 8 (l / 16), dims + 8 ((l / 8) % 2) (two n8 tiles of
    // keys, both halves of a k16 step); V's (transposed) reads key (l % 8) + 8 ((l / 8) % 2), dims + 8 (l / 16)
    const u32 k_at = shared_address(sk) + 2 * (((lane & 7) + ((lane >> 4) << 3)) * LD + ((lane >> 3) & 1) * 8);
    const u32 v_at = shared_address(sv) + 2 * ((((lane >> 3) & 1) * 8 + (lane & 7)) * LD + (lane >> 4) * 8);
    const int per_head = (nq + 15) / 16, units = nh * per_head;
    // two warps a unit when the units leave at least half the warps idle: warp w takes unit w / 2 and
    // keys blocks w % 2, 2 + w % 2, ... of each stage pair (a stage holds `split` consecutive blocks)
    const int split = SPLIT == 2 && 2 * units <= warps ? 2 : 1;
    const int warp = warp_id / split, part = warp_id % split, per_round = warps / split;
    const float NEG = neg_inf();
    for (int u0 = 0; u0 < units; u0 += per_round) {
        const int u = u0 + warp;
        const bool active = u < units;
        const int hh = active ? u / per_head : 0, r0 = active ? (u % per_head) * 16 + g : nq, r1 = r0 + 8;
        i64 b0 = 0, e0 = 0, b1 = 0, e1 = 0;  // visible keys of rows r0 and r1 (empty past nq)
        if (r0 < nq) range(r0, b0, e0);
        if (r1 < nq) range(r1, b1, e1);
        if (e0 <= b0) b0 = e0 = 0;
        if (e1 <= b1) b1 = e1 = 0;
        [[maybe_unused]] const auto mask0 = mask.row(hh, min(r0, nq - 1));
        [[maybe_unused]] const auto mask1 = mask.row(hh, min(r1, nq - 1));
        // this warp's keys: the union of its rows' ranges; the block's: the union over the warps
        int lo = (int)tk, hi = 0;
        if (e0 > b0) { lo = (int)b0; hi = (int)e0; }
        if (e1 > b1) { lo = min(lo, (int)b1); hi = max(hi, (int)e1); }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            lo = min(lo, __shfl_xor_sync(0xffffffffu, lo, o));
            hi = max(hi, __shfl_xor_sync(0xffffffffu, hi, o));
        }
        if (lane == 0) { ranges[2 * warp_id] = lo; ranges[2 * warp_id + 1] = hi; }
        ml::block_sync();
        int block_lo = (int)tk, block_hi = 0;
        for (int w = 0; w < warps; ++w) {
            if (ranges[2 * w] < ranges[2 * w + 1]) {
                block_lo = min(block_lo, ranges[2 * w]);
                block_hi = max(block_hi, ranges[2 * w + 1]);
            }
        }
        ml::block_sync();  // ranges[] is rewritten next round
        // the unit's queries as A fragments: rows r0 / r1, columns 16 ks + 2 qd (+ 8), zeros past nq
        u32 qa[KS][4];
        const T* q0 = q + (i64)hh * q_head + (i64)min(r0, nq - 1) * q_row;
        const T* q1 = q + (i64)hh * q_head + (i64)min(r1, nq - 1) * q_row;
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
            const int c = 16 * ks + 2 * qd;
            qa[ks][0] = r0 < nq ? *reinterpret_cast<const u32*>(q0 + c) : 0u;
            qa[ks][1] = r1 < nq ? *reinterpret_cast<const u32*>(q1 + c) : 0u;
            qa[ks][2] = r0 < nq ? *reinterpret_cast<const u32*>(q0 + c + 8) : 0u;
            qa[ks][3] = r1 < nq ? *reinterpret_cast<const u32*>(q1 + c + 8) : 0u;
        }
        float o[DT][4];
#pragma unroll
        for (int n = 0; n < DT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
        float m0 = NEG, m1 = NEG, l0 = 0.0f, l1 = 0.0f;  // running maxima (scaled, log2 units), this lane's sums
        const int first = block_lo / ATT_BK * ATT_BK, step = split * ATT_BK;
        for (int p = 0; p < split && first + p * ATT_BK < block_hi; ++p) {
            attention_stage<T, D>(sk + p * ATT_BK * LD, k, k_row, first + p * ATT_BK, tk);
            attention_stage<T, D>(sv + p * ATT_BK * LD, v, v_row, first + p * ATT_BK, tk);
        }
        cp_async_commit();
        int stage = 0;
        for (int js = first; js < block_hi; js += step, stage ^= 1) {
            for (int p = 0; p < split && js + step + p * ATT_BK < block_hi; ++p) {  // the next stage lands meanwhile
                attention_stage<T, D>(sk + ((stage ^ 1) * split + p) * ATT_BK * LD, k, k_row, js + step + p * ATT_BK, tk);
                attention_stage<T, D>(sv + ((stage ^ 1) * split + p) * ATT_BK * LD, v, v_row, js + step + p * ATT_BK, tk);
            }
            cp_async_commit();
            cp_async_wait<1>();
            ml::block_sync();
            const int j0 = js + part * ATT_BK;  // this warp's block of the stage
            if (active && j0 < hi && j0 + ATT_BK > lo) {
                const int slot = stage * split + part;
                const u32 k_stage = k_at + 2 * slot * ATT_BK * LD, v_stage = v_at + 2 * slot * ATT_BK * LD;
                float s[NT][4];
#pragma unroll
                for (int n = 0; n < NT; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
                for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
                    for (int n = 0; n < NT; n += 2) {  // keys 8n..8n+15: B fragments of two n8 tiles
                        u32 b[4];
                        ldmatrix_x4(b, k_stage + 2 * (8 * n * LD + 16 * ks));
                        mma_16816(s[n], qa[ks], b, T{});
                        mma_16816(s[n + 1], qa[ks], b + 2, T{});
                    }
                }
                // mask, scale (log2 units) and the rows' new maxima
                float mx0 = m0, mx1 = m1;
#pragma unroll
                for (int n = 0; n < NT; ++n) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const i64 j = j0 + 8 * n + 2 * qd + (e & 1);
                        const bool seen = (e < 2) ? (j >= b0 && j < e0) : (j >= b1 && j < e1);
                        s[n][e] = seen ? softcap<Cap>(s[n][e] * scale_log2, 1.4426950408889634f) : NEG;
                        if constexpr (Mask::present) {
                            if (seen) s[n][e] += (e < 2 ? mask0(j) : mask1(j)) * 1.4426950408889634f;
                        }
                    }
                    mx0 = fmaxf(mx0, fmaxf(s[n][0], s[n][1]));
                    mx1 = fmaxf(mx1, fmaxf(s[n][2], s[n][3]));
                }
#pragma unroll
                for (int off = 1; off < 4; off <<= 1) {  // the quad holds a row's 64 scores
                    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
                    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
                }
                // a row that has seen no key yet keeps max -inf: subtract 0 instead (its p are all 0)
                const float base0 = mx0 == NEG ? 0.0f : mx0, base1 = mx1 == NEG ? 0.0f : mx1;
                const float c0 = exp2f(m0 - base0), c1 = exp2f(m1 - base1);
                m0 = mx0;
                m1 = mx1;
                l0 *= c0;
                l1 *= c1;
#pragma unroll
                for (int n = 0; n < DT; ++n) {
                    o[n][0] *= c0;
                    o[n][1] *= c0;
                    o[n][2] *= c1;
                    o[n][3] *= c1;
                }
#pragma unroll
                for (int kk = 0; kk < ATT_BK / 16; ++kk) {  // keys 16kk..16kk+15: P's fragment, then P V
                    u32 pa[4], pl[4];  // P's fragment: its 16-bit value and what that rounding lost
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int n = 2 * kk + h;
                        const float p0 = exp2f(s[n][0] - base0), p1 = exp2f(s[n][1] - base0);
                        const float p2 = exp2f(s[n][2] - base1), p3 = exp2f(s[n][3] - base1);
                        l0 += p0 + p1;
                        l1 += p2 + p3;
                        // the C fragment of keys 8n.. is half of the A fragment of the key step
                        // (a0 / a1: rows g / g + 8 of its low 8 keys; a2 / a3: of its high 8)
                        split_pair<T>(p0, p1, pa[2 * h], pl[2 * h]);
                        split_pair<T>(p2, p3, pa[2 * h + 1], pl[2 * h + 1]);
                    }
#pragma unroll
                    for (int n = 0; n < DT; n += 2) {  // dims 8n..8n+15
                        u32 b[4];
                        ldmatrix_x4_trans(b, v_stage + 2 * (16 * kk * LD + 8 * n));
                        mma_16816(o[n], pa, b, T{});
                        mma_16816(o[n + 1], pa, b + 2, T{});
                        mma_16816(o[n], pl, b, T{});
                        mma_16816(o[n + 1], pl, b + 2, T{});
                    }
                }
            }
            ml::block_sync();  // every warp is done with this stage before the next block refills it
        }
        cp_async_wait<0>();
        if (split == 2) {
            // merge the pair's partial results, lane by lane (both warps hold the same rows and columns):
            // the odd warp leaves (m, l, o) in the stages' space (free: every warp passed the loop's last
            // barrier), the even one rescales both to the larger maximum and adds
            float* merge = reinterpret_cast<float*>(smem) + (warp * 32 + lane) * (4 * DT + 4);
            if (part == 1) {
                merge[0] = m0;
                merge[1] = m1;
                merge[2] = l0;
                merge[3] = l1;
#pragma unroll
                for (int n = 0; n < DT; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) merge[4 + 4 * n + e] = o[n][e];
            }
            ml::block_sync();
            if (part == 0) {
                const float pm0 = merge[0], pm1 = merge[1];
                const float n0 = fmaxf(m0, pm0), n1 = fmaxf(m1, pm1);
                const float z0 = n0 == NEG ? 0.0f : n0, z1 = n1 == NEG ? 0.0f : n1;  // rows no key reached
                const float a0 = exp2f(m0 - z0), a1 = exp2f(m1 - z1), b0 = exp2f(pm0 - z0), b1 = exp2f(pm1 - z1);
                l0 = l0 * a0 + merge[2] * b0;
                l1 = l1 * a1 + merge[3] * b1;
#pragma unroll
                for (int n = 0; n < DT; ++n) {
                    o[n][0] = o[n][0] * a0 + merge[4 + 4 * n] * b0;
                    o[n][1] = o[n][1] * a0 + merge[4 + 4 * n + 1] * b0;
                    o[n][2] = o[n][2] * a1 + merge[4 + 4 * n + 2] * b1;
                    o[n][3] = o[n][3] * a1 + merge[4 + 4 * n + 3] * b1;
                }
            }
        }
#pragma unroll
        for (int off = 1; off < 4; off <<= 1) {
            l0 += __shfl_xor_sync(0xffffffffu, l0, off);
            l1 += __shfl_xor_sync(0xffffffffu, l1, off);
        }
        if (active && part == 0) {
            const float i0 = l0 > 0.0f ? 1.0f / l0 : 0.0f, i1 = l1 > 0.0f ? 1.0f / l1 : 0.0f;
#pragma unroll
            for (int n = 0; n < DT; ++n) {
                const int dd = 8 * n + 2 * qd;
                if (r0 < nq) {
                    store(hh, r0, dd, o[n][0] * i0);
                    store(hh, r0, dd + 1, o[n][1] * i0);
                }
                if (r1 < nq) {
                    store(hh, r1, dd, o[n][2] * i1);
                    store(hh, r1, dd + 1, o[n][3] * i1);
                }
            }
        }
    }
}

// The tile on tensor cores: the tile's heads (one kv head's) and block of queries through
// attention_mma<T, D, Split>, each query's visible keys by the rule of the other paths.
template <class S, int Split, class O, class Q, class K, class V, class QP, class L, class M>
__device__ __forceinline__ void attention_mma_tile(const Args& a, const Task& t, int tid, float scale_log2, O out,
                                                   Q q, K k, V v, QP qpos, L lens, M mask) {
    using T = typename Q::type;
    extern __shared__ float4 ml_smem4[];
    const int bi = t.lo[0], h0 = t.lo[1], s0 = t.lo[2];
    const int kh = h0 / S::group;  // the tile's heads share it
    const auto len = kv_length<S::tk>(lens, bi);
    const bool bad_len = is_present<L>::value && (len < 0 || len > S::tk);
    if (bad_len && threadIdx.x == 0) fail(a, DATA, blockIdx.x, tid, t.op, len, S::tk, 2, 0);
    auto range = [&](int r, i64& first, i64& last) {
        const int i = s0 + r;
        i64 begin, end;
        visible_keys<S>(qpos, bi, i, len, begin, end);
        first = begin;
        last = bad_len ? begin : end;  // a bad length is reported above; nothing is read
    };
    using Mask = typename mask_rows_of<M>::type;
    Mask rows{};
    if constexpr (is_present<M>::value) rows = {mask, bi, h0, s0};
    attention_mma<T, S::d, Split, S::cap_bits>(
        q.p + (i64)bi * stride_of<0, Q> + (i64)h0 * stride_of<1, Q> + (i64)s0 * stride_of<2, Q>, stride_of<1, Q>,
        stride_of<2, Q>, t.hi[1] - h0, t.hi[2] - s0, k.p + (i64)bi * stride_of<0, K> + (i64)kh * stride_of<1, K>,
        stride_of<2, K>, v.p + (i64)bi * stride_of<0, V> + (i64)kh * stride_of<1, V>, stride_of<2, V>, S::tk,
        scale_log2, ml_smem4, range, [&](int hh, int r, int dd, float val) {
            store(out.p + (i64)bi * stride_of<0, O> + (i64)(h0 + hh) * stride_of<1, O> +
                      (i64)(s0 + r) * stride_of<2, O> + (i64)dd * stride_of<3, O>,
                  val);
        },
        rows);
}

// q, k and v 16-byte aligned (the tensor-core and split-key paths load them in 16-byte packs)
template <class Q, class K, class V>
__device__ __forceinline__ bool aligned_heads(const Q& q, const K& k, const V& v) {
    return aligned(q.p, 16) && aligned(k.p, 16) && aligned(v.p, 16);
}

// One tile of attention (queries of the query heads of one kv head; out [B, Hq, Tq, Dv]): lanes over
// keys where LN is a Lanes (k and v 16-byte aligned), else on tensor cores where Mma (attention_mma's Split, 1 or 2), else split keys where SplitKeys, either only where q,
// k and v are 16-byte aligned; else a warp per row. scale_log2: scale * log2(e), rounded once.
template <class S, int Mma, bool SplitKeys, class LN = NoLanes, class O, class Q, class K, class V, class QP, class L,
          class M>
__device__ __forceinline__ void attention(const Args& a, const Task& t, int tid, float scale, float scale_log2, O out,
                                          Q q, K k, V v, QP qpos, L lens, M mask) {
    static_assert(Q::rank == 4 && K::rank == 4 && V::rank == 4 && O::rank == 4, "attention: 4-D q, k, v, out");
    if constexpr (LN::present) {
        if (aligned(k.p, 16) && aligned(v.p, 16)) {
            attention_lanes<S, 0, LN>(a, t, tid, scale, out, q, k, v, qpos, lens, mask, Absent{});
            return;
        }
    }
    if constexpr (Mma > 0) {
        if (aligned_heads(q, k, v)) {
            attention_mma_tile<S, Mma>(a, t, tid, scale_log2, out, q, k, v, qpos, lens, mask);
            return;
        }
    }
    if constexpr (SplitKeys) {
        if (aligned_heads(q, k, v)) {
            attention_split_keys<S, 0>(a, t, tid, scale, out, q, k, v, qpos, lens, mask);
            return;
        }
    }
    attention_warp_rows<S, 0>(a, t, tid, scale, out, q, k, v, qpos, lens, mask);
}

// One tile of attention_partial: key range t.lo[3] of Chunk keys; out [B, Hq, Tq, splits, Dv + 2]
// float32, the unnormalised output, its max score m and exp-sum l. Lanes over keys where LN is a Lanes
// and k and v are aligned, else split keys where SplitKeys and aligned (the append form's k_new and
// v_new too). app: AttnAppend for the append form, else Absent.
template <class S, int Chunk, bool SplitKeys, class LN = NoLanes, class O, class Q, class K, class V, class QP, class L,
          class M, class App = Absent>
__device__ __forceinline__ void attention_partial(const Args& a, const Task& t, int tid, float scale, O out, Q q, K k,
                                                  V v, QP qpos, L lens, M mask, App app = {}) {
    static_assert(Chunk > 0 && O::rank == 5, "attention_partial: key ranges of Chunk keys, 5-D out");
    if constexpr (LN::present) {
        if (aligned(k.p, 16) && aligned(v.p, 16)) {
            attention_lanes<S, Chunk, LN>(a, t, tid, scale, out, q, k, v, qpos, lens, mask, app);
            return;
        }
    }
    if constexpr (SplitKeys) {
        bool ok = aligned_heads(q, k, v);
        if constexpr (is_present<App>::value) ok = ok && aligned(app.k.p, 16) && aligned(app.v.p, 16);
        if (ok) {
            attention_split_keys<S, Chunk>(a, t, tid, scale, out, q, k, v, qpos, lens, mask, app);
            return;
        }
    }
    attention_warp_rows<S, Chunk>(a, t, tid, scale, out, q, k, v, qpos, lens, mask, app);
}

// One tile of attention_combine, a warp per (batch, head, query): the largest m over the Splits key
// ranges of x [B, Hq, Tq, Splits, Dv + 2], then the weighted sums of the outputs (lanes over the
// values) and of l; zeros when no range saw a key. The same operations in the same order either way.
template <int Splits, int Dv, bool Held, class O, class X>
__device__ __forceinline__ void attention_combine(const Task& t, O out, X x) {
    static_assert(X::rank == 5 && O::rank == 4, "attention_combine: 5-D partial results, 4-D out");
    constexpr i64 X3 = stride_of<3, X>, X4 = stride_of<4, X>, O3 = stride_of<3, O>;
    Task rowt = t;
    rowt.hi[3] = rowt.lo[3] + 1;  // a warp per (batch, head, query)
    for_box_warps<4>(rowt, [&](const int* o, int lane) {
        const i64 xb = (i64)o[0] * stride_of<0, X> + (i64)o[1] * stride_of<1, X> + (i64)o[2] * stride_of<2, X>;
        if constexpr (Held) {
            // every load before any store (out may alias x as far as the compiler knows: a store between
            // them kept the next loads from starting), each range's m, l and weight in registers
            constexpr int CHUNKS = (Dv + 31) / 32;
            float ms[Splits], ls[Splits], w[Splits];
#pragma unroll
            for (int s = 0; s < Splits; ++s) {
                const i64 sb = xb + (i64)s * X3;
                ms[s] = x.p[sb + Dv * X4];
                ls[s] = x.p[sb + (Dv + 1) * X4];
            }
            float top = neg_inf();
#pragma unroll
            for (int s = 0; s < Splits; ++s) top = ms[s] > top ? ms[s] : top;
            const float base = top == neg_inf() ? 0.0f : top;
            float total = 0.0f;
#pragma unroll
            for (int s = 0; s < Splits; ++s) {
                w[s] = expf(ms[s] - base);
                total += ls[s] * w[s];
            }
            const i64 ob = (i64)o[0] * stride_of<0, O> + (i64)o[1] * stride_of<1, O> + (i64)o[2] * stride_of<2, O>;
            float acc[CHUNKS];  // the lane's values dd = lane + 32 j
#pragma unroll
            for (int j = 0; j < CHUNKS; ++j) {
                const int dd = lane + 32 * j;
                acc[j] = 0.0f;
                if (dd >= Dv) continue;
#pragma unroll
                for (int s = 0; s < Splits; ++s) acc[j] += x.p[xb + (i64)s * X3 + (i64)dd * X4] * w[s];
            }
            if constexpr (CHUNKS == 1) {  // (as ML_CHUNKS: no loop of one trip)
                const int dd = lane;
                if (dd < Dv) store(out.p + ob + (i64)dd * O3, total > 0.0f ? acc[0] / total : 0.0f);
            } else {
#pragma unroll
                for (int j = 0; j < CHUNKS; ++j) {
                    const int dd = lane + 32 * j;
                    if (dd < Dv) store(out.p + ob + (i64)dd * O3, total > 0.0f ? acc[j] / total : 0.0f);
                }
            }
        } else {  // too many ranges to keep in registers: each weight recomputed where it is used
            float top = neg_inf();
            for (int s = 0; s < Splits; ++s) {
                const float m = x.p[xb + (i64)s * X3 + Dv * X4];
                top = m > top ? m : top;
            }
            const float base = top == neg_inf() ? 0.0f : top;
            float total = 0.0f;
            for (int s = 0; s < Splits; ++s) {
                const i64 sb = xb + (i64)s * X3;
                total += x.p[sb + (Dv + 1) * X4] * expf(x.p[sb + Dv * X4] - base);
            }
            const i64 ob = (i64)o[0] * stride_of<0, O> + (i64)o[1] * stride_of<1, O> + (i64)o[2] * stride_of<2, O>;
            for (int dd = lane; dd < Dv; dd += 32) {
                float acc = 0.0f;
                for (int s = 0; s < Splits; ++s) {
                    const i64 sb = xb + (i64)s * X3;
                    acc += x.p[sb + (i64)dd * X4] * expf(x.p[sb + Dv * X4] - base);
                }
                store(out.p + ob + (i64)dd * O3, total > 0.0f ? acc / total : 0.0f);
            }
        }
    });
}

#undef ML_CHUNKS

}  // namespace ml


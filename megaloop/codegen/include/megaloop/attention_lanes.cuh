// megaloop/attention_lanes.cuh: the decode attention tile built for latency (KernelOptions.decode_attention;
// megaloop/codegen/emit_attention.py picks it and sizes it; docs/runtime.md, "Lanes over keys").
//
// A lane a key: the tile's keys and values are staged in shared memory at once (cp.async, every thread),
// with its query rows (rotated in the append form) and the append form's new key and value beside them;
// then each warp takes a block of 32 keys and some of the rows: a lane computes its key's whole dot
// product with each row, the warp finds the rows' maxima (one reduction), each lane one exponential,
// the warp the sums (one reduction), and the lanes, now over the value dims, add the 32 values with
// their weights from shared memory. The warps of a row merge once, at the end. One memory round trip
// and two block barriers where the split-key tile had a round trip a step of 4 keys and two merges.
#pragma once
#include "megaloop/attention_keys.cuh"
#include "megaloop/rope.cuh"
#include "megaloop/vec.cuh"

namespace ml {

// The tile's arrangement (emit_attention.py's decode_lanes): at most Rows (head, query) rows a tile,
// Blocks blocks of 32 keys staged at once, each block's rows over RowSplit warps (warp w: block
// w % Blocks, rows w / Blocks + RowSplit x); Blocks * RowSplit warps compute, all of them stage.
template <int Rows, int Blocks, int RowSplit>
struct Lanes {
    static constexpr bool present = true;
    static_assert(Rows > 0 && Blocks > 0 && RowSplit > 0 && RowSplit <= Rows, "Lanes: rows, key blocks, row split");
    static constexpr int rows = Rows, blocks = Blocks, row_split = RowSplit;
    static constexpr int per_warp = (Rows + RowSplit - 1) / RowSplit, keys = 32 * Blocks, warps = Blocks * RowSplit;
};

struct NoLanes {  // the other paths
    static constexpr bool present = false;
};

// The shared memory of attention_lanes<T, D, DV, LN>, in bytes and in this order (emit_attention.py's
// lanes_shared_bytes is the same sum): keys and values [keys][dims + 16 bytes] (the pad puts a lane's
// rows in distinct banks), the rows' q as float32, the new key and value, the warps' weights, the
// warps' partial sums (DV + 2 floats a row).
template <class T, int D, int DV, class LN>
struct LanesSmem {
    static constexpr int PAD = 16 / (int)sizeof(T), LD = D + PAD, LDV = DV + PAD;
    static constexpr int K = 0, V = K + LN::keys * LD * (int)sizeof(T), Q = V + LN::keys * LDV * (int)sizeof(T);
    static constexpr int KN = Q + LN::rows * D * 4, VN = KN + (D * (int)sizeof(T) + 15) / 16 * 16;
    static constexpr int P = VN + (DV * (int)sizeof(T) + 15) / 16 * 16, PART = P + LN::warps * LN::per_warp * 32 * 4;
    static constexpr int BYTES = PART + LN::warps * LN::per_warp * (DV + 2) * 4;
    struct Views {
        T *ks, *vs;
        float* qs;
        T *kn, *vn;
        float *ps, *part;
    };
    // the regions above in the block's dynamic shared memory
    __device__ __forceinline__ static Views views() {
        extern __shared__ float4 ml_smem4[];
        char* s = reinterpret_cast<char*>(ml_smem4);
        return {reinterpret_cast<T*>(s + K),    reinterpret_cast<T*>(s + V),     reinterpret_cast<float*>(s + Q),
                reinterpret_cast<T*>(s + KN),   reinterpret_cast<T*>(s + VN),    reinterpret_cast<float*>(s + P),
                reinterpret_cast<float*>(s + PART)};
    }
};

// LN::keys rows of keys and values into the staged rows, 16 bytes a copy, every thread: row r's key
// (value) from row(true, r) (row(false, r)), zeros where that is nullptr (``any``: a global address
// the zero copies name, reading nothing)
template <class T, int D, int DV, class LN, class Row>
__device__ __forceinline__ void lanes_stage_rows(T* ks, T* vs, const T* any, Row row) {
    using L = LanesSmem<T, D, DV, LN>;
    constexpr int W = 16 / (int)sizeof(T), KC = D / W, VC = DV / W;
    for (int c = threadIdx.x; c < LN::keys * (KC + VC); c += ml::block_threads()) {
        const bool key = c < LN::keys * KC;
        const int e = key ? c : c - LN::keys * KC, r = key ? e / KC : e / VC, col = (key ? e % KC : e % VC) * W;
        const T* src = row(key, r);
        cp_async16(key ? ks + r * L::LD + col : vs + r * L::LDV + col, src ? src + col : any, src != nullptr);
    }
    cp_async_commit();
}

// keys [s0, s0 + n) of the kv head's k and v rows (kp, vp; rows k2 / v2 apart) into the staged rows,
// zeros past n
template <class T, int D, int DV, class LN>
__device__ __forceinline__ void lanes_stage(T* ks, T* vs, const T* kp, const T* vp, i64 k2, i64 v2, i64 s0, int n) {
    lanes_stage_rows<T, D, DV, LN>(ks, vs, kp, [&](bool key, int r) -> const T* {
        return r >= n ? nullptr : key ? kp + (s0 + r) * k2 : vp + (s0 + r) * v2;
    });
}

// row r of the tile's rows (heads, then queries) into q's float32 rows in shared memory, rotated at
// position pn and rounded to T as rope stores it (the append form); the new key rotated and the new
// value beside them
template <class S, class LN, class T, class Q, class App>
__device__ __forceinline__ void lanes_queries(const Task& t, float* qs, T* kn, T* vn, Q q, i64 pn, const App& app) {
    constexpr int D = S::d, DV = S::dv;
    const int bi = t.lo[0], nq = t.hi[2] - t.lo[2], nrows = (t.hi[1] - t.lo[1]) * nq;
    for (int e = threadIdx.x; e < nrows * D; e += ml::block_threads()) {
        const int r = e / D, d = e % D;
        const T* row = q.p + (i64)bi * stride_of<0, Q> + (i64)(t.lo[1] + r / nq) * stride_of<1, Q> +
                       (i64)(t.lo[2] + r % nq) * stride_of<2, Q>;
        if constexpr (is_present<App>::value) {
            qs[e] = rope_head_dim<App::rd, App::neox>(row, stride_of<3, Q>, d, (double)pn, app.inv_freq);
        } else {
            qs[e] = load(row + (i64)d * stride_of<3, Q>);
        }
    }
    if constexpr (is_present<App>::value) {
        using KN = decltype(app.k);
        using VN = decltype(app.v);
        const int kh = t.lo[1] / S::group;
        const T* kr = app.k.p + (i64)bi * stride_of<0, KN> + (i64)kh * stride_of<1, KN>;
        const T* vr = app.v.p + (i64)bi * stride_of<0, VN> + (i64)kh * stride_of<1, VN>;
        for (int d = threadIdx.x; d < D + DV; d += ml::block_threads()) {
            if (d < D) {
                store(kn + d, rope_head_dim<App::rd, App::neox>(kr, stride_of<3, KN>, d, (double)pn, app.inv_freq));
            }
            else vn[d - D] = vr[(i64)(d - D) * stride_of<3, VN>];
        }
    }
}

// q row r (float32, shared) . the key at krow (T, shared): a pack's products chained, the packs summed
template <int D, class T>
__device__ __forceinline__ float lanes_dot(const float* qr, const T* krow) {
    constexpr int W = 16 / (int)sizeof(T);
    float s = 0.0f;
#pragma unroll
    for (int c = 0; c < D / W; ++c) {
        const Pack<T, W> kp = load_pack<T, W>(krow + c * W);
        float part = 0.0f;
#pragma unroll
        for (int w4 = 0; w4 < W; w4 += 4) {
            const float4 q4 = *reinterpret_cast<const float4*>(qr + c * W + w4);
            part = fmaf(q4.x, get(kp, w4), part);
            part = fmaf(q4.y, get(kp, w4 + 1), part);
            part = fmaf(q4.z, get(kp, w4 + 2), part);
            part = fmaf(q4.w, get(kp, w4 + 3), part);
        }
        s += part;
    }
    return s;
}

// One stage's keys [s0, s0 + 32 Blocks) (staged in ks, vs; the append form's new key and value at
// pn in kn, vn) for a computing warp's rows rg + RowSplit x: each lane its key's scores, the warp's
// online softmax, then the lanes over the value dims. begin/end: each row's visible keys.
template <class S, class LN, bool APPEND, class T, class M, int R, int VPL>
__device__ __forceinline__ void lanes_keys(const Task& t, float scale, const M& mask, const float* qs, const T* ks,
                                           const T* vs, const T* kn, const T* vn, float* ps, i64 s0, i64 key_hi,
                                           i64 pn, int nrows, const i64 (&begin)[R], const i64 (&end)[R],
                                           float (&m)[R], float (&l)[R], float (&acc)[R][VPL]) {
    using Sm = LanesSmem<T, S::d, S::dv, LN>;
    constexpr int D = S::d;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, kb = warp % LN::blocks, rg = warp / LN::blocks;
    const int bi = t.lo[0], nq = t.hi[2] - t.lo[2];
    const i64 j = s0 + 32 * kb + lane;  // this lane's key
    const T* krow = APPEND && j == pn ? kn : ks + (32 * kb + lane) * Sm::LD;
    float corr[R];
#pragma unroll
    for (int x = 0; x < R; ++x) {
        const int r = rg + LN::row_split * x;
        float s = neg_inf();
        if (r < nrows) {
            const int h = t.lo[1] + r / nq, i = t.lo[2] + r % nq;
            const float dot = lanes_dot<D>(qs + r * D, krow);
            if (j >= begin[x] && j < end[x] && j < key_hi) {
                s = with_mask(softcap<S::cap_bits>(dot * scale), mask, bi, h, i, j);
            }
        }
        const float mx = warp_max(s), mn = mx > m[x] ? mx : m[x];
        const float base = mn == neg_inf() ? 0.0f : mn;  // no key seen yet: every weight 0
        const float p = expf(s - base);
        corr[x] = expf(m[x] - base);
        m[x] = mn;
        ps[((warp * R) + x) * 32 + lane] = p;
        l[x] = l[x] * corr[x] + warp_sum(p);
    }
    __syncwarp();
    // lanes over the value dims: the 32 keys' values with their weights, in two chains of 16
    float sum[2][R][VPL];
#pragma unroll
    for (int x = 0; x < R; ++x)
#pragma unroll
        for (int c = 0; c < VPL; ++c) sum[0][x][c] = sum[1][x][c] = 0.0f;
#pragma unroll 8  // (unrolled whole, ptxas hoists all 32 values and spills under the loader warp's 224 registers)
    for (int jj = 0; jj < 32; ++jj) {
        const T* vrow = APPEND && s0 + 32 * kb + jj == pn ? vn : vs + (32 * kb + jj) * Sm::LDV;
        const Pack<T, VPL> vv = load_pack<T, VPL>(vrow + lane * VPL);
#pragma unroll
        for (int x = 0; x < R; ++x) {
            const float p = ps[((warp * R) + x) * 32 + jj];
#pragma unroll
            for (int c = 0; c < VPL; ++c) {  // a key no row sees adds 0 (its value in the cache may be anything)
                const float value = p != 0.0f ? pack_at<VPL>(vv, c) : 0.0f;  // (off the chain of sums)
                sum[jj & 1][x][c] = fmaf(p, value, sum[jj & 1][x][c]);
            }
        }
    }
#pragma unroll
    for (int x = 0; x < R; ++x)
#pragma unroll
        for (int c = 0; c < VPL; ++c) acc[x][c] = fmaf(acc[x][c], corr[x], sum[0][x][c] + sum[1][x][c]);
    __syncwarp();  // ps is rewritten by the next stage
}

// The warps' states merged a row at a time: each computing warp leaves its rows' m, l and value sums
// in shared memory; then a thread an output element weighs the row's Blocks warps by exp(m - max m)
// and writes the range's sums, m and l (Chunk > 0) or the normalised output (zeros where no key).
template <class S, int Chunk, class LN, class O, int R, int VPL>
__device__ __forceinline__ void lanes_merge(const Task& t, O out, float* part, bool computes, int rg, int nrows,
                                            const float (&m)[R], const float (&l)[R], const float (&acc)[R][VPL]) {
    constexpr int DV = S::dv, SLOT = DV + 2, B = LN::blocks;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (computes) {
#pragma unroll
        for (int x = 0; x < R; ++x) {
            if (rg + LN::row_split * x >= nrows) continue;
            float* slot = part + (warp * R + x) * SLOT;
#pragma unroll
            for (int c = 0; c < VPL; ++c) slot[lane * VPL + c] = acc[x][c];
            if (lane == 0) {
                slot[DV] = m[x];
                slot[DV + 1] = l[x];
            }
        }
    }
    ml::block_sync();
    const int bi = t.lo[0], nq = t.hi[2] - t.lo[2];
    for (int e = threadIdx.x; e < nrows * DV; e += ml::block_threads()) {
        const int r = e / DV, d = e % DV;
        const float* first = part + ((r % LN::row_split) * B * R + r / LN::row_split) * SLOT;  // block b: + b R SLOT
        float top = neg_inf();
#pragma unroll
        for (int b = 0; b < B; ++b) top = first[b * R * SLOT + DV] > top ? first[b * R * SLOT + DV] : top;
        const float base = top == neg_inf() ? 0.0f : top;
        float o = 0.0f, sum = 0.0f;
#pragma unroll
        for (int b = 0; b < B; ++b) {
            const float* sl = first + b * R * SLOT;
            const float w = expf(sl[DV] - base);
            o = fmaf(sl[d], w, o);
            sum = fmaf(sl[DV + 1], w, sum);
        }
        const i64 ob = (i64)bi * stride_of<0, O> + (i64)(t.lo[1] + r / nq) * stride_of<1, O> +
                       (i64)(t.lo[2] + r % nq) * stride_of<2, O>;
        if constexpr (Chunk > 0) {
            const i64 rb = ob + (i64)t.lo[3] * stride_of<3, O>;
            out.p[rb + (i64)d * stride_of<4, O>] = o;
            if (d == 0) {
                out.p[rb + (i64)DV * stride_of<4, O>] = top;
                out.p[rb + (i64)(DV + 1) * stride_of<4, O>] = sum;
            }
        } else {
            store(out.p + ob + (i64)d * stride_of<3, O>, sum > 0.0f ? o / sum : 0.0f);
        }
    }
    ml::block_sync();  // the shared memory is the next tile's
}

// The lanes-over-keys tile of attention (Chunk 0: all keys, out [B, Hq, Tq, Dv] normalised) or of
// attention_partial (Chunk > 0: key range t.lo[3], out [B, Hq, Tq, splits, Dv + 2] float32: the
// unnormalised sums, their max score m and exp-sum l). The caller checked that k and v are 16-byte
// aligned (q and the append form's k_new, v_new are read by element); LN: Lanes<Rows, Blocks, RowSplit>.
template <class S, int Chunk, class LN, class O, class Q, class K, class V, class QP, class L, class M, class App>
__device__ __forceinline__ void attention_lanes(const Args& a, const Task& t, int tid, float scale, O out, Q q, K k,
                                                V v, QP qpos, L lens, M mask, App app) {
    constexpr bool APPEND = is_present<App>::value;
    static_assert(!APPEND || (Chunk > 0 && is_present<QP>::value), "append form: attention_partial's, with positions");
    using T = typename Q::type;
    using Sm = LanesSmem<T, S::d, S::dv, LN>;
    constexpr int D = S::d, DV = S::dv, TK = S::tk, VPL = DV / 32, R = LN::per_warp, W = 16 / (int)sizeof(T);
    static_assert(D % W == 0 && DV % 32 == 0 && (VPL & (VPL - 1)) == 0 && VPL * (int)sizeof(T) <= 16,
                  "attention_lanes: heads of whole 16-byte packs, values of 32 to 128 dims (16 bytes a lane at most)");
    const auto [ks, vs, qs, kn, vn, ps, part] = Sm::views();
    const int warp = threadIdx.x >> 5, rg = warp / LN::blocks;
    const int bi = t.lo[0], nq = t.hi[2] - t.lo[2], nrows = (t.hi[1] - t.lo[1]) * nq, kh = t.lo[1] / S::group;
    const i64 key_lo = Chunk > 0 ? (i64)t.lo[3] * Chunk : 0;
    const i64 key_hi = Chunk > 0 && key_lo + Chunk < TK ? key_lo + Chunk : TK;
    const T* kp = k.p + (i64)bi * stride_of<0, K> + (i64)kh * stride_of<1, K>;
    const T* vp = v.p + (i64)bi * stride_of<0, V> + (i64)kh * stride_of<1, V>;
    // the first stage's copies go out first, waiting for no load (not the length, not the position);
    // the rows' q and the new key and value meanwhile
    if (key_lo < key_hi) {
        const i64 n = key_hi - key_lo;
        const int staged = n < LN::keys ? (int)n : LN::keys;
        lanes_stage<T, D, DV, LN>(ks, vs, kp, vp, stride_of<2, K>, stride_of<2, V>, key_lo, staged);
    }
    const auto len = kv_length<TK>(lens, bi);
    bool bad = false;  // a length out of range: reported, no key seen
    if constexpr (is_present<L>::value) {
        bad = len < 0 || len > TK;
        if (bad && threadIdx.x == 0) fail(a, DATA, blockIdx.x, tid, t.op, len, TK, 2, 0);
    }
    const i64 pn = APPEND ? query_position(qpos, bi, t.lo[2]) : -1;  // (the append form: one query)
    lanes_queries<S, LN>(t, qs, kn, vn, q, pn, app);
    // the warp's rows (rg + RowSplit x) and their visible keys
    const bool computes = warp < LN::warps;
    float m[R], l[R], acc[R][VPL];
    i64 begin[R], end[R];
#pragma unroll
    for (int x = 0; x < R; ++x) {
        const int r = rg + LN::row_split * x;
        m[x] = neg_inf();
        l[x] = 0.0f;
#pragma unroll
        for (int c = 0; c < VPL; ++c) acc[x][c] = 0.0f;
        begin[x] = end[x] = 0;
        if (computes && r < nrows && !bad) visible_keys<S>(qpos, bi, t.lo[2] + r % nq, len, begin[x], end[x]);
    }
    for (i64 s0 = key_lo; s0 < key_hi; s0 += LN::keys) {
        if (s0 > key_lo) {  // a later stage (whole-range attention): the last one's keys all read
            ml::block_sync();
            const i64 n = key_hi - s0;
            const int staged = n < LN::keys ? (int)n : LN::keys;
            lanes_stage<T, D, DV, LN>(ks, vs, kp, vp, stride_of<2, K>, stride_of<2, V>, s0, staged);
        }
        cp_async_wait<0>();
        ml::block_sync();
        if (!computes) continue;
        lanes_keys<S, LN, APPEND>(t, scale, mask, qs, ks, vs, kn, vn, ps, s0, key_hi, pn, nrows, begin, end, m, l,
                                  acc);
    }
    lanes_merge<S, Chunk, LN>(t, out, part, computes, rg, nrows, m, l, acc);
}

}  // namespace ml

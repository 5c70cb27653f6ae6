// megaloop/attention.cuh: attention tiles on tensor cores (mma.sync m16n8k16, sm_80 and later), the
// FlashAttention-2 scheme inside one tile: the tile's query heads (which share one kv head) times its
// block of queries, against every key some query of the tile sees.
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
#pragma once
#include "megaloop/mma.cuh"
#include "megaloop/types.cuh"
#include "megaloop/vec.cuh"

namespace ml {

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
    for (int c = threadIdx.x; c < ATT_BK * CHUNKS; c += blockDim.x) {
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
template <typename T, int D, int SPLIT, typename Range, typename Store>
__device__ __forceinline__ void attention_mma(const T* q, i64 q_head, i64 q_row, int nh, int nq, const T* k, i64 k_row,
                                              const T* v, i64 v_row, int tk, float scale_log2, void* smem,
                                              Range range, Store store) {
    static_assert(D % 16 == 0 && D <= 128, "head dimensions of 16..128 in steps of 16");
    static_assert(SPLIT == 1 || SPLIT == 2, "a unit's keys over one or two warps");
    constexpr int LD = D + 8, KS = D / 16, NT = ATT_BK / 8, DT = D / 8;
    T* sk = reinterpret_cast<T*>(smem);  // [2][SPLIT][ATT_BK][LD]
    T* sv = sk + 2 * SPLIT * ATT_BK * LD;  // [2][SPLIT][ATT_BK][LD]
    int* ranges = reinterpret_cast<int*>(sv + 2 * SPLIT * ATT_BK * LD);  // [warps][2]
    const int warps = blockDim.x >> 5, warp_id = threadIdx.x >> 5, lane = threadIdx.x & 31;
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
        __syncthreads();
        int block_lo = (int)tk, block_hi = 0;
        for (int w = 0; w < warps; ++w) {
            if (ranges[2 * w] < ranges[2 * w + 1]) {
                block_lo = min(block_lo, ranges[2 * w]);
                block_hi = max(block_hi, ranges[2 * w + 1]);
            }
        }
        __syncthreads();  // ranges[] is rewritten next round
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
            __syncthreads();
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
                        s[n][e] = seen ? s[n][e] * scale_log2 : NEG;
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
            __syncthreads();  // every warp is done with this stage before the next block refills it
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
            __syncthreads();
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

}  // namespace ml

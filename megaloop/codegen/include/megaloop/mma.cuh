// megaloop/mma.cuh: matmul tiles on tensor cores (sm_80 and later): mma.sync.m16n8k16 with 16-bit
// inputs and float32 accumulation, operands staged through shared memory by cp.async in three stages
// (two K slices loading while one multiplies), fragments read with ldmatrix.
//
// It computes C[i, j] = sum_k A[i, k] * B[j, k] for a rows x cols tile where both A's rows and B's
// columns are contiguous in K: row-major activations times weights stored [out, in], the layout
// checkpoints use. The generator (megaloop/codegen/emit_matmul.py) picks it only then, with K a
// multiple of 8 and 16-byte aligned rows, and falls back to the SIMT paths otherwise.
//
// Fragment layouts are those of the PTX ISA for mma.m16n8k16 (.row.col), with g = lane / 4 and
// q = lane % 4: A registers hold rows g and g + 8, columns 2q, 2q + 1 (and + 8); B registers hold
// column g, rows 2q, 2q + 1 (and + 8); C holds rows g and g + 8, columns 2q and 2q + 1. A shared
// memory row is BK + 8 elements (80 bytes): the 8 rows an ldmatrix phase reads fall in distinct banks,
// and every 16-byte cp.async destination and ldmatrix row address is aligned.
#pragma once
#include "megaloop/types.cuh"
#include "megaloop/vec.cuh"  // cp.async

namespace ml {

__device__ __forceinline__ void mma_16816(float* c, const u32* a, const u32* b, bf16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void mma_16816(float* c, const u32* a, const u32* b, f16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

constexpr int MMA_BK = 32;  // K slice per stage
constexpr int MMA_LD = MMA_BK + 8;  // shared memory row, in elements
// mma_tile<T, BM, BN, ...> needs MMA_STAGES * (BM + BN) * MMA_LD * 2 bytes of shared memory (A and B
// slices per stage); megaloop/codegen/emit_matmul.py sizes the kernel's dynamic shared memory with it.

// Stage one BK slice of rows [0, rows) of X (row stride ld, K contiguous) into s[0..R).
template <typename T, int R>
__device__ __forceinline__ void mma_stage(T* s, const T* x, i64 ld, int rows, int k0, int K) {
    // Precondition (emit_matmul.py checks it): K % 8 == 0, rows 16-byte aligned, so a chunk is either
    // whole or past K. Chunk c goes to row (c / 32) * 8 + c % 8, column 8 ((c / 8) % 4): the 8 threads
    // of a shared-memory phase write 8 different rows of one column, distinct banks at 80-byte rows.
    static_assert(MMA_BK / 8 == 4 && R % 8 == 0, "the chunk order assumes 4 chunks per row, rows in eights");
    for (int c = threadIdx.x; c < R * 4; c += ml::block_threads()) {
        const int r = (c >> 5) * 8 + (c & 7), kc = ((c >> 3) & 3) * 8;
        const bool ok = r < rows && k0 + kc < K;
        cp_async16(s + r * MMA_LD + kc, ok ? x + (i64)r * ld + k0 + kc : x, ok);
    }
}

// Fragments from shared memory with ldmatrix (one instruction loads what four 32-bit loads would):
// each lane gives the address of one 8-element row of one of the 8 x 8 matrices, lane l of matrix
// l / 8 (PTX ISA, ldmatrix), and receives two elements (row lane / 4, columns 2 (lane % 4) + {0, 1})
// of every matrix, which is exactly the mma.m16n8k16 fragment layout:
//   A 16 x 16 at `a` (rows MMA_LD apart): matrices (rows 0-7, k 0-7), (8-15, 0-7), (0-7, 8-15),
//   (8-15, 8-15) = a0..a3: lane l points at row l % 16, column 8 (l / 16);
//   B for two n8 tiles at `b` (n rows MMA_LD apart, k contiguous): (n 0-7, k 0-7), (0-7, 8-15),
//   (8-15, 0-7), (8-15, 8-15) = b0, b1 of the first tile, b0, b1 of the second: lane l points at
//   n row (l % 8) + 8 (l / 16), column 8 ((l / 8) % 2). The x2 form (one n8 tile) reads lanes 0-15.
// Four 8 x 8 matrices from this lane's row address `at` (a shared-space address); .trans delivers
// each transposed.
__device__ __forceinline__ void ldmatrix_x4(u32* r, u32 at) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(at)
                 : "memory");  // reads what cp.async wrote: not to be moved across the barrier
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32* r, u32 at) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(at)
                 : "memory");  // reads what cp.async wrote: not to be moved across the barrier
}
template <typename T>
__device__ __forceinline__ void ldmatrix_a(u32* r, const T* a, int lane) {
    ldmatrix_x4(r, shared_address(a + (lane & 15) * MMA_LD + (lane >> 4) * 8));
}
template <typename T>
__device__ __forceinline__ void ldmatrix_b2(u32* r, const T* b, int lane) {  // two n8 tiles: r[0..3]
    ldmatrix_x4(r, shared_address(b + ((lane & 7) + ((lane >> 4) << 3)) * MMA_LD + ((lane >> 3) & 1) * 8));
}
template <typename T>
__device__ __forceinline__ void ldmatrix_b1(u32* r, const T* b, int lane) {  // one n8 tile: r[0..1]
    const u32 at = shared_address(b + (lane & 7) * MMA_LD + ((lane >> 3) & 1) * 8);
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];" : "=r"(r[0]), "=r"(r[1]) : "r"(at)
                 : "memory");  // reads what cp.async wrote: not to be moved across the barrier
}

constexpr int MMA_STAGES = 3;  // K slices in flight: two loading while one multiplies
constexpr int MMA_MAX_FRAGMENTS = 32;  // 16 x 8 accumulator fragments per warp: 128 registers

// One rows x cols output tile (any size: BM x BN sub-tiles in turn, edges masked) with the block's
// WM x WN warps, each computing FM x FN fragments of 16 x 8. store(i, j, value) writes C[i, j].
// Pipeline: slice s lives in stage s % MMA_STAGES. Each step waits until its own copies of slice s
// landed (wait_group: all but the newest MMA_STAGES - 2 groups), then one barrier makes everyone's
// copies visible AND says every warp is done with the previous step's stage, which is the one the
// next load (slice s + MMA_STAGES - 1) overwrites. Every step commits a group, empty or not, so the
// count stays uniform.
template <typename T, int BM, int BN, int WM, int WN, typename Store>
__device__ __forceinline__ void mma_tile(const T* A, i64 lda, const T* B, i64 ldb, int rows, int cols, int K,
                                         void* smem, Store store) {
    constexpr int FM = BM / 16 / WM, FN = BN / 8 / WN;
    static_assert(FM * WM * 16 == BM && FN * WN * 8 == BN, "the warp grid must cover the tile exactly");
    static_assert(FM * FN <= MMA_MAX_FRAGMENTS, "too many accumulators per warp: they would spill");
    constexpr int S = MMA_STAGES;
    T* sA = reinterpret_cast<T*>(smem);  // [S][BM][MMA_LD]
    T* sB = sA + S * BM * MMA_LD;  // [S][BN][MMA_LD]
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wm = warp / WN, wn = warp % WN, g = lane >> 2, q = lane & 3;
    const int slices = (K + MMA_BK - 1) / MMA_BK;
    for (int r0 = 0; r0 < rows; r0 += BM) {
        for (int c0 = 0; c0 < cols; c0 += BN) {
            const T* a = A + (i64)r0 * lda;
            const T* b = B + (i64)c0 * ldb;
            const int nr = rows - r0 < BM ? rows - r0 : BM, nc = cols - c0 < BN ? cols - c0 : BN;
            float acc[FM][FN][4];
#pragma unroll
            for (int i = 0; i < FM; ++i)
#pragma unroll
                for (int j = 0; j < FN; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;
#pragma unroll
            for (int st = 0; st < S - 1; ++st) {
                if (st < slices) {
                    mma_stage<T, BM>(sA + st * BM * MMA_LD, a, lda, nr, st * MMA_BK, K);
                    mma_stage<T, BN>(sB + st * BN * MMA_LD, b, ldb, nc, st * MMA_BK, K);
                }
                cp_async_commit();
            }
            for (int s = 0; s < slices; ++s) {
                cp_async_wait<S - 2>();
                ml::block_sync();
                const int next = s + S - 1;
                if (next < slices) {
                    mma_stage<T, BM>(sA + (next % S) * BM * MMA_LD, a, lda, nr, next * MMA_BK, K);
                    mma_stage<T, BN>(sB + (next % S) * BN * MMA_LD, b, ldb, nc, next * MMA_BK, K);
                }
                cp_async_commit();
                const T* as = sA + (s % S) * BM * MMA_LD + (wm * FM * 16) * MMA_LD;
                const T* bs = sB + (s % S) * BN * MMA_LD + (wn * FN * 8) * MMA_LD;
#pragma unroll
                for (int ks = 0; ks < MMA_BK; ks += 16) {
                    u32 af[FM][4], bf[FN][2];
#pragma unroll
                    for (int i = 0; i < FM; ++i) ldmatrix_a(af[i], as + i * 16 * MMA_LD + ks, lane);
#pragma unroll
                    for (int j = 0; j + 1 < FN; j += 2) {
                        u32 r[4];
                        ldmatrix_b2(r, bs + j * 8 * MMA_LD + ks, lane);
                        bf[j][0] = r[0];
                        bf[j][1] = r[1];
                        bf[j + 1][0] = r[2];
                        bf[j + 1][1] = r[3];
                    }
                    if (FN % 2) ldmatrix_b1(bf[FN - 1], bs + (FN - 1) * 8 * MMA_LD + ks, lane);
#pragma unroll
                    for (int i = 0; i < FM; ++i)
#pragma unroll
                        for (int j = 0; j < FN; ++j) mma_16816(acc[i][j], af[i], bf[j], T{});
                }
            }
            cp_async_wait<0>();  // no copy may still land in shared memory the next sub-tile or task uses
            ml::block_sync();
#pragma unroll
            for (int i = 0; i < FM; ++i) {
#pragma unroll
                for (int j = 0; j < FN; ++j) {
                    const int r = wm * FM * 16 + i * 16 + g, c = wn * FN * 8 + j * 8 + 2 * q;
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int rr = r + (e >> 1) * 8, cc = c + (e & 1);
                        if (rr < nr && cc < nc) store(r0 + rr, c0 + cc, acc[i][j][e]);
                    }
                }
            }
        }
    }
}

// ---- tiles of at most 8 rows (a few tokens): the task's columns x K shared evenly by its warps -----
// One unit of the skinny walk: its two mmas (A's words `wa` and B's `wb` as the two k halves), and at
// the end of the warp's run of a group the sums into the group's partial-sum slot.
template <typename T, int S>
__device__ __forceinline__ void skinny_unit(float (&c)[4], const u32 (&wa)[4], const u32 (&wb)[4], int i, int last,
                                            float* partial, int warp, int lane) {
    const u32 a0[4] = {wa[0], 0u, wa[1], 0u}, b0[2] = {wb[0], wb[1]};
    mma_16816(c, a0, b0, T{});
    const u32 a1[4] = {wa[2], 0u, wa[3], 0u}, b1[2] = {wb[2], wb[3]};
    mma_16816(c, a1, b1, T{});
    if (i % S == S - 1 || i == last) {  // the end of this warp's run of a group
        float* out = partial + (i / S + warp) * 64 + 2 * lane;
        out[0] = c[0];
        out[1] = c[1];
        c[0] = c[1] = c[2] = c[3] = 0.0f;
    }
}

// C[r][n] = sum_k A[r][k] * B[n][k] for rows r < nr <= 8 (rows 8-15 of the m16 fragment are zeros)
// and columns n < ncols of B from `b` (ldb apart). The work is G = ceil(ncols / 8) groups of 8 columns
// x S slices of 32 K elements: L = G S units in group-major order, warp w of W taking units
// [w L / W, (w + 1) L / W). So every warp streams the same share of the weights whatever the column
// count (a warp per group left 2 of 8 warps idle on 48-column decode tiles, and a second round of groups
// on 88-column ones). Any assignment of K indices to an mma's 16 k slots is right as long as A and B
// use the same one; this one gives lane (g, q) = (lane / 4, lane % 4) the slots 2q, 2q + 1, 2q + 8,
// 2q + 9 of two mmas from its 16-byte loads of A row g and B row (column) g at 32 s + 8q: k 8q..8q+3
// to the first, 8q+4..8q+7 to the second. So the loads feed the fragments directly (no shared memory
// for operands, no ldmatrix), as 32-bit words (load_words), in two rounds of U units a lane: each round
// multiplies while the other's loads are in flight, and no register copy joins them (a copy at the end
// of each round waited for the loads just issued). Rows and columns past the tile read a real row and their results are dropped. At the end
// of each group's run of units a warp writes its sums (c[0], c[1] = row g, columns 2q, 2q + 1; c[2],
// c[3] are the zero rows) to partial[(group + w) 64 + 2 lane + 0/1]; skinny_sums adds them up. (Slot
// group + w is the run's own: where warp w - 1 reaches into group + 1, warp w starts past group. So
// G + W - 1 slots, 256 bytes each, whatever the tile's width.)
// STREAM: B is read under the L2 evict_first policy (weights streamed once a step).
template <typename T, int S, int U, bool STREAM>
__device__ __forceinline__ void mma_skinny(const T* a, i64 lda, int nr, const T* b, i64 ldb, int ncols, int lo,
                                           int hi, float* partial, int warp, int W) {
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    if (lo >= hi) return;  // (fewer units than warps)
    const u64 policy = STREAM ? evict_first_policy() : 0;
    const T* ar = a + (i64)min(g, nr - 1) * lda + 8 * q;
    const int last = hi - 1;
    auto load = [&](u32 (&wa)[4], u32 (&wb)[4], int i) {  // unit i's A and B (past the last unit: the last again)
        i = min(i, last);
        load_words(wa, ar + 32 * (i % S));
        const T* p = b + (i64)min(8 * (i / S) + g, ncols - 1) * ldb + 8 * q + 32 * (i % S);  // column 8 (i / S) + g
        if constexpr (STREAM)
            load_words_policy(wb, p, policy);
        else
            load_words(wb, p);
    };
    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    // two rounds of U units, each multiplied while the other is in flight (no copies between them)
    u32 a0[U][4], b0[U][4], a1[U][4], b1[U][4];
#pragma unroll
    for (int u = 0; u < U; ++u) load(a0[u], b0[u], lo + u);
    for (int i0 = lo; i0 < hi; i0 += 2 * U) {
#pragma unroll
        for (int u = 0; u < U; ++u) load(a1[u], b1[u], i0 + U + u);
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (i0 + u < hi) skinny_unit<T, S>(c, a0[u], b0[u], i0 + u, last, partial, warp, lane);
        if (i0 + U >= hi) break;
#pragma unroll
        for (int u = 0; u < U; ++u) load(a0[u], b0[u], i0 + 2 * U + u);
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (i0 + U + u < hi) skinny_unit<T, S>(c, a1[u], b1[u], i0 + U + u, last, partial, warp, lane);
    }
}

// After a barrier over the warps that ran mma_skinny on a task of L = G S units: this lane's two sums
// of group `group` (row lane / 4, columns 2 (lane % 4) + 0/1): the partial sums of the warps whose
// units meet the group, added in warp order (the same bits every run).
__device__ __forceinline__ void skinny_sums(const float* partial, int group, int S, int L, int W, float& c0,
                                            float& c1) {
    const int lane = threadIdx.x & 31;
    c0 = c1 = 0.0f;
    for (int w = 0; w < W; ++w) {
        const int lo = w * L / W, hi = (w + 1) * L / W;
        if (lo < hi && lo < (group + 1) * S && hi > group * S) {
            const float* p = partial + (group + w) * 64 + 2 * lane;
            c0 += p[0];
            c1 += p[1];
        }
    }
}

}  // namespace ml

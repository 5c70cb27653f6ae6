// megaloop/mma.cuh: matmul tiles on tensor cores (sm_80 and later): mma.sync.m16n8k16 with 16-bit
// inputs and float32 accumulation, operands staged through shared memory by cp.async, two stages so
// that the next K slice loads while this one multiplies.
//
// It computes C[i, j] = sum_k A[i, k] * B[j, k] for a rows x cols tile where both A's rows and B's
// columns are contiguous in K: row-major activations times weights stored [out, in], the layout
// checkpoints use. The generator (megaloop/codegen/emit_matmul.py) picks it only then, with K a
// multiple of 8 and 16-byte aligned rows, and falls back to the SIMT paths otherwise.
//
// Fragment layouts are those of the PTX ISA for mma.m16n8k16 (.row.col), with g = lane / 4 and
// q = lane % 4: A registers hold rows g and g + 8, columns 2q, 2q + 1 (and + 8); B registers hold
// column g, rows 2q, 2q + 1 (and + 8); C holds rows g and g + 8, columns 2q and 2q + 1. A shared
// memory row is BK + 8 elements (80 bytes), which keeps the 32-bit fragment loads free of bank
// conflicts and every 16-byte cp.async destination aligned.
#pragma once
#include "megaloop/types.cuh"

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

__device__ __forceinline__ u32 shared_address(const void* p) {
    u64 a;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
    return (u32)a;
}
// 16 bytes global -> shared without passing through registers; zeros when !valid (src not read).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(shared_address(dst)), "l"(src),
                 "r"(valid ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

constexpr int MMA_BK = 32;  // K slice per stage
constexpr int MMA_LD = MMA_BK + 8;  // shared memory row, in elements
// mma_tile<T, BM, BN, ...> needs 2 * (BM + BN) * MMA_LD * 2 bytes of shared memory (two stages of A
// and B slices); megaloop/codegen/emit_matmul.py sizes the kernel's dynamic shared memory with it.

// Stage one BK slice of rows [0, rows) of X (row stride ld, K contiguous) into s[0..R).
template <typename T, int R>
__device__ __forceinline__ void mma_stage(T* s, const T* x, i64 ld, int rows, int k0, int K) {
    constexpr int CHUNKS = MMA_BK / 8;  // 16-byte chunks per row
    for (int c = threadIdx.x; c < R * CHUNKS; c += blockDim.x) {
        const int r = c / CHUNKS, kc = (c % CHUNKS) * 8;
        const bool ok = r < rows && k0 + kc < K;
        cp_async16(s + r * MMA_LD + kc, ok ? x + (i64)r * ld + k0 + kc : x, ok);
    }
}

// One rows x cols output tile (any size: BM x BN sub-tiles in turn, edges masked) with the block's
// WM x WN warps, each computing FM x FN fragments of 16 x 8. store(i, j, value) writes C[i, j].
template <typename T, int BM, int BN, int WM, int WN, typename Store>
__device__ __forceinline__ void mma_tile(const T* A, i64 lda, const T* B, i64 ldb, int rows, int cols, int K,
                                         void* smem, Store store) {
    constexpr int FM = BM / 16 / WM, FN = BN / 8 / WN;
    static_assert(FM * WM * 16 == BM && FN * WN * 8 == BN, "the warp grid must cover the tile exactly");
    T* sA = reinterpret_cast<T*>(smem);  // [2][BM][MMA_LD]
    T* sB = sA + 2 * BM * MMA_LD;  // [2][BN][MMA_LD]
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
            mma_stage<T, BM>(sA, a, lda, nr, 0, K);
            mma_stage<T, BN>(sB, b, ldb, nc, 0, K);
            cp_async_commit();
            for (int s = 0; s < slices; ++s) {
                if (s + 1 < slices) {  // next slice into the other stage, then wait for this one only
                    const int o = (s + 1) & 1;
                    mma_stage<T, BM>(sA + o * BM * MMA_LD, a, lda, nr, (s + 1) * MMA_BK, K);
                    mma_stage<T, BN>(sB + o * BN * MMA_LD, b, ldb, nc, (s + 1) * MMA_BK, K);
                    cp_async_commit();
                    cp_async_wait<1>();
                } else {
                    cp_async_wait<0>();
                }
                __syncthreads();
                const T* as = sA + (s & 1) * BM * MMA_LD + (wm * FM * 16 + g) * MMA_LD + 2 * q;
                const T* bs = sB + (s & 1) * BN * MMA_LD + (wn * FN * 8 + g) * MMA_LD + 2 * q;
#pragma unroll
                for (int ks = 0; ks < MMA_BK; ks += 16) {
                    u32 af[FM][4], bf[FN][2];
#pragma unroll
                    for (int i = 0; i < FM; ++i) {
                        const T* p = as + i * 16 * MMA_LD + ks;
                        af[i][0] = *reinterpret_cast<const u32*>(p);
                        af[i][1] = *reinterpret_cast<const u32*>(p + 8 * MMA_LD);
                        af[i][2] = *reinterpret_cast<const u32*>(p + 8);
                        af[i][3] = *reinterpret_cast<const u32*>(p + 8 * MMA_LD + 8);
                    }
#pragma unroll
                    for (int j = 0; j < FN; ++j) {
                        const T* p = bs + j * 8 * MMA_LD + ks;
                        bf[j][0] = *reinterpret_cast<const u32*>(p);
                        bf[j][1] = *reinterpret_cast<const u32*>(p + 8);
                    }
#pragma unroll
                    for (int i = 0; i < FM; ++i)
#pragma unroll
                        for (int j = 0; j < FN; ++j) mma_16816(acc[i][j], af[i], bf[j], T{});
                }
                __syncthreads();  // this stage is overwritten by the load two slices on
            }
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

}  // namespace ml

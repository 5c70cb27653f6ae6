// megaloop/wgmma.cuh: matmul tiles on Hopper's warpgroup tensor cores (sm_90a: wgmma.mma_async), for
// the same operands as megaloop/mma.cuh: C[i, j] = sum_k A[i, k] * B[j, k], A's rows and B's columns
// contiguous in K, 16-bit inputs, float32 accumulation.
//
// A block of WGS warpgroups computes BM x BN sub-tiles, BM = 64 WGS: warpgroup w owns rows
// [64 w, 64 w + 64) and all BN columns (BN / 2 accumulators a thread). Both operands are staged in
// shared memory by every thread with cp.async, K slices of WG_BK = 64 elements (one 128-byte row per
// matrix row), in the 128-byte swizzled layout wgmma reads: 16-byte chunk j of row r lives at
// r * 128 + ((j ^ (r % 8)) * 16), so 8 rows form a 1024-byte atom and consecutive atoms are 1024 bytes
// apart (the descriptors' stride). The k16 steps inside a slice advance the descriptors' start
// address by 32 bytes: the hardware applies the swizzle to the address, which is why stages start on
// 1024-byte boundaries.
//
// Pipeline over S stages, slices prefetched S - 2 ahead. Step s: wait for this thread's copies of slice
// s, fence them to the async proxy (wgmma reads shared memory through it), barrier (everyone's copies
// visible, and every warpgroup past its wait for slice s - 2's wgmmas), refill slice s - 2's stage with
// slice s + S - 2, issue slice s's wgmmas and wait until only they are in flight (slice s - 1 done).
// So four stages hold slices s - 1 (possibly still read), s, s + 1 and s + 2 (landing).
#pragma once
#include "megaloop/types.cuh"
#include "megaloop/vec.cuh"  // cp.async, shared_address
#include "megaloop/wgmma_ops.cuh"

namespace ml {

constexpr int WG_BK = 64;  // K slice per stage: 128 bytes of 16-bit elements, one swizzle row

// Shared memory one wgmma_tile<T, BN, WGS, S> needs (plus up to 1023 bytes to align the stages).
__host__ __device__ constexpr int wgmma_shared_bytes(int bn, int wgs, int stages) { return stages * (64 * wgs + bn) * WG_BK * 2 + 1024; }

// Matrix descriptor of a K-major operand in the 128-byte swizzled layout at shared address `at`:
// start address >> 4 (bits 0-13), leading byte offset 16 >> 4 (unused by swizzled K-major layouts,
// set as CUTLASS does), stride byte offset 1024 >> 4 (bits 32-45: the next 8 rows), swizzle mode 1
// = 128 bytes (bits 62-63). Base offset 0: stages are 1024-byte aligned.
__device__ __forceinline__ u64 wgmma_desc(u32 at) {
    return (u64)((at & 0x3FFFF) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// The accumulators are written by wgmmas in flight: keep the compiler from moving their reads and
// writes across the points where the asynchronous instructions are issued and waited for.
template <int R>
__device__ __forceinline__ void wgmma_fence_registers(float* d) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// cp.async's writes are made by the generic proxy; wgmma reads through the async proxy.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Stage one WG_BK slice of rows [0, rows) of X (row stride ld, K contiguous, K % 8 == 0, rows 16-byte
// aligned: a chunk is whole or past K) into the swizzled R x 64 layout at `s`; zeros past rows and K.
// Eight consecutive threads copy one row's 128 contiguous bytes; THREADS (the block) divides the chunks,
// so the loop unrolls into R * 8 / THREADS copies a thread.
template <typename T, int R, int THREADS>
__device__ __forceinline__ void wgmma_stage(char* s, const T* x, i64 ld, int rows, int k0, int K) {
    static_assert(R * 8 % THREADS == 0, "every thread copies the same number of chunks");
#pragma unroll
    for (int i = 0; i < R * 8 / THREADS; ++i) {
        const int c = threadIdx.x + i * THREADS, r = c >> 3, j = c & 7, k = k0 + j * 8;
        const bool ok = r < rows && k < K;
        cp_async16(s + r * 128 + ((j ^ (r & 7)) << 4), ok ? x + (i64)r * ld + k : x, ok);
    }
}

// One rows x cols output tile (BM x BN sub-tiles in turn, edges masked) with WGS warpgroups (compute threads
// == 128 WGS) and S stages at `smem` (wgmma_shared_bytes(BN, WGS, S) bytes). store(i, j, value) writes
// C[i, j]. A warpgroup's accumulators follow wgmma's D layout: warp w % 4 of the group holds rows
// 16 (w % 4) + g and + 8 (g = lane / 4), and d[4 n + e] is column 8 n + 2 (lane % 4) + (e % 2) of row
// + 8 (e / 2).
template <typename T, int BN, int WGS, int S, typename Store>
__device__ __forceinline__ void wgmma_tile(const T* A, i64 lda, const T* B, i64 ldb, int rows, int cols, int K,
                                           void* smem, Store store) {
    constexpr int BM = 64 * WGS, A_BYTES = BM * WG_BK * 2, STAGE = A_BYTES + BN * WG_BK * 2;
    static_assert(BN == 64 || BN == 128 || BN == 256, "wgmma tiles are 64, 128 or 256 columns wide");
    static_assert(S >= 3, "slices are prefetched S - 2 ahead");
    char* base = reinterpret_cast<char*>(smem) + ((1024 - (shared_address(smem) & 1023)) & 1023);
    const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    const int g = lane >> 2, q = lane & 3;
    const int slices = (K + WG_BK - 1) / WG_BK;
    for (int r0 = 0; r0 < rows; r0 += BM) {
        for (int c0 = 0; c0 < cols; c0 += BN) {
            const T* a = A + (i64)r0 * lda;
            const T* b = B + (i64)c0 * ldb;
            const int nr = rows - r0 < BM ? rows - r0 : BM, nc = cols - c0 < BN ? cols - c0 : BN;
            float d[BN / 2];
#pragma unroll
            for (int i = 0; i < BN / 2; ++i) d[i] = 0.0f;
#pragma unroll
            for (int st = 0; st < S - 2; ++st) {
                if (st < slices) {
                    wgmma_stage<T, BM, 128 * WGS>(base + st * STAGE, a, lda, nr, st * WG_BK, K);
                    wgmma_stage<T, BN, 128 * WGS>(base + st * STAGE + A_BYTES, b, ldb, nc, st * WG_BK, K);
                }
                cp_async_commit();
            }
            for (int s = 0; s < slices; ++s) {
                cp_async_wait<S - 3>();  // this thread's copies of slice s (later slices may be in flight)
                fence_proxy_async();
                ml::block_sync();
                const int next = s + S - 2;  // into slice s - 2's stage, whose wgmmas every group waited for
                if (next < slices) {
                    wgmma_stage<T, BM, 128 * WGS>(base + (next % S) * STAGE, a, lda, nr, next * WG_BK, K);
                    wgmma_stage<T, BN, 128 * WGS>(base + (next % S) * STAGE + A_BYTES, b, ldb, nc, next * WG_BK, K);
                }
                cp_async_commit();  // every step commits a group, empty or not: the wait count stays uniform
                const u32 sa = shared_address(base + (s % S) * STAGE) + wg * 64 * WG_BK * 2;
                const u32 sb = shared_address(base + (s % S) * STAGE + A_BYTES);
                wgmma_fence_registers<BN / 2>(d);
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < WG_BK / 16; ++kk) Wgmma<T, BN>::mma(d, wgmma_desc(sa + 32 * kk), wgmma_desc(sb + 32 * kk));
                wgmma_commit();
                wgmma_wait<1>();
                wgmma_fence_registers<BN / 2>(d);
            }
            wgmma_wait<0>();
            wgmma_fence_registers<BN / 2>(d);
            cp_async_wait<0>();  // no copy may still land in shared memory the next sub-tile or task uses
            ml::block_sync();  // ... nor a wgmma still read it
            const int row = 64 * wg + 16 * warp + g;
#pragma unroll
            for (int n = 0; n < BN / 8; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int rr = row + 8 * (e >> 1), cc = 8 * n + 2 * q + (e & 1);
                    if (rr < nr && cc < nc) store(r0 + rr, c0 + cc, d[4 * n + e]);
                }
            }
        }
    }
}

}  // namespace ml

// megaloop/stage.cuh: a decode matmul tile's weights copied into shared memory by the copy engine
// (cp.async.bulk, sm_90 and later) while the task still waits for its producers.
//
// A decode tile streams its block of weights through each warp's loads, bound by what one processor
// keeps in flight (~28 GB/s a processor on an H200: scripts/decode_matmuls.py) and only once its
// producers are done. Weights never change while the kernel runs, so warp 2 can start copying the
// block as soon as the task comes up, during the wait; the tile then reads it from shared memory.
// One mbarrier per block counts the bytes (expect_tx by the issuing lane, complete_tx by the copies);
// every use completes one phase, and the tile waits on that phase's parity (ml_stage_parity, flipped
// once all threads are past the wait). The generated code declares the block's barrier state
// (megaloop/codegen/kernel.py) only when some op stages its weights (the matmul tile switch
// stage_weights).
#pragma once
#include "megaloop/loop.cuh"

namespace ml {

__device__ __forceinline__ u32 smem_address(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// Thread 0, once before the task loop.
__device__ __forceinline__ void stage_init(u64* bar) {
#if __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_address(bar)) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}

// Every thread, after its task and before the barrier that ends it: its ordinary stores to shared
// memory are ordered before the copy engine's writes that the next task may issue there (a proxy fence
// orders only its own thread's accesses, and no barrier carries it to another thread).
__device__ __forceinline__ void stage_fence() {
#if __CUDA_ARCH__ >= 900
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

// The lanes of one warp: copy `rows` rows of `row_bytes` each (16-byte multiples, 16-byte aligned) from
// `src` (rows `src_stride` bytes apart) to `dst` (rows `pitch` bytes apart), completing one phase of
// `bar` once all have landed. Below sm_90 there is no copy engine: a trap, never a silent no-op
// (megaloop/runtime/compile.py refuses such sources for those GPUs before they get here).
__device__ __forceinline__ void stage_rows(u64* bar, char* dst, int pitch, const char* src, i64 src_stride, int rows,
                                           int row_bytes) {
#if __CUDA_ARCH__ >= 900
    const int lane = threadIdx.x & 31;
    if (lane == 0)
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_address(bar)),
                     "r"((u32)rows * (u32)row_bytes)
                     : "memory");
    __syncwarp();
    for (int r = lane; r < rows; r += 32)
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                         smem_address(dst + (i64)r * pitch)),
                     "l"(src + (i64)r * src_stride), "r"((u32)row_bytes), "r"(smem_address(bar))
                     : "memory");
#else
    __trap();
#endif
}

__device__ __forceinline__ bool stage_done(u64* bar, u32 parity) {
#if __CUDA_ARCH__ >= 900
    u32 done;
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(smem_address(bar)), "r"(parity)
        : "memory");
    return done != 0;
#else
    __trap();
    return false;
#endif
}

// Every thread of the tile: wait until the staged weights have landed. True for every thread, or false
// for every thread (decided together at a barrier, so that all leave the tile or none does) if they have
// not within the timeout (after recording a watchdog error that names the task: counter -3 tells the
// host it was staged weights) or once any block gave up.
__device__ inline bool stage_wait(const Args& a, u64* bar, u32 parity, int proc, int tid, int op) {
    const u64 start = now_ns();
    bool ok = true;
    for (int spin = 0; !stage_done(bar, parity); ++spin) {
        if ((spin & 63) == 63) {
            if (aborted(a)) {
                ok = false;
                break;
            }
            if (now_ns() - start > a.timeout_ns) {
                if (threadIdx.x == 0) fail(a, WATCHDOG, proc, tid, op, -3, 0, 0, 0, a.rank);
                ok = false;
                break;
            }
        }
    }
    return !__syncthreads_or(!ok);
}

// Thread 0, leaving early (the block gave up) with copies in flight: let them land first (a copy into
// the shared memory of a block that has left is not allowed). Bounded: the copies only read memory.
__device__ inline void stage_drain(u64* bar, u32 parity) {
    const u64 start = now_ns();
    while (!stage_done(bar, parity) && now_ns() - start < 1000000ull) {
    }
}

}  // namespace ml

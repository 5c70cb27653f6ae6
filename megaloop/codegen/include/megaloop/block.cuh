// megaloop/block.cuh: the threads that run a block's tiles. A kernel with the ring's loader warp
// (megaloop/ring_loader.cuh, ML_COMPUTE_THREADS set) has one warp more that runs no tile: tiles count
// only the compute threads before it and meet at a named barrier of theirs (row groups use 1 .. 8).
#pragma once

namespace ml {

#ifdef ML_COMPUTE_THREADS
constexpr int COMPUTE_BARRIER = 15;
__device__ __forceinline__ constexpr unsigned block_threads() { return ML_COMPUTE_THREADS; }
__device__ __forceinline__ void block_sync() {
    asm volatile("bar.sync %0, %1;" ::"n"(COMPUTE_BARRIER), "n"(ML_COMPUTE_THREADS) : "memory");
}
#else
__device__ __forceinline__ unsigned block_threads() { return blockDim.x; }
__device__ __forceinline__ void block_sync() { __syncthreads(); }
#endif

}  // namespace ml

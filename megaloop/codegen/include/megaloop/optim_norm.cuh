// megaloop/optim_norm.cuh: the scalars of an optimizer step (megaloop/frontend/ops/optim_norm.py is the
// definition): sums of squares of ranges of a gradient's rows (a tile a range, for global-norm
// clipping) and the learning rate of the step counter's update. Plain C++ over megaloop/at.cuh and
// the load/store of megaloop/types.cuh, so the CPU shim of tests/test_sample_codegen.py runs it.
#pragma once

extern __shared__ float4 ml_smem4[];  // the dynamic shared memory

namespace ml {
namespace opt {

// out[i] = the sum of squares of x's rows [i * Per, min(Rows, (i + 1) * Per)) (Inner: x's extents after
// axis 0; X: x's strides, in its own index space), the whole block on each range of the box: each thread
// folds its elements in increasing order, then the warps in a fixed order (the same bits every run)
template <i64... D>
struct Dims {
    static constexpr int rank = sizeof...(D);
    static constexpr i64 inner = (D * ... * (i64)1);
    static constexpr i64 extent[sizeof...(D) + 1] = {D..., 1};
};
template <i64 Rows, i64 Per, bool Contiguous, class Inner, class O, class X>
__device__ __forceinline__ void square_sum(const Task& t, O out, X x) {
    static_assert(X::rank == Inner::rank + 1, "square_sum: x's strides and extents disagree");
    float* partial = reinterpret_cast<float*>(ml_smem4);  // a float a warp (the template asks 128 bytes)
    constexpr i64 inner = Inner::inner;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = ml::block_threads() >> 5;
    for (int r = t.lo[0]; r < t.hi[0]; ++r) {
        const i64 first = (i64)r * Per, last = first + Per < Rows ? first + Per : Rows;
        const i64 count = (last - first) * inner;
        float acc = 0.0f;
        for (i64 e = threadIdx.x; e < count; e += ml::block_threads()) {
            float v;
            if constexpr (Contiguous) {
                v = load(x.p + first * inner + e);
            } else {
                int i[X::rank];
                i[0] = (int)(first + e / inner);
                i64 rest = e % inner;
#pragma unroll
                for (int d = X::rank - 1; d >= 1; --d) {
                    i[d] = (int)(rest % Inner::extent[d - 1]);
                    rest /= Inner::extent[d - 1];
                }
                v = load(x.p + x.offset(i));
            }
            acc = fmaf(v, v, acc);
        }
        for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        if (lane == 0) partial[warp] = acc;
        ml::block_sync();
        if (warp == 0) {
            float s = lane < warps ? partial[lane] : 0.0f;
            for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
            if (lane == 0) store(out.p + out.offset(&r), s);
        }
        ml::block_sync();  // partial is the next range's
    }
}

// the learning rate of update s = c / K (from 0): warmup from 0, then Kind 0 constant, 1 linear, 2 cosine
// decay to min_lr at Total updates; in double, rounded once
template <class O, class C>
__device__ __forceinline__ void lr_schedule(const Task& t, O out, C counter, double lr, double min_lr, i64 warmup,
                                            i64 total, int kind, i64 k) {
    if (threadIdx.x != 0) return;
    const i64 c = load(counter.p), s = (c < 0 ? 0 : c) / k;
    double value = lr;
    if (s < warmup) {
        value = lr * (double)s / (double)warmup;
    } else if (kind != 0) {
        const double p = fmin(1.0, (double)(s - warmup) / (double)(total - warmup > 1 ? total - warmup : 1));
        const double decay = kind == 2 ? 0.5 * (1.0 + cos(3.141592653589793 * p)) : 1.0 - p;
        value = min_lr + (lr - min_lr) * decay;
    }
    store(out.p, (float)value);
}

}  // namespace opt
}  // namespace ml

// megaloop/loss.cuh: the cross-entropy's tiles (megaloop/frontend/ops/loss.py), a warp per row of
// logits: the row's max and sum of exponentials in one pass (online), never a probability stored.
#pragma once
#include "megaloop/elementwise.cuh"

namespace ml {

// The row's (max, sum of exp(x - max)) over its V logits XS apart, merged over the warp's lanes.
template <i64 V, i64 XS, class T>
__device__ __forceinline__ void row_logsumexp(const T* row, int lane, float& m, float& s) {
    m = neg_inf();
    s = 0.0f;
    for (i64 v = lane; v < V; v += 32) {
        const float x = load(row + v * XS);
        if (x > m) {
            s = (m == neg_inf() ? 0.0f : s * expf(m - x)) + 1.0f;
            m = x;
        } else if (x != neg_inf()) {
            s += expf(x - m);
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
        const float top = fmaxf(m, m2);
        s = (m == neg_inf() ? 0.0f : s * expf(m - top)) + (m2 == neg_inf() ? 0.0f : s2 * expf(m2 - top));
        m = top;
    }
}

// A row's target: ignore_index (false), or an id in [0, V) (true); any other is a data error.
template <i64 V, i64 Ignore>
__device__ __forceinline__ bool counted_target(const Args& a, const Task& t, int tid, i64 y) {
    if (y == Ignore) return false;
    if (y < 0 || y >= V) {
        fail(a, DATA, blockIdx.x, tid, t.op, y, V, 0, 0);
        return false;
    }
    return true;
}

// out[i] = logsumexp(logits[i, :]) - logits[i, target[i]] (0 where the target is Ignore); X's strides are
// the logits' leading axes, XS the stride along the vocabulary.
template <i64 V, i64 XS, i64 Ignore, class O, class X, class Y>
__device__ __forceinline__ void cross_entropy(const Args& a, const Task& t, int tid, O out, X x, Y y) {
    for_box_warps<O::rank>(t, [&](const int* i, int lane) {
        const auto* row = x.p + x.offset(i);
        float m, s;
        row_logsumexp<V, XS>(row, lane, m, s);
        const i64 target = load(y.p + y.offset(i));
        float loss = 0.0f;
        if (counted_target<V, Ignore>(a, t, tid, target)) loss = m + logf(s) - load(row + target * XS);
        if (lane == 0) store(out.p + out.offset(i), loss);
    });
}

// out[i, :] = (softmax(logits[i, :]) - onehot(target[i])) * cotangent[i] (zeros where the target is
// Ignore); O and X address the leading axes, OS and XS step along the vocabulary.
template <i64 V, i64 XS, i64 OS, i64 Ignore, int N, class O, class X, class Y, class C>
__device__ __forceinline__ void cross_entropy_grad(const Args& a, const Task& t, int tid, O out, X x, Y y, C c) {
    for_box_warps<N>(t, [&](const int* i, int lane) {
        const auto* row = x.p + x.offset(i);
        float m, s;
        row_logsumexp<V, XS>(row, lane, m, s);
        const i64 target = load(y.p + y.offset(i));
        const float scale = counted_target<V, Ignore>(a, t, tid, target) ? load(c.p + c.offset(i)) : 0.0f;
        const float inv = scale / s;
        auto* dst = out.p + out.offset(i);
        for (i64 v = lane; v < V; v += 32) {
            const float p = expf(load(row + v * XS) - m) * inv;
            store(dst + v * OS, v == target ? p - scale : p);
        }
    });
}

}  // namespace ml

// megaloop/optim.cuh: the optimizer's updates (megaloop/frontend/ops/optim.py is the definition), in
// place on parameter, moment and accumulation states over the task's box: megaloop/elementwise.cuh's
// loop with the tile's scalars (bias corrections, the update's number) computed once, in double.
// The gradients' squared norms and the learning rate: megaloop/optim_norm.cuh.
#pragma once
#include "megaloop/elementwise.cuh"

namespace ml {
namespace opt {

// The iteration with c micro-batches done before it, of cycles of K: it ends a cycle and updates
// (update), it starts one (first), and the update's number from 1 (t). A negative counter (refused as
// a data error by the reference) updates nothing.
struct Step {
    bool update, first;
    i64 t;
};
__device__ __forceinline__ Step step_of(i64 c, i64 k) {
    return {c >= 0 && (c + 1) % k == 0, c >= 0 && c % k == 0, (c + 1) / k};
}

// the value of a 0-d operand (a scalar the tile reads once)
template <class A>
__device__ __forceinline__ auto scalar(A x) {
    return load(x.p);
}

// buffer = grad where a cycle starts, else buffer + grad
template <int W, int U, class O, class B, class G, class C>
__device__ __forceinline__ void grad_accumulate(const Task& t, O out, B buffer, G grad, C counter, i64 k) {
    if (step_of(scalar(counter), k).first) {
        elementwise<W, U>(t, [](float g) { return g; }, out, grad);
    } else {
        elementwise<W, U>(t, [](float b, float g) { return b + g; }, out, buffer, grad);
    }
}

// state = beta * state + (1 - beta) * x, x = grad * scale (squared where Square), on updates
template <int W, int U, class O, class S, class G, class Sc, class C>
__device__ __forceinline__ void adam_moment(const Task& t, O out, S state, G grad, Sc scale, C counter,
                                            double beta, bool square, i64 k) {
    if (!step_of(scalar(counter), k).update) return;  // (the state stays as it is)
    const float b = (float)beta, a = (float)(1.0 - beta), s = scalar(scale);
    if (square) {
        elementwise<W, U>(t, [=](float m, float g) { const float x = g * s; return fmaf(b, m, a * (x * x)); },
                          out, state, grad);
    } else {
        elementwise<W, U>(t, [=](float m, float g) { return fmaf(b, m, a * (g * s)); }, out, state, grad);
    }
}

// param = param * (1 - lr wd) - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
template <int W, int U, class O, class P, class M, class V, class L, class C>
__device__ __forceinline__ void adamw_update(const Task& t, O out, P param, M m, V v, L lr, C counter,
                                             double beta1, double beta2, double eps, double wd, i64 k) {
    const Step st = step_of(scalar(counter), k);
    if (!st.update) return;
    const double l = scalar(lr);
    const float decay = (float)(1.0 - l * wd), step = (float)(l / (1.0 - pow(beta1, (double)st.t)));
    const float inv_bc2 = (float)(1.0 / sqrt(1.0 - pow(beta2, (double)st.t))), e = (float)eps;
    elementwise<W, U>(
        t, [=](float p, float m1, float v1) { return p * decay - step * m1 / fmaf(sqrtf(v1), inv_bc2, e); }, out,
        param, m, v);
}

// buf = d on the first update, else momentum * buf + (1 - dampening) * d; d = grad * scale + wd * param
template <int W, int U, class O, class B, class G, class P, class Sc, class C>
__device__ __forceinline__ void sgd_momentum(const Task& t, O out, B buf, G grad, P param, Sc scale, C counter,
                                             double momentum, double dampening, double wd, i64 k) {
    const Step st = step_of(scalar(counter), k);
    if (!st.update) return;
    const float mu = (float)momentum, a = (float)(1.0 - dampening), w = (float)wd, s = scalar(scale);
    if (st.t == 1) {
        elementwise<W, U>(t, [=](float g, float p) { return fmaf(w, p, g * s); }, out, grad, param);
    } else {
        elementwise<W, U>(
            t, [=](float b, float g, float p) { return fmaf(mu, b, a * fmaf(w, p, g * s)); }, out, buf, grad, param);
    }
}

// param -= lr * u: u = d (momentum 0), d + momentum * buf (Nesterov) or buf
template <int W, int U, class O, class P, class G, class B, class L, class Sc, class C>
__device__ __forceinline__ void sgd_update(const Task& t, O out, P param, G grad, B buf, L lr, Sc scale, C counter,
                                           double momentum, bool nesterov, double wd, i64 k) {
    if (!step_of(scalar(counter), k).update) return;
    const float l = scalar(lr), mu = (float)momentum, w = (float)wd, s = scalar(scale);
    if (momentum == 0.0) {
        elementwise<W, U>(t, [=](float p, float g) { return p - l * fmaf(w, p, g * s); }, out, param, grad);
    } else if (nesterov) {
        elementwise<W, U>(
            t, [=](float p, float g, float b) { return p - l * fmaf(mu, b, fmaf(w, p, g * s)); }, out, param, grad,
            buf);
    } else {
        elementwise<W, U>(t, [=](float p, float b) { return p - l * b; }, out, param, buf);
    }
}

}  // namespace opt
}  // namespace ml

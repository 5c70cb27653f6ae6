// megaloop/math.cuh: the scalar functions op expressions are written with (see OpDef.lowering).
//
// Each matches the numpy reference's rule where IEEE leaves a choice: maximum/minimum propagate
// NaN, relu keeps NaN, sigmoid never overflows.
#pragma once
#include "megaloop/types.cuh"

namespace ml {

__device__ __forceinline__ bool isnan_(float x) { return x != x; }

__device__ __forceinline__ float maximum(float a, float b) { return (a > b || isnan_(a)) ? a : b; }
__device__ __forceinline__ i64 maximum(i64 a, i64 b) { return a > b ? a : b; }
__device__ __forceinline__ float minimum(float a, float b) { return (a < b || isnan_(a)) ? a : b; }
__device__ __forceinline__ i64 minimum(i64 a, i64 b) { return a < b ? a : b; }
__device__ __forceinline__ float abs_(float a) { return fabsf(a); }
__device__ __forceinline__ i64 abs_(i64 a) { return a < 0 ? -a : a; }
__device__ __forceinline__ float relu(float a) { return (a > 0.0f || isnan_(a)) ? a : 0.0f; }
__device__ __forceinline__ i64 relu(i64 a) { return a > 0 ? a : 0; }
__device__ __forceinline__ float rsqrt_(float a) { return 1.0f / sqrtf(a); }  // two roundings, as the spec
__device__ __forceinline__ float sigmoid(float x) {
    const float e = expf(-fabsf(x));
    return x >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
}
__device__ __forceinline__ float silu(float x) { return x * sigmoid(x); }
// PyTorch's hard activations: relu6(x + 3) / 6 (NaN kept by maximum/minimum) and x times it
__device__ __forceinline__ float hardsigmoid(float x) { return minimum(maximum(x + 3.0f, 0.0f), 6.0f) / 6.0f; }
__device__ __forceinline__ float hardswish(float x) { return x * minimum(maximum(x + 3.0f, 0.0f), 6.0f) / 6.0f; }
__device__ __forceinline__ float gelu_erf(float x) {
    return (float)(0.5 * (double)x * (1.0 + erf((double)x * 0.70710678118654752440)));
}
__device__ __forceinline__ float gelu_tanh(float x) {
    const double d = x;
    return (float)(0.5 * d * (1.0 + tanh(0.79788456080286535588 * (d + 0.044715 * d * d * d))));
}
__device__ __forceinline__ float erf_(float x) { return (float)erf((double)x); }
// logit softcapping by c, the float32 whose bits are CapBits (0: none): c tanh(s / c); scores in
// log2 units (attention's tensor-core path) pass unit = log2(e), the same curve in those units
template <unsigned CapBits>
__device__ __forceinline__ float softcap(float s, float unit = 1.0f) {
    if constexpr (CapBits == 0u) {
        return s;
    } else {
        constexpr unsigned bits = CapBits;
        float c;
        memcpy(&c, &bits, sizeof c);
        return c * unit * tanhf(s / (c * unit));
    }
}

}  // namespace ml

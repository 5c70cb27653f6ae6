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
// numpy's power, floor_divide and remainder (megaloop/frontend/ops/elementwise.py). Integers: products
// wrap modulo 2^64 (the store keeps the dtype's low bits: numpy's wrap-around), a zero divisor gives 0
// (numpy's result, with its warning), x // -1 wraps at the smallest value; a negative exponent (a data
// error on the reference, numpy's ValueError) gives the quotient truncated: 0 unless |x| is 1.
__device__ __forceinline__ float power(float a, float b) { return powf(a, b); }
__device__ __forceinline__ i64 power(i64 a, i64 b) {
    if (b < 0) return a == 1 ? 1 : a == -1 ? ((b & 1) ? -1 : 1) : 0;
    unsigned long long r = 1, x = (unsigned long long)a;
    for (unsigned long long e = (unsigned long long)b; e != 0; e >>= 1, x *= x) {
        if (e & 1) r *= x;
    }
    return (i64)r;
}
__device__ __forceinline__ i64 floor_divide(i64 a, i64 b) {
    if (b == 0) return 0;
    if (b == -1) return (i64)(0ull - (unsigned long long)a);
    const i64 q = a / b;
    return (a % b != 0 && (a < 0) != (b < 0)) ? q - 1 : q;
}
__device__ __forceinline__ i64 remainder(i64 a, i64 b) {
    if (b == 0 || b == -1) return 0;
    const i64 r = a % b;
    return (r != 0 && (r < 0) != (b < 0)) ? r + b : r;
}
// floats: numpy's divmod in float32, step for step (fmod, then the quotient of the exact difference,
// corrected by the remainder's sign and rounded to the nearest integer below); b = 0: a / b and fmod
__device__ __forceinline__ float divmod_(float a, float b, float& mod) {
    mod = fmodf(a, b);
    if (b == 0.0f) return a / b;
    float div = (a - mod) / b;
    if (mod != 0.0f) {
        if ((b < 0.0f) != (mod < 0.0f)) {
            mod += b;
            div -= 1.0f;
        }
    } else {
        mod = copysignf(0.0f, b);
    }
    if (div == 0.0f) return copysignf(0.0f, a / b);
    float floordiv = floorf(div);
    if (div - floordiv > 0.5f) floordiv += 1.0f;
    return floordiv;
}
__device__ __forceinline__ float floor_divide(float a, float b) {
    float mod;
    return divmod_(a, b, mod);
}
__device__ __forceinline__ float remainder(float a, float b) {
    float mod;
    divmod_(a, b, mod);
    return mod;
}

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

// megaloop/types.cuh: element types and their conversions, with no CUDA header needed.
//
// NVRTC sees only what we give it, so 16-bit floats are plain 16-bit storage here and every
// conversion is one PTX instruction (round to nearest even). Arithmetic happens in a "compute"
// type: float for every float dtype, long long for integers, bool for masks (the numpy reference
// does the same, see megaloop/dtypes.py).
#pragma once
#include "megaloop/block.cuh"  // every header's tiles count and synchronise the compute threads

namespace ml {

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

__device__ __forceinline__ float pos_inf() { return __int_as_float(0x7f800000); }
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

struct bf16 { u16 bits; };
struct f16 { u16 bits; };

__device__ __forceinline__ float to_float(bf16 x) { return __uint_as_float(((u32)x.bits) << 16); }
__device__ __forceinline__ float to_float(f16 x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
}

// load: storage -> compute type
__device__ __forceinline__ float load(const float* p) { return *p; }
__device__ __forceinline__ float load(const bf16* p) { return to_float(*p); }
__device__ __forceinline__ float load(const f16* p) { return to_float(*p); }
__device__ __forceinline__ i64 load(const int* p) { return *p; }
__device__ __forceinline__ i64 load(const i64* p) { return *p; }
__device__ __forceinline__ bool load(const bool* p) { return *p; }

// store: compute type -> storage (one rounding)
__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(bf16* p, float v) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
    p->bits = h;
}
__device__ __forceinline__ void store(f16* p, float v) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    p->bits = h;
}
__device__ __forceinline__ void store(int* p, i64 v) { *p = (int)v; }  // wraps, as numpy does
__device__ __forceinline__ void store(i64* p, i64 v) { *p = v; }
__device__ __forceinline__ void store(bool* p, bool v) { *p = v; }

// v rounded to T as storing it would, back in compute type (fused_elementwise's intermediates)
template <class T, class V>
__device__ __forceinline__ auto stored(V v) {
    T s;
    store(&s, v);
    return load(&s);
}

// conversions between compute types (casts); float -> int is refused by the graph builder
__device__ __forceinline__ float to_compute_float(float v) { return v; }
__device__ __forceinline__ float to_compute_float(i64 v) { return (float)v; }  // via float32, as torch
__device__ __forceinline__ float to_compute_float(bool v) { return v ? 1.0f : 0.0f; }
__device__ __forceinline__ i64 to_compute_int(i64 v) { return v; }
__device__ __forceinline__ i64 to_compute_int(bool v) { return v ? 1 : 0; }
__device__ __forceinline__ bool to_compute_bool(float v) { return v != 0.0f; }
__device__ __forceinline__ bool to_compute_bool(i64 v) { return v != 0; }
__device__ __forceinline__ bool to_compute_bool(bool v) { return v; }

}  // namespace ml

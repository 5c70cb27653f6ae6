// megaloop/vec.cuh: packed loads and stores for the memory-bound fast paths.
//
// A Pack<T, N> is N consecutive elements moved with one load (16 bytes for N = 16 / sizeof(T)).
// The generated fast paths use it only where the code generator proved (strides, compile time) and
// the tile checked (alignment of its start, run time) that the elements are consecutive and aligned;
// everything else takes the per-element path.
#pragma once
#include "megaloop/types.cuh"

namespace ml {

template <class T, int N>
struct alignas(sizeof(T) * N) Pack {
    T v[N];
};

template <class T, int N>
__device__ __forceinline__ Pack<T, N> load_pack(const T* p) {
    return *reinterpret_cast<const Pack<T, N>*>(p);
}

template <class T, int N>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, N>& x) {
    *reinterpret_cast<Pack<T, N>*>(p) = x;
}

// element i of a pack in compute type
template <int N>
__device__ __forceinline__ float get(const Pack<float, N>& p, int i) { return p.v[i]; }
template <int N>
__device__ __forceinline__ float get(const Pack<bf16, N>& p, int i) { return to_float(p.v[i]); }
template <int N>
__device__ __forceinline__ float get(const Pack<f16, N>& p, int i) { return to_float(p.v[i]); }
template <int N>
__device__ __forceinline__ i64 get(const Pack<int, N>& p, int i) { return p.v[i]; }
template <int N>
__device__ __forceinline__ i64 get(const Pack<i64, N>& p, int i) { return p.v[i]; }
template <int N>
__device__ __forceinline__ bool get(const Pack<bool, N>& p, int i) { return p.v[i]; }

template <class T, int N, class V>
__device__ __forceinline__ void set(Pack<T, N>& p, int i, V value) { store(&p.v[i], value); }

__device__ __forceinline__ bool aligned(const void* p, int bytes) {
    return (reinterpret_cast<unsigned long long>(p) & (unsigned long long)(bytes - 1)) == 0;
}

// dot product of two packs in float32
template <class T, int N>
__device__ __forceinline__ float dot(const Pack<T, N>& a, const Pack<T, N>& b) {
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < N; ++i) s += get(a, i) * get(b, i);
    return s;
}

}  // namespace ml

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

// L2 policy for data read once an iteration and too big to stay in L2 (a decode step's weights): its
// lines are the first evicted, so the stream does not push out what the next tasks need again (the
// loop kernel's code, task lists, counters, activations, the KV cache)
__device__ __forceinline__ u64 evict_first_policy() {
    u64 policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    return policy;
}

// 16 bytes as four 32-bit words (an mma's operands, a ring of loads in flight): loaded as words, they are
// used as they are; load_words_policy under an L2 policy (evict_first_policy).
// (As Pack<bf16, 8>, ptxas repacks each pack with PRMTs where the next round's packs move into place,
// so each round waits there for the loads it just issued: one round of U units in flight, not two.)
__device__ __forceinline__ void load_words(u32 (&w)[4], const void* p) {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    w[0] = v.x;
    w[1] = v.y;
    w[2] = v.z;
    w[3] = v.w;
}
__device__ __forceinline__ void load_words_policy(u32 (&w)[4], const void* p, u64 policy) {
    asm volatile("ld.global.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                 : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
                 : "l"(p), "l"(policy));
}

template <class T, int N>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, N>& x) {
    *reinterpret_cast<Pack<T, N>*>(p) = x;
}

// element i of a pack in compute type
template <int N>
__device__ __forceinline__ float get(const Pack<float, N>& p, int i) { return p.v[i]; }
template <int N>
__device__ __forceinline__ float get(const Pack<bf16, N>& p, int i) {
    // from the 32-bit word that holds elements i & ~1 (low half) and i | 1 (high half): one instruction
    // a value, where extracting the 16 bits first took two
    u32 w;
    memcpy(&w, &p.v[i & ~1], sizeof w);
    return __uint_as_float((i & 1) ? (w & 0xffff0000u) : (w << 16));
}
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

// a + b element by element, each sum rounded to T as storing it would round it: a norm's row plus its
// residual, the values an add op would have stored (megaloop/rows.cuh)
template <class T, int N>
__device__ __forceinline__ Pack<T, N> add_rounded(const Pack<T, N>& a, const Pack<T, N>& b) {
    Pack<T, N> s;
#pragma unroll
    for (int i = 0; i < N; ++i) set(s, i, get(a, i) + get(b, i));
    return s;
}
template <class T>
__device__ __forceinline__ float add_rounded(const T* a, const T* b) {
    T s;
    store(&s, load(a) + load(b));
    return load(&s);
}

__device__ __forceinline__ bool aligned(const void* p, int bytes) {
    return (reinterpret_cast<unsigned long long>(p) & (unsigned long long)(bytes - 1)) == 0;
}

// Running maxima of packs, element by element, none NaN-propagating (as fmaxf: softmax's maxima, whose
// NaNs reach the output through the sum). 16-bit elements two an instruction (max.bf16x2 / max.f16x2,
// sm_80+) and no conversion to float: the row's max is taken in its own dtype, where it is exact.
template <int N>
__device__ __forceinline__ void max_into(Pack<float, N>& acc, const Pack<float, N>& x) {
#pragma unroll
    for (int i = 0; i < N; ++i) acc.v[i] = fmaxf(acc.v[i], x.v[i]);
}
__device__ __forceinline__ u32 max2(bf16, u32 a, u32 b) {
    asm("max.bf16x2 %0, %0, %1;" : "+r"(a) : "r"(b));
    return a;
}
__device__ __forceinline__ u32 max2(f16, u32 a, u32 b) {
    asm("max.f16x2 %0, %0, %1;" : "+r"(a) : "r"(b));
    return a;
}
template <class T, int N>
__device__ __forceinline__ void max_into(Pack<T, N>& acc, const Pack<T, N>& x) {
    static_assert(sizeof(T) == 2 && N % 2 == 0, "16-bit packs of whole pairs");
#pragma unroll
    for (int i = 0; i < N; i += 2) {
        u32 a, b;
        memcpy(&a, &acc.v[i], sizeof a);
        memcpy(&b, &x.v[i], sizeof b);
        a = max2(T{}, a, b);
        memcpy(&acc.v[i], &a, sizeof a);
    }
}
// a pack of -inf, and the largest element of a pack in float32
__device__ __forceinline__ void set_neg_inf(float& x) { x = neg_inf(); }
__device__ __forceinline__ void set_neg_inf(bf16& x) { x.bits = 0xff80; }
__device__ __forceinline__ void set_neg_inf(f16& x) { x.bits = 0xfc00; }
template <class T, int N>
__device__ __forceinline__ Pack<T, N> neg_inf_pack() {
    Pack<T, N> p;
#pragma unroll
    for (int i = 0; i < N; ++i) set_neg_inf(p.v[i]);
    return p;
}
template <class T, int N>
__device__ __forceinline__ float pack_max(const Pack<T, N>& p) {
    float m = get(p, 0);
#pragma unroll
    for (int i = 1; i < N; ++i) m = fmaxf(m, get(p, i));
    return m;
}

// dot product of two packs in float32
template <class T, int N>
__device__ __forceinline__ float dot(const Pack<T, N>& a, const Pack<T, N>& b) {
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < N; ++i) s += get(a, i) * get(b, i);
    return s;
}

// ---- cp.async: global -> shared without passing through registers (sm_80 and later) -------------
// Used by the tensor-core matmul's stages and the block-per-row ring. Unlike a load into registers, a
// copy in flight is not waited for by __syncthreads (only by cp.async.wait_group), so a block can
// synchronise for a reduction while the next rows are still arriving.
__device__ __forceinline__ u32 shared_address(const void* p) {
    u64 a;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
    return (u32)a;
}
// 16 bytes global -> shared without passing through registers; zeros when !valid (src not read).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(shared_address(dst)), "l"(src),
                 "r"(valid ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

}  // namespace ml

#pragma once
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <cstdint>
#include <vector>
#include <algorithm>
#define __device__
#define __noinline__
#define __forceinline__ inline
struct Dim { unsigned x; };
static Dim threadIdx, blockDim, blockIdx;
template <class A, class B> inline auto min(A a, B b) -> decltype(a + b) { return a < b ? a : b; }
inline float __uint_as_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
namespace ml {
typedef unsigned short u16; typedef unsigned int u32; typedef unsigned long long u64; typedef long long i64;
struct bf16 { u16 bits; };
struct f16 { u16 bits; };
inline float to_float(bf16 x) { return __uint_as_float(((u32)x.bits) << 16); }
inline float to_float(f16 x) { _Float16 h; memcpy(&h, &x.bits, 2); return (float)h; }
inline float load(const float* p) { return *p; }
inline float load(const bf16* p) { return to_float(*p); }
inline float load(const f16* p) { return to_float(*p); }
inline i64 load(const int* p) { return *p; }
inline i64 load(const i64* p) { return *p; }
inline void store(float* p, float v) { *p = v; }
inline void store(bf16* p, float v) {
    u32 u; memcpy(&u, &v, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) { p->bits = 0x7fff; return; }  // canonical NaN (as F2FP)
    u32 r = u + 0x7fffu + ((u >> 16) & 1u);
    p->bits = (u16)(r >> 16);
}
inline void store(f16* p, float v) { _Float16 h = (_Float16)v; memcpy(&p->bits, &h, 2); }
inline void store(int* p, i64 v) { *p = (int)v; }
inline void store(i64* p, i64 v) { *p = v; }
template <class T, int N> struct alignas(sizeof(T) * N) Pack { T v[N]; };
template <class T, int N> inline Pack<T, N> load_pack(const T* p) {
    if ((uintptr_t)p % (sizeof(T) * N)) { fprintf(stderr, "misaligned pack load\n"); abort(); }
    return *reinterpret_cast<const Pack<T, N>*>(p); }
template <class T, int N> inline void store_pack(T* p, const Pack<T, N>& x) {
    if ((uintptr_t)p % (sizeof(T) * N)) { fprintf(stderr, "misaligned pack store\n"); abort(); }
    *reinterpret_cast<Pack<T, N>*>(p) = x; }
template <int N> inline float get(const Pack<float, N>& p, int i) { return p.v[i]; }
template <int N> inline float get(const Pack<bf16, N>& p, int i) { return to_float(p.v[i]); }
template <int N> inline float get(const Pack<f16, N>& p, int i) { return to_float(p.v[i]); }
template <class T, int N, class V> inline void set(Pack<T, N>& p, int i, V value) { store(&p.v[i], value); }
inline bool aligned(const void* p, int bytes) { return ((unsigned long long)p & (unsigned long long)(bytes - 1)) == 0; }
enum Error : u64 { OK = 0, WATCHDOG = 1, DATA = 2 };
struct Args { char* arena; u64* abort; };
struct Task { int sig, op; int lo[8], hi[8]; };
static int fails = 0; static i64 first_info[8]; 
inline void fail(const Args& a, u64 code, i64 i0, i64 i1, i64 i2, i64 i3, i64 i4, i64 i5, i64 i6, i64 i7 = 0) {
    if (!fails) { i64 info[8] = {i0,i1,i2,i3,i4,i5,i6,i7}; memcpy(first_info, info, sizeof info); }
    fails++; *a.abort = code;
}
template <int N, class F> inline void for_box(const Task& t, F f) {
    int ext[N + 1]; i64 total = 1;
    for (int d = 0; d < N; ++d) { ext[d] = t.hi[d] - t.lo[d]; total *= ext[d]; }
    for (unsigned e = threadIdx.x; e < (unsigned)total; e += blockDim.x) {
        int i[N + 1]; unsigned r = e;
        for (int d = N - 1; d >= 0; --d) { i[d] = t.lo[d] + (int)(r % (unsigned)ext[d]); r /= (unsigned)ext[d]; }
        f(i);
    }
}
}

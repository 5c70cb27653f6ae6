// megaloop/elementwise.cuh: one tile of an elementwise op (megaloop/codegen/emit.py instantiates it).
//
// An operand is a pointer with its strides in the output's index space (At<T, S...>: 0 on an axis it
// is broadcast along); the op is a lambda from the inputs' compute values to the output's. The
// per-element path is the definition; the packed path (W elements a 16-byte load along the last axis,
// U packs a thread in flight) runs where the generator proved the layout allows it and the tile's
// box and pointers are aligned.
#pragma once
#include "megaloop/loop.cuh"
#include "megaloop/at.cuh"
#include "megaloop/vec.cuh"

namespace ml {

// An input's U values of the packed path in flight: whole packs where it moves along the last axis
// (stride 1 there), one value a row where it does not
template <class A, int W, int U, bool Vec = A::inner == 1>
struct InFlight;
template <class A, int W, int U>
struct InFlight<A, W, U, true> {
    using T = typename A::type;
    A in;
    Pack<T, W> v[U];
    __device__ __forceinline__ void load(int u, const int* i) { v[u] = load_pack<T, W>(in.p + in.offset(i)); }
    __device__ __forceinline__ auto get(int u, int j) const { return ml::get(v[u], j); }
    __device__ __forceinline__ bool aligned_() const { return aligned(in.p, W * (int)sizeof(T)); }
};
template <class A, int W, int U>
struct InFlight<A, W, U, false> {
    A in;
    decltype(ml::load(A{}.p)) v[U];
    __device__ __forceinline__ void load(int u, const int* i) { v[u] = ml::load(in.p + in.offset(i)); }
    __device__ __forceinline__ auto get(int u, int) const { return v[u]; }
    __device__ __forceinline__ bool aligned_() const { return true; }
};

// The tile's box in packs of W along the last axis, U packs a thread in flight, where ``aligned()``:
// each pack u's ``load(u, i, at_u)`` (its index i[]; at_u gets its output offset) runs before any
// pack's ``store(u, at_u)``. Packs past the box's end load its last pack again (never stored), so
// every pack is defined without a branch (undefined tail packs made ptxas spill). False, having done
// nothing, where the box is not whole packs or has 2^31 packs or more (32-bit index arithmetic: a
// 64-bit division costs ~4x): the caller's per-element path then runs.
template <int N, int W, int U, class Aligned, class Load, class Store>
__device__ __forceinline__ bool packed_box(const Task& t, Aligned aligned, Load load, Store store) {
    constexpr int last = N - 1;
    if (t.lo[last] % W == 0 && (t.hi[last] - t.lo[last]) % W == 0 && aligned()) {
        const int c0 = t.lo[last];
        const i64 vpr = (t.hi[last] - c0) / W;
        i64 rows = 1;
        for (int d = 0; d < last; ++d) rows *= t.hi[d] - t.lo[d];
        if (rows * vpr <= 0x7fffffff) {
            const unsigned vpr32 = (unsigned)vpr, total = (unsigned)(rows * vpr);
            for (unsigned e0 = threadIdx.x; e0 < total; e0 += U * ml::block_threads()) {
                i64 at[U];
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    const unsigned e = min(e0 + u * ml::block_threads(), total - 1);
                    int i[N];
                    i[last] = c0 + (int)(e % vpr32) * W;
                    unsigned r = e / vpr32;
                    for (int d = last - 1; d >= 0; --d) {
                        const unsigned ext = t.hi[d] - t.lo[d];
                        i[d] = t.lo[d] + (int)(r % ext);
                        r /= ext;
                    }
                    load(u, i, at[u]);
                }
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    if (e0 + u * ml::block_threads() >= total) break;
                    store(u, at[u]);
                }
            }
            return true;
        }
    }
    return false;
}

// out[i] = f(in[i]...) over the task's box: the packed path (W > 0: W elements a load, U packs an
// operand in flight) where the box and every packed pointer are aligned, else element by element
template <int W, int U, class F, class O, class... I>
__device__ __forceinline__ void elementwise(const Task& t, F f, O out, I... in) {
    constexpr int N = O::rank;
    using TO = typename O::type;
    static_assert(((I::rank == N) && ...), "elementwise: operands in the output's index space");
    static_assert(W == 0 || W * sizeof(TO) <= 16, "elementwise: a pack is at most 16 bytes");
    if constexpr (W > 0) {
        const bool done = [&](InFlight<I, W, U>... h) {
            return packed_box<N, W, U>(
                t,
                [&] { return (aligned(out.p, W * (int)sizeof(TO)) && ... && h.aligned_()); },
                [&](int u, const int* i, i64& at_u) {
                    (h.load(u, i), ...);
                    at_u = out.offset(i);
                },
                [&](int u, i64 at_u) {
                    Pack<TO, W> po;
#pragma unroll
                    for (int j = 0; j < W; ++j) set(po, j, f(h.get(u, j)...));
                    store_pack<TO, W>(out.p + at_u, po);
                });
        }(InFlight<I, W, U>{in}...);
        if (done) return;
    }
    for_box<N>(t, [&](const int* i) { store(out.p + out.offset(i), f(load(in.p + in.offset(i))...)); });
}

}  // namespace ml

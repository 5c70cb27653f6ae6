// megaloop/reduce.cuh: one tile of a reduction (sum, mean, max, min, argmax over one or more axes)
// and of the split argmax's two halves; megaloop/codegen/emit_reduce.py instantiates them with the
// reduced elements' layout and the operands' strides in the output's index space (At, elementwise.cuh).
// Semantics: megaloop.frontend.ops.reduce (float32 or int64 accumulation, NaN propagation, argmax's
// first index).
#pragma once
#include "megaloop/elementwise.cuh"

namespace ml {

enum ReduceOp : int { RED_SUM, RED_MEAN, RED_MAX, RED_MIN, RED_ARGMAX };
constexpr i64 NO_INDEX = 9223372036854775807LL;  // argmax: no element seen yet

template <class C> struct is_float_value { static constexpr bool value = false; };
template <> struct is_float_value<float> { static constexpr bool value = true; };

// The running result of one op over values of compute type C (float or i64): add(v, r) folds in
// element r; warp() combines the warp's lanes (argmax: ties to the smaller index).
template <int Op, class C>
struct Fold {
    static constexpr bool is_float = is_float_value<C>::value, arg = Op == RED_ARGMAX;
    C best;
    i64 best_i;
    __device__ __forceinline__ static C init() {
        if constexpr (Op == RED_SUM || Op == RED_MEAN) return 0;
        else if constexpr (Op == RED_MIN && is_float) return pos_inf();
        else if constexpr (Op == RED_MIN) return 9223372036854775807LL;
        else if constexpr (is_float) return neg_inf();
        else return -9223372036854775807LL - 1;
    }
    __device__ __forceinline__ Fold() : best(init()), best_i(NO_INDEX) {}
    __device__ __forceinline__ void add(C v, i64 r) {
        if constexpr (arg) {
            bool better;
            if constexpr (is_float) better = (v != v) ? (best == best) : (v > best);
            else better = v > best;
            if (best_i == NO_INDEX || better) {
                best = v;
                best_i = r;
            }
        } else if constexpr (Op == RED_SUM || Op == RED_MEAN) {
            best += v;
        } else if constexpr (Op == RED_MAX) {
            best = (v > best || v != v) ? v : best;
        } else {
            best = (v < best || v != v) ? v : best;
        }
    }
    __device__ __forceinline__ void warp() {
        if constexpr (arg) warp_argmax(best, best_i);
        else if constexpr (Op == RED_SUM || Op == RED_MEAN) best = warp_sum(best);
        else if constexpr (Op == RED_MAX) best = warp_max(best);
        else best = warp_min(best);
    }
};

// The reduced elements of an output element: one run from its base (Run: element r at base + r), or
// the reduced axes' (size, stride) in order (Axes<Dim<n, s>...>: r decomposed row-major)
struct Run {
    __device__ __forceinline__ static i64 offset(i64 r) { return r; }
};
template <i64 N, i64 S> struct Dim { static constexpr i64 n = N, s = S; };
template <class... D> struct Axes;
template <> struct Axes<> {
    __device__ __forceinline__ static i64 offset_of(i64&) { return 0; }
};
template <class D, class... R> struct Axes<D, R...> {
    // the later axes first: the last axis is the fastest
    __device__ __forceinline__ static i64 offset_of(i64& rest) {
        const i64 later = Axes<R...>::offset_of(rest);
        const i64 at = (rest % D::n) * D::s;
        rest /= D::n;
        return later + at;
    }
    __device__ __forceinline__ static i64 offset(i64 r) { return offset_of(r); }
};

// An output element's result: argmax's index, mean's sum over Total, the others' value
template <int Op, i64 Total, class D, class C>
__device__ __forceinline__ void store_fold(D* dest, const Fold<Op, C>& f) {
    if constexpr (Op == RED_ARGMAX) store(dest, f.best_i);
    else if constexpr (Op == RED_MEAN) store(dest, f.best / (float)Total);
    else store(dest, f.best);
}

// out[o] = op over the Total elements of x at x.offset(o) + Red::offset(r): a warp an output element
// (x: its strides in the output's index space, 0 along the reduced axes)
template <int Op, i64 Total, class Red, class O, class X>
__device__ __forceinline__ void reduce_warps(const Task& t, O out, X x) {
    using C = decltype(load(x.p));
    for_box_warps<O::rank>(t, [&](const int* o, int lane) {
        const i64 base = x.offset(o);
        Fold<Op, C> f;
        for (i64 r = lane; r < Total; r += 32) f.add(load(x.p + base + Red::offset(r)), r);
        f.warp();
        if (lane == 0) store_fold<Op, Total>(out.p + out.offset(o), f);
    });
}

// The same with a thread an output element, folded in index order: for few reduced elements an
// output element (a warp's lanes would idle), e.g. a split-K product's partial sums
template <int Op, i64 Total, class Red, class O, class X>
__device__ __forceinline__ void reduce_threads(const Task& t, O out, X x) {
    using C = decltype(load(x.p));
    for_box<O::rank>(t, [&](const int* o) {
        const i64 base = x.offset(o);
        Fold<Op, C> f;
#pragma unroll
        for (i64 r = 0; r < Total; ++r) f.add(load(x.p + base + Red::offset(r)), r);
        store_fold<Op, Total>(out.p + out.offset(o), f);
    });
}

// Each warp's result (and argmax's index) in shared memory, for the block reductions
template <class C, bool Arg>
struct BlockShared {
    C red[32];
};
template <class C>
struct BlockShared<C, true> {
    C red[32];
    i64 red_i[32];
};

// One output element on the whole block: the total elements at p, Step apart (16-byte packs, U a
// thread in flight, where Step is 1 and p is aligned), folded by each thread in increasing index
// order (argmax's ties still go to the first index), then the warps combined in a fixed order (the
// same bits every run); thread 0 stores the result at dest (argmax: the index plus first; mean:
// divided by total).
template <int Op, i64 Step, int U, class T, class D, class C>
__device__ __forceinline__ void block_fold(const T* p, i64 total, D* dest, i64 first,
                                           BlockShared<C, Op == RED_ARGMAX>& sh) {
    constexpr int W = 16 / sizeof(T);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = ml::block_threads() >> 5;
    Fold<Op, C> f;
    i64 r0 = 0;  // elements before r0: folded in (whole packs)
    if constexpr (Step == 1) {
        if (aligned(p, 16)) {
            const i64 packs = total / W;
            for (i64 j0 = threadIdx.x; j0 < packs; j0 += U * (i64)ml::block_threads()) {
                Pack<T, W> pk[U];  // U loads in flight before any is used
#pragma unroll
                for (int k = 0; k < U; ++k) {
                    const i64 j = min(j0 + k * (i64)ml::block_threads(), packs - 1);
                    pk[k] = load_pack<T, W>(p + j * W);
                }
#pragma unroll
                for (int k = 0; k < U; ++k) {
                    if (j0 + k * (i64)ml::block_threads() >= packs) break;
#pragma unroll
                    for (int w = 0; w < W; ++w) f.add(get(pk[k], w), (j0 + k * (i64)ml::block_threads()) * W + w);
                }
            }
            r0 = packs * W;
        }
    }
    for (i64 r = r0 + threadIdx.x; r < total; r += ml::block_threads()) f.add(load(p + r * Step), r);  // the rest
    f.warp();
    if (lane == 0) {
        sh.red[warp] = f.best;
        if constexpr (Op == RED_ARGMAX) sh.red_i[warp] = f.best_i;
    }
    ml::block_sync();
    if (warp == 0) {
        f = Fold<Op, C>();
        if (lane < warps) {
            f.best = sh.red[lane];
            if constexpr (Op == RED_ARGMAX) f.best_i = sh.red_i[lane];
        }
        f.warp();
        if (lane == 0) {
            if constexpr (Op == RED_ARGMAX) store(dest, f.best_i + first);
            else if constexpr (Op == RED_MEAN) store(dest, f.best / (float)total);
            else store(dest, f.best);
        }
    }
    ml::block_sync();  // sh is the next element's
}

// out[o] = op over the Total consecutive elements at x.offset(o), the whole block on each output
// element in turn (x: its strides in the output's index space)
template <int Op, i64 Total, int U, class O, class X>
__device__ __forceinline__ void reduce_block(const Task& t, O out, X x) {
    using C = decltype(load(x.p));
    __shared__ BlockShared<C, Op == RED_ARGMAX> sh;
    constexpr int N = O::rank;
    for (int e = 0; e < box_count<N>(t); ++e) {
        int o[N + 1];
        box_index<N>(t, e, o);
        block_fold<Op, 1, U>(x.p + x.offset(o), Total, out.p + out.offset(o), 0, sh);
    }
}

// argmax_partial: out[o] = the index along Axis (of Len) of the largest of x's elements in range
// o[Axis] (Chunk elements from o[Axis] * Chunk; the last range shorter), the whole block on each
// range in turn (x: its strides in out's index space, 0 along Axis; XS its stride along Axis)
template <int Axis, i64 Len, i64 Chunk, i64 XS, int U, class O, class X>
__device__ __forceinline__ void argmax_partial(const Task& t, O out, X x) {
    using C = decltype(load(x.p));
    __shared__ BlockShared<C, true> sh;
    constexpr int N = O::rank;
    for (int e = 0; e < box_count<N>(t); ++e) {
        int o[N + 1];
        box_index<N>(t, e, o);
        const i64 lo = (i64)o[Axis] * Chunk;  // the range's first element along the axis
        const i64 count = min((i64)Chunk, Len - lo);
        block_fold<RED_ARGMAX, XS, U>(x.p + x.offset(o) + lo * XS, count, out.p + out.offset(o), lo, sh);
    }
}

// argmax_combine: out[o] = the index of the largest of x's elements at the Splits ranges' argmaxes
// (partial's), a warp an output element, a lane B ranges at once: their indices loaded together, then
// x's values at them together (two trips, not one a range), folded in range order, the lanes combined
// (ties to the smaller index: the earlier range). x, partial: strides in out's index space; XS, PS:
// theirs along the reduced axis.
template <int Splits, int B, i64 XS, i64 PS, class O, class X, class P>
__device__ __forceinline__ void argmax_combine(const Task& t, O out, X x, P partial) {
    using C = decltype(load(x.p));
    for_box_warps<O::rank>(t, [&](const int* o, int lane) {
        const i64 xb = x.offset(o), pb = partial.offset(o);
        Fold<RED_ARGMAX, C> f;
        for (int s0 = lane; s0 < Splits; s0 += 32 * B) {  // the lane's ranges s0, s0 + 32, ...
            i64 at[B];  // their best indices
#pragma unroll
            for (int k = 0; k < B; ++k) {
                const int s = s0 + 32 * k;
                at[k] = s < Splits ? partial.p[pb + (i64)s * PS] : NO_INDEX;
            }
            C val[B];
#pragma unroll
            for (int k = 0; k < B; ++k)
                val[k] = at[k] != NO_INDEX ? load(x.p + xb + at[k] * XS) : Fold<RED_ARGMAX, C>::init();
#pragma unroll
            for (int k = 0; k < B; ++k)
                if (at[k] != NO_INDEX) f.add(val[k], at[k]);
        }
        f.warp();
        if (lane == 0) store(out.p + out.offset(o), f.best_i);
    });
}

}  // namespace ml

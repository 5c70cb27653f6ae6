// megaloop/at.cuh: an operand of a tile template, a pointer with its strides as template arguments
// (At<T, S...>, one stride per axis of the index space it is addressed in: 0 along a broadcast axis).
// Plain C++ after megaloop/types.cuh (ml::i64), so host shims of tile tests include it as it is.
#pragma once

namespace ml {

template <class T> struct unconst { using type = T; };
template <class T> struct unconst<const T> { using type = T; };
template <i64... S> struct first_of { static constexpr i64 value = 0; };
template <i64 A, i64... R> struct first_of<A, R...> { static constexpr i64 value = A; };
template <i64... S> struct last_of { static constexpr i64 value = 0; };
template <i64 A> struct last_of<A> { static constexpr i64 value = A; };
template <i64 A, i64 B, i64... R> struct last_of<A, B, R...> : last_of<B, R...> {};
template <int K, i64 A, i64... R> struct nth_of : nth_of<K - 1, R...> {};
template <i64 A, i64... R> struct nth_of<0, A, R...> { static constexpr i64 value = A; };

// a pointer and its strides in the output's index space, one per output axis
template <class T, i64... S>
struct At {
    using type = typename unconst<T>::type;
    static constexpr int rank = sizeof...(S);
    static constexpr i64 outer = first_of<S...>::value;  // the first axis's stride
    static constexpr i64 inner = last_of<S...>::value;  // the last axis's stride
    T* p;
    // sum(i[d] * stride[d]) over the axes that move
    __device__ __forceinline__ i64 offset(const int* i) const {
        i64 o = 0;
        int d = 0;
        ((o += S != 0 ? (i64)i[d] * S : 0, ++d), ...);
        return o;
    }
};
template <i64... S, class T>
__device__ __forceinline__ At<T, S...> at(T* p) {
    return {p};
}

template <int Axis, class A> struct stride_along { static constexpr i64 value = 0; };  // (no operand)
template <int Axis, class T, i64... S> struct stride_along<Axis, At<T, S...>> : nth_of<Axis, S...> {};
template <int Axis, class A> inline constexpr i64 stride_of = stride_along<Axis, A>::value;

// an operand a tile does without (a norm's weight, bias or residual; attention's positions, lengths)
struct Absent {
    __device__ __forceinline__ void pack(int, int) {}
};
template <class A> struct is_present { static constexpr bool value = true; };
template <> struct is_present<Absent> { static constexpr bool value = false; };

// sum(i[d] * stride[d]) over the first K axes only (the later ones at 0)
template <int K, class T, i64... S>
__device__ __forceinline__ i64 leading_offset(const At<T, S...>&, const int* i) {
    i64 o = 0;
    int d = 0;
    ((o += S != 0 && d < K ? (i64)i[d] * S : 0, ++d), ...);
    return o;
}

}  // namespace ml

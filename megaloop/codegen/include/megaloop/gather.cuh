// megaloop/gather.cuh: tiles that copy elements from where an index says (embedding, concat);
// megaloop/codegen/emit.py instantiates them with the operands' layouts (At, elementwise.cuh).
#pragma once
#include "megaloop/elementwise.cuh"

namespace ml {

// out[..., d] = table[ids[...], d]: the table's rows in packs of W (U a thread in flight, each with
// its id) where W > 0 and the box and pointers are aligned, else element by element. An id outside
// [0, V) is reported (a data error naming it) and its elements are not written.
template <i64 V, int W, int U, class O, class Table, class Ids>
__device__ __forceinline__ void embedding(const Args& a, const Task& t, int tid, O out, Table table, Ids ids) {
    constexpr int N = O::rank;
    using T = typename O::type;
    static_assert(Table::rank == 2 && Ids::rank == N - 1, "embedding: a 2-D table, ids of out's leading axes");
    const auto bad = [&](i64 id) { fail(a, DATA, blockIdx.x, tid, t.op, id, V, 0, 0); };
    if constexpr (W > 0) {
        Pack<T, W> row[U];
        i64 id[U];
        const bool done = packed_box<N, W, U>(
            t,
            [&] { return aligned(out.p, W * (int)sizeof(T)) && aligned(table.p, W * (int)sizeof(T)); },
            [&](int u, const int* i, i64& at_u) {
                id[u] = load(ids.p + ids.offset(i));
                const i64 at_id = id[u] < 0 || id[u] >= V ? 0 : id[u];  // (a bad id: reported at the store)
                row[u] = load_pack<T, W>(table.p + at_id * Table::outer + (i64)i[N - 1]);
                at_u = out.offset(i);
            },
            [&](int u, i64 at_u) {
                if (id[u] < 0 || id[u] >= V) {
                    bad(id[u]);
                    return;
                }
                store_pack<T, W>(out.p + at_u, row[u]);
            });
        if (done) return;
    }
    for_box<N>(t, [&](const int* i) {
        const i64 id = load(ids.p + ids.offset(i));
        if (id < 0 || id >= V) {
            bad(id);
            return;
        }
        store(out.p + out.offset(i), load(table.p + id * Table::outer + (i64)i[N - 1] * Table::inner));
    });
}

// out[...] = data[c mod R, ...] for the step counter c (0-d): a training step's batch out of data
// uploaded once, wrapping around at its end. RowStride is data's first stride; Data holds the strides
// of its other axes in out's index space. A counter below 0 is reported (STEP_COUNTER_KIND).
constexpr i64 STEP_COUNTER_KIND = 6;  // ml::fail's kind (megaloop/runtime/report.py)
template <i64 R, i64 RowStride, class O, class Data, class C>
__device__ __forceinline__ void step_batch(const Args& a, const Task& t, int tid, O out, Data data, C counter) {
    const i64 c = load(counter.p);
    if (c < 0) {
        if (threadIdx.x == 0) fail(a, DATA, blockIdx.x, tid, t.op, c, R, STEP_COUNTER_KIND, 0);
        return;
    }
    const auto* row = data.p + (c % R) * RowStride;
    for_box<O::rank>(t, [&](const int* i) { store(out.p + out.offset(i), load(row + data.offset(i))); });
}

// out[r, c] = the sum of values[n, c] over the n whose ids[n] == r, in the order of n (float32, one
// rounding: the same on every run), for the task's box of out: a warp a row, its lanes 32 columns
// apart holding K columns each, scanning the N ids 32 at a time. An id outside [0, R) is reported.
template <i64 R, i64 N, int K, class O, class Vals, class Ids>
__device__ __forceinline__ void scatter_add(const Args& a, const Task& t, int tid, O out, Vals values, Ids ids) {
    static_assert(O::rank == 2 && Vals::rank == 2 && Ids::rank == 1, "scatter_add: values [n, dim], ids [n]");
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = ml::block_threads() >> 5;
    const int c1 = t.hi[1];
    for (int r = t.lo[0] + warp; r < t.hi[0]; r += warps) {
        for (int cb = t.lo[1]; cb < c1; cb += 32 * K) {
            float acc[K];
#pragma unroll
            for (int k = 0; k < K; ++k) acc[k] = 0.0f;
            for (i64 base = 0; base < N; base += 32) {
                i64 id = -1;
                if (base + lane < N) {
                    id = load(ids.p + (base + lane) * Ids::inner);
                    if (id < 0 || id >= R) {
                        fail(a, DATA, blockIdx.x, tid, t.op, id, R, 0, 0);
                        id = -1;
                    }
                }
                for (unsigned hits = __ballot_sync(0xffffffffu, id == r); hits; hits &= hits - 1) {
                    const auto* row = values.p + (base + __ffs(hits) - 1) * Vals::outer;
#pragma unroll
                    for (int k = 0; k < K; ++k) {
                        const int c = cb + lane + 32 * k;
                        if (c < c1) acc[k] += load(row + (i64)c * Vals::inner);
                    }
                }
            }
#pragma unroll
            for (int k = 0; k < K; ++k) {
                const int c = cb + lane + 32 * k;
                if (c < c1) store(out.p + (i64)r * O::outer + (i64)c * O::inner, acc[k]);
            }
        }
    }
}

// concat's element i from the input whose part of the axis holds i[Axis] (parts of Sizes... in order)
template <int Axis, int Start, class O>
__device__ __forceinline__ void concat_part(int*, i64, O) {}
template <int Axis, int Start, int Size, int... Sizes, class O, class I, class... R>
__device__ __forceinline__ void concat_part(int* i, i64 o, O out, I in, R... rest) {
    const int c = i[Axis];
    if (c < Start + Size) {
        i[Axis] = c - Start;
        store(out.p + o, load(in.p + in.offset(i)));
    } else {
        concat_part<Axis, Start + Size, Sizes...>(i, o, out, rest...);
    }
}

// out = the inputs one after another along Axis, of Sizes... elements there each
template <int Axis, int... Sizes, class O, class... I>
__device__ __forceinline__ void concat(const Task& t, O out, I... in) {
    static_assert(sizeof...(Sizes) == sizeof...(I), "concat: one size along the axis per input");
    static_assert(((I::rank == O::rank) && ...), "concat: the inputs have the output's rank");
    constexpr int N = O::rank;
    for_box<N>(t, [&](const int* i) {
        int j[N + 1];
#pragma unroll
        for (int d = 0; d < N; ++d) j[d] = i[d];
        concat_part<Axis, 0, Sizes...>(j, out.offset(i), out, in...);
    });
}

}  // namespace ml

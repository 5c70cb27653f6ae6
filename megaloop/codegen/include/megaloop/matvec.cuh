// megaloop/matvec.cuh: matrix-vector tiles that sum whole weight rows, a warp a row (a decode step's
// products). A tile's few rows of A are a Rows policy: PlainRows as they are in memory, NormedRows
// rmsnormed on the way in (rmsnorm_linear). The weight rows come from the weight ring
// (megaloop/ring.cuh) or from global memory (direct_matvec). A column's sum is one warp's, its lanes
// taking every 32nd 16-byte piece, so the result is the same bits every run.
#pragma once
#include "megaloop/loop.cuh"
#include "megaloop/vec.cuh"

namespace ml {

template <class T>
struct PlainRows {
    static constexpr int N = 16 / sizeof(T);
    const T* x;
    i64 step;
    __device__ __forceinline__ void prepare(int, int) {}
    __device__ __forceinline__ Pack<T, N> piece(int row, int i) const { return load_pack<T, N>(x + row * step + N * i); }
};

// As the rmsnorm op stores them: x (or x + residual, rounded to T as an add stores it) times
// 1 / sqrt(mean(x^2) + eps), times the weight, rounded to T. The block norms the tile's rows once into
// `stage` (ROWS x PIECES packs, then ROWS x warps floats), each thread's loads issued together.
template <class T, int PIECES, int ROWS, bool RESIDUAL>
struct NormedRows {
    static constexpr int N = 16 / sizeof(T);
    // a thread's pieces of a row in one run of loads where the block has at least 256 threads
    static constexpr int B = (PIECES + 255) / 256 < 4 ? (PIECES + 255) / 256 : 4;
    const T* x;
    i64 step;
    const T* residual;
    i64 residual_step;
    const T* weight;
    float eps;
    Pack<T, N>* stage;

    __device__ __forceinline__ Pack<T, N> raw(int row, int i) const {
        const Pack<T, N> v = load_pack<T, N>(x + row * step + N * i);
        if constexpr (RESIDUAL) return add_rounded(v, load_pack<T, N>(residual + row * residual_step + N * i));
        return v;
    }
    // The whole block, before any piece: the raw rows and their sums of squares, a barrier, the scaling.
    __device__ __forceinline__ void prepare(int nr, int) {
        const int threads = ml::block_threads(), tid = threadIdx.x, warps = threads >> 5;
        float* sums = reinterpret_cast<float*>(stage + ROWS * PIECES);
        Pack<T, N> g[B];
        for (int row = 0; row < nr; ++row) {
            float q = 0.0f;
            for (int u0 = 0; u0 * threads < PIECES; u0 += B) {
                Pack<T, N> v[B];
#pragma unroll
                for (int u = 0; u < B; ++u) {
                    const int i = min(tid + threads * (u0 + u), PIECES - 1);
                    v[u] = raw(row, i);
                    if (row == 0 && u0 == 0) g[u] = load_pack<T, N>(weight + N * i);
                }
#pragma unroll
                for (int u = 0; u < B; ++u) {
                    const int i = tid + threads * (u0 + u);
                    if (i >= PIECES) break;
                    stage[row * PIECES + i] = v[u];
#pragma unroll
                    for (int e = 0; e < N; ++e) q += get(v[u], e) * get(v[u], e);
                }
            }
            q = warp_sum(q);
            if ((tid & 31) == 0) sums[row * warps + (tid >> 5)] = q;
        }
        ml::block_sync();
        for (int row = 0; row < nr; ++row) {
            float q = 0.0f;
            for (int w = 0; w < warps; ++w) q += sums[row * warps + w];
            const float inv = 1.0f / sqrtf(q / (float)(N * PIECES) + eps);
            for (int u0 = 0; u0 * threads < PIECES; u0 += B) {
#pragma unroll
                for (int u = 0; u < B; ++u) {
                    const int i = tid + threads * (u0 + u);
                    if (i >= PIECES) break;
                    const Pack<T, N> gv = u0 == 0 ? g[u] : load_pack<T, N>(weight + N * i);
                    Pack<T, N> y = stage[row * PIECES + i];
#pragma unroll
                    for (int e = 0; e < N; ++e) set(y, e, get(y, e) * inv * get(gv, e));
                    stage[row * PIECES + i] = y;
                }
            }
        }
        ml::block_sync();
    }
    __device__ __forceinline__ Pack<T, N> piece(int row, int i) const { return stage[row * PIECES + i]; }
};

// One warp: `count` weight rows starting at `w` (`w_step` bytes apart), each against the tile's nr
// rows; store(row, c0 + column, sum).
template <class T, int PIECES, int ROWS, class Rows, class Store>
__device__ __forceinline__ void warp_columns(const unsigned char* w, i64 w_step, int c0, int count, const Rows& rows,
                                             int nr, Store& store) {
    constexpr int N = 16 / sizeof(T), U = PIECES < 8 * 32 ? (PIECES + 31) / 32 : 8;
    const int lane = threadIdx.x & 31;
    for (int c = 0; c < count; ++c, w += w_step) {
        const Pack<T, N>* wp = reinterpret_cast<const Pack<T, N>*>(w);
        float acc[ROWS];
#pragma unroll
        for (int row = 0; row < ROWS; ++row) acc[row] = 0.0f;
        for (int i0 = lane; i0 < PIECES; i0 += 32 * U) {
            Pack<T, N> wv[U];
#pragma unroll
            for (int u = 0; u < U; ++u) wv[u] = wp[min(i0 + 32 * u, PIECES - 1)];  // past the row: unused
#pragma unroll
            for (int row = 0; row < ROWS; ++row) {
                if (row >= nr) break;
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    const int i = i0 + 32 * u;
                    const Pack<T, N> xv = rows.piece(row, min(i, PIECES - 1));
                    if (i < PIECES) acc[row] += dot(wv[u], xv);
                }
            }
        }
#pragma unroll
        for (int row = 0; row < ROWS; ++row) {
            if (row >= nr) break;  // nr is the same on every lane: the shuffles stay convergent
            const float s = warp_sum(acc[row]);
            if (lane == 0) store(row, c0 + c, s);
        }
    }
}

// `cols` weight rows read from global memory (`w`, `w_step` bytes apart, 16-byte aligned) against
// the tile's nr <= ROWS prepared rows, in runs of `per_run` columns dealt to the warps in turn.
template <class T, int PIECES, int ROWS, class Rows, class Store>
__device__ __forceinline__ void direct_columns(int cols, int per_run, const unsigned char* w, i64 w_step,
                                               const Rows& rows, int nr, Store store) {
    const int warps = ml::block_threads() >> 5, warp = threadIdx.x >> 5;
    for (int c0 = warp * per_run; c0 < cols; c0 += warps * per_run)
        warp_columns<T, PIECES, ROWS>(w + c0 * w_step, w_step, c0, min(per_run, cols - c0), rows, nr, store);
}

// The same, the rows prepared by the whole block first (a Rows policy may hold barriers).
template <class T, int PIECES, int ROWS, class Rows, class Store>
__device__ __forceinline__ void direct_matvec(int cols, int per_run, const unsigned char* w, i64 w_step, Rows rows,
                                              int nr, Store store) {
    rows.prepare(nr, PIECES);
    direct_columns<T, PIECES, ROWS>(cols, per_run, w, w_step, rows, nr, store);
}

}  // namespace ml

namespace ml {

template <class T>
__device__ __forceinline__ float rounded(float v) {
    T s;
    store(&s, v);
    return load(&s);
}

// swiglu_linear's epilogue, the whole block after a barrier: silu(gate) * up of the tile's nr x cols
// sums in shared memory, each rounded to T first as the two products would be stored, then stored.
template <class T, class Store>
__device__ __forceinline__ void silu_mul_sums(const float* gate, const float* up, int nr, int cols, Store store) {
    for (int e = threadIdx.x; e < nr * cols; e += ml::block_threads())
        store(e / cols, e % cols, silu(rounded<T>(gate[e])) * rounded<T>(up[e]));
}

// rmsnorm_linear on any layout: a warp an output element (row, column) of the tile's `rows` x `cols`,
// its row's scale taken again for each. x(row, i) (the residual already added and rounded),
// g(i), w(column, i): element loads; store(row, column, value).
template <class T, class X, class G, class W, class Store>
__device__ __forceinline__ void norm_linear_elements(int rows, int cols, int k, float eps, X x, G g, W w, Store store) {
    const int warps = ml::block_threads() >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int e = warp; e < rows * cols; e += warps) {
        const int row = e / cols, col = e % cols;
        float q = 0.0f;
        for (int i = lane; i < k; i += 32) q += x(row, i) * x(row, i);
        const float inv = 1.0f / sqrtf(warp_sum(q) / (float)k + eps);
        float s = 0.0f;
        for (int i = lane; i < k; i += 32) s += rounded<T>(x(row, i) * inv * g(i)) * w(col, i);
        s = warp_sum(s);
        if (lane == 0) store(row, col, s);
    }
}

// swiglu_linear on any layout: a warp an output element (row, column), its row's scale (NORM) taken
// again for each. x(row, i) (the residual already added and rounded), g(i): the norm's weight,
// gate(column, i), up(column, i): element loads; store(row, column, value).
template <class T, bool NORM, class X, class G, class W, class U, class Store>
__device__ __forceinline__ void swiglu_elements(int rows, int cols, int k, float eps, X x, G g, W gate, U up,
                                                Store store) {
    const int warps = ml::block_threads() >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int e = warp; e < rows * cols; e += warps) {
        const int row = e / cols, col = e % cols;
        float inv = 1.0f;
        if constexpr (NORM) {
            float q = 0.0f;
            for (int i = lane; i < k; i += 32) q += x(row, i) * x(row, i);
            inv = 1.0f / sqrtf(warp_sum(q) / (float)k + eps);
        }
        float sg = 0.0f, su = 0.0f;
        for (int i = lane; i < k; i += 32) {
            const float a = NORM ? rounded<T>(x(row, i) * inv * g(i)) : x(row, i);
            sg += a * gate(col, i);
            su += a * up(col, i);
        }
        sg = warp_sum(sg);
        su = warp_sum(su);
        if (lane == 0) store(row, col, silu(rounded<T>(sg)) * rounded<T>(su));
    }
}

}  // namespace ml

// megaloop/sample.cuh: one row of logits -> one token, the whole block on the row: the tiles of sample
// and of its split form, which megaloop/codegen/emit_sample.py instantiates (operands: At, at.cuh).
//
// The definition is megaloop/frontend/ops/sample.py (as numpy: _sampling.py); this computes it bit
// for bit. Float steps are spelled __fadd_rn / __fsub_rn / __fmul_rn / __fdiv_rn (never contracted
// into FMAs), weights are integers whose sums are exact in any order, the top-k and top-p thresholds
// come from a radix select over each logit's distance below the largest in float-key space (counts
// for top-k, weights for top-p), min-p drops the kept weights below its own, and the draw finds its chunk of the row by per-chunk sums, then its
// token by a scan of that chunk in index order. The code also compiles on the host
// (tests/test_sample_codegen.py: g++ with a shim for the CUDA builtins, a fiber per thread).
#pragma once

extern __shared__ float4 ml_smem4[];  // the dynamic shared memory: the tiles' Shared

namespace ml {
namespace smp {

// (shared memory is kept small: what a tile takes of it, the whole loop kernel's other tiles lose of L1)
constexpr int RADIX_BITS = 9;
constexpr int BUCKETS = 1 << RADIX_BITS;  // a radix pass's buckets
constexpr int FIRST_SHIFT = 16;  // the first pass's buckets are 2^16 keys wide: one bfloat16 value each
constexpr int CHUNKS = 512;  // the most chunks of a row whose sums the draw keeps
constexpr int WEIGHT_BITS = 40;  // the largest logit weighs 2^40
constexpr int PACKS = 4;  // 16-byte packs a thread loads before it uses any
constexpr u32 FULL = 0xffffffffu;

// Dynamic shared memory of a sample tile (the emitter reserves sizeof(Shared) bytes).
struct Shared {
    u64 hist[BUCKETS];  // a radix pass's counts or weights per bucket
    u64 chunk[CHUNKS];  // the kept weight of each chunk of the row
    u64 warp[32];  // per-warp partial results
    float warp_value[32];
    i64 warp_index[32];
    u64 found[2];  // first_reaching's answer
};

// ---- the definition's arithmetic ----------------------------------------------------------------------

// A key that orders as the float does (no NaN here); -0.0 and +0.0 share one (x + 0 is +0 for both).
__device__ __forceinline__ u32 key_of(float v) {
    const u32 u = __float_as_uint(__fadd_rn(v, 0.0f));
    return (u >> 31) ? ~u : (u | 0x80000000u);
}

// floor(P(f) 2^(40 + j)) for e = (v - m) c, j = floor(e), f = e - j; 0 below e = -40.
__device__ __forceinline__ u64 weight_of(float v, float m, float c) {
    const float e = __fmul_rn(__fsub_rn(v, m), c);
    if (!(e >= -40.0f)) return 0;
    const float j = floorf(e);
    const float f = __fsub_rn(e, j);
    float p = __uint_as_float(0x3962a0f2u);  // the coefficients of _sampling.EXP2_COEFFS, C6 .. C1
    p = __fadd_rn(__fmul_rn(p, f), __uint_as_float(0x3aa36b1fu));
    p = __fadd_rn(__fmul_rn(p, f), __uint_as_float(0x3c1e85c8u));
    p = __fadd_rn(__fmul_rn(p, f), __uint_as_float(0x3d634489u));
    p = __fadd_rn(__fmul_rn(p, f), __uint_as_float(0x3e75feacu));
    p = __fadd_rn(__fmul_rn(p, f), __uint_as_float(0x3f317216u));
    p = __fadd_rn(__fmul_rn(p, f), 1.0f);
    const float scale = __uint_as_float((u32)(127 + WEIGHT_BITS + (int)j) << 23);  // 2^(40 + j), exact
    return __float2ull_rz(__fmul_rn(p, scale));
}

// floor(mass * p24 / 2^24), exact (mass < 2^63, p24 <= 2^24).
__device__ __forceinline__ u64 top_p_target(u64 mass, u64 p24) {
    return (mass >> 24) * p24 + (((mass & 0xffffffull) * p24) >> 24);
}

// Words 0 and 1 of Philox4x32-10, key (seed low, seed high), counter (offset low, offset high, 0, 0).
__device__ __forceinline__ u64 uniform64(u64 seed, u64 offset) {
    u32 c0 = (u32)offset, c1 = (u32)(offset >> 32), c2 = 0, c3 = 0, k0 = (u32)seed, k1 = (u32)(seed >> 32);
    for (int r = 0; r < 10; ++r) {
        if (r) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        const u32 h0 = __umulhi(0xD2511F53u, c0), l0 = 0xD2511F53u * c0;
        const u32 h1 = __umulhi(0xCD9E8D57u, c2), l1 = 0xCD9E8D57u * c2;
        c0 = h1 ^ c1 ^ k0;
        c1 = l1;
        c2 = h0 ^ c3 ^ k1;
        c3 = l0;
    }
    return (u64)c0 | ((u64)c1 << 32);
}

// The parameters' ranges (sample.py): anything else is a data error.
__device__ __forceinline__ bool valid(float temperature, i64 top_k, float top_p, float min_p) {
    return temperature >= 0.0f && temperature <= __uint_as_float(0x7f7fffffu) && top_k >= 0 && top_p > 0.0f &&
           top_p <= 1.0f && min_p >= 0.0f && min_p <= 1.0f;
}

// The least weight min-p keeps: min_p in units of 2^-24 (rounded to nearest), times 2^16 (0: off).
__device__ __forceinline__ u64 min_p_weight(float min_p) {
    return (u64)__float2ll_rn(__fmul_rn(min_p, 16777216.0f)) << (WEIGHT_BITS - 24);
}

// The float a key stands for (key_of's inverse; -0.0 comes back as +0.0).
__device__ __forceinline__ float value_of(u32 key) {
    return __uint_as_float((key >> 31) ? (key & 0x7fffffffu) : ~key);
}

// ---- the block's cooperation (its compute threads a multiple of 32; every thread calls each of these) ---------

__device__ __forceinline__ u64 warp_sum(u64 v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    return v;
}

__device__ __forceinline__ u64 block_sum(u64 v, Shared& s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = ml::block_threads() >> 5;
    v = warp_sum(v);
    if (lane == 0) s.warp[warp] = v;
    ml::block_sync();
    const u64 total = warp_sum(lane < warps ? s.warp[lane] : 0);
    ml::block_sync();
    return total;
}

__device__ __forceinline__ u32 block_or(u32 v, Shared& s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = ml::block_threads() >> 5;
    for (int o = 16; o > 0; o >>= 1) v |= __shfl_xor_sync(FULL, v, o);
    if (lane == 0) s.warp[warp] = v;
    ml::block_sync();
    u32 all = lane < warps ? (u32)s.warp[lane] : 0u;
    for (int o = 16; o > 0; o >>= 1) all |= __shfl_xor_sync(FULL, all, o);
    ml::block_sync();
    return all;
}

// argmax's rule: NaN beats everything, then the larger value, ties (and NaNs) to the smaller index.
__device__ __forceinline__ void better(float& v, i64& i, float w, i64 j) {
    const bool w_nan = w != w, v_nan = v != v;
    const bool take = (w_nan || v_nan) ? (w_nan && (!v_nan || j < i)) : (w > v || (w == v && j < i));
    if (take) {
        v = w;
        i = j;
    }
}

__device__ __forceinline__ void block_argmax(float& v, i64& i, Shared& s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = ml::block_threads() >> 5;
    for (int o = 16; o > 0; o >>= 1) better(v, i, __shfl_xor_sync(FULL, v, o), __shfl_xor_sync(FULL, i, o));
    if (lane == 0) {
        s.warp_value[warp] = v;
        s.warp_index[warp] = i;
    }
    ml::block_sync();
    v = lane < warps ? s.warp_value[lane] : __uint_as_float(0xff800000u);
    i = lane < warps ? s.warp_index[lane] : 9223372036854775807LL;
    for (int o = 16; o > 0; o >>= 1) better(v, i, __shfl_xor_sync(FULL, v, o), __shfl_xor_sync(FULL, i, o));
    ml::block_sync();
}

// The exclusive prefix sum of each thread's v in thread order; total: the sum of all.
__device__ __forceinline__ u64 block_exclusive_scan(u64 v, u64& total, Shared& s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = ml::block_threads() >> 5;
    u64 inclusive = v;
    for (int o = 1; o < 32; o <<= 1) {
        const u64 y = __shfl_up_sync(FULL, inclusive, o);
        if (lane >= o) inclusive += y;
    }
    if (lane == 31) s.warp[warp] = inclusive;
    ml::block_sync();
    u64 before = 0, all = 0;
    for (int w = 0; w < warps; ++w) {
        const u64 x = s.warp[w];
        before += w < warp ? x : 0;
        all += x;
    }
    ml::block_sync();
    total = all;
    return before + inclusive - v;
}

// The first b in [0, len) whose running sum of a(0) .. a(b) reaches need (the sums must reach it), and
// the sum before it.
template <class A>
__device__ __forceinline__ void first_reaching(const A& a, int len, u64 need, int& index, u64& before, Shared& s) {
    const int per = (len + (int)ml::block_threads() - 1) / (int)ml::block_threads();
    const int lo = min(len, (int)threadIdx.x * per), hi = min(len, lo + per);
    u64 mine = 0;
    for (int b = lo; b < hi; ++b) mine += a(b);
    u64 total;
    const u64 excl = block_exclusive_scan(mine, total, s);
    if (lo < hi && excl + mine >= need && (threadIdx.x == 0 || excl < need)) {
        u64 run = excl;
        int b = lo;
        while (b < hi - 1 && run + a(b) < need) run += a(b++);
        s.found[0] = (u64)b;
        s.found[1] = run;
    }
    ml::block_sync();
    index = (int)s.found[0];
    before = s.found[1];
    ml::block_sync();
}

// f(i, v) for the n elements at x (STRIDE apart), each thread in increasing index order: 16-byte packs
// where they are contiguous and aligned (PACKS of them loaded before any is used), single ones otherwise.
template <class T, int STRIDE, class F>
__device__ __forceinline__ void for_each(const T* x, i64 n, F f) {
    constexpr int E = 16 / (int)sizeof(T);
    i64 done = 0;
    if (STRIDE == 1 && n >= E && aligned(x, 16)) {
        const i64 packs = n / E;
        for (i64 j0 = threadIdx.x; j0 < packs; j0 += PACKS * (i64)ml::block_threads()) {
            Pack<T, E> pk[PACKS];
#pragma unroll
            for (int k = 0; k < PACKS; ++k) {
                const i64 j = min(j0 + k * (i64)ml::block_threads(), packs - 1);
                pk[k] = load_pack<T, E>(x + j * E);
            }
#pragma unroll
            for (int k = 0; k < PACKS; ++k) {
                const i64 j = j0 + k * (i64)ml::block_threads();
                if (j >= packs) break;
#pragma unroll
                for (int w = 0; w < E; ++w) f(j * E + w, get(pk[k], w));
            }
        }
        done = packs * E;
    }
    for (i64 i = done + threadIdx.x; i < n; i += ml::block_threads()) f(i, load(x + i * STRIDE));
}

// What a selection visits: f(d, weight) for each element, d = keymax - key (0 for the largest logit),
// weight() its weight (computed only where asked).
template <class T, int STRIDE>
struct Logits {
    const T* x;
    i64 n;
    float m, c;
    u32 keymax;
    template <class F>
    __device__ __forceinline__ void operator()(F f) const {
        for_each<T, STRIDE>(x, n, [&](i64, float v) { f(keymax - key_of(v), [&] { return weight_of(v, m, c); }); });
    }
};
struct Candidates {  // sample_combine's: range q's slot j of the summary, for j < count[q]
    const i64* summary;
    i64 qstride, jstride;
    const int* count;
    int ranges, per;  // per: slots a range
    u32 keymax;
    __device__ __forceinline__ bool held(int e) const { return e % per < count[e / per]; }
    __device__ __forceinline__ u64 key_index(int e) const {
        return (u64)summary[(e / per) * qstride + (2 + 2 * (e % per)) * jstride];
    }
    __device__ __forceinline__ u64 weight(int e) const {
        return (u64)summary[(e / per) * qstride + (3 + 2 * (e % per)) * jstride];
    }
    template <class F>
    __device__ __forceinline__ void operator()(F f) const {
        for (int e = threadIdx.x; e < ranges * per; e += ml::block_threads()) {
            if (held(e)) f(keymax - (u32)(key_index(e) >> 32), [&] { return weight(e); });
        }
    }
};

// ---- the thresholds ------------------------------------------------------------------------------------

// What selections and the combine hand a visit: functors, as NVRTC 13.0 makes a generic lambda in a
// device template a host function.
template <bool MASS>
struct Tally {  // select's histogram pass: elements with lo <= d <= min(hi, limit) into buckets of 2^shift
    u32 lo, hi, limit;
    int shift;
    u64& last;  // the last bucket, summed in registers
    Shared& s;
    template <class W>
    __device__ __forceinline__ void operator()(u32 d, W weight) const {
        if (d < lo || d > hi || d > limit) return;
        const u64 val = MASS ? weight() : 1ull;
        const u32 b = (d - lo) >> shift;
        if (b >= BUCKETS - 1) {
            last += val;
        } else if (val) {
            atomicAdd(&s.hist[b], val);
        }
    }
};
struct KeyBits {  // the union of the visited keys' bits
    u32 keymax;
    u32& bits;
    template <class W>
    __device__ __forceinline__ void operator()(u32 d, W) const { bits |= keymax - d; }
};
struct KeptWeight {  // the weight of the visited elements with d <= limit
    u32 limit;
    u64& kept;
    template <class W>
    __device__ __forceinline__ void operator()(u32 d, W weight) const { kept += d <= limit ? weight() : 0ull; }
};

// Radix select over the visited elements with d <= limit: the smallest d* whose elements at or below it
// count (MASS false: 1 each) or weigh (MASS true) at least need. With from_total, need is instead
// top_p_target(the elements' total weight, p24), the first pass's total. Every d is a multiple of
// 2^zeros (the keys' common trailing zero bits): bfloat16 rows take one pass where the first pass's
// bucket is not its last, float32 ones three.
template <bool MASS, class V>
__device__ u32 select(const V& visit, u32 limit, u64 need, bool from_total, u64 p24, int zeros, Shared& s) {
    u32 lo = 0, hi = FULL;  // d* lies in [lo, hi]
    int shift = zeros > FIRST_SHIFT ? zeros : FIRST_SHIFT;
    for (bool first = true;; first = false) {
        for (int b = threadIdx.x; b < BUCKETS; b += ml::block_threads()) s.hist[b] = 0;
        ml::block_sync();
        u64 last = 0;  // the last bucket (the first pass's: everything beyond) summed in registers
        visit(Tally<MASS>{lo, hi, limit, shift, last, s});
        const u64 beyond = block_sum(last, s);  // (its barriers also order the atomics before the reads)
        if (threadIdx.x == 0) s.hist[BUCKETS - 1] = beyond;
        ml::block_sync();
        if (from_total && first) {
            u64 mine = 0;
            for (int b = threadIdx.x; b < BUCKETS; b += ml::block_threads()) mine += s.hist[b];
            need = top_p_target(block_sum(mine, s), p24);
        }
        int b;
        u64 before;
        first_reaching([&](int q) { return s.hist[q]; }, BUCKETS, need, b, before, s);
        need -= before;
        const u32 at = lo + ((u32)b << shift);
        hi = b == BUCKETS - 1 ? hi : min(hi, at + ((1u << shift) - 1u));
        lo = at;
        const u32 width = hi - lo;
        if ((width >> zeros) == 0) return lo;  // one multiple of 2^zeros left: lo
        const int bits = 32 - __clz(width);
        shift = bits - RADIX_BITS > zeros ? bits - RADIX_BITS : zeros;
    }
}

// ---- the draw ------------------------------------------------------------------------------------------

// The first index in [lo, hi) of the row whose running sum of kept weights (d <= limit and weight >=
// min_w), from lo, exceeds rest (they must): warp 0, 128 elements at a time (4 a lane, loaded together),
// in index order; every thread gets it.
template <class T, int STRIDE>
__device__ i64 scan_for(const T* x, i64 lo, i64 hi, u64 rest, float m, float c, u32 keymax, u32 limit, u64 min_w,
                        Shared& s) {
    const int lane = threadIdx.x & 31;
    if ((threadIdx.x >> 5) == 0) {
        for (i64 j0 = lo; j0 < hi; j0 += 128) {
            float v[4];
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const i64 i = j0 + 32 * q + lane;
                v[q] = i < hi ? load(x + i * STRIDE) : m;
            }
            bool found = false;
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const i64 i = j0 + 32 * q + lane;
                u64 inclusive = i < hi && keymax - key_of(v[q]) <= limit ? weight_of(v[q], m, c) : 0ull;
                inclusive = inclusive >= min_w ? inclusive : 0ull;
                for (int o = 1; o < 32; o <<= 1) {
                    const u64 y = __shfl_up_sync(FULL, inclusive, o);
                    if (lane >= o) inclusive += y;
                }
                const unsigned hit = __ballot_sync(FULL, inclusive > rest);
                if (hit) {
                    if (lane == 0) s.found[0] = (u64)(j0 + 32 * q + __ffs((int)hit) - 1);
                    found = true;
                    break;
                }
                rest -= __shfl_sync(FULL, inclusive, 31);
            }
            if (found) break;
        }
    }
    ml::block_sync();
    const i64 token = (i64)s.found[0];
    ml::block_sync();
    return token;
}

// Whether a row draws (otherwise its token is the argmax): a temperature of at least 2^-126 (and
// finite: other values are refused before) and a finite largest logit.
__device__ __forceinline__ bool drawing(float m, float temperature) {
    return temperature >= __uint_as_float(0x00800000u) && temperature <= __uint_as_float(0x7f7fffffu) &&
           fabsf(m) <= __uint_as_float(0x7f7fffffu);
}

// ---- the row -------------------------------------------------------------------------------------------

// The token of one row of N logits (STRIDE apart), every thread of the block calling it with the same
// arguments; CHUNK: elements a chunk of the draw's running sums (N <= CHUNK * CHUNKS).
template <class T, int N, int STRIDE, int CHUNK>
__device__ i64 sample_row(const T* x, i64 seed, i64 offset, float temperature, i64 top_k, float top_p, float min_p,
                          Shared& s) {
    static_assert((N + CHUNK - 1) / CHUNK <= CHUNKS, "sample: too many chunks for the draw's running sums");
    static_assert(CHUNK % 128 == 0, "sample: chunks are whole rounds of the draw's scan (128 elements)");
    // the largest logit (argmax's: the first, or the first NaN), and the keys' common trailing zeros
    float m = __uint_as_float(0xff800000u);
    i64 first = 9223372036854775807LL;
    u32 bits = 0;
    for_each<T, STRIDE>(x, N, [&](i64 i, float v) {
        better(m, first, v, i);
        bits |= v == v ? key_of(v) : 0u;
    });
    block_argmax(m, first, s);
    if (!drawing(m, temperature)) return first;
    const int zeros = __ffs((int)block_or(bits, s)) - 1;  // (the largest logit's key is never 0)
    const u32 keymax = key_of(m);
    const float c = __fdiv_rn(__uint_as_float(0x3fb8aa3bu), temperature);  // log2(e) / T
    const Logits<T, STRIDE> row{x, N, m, c, keymax};
    // top-k: d <= the k-th smallest d; top-p: the smallest d whose weight at or below reaches the target
    u32 limit = FULL;
    if (top_k >= 1 && top_k < N) limit = select<false>(row, FULL, (u64)top_k, false, 0, zeros, s);
    const u64 p24 = (u64)__float2ll_rn(__fmul_rn(top_p, 16777216.0f));
    if (p24 < (1ull << 24)) limit = select<true>(row, limit, 0, true, p24, zeros, s);
    const u64 min_w = min_p_weight(min_p);  // min-p, after them: the kept weights below min_w are dropped
    // each chunk's kept weight: a thread's elements come in increasing index order, so it adds what it
    // has of a chunk once it moves on to the next
    constexpr int chunks = (N + CHUNK - 1) / CHUNK;
    for (int k = threadIdx.x; k < chunks; k += ml::block_threads()) s.chunk[k] = 0;
    ml::block_sync();
    int at = -1;
    u64 sum = 0;
    for_each<T, STRIDE>(x, N, [&](i64 i, float v) {
        const int k = (int)(i / CHUNK);
        if (k != at) {
            if (sum) atomicAdd(&s.chunk[at], sum);
            at = k;
            sum = 0;
        }
        if (keymax - key_of(v) <= limit) {
            const u64 w = weight_of(v, m, c);
            sum += w >= min_w ? w : 0ull;
        }
    });
    if (sum) atomicAdd(&s.chunk[at], sum);
    ml::block_sync();
    u64 mine = 0;
    for (int k = threadIdx.x; k < chunks; k += ml::block_threads()) mine += s.chunk[k];
    const u64 total = block_sum(mine, s);
    // the draw: r uniform in [0, total); the chunk whose running sum first exceeds it, then in it the token
    const u64 r = __umul64hi(uniform64((u64)seed, (u64)offset), total);
    int k;
    u64 before;
    first_reaching([&](int q) { return s.chunk[q]; }, chunks, r + 1, k, before, s);
    const i64 end = (i64)(k + 1) * CHUNK < N ? (i64)(k + 1) * CHUNK : N;
    return scan_for<T, STRIDE>(x, (i64)k * CHUNK, end, r - before, m, c, keymax, limit, min_w, s);
}

// ---- split over tiles (megaloop/frontend/ops/sample_split.py) --------------------------------------------

// The row's largest logit and argmax from argmax_partial's indices (argmax_combine's rule), in every thread.
template <class T, int STRIDE>
__device__ void row_max(const T* x, i64 n, const i64* partial, i64 pstride, int ranges, float& m, i64& first, Shared& s) {
    m = __uint_as_float(0xff800000u);
    first = 9223372036854775807LL;
    for (int q = threadIdx.x; q < ranges; q += ml::block_threads()) {
        i64 i = partial[q * pstride];
        i = i < 0 ? 0 : i >= n ? n - 1 : i;
        better(m, first, load(x + i * STRIDE), i);
    }
    block_argmax(m, first, s);
}

// sample_partial of one range [lo, lo + count) of a row whose largest logit is m: out[0] its total
// weight, out[1] the bound (the (L+1)-th largest key, 0 where count <= L) + 2^32 * candidates, then
// (key * 2^32 + index, weight) of each candidate (the keys above the bound) in index order, zeros after;
// all zeros where the row does not draw. ostride: between consecutive int64s of out.
template <class T, int STRIDE, int L>
__device__ void sample_range(const T* x, i64 lo, i64 count, float m, float temperature, i64* out, i64 ostride,
                             Shared& s) {
    int held = 0;
    u64 total = 0, bound = 0;
    if (drawing(m, temperature)) {
        const float c = __fdiv_rn(__uint_as_float(0x3fb8aa3bu), temperature);
        const u32 keymax = key_of(m);
        const T* xr = x + lo * STRIDE;
        u32 bits = 0;
        for_each<T, STRIDE>(xr, count, [&](i64, float v) {
            bits |= key_of(v);
            total += weight_of(v, m, c);
        });
        total = block_sum(total, s);
        const int zeros = __ffs((int)(block_or(bits, s) | keymax)) - 1;
        u32 below = FULL;  // candidates: d < below
        if (count > L) {
            below = select<false>(Logits<T, STRIDE>{xr, count, m, c, keymax}, FULL, L + 1, false, 0, zeros, s);
            bound = keymax - below;
        }
        for (i64 i0 = 0; i0 < count; i0 += ml::block_threads()) {  // compacted in index order
            const i64 i = i0 + threadIdx.x;
            const float v = i < count ? load(xr + i * STRIDE) : 0.0f;
            const u32 key = key_of(v);
            const bool pick = i < count && (count <= L || keymax - key < below);
            u64 picked;
            const int slot = held + (int)block_exclusive_scan(pick ? 1ull : 0ull, picked, s);
            if (pick) {
                out[(2 + 2 * slot) * ostride] = (i64)(((u64)key << 32) | (u64)(lo + i));
                out[(3 + 2 * slot) * ostride] = (i64)weight_of(v, m, c);
            }
            held += (int)picked;
        }
    }
    for (int j = held + threadIdx.x; j < L; j += ml::block_threads()) {
        out[(2 + 2 * j) * ostride] = 0;
        out[(3 + 2 * j) * ostride] = 0;
    }
    if (threadIdx.x == 0) {
        out[0] = (i64)total;
        out[ostride] = (i64)(bound | ((u64)held << 32));
    }
}

// sample_combine's shared memory: the row's own (Shared, for the fallback too), then the ranges' totals and
// candidate counts (the candidates stay in the summary, in global memory).
template <int R>
struct CombineShared {
    Shared row;
    u64 total[R];
    int count[R];
};

// The token of one row from argmax_partial's indices (R ranges of RCHUNK) and sample_partial's summary
// (range q's int64 j at summary[q * qstride + j * jstride], L slots a range); the row whole where the
// candidates do not settle a threshold (sample_row).
template <class T, int N, int STRIDE, int CHUNK, int R, int RCHUNK, int L>
__device__ i64 sample_combined(const T* x, const i64* partial, i64 pstride, const i64* summary, i64 qstride, i64 jstride,
                               i64 seed, i64 offset, float temperature, i64 top_k, float top_p, float min_p,
                               CombineShared<R>& cs) {
    Shared& s = cs.row;
    float m;
    i64 first;
    row_max<T, STRIDE>(x, N, partial, pstride, R, m, first, s);
    if (!drawing(m, temperature)) return first;
    const float c = __fdiv_rn(__uint_as_float(0x3fb8aa3bu), temperature);
    const u32 keymax = key_of(m);
    // the ranges' totals and counts, and the bound: every key above it is a candidate
    u32 bound = 0;
    u64 count = 0, all = 0;
    for (int q = threadIdx.x; q < R; q += ml::block_threads()) {
        const u64 b = (u64)summary[q * qstride + jstride];
        cs.total[q] = (u64)summary[q * qstride];
        cs.count[q] = (int)(b >> 32);
        bound = (u32)b > bound ? (u32)b : bound;
        count += b >> 32;
        all += cs.total[q];
    }
    for (int o = 16; o > 0; o >>= 1) {
        const u32 y = __shfl_xor_sync(FULL, bound, o);
        bound = y > bound ? y : bound;
    }
    if ((threadIdx.x & 31) == 0) s.warp_value[threadIdx.x >> 5] = __uint_as_float(bound);
    count = block_sum(count, s);  // (its barriers publish the totals, counts and the warps' bounds)
    all = block_sum(all, s);
    for (int w = 0; w < (int)(ml::block_threads() >> 5); ++w) {
        const u32 y = __float_as_uint(s.warp_value[w]);
        bound = y > bound ? y : bound;
    }
    const Candidates cand{summary, qstride, jstride, cs.count, R, L, keymax};
    u32 bits = keymax;
    cand(KeyBits{keymax, bits});
    const int zeros = __ffs((int)block_or(bits, s)) - 1;
    const u32 above = keymax - bound;  // every element with d < above is a candidate
    // the thresholds from the candidates, where they settle them
    bool settled = true;
    u32 limit = FULL;
    if (top_k >= 1 && top_k < N) {
        settled = (u64)top_k <= count && (limit = select<false>(cand, FULL, (u64)top_k, false, 0, zeros, s)) < above;
    }
    const u64 p24 = (u64)__float2ll_rn(__fmul_rn(top_p, 16777216.0f));
    if (settled && p24 < (1ull << 24)) {
        u64 kept = 0;
        cand(KeptWeight{limit, kept});
        kept = block_sum(kept, s);
        const u64 target = top_p_target(limit == FULL ? all : kept, p24);
        settled = kept >= target && (limit = select<true>(cand, limit, target, false, 0, zeros, s)) < above;
    }
    // min-p alone: settled where nothing at or below the bound (weights grow with the logits) weighs enough
    const u64 min_w = min_p_weight(min_p);
    if (settled && limit == FULL && min_w && bound) settled = weight_of(value_of(bound), m, c) < min_w;
    if (!settled) return sample_row<T, N, STRIDE, CHUNK>(x, seed, offset, temperature, top_k, top_p, min_p, s);
    const u64 u = uniform64((u64)seed, (u64)offset);
    int k;
    u64 before;
    if (limit == FULL && !min_w) {  // no threshold: the range the draw lands in by the totals, then in it
        const u64 r = __umul64hi(u, all);
        first_reaching([&](int q) { return cs.total[q]; }, R, r + 1, k, before, s);
        const i64 end = (i64)(k + 1) * RCHUNK < N ? (i64)(k + 1) * RCHUNK : N;
        return scan_for<T, STRIDE>(x, (i64)k * RCHUNK, end, r - before, m, c, keymax, FULL, 0, s);
    }
    const auto kept_weight = [&](int e) {  // slot e's weight where kept, in index order (ranges, then slots)
        const u64 w = cand.held(e) && keymax - (u32)(cand.key_index(e) >> 32) <= limit ? cand.weight(e) : 0ull;
        return w >= min_w ? w : 0ull;
    };
    u64 kept = 0;
    for (int e = threadIdx.x; e < R * L; e += ml::block_threads()) kept += kept_weight(e);
    const u64 r = __umul64hi(u, block_sum(kept, s));
    first_reaching(kept_weight, R * L, r + 1, k, before, s);
    return (i64)(cand.key_index(k) & 0xffffffffull);
}

// ---- the tiles (megaloop/codegen/emit_sample.py writes one call each) ---------------------------------

constexpr int DATA_KIND = 3;  // ml::fail's kind for a row's parameters out of range (megaloop/runtime/report.py)

// The dynamic shared memory as S (the emitter reserves BYTES of it).
template <class S, int BYTES>
__device__ __forceinline__ S& shared_as() {
    static_assert(sizeof(S) <= BYTES, "sample: emit_sample.shared_bytes is too small");
    return *reinterpret_cast<S*>(ml_smem4);
}

// A row's sampling parameters, each read at the row's index o (in the rows' index space).
struct Params {
    i64 seed, offset;
    float temperature;
    i64 top_k;
    float top_p, min_p;
};
template <class S, class O, class Tp, class K, class P, class Q>
__device__ __forceinline__ Params params_at(const int* o, S seed, O offset, Tp temperature, K top_k, P top_p,
                                            Q min_p) {
    return {seed.p[seed.offset(o)], offset.p[offset.offset(o)], temperature.p[temperature.offset(o)],
            top_k.p[top_k.offset(o)], top_p.p[top_p.offset(o)], min_p.p[min_p.offset(o)]};
}

// Whether the row's parameters are in range; else the kernel stops, reporting the row (row-major
// among rows of shape ROWS...).
template <int... ROWS>
__device__ __forceinline__ bool checked(const Args& a, const Task& t, int tid, const int* o, const Params& p) {
    if (valid(p.temperature, p.top_k, p.top_p, p.min_p)) return true;
    i64 row = 0;
    int d = 0;
    ((row = row * ROWS + o[d++]), ...);
    if (threadIdx.x == 0) fail(a, DATA, blockIdx.x, tid, t.op, row, 0, DATA_KIND, 0);
    return false;
}

// sample's tile: each row of N logits of the box (rows of shape ROWS...) on the whole block, one after
// another; x's strides: the rows', then along a row (CHUNK: sample_row's).
template <int N, int CHUNK, int BYTES, int... ROWS, class X, class S, class O, class Tp, class K, class P, class Q,
          class Out>
__device__ __forceinline__ void sample_tile(const Args& a, const Task& t, int tid, X x, S seed, O offset,
                                            Tp temperature, K top_k, P top_p, Q min_p, Out out) {
    constexpr int R = sizeof...(ROWS);
    static_assert(X::rank == R + 1 && Out::rank == R, "sample: x is rows of logits, out a token a row");
    Shared& sh = shared_as<Shared, BYTES>();
    for (int e = 0; e < box_count<R>(t); ++e) {
        int o[R + 1];
        box_index<R>(t, e, o);
        const Params p = params_at(o, seed, offset, temperature, top_k, top_p, min_p);
        if (!checked<ROWS...>(a, t, tid, o, p)) return;
        const i64 token = sample_row<typename X::type, N, (int)X::inner, CHUNK>(
            x.p + leading_offset<R>(x, o), p.seed, p.offset, p.temperature, p.top_k, p.top_p, p.min_p, sh);
        if (threadIdx.x == 0) store(out.p + out.offset(o), token);
    }
}

// sample_partial's tile: each range (of RANGES of CHUNK logits) of its rows' N on the whole block, one
// after another: partial, argmax_partial's indices (rows, RANGES); out, the summary (rows, RANGES, slots).
template <int N, int RANGES, int CHUNK, int L, int BYTES, class X, class Pa, class Tp, class Out>
__device__ __forceinline__ void sample_partial_tile(const Task& t, X x, Pa partial, Tp temperature, Out out) {
    constexpr int R = X::rank - 1;
    static_assert(Pa::rank == R + 1 && Tp::rank == R && Out::rank == R + 2, "sample_partial: operand ranks");
    using T = typename X::type;
    Shared& sh = shared_as<Shared, BYTES>();
    for (int e = 0; e < box_count<R + 1>(t); ++e) {
        int o[R + 2];
        box_index<R + 1>(t, e, o);
        const T* row = x.p + leading_offset<R>(x, o);
        float m;
        i64 first;
        row_max<T, (int)X::inner>(row, N, partial.p + leading_offset<R>(partial, o), Pa::inner, RANGES, m, first, sh);
        const i64 lo = (i64)o[R] * CHUNK;
        const float tp = temperature.p[temperature.offset(o)];
        sample_range<T, (int)X::inner, L>(row, lo, min((i64)CHUNK, (i64)N - lo), m, tp,
                                          out.p + leading_offset<R + 1>(out, o), Out::inner, sh);
        ml::block_sync();  // (the shared memory is the next range's)
    }
}

// sample_combine's tile: each row of the box (shape ROWS...) from its RANGES ranges' summaries (L
// candidates each, ranges of RCHUNK), on the whole block, one after another.
template <int N, int CHUNK, int RANGES, int RCHUNK, int L, int BYTES, int... ROWS, class X, class Pa, class Su, class S,
          class O, class Tp, class K, class P, class Q, class Out>
__device__ __forceinline__ void sample_combine_tile(const Args& a, const Task& t, int tid, X x, Pa partial, Su summary,
                                                    S seed, O offset, Tp temperature, K top_k, P top_p, Q min_p,
                                                    Out out) {
    constexpr int R = sizeof...(ROWS);
    static_assert(X::rank == R + 1 && Pa::rank == R + 1 && Su::rank == R + 2 && Out::rank == R,
                  "sample_combine: operand ranks");
    CombineShared<RANGES>& sh = shared_as<CombineShared<RANGES>, BYTES>();
    for (int e = 0; e < box_count<R>(t); ++e) {
        int o[R + 1];
        box_index<R>(t, e, o);
        const Params p = params_at(o, seed, offset, temperature, top_k, top_p, min_p);
        if (!checked<ROWS...>(a, t, tid, o, p)) return;
        const i64 token = sample_combined<typename X::type, N, (int)X::inner, CHUNK, RANGES, RCHUNK, L>(
            x.p + leading_offset<R>(x, o), partial.p + leading_offset<R>(partial, o), Pa::inner,
            summary.p + leading_offset<R>(summary, o), stride_along<R, Su>::value, Su::inner, p.seed, p.offset,
            p.temperature, p.top_k, p.top_p, p.min_p, sh);
        if (threadIdx.x == 0) store(out.p + out.offset(o), token);
        ml::block_sync();  // (the shared memory is the next row's)
    }
}

// ---- penalize (megaloop/frontend/ops/sample_penalty.py) --------------------------------------------------

constexpr int PENALTY_KIND = 4;  // ml::fail's kind for a penalty or count out of range (megaloop/runtime/report.py)

// A logit penalised as the definition says, each step a rounded float32 operation (no contraction).
__device__ __forceinline__ float penalized(float x, i64 count, bool in_prompt, float repetition, float presence,
                                          float frequency) {
    if (in_prompt || count > 0) x = x < 0.0f ? __fmul_rn(x, repetition) : __fdiv_rn(x, repetition);
    x = __fsub_rn(x, __fmul_rn(frequency, (float)count));
    return count > 0 ? __fsub_rn(x, presence) : x;
}

__device__ __forceinline__ bool valid_penalties(i64 count, float repetition, float presence, float frequency) {
    const float big = __uint_as_float(0x7f7fffffu);
    return count >= 0 && repetition > 0.0f && repetition <= big && fabsf(presence) <= big && fabsf(frequency) <= big;
}

// penalize's tile: every element of the task's box (logits of shape SHAPE..., the operands in its index
// space); an element out of range stops the kernel, reporting its row (row-major among the rows) and token.
template <int... SHAPE, class X, class C, class M, class Rp, class Pr, class Fr, class Out>
__device__ __forceinline__ void penalize_tile(const Args& a, const Task& t, int tid, X x, C counts, M prompt,
                                              Rp repetition, Pr presence, Fr frequency, Out out) {
    constexpr int N = sizeof...(SHAPE);
    constexpr int dims[N] = {SHAPE...};
    static_assert(X::rank == N && Out::rank == N, "penalize: the operands in the logits' index space");
    const int total = box_count<N>(t);
    for (int e = threadIdx.x; e < total; e += ml::block_threads()) {
        int i[N];
        box_index<N>(t, e, i);
        const i64 c = load(counts.p + counts.offset(i));
        const float r = load(repetition.p + repetition.offset(i)), p = load(presence.p + presence.offset(i));
        const float f = load(frequency.p + frequency.offset(i));
        if (!valid_penalties(c, r, p, f)) {
            i64 row = 0;
            for (int d = 0; d + 1 < N; ++d) row = row * dims[d] + i[d];
            fail(a, DATA, blockIdx.x, tid, t.op, row, i[N - 1], PENALTY_KIND, 0);
            return;
        }
        const bool seen = load(prompt.p + prompt.offset(i));
        store(out.p + out.offset(i), penalized(load(x.p + x.offset(i)), c, seen, r, p, f));
    }
}

}  // namespace smp
}  // namespace ml

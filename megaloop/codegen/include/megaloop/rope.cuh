// megaloop/rope.cuh: rope's tile and the angle of its pairs (megaloop/codegen/emit.py instantiates
// it; megaloop/cache.cuh's rope_kv_update turns pairs with the same arithmetic). The code also
// compiles on the host: tests/test_rope_kv_codegen.py runs it there with a shim for the CUDA builtins.
#pragma once
#include "megaloop/elementwise.cuh"

namespace ml {

// the lowest bit set in M (-1: none)
template <unsigned M, int D = 0>
struct lowest_bit {
    static constexpr int value = (M & 1) ? D : lowest_bit<(M >> 1), D + 1>::value;
};
template <int D>
struct lowest_bit<0, D> {
    static constexpr int value = -1;
};

// sum(i[d] * stride[d]) over the leading axes (all but the last) that are in Moving (bit d: axis d
// has more than one index; the others are at index 0)
template <unsigned Moving, class T, i64... S>
__device__ __forceinline__ i64 lead_offset(const At<T, S...>&, const int* i) {
    i64 o = 0;
    int d = 0;
    ((o += S != 0 && d + 1 < (int)sizeof...(S) && ((Moving >> d) & 1) ? (i64)i[d] * S : 0, ++d), ...);
    return o;
}

// sin and cos (float32) of pv * w. The product is float64 (as the reference: at position 1e6 float32
// would be off by 0.03 rad), and so is its reduction by k quarter turns (Cody-Waite, pi/2 in two
// doubles); float32 polynomials take the rest, |r| <= pi/4, and k mod 4 becomes swaps and signs.
__device__ __forceinline__ void rope_angle(double pv, double w, float& s, float& c) {
    // Cephes' sinf/cosf minimax polynomials: at most 0.73 ulp (sin), 0.88 ulp (cos) on [0, pi/4]
    constexpr float SIN0 = -0x1.9943f2p-13f, SIN1 = 0x1.11073cp-7f, SIN2 = -0x1.555546p-3f;
    constexpr float COS0 = 0x1.99eb9cp-16f, COS1 = -0x1.6c0c34p-10f, COS2 = 0x1.55554ap-5f;
    // 2/pi, pi/2 and the double nearest to what it leaves out, and 1.5 * 2^52: adding it rounds a
    // float64 below 2^51 to an integer (positions below 3e15 at frequency 1)
    constexpr double TWO_OVER_PI = 0x1.45f306dc9c883p-1, PIO2_HI = 0x1.921fb54442d18p+0;
    constexpr double PIO2_LO = 0x1.1a62633145c07p-54, ROUND_MAGIC = 0x1.8p+52;
    const double ang = pv * w;
    // k = ang / (pi/2) to the nearest integer, the integer part of t: no float64 rint or conversion
    const double t = fma(ang, TWO_OVER_PI, ROUND_MAGIC);
    const double k = t - ROUND_MAGIC;
    const float r = (float)fma(-k, PIO2_LO, fma(-k, PIO2_HI, ang));
    const float z = r * r;
    const float sr = fmaf(fmaf(fmaf(SIN0, z, SIN1), z, SIN2) * z, r, r);
    const float cr = fmaf(fmaf(fmaf(fmaf(COS0, z, COS1), z, COS2), z, -0.5f), z, 1.0f);
    long long bits;
    memcpy(&bits, &t, sizeof bits);
    const int q = (int)(bits & 3);  // k mod 4: t's last bits (the magic number is a multiple of 4)
    s = (q & 1) ? cr : sr;
    c = (q & 1) ? sr : cr;
    if (q & 2) s = -s;
    if ((q + 1) & 2) c = -c;
}

// element k of a pack in compute type (ml::get reads 16-bit elements from 32-bit words: packs of 2+)
template <int W, class T>
__device__ __forceinline__ float pack_at(const Pack<T, W>& p, int k) {
    if constexpr (W > 1) {
        return get(p, k);
    } else {
        return load(&p.v[k]);
    }
}

// Dims [r W, r W + W) of a contiguous head vector x rotated at position pv with rope's formula and
// rounded to T as rope stores them (attention's append form: q, and the new key as the cache gets it).
// Packs hold whole runs of pairs: W divides RD / 2 (neox) or RD (interleaved, W even).
template <int RD, bool Neox, int W, class T>
__device__ __forceinline__ Pack<T, W> rope_head_pack(const T* x, int r, double pv, const double* inv_freq) {
    static_assert(Neox ? (RD / 2) % W == 0 : (RD % W == 0 && W % 2 == 0), "rope_head_pack: packs of whole pairs");
    const int d0 = r * W;
    const Pack<T, W> a = load_pack<T, W>(x + d0);
    if (d0 >= RD) return a;  // past rotary_dim: as it is
    Pack<T, W> out;
    if constexpr (Neox) {
        constexpr int HALF = RD / 2;
        const bool first = d0 < HALF;
        const Pack<T, W> b = load_pack<T, W>(x + (first ? d0 + HALF : d0 - HALF));
#pragma unroll
        for (int k = 0; k < W; ++k) {
            float s, c;
            rope_angle(pv, inv_freq[(first ? d0 : d0 - HALF) + k], s, c);
            const float xd = pack_at<W>(a, k), xp = pack_at<W>(b, k);
            set(out, k, fmaf(xd, c, first ? -(xp * s) : xp * s));
        }
    } else {
#pragma unroll
        for (int k = 0; k < W / 2; ++k) {
            float s, c;
            rope_angle(pv, inv_freq[d0 / 2 + k], s, c);
            const float x1 = get(a, 2 * k), x2 = get(a, 2 * k + 1);
            set(out, 2 * k, fmaf(x1, c, -(x2 * s)));
            set(out, 2 * k + 1, fmaf(x2, c, x1 * s));
        }
    }
    return out;
}

// Dim d of a head vector x (element stride XS) rotated at position pv as rope_head_pack, in float
template <int RD, bool Neox, class T>
__device__ __forceinline__ float rope_head_dim(const T* x, i64 xs, int d, double pv, const double* inv_freq) {
    constexpr int HALF = RD / 2;
    const float xd = load(x + (i64)d * xs);
    if (d >= RD) return xd;
    const int f = Neox ? d % HALF : d / 2;
    const int p = Neox ? (d < HALF ? d + HALF : d - HALF) : d ^ 1;
    const bool first = Neox ? d < HALF : !(d & 1);
    float s, c;
    rope_angle(pv, inv_freq[f], s, c);
    const float xp = load(x + (i64)p * xs);
    T r;
    store(&r, fmaf(xd, c, first ? -(xp * s) : xp * s));
    return load(&r);
}

// One item of the per-pair path (see rope_pairs), turned and stored at o: W pairs of packs pa, pb
// (neox), W / 2 pairs in pa (interleaved); an item past the rotary dims (j >= ROT_ITEMS) copied.
template <int RD, bool Neox, int W, int ROT_ITEMS, int ITEMS, class TO, class T>
__device__ __forceinline__ void rope_item(TO* o, int j, double pv, const double* inv_freq, const Pack<T, W>& pa,
                                          const Pack<T, W>& pb) {
    constexpr int HALF = RD / 2;
    if (ROT_ITEMS == ITEMS || j < ROT_ITEMS) {
        if constexpr (Neox) {
            Pack<TO, W> qa, qb;
#pragma unroll
            for (int k = 0; k < W; ++k) {
                float s, c;
                rope_angle(pv, inv_freq[j * W + k], s, c);
                const float x1 = pack_at<W>(pa, k), x2 = pack_at<W>(pb, k);
                set(qa, k, fmaf(x1, c, -(x2 * s)));
                set(qb, k, fmaf(x2, c, x1 * s));
            }
            store_pack<TO, W>(o + j * W, qa);
            store_pack<TO, W>(o + HALF + j * W, qb);
        } else {
            Pack<TO, W> qa;
#pragma unroll
            for (int k = 0; k < W / 2; ++k) {
                float s, c;
                rope_angle(pv, inv_freq[j * (W / 2) + k], s, c);
                const float x1 = get(pa, 2 * k), x2 = get(pa, 2 * k + 1);
                set(qa, 2 * k, fmaf(x1, c, -(x2 * s)));
                set(qa, 2 * k + 1, fmaf(x2, c, x1 * s));
            }
            store_pack<TO, W>(o + j * W, qa);
        }
    } else if constexpr (Neox) {  // past rotary_dim: the pack copied
        store_pack<TO, W>(o + HALF + j * W, pb);
    } else {
        store_pack<TO, W>(o + j * W, pa);
    }
}

// rope's per-pair path over whole rows: U items a thread (a pack of a row and its partner pack) loaded
// before any is stored, as a store may alias the next load. False, having done nothing, where the box
// is not whole rows, a pointer is unaligned or the items reach 2^31 (32-bit index arithmetic).
template <int HD, int RD, bool Neox, int W, int U, unsigned Moving, class O, class X, class P>
__device__ __forceinline__ bool rope_pairs(const Task& t, const double* inv_freq, O out, X x, P pos) {
    using T = typename X::type;
    using TO = typename O::type;
    constexpr int N = X::rank, last = N - 1, HALF = RD / 2, ROTATED = Neox ? RD / 2 : RD;
    constexpr int ROT_ITEMS = ROTATED / W, ITEMS = (ROTATED + HD - RD) / W;  // per row
    constexpr int OUTER = lowest_bit<Moving>::value;  // the outermost axis that moves
    static_assert(X::inner == 1 && O::inner == 1, "rope: packs along a contiguous last axis");
    static_assert(Neox || W % 2 == 0, "rope: interleaved packs hold whole pairs");
    const int lo = t.lo[last], hi = t.hi[last];  // (both read before either is tested: one branch)
    // (nested, not early returns: those made ptxas add a BSSY/BREAK pair around the loop)
    if (lo == 0 && hi == HD && aligned(x.p, W * (int)sizeof(T)) && aligned(out.p, W * (int)sizeof(TO))) {
        i64 rows = 1;
#pragma unroll
        for (int d = 0; d < last; ++d)
            if ((Moving >> d) & 1) rows *= (i64)(t.hi[d] - t.lo[d]);
        if (rows * ITEMS <= 0x7fffffff) {  // 32-bit index arithmetic
            const unsigned total = (unsigned)(rows * ITEMS);
            for (unsigned e0 = threadIdx.x; e0 < total; e0 += U * ml::block_threads()) {
                Pack<T, W> pa[U], pb[U];
                double pv[U];
                i64 ob[U];
                int jj[U];
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    // past the end: the last item again, loaded but never stored (defined without a branch)
                    const unsigned e = u == 0 ? e0 : min(e0 + u * ml::block_threads(), total - 1);
                    const int j = (int)(e % (unsigned)ITEMS);
                    unsigned r = e / (unsigned)ITEMS;
                    int i[last > 0 ? last : 1];
#pragma unroll
                    for (int d = last - 1; d >= 0; --d) {  // the item's row, innermost axis first
                        if (!((Moving >> d) & 1)) {
                            i[d] = 0;
                        } else if (d == OUTER) {
                            i[d] = t.lo[d] + (int)r;
                        } else {
                            const unsigned ext = t.hi[d] - t.lo[d];
                            i[d] = t.lo[d] + (int)(r % ext);
                            r /= ext;
                        }
                    }
                    const i64 xb = lead_offset<Moving>(x, i);
                    ob[u] = lead_offset<Moving>(out, i);
                    jj[u] = j;
                    pv[u] = (double)load(pos.p + pos.offset(i));
                    if constexpr (Neox) {  // a copied item's pack is its partner's: its own load reads the same address
                        const int first = ROT_ITEMS == ITEMS || j < ROT_ITEMS ? j * W : HALF + j * W;
                        pa[u] = load_pack<T, W>(x.p + xb + first);
                        pb[u] = load_pack<T, W>(x.p + xb + HALF + j * W);
                    } else {
                        pa[u] = load_pack<T, W>(x.p + xb + j * W);
                    }
                }
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    if (u > 0 && e0 + u * ml::block_threads() >= total) break;
                    rope_item<RD, Neox, W, ROT_ITEMS, ITEMS, TO>(out.p + ob[u], jj[u], pv[u], inv_freq, pa[u], pb[u]);
                }
            }
            return true;
        }
    }
    return false;
}

// out[d] = x[d] cos - x[p] sin, out[p] = x[p] cos + x[d] sin for each pair (d, p) of the first RD dims
// (neox: d, d + RD/2; interleaved: 2f, 2f + 1) at angle pos * inv_freq[f], dims past RD copied; the
// per-pair path (W > 0) where it applies, else element by element. pos over x's leading axes.
template <int HD, int RD, bool Neox, int W, int U, unsigned Moving, class O, class X, class P>
__device__ __forceinline__ void rope(const Task& t, const double* inv_freq, O out, X x, P pos) {
    constexpr int N = X::rank, HALF = RD / 2;
    static_assert(O::rank == N && P::rank == N - 1, "rope: out as x, pos over x's leading axes");
    if constexpr (W > 0) {
        if (rope_pairs<HD, RD, Neox, W, U, Moving>(t, inv_freq, out, x, pos)) return;
    }
    for_box<N>(t, [&](const int* i) {
        const i64 xb = lead_offset<Moving>(x, i), ob = lead_offset<Moving>(out, i);
        const int d = i[N - 1];
        if (d >= RD) {
            store(out.p + ob + (i64)d * O::inner, load(x.p + xb + (i64)d * X::inner));
            return;
        }
        const int f = Neox ? d % HALF : d / 2;
        const int p = Neox ? (d < HALF ? d + HALF : d - HALF) : d ^ 1;
        const float sign = (Neox ? d < HALF : !(d & 1)) ? -1.0f : 1.0f;
        const double pv = (double)load(pos.p + pos.offset(i));
        float s, c;
        rope_angle(pv, inv_freq[f], s, c);
        const float xd = load(x.p + xb + (i64)d * X::inner), xp = load(x.p + xb + (i64)p * X::inner);
        store(out.p + ob + (i64)d * O::inner, fmaf(xd, c, sign * (xp * s)));
    });
}

// rope_table's tile, element by element: for d < RD with partner p (neox: d +- RD/2; interleaved:
// d ^ 1), out[d] = x[d] cos[f] -+ x[p] sin[f] (minus for the pair's first dim), f = d, or its pair's
// index where PerPair; in float64 (the products of float32 values are exact there: the reference's
// bits), rounded once; dims past RD copied. The tables' strides are in x's index space (their last
// axis indexes f).
template <int RD, bool Neox, bool PerPair, class O, class X, class C, class S>
__device__ __forceinline__ void rope_table(const Task& t, O out, X x, C cos, S sin) {
    constexpr int N = X::rank, HALF = RD / 2;
    static_assert(O::rank == N && C::rank == N && S::rank == N, "rope_table: out, cos and sin in x's index space");
    for_box<N>(t, [&](const int* i) {
        const int d = i[N - 1];
        const i64 xd = x.offset(i);
        if (d >= RD) {
            store(out.p + out.offset(i), load(x.p + xd));
            return;
        }
        const int p = Neox ? (d < HALF ? d + HALF : d - HALF) : d ^ 1;
        const bool first = Neox ? d < HALF : !(d & 1);
        const int f = PerPair ? (Neox ? d % HALF : d / 2) : d;
        const double c = load(cos.p + cos.offset(i) + (i64)(f - d) * C::inner);
        const double s = load(sin.p + sin.offset(i) + (i64)(f - d) * S::inner);
        const double a = load(x.p + xd), b = load(x.p + xd + (i64)(p - d) * X::inner);
        store(out.p + out.offset(i), (float)(a * c + (first ? -b : b) * s));
    });
}

}  // namespace ml

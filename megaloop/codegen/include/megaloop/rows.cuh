// megaloop/rows.cuh: one tile of a row op (softmax / log_softmax along an axis, layernorm / rmsnorm
// along the last); megaloop/codegen/emit_rows.py instantiates ml::rows with the row's length, the
// operands' layouts (At, elementwise.cuh) and the block-per-row layout it chose (BlockRows).
//
// Three paths walk a row for the op's program: a warp a row element by element (any strides: the
// definition), a warp a row in 16-byte packs (WarpRow), and the block-per-row path (HeldRow): groups
// of warps each reducing rows of their own, a thread holding its packs of the row in registers (one
// read of the row), the group's next rows streaming into a ring of row slots in shared memory.
#pragma once
#include "megaloop/elementwise.cuh"

namespace ml {

enum RowOp : int { ROW_SOFTMAX, ROW_LOG_SOFTMAX, ROW_LAYERNORM, ROW_RMSNORM };

template <class A>
__device__ __forceinline__ bool aligned_operand(const A& a, int w) {
    if constexpr (is_present<A>::value) return aligned(a.p, w * (int)sizeof(typename A::type));
    else return true;
}

// the offset of an operand's row: its strides over every axis but the row's
template <int Axis, class A>
__device__ __forceinline__ i64 row_offset(const A&, const int* i) {
    return 0;  // (Absent)
}
template <int Axis, class T, i64... S>
__device__ __forceinline__ i64 row_offset(const At<T, S...>&, const int* i) {
    i64 o = 0;
    int d = 0;
    ((o += S != 0 && d != Axis ? (i64)i[d] * S : 0, ++d), ...);
    return o;
}

// The block-per-row layout (emit_rows.block_rows): Groups groups of Threads threads, each group on
// rows of its own (group g rows g, g + Groups, ...), a thread holding Held packs of its row; Ring row
// slots in shared memory (Ring / Groups a group); Parts partial sums a thread; Keep: softmax keeps
// each exponential for its store pass, a norm its weight's and bias's packs for the whole task.
// Groups == 0: no block path (the warp paths only).
template <int Groups = 0, int Threads = 0, int Held = 0, int Ring = 0, int Parts = 1, bool Keep = false>
struct BlockRows {
    static constexpr int groups = Groups, threads = Threads, held = Held, ring = Ring, parts = Parts;
    static constexpr bool keep = Keep;
};

// P running partials (a thread's pack u into partial u % P: a row's elements are not one chain of
// dependent adds), added pairwise in a fixed order: ((p0 + p1) + (p2 + p3))
template <int P>
struct Partials {
    float p[P];
    __device__ __forceinline__ explicit Partials(float init) {
#pragma unroll
        for (int a = 0; a < P; ++a) p[a] = init;
    }
    __device__ __forceinline__ float& operator[](int u) { return p[u % P]; }
    __device__ __forceinline__ float total() const {
        float s[P];
#pragma unroll
        for (int a = 0; a < P; ++a) s[a] = p[a];
#pragma unroll
        for (int n = P; n > 1; n = (n + 1) / 2) {
#pragma unroll
            for (int a = 0; a < n / 2; ++a) s[a] = s[2 * a] + s[2 * a + 1];
            if (n % 2) s[n / 2] = s[n - 1];
        }
        return s[0];
    }
};

// A warp's walk over one row: element by element (W == 1, any strides) or in packs of W (a row of
// whole aligned packs, stride 1). each(f) calls f(u, q, j, v) for every element j (value v, as
// float; u, q: its pack and place there), reading the row afresh from memory each time.
template <int Axis, int Len, int W, class O, class X, class Res>
struct WarpRow {
    using TX = typename X::type;
    static constexpr int parts = 1;
    static constexpr i64 xs = stride_along<Axis, X>::value, os = stride_along<Axis, O>::value;
    static constexpr i64 rs = stride_along<Axis, Res>::value;
    O out;
    X x;
    Res res;
    i64 xb, ob, rb;
    int lane;

    // the row's element j: x's, plus the residual's (rounded to x's dtype, as an add stores it)
    __device__ __forceinline__ float value(int j) const {
        if constexpr (is_present<Res>::value)
            return add_rounded(x.p + xb + (i64)j * xs, res.p + rb + (i64)j * rs);
        else return load(x.p + xb + (i64)j * xs);
    }
    __device__ __forceinline__ Pack<TX, W> pack(int j0) const {
        if constexpr (is_present<Res>::value)
            return add_rounded(load_pack<TX, W>(x.p + xb + j0), load_pack<TX, W>(res.p + rb + j0));
        else return load_pack<TX, W>(x.p + xb + j0);
    }
    template <class F>
    __device__ __forceinline__ void each(F f) const {
        if constexpr (W == 1) {
            for (int j = lane; j < Len; j += 32) f(0, 0, j, value(j));
        } else {
            for (int j0 = lane * W; j0 < Len; j0 += 32 * W) {
                const Pack<TX, W> px = pack(j0);
#pragma unroll
                for (int q = 0; q < W; ++q) f(0, q, j0 + q, get(px, q));
            }
        }
    }
    // out[j] = f(u, q, j, v) for every j (before: per-pack work of the block path, none here)
    template <class Before, class F>
    __device__ __forceinline__ void store_each(Before, F f) const {
        using TO = typename O::type;
        if constexpr (W == 1) {
            each([&](int u, int q, int j, float v) { store(out.p + ob + (i64)j * os, f(u, q, j, v)); });
        } else {
            for (int j0 = lane * W; j0 < Len; j0 += 32 * W) {
                const Pack<TX, W> px = pack(j0);
                Pack<TO, W> po;
#pragma unroll
                for (int q = 0; q < W; ++q) set(po, q, f(0, q, j0 + q, get(px, q)));
                store_pack<TO, W>(out.p + ob + j0, po);
            }
        }
    }
    __device__ __forceinline__ float sum(float v) const { return warp_sum(v); }
    __device__ __forceinline__ float max(float v) const { return warp_max(v); }
    __device__ __forceinline__ void refill() const {}
};

// A group's row on the block path: this thread's packs of it (px[u] is pack tg + u * T), held in
// registers; sums are the group's (one barrier each), refill() starts the copy of the group's next
// row into this row's slot (the row is in px: its slot is free).
template <int Len, int W_, class B, class O, class TX_, class Refill>
struct HeldRow {
    using TX = TX_;
    using TO = typename O::type;
    static constexpr int W = W_, T = B::threads, G = B::groups, H = B::held, parts = B::parts;
    static constexpr int packs = Len / W;
    static constexpr bool full = packs == H * T, keep = B::keep;  // full: every thread holds H packs
    const Pack<TX, W> (&px)[H];
    O out;
    i64 ob;
    int tg, g;
    float* red;
    int& rk;  // group reductions so far: which half of red the next one uses
    Refill refill;

    // f(u, pk) for each pack pk of the row this thread holds (px[u])
    template <class F>
    __device__ __forceinline__ void for_packs(F f) const {
#pragma unroll
        for (int u = 0; u < H; ++u) {
            const int pk = tg + u * T;
            if (!full && pk >= packs) break;
            f(u, pk);
        }
    }
    template <class F>
    __device__ __forceinline__ void each(F f) const {
        for_packs([&](int u, int pk) {
#pragma unroll
            for (int q = 0; q < W; ++q) f(u, q, pk * W + q, get(px[u], q));
        });
    }
    // out[j] = f(u, q, j, v) in packs, before(u, pk) first for each pack
    template <class Before, class F>
    __device__ __forceinline__ void store_each(Before before, F f) const {
        for_packs([&](int u, int pk) {
            before(u, pk);
            Pack<TO, W> po;
#pragma unroll
            for (int q = 0; q < W; ++q) set(po, q, f(u, q, pk * W + q, get(px[u], q)));
            store_pack<TO, W>(out.p + ob + pk * W, po);
        });
    }
    __device__ __forceinline__ float sum(float v) const { return group_sum<T / 32, G>(v, red, rk++, g); }
};

// A norm's weight or bias: element j loaded where it is used (warp paths); this thread's packs loaded
// once a task (block path: its columns are the same in every row; a load a row put an L2 round trip
// between each row's reduction and its stores); or, where those do not fit, one 16-byte load a pack.
template <class A>
struct ParamAt {
    A a;
    __device__ __forceinline__ void pack(int, int) {}
    __device__ __forceinline__ float get(int, int, int j) const { return load(a.p + (i64)j * A::inner); }
};
template <class A>
__device__ __forceinline__ auto param_at(A a) {
    if constexpr (is_present<A>::value) return ParamAt<A>{a};
    else return a;
}
template <class A, int W, int H>
struct HeldParam {
    Pack<typename A::type, W> p[H];
    __device__ __forceinline__ void pack(int, int) {}
    __device__ __forceinline__ float get(int u, int q, int) const { return ml::get(p[u], q); }
};
template <class A, int W>
struct PackParam {
    A a;
    Pack<typename A::type, W> cur;
    __device__ __forceinline__ void pack(int, int pk) { cur = load_pack<typename A::type, W>(a.p + pk * W); }
    __device__ __forceinline__ float get(int, int q, int) const { return ml::get(cur, q); }
};
template <int Len, int W, class B, class A>
__device__ __forceinline__ auto block_param(A a, int tg) {
    if constexpr (!is_present<A>::value) {
        return a;
    } else if constexpr (B::keep) {
        HeldParam<A, W, B::held> h;
#pragma unroll
        for (int u = 0; u < B::held; ++u)
            h.p[u] = load_pack<typename A::type, W>(a.p + min(tg + u * B::threads, Len / W - 1) * W);
        return h;
    } else {
        return PackParam<A, W>{a, {}};
    }
}

// layernorm / rmsnorm of one row: y = (x - mean) / sqrt(var + eps) (rmsnorm: x / sqrt(mean(x^2) +
// eps)), times the weight, plus the bias, where present
template <int Op, int Len, class R, class Wt, class Bs>
__device__ __forceinline__ void norm_row(const R& r, float eps, Wt& w, Bs& b) {
    constexpr int P = R::parts;
    float mean = 0.0f, inv;
    if constexpr (Op == ROW_LAYERNORM) {
        Partials<P> s(0.0f);
        r.each([&](int u, int, int, float v) { s[u] += v; });
        const float st = s.total();
        r.refill();
        mean = r.sum(st) / (float)Len;
        Partials<P> q2(0.0f);
        r.each([&](int u, int, int, float v) {
            const float d = v - mean;
            q2[u] += d * d;
        });
        const float qt = q2.total();
        inv = 1.0f / sqrtf(r.sum(qt) / (float)Len + eps);
    } else {
        Partials<P> q2(0.0f);
        r.each([&](int u, int, int, float v) { q2[u] += v * v; });
        const float qt = q2.total();
        r.refill();
        inv = 1.0f / sqrtf(r.sum(qt) / (float)Len + eps);
    }
    r.store_each(
        [&](int u, int pk) {
            w.pack(u, pk);
            b.pack(u, pk);
        },
        [&](int u, int q, int j, float v) {
            float y = Op == ROW_LAYERNORM ? (v - mean) * inv : v * inv;
            if constexpr (is_present<Wt>::value) y = y * w.get(u, q, j);
            if constexpr (is_present<Bs>::value) y = y + b.get(u, q, j);
            return y;
        });
}

// softmax / log_softmax of one row on a warp: its max, the sum of exp(x - max), then the outputs
// (one division a row, a multiplication an element: a division an element made them issue-bound)
template <int Op, class R>
__device__ __forceinline__ void softmax_warp_row(const R& r) {
    float m = neg_inf();
    r.each([&](int, int, int, float v) { m = (v > m || v != v) ? v : m; });
    m = r.max(m);
    float s = 0.0f;
    r.each([&](int, int, int, float v) { s += expf(v - m); });
    s = r.sum(s);
    const float inv_s = 1.0f / s;
    r.store_each([](int, int) {}, [&](int, int, int, float v) {
        if constexpr (Op == ROW_SOFTMAX) return expf(v - m) * inv_s;
        else return (v - m) - logf(s);
    });
}

// softmax / log_softmax of one row on the block path, one barrier a row: each warp takes its
// exponentials relative to its own max and sums them, and the warps' (max, sum) pairs are combined
// once (two block reductions in turn left the row's processing longer than its transfer). The maxima
// are taken in the row's dtype a pack at a time (16-bit: two elements an instruction, no
// conversions); a NaN needs no max of its own: it reaches every output through the sum, as in torch.
template <int Op, class R>
__device__ __forceinline__ void softmax_held_row(const R& r) {
    using TX = typename R::TX;
    constexpr int P = R::parts, W = R::W, H = R::H;
    constexpr float LOG2E = 1.4426950408889634f;
    // 16-bit results (8 or 11 bits): 2^((v - mt) log2 e) to ~2 float32 ulps in three instructions
    // (expf's range reduction made these rows issue-bound). Not fmaf(v, log2 e, -mt log2 e): mt log2 e
    // overflows for a bf16 row masked with finfo(bf16).min and is inexact for huge |mt|
    constexpr bool approx = sizeof(typename R::TO) == 2;
    Pack<TX, W> mp[P];  // running maxima of this thread's packs
#pragma unroll
    for (int a = 0; a < P; ++a) mp[a] = neg_inf_pack<TX, W>();
    r.for_packs([&](int u, int) { max_into(mp[u % P], r.px[u]); });
#pragma unroll
    for (int a = 1; a < P; ++a) max_into(mp[0], mp[a]);
    float m = pack_max(mp[0]);
    r.refill();
    m = warp_fmax(m);
    const float mt = m == neg_inf() ? 0.0f : m;  // a warp of -inf only: exps of 0
    const auto exp_of = [&](float v) {
        if constexpr (approx) return exp2_approx((v - mt) * LOG2E);
        else return expf(v - mt);
    };
    Partials<P> sp(0.0f);
    // softmax keeps each exponential for the store pass where R::keep (registers), else computes it
    // twice; the same values
    constexpr bool keep = Op == ROW_SOFTMAX && R::keep;
    float ex[keep ? H : 1][W];
    r.each([&](int u, int q, int, float v) {
        const float e = exp_of(v);
        if constexpr (keep) ex[u][q] = e;
        sp[u] += e;
    });
    float s = sp.total();
    s = warp_sum(s);
    float mx = m, sx = s;
    group_max_sumexp<R::T / 32, R::G>(mx, sx, r.red, r.rk++, r.g);  // the row's max, sum of exp(x - max)
    const auto none = [](int, int) {};
    if constexpr (Op == ROW_SOFTMAX) {
        // the warp's exps are relative to mt: rescaled to the row's max with the sum's reciprocal;
        // nothing to rescale where they are all 0, unless the whole row is -inf (NaN, as torch)
        // (__fdividef: 2 ulps, where IEEE division is a call-guarded sequence; 0 < sx <= Len)
        const float c = (s == 0.0f && mx != neg_inf()) ? 0.0f : __fdividef(expf(m - mx), sx);
        if constexpr (keep || !approx) {
            r.store_each(none, [&](int u, int q, int, float v) {
                if constexpr (keep) return ex[u][q] * c;
                else return exp_of(v) * c;
            });
        } else {
            // recomputed exps take c in their exponent: 2^((v - mt) log2 e + log2 c), one FFMA for
            // the FADD, FMUL and FMUL (c = 0: log2 c = -inf, the output 0; NaN stays NaN)
            const float lc = log2f(c);
            r.store_each(none, [&](int, int, int, float v) { return exp2_approx(fmaf(v - mt, LOG2E, lc)); });
        }
    } else {
        r.store_each(none, [&](int, int, int, float v) { return (v - mx) - logf(sx); });
    }
}

// The warp paths over the task's rows: element by element (W == 1) or in packs of W
template <int Op, int Axis, int Len, int W, class O, class X, class Res, class Wt, class Bs>
__device__ __forceinline__ void warp_rows(const Task& rowt, float eps, O out, X x, Res res, Wt w, Bs b) {
    for_box_warps<X::rank>(rowt, [&](const int* o, int lane) {
        const WarpRow<Axis, Len, W, O, X, Res> r{
            out, x, res, row_offset<Axis>(x, o), row_offset<Axis>(out, o), row_offset<Axis>(res, o), lane};
        if constexpr (Op == ROW_SOFTMAX || Op == ROW_LOG_SOFTMAX) {
            softmax_warp_row<Op>(r);
        } else {
            auto pw = param_at(w);
            auto pb = param_at(b);
            norm_row<Op, Len>(r, eps, pw, pb);
        }
    });
}

// The block path: groups of warps each on rows of their own (B), the group's next Ring / Groups rows
// in flight into its slots (cp.async: a copy in flight is not waited for by a barrier, so the rows
// stream across each row's reductions). Each thread copies and reads back only its own packs
// (pk = tg + u * Threads): no barrier guards a slot.
template <int Op, int Axis, int Len, int W, class B, class O, class X, class Res, class Wt, class Bs>
__device__ __forceinline__ void block_rows(const Task& rowt, float eps, O out, X x, Res res, Wt w, Bs b) {
    using TX = typename X::type;
    using PX = Pack<TX, W>;
    constexpr int N = X::rank, G = B::groups, T = B::threads, H = B::held, S = B::ring / G, packs = Len / W;
    constexpr bool full = packs == H * T, residual = is_present<Res>::value;
    static_assert(G > 0 && S > 0 && H * T >= packs, "block_rows: every pack of a row held by a thread");
    __shared__ float red[128 * G];  // the warps' partial results (group_sum), 128 a group
    const int nrows = box_count<N>(rowt);
    auto row_at = [&](int e, i64& xb, i64& ob, i64& rb) {
        int o[N + 1];
        box_index<N>(rowt, e, o);
        xb = row_offset<Axis>(x, o);
        ob = row_offset<Axis>(out, o);
        rb = row_offset<Axis>(res, o);
    };
    int rk = 0;
    const int g = G == 1 ? 0 : threadIdx.x / T;  // this thread's group: rows g, g + G, ...
    const int tg = G == 1 ? threadIdx.x : threadIdx.x % T;  // its place in the group's row
    auto pw = block_param<Len, W, B>(w, tg);
    auto pb = block_param<Len, W, B>(b, tg);
    // the group's i-th row in slot g * S + i % S; the residual's rows slot for slot after x's
    extern __shared__ float4 ml_smem4[];
    PX* slots = reinterpret_cast<PX*>(ml_smem4);
    PX* rslots = slots + B::ring * packs;
    // one commit group a row, empty past the last row (the count of groups in flight stays in step
    // with the rows)
    auto fetch = [&](int e, int slot) {
        if (e < nrows) {
            i64 xb, ob, rb;
            row_at(e, xb, ob, rb);
#pragma unroll
            for (int u = 0; u < H; ++u) {
                const int pk = tg + u * T;
                if (full || pk < packs) cp_async16(slots + slot * packs + pk, x.p + xb + pk * W, true);
                if constexpr (residual)
                    if (full || pk < packs) cp_async16(rslots + slot * packs + pk, res.p + rb + pk * W, true);
            }
        }
        cp_async_commit();
    };
#pragma unroll
    for (int d = 0; d < S; ++d) fetch(g + G * d, g * S + d);
    for (int i0 = 0; g + G * i0 < nrows; i0 += S) {
        // unrolled over the slots: a slot's address a constant (docs/experiments.md)
#pragma unroll
        for (int d = 0; d < S; ++d) {
            const int e = g + G * (i0 + d);
            if (e >= nrows) break;  // (the same for the whole group: its barriers stay matched)
            i64 xb, ob, rb;
            row_at(e, xb, ob, rb);
            cp_async_wait<S - 1>();  // this thread's packs of row e have landed
            PX px[H];  // row e
#pragma unroll
            for (int u = 0; u < H; ++u) {
                const int pk = tg + u * T;
                if constexpr (full) px[u] = slots[(g * S + d) * packs + pk];
                else px[u] = pk < packs ? slots[(g * S + d) * packs + pk] : PX{};
                if constexpr (residual)
                    if (full || pk < packs) px[u] = add_rounded(px[u], rslots[(g * S + d) * packs + pk]);
            }
            // the group's row S on goes into row e's slot: this thread's packs of row e are in px
            const int next = e + G * S, slot_e = g * S + d;
            const auto refill = [&fetch, next, slot_e] { fetch(next, slot_e); };
            const HeldRow<Len, W, B, O, TX, decltype(refill)> r{px, out, ob, tg, g, red, rk, refill};
            if constexpr (Op == ROW_SOFTMAX || Op == ROW_LOG_SOFTMAX) softmax_held_row<Op>(r);
            else norm_row<Op, Len>(r, eps, pw, pb);
        }
    }
}

// One tile of a row op along Axis (rows of Len elements): the block path (B::groups > 0) where the
// block has B's threads and every operand is aligned to its packs of W, else a warp a row in packs
// of W (W > 1) where aligned, else element by element. x, out, res: strides in x's index space;
// w, b: 1-D; res, w, b: Absent where the op has none. eps: the norms'.
template <int Op, int Axis, int Len, int W, class B, class O, class X, class Res, class Wt, class Bs>
__device__ __forceinline__ void rows(const Task& t, float eps, O out, X x, Res res, Wt w, Bs b) {
    static_assert(X::rank == O::rank && Axis < X::rank, "rows: x and out of one rank, Axis among theirs");
    static_assert(W == 1 || Len % W == 0, "rows: the packed paths' rows are whole packs");
    Task rowt = t;
    rowt.hi[Axis] = rowt.lo[Axis] + 1;  // iterate the box without the row axis
    if constexpr (W > 1) {
        const bool packed = aligned_operand(x, W) && aligned_operand(w, W) && aligned_operand(b, W) &&
                            aligned_operand(res, W) && aligned_operand(out, W);
        if constexpr (B::groups > 0) {
            if (packed && ml::block_threads() == B::groups * B::threads) {
                block_rows<Op, Axis, Len, W, B>(rowt, eps, out, x, res, w, b);
                return;
            }
        }
        if (packed) {
            warp_rows<Op, Axis, Len, W>(rowt, eps, out, x, res, w, b);
            return;
        }
    }
    warp_rows<Op, Axis, Len, 1>(rowt, eps, out, x, res, w, b);
}

}  // namespace ml

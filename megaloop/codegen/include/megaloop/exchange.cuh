// megaloop/exchange.cuh: the tiles of exchanges between ranks (megaloop/codegen/emit_collective.py and
// exchange.py write one call each): pulled all_reduce, reduce_scatter, all_gather, recv and send, and a
// pushing all_reduce's (megaloop/plan/rendezvous.py).
//
// A pulled tile reads its box of every member's operand straight from that rank's arena (peer memory
// over NVLink) and combines in group order, so every rank computes bitwise the same values.
//
// A pushing all_reduce: member `me` of a group of G stores its box of x into every other member's
// inbox, then sums the G boxes in rank order (x's own box for itself, the inbox for the others): the
// members meet in the tile. The inbox of one op has the same layout on every member
// (megaloop/codegen/exchange.py); off[2 + g] is member g's, in the arena of rank ranks[g]:
//
//   slot (parity, sender, tile): two slots per sender and tile, by iteration parity, so that a
//   sender may already write iteration k + 1's box while a receiver still reads iteration k's
//   (why two are enough: megaloop/plan/rendezvous.py).
//
// Small tiles travel in LL lines (NCCL's "low latency" protocol): 16 bytes = {data word, flag,
// data word, flag}, each 8-byte half stored at once over NVLink, the flag being the iteration + 1.
// A reader that sees the flag in both halves has the data: no fence, no separate signal, one trip.
// Large tiles travel as plain 16-byte stores in chunks, each released (fence + increment of the
// receiver's flag for (sender, tile)); the receiver waits for the flag, acquires, and reads its inbox.
// Every wait checks the watchdog and gives up (reporting the member it waited for) like wait_task.
#pragma once
#include "megaloop/elementwise.cuh"
#include "megaloop/math.cuh"

namespace ml {

__device__ __forceinline__ void ll_store(void* p, u64 data, u32 flag) {
    asm volatile("st.relaxed.sys.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"((u32)data), "r"(flag),
                 "r"((u32)(data >> 32)), "r"(flag)
                 : "memory");
}
__device__ __forceinline__ bool ll_load(const void* p, u32 flag, u64& data, u32& seen) {
    u32 lo, f0, hi, f1;
    asm volatile("ld.relaxed.sys.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(lo), "=r"(f0), "=r"(hi), "=r"(f1)
                 : "l"(p)
                 : "memory");
    data = (u64)lo | ((u64)hi << 32);
    seen = f0 == flag ? f1 : f0;
    return f0 == flag && f1 == flag;
}

// Record a wait inside an exchange tile that timed out: counter -1 (an LL line) or -2 (a bulk flag)
// tells the host that it was member `peer`'s pushed data, not a counter.
__device__ inline void exchange_timeout(const Args& a, int proc, int tid, int op, int what, u64 want, u64 seen, u64 k,
                                        int peer) {
    fail(a, WATCHDOG, proc, tid, op, what, (i64)want, (i64)seen, (i64)k, peer);
}

// Wait until the LL line at p carries `flag`; false once the watchdog fired or any block gave up.
__device__ inline bool ll_wait(const Args& a, const void* p, u32 flag, u64& data, int proc, int tid, int op, u64 k,
                               int peer) {
    u32 seen;
    if (ll_load(p, flag, data, seen)) return true;
    const u64 start = now_ns();
    for (unsigned polls = 1;; ++polls) {
        if (ll_load(p, flag, data, seen)) return true;
        if ((polls & 63) == 0) {
            if (aborted(a)) return false;
            if (now_ns() - start > a.timeout_ns) {
                exchange_timeout(a, proc, tid, op, -1, flag, seen, k, peer);
                return false;
            }
        }
    }
}

// Up to 8 bytes of a tile's run [p, p + n) (n < 8 only at a tile's end): a line's data word.
__device__ __forceinline__ u64 load_word(const char* p, int n) {
    if (n == 8) return *reinterpret_cast<const u64*>(p);
    u64 w = 0;
    for (int b = 0; b < n; ++b) w |= (u64)(unsigned char)p[b] << (8 * b);
    return w;
}
__device__ __forceinline__ void store_word(char* p, u64 w, int n) {
    if (n == 8) {
        *reinterpret_cast<u64*>(p) = w;
        return;
    }
    for (int b = 0; b < n; ++b) p[b] = (char)(w >> (8 * b));
}

template <bool SUM, class C>
__device__ __forceinline__ C combine(C acc, C v) {
    if constexpr (SUM) {
        return acc + v;
    } else {
        return maximum(acc, v);
    }
}

// The G members' packs combined element by element in rank order (compute type), rounded once.
template <class T, int N, int G, bool SUM>
__device__ __forceinline__ Pack<T, N> combine_packs(const Pack<T, N> (&p)[G]) {
    Pack<T, N> out;
#pragma unroll
    for (int i = 0; i < N; ++i) {
        auto acc = get(p[0], i);
#pragma unroll
        for (int g = 1; g < G; ++g) acc = combine<SUM>(acc, get(p[g], i));
        set(out, i, acc);
    }
    return out;
}

template <class T, int G, bool SUM>
__device__ __forceinline__ u64 combine_words(const u64 (&w)[G]) {
    constexpr int N = 8 / sizeof(T);
    Pack<T, N> p[G];
#pragma unroll
    for (int g = 0; g < G; ++g) memcpy(&p[g], &w[g], 8);
    const Pack<T, N> out = combine_packs<T, N, G, SUM>(p);
    u64 r;
    memcpy(&r, &out, 8);
    return r;
}

// Where a slot starts: member g's inbox (the arena of rank ranks[g]), slot (k's parity, sender, tile);
// g's inbox has slots for the G - 1 others only (sender index past g moves down by one).
template <int G, int TILES>
__device__ __forceinline__ char* inbox_slot(const Args& a, const int (&ranks)[G], const i64* off, int g, u64 k,
                                            int sender, int tile, i64 slot_bytes) {
    const int from = sender < g ? sender : sender - 1;
    return a.arenas[ranks[g]] + off[2 + g] + (((i64)(k & 1) * (G - 1) + from) * TILES + tile) * slot_bytes;
}
// member g's flag for (sender, tile) after its slots (bulk tiles)
template <int G, int TILES>
__device__ __forceinline__ u64* inbox_flag(const Args& a, const int (&ranks)[G], const i64* off, int g, int sender,
                                           int tile, i64 slot_bytes) {
    const int from = sender < g ? sender : sender - 1;
    return reinterpret_cast<u64*>(a.arenas[ranks[g]] + off[2 + g] + 2 * (i64)(G - 1) * TILES * slot_bytes) +
           from * TILES + tile;
}

// LL tile: E elements of x (own box, contiguous) into out, 8 data bytes a line, TILES tiles of at most
// LINES lines each. Every thread hands over its lines first, then waits for the others' same lines.
template <class T, int G, bool SUM, int TILES, int LINES>
__device__ inline void push_ll(const Args& a, const Task& t, int tid, u64 k, int proc, const i64* off,
                               const int (&ranks)[G], int me, const T* x, T* out, int elements) {
    static_assert(8 % sizeof(T) == 0, "a line holds whole elements");
    constexpr i64 SLOT = (i64)LINES * 16;
    const u32 flag = (u32)k + 1u;
    const int bytes = elements * (int)sizeof(T), lines = (bytes + 7) / 8;
    const char* xb = reinterpret_cast<const char*>(x);
    for (int l = threadIdx.x; l < lines; l += ml::block_threads()) {
        const u64 w = load_word(xb + 8 * l, min(8, bytes - 8 * l));
#pragma unroll
        for (int g = 0; g < G; ++g)
            if (g != me) ll_store(inbox_slot<G, TILES>(a, ranks, off, g, k, me, t.tile, SLOT) + 16 * (i64)l, w, flag);
    }
    bool ok = true;
    for (int l = threadIdx.x; ok && l < lines; l += ml::block_threads()) {
        const int n = min(8, bytes - 8 * l);
        u64 w[G];
#pragma unroll
        for (int g = 0; g < G; ++g) {
            if (g == me) {
                w[g] = load_word(xb + 8 * l, n);
            } else if (ok) {
                const char* line = inbox_slot<G, TILES>(a, ranks, off, me, k, g, t.tile, SLOT) + 16 * (i64)l;
                ok = ll_wait(a, line, flag, w[g], proc, tid, t.op, k, ranks[g]);
            }
        }
        if (ok) store_word(reinterpret_cast<char*>(out) + 8 * l, combine_words<T, G, SUM>(w), n);
    }
}

// Bulk tile, in chunks of CHUNK bytes so that the link and the sum overlap: chunk c is stored into the
// members' inboxes (posted), then chunk c - 1 -- which the members have flagged by now -- is summed from
// the local inbox while c is in flight, then chunk c is released (one fence, one increment of each
// member's flag for (this sender, this tile)). Without chunks every processor would store its whole
// tile and then sum it, all in step, the link idle during the sums. A flag counts chunks: CHUNKS a
// tile per iteration, so chunk c of iteration k has arrived once it reads k * CHUNKS + c + 1 or more.
// Slots of BYTES bytes; the flags ((G - 1) x TILES u64) after all slots.
template <class T, int G, bool SUM, int TILES, int BYTES, int CHUNK>
__device__ inline void push_bulk(const Args& a, const Task& t, int tid, u64 k, int proc, const i64* off,
                                 const int (&ranks)[G], int me, const T* x, T* out, int elements) {
    static_assert(CHUNK % 16 == 0, "chunks of whole 16-byte packs");
    constexpr int N = 16 / sizeof(T);
    constexpr int CHUNKS = (BYTES + CHUNK - 1) / CHUNK;
    constexpr i64 SLOT = BYTES;
    const int bytes = elements * (int)sizeof(T);
    const char* xb = reinterpret_cast<const char*>(x);
    __shared__ int exchange_ok;
    for (int c = 0; c <= CHUNKS; ++c) {
        if (c < CHUNKS) {  // chunk c out to every other member (a ragged tile end: bytewise)
            const int lo = c * CHUNK, hi = min(bytes, lo + CHUNK);
#pragma unroll
            for (int g = 0; g < G; ++g) {
                if (g == me) continue;
                char* dst = inbox_slot<G, TILES>(a, ranks, off, g, k, me, t.tile, SLOT);
                for (int b = lo + 16 * (int)threadIdx.x; b + 16 <= hi; b += 16 * ml::block_threads())
                    *reinterpret_cast<uint4*>(dst + b) = *reinterpret_cast<const uint4*>(xb + b);
                for (int b = max(lo, hi - (hi - lo) % 16) + (int)threadIdx.x; b < hi; b += ml::block_threads()) dst[b] = xb[b];
            }
        }
        if (c > 0) {  // chunk c - 1 from every member, summed in rank order
            if (threadIdx.x < 32) {  // warp 0: lane g waits for member g's flag
                bool ok = !aborted(a);
                const int g = threadIdx.x;
                const u64 want = k * CHUNKS + (u64)c;
                if (ok && g < G && g != me) {
                    const u64* f = inbox_flag<G, TILES>(a, ranks, off, me, g, t.tile, SLOT);
                    const u64 start = now_ns();
                    unsigned polls = 0;
                    u64 seen;
                    while ((seen = load_relaxed_sys(f)) < want) {
                        if ((++polls & 63) == 0 && (aborted(a) || now_ns() - start > a.timeout_ns)) {
                            if (!aborted(a)) exchange_timeout(a, proc, tid, t.op, -2, want, seen, k, ranks[g]);
                            ok = false;
                            break;
                        }
                    }
                }
                ok = __all_sync(0xffffffffu, ok);
                if (ok) fence_acquire(true);
                if (threadIdx.x == 0) exchange_ok = ok;
            }
            ml::block_sync();
            if (!exchange_ok) return;
            const int lo = (c - 1) * CHUNK, hi = min(bytes, lo + CHUNK);
            for (int b = lo + 16 * (int)threadIdx.x; b + 16 <= hi; b += 16 * ml::block_threads()) {
                Pack<T, N> p[G];
#pragma unroll
                for (int g = 0; g < G; ++g) {
                    const char* from = g == me ? xb : inbox_slot<G, TILES>(a, ranks, off, me, k, g, t.tile, SLOT);
                    p[g] = *reinterpret_cast<const Pack<T, N>*>(from + b);
                }
                *reinterpret_cast<Pack<T, N>*>(reinterpret_cast<char*>(out) + b) = combine_packs<T, N, G, SUM>(p);
            }
            const int tail = max(lo, hi - (hi - lo) % 16);  // whole elements: tiles and chunks are 16-byte aligned
            for (int e = tail / (int)sizeof(T) + (int)threadIdx.x; e < hi / (int)sizeof(T); e += ml::block_threads()) {
                Pack<T, 1> p[G];
#pragma unroll
                for (int g = 0; g < G; ++g) {
                    const char* from = g == me ? xb : inbox_slot<G, TILES>(a, ranks, off, me, k, g, t.tile, SLOT);
                    p[g] = reinterpret_cast<const Pack<T, 1>*>(from)[e];
                }
                reinterpret_cast<Pack<T, 1>*>(out)[e] = combine_packs<T, 1, G, SUM>(p);
            }
        }
        if (c < CHUNKS) {
            ml::block_sync();  // every thread's stores of chunk c issued ...
            if (threadIdx.x == 0) {  // ... then released: the fence, then each member's flag
                asm volatile("fence.acq_rel.sys;" ::: "memory");
#pragma unroll
                for (int g = 0; g < G; ++g) {
                    if (g == me) continue;
                    u64* f = inbox_flag<G, TILES>(a, ranks, off, g, me, t.tile, SLOT);
                    asm volatile("red.relaxed.sys.global.add.u64 [%0], 1;" ::"l"(f) : "memory");
                }
            }
        }
    }
}

// A pushing all_reduce's tile: member ME of the group of ranks RANKS..., its box one run of x and out
// (both contiguous, the same layout), in LL lines (slots of LINES lines) or bulk stores (slots of
// BYTES, chunks of CHUNK); TILES tiles an op.
template <bool SUM, int TILES, int LINES, int ME, int... RANKS, class X, class O>
__device__ __forceinline__ void push_all_reduce_ll(const Args& a, const Task& t, int tid, u64 k, int proc,
                                                   const i64* off, X x, O out) {
    const int ranks[sizeof...(RANKS)] = {RANKS...};
    const i64 first = out.offset(t.lo);
    push_ll<typename O::type, sizeof...(RANKS), SUM, TILES, LINES>(a, t, tid, k, proc, off, ranks, ME, x.p + first,
                                                                   out.p + first, box_count<O::rank ? O::rank : 1>(t));
}
template <bool SUM, int TILES, int BYTES, int CHUNK, int ME, int... RANKS, class X, class O>
__device__ __forceinline__ void push_all_reduce_bulk(const Args& a, const Task& t, int tid, u64 k, int proc,
                                                     const i64* off, X x, O out) {
    const int ranks[sizeof...(RANKS)] = {RANKS...};
    const i64 first = out.offset(t.lo);
    push_bulk<typename O::type, sizeof...(RANKS), SUM, TILES, BYTES, CHUNK>(
        a, t, tid, k, proc, off, ranks, ME, x.p + first, out.p + first, box_count<O::rank ? O::rank : 1>(t));
}

// ---- pulled tiles: W > 0 where every operand's layout allows W-element 16-byte packs --------------------

// The members' values (compute type) combined in group order: sums, or maxima (NaN kept).
template <bool SUM>
struct InGroupOrder {
    template <class C, class... R>
    __device__ __forceinline__ C operator()(C acc, R... v) const {
        ((acc = combine<SUM>(acc, v)), ...);
        return acc;
    }
};

// all_reduce and reduce_scatter: out[i] = the members' in[i] combined in group order, one rounding at
// the store (each member's pointer at this rank's slice for reduce_scatter); U packs in flight.
template <bool SUM, int W, int U, class O, class... I>
__device__ __forceinline__ void reduce_members(const Task& t, O out, I... in) {
    elementwise<W, U>(t, InGroupOrder<SUM>{}, out, in...);
}

// f(member K's operand, K) for the member j of a gather (Last: j past the others is the last member's;
// else a j past every member calls nothing).
template <int K, bool Last, class F, class A, class... R>
__device__ __forceinline__ void with_member(int j, F& f, const A& in, const R&... rest) {
    if constexpr (sizeof...(R) == 0) {
        if (Last || j == K) f(in, K);
    } else if (j == K) {
        f(in, K);
    } else {
        with_member<K + 1, Last>(j, f, rest...);
    }
}
// where member k's element for output element i is: piece k along Axis starts at k * Piece there
template <int Axis, int Piece, class A>
__device__ __forceinline__ auto member_element(const A& in, int k, const int* i) {
    return in.p + (in.offset(i) - (i64)k * Piece * stride_along<Axis, A>::value);
}
template <int Axis, int Piece, int W, class P>
struct LoadPiece {  // a member's pack at output element i
    const int* i;
    P& p;
    template <class A>
    __device__ __forceinline__ void operator()(const A& in, int k) const {
        p = load_pack<typename A::type, W>(member_element<Axis, Piece>(in, k, i));
    }
};
template <int Axis, int Piece, class T>
struct CopyPiece {  // a member's element into out
    const int* i;
    T* to;
    template <class A>
    __device__ __forceinline__ void operator()(const A& in, int k) const {
        *to = *member_element<Axis, Piece>(in, k, i);
    }
};

// all_gather: member j's in fills slice j (Piece elements) along Axis of out, a copy bit for bit; a pack
// never straddles two members' pieces (W > 0: Piece is whole packs along the last axis).
template <int Axis, int Piece, int W, int U, class O, class... I>
__device__ __forceinline__ void gather_members(const Task& t, O out, I... in) {
    constexpr int N = O::rank;
    using T = typename O::type;
    if constexpr (W > 0) {
        Pack<T, W> p[U];
        const bool done = packed_box<N, W, U>(
            t,
            [&] { return (aligned(out.p, W * (int)sizeof(T)) && ... && aligned(in.p, W * (int)sizeof(in.p[0]))); },
            [&](int u, const int* i, i64& at_u) {
                LoadPiece<Axis, Piece, W, Pack<T, W>> load{i, p[u]};
                with_member<0, true>(i[Axis] / Piece, load, in...);
                at_u = out.offset(i);
            },
            [&](int u, i64 at_u) { store_pack<T, W>(out.p + at_u, p[u]); });
        if (done) return;
    }
    for_box<N>(t, [&](const int* i) {
        CopyPiece<Axis, Piece, T> copy{i, out.p + out.offset(i)};
        with_member<0, false>(i[Axis] / Piece, copy, in...);
    });
}

// recv (and a pushing recv's send, out in the receiver's arena): out[i] = in[i], bit for bit.
template <int W, int U, class O, class I>
__device__ __forceinline__ void copy_box(const Task& t, O out, I in) {
    constexpr int N = O::rank;
    using T = typename O::type;
    if constexpr (W > 0) {
        Pack<T, W> p[U];
        const bool done = packed_box<N, W, U>(
            t, [&] { return aligned(out.p, W * (int)sizeof(T)) && aligned(in.p, W * (int)sizeof(in.p[0])); },
            [&](int u, const int* i, i64& at_u) {
                p[u] = load_pack<T, W>(in.p + in.offset(i));
                at_u = out.offset(i);
            },
            [&](int u, i64 at_u) { store_pack<T, W>(out.p + at_u, p[u]); });
        if (done) return;
    }
    for_box<N>(t, [&](const int* i) { out.p[out.offset(i)] = in.p[in.offset(i)]; });
}

}  // namespace ml

// megaloop/ring.cuh: the weight ring (sm_90). A decode step's matrix-vector tiles read every weight
// once, and weights never depend on activations, so a processor copies them into shared memory ahead
// of its tasks' waits: RING_SLOTS slots of RING_SLOT_BYTES, each filled by one cp.async.bulk of whole
// weight rows (a RingChunk) that completes on the slot's mbarrier.
//
// The chunks of processor p are listed in task order (a.ring_chunks[a.ring_begin[p] ..]); chunk i of
// an iteration is the ring's g = G + i (G: the chunks of the iterations before) and lives in slot
// g % RING_SLOTS, whose warp (slot % warps) consumes it and then issues chunk g + RING_SLOTS into the
// same slot, within the iteration (the host may write parameters between runs). So the ring runs up to RING_SLOTS chunks
// ahead across tasks and their waits, with no producer warp and no empty barriers. Compiled for an
// architecture before sm_90 (no bulk copies), the tiles read the chunks' rows from global memory.
// With ML_RING_LOADER a loader warp issues every copy instead (megaloop/ring_loader.cuh): the
// consuming warp then releases the slot on its empty barrier.
#pragma once
#include "megaloop/loop.cuh"
#include "megaloop/matvec.cuh"
#include "megaloop/vec.cuh"

namespace ml {

constexpr int RING_SLOTS = ML_RING_SLOTS;
constexpr int RING_SLOT_BYTES = ML_RING_SLOT_BYTES;
constexpr int RING_OFFSET = ML_RING_OFFSET;  // past every other tile's dynamic shared memory
#if __CUDA_ARCH__ >= 900
constexpr bool RING_COPIES = true;
#else
constexpr bool RING_COPIES = false;  // ring_issue and ring_wait do nothing; ring_matvec reads global memory
#endif
#ifdef ML_RING_LOADER
constexpr bool RING_LOADER = true;
#else
constexpr bool RING_LOADER = false;
#endif
static_assert(RING_SLOTS > 0 && RING_SLOT_BYTES % 16 == 0 && RING_OFFSET % 128 == 0, "weight ring layout");

struct Ring {
    unsigned char* data;  // RING_SLOTS x RING_SLOT_BYTES
    u64* full;            // a barrier a slot: its chunk has landed
    int* pending;         // a slot's copy in flight: the phase it completes, or -1
    u64* empty;           // with the loader warp, a barrier a slot: its consumer is done with it
};

// The slots, then full[RING_SLOTS], (with the loader warp: empty[RING_SLOTS],) pending[RING_SLOTS].
__device__ __forceinline__ Ring ring() {
    extern __shared__ float4 ml_smem4[];
    unsigned char* base = reinterpret_cast<unsigned char*>(ml_smem4) + RING_OFFSET;
    u64* full = reinterpret_cast<u64*>(base + (i64)RING_SLOTS * RING_SLOT_BYTES);
    return {base, full, reinterpret_cast<int*>(full + (RING_LOADER ? 2 : 1) * RING_SLOTS), full + RING_SLOTS};
}

// The chunks this block's ring took before the current iteration, and in all: a running count, as
// the programs of one kernel (megaloop/plan/programs.py) take different chunks an iteration.
__shared__ u64 ring_first_chunk, ring_taken;

__device__ __forceinline__ u32 ring_bar(const Ring& r, int slot) { return shared_address(r.full + slot); }

// Thread 0, before the kernel's first barrier.
__device__ __forceinline__ void ring_init() {
    const Ring r = ring();
    for (int s = 0; s < RING_SLOTS; ++s) r.pending[s] = -1;
    ring_taken = 0;
#if __CUDA_ARCH__ >= 900
    for (int s = 0; s < RING_SLOTS; ++s)
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(ring_bar(r, s)) : "memory");
    for (int s = 0; RING_LOADER && s < RING_SLOTS; ++s)  // one arrival a use: its consuming warp's
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_address(r.empty + s)) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}

__device__ __forceinline__ int ring_chunks(const Args& a, int proc) { return a.ring_begin[proc + 1] - a.ring_begin[proc]; }

// Thread 0, before the barrier that starts an iteration (after ring_init).
__device__ __forceinline__ void ring_advance(const Args& a, int proc) {
    ring_first_chunk = ring_taken;
    ring_taken += (u64)ring_chunks(a, proc);
}

// One lane: copy chunk `c` into `slot` (its phase `phase`); weights are read once a step, evict_first.
__device__ __forceinline__ void ring_issue(const Args& a, const RingChunk& c, int slot, int phase) {
#if __CUDA_ARCH__ >= 900
    const Ring r = ring();
    const u32 bar = ring_bar(r, slot), dst = shared_address(r.data + (i64)slot * RING_SLOT_BYTES);
    const u64 policy = evict_first_policy();
    r.pending[slot] = phase;
    // the slot's earlier reads (generic proxy) before the copy's writes (async proxy)
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(c.rows * c.row_bytes)
                 : "memory");
    const bool dense = c.stride == c.row_bytes;
    for (int row = 0; row < (dense ? 1 : c.rows); ++row) {
        const u32 bytes = dense ? c.rows * c.row_bytes : c.row_bytes;
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], "
            "%4;" ::"r"(dst + row * c.row_bytes),
            "l"(a.arena + c.src + row * c.stride), "r"(bytes), "r"(bar), "l"(policy)
            : "memory");
    }
#endif
}

// One lane, after its warp's __syncwarp past its last read of `slot`: the loader warp may refill it
// (release: the reads come first; the loader fences the async proxy before its copy).
__device__ __forceinline__ void ring_release(const Ring& r, int slot) {
#if __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(shared_address(r.empty + slot)) : "memory");
#endif
}

// The whole warp: until `slot` completes `phase`; false once the watchdog timeout passed (reported
// as counter -3, the slot and phase: megaloop/runtime/report.py) or another block gave up. tid < 0:
// draining, where only the copy's own time counts (bounded by 10 ms, no report).
__device__ __forceinline__ bool ring_wait(const Args& a, int slot, int phase, u64 k, int proc, int tid) {
#if __CUDA_ARCH__ < 900
    return true;
#else
    const u32 bar = ring_bar(ring(), slot);
    const u64 start = now_ns();
    for (unsigned polls = 1;; ++polls) {
        u32 done;
        asm volatile(
            "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
            : "=r"(done)
            : "r"(bar), "r"(phase)
            : "memory");
        if (__all_sync(0xffffffffu, done)) return true;
        if ((polls & 63) == 0) {
            bool quit = false;
            if ((threadIdx.x & 31) == 0) {
                const bool late = now_ns() - start > (tid < 0 ? 10000000ull : a.timeout_ns);
                quit = late || (tid >= 0 && aborted(a));
                if (late && tid >= 0) fail(a, WATCHDOG, proc, tid, -1, -3, phase, slot, (i64)k, a.rank);
            }
            if (__shfl_sync(0xffffffffu, quit, 0)) return false;
        }
    }
#endif
}

// Every warp, at the start of iteration k (after the block's barrier): the iteration's first chunks.
__device__ __forceinline__ void ring_start(const Args& a, u64 k, int proc) {
    const int n = ring_chunks(a, proc), warps = ml::block_threads() >> 5, warp = threadIdx.x >> 5;
    if (!RING_COPIES || (threadIdx.x & 31) != 0 || n == 0) return;
    const u64 g0 = ring_first_chunk;
    for (int i = 0; i < n && i < RING_SLOTS; ++i) {
        const int slot = (int)((g0 + i) % RING_SLOTS);
        if (slot % warps == warp)
            ring_issue(a, a.ring_chunks[a.ring_begin[proc] + i], slot, (int)(((g0 + i) / RING_SLOTS) & 1));
    }
}

// Warp 0, before the block leaves (after a barrier): no copy may still be writing its shared memory.
__device__ __forceinline__ void ring_drain(const Args& a, u64 k, int proc) {
    if (threadIdx.x >= 32) return;
    const Ring r = ring();
    for (int s = 0; s < RING_SLOTS; ++s)
        if (r.pending[s] >= 0 && !ring_wait(a, s, r.pending[s], k, proc, -1)) return;
}

// `cols` weight rows (a tile's output columns) against its nr <= ROWS prepared rows of A (a Rows
// policy, megaloop/matvec.cuh), taken from the ring: the task's chunks first .. (per_chunk rows each,
// the last fewer), each row PIECES 16-byte pieces; `w`, `w_step`: the same rows in global memory,
// read instead where the kernel has no bulk copies (before sm_90). store(row, column, value).
template <class T, int PIECES, int ROWS, class Rows, class Store>
__device__ __forceinline__ void ring_columns(const Args& a, const Task& t, int tid, u64 k, int proc, int first,
                                             int cols, int per_chunk, const unsigned char* w, i64 w_step,
                                             const Rows& rows, int nr, Store store) {
    const Ring r = ring();
    const int n = ring_chunks(a, proc), warps = ml::block_threads() >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int chunks = (cols + per_chunk - 1) / per_chunk;
    const u64 base = ring_first_chunk + (u64)(t.ring_first + first);
    for (int j = 0; j < chunks; ++j) {
        const u64 g = base + (u64)j;
        const int slot = (int)(g % RING_SLOTS);
        if (slot % warps != warp) continue;
        const int next = t.ring_first + first + j + RING_SLOTS;  // the chunk this slot takes next, this iteration
        RingChunk following;
        if (!RING_LOADER && lane == 0 && next < n) following = a.ring_chunks[a.ring_begin[proc] + next];  // (in flight meanwhile)
        if (!ring_wait(a, slot, (int)((g / RING_SLOTS) & 1), k, proc, tid)) return;
        const int c0 = j * per_chunk, in_chunk = min(per_chunk, cols - c0);
        if constexpr (RING_COPIES)
            warp_columns<T, PIECES, ROWS>(r.data + (i64)slot * RING_SLOT_BYTES, 16 * PIECES, c0, in_chunk, rows, nr, store);
        else
            warp_columns<T, PIECES, ROWS>(w + c0 * w_step, w_step, c0, in_chunk, rows, nr, store);
        __syncwarp();
        if (lane == 0 && RING_LOADER) {
            ring_release(r, slot);
        } else if (lane == 0) {
            r.pending[slot] = -1;
            if (next < n) ring_issue(a, following, slot, (int)(((g + RING_SLOTS) / RING_SLOTS) & 1));
        }
    }
}

// A tile of nr <= ROWS rows of A times `cols` weight rows from the ring (ring_columns), its rows
// prepared by the whole block first (a Rows policy may hold barriers) while the chunks may still land.
template <class T, int PIECES, int ROWS, class Rows, class Store>
__device__ __forceinline__ void ring_matvec(const Args& a, const Task& t, int tid, u64 k, int proc, int cols,
                                            int per_chunk, const unsigned char* w, i64 w_step, Rows rows, int nr,
                                            Store store) {
    rows.prepare(nr, PIECES);
    ring_columns<T, PIECES, ROWS>(a, t, tid, k, proc, 0, cols, per_chunk, w, w_step, rows, nr, store);
}

// The loop body's hooks (megaloop/loop_body.cuh) for a kernel with the ring.
struct WeightRing {
    static constexpr bool LOADER = false;
    static __device__ __forceinline__ void init() { ring_init(); }
    static __device__ __forceinline__ void advance(const Args& a, int proc) { ring_advance(a, proc); }
    static __device__ __forceinline__ void start(const Args& a, u64 k, int proc) { ring_start(a, k, proc); }
    static __device__ __forceinline__ void drain(const Args& a, u64 k, int proc) { ring_drain(a, k, proc); }
    static __device__ __forceinline__ void grant(const Args&, int, u64, u64, int) {}
    static __device__ __forceinline__ void leave() {}
    static __device__ __forceinline__ void load(const Args&, int) {}
};

}  // namespace ml

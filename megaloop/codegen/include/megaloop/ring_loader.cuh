// megaloop/ring_loader.cuh: the weight ring's loader warp (KernelOptions.weight_ring_loader, sm_90).
//
// A warp beside the ML_COMPUTE_THREADS that run the tiles, in none of their barriers, whose only work
// is the ring: it walks its processor's chunks (g = k C + i, as megaloop/ring.cuh numbers them) across
// tasks, their waits and the iterations the host has granted, and copies chunk g into slot
// g % RING_SLOTS once that slot's consumer released its use before (the slot's empty barrier) and
// fewer than RING_IN_FLIGHT bytes are still landing: strictly in order (weight_ring_loader 1) or the
// oldest chunk whose slot is free (2). So a handoff's loads queue behind that many bytes at most
// while the ring fills whenever the processor waits. It leaves once the compute warps leave (a stop,
// or a failed wait) or another block aborted, after its copies land; a consumer whose chunk never
// lands is still reported by ring_wait's watchdog. In a kernel of several programs each grant names
// its program and the ring's chunk count at its end, and the loader walks that program's list
// (megaloop/loader_runs.cuh).
#pragma once
#include "megaloop/loader_runs.cuh"
#include "megaloop/loop_body.cuh"  // ML_PROGRAMS
#include "megaloop/ring.cuh"

namespace ml {

static_assert(RING_LOADER, "megaloop/ring_loader.cuh: the kernel defines ML_RING_LOADER");
constexpr int RING_IN_FLIGHT = ML_RING_IN_FLIGHT;  // bytes of copies not landed, at most
// 1: the chunks copied strictly in order; 2: the oldest whose slot is free, within one lap
constexpr int RING_LOADER_ORDER = ML_RING_LOADER;
static_assert(RING_SLOTS <= 32 && (RING_LOADER_ORDER == 1 || RING_LOADER_ORDER == 2), "a lane a slot; two orders");
static_assert(ML_PROGRAMS <= 32 && ML_PROGRAMS < (1 << RUN_PROGRAM_BITS), "a lane a program's list");

// What thread 0 tells the loader warp: the iterations the host granted so far (several programs: the
// grant word, megaloop/loader_runs.cuh), and that the compute warps left.
struct LoaderShared {
    u64 granted;
    int leaving;
};
__device__ __forceinline__ LoaderShared& loader_shared() {
    __shared__ LoaderShared s;
    return s;
}

// Thread 0, after it read the doorbell (acquire): a release here, an acquire in the loader, so the
// copies of a granted iteration read the parameters the host wrote before it.
__device__ __forceinline__ void loader_grant(u64 granted) {
    asm volatile("st.release.cta.shared.u64 [%0], %1;" ::"r"(shared_address(&loader_shared().granted)), "l"(granted)
                 : "memory");
}
__device__ __forceinline__ u64 loader_granted() {
    u64 v;
    asm volatile("ld.acquire.cta.shared.u64 %0, [%1];" : "=l"(v) : "r"(shared_address(&loader_shared().granted))
                 : "memory");
    return v;
}
__device__ __forceinline__ void loader_leave() { *(volatile int*)&loader_shared().leaving = 1; }
__device__ __forceinline__ bool loader_told_to_leave(const Args& a) {
    return *(volatile int*)&loader_shared().leaving != 0 || aborted(a);
}

// This lane: whether the barrier at `bar` completed the phase of parity `phase`; `block`: wait a
// while in the instruction (try_wait, the thread suspended), else only look (test_wait).
template <bool block>
__device__ __forceinline__ bool phase_done(u32 bar, u32 phase) {
#if __CUDA_ARCH__ < 900
    return true;
#else
    u32 done;
    if constexpr (block) {
        asm volatile(
            "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
            : "=r"(done) : "r"(bar), "r"(phase) : "memory");
    } else {
        asm volatile(
            "{\n .reg .pred p;\n mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
            : "=r"(done) : "r"(bar), "r"(phase) : "memory");
    }
    return done != 0;
#endif
}

__device__ __forceinline__ u64 warp_min_u64(u64 v) {
    for (int o = 16; o > 0; o >>= 1) {
        const u64 w = __shfl_xor_sync(0xffffffffu, v, o);
        v = w < v ? w : v;
    }
    return v;
}

// chunk g's description, g in [base, base + 64): lane l holds chunk base + l's in `near`, base + 32 + l's
// in `far` (every lane shuffles both: a lane's own g picks)
__device__ __forceinline__ RingChunk ring_chunk_at(const RingChunk& near, const RingChunk& far, u64 g, u64 base) {
    const int from = (int)((g - base) & 31);
    const bool is_far = g - base >= 32;
    RingChunk c;
    const i64 src[2] = {__shfl_sync(0xffffffffu, near.src, from), __shfl_sync(0xffffffffu, far.src, from)};
    const i64 stride[2] = {__shfl_sync(0xffffffffu, near.stride, from), __shfl_sync(0xffffffffu, far.stride, from)};
    const int rows[2] = {__shfl_sync(0xffffffffu, near.rows, from), __shfl_sync(0xffffffffu, far.rows, from)};
    const int row_bytes[2] = {__shfl_sync(0xffffffffu, near.row_bytes, from), __shfl_sync(0xffffffffu, far.row_bytes, from)};
    c.src = is_far ? src[1] : src[0];
    c.stride = is_far ? stride[1] : stride[0];
    c.rows = is_far ? rows[1] : rows[0];
    c.row_bytes = is_far ? row_bytes[1] : row_bytes[0];
    return c;
}

// Several programs, the whole loader warp, every chunk granted before issued: grant word `word` read;
// on a switch, the run's program's list (from lane `program`: lane p holds program p's) and the
// descriptions of chunks base + lane and base + 32 + lane.
__device__ __forceinline__ void loader_follow(LoaderRun& run, u64 word, const RingChunk* my_list, int my_n,
                                              const RingChunk*& list, int& n, RingChunk& near, RingChunk& far,
                                              u64 base, int lane) {
    if (!run_follow(run, word)) return;
    list = reinterpret_cast<const RingChunk*>(__shfl_sync(0xffffffffu, (u64)my_list, run.program));
    n = __shfl_sync(0xffffffffu, my_n, run.program);
    if (n > 0) {
        near = list[run_entry(run, base + lane, n)];
        far = list[run_entry(run, base + 32 + lane, n)];
    }
}

// The whole loader warp, until the block leaves. Lane s < RING_SLOTS keeps slot s: its copies issued
// so far (`uses`: its next chunk is s + RING_SLOTS uses), whether the last one may still be landing,
// and its bytes. A round: note the copies that landed; every slot whose next chunk is granted, within
// one lap of the oldest chunk not issued (RING_LOADER_ORDER 1: that chunk only), whose consumer
// released its last use and whose bytes fit the cap is ready; the lowest ready chunk is copied. With
// none ready the warp waits in try_wait on what holds the oldest chunk back, or for a grant. Several
// programs: lane p < ML_PROGRAMS keeps program p's list here; a grant of another program, read once
// every chunk granted before was issued, swaps its list in (megaloop/loader_runs.cuh).
__device__ __noinline__ void ring_loader(const Args& a, int proc) {
#if __CUDA_ARCH__ >= 900  // (before it the tiles read global memory themselves: the warp just leaves)
    constexpr bool PROGRAMS = ML_PROGRAMS > 1;
    int n = PROGRAMS ? 0 : ring_chunks(a, proc);  // the chunks of the list walked (several programs: the run's)
    const int lane = threadIdx.x & 31;
    if (!PROGRAMS && n == 0) return;
    const RingChunk* list = PROGRAMS ? nullptr : a.ring_chunks + a.ring_begin[proc];
    const Ring r = ring();
    const bool keeper = lane < RING_SLOTS;  // (lanes past the slots only shuffle descriptions)
    const u32 full = ring_bar(r, lane % RING_SLOTS), empty = shared_address(r.empty + lane % RING_SLOTS);
    u64 uses = 0, base = 0, granted = loader_granted();  // several programs: the grant word
    bool landing = false;
    int bytes = 0;
    RingChunk near, far;
    if constexpr (!PROGRAMS) {
        near = list[lane % n];
        far = list[(32 + lane) % n];
    }
    const RingChunk* my_list = nullptr;  // several programs: lane p's, program p's list and its chunks
    int my_n = 0;
    if constexpr (PROGRAMS) {  // (from the programs' tables: thread 0 rewrites the block's Args)
        near = far = RingChunk{};
        const Program& g = a.programs[lane % ML_PROGRAMS];
        const int* begin = g.ring_begin;
        my_list = g.ring_chunks + begin[proc];
        my_n = begin[proc + 1] - begin[proc];
        if (!__any_sync(0xffffffffu, my_n > 0)) return;  // no program has chunks here
    }
    LoaderRun run{0, 0, -1};  // several programs: the run walked (program -1: none yet)
    if constexpr (PROGRAMS) loader_follow(run, granted, my_list, my_n, list, n, near, far, base, lane);
    u64 deadline = 0;  // leaving: the drain's end
    for (unsigned idle = 1;; ++idle) {
        if (landing && phase_done<false>(full, (u32)((uses - 1) & 1))) landing = false;
        if (deadline != 0) {  // leaving: every copy landed first (10 ms at most), as ring_drain
            if (!__any_sync(0xffffffffu, landing) || now_ns() > deadline) return;
            continue;
        }
        const u64 next = keeper ? (u64)lane + (u64)RING_SLOTS * uses : ~0ull, oldest = warp_min_u64(next);
        while (oldest - base >= 32) {  // (uniform: every lane has oldest and base)
            base += 32;
            near = far;
            if constexpr (PROGRAMS) {
                if (n > 0) far = list[run_entry(run, base + 32 + lane, n)];
            } else {
                far = list[(int)((base + 32 + lane) % (u64)n)];
            }
        }
        const RingChunk c = ring_chunk_at(near, far, next, base);
        const int want = c.rows * c.row_bytes;
        int in_flight = landing ? bytes : 0;
        for (int o = 16; o > 0; o >>= 1) in_flight += __shfl_xor_sync(0xffffffffu, in_flight, o);
        const bool released = uses == 0 || phase_done<false>(empty, (u32)((uses - 1) & 1));
        const bool ready = keeper && next < (PROGRAMS ? run.end : granted * (u64)n) &&
                           next < oldest + RING_SLOTS && (RING_LOADER_ORDER != 1 || next == oldest) && released &&
                           (in_flight == 0 || in_flight + want <= RING_IN_FLIGHT);
        const u64 pick = warp_min_u64(ready ? next : ~0ull);
        if (pick != ~0ull) {
            if (ready && next == pick) {  // (ring_issue's fence orders the consumer's reads first)
                ring_issue(a, c, lane, (int)(uses & 1));
                landing = true;
                bytes = want;
                ++uses;
            }
            __syncwarp();
            continue;
        }
        if ((idle & 63) == 0 && __shfl_sync(0xffffffffu, lane == 0 && loader_told_to_leave(a), 0)) {
            deadline = now_ns() + 10000000ull;
            continue;
        }
        // the next iteration's chunks: only once the host granted it
        if (oldest >= (PROGRAMS ? run.end : granted * (u64)n)) {
            __nanosleep(128);  // (a grant is on the critical path of a step: short)
            granted = loader_granted();
            if constexpr (PROGRAMS) loader_follow(run, granted, my_list, my_n, list, n, near, far, base, lane);
            continue;
        }
        // the oldest chunk's slot not released yet: its lane suspends in try_wait on the release; else
        // the cap holds it: the lane of the oldest copy landing suspends on that
        const bool holder = keeper && next == oldest, unreleased = __any_sync(0xffffffffu, holder && !released);
        const u64 last = landing ? (u64)lane + (u64)RING_SLOTS * (uses - 1) : ~0ull;
        const u64 first_landing = warp_min_u64(last);
        if (unreleased ? holder : landing && last == first_landing) {
            phase_done<true>(unreleased ? empty : full, (u32)((uses - 1) & 1));
        }
        __syncwarp();
    }
#endif
}

// The loop body's hooks (megaloop/loop_body.cuh) for a kernel whose ring has a loader warp.
struct LoaderRing {
    static constexpr bool LOADER = true;
    static __device__ __forceinline__ void init() {
        ring_init();
        loader_shared().granted = 0;
        loader_shared().leaving = 0;
    }
    static __device__ __forceinline__ void advance(const Args& a, int proc) { ring_advance(a, proc); }
    static __device__ __forceinline__ void start(const Args&, u64, int) {}
    // (every compute thread, leaving after a failed wait: the loader drains its own copies)
    static __device__ __forceinline__ void drain(const Args&, u64, int) {
        if (threadIdx.x == 0) loader_leave();
    }
    // (thread 0; several programs: after the grant's program's tables were loaded, before ring_advance)
    static __device__ __forceinline__ void grant(const Args& a, int proc, u64 iteration, u64 granted, int program) {
        if constexpr (ML_PROGRAMS > 1)
            loader_grant(run_grant(ring_taken, granted - iteration, ring_chunks(a, proc), program));
        else
            loader_grant(granted);
    }
    static __device__ __forceinline__ void leave() { loader_leave(); }
    static __device__ __forceinline__ void load(const Args& a, int proc) { ring_loader(a, proc); }
};

}  // namespace ml

// megaloop/ring_loader.cuh: the weight ring's loader warp (KernelOptions.weight_ring_loader, sm_90).
//
// A warp beside the ML_COMPUTE_THREADS that run the tiles, in none of their barriers, whose only work
// is the ring: it walks its processor's chunks in order (g = k C + i, as megaloop/ring.cuh numbers
// them), across tasks, their waits and the iterations the host has granted, and copies chunk g into
// slot g % RING_SLOTS as soon as that slot's consumer released its use before (the slot's empty
// barrier) and fewer than RING_IN_FLIGHT bytes are still landing, so that a handoff's loads queue
// behind that many bytes at most while the ring fills whenever the processor waits. It leaves once
// the compute warps leave (a stop, or a failed wait) or another block aborted, after its copies land;
// a consumer whose chunk never lands is still reported by ring_wait's watchdog.
#pragma once
#include "megaloop/ring.cuh"

namespace ml {

static_assert(RING_LOADER, "megaloop/ring_loader.cuh: the kernel defines ML_RING_LOADER");
constexpr int RING_IN_FLIGHT = ML_RING_IN_FLIGHT;  // bytes of copies not landed, at most

// What thread 0 tells the loader warp: the iterations the host granted so far, and that the compute
// warps left.
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

// The whole warp: whether the barrier at `bar` completed the phase of parity `phase`; `block`: wait
// a while in the instruction (try_wait), else only look (test_wait).
template <bool block>
__device__ __forceinline__ bool warp_phase_done(u32 bar, int phase) {
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
    return __all_sync(0xffffffffu, done);
#endif
}

// The whole warp: until the barrier completes `phase`; false once told to leave (checked every 64
// polls: an L2 read). `deadline` > 0: also false past it (a drain, where only the copy's time counts).
__device__ __forceinline__ bool loader_wait(const Args& a, u32 bar, int phase, bool may_leave, u64 deadline) {
    for (unsigned polls = 1;; ++polls) {
        if (warp_phase_done<true>(bar, phase)) return true;
        if ((polls & 63) == 0) {
            bool quit = false;
            if ((threadIdx.x & 31) == 0)
                quit = (may_leave && loader_told_to_leave(a)) || (deadline != 0 && now_ns() > deadline);
            if (__shfl_sync(0xffffffffu, quit, 0)) return false;
        }
    }
}

// The whole warp, leaving: every copy still landing [done, issued) lands first (10 ms at most).
__device__ __forceinline__ void loader_drain(const Args& a, u64 done, u64 issued) {
    const Ring r = ring();
    const u64 deadline = now_ns() + 10000000ull;
    for (u64 g = done; g < issued; ++g)
        if (!loader_wait(a, ring_bar(r, (int)(g % RING_SLOTS)), (int)((g / RING_SLOTS) & 1), false, deadline)) return;
}

// The whole loader warp, until the block leaves. Lane l holds chunk base + l of the walk (and the
// next 32 chunks in `ahead`), so a chunk's description is a shuffle, not a dependent load.
__device__ __noinline__ void ring_loader(const Args& a, int proc) {
#if __CUDA_ARCH__ >= 900  // (before it the tiles read global memory themselves: the warp just leaves)
    const int n = ring_chunks(a, proc), lane = threadIdx.x & 31;
    if (n == 0) return;
    const RingChunk* list = a.ring_chunks + a.ring_begin[proc];
    const Ring r = ring();
    u64 base = 0, issued = 0, done = 0, k = 0;  // the walk: chunk `issued` next, the oldest not seen landed
    RingChunk mine = list[lane % n], ahead = list[(32 + lane) % n];
    int i = 0, in_flight = 0;  // chunk i of iteration k; bytes issued and not seen landed
    for (;; ++issued) {
        if (i == 0) {  // a new iteration's chunks: only once the host granted it
            for (unsigned backoff = 32; loader_granted() <= k;) {
                if (__shfl_sync(0xffffffffu, lane == 0 && loader_told_to_leave(a), 0))
                    return loader_drain(a, done, issued);
                __nanosleep(backoff);
                backoff = backoff < 256 ? 2 * backoff : 256;  // a grant on the critical path of a step
            }
        }
        if (issued - base == 32) {
            base += 32;
            mine = ahead;
            ahead = list[(int)((base + 32 + lane) % (u64)n)];
        }
        const int from = (int)(issued - base), slot = (int)(issued % RING_SLOTS);
        const u64 use = issued / RING_SLOTS;
        RingChunk c;
        c.src = __shfl_sync(0xffffffffu, mine.src, from);
        c.stride = __shfl_sync(0xffffffffu, mine.stride, from);
        c.rows = __shfl_sync(0xffffffffu, mine.rows, from);
        c.row_bytes = __shfl_sync(0xffffffffu, mine.row_bytes, from);
        const int bytes = c.rows * c.row_bytes;
        // the slot's use before this one consumed (its consumer's release)
        if (use > 0 && !loader_wait(a, shared_address(r.empty + slot), (int)((use - 1) & 1), true, 0))
            return loader_drain(a, done, issued);
        // account the copies that landed: every one up to the slot's previous use (so no slot's barrier
        // is two phases past what is looked at), later ones while over the cap or already landed
        while (done < issued) {
            const int ds = (int)(done % RING_SLOTS), phase = (int)((done / RING_SLOTS) & 1);
            if (done + RING_SLOTS <= issued || in_flight + bytes > RING_IN_FLIGHT) {
                if (!loader_wait(a, ring_bar(r, ds), phase, true, 0)) return loader_drain(a, done, issued);
            } else if (!warp_phase_done<false>(ring_bar(r, ds), phase)) {
                break;
            }
            in_flight -= r.bytes[ds];
            ++done;
        }
        if (lane == 0) {
            r.bytes[slot] = bytes;
            ring_issue(a, c, slot, (int)(use & 1));
        }
        __syncwarp();
        in_flight += bytes;
        if (++i == n) {
            i = 0;
            ++k;
        }
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
    static __device__ __forceinline__ void start(const Args&, u64, int) {}
    // (every compute thread, leaving after a failed wait: the loader drains its own copies)
    static __device__ __forceinline__ void drain(const Args&, u64, int) {
        if (threadIdx.x == 0) loader_leave();
    }
    static __device__ __forceinline__ void grant(u64 granted) { loader_grant(granted); }
    static __device__ __forceinline__ void leave() { loader_leave(); }
    static __device__ __forceinline__ void load(const Args& a, int proc) { ring_loader(a, proc); }
};

}  // namespace ml

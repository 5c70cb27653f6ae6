// megaloop/loop_body.cuh: the loop kernel's body. Each block walks its processor's task list once
// an iteration, for as many iterations as the host grants: wait for a task's counters (warp 0),
// copy the next task into a slot meanwhile (warp 1), run the task (the whole block), then signal its
// counter (thread 0). The generated kernel instantiates it with its tile dispatch and its ring.
#pragma once
#include "megaloop/loop.cuh"

namespace ml {

// A kernel without the weight ring: nothing to start, nothing to drain (megaloop/ring.cuh: WeightRing;
// with a loader warp: megaloop/ring_loader.cuh, LoaderRing).
struct NoRing {
    static constexpr bool LOADER = false;  // no warp beside the compute warps
    static __device__ __forceinline__ void init() {}
    static __device__ __forceinline__ void advance(const Args&, int) {}
    static __device__ __forceinline__ void start(const Args&, u64, int) {}
    static __device__ __forceinline__ void drain(const Args&, u64, int) {}
    static __device__ __forceinline__ void grant(const Args&, int, u64, u64, int) {}
    static __device__ __forceinline__ void leave() {}
    static __device__ __forceinline__ void load(const Args&, int) {}
};

// Thread 0, after the block's barrier that follows the task: the profile stamps, then the signal.
__device__ __forceinline__ void finish_task(const Args& a, const Task& t, int tid, u64 k, u64 start) {
    if (a.profile != nullptr && k < (u64)a.profile_iterations) {
        // stamped before the signal, so that a task waiting on this one starts after this end
        u64* slot = a.profile + 2 * (k * (u64)a.n_tasks + (u64)tid);
        slot[0] = start;
        slot[1] = now_ns();
    }
    if (t.counter < 0) return;  // nobody waits on it
    if (t.remote) {  // read by other GPUs: their tiles pull this task's output over NVLink
        __threadfence_system();
        add_release_sys(&a.counters[t.counter], 1ull);
        // and their mirrors of the counter, in their own memory, where they poll it
        for (int m = t.mirror_begin; m < t.mirror_begin + t.mirror_count; ++m)
            add_release_sys(&a.rank_counters[a.mirrors[m].rank][a.mirrors[m].counter], 1ull);
    } else {
        // red.release after the barrier publishes every thread's writes (release is cumulative over
        // the barrier's synchronisation), as CUTLASS's semaphores do; no __threadfence (fence.sc) in front
        add_release(&a.counters[t.counter], 1ull);
    }
}

#ifndef ML_PROGRAMS  // a generated kernel sets it: its plan's programs (megaloop/plan/programs.py)
#define ML_PROGRAMS 1
#endif

// Thread 0: program p's tables into the block's Args (its iterations use them from now on).
__device__ __forceinline__ void load_program(Args& a, int p) {
    const Program& g = a.programs[p];
    a.tasks = g.tasks;
    a.waits = g.waits;
    a.list_begin = g.list_begin;
    a.lists = g.lists;
    a.operand_offsets = g.operand_offsets;
    a.counters = g.counters;
    a.rank_counters = g.rank_counters;
    a.mirrors = g.mirrors;
    a.ring_chunks = g.ring_chunks;
    a.ring_begin = g.ring_begin;
    a.records = g.records;
}

// run_task(a, slot, k, proc): the task's tile function, by its signature. Waits and tiles see k as
// the iteration of the program that runs (each program's counters count its own iterations).
template <class Ring, class RunTask>
__device__ __forceinline__ void loop_body(const Args* args, RunTask run_task) {
    __shared__ Args a;
    __shared__ int go;
    __shared__ u64 granted;   // iterations the host has asked for, as last read
    __shared__ u64 reported;  // when this block last reported progress (%globaltimer)
    __shared__ u64 counted;   // iterations this block added to the arrival counter (KernelOptions.completion_word)
    __shared__ u64 runs[ML_PROGRAMS];  // iterations each program has run here
    __shared__ u64 local;     // this iteration's number in its program's own count
    __shared__ u64 iteration;  // the kernel's (progress, grants, profile): thread 0's, kept out of registers
    __shared__ int program, switched;  // the program whose tables `a` holds; whether this iteration changed it
    __shared__ int granted_program;    // the program of the iterations granted
    if (threadIdx.x == 0) {
        a = *args;
        granted = 0;
        reported = now_ns();
        counted = 0;
        program = 0;
        iteration = 0;
        for (int p = 0; p < ML_PROGRAMS; ++p) runs[p] = 0;
        Ring::init();
    }
    __syncthreads();  // the loader warp's too: the ring's barriers are initialised
    if constexpr (Ring::LOADER) {
        if (threadIdx.x >= ml::block_threads()) {
            Ring::load(a, blockIdx.x);
            return;
        }
    }
    const int proc = blockIdx.x;
    // the task running (slot q), the next ones (being copied by warp 1 meanwhile) and the previous
    // one (thread 0 may still be signalling its counter when warp 1 starts copying): SLOT_RING of them
    __shared__ TaskSlot slots[SLOT_RING];
    int q = 0;  // cycles 0 .. SLOT_RING - 1 (a running count would wrap after 2^32 tasks, and 2^32 % 3 != 0)
    const int filler = ml::block_threads() > 32 ? 1 : 0;  // the warp that copies tasks ahead (warp 0 if alone)
    if (a.list_begin[proc] < a.list_begin[proc + 1] && (int)(threadIdx.x >> 5) == filler)
        fill_first(a, a.list_begin[proc], a.list_begin[proc + 1], slots, 0);
    for (u64 it = 0;; ++it) {  // (== iteration: a register the one-program kernel uses as k)
        if (threadIdx.x == 0) {
            const bool ask = iteration >= granted;
            if (ask) {
                granted = wait_requested(a, iteration);
                // a grant of another program comes only once every block finished the iterations before it
                granted_program = ML_PROGRAMS > 1 ? (int)*(volatile u64*)&a.doorbell[2] : 0;
                if constexpr (ML_PROGRAMS == 1) Ring::grant(a, proc, iteration, granted, 0);
            }
            go = iteration < granted;
            switched = 0;
            if (go) {
                const int p = granted_program;
                if constexpr (ML_PROGRAMS > 1) {
                    if (p != program) {
                        load_program(a, p);
                        program = p;
                        switched = 1;
                    }
                    if (ask) Ring::grant(a, proc, iteration, granted, p);  // (its chunks: from p's tables)
                }
                local = runs[p]++;
                if (blockIdx.x != 0 || !ask) stamp(a, iteration, STAMP_SEEN, now_ns());  // (block 0's: its doorbell read)
                Ring::advance(a, proc);
            } else {
                Ring::leave();
            }
        }
        ml::block_sync();
        if (!go) return;
        const u64 k = ML_PROGRAMS > 1 ? local : it;
        const int begin = a.list_begin[proc], end = a.list_begin[proc + 1];
        if constexpr (ML_PROGRAMS > 1) {  // (a kernel of one program: not compiled, its registers as they were)
            if (switched) {  // the slot warp 1 filled holds the old program's task: this one's first instead
                if (begin < end && (int)(threadIdx.x >> 5) == filler) fill_first(a, begin, end, slots, q);
                ml::block_sync();
            }
        }
        Ring::start(a, k, proc);
        for (int i = begin; i < end; ++i, q = next_slot(q)) {
            const TaskSlot& s = slots[q];
            u64 start = 0;
            if (threadIdx.x < 32) {
                const bool ready = wait_task(a, s, k, proc);
                if (threadIdx.x == 0) {
                    go = ready;
                    start = now_ns();
                }
            }
            if ((int)(threadIdx.x >> 5) == filler)  // the next tasks (after the last: the next iteration's first)
                fill_ahead(a, i, begin, end, slots, q);
            ml::block_sync();
            if (!go) {
                Ring::drain(a, k, proc);
                return;
            }
            run_task(a, s, k, proc);
            ml::block_sync();
            if (threadIdx.x == 0) finish_task(a, s.task, s.id, iteration, start);
        }
        ml::block_sync();
        if (threadIdx.x == 0) {
            stamp(a, iteration, STAMP_DONE, now_ns());
            iteration_done(a, iteration, granted, reported, counted);
            stamp(a, iteration, STAMP_REPORTED, now_ns());
            ++iteration;
        }
    }
}

}  // namespace ml

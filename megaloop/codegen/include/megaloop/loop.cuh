// megaloop/loop.cuh: the machinery of the persistent loop kernel.
//
// One thread block per processor walks its task list every iteration. Before a task, the lanes of
// warp 0 wait until each counter it depends on reaches its target (acquire loads, the task's waits
// shared among the 32 lanes so that their loads overlap); after the task, once
// all threads are past a barrier, thread 0 adds 1 to the task's counter (release). Every spin reads
// %globaltimer and gives up after the watchdog timeout, recording who waited on what, and raising
// the abort flag that makes every other block leave too. The host asks for iterations through a
// doorbell in mapped pinned memory and learns of progress and errors through the same block.
#pragma once
#include "megaloop/abi.cuh"  // Task, Wait, Mirror, Control, Args: the host reads and writes them too

namespace ml {

__device__ __forceinline__ u64 now_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ u64 load_acquire(const u64* p) {
    u64 v;
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ u64 load_acquire_sys(const volatile u64* p) {
    u64 v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void add_release(u64* p, u64 v) {
    asm volatile("red.release.gpu.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void add_release_sys(u64* p, u64 v) {
    asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
// Polling loads: relaxed (strong, unordered), so that several are in flight at once; the acquire
// comes from one fence after they all saw their targets (a strong read that observes a release, then
// an acquire fence: the PTX memory model's acquire pattern, as C++'s relaxed load + acquire fence). The
// loads have no "memory" clobber, so the compiler may issue other loads (the waits' descriptions)
// around them; the fence has one, so nothing that reads the producers' data moves above it.
__device__ __forceinline__ u64 load_relaxed(const u64* p) {
    u64 v;
    asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p));  // no "memory": see fence_acquire
    return v;
}
__device__ __forceinline__ u64 load_relaxed_sys(const u64* p) {
    u64 v;
    asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p));
    return v;
}
// sm_90 has acquire-only fences (fence.acquire: an L1 invalidation, no MEMBAR; PTX ISA 8.6, NVRTC
// 12.8 and later); older GPUs or compilers take fence.acq_rel, which also waits for this thread's
// outstanding writes (MEMBAR.ALL).
#if __CUDA_ARCH__ >= 900 && (__CUDACC_VER_MAJOR__ > 12 || (__CUDACC_VER_MAJOR__ == 12 && __CUDACC_VER_MINOR__ >= 8))
#define ML_FENCE_ACQUIRE "fence.acquire"
#else
#define ML_FENCE_ACQUIRE "fence.acq_rel"
#endif
__device__ __forceinline__ void fence_acquire(bool sys) {
    if (sys) {
        asm volatile(ML_FENCE_ACQUIRE ".sys;" ::: "memory");
    } else {
        asm volatile(ML_FENCE_ACQUIRE ".gpu;" ::: "memory");
    }
}
__device__ __forceinline__ void store_release_sys(volatile u64* p, u64 v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Record the first error (later ones are dropped) and make every block leave.
__device__ inline void fail(const Args& a, u64 code, i64 i0, i64 i1, i64 i2, i64 i3, i64 i4, i64 i5, i64 i6,
                            i64 i7 = 0) {
    if (atomicCAS((unsigned long long*)a.abort, 0ull, code) == 0ull) {
        const i64 info[8] = {i0, i1, i2, i3, i4, i5, i6, i7};
        for (int k = 0; k < 8; ++k) a.control->info[k] = info[k];
        __threadfence_system();
        store_release_sys(&a.control->error, code);
    }
}

__device__ __forceinline__ bool aborted(const Args& a) { return *(volatile u64*)a.abort != 0; }

// What a task reads before its tile can start, copied into shared memory ahead of time: its descriptor,
// up to SLOT_WAITS of its waits and its op's operand offsets. Warp 1 copies the next task's while warp 0
// waits for this one's producers, so three links leave the chain of dependent loads between two tasks
// (list entry -> descriptor -> waits -> counters, and operand offsets -> data), each an L2 round trip
// (~0.6 us) or worse where a decode step's weights pushed them out of L2. An L1 prefetch would not
// do: warp 0's acquire fence invalidates L1.
#ifndef ML_SLOT_WAITS  // a generated kernel sets it from its plan's options (KernelOptions.slot_waits)
#define ML_SLOT_WAITS 16
#endif
constexpr int SLOT_WAITS = ML_SLOT_WAITS;
struct alignas(16) TaskSlot {  // (16: a record is copied into it 16 bytes at a time)
    Task task;
    Wait waits[SLOT_WAITS];  // the first SLOT_WAITS of task.wait_count
    i64 offsets[MAX_OPERANDS];
    int id;
};
// KernelOptions.task_records: the host lays out one TaskSlot per list position (megaloop/runtime/
// records.py, by this arithmetic), so that a slot is one copy of known address, issued ahead.
#ifndef ML_TASK_RECORDS
#define ML_TASK_RECORDS 0
#endif
static_assert(ML_OFFSETOF(TaskSlot, waits) == sizeof(Task), "TaskSlot: waits right after the task (records.py)");
static_assert(ML_OFFSETOF(TaskSlot, offsets) == (sizeof(Task) + SLOT_WAITS * sizeof(Wait) + 7) / 8 * 8,
              "TaskSlot: operand offsets at the next 8 bytes after the waits (records.py)");
static_assert(ML_OFFSETOF(TaskSlot, id) == ML_OFFSETOF(TaskSlot, offsets) + 8 * MAX_OPERANDS &&
                  sizeof(TaskSlot) % 16 == 0, "TaskSlot: id after the offsets, padded to 16 bytes (records.py)");
// the slots a block cycles through: the running task's, the previous one's (thread 0 may still be
// signalling it) and those being copied ahead (one; with records, two)
constexpr int SLOT_AHEAD = ML_TASK_RECORDS ? 2 : 1;
constexpr int SLOT_RING = ML_TASK_RECORDS ? 4 : 3;
__device__ __forceinline__ int next_slot(int q) { return q + 1 == SLOT_RING ? 0 : q + 1; }
__device__ __forceinline__ int slot_after(int q, int n) { return (q + n) % SLOT_RING; }

// Warp 1's lanes together: copy task `id`'s descriptor, waits and operand offsets into `s` (two
// rounds of loads: the descriptor, then what it points to).
__device__ __forceinline__ void fill_slot(const Args& a, int id, TaskSlot& s) {
    constexpr int TASK_WORDS = sizeof(Task) / 4, WAIT_WORDS = sizeof(Wait) / 4;
    static_assert(sizeof(Task) % 4 == 0 && TASK_WORDS <= 32 && sizeof(Wait) % 4 == 0, "a lane per word");
    const int lane = threadIdx.x & 31;
    if (lane < TASK_WORDS) reinterpret_cast<int*>(&s.task)[lane] = reinterpret_cast<const int*>(a.tasks + id)[lane];
    __syncwarp();
    const int op = s.task.op, wait_begin = s.task.wait_begin, wait_count = s.task.wait_count;
    const int words = min(wait_count, SLOT_WAITS) * WAIT_WORDS;
    const int* waits = reinterpret_cast<const int*>(a.waits + wait_begin);
    int w[(SLOT_WAITS * WAIT_WORDS + 31) / 32];
#pragma unroll
    for (int j = 0; j < (SLOT_WAITS * WAIT_WORDS + 31) / 32; ++j) w[j] = lane + 32 * j < words ? waits[lane + 32 * j] : 0;
    const i64 off = lane < MAX_OPERANDS ? a.operand_offsets[(i64)op * MAX_OPERANDS + lane] : 0;
#pragma unroll
    for (int j = 0; j < (SLOT_WAITS * WAIT_WORDS + 31) / 32; ++j)
        if (lane + 32 * j < words) reinterpret_cast<int*>(s.waits)[lane + 32 * j] = w[j];
    if (lane < MAX_OPERANDS) s.offsets[lane] = off;
    if (lane == 0) s.id = id;
}

// Warp 1's lanes: start copying list position `pos`'s record into `s` (cp.async, 16 bytes a lane a
// round; sm_80 and later). Nothing waits for it here: copy_wait() before the slot is read.
__device__ __forceinline__ void copy_record(const Args& a, int pos, TaskSlot& s) {
    constexpr int CHUNKS = sizeof(TaskSlot) / 16;
    const char* src = reinterpret_cast<const char*>(a.records) + (i64)pos * sizeof(TaskSlot);
    const unsigned dst = (unsigned)__cvta_generic_to_shared(&s);
    for (int c = threadIdx.x & 31; c < CHUNKS; c += 32)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst + 16 * c), "l"(src + 16 * c) : "memory");
    asm volatile("cp.async.commit_group;" ::: "memory");
}
__device__ __forceinline__ void copy_wait() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// The warp that copies slots (warp 1; warp 0 if alone), during task i's wait (list positions
// begin..end): the next task's slot, or with records the one after it (the next one's copy, issued a
// task ago, is waited for first; the block's barrier then shows it to every thread).
__device__ __forceinline__ void fill_ahead(const Args& a, int i, int begin, int end, TaskSlot* slots, int q) {
    if constexpr (ML_TASK_RECORDS) {
        copy_wait();
        const int n = end - begin, pos = i + 2 < end ? i + 2 : begin + (i + 2 - begin) % n;
        copy_record(a, pos, slots[slot_after(q, 2)]);
    } else {
        fill_slot(a, a.lists[i + 1 < end ? i + 1 : begin], slots[next_slot(q)]);
    }
}
// The same warp, at the start and when a program's tables replace another's: the first SLOT_AHEAD slots
// from list position begin, complete when it returns (the caller's barrier shows them to the block).
__device__ __forceinline__ void fill_first(const Args& a, int begin, int end, TaskSlot* slots, int q) {
    if constexpr (ML_TASK_RECORDS) {
        copy_wait();  // (a copy of the old program's may still be landing in these slots)
        copy_record(a, begin, slots[q]);
        copy_record(a, begin + 1 < end ? begin + 1 : begin, slots[next_slot(q)]);
        copy_wait();
        __syncwarp();
    } else {
        fill_slot(a, a.lists[begin], slots[q]);
    }
}

// Warp 0 only (all 32 lanes): wait until every wait of task `tid` is satisfied for iteration k;
// true for every lane, or false for every lane once any block gave up (all 32 lanes must call it:
// it ends in a warp vote). The lanes share the waits, WAIT_BATCH of a lane's counters loaded at once
// (relaxed) and polled together, then one acquire fence (the whole warp, once all lanes are satisfied):
// a consumer of a 128-tile matmul waits on 128 counters.
// (One thread polling them in turn would pay an L2 round trip each, and acquire loads each complete
// before the next one starts: hence relaxed loads in flight together, then one fence.)
constexpr int WAIT_BATCH = 4;
// The longest sleep between two polls of a wait's counters, in ns (the sleeps double from 32 up to it);
// 0: no sleep, the polls back to back (set from the plan's options: KernelOptions.poll_sleep_ns).
#ifndef ML_POLL_SLEEP_NS
#define ML_POLL_SLEEP_NS 0
#endif
__device__ inline bool wait_task(const Args& a, const TaskSlot& s, u64 k, int proc) {
    // The abort flag is read while polling, not before: a task whose producers are done runs anyway
    // (the iteration's end or the next wait that cannot be met notices the abort), and the flag's L2
    // round trip stays off the path of every chain of tasks on one processor.
    const Task& t = s.task;
    const int tid = s.id;
    const Wait* waits = t.wait_count <= SLOT_WAITS ? s.waits : a.waits + t.wait_begin;
    bool ok = true;
    bool any = false, sys = false;
    for (int w0 = threadIdx.x & 31; ok && w0 < t.wait_count; w0 += 32 * WAIT_BATCH) {
        Wait wt[WAIT_BATCH];
#pragma unroll
        for (int j = 0; j < WAIT_BATCH; ++j) {  // the waits' descriptions, all loads out at once
            const int w = min(w0 + 32 * j, t.wait_count - 1);
            wt[j] = waits[w];
        }
        const u64* c[WAIT_BATCH];
        u64 target[WAIT_BATCH], seen[WAIT_BATCH];
        bool peer[WAIT_BATCH];
#pragma unroll
        for (int j = 0; j < WAIT_BATCH; ++j) {  // then the counters, all loads out before any is looked at
            const bool live = w0 + 32 * j < t.wait_count && (u64)wt[j].lag <= k;  // lag > k: no such iteration
            target[j] = live ? (u64)wt[j].per_iteration * (k + 1 - wt[j].lag) : 0;
            peer[j] = wt[j].rank != a.rank;  // another rank's counter: polled in its mirror here, if it has one
            c[j] = wt[j].mirror >= 0 ? &a.counters[wt[j].mirror]
                   : peer[j]         ? &a.rank_counters[wt[j].rank][wt[j].counter]
                                     : &a.counters[wt[j].counter];
            seen[j] = live ? (peer[j] ? load_relaxed_sys(c[j]) : load_relaxed(c[j])) : 0;
            any |= live;
            sys |= live && peer[j];
        }
        // poll every counter of the batch still short, all loads out together each round (counters
        // that arrive together cost one round trip, not one each)
        const u64 start = now_ns();
        unsigned backoff = 32, polls = 0;
        for (;;) {
            int short_of = -1;
#pragma unroll
            for (int j = WAIT_BATCH - 1; j >= 0; --j)
                if (seen[j] < target[j]) short_of = j;
            if (short_of < 0) break;
            if ((++polls & 7) == 0 && aborted(a)) {  // not every poll: it is another L2 round trip
                ok = false;
                break;
            }
            if (now_ns() - start > a.timeout_ns) {
                Wait w = wt[0];
                u64 want = target[0], got = seen[0];
#pragma unroll
                for (int j = 1; j < WAIT_BATCH; ++j) {  // static indices: the arrays stay in registers
                    if (j == short_of) {
                        w = wt[j];
                        want = target[j];
                        got = seen[j];
                    }
                }
                fail(a, WATCHDOG, proc, tid, t.op, w.counter, (i64)want, (i64)got, (i64)k, w.rank);
                ok = false;
                break;
            }
            // short: a dependency's latency is on the critical path of every decode step, and the
            // polls hit the L2 (132 blocks every 256 ns is far below what it serves)
            if (ML_POLL_SLEEP_NS > 0) {
                __nanosleep(backoff);
                backoff = backoff * 2 < ML_POLL_SLEEP_NS ? backoff * 2 : ML_POLL_SLEEP_NS;
            }
#pragma unroll
            for (int j = 0; j < WAIT_BATCH; ++j)
                if (seen[j] < target[j]) seen[j] = peer[j] ? load_relaxed_sys(c[j]) : load_relaxed(c[j]);
        }
    }
    // the same branch on every lane (a diverged warp would run both fences one after the other); the
    // caller's __syncthreads then orders the whole block's reads of the producers' data after the fence
    const bool all_ok = __all_sync(0xffffffffu, ok);
    if (all_ok && __any_sync(0xffffffffu, any)) fence_acquire(__any_sync(0xffffffffu, sys));
    return all_ok;
}

// The loop's own cost, switched at compile time (KernelOptions; nothing of them is compiled when 0):
// round_trip_stamps, completion_word and doorbell_reads (docs/runtime.md, "The loop's own cost").
#ifndef ML_ROUND_TRIP_STAMPS
#define ML_ROUND_TRIP_STAMPS 0
#endif
#ifndef ML_COMPLETION_WORD
#define ML_COMPLETION_WORD 0
#endif
#ifndef ML_DOORBELL_READS
#define ML_DOORBELL_READS 0
#endif
// Round-trip stamps: STAMP_WORDS u64 per (iteration, block) after the tasks' (start, end) pairs in
// a.profile; the host names them in megaloop/runtime/loop.py STAMP_FIELDS (the same order).
constexpr int STAMP_WORDS = 8;
enum Stamp : int {
    STAMP_SEEN = 0,       // %globaltimer: the block knew it may run the iteration (block 0: its doorbell read returned)
    STAMP_ISSUED = 1,     // block 0: that read was issued
    STAMP_HOST = 2,       // block 0: the host's clock word (Control::host_ns) read by that same load
    STAMP_PUBLISHED = 3,  // block 0: the grant republished in device memory for the other blocks
    STAMP_DONE = 4,       // the block's last task of the iteration ended (after its barrier)
    STAMP_REPORTED = 5,   // the block's completion or progress store was issued (or skipped)
};
__device__ __forceinline__ void stamp(const Args& a, u64 k, Stamp which, u64 value) {
    if constexpr (ML_ROUND_TRIP_STAMPS) {
        if (a.profile == nullptr || k >= (u64)a.profile_iterations) return;
        const u64 tasks = 2 * (u64)a.profile_iterations * (u64)a.n_tasks;
        a.profile[tasks + (k * gridDim.x + blockIdx.x) * STAMP_WORDS + which] = value;
    }
}

// Thread 0 only: wait until the host asked for iteration k; returns how many iterations the host has
// asked for so far (0: stop or abort). The caller keeps the answer and asks again only after running
// that many. Only block 0 polls the host's doorbell (mapped memory, across PCIe) and republishes it
// in device memory, where the other blocks poll the L2 instead: 132 blocks polling PCIe with long
// back-offs made every run() slow to start. A stop is honoured only once the iterations asked for
// before it are done, by every block.
__device__ __forceinline__ void store_release_gpu(u64* p, u64 v) {
    asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
// Block 0: a new grant, its program first (the host writes the program, then requested).
__device__ __forceinline__ void publish_grant(const Args& a, u64 requested) {
    if (requested <= load_acquire(&a.doorbell[0])) return;
    *(volatile u64*)&a.doorbell[2] = a.control->program;
    store_release_gpu(&a.doorbell[0], requested);
}
// Block 0's stop check (the host writes requested, then stop, so requested read again after a stop
// is the last request): the last grant, or 0 once every granted iteration is done.
__device__ __forceinline__ u64 doorbell_stop(const Args& a, u64 k) {
    const u64 last = load_acquire_sys(&a.control->requested);
    publish_grant(a, last);
    if (last > k) return last;
    store_release_gpu(&a.doorbell[1], 1);
    return 0;
}
// One read of the doorbell, the host's clock word beside it in the same 16 bytes (one PCIe read).
__device__ __forceinline__ void read_doorbell(const Args& a, u64& requested, u64& host_ns) {
    asm volatile("ld.relaxed.sys.global.v2.u64 {%0, %1}, [%2];"
                 : "=l"(requested), "=l"(host_ns) : "l"(&a.control->requested) : "memory");
}
// Block 0 with KernelOptions.doorbell_reads = R: R reads of the doorbell in flight, spaced over one
// read's trip (~1 us), each reissued as soon as it returned: a write is seen ~trip / 2R after it lands
// instead of ~trip / 2 (plus an L2 trip for the abort flag and one for the grant around every read,
// as wait_requested's poll does). The abort flag and stop are read every 8th round.
constexpr unsigned DOORBELL_TRIP_NS = 1024;
__device__ inline u64 wait_doorbell(const Args& a, u64 k) {
    constexpr int R = ML_DOORBELL_READS > 0 ? ML_DOORBELL_READS : 1;
    u64 req[R], host[R], issued[R];
#pragma unroll
    for (int j = 0; j < R; ++j) {
        if (j > 0) __nanosleep(DOORBELL_TRIP_NS / R);
        issued[j] = now_ns();
        read_doorbell(a, req[j], host[j]);
    }
    u64 got = 0, got_issued = 0, got_host = 0;  // (scalars: an array indexed after the loop went to local memory)
    for (unsigned round = 1; got == 0; ++round) {
#pragma unroll
        for (int j = 0; j < R; ++j) {
            if (got == 0) {
                if (req[j] > k) {  // (the first use of the read: it waits here for it to return)
                    got = req[j];
                    got_issued = issued[j];
                    got_host = host[j];
                } else {
                    issued[j] = now_ns();
                    read_doorbell(a, req[j], host[j]);
                }
            }
        }
        if (got == 0 && (round & 7) == 0) {
            if (aborted(a)) return 0;
            if (load_acquire_sys(&a.control->stop) != 0) return doorbell_stop(a, k);
        }
    }
    stamp(a, k, STAMP_SEEN, now_ns());
    fence_acquire(true);  // then the program the host wrote before requested
    stamp(a, k, STAMP_ISSUED, got_issued);
    stamp(a, k, STAMP_HOST, got_host);
    *(volatile u64*)&a.doorbell[2] = a.control->program;
    store_release_gpu(&a.doorbell[0], got);  // got > k >= every grant published before
    stamp(a, k, STAMP_PUBLISHED, now_ns());
    return got;
}
__device__ inline u64 wait_requested(const Args& a, u64 k) {
    if (ML_DOORBELL_READS > 0 && blockIdx.x == 0) return wait_doorbell(a, k);
    unsigned backoff = 32, polls = 0;
    for (;;) {
        if (aborted(a)) return 0;
        if (blockIdx.x == 0) {
            // one PCIe read a poll; stop (rare) every 8th
            u64 requested, host_ns = 0;
            const u64 issued = ML_ROUND_TRIP_STAMPS ? now_ns() : 0;
            if constexpr (ML_ROUND_TRIP_STAMPS) {
                read_doorbell(a, requested, host_ns);
                if (requested > k) fence_acquire(true);  // (only then: before sm_90 it is a MEMBAR.SYS)
            } else {
                requested = load_acquire_sys(&a.control->requested);
            }
            if (requested > k) {
                stamp(a, k, STAMP_SEEN, now_ns());
                stamp(a, k, STAMP_ISSUED, issued);
                stamp(a, k, STAMP_HOST, host_ns);
            }
            publish_grant(a, requested);
            if (requested > k) {
                stamp(a, k, STAMP_PUBLISHED, now_ns());
                return requested;
            }
            if ((++polls & 7) == 0 && load_acquire_sys(&a.control->stop) != 0) return doorbell_stop(a, k);
        } else {
            const u64 granted = load_acquire(&a.doorbell[0]);
            if (granted > k) return granted;
            if (load_acquire(&a.doorbell[1])) {  // stop, published after the last grant
                const u64 last = load_acquire(&a.doorbell[0]);
                if (last > k) return last;
                return 0;
            }
        }
        // block 0's PCIe read takes ~1 us itself: no sleep on top of it
        if (blockIdx.x != 0) {
            __nanosleep(backoff);
            backoff = backoff < 256 ? backoff * 2 : 256;
        }
    }
}

__device__ __forceinline__ u64 atom_add_acq_rel_sys(u64* p, u64 v) {
    u64 old;
    asm volatile("atom.acq_rel.sys.global.add.u64 %0, [%1], %2;" : "=l"(old) : "l"(p), "l"(v) : "memory");
    return old;
}
// KernelOptions.completion_word, thread 0 at the end of its grant (n iterations asked for so far):
// add the iterations this block finished since its last grant (`counted`) to the arrival counter
// (device memory: doorbell[3]); the block whose add brings it to n per block writes Control::done. A
// smaller value written late cannot land after a larger one: its writer's later adds (release) come
// before the larger value's add (acquire), and every block's count is at most the newest grant.
__device__ __forceinline__ void finish_grant(const Args& a, u64 n, u64& counted) {
    if (gridDim.x == 1) {
        store_release_sys(&a.control->done, n);
        return;
    }
    const u64 add = n - counted;
    counted = n;
    if (atom_add_acq_rel_sys(&a.doorbell[3], add) + add == n * gridDim.x) store_release_sys(&a.control->done, n);
}

// Thread 0 only: this block finished iteration k. Blocks may run ahead of each other (their waits
// keep them correct), so the host takes the minimum over all blocks as the iterations completed.
// Reported at the end of what was asked (completion), and in between every 64 iterations or 100 ms,
// whichever comes first (so the host sees a long run make progress, however slow an iteration is),
// not every iteration: each report is a PCIe write. `last` is the block's time of its last report.
// With a completion word, the end of a grant is reported through it instead (finish_grant).
__device__ inline void iteration_done(const Args& a, u64 k, u64 granted, u64& last, u64& counted) {
    if (ML_COMPLETION_WORD && k + 1 == granted) {
        finish_grant(a, granted, counted);
        return;
    }
    const u64 now = now_ns();
    if (k + 1 != granted && (k & 63) != 63 && now - last < 100000000ull) return;
    last = now;
    // release is cumulative over the barrier before: the block's writes are visible first (no fence.sc)
    store_release_sys(&a.progress[blockIdx.x], k + 1);
}

// ---- iterating over a tile's elements -------------------------------------------------------------

// Call f(index) for every element of the task's box; the block's threads share the work, consecutive
// threads taking consecutive elements of the last axis (coalesced).
template <int N, class F>
__device__ __forceinline__ void for_box(const Task& t, F f) {
    int ext[N + 1];
    i64 total = 1;
    for (int d = 0; d < N; ++d) {
        ext[d] = t.hi[d] - t.lo[d];
        total *= ext[d];
    }
    if (total <= 0x7fffffff) {  // 32-bit index arithmetic: a 64-bit division is ~4x the instructions
        for (unsigned e = threadIdx.x; e < (unsigned)total; e += ml::block_threads()) {
            int i[N + 1];
            unsigned r = e;
            for (int d = N - 1; d >= 0; --d) {
                i[d] = t.lo[d] + (int)(r % (unsigned)ext[d]);
                r /= (unsigned)ext[d];
            }
            f(i);
        }
        return;
    }
    for (i64 e = threadIdx.x; e < total; e += ml::block_threads()) {
        int i[N + 1];
        i64 r = e;
        for (int d = N - 1; d >= 0; --d) {
            i[d] = t.lo[d] + (int)(r % ext[d]);
            r /= ext[d];
        }
        f(i);
    }
}

// The number of elements of the task's box, and the index of its e-th element (row-major), for loops
// that the whole block takes step by step (block-wide row reductions may synchronise the block).
template <int N>
__device__ __forceinline__ int box_count(const Task& t) {
    int total = 1;
    for (int d = 0; d < N; ++d) total *= t.hi[d] - t.lo[d];
    return total;
}
template <int N>
__device__ __forceinline__ void box_index(const Task& t, int e, int* i) {
    for (int d = N - 1; d >= 0; --d) {
        const int ext = t.hi[d] - t.lo[d];
        i[d] = t.lo[d] + e % ext;
        e /= ext;
    }
}

// Call f(index, lane) once per element of the box with a whole warp per element (reductions).
template <int N, class F>
__device__ __forceinline__ void for_box_warps(const Task& t, F f) {
    int ext[N + 1];
    i64 total = 1;
    for (int d = 0; d < N; ++d) {
        ext[d] = t.hi[d] - t.lo[d];
        total *= ext[d];
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = ml::block_threads() >> 5;
    for (i64 e = warp; e < total; e += warps) {
        int i[N + 1];
        i64 r = e;
        for (int d = N - 1; d >= 0; --d) {
            i[d] = t.lo[d] + (int)(r % ext[d]);
            r /= ext[d];
        }
        f(i, lane);
    }
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ i64 warp_sum(i64 v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) {
        const float w = __shfl_xor_sync(0xffffffffu, v, o);
        v = (w > v || w != w) ? w : v;  // NaN wins, as numpy's max
    }
    return v;
}
// Row reductions of a group of W warps (the block-per-row path: G groups of W warps, each group on
// rows of its own; G == 1: the whole block), one barrier each: a named barrier of the group's
// 32 W threads (id 1 + g), __syncthreads for a single group. Every thread of the group calls them with
// the same `red` in shared memory (128 floats a group). Call k of a run of back-to-back reductions uses
// half (k & 1) of the group's `red`, so it never overwrites a half a slower thread may still be reading
// from call k - 1; call k - 2's readers have all passed call k - 1's barrier. The warps' partials are
// combined by a butterfly over W lanes (W a power of two; otherwise in warp order): the same bits on
// every thread of the group (a + b == b + a), log2(W) shuffles instead of W dependent loads and adds.
template <int W, int G>
__device__ __forceinline__ void group_barrier(int g) {
    if constexpr (G == 1) {
        ml::block_sync();
    } else {
        asm volatile("bar.sync %0, %1;" ::"r"(1 + g), "n"(32 * W) : "memory");
    }
}
template <int W>
__device__ __forceinline__ float lanes_sum(float v) {
    static_assert((W & (W - 1)) == 0 && W <= 32, "butterflies over a power of two of lanes");
#pragma unroll
    for (int o = W / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
template <int W>
__device__ __forceinline__ float lanes_fmax(float v) {
#pragma unroll
    for (int o = W / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
template <int W, int G>
__device__ __forceinline__ float group_sum(float v, float* red, int k, int g) {
    red += 128 * g + 32 * (k & 1);
    v = warp_sum(v);
    if ((threadIdx.x & 31) == 0) red[(threadIdx.x >> 5) % W] = v;
    group_barrier<W, G>(g);
    if constexpr ((W & (W - 1)) == 0) {
        return lanes_sum<W>(red[threadIdx.x % W]);
    } else {  // a group of, say, 12 warps: the partials in warp order (the same bits on every thread too)
        float s = 0.0f;
#pragma unroll
        for (int w = 0; w < W; ++w) s += red[w];
        return s;
    }
}
// s scaled from max m to max mx: s * exp(m - mx), and 0 for an empty part (s == 0: all its elements
// were -inf), which would otherwise give 0 * exp(-inf + inf) = NaN.
__device__ __forceinline__ float rescale_sumexp(float s, float m, float mx) {
    return s == 0.0f ? 0.0f : s * expf(m - mx);
}
// 2^x to about 2 ulps (ex2.approx, subnormal results flushed to 0): for exponentials whose result is
// rounded to a 16-bit float anyway; expf's exact range reduction is ~8 instructions where this is 1.
__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
// The largest of the warp's values, none of which is NaN (fmaxf-based maxima: softmax's).
__device__ __forceinline__ float warp_fmax(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
// Softmax's sum across a group's warps in one barrier: each warp brings its max m (the same on all its
// lanes; not NaN) and s = sum(exp(x - m)) over its elements; every thread gets the row's max and the
// sum rescaled to it. Lane l rescales warp l % W's sum (one exponential a thread, not one a warp), and
// the butterfly adds them: the same bits on every thread of the group.
template <int W, int G>
__device__ __forceinline__ void group_max_sumexp(float& m, float& s, float* red, int k, int g) {
    red += 128 * g + 64 * (k & 1);
    if ((threadIdx.x & 31) == 0) {
        red[(threadIdx.x >> 5) % W] = m;
        red[32 + (threadIdx.x >> 5) % W] = s;
    }
    group_barrier<W, G>(g);
    if constexpr ((W & (W - 1)) == 0) {
        const float mw = red[threadIdx.x % W], sw = red[32 + threadIdx.x % W];
        m = lanes_fmax<W>(mw);  // NaN only where a whole warp was NaN (warp_fmax): then s is NaN too
        s = lanes_sum<W>(rescale_sumexp(sw, mw, m));
    } else {  // not a power of two of warps: in warp order, an exponential per warp
        m = red[0];
#pragma unroll
        for (int w = 1; w < W; ++w) m = fmaxf(m, red[w]);
        s = 0.0f;
#pragma unroll
        for (int w = 0; w < W; ++w) s += rescale_sumexp(red[32 + w], red[w], m);
    }
}
__device__ __forceinline__ float warp_min(float v) {
    for (int o = 16; o > 0; o >>= 1) {
        const float w = __shfl_xor_sync(0xffffffffu, v, o);
        v = (w < v || w != w) ? w : v;
    }
    return v;
}
__device__ __forceinline__ i64 warp_max(i64 v) {
    for (int o = 16; o > 0; o >>= 1) {
        const i64 w = __shfl_xor_sync(0xffffffffu, v, o);
        v = w > v ? w : v;
    }
    return v;
}
__device__ __forceinline__ i64 warp_min(i64 v) {
    for (int o = 16; o > 0; o >>= 1) {
        const i64 w = __shfl_xor_sync(0xffffffffu, v, o);
        v = w < v ? w : v;
    }
    return v;
}

// argmax across a warp: larger value wins, NaN beats everything, ties go to the smaller index.
template <class T>
__device__ __forceinline__ void warp_argmax(T& v, i64& idx) {
    for (int o = 16; o > 0; o >>= 1) {
        const T w = __shfl_xor_sync(0xffffffffu, v, o);
        const i64 j = __shfl_xor_sync(0xffffffffu, idx, o);
        const bool w_nan = w != w, v_nan = v != v;
        bool take;
        if (w_nan || v_nan) take = w_nan && (!v_nan || j < idx);
        else take = w > v || (w == v && j < idx);
        if (take) { v = w; idx = j; }
    }
}

}  // namespace ml

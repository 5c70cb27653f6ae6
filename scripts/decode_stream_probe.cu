// Decode-stream probe: can a processor's weights stream ahead of its dependencies? A persistent kernel
// (one block per SM) runs a Llama-3.2-1B-shaped decode step as the loop kernel does: a chain of stages
// linked by counters, each matrix-vector product cut into one tile per processor (a run of output rows
// with all K, weights [N, K] row-major), each small op (norm, rope, attention, ...) one task whose
// duration is given (a spin on %globaltimer), so the step's time is what the weight stream and the
// chain of handoffs make of it. Modes, per block of 8 consumer warps + 1 loader warp:
//   direct: the consumers wait for the task's producers, then load its weights from global memory
//           (16-byte loads, U in flight a thread): the loop kernel's design today.
//   gated:  the loader warp copies each task's weights with cp.async.bulk into a ring of shared-memory
//           slots, but only once the task's producers are done (a task's own weights behind its wait).
//   ahead:  the same ring, the loader walking the processor's task list without waiting for anything
//           but free slots: weights are in flight while the consumers wait for activations.
//   stream: ahead with no waits at all (wrong results): what the ring alone can stream.
//   claim:  loop kernel v3's schedule: every processor takes part in every product, and its loader
//           claims the product's units (16 KB of whole rows) from one counter a stage as its ring frees,
//           running ahead across stages and iterations; so fast processors take more units, and a
//           stage ends when the chip's stream does, not when its slowest processor's share does.
//   cstream: claim with no waits at all (wrong results): what the claimed ring alone can stream.
//   ll:     ahead, with each handoff one trip: producers also store their outputs as 8-byte words of two
//           bf16 and a flag (the iteration), and consumers read those words until every flag is theirs,
//           without waiting on the counter first (the counters are still released, as a kernel would).
// Checks layer 0's products and a sample of the LM head's against float64 on the host.
// Measures the design docs/runtime.md proposes for loop kernel v2; not part of the package.
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I megaloop/codegen/include -o scripts/decode_stream_probe.bin scripts/decode_stream_probe.cu
//   scripts/decode_stream_probe.bin MODE SLOTS DELAYS [ITERATIONS [LEAD [CAP]]]  (DELAYS: today | fused | none
//   | v3 (attention one 4.5 us stage, its combine a 1 us prologue of o) | v3fast (attention 2.5 us);
//   LEAD: chunks of 16 KB the loader also prefetches into L2 ahead of its copies; CAP: the most chunks a
//   loader has in flight, as the loop kernel's weight_ring_loader_bytes, 0: as many as slots free)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "megaloop/vec.cuh"

#define CK(x)                                                                           \
    do {                                                                                \
        cudaError_t e = (x);                                                            \
        if (e != cudaSuccess) {                                                         \
            printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e));    \
            exit(1);                                                                    \
        }                                                                               \
    } while (0)

using ml::u32;
using ml::u64;

constexpr int CONSUMERS = 256;  // 8 warps
constexpr int THREADS = CONSUMERS + 32;
constexpr int SLOT_BYTES = 16384;
constexpr int MAX_K = 8192;
constexpr int MAX_ROWS = 1024;
enum Mode { DIRECT = 0, GATED = 1, AHEAD = 2, STREAM = 3, CLAIM = 4, CSTREAM = 5, LL = 6 };
constexpr int CLAIMS_IN_FLIGHT = 4;  // a loader's claims outstanding (an L2 atomic's round trip each)
constexpr int ENDS = 64;             // stage ends a loader may run ahead of its consumers

struct Task {
    int gemv;         // 1: matrix-vector tile, 0: small op
    int stage;        // counter index (the stage this task belongs to)
    int dep;          // counter waited on (-1: none)
    int dep_per_iter; // tasks of the producer stage
    int first;        // 1 for the step's first stage: waits on the previous iteration's last
    int k, row0, rows;
    long long w_off;  // element offset of the tile's weights
    int in_buf, out_buf, n_in, n_out;
    int delay_ns;
    int units;        // claim modes: the product's units (all of its rows in 16 KB pieces); 0: small op
    int prologue_ns;  // a product's start-up before its first unit (an o projection combining attention)
};

__device__ __forceinline__ u64 now_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ u32 ld_acquire(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void red_release(u32* p) {
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(p) : "memory");
}
__device__ __forceinline__ void mbar_init(u32 bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    asm volatile(
        "{\n .reg .pred p;\n W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra W;\n}" ::"r"(bar),
        "r"(parity)
        : "memory");
}
__device__ __forceinline__ void bulk_copy(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::"r"(dst),
        "l"(src), "r"(bytes), "r"(bar), "l"(ml::evict_first_policy())
        : "memory");
}
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p), "l"(ml::evict_first_policy()));
    return v;
}
__device__ __forceinline__ uint4 ld_cg(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ float dot8(uint4 w, const uint4 x) {
    float s = 0.f;
    const u32 a[4] = {w.x, w.y, w.z, w.w}, b[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        s = fmaf(__uint_as_float(a[i] << 16), __uint_as_float(b[i] << 16), s);
        s = fmaf(__uint_as_float(a[i] & 0xffff0000u), __uint_as_float(b[i] & 0xffff0000u), s);
    }
    return s;
}
__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;" ::"n"(CONSUMERS) : "memory"); }

__device__ bool wait_counter(const u32* c, u32 target, u32* abort_flag) {
    u64 start = now_ns();
    while (ld_acquire(c) < target) {
        if (*(volatile u32*)abort_flag) return false;
        if (now_ns() - start > 2000000000ull) {
            atomicExch(abort_flag, 1u);
            printf("probe watchdog: block %d counter %p wants %u has %u\n", blockIdx.x, c, target, *(volatile u32*)c);
            return false;
        }
    }
    return true;
}

// ll mode: a word is two bf16 (low half) and the iteration that wrote them (high half); 8-byte accesses are
// single-copy atomic, so a word whose flag is the reader's holds that iteration's values
__device__ __forceinline__ void ll_store(u64* p, u32 pair, u32 flag) {
    asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(((u64)flag << 32) | pair) : "memory");
}
// piece j of 8 bf16 (a uint4) as its four words
__device__ __forceinline__ void ll_store_piece(u64* words, int j, uint4 v, u32 flag) {
    ll_store(words + 4 * j, v.x, flag);
    ll_store(words + 4 * j + 1, v.y, flag);
    ll_store(words + 4 * j + 2, v.z, flag);
    ll_store(words + 4 * j + 3, v.w, flag);
}
__device__ __forceinline__ void ll_load2(const u64* p, u64& a, u64& b) {
    asm volatile("ld.relaxed.gpu.global.v2.u64 {%0, %1}, [%2];" : "=l"(a), "=l"(b) : "l"(p) : "memory");
}
// pieces [0, n8) of 8 bf16 each (piece j: words 4j .. 4j + 3), a thread every CONSUMERS-th, into xs;
// every word re-read until its flag is `flag`
__device__ bool ll_read(const u64* ll, uint4* xs, int n8, u32 flag, u32* abort_flag) {
    const u64 start = now_ns();
    for (int j = threadIdx.x; j < n8; j += CONSUMERS) {
        u64 w[4];
        for (unsigned polls = 1;; ++polls) {
            ll_load2(ll + 4 * j, w[0], w[1]);
            ll_load2(ll + 4 * j + 2, w[2], w[3]);
            if ((u32)(w[0] >> 32) == flag && (u32)(w[1] >> 32) == flag && (u32)(w[2] >> 32) == flag &&
                (u32)(w[3] >> 32) == flag)
                break;
            if ((polls & 15) == 0 && *(volatile u32*)abort_flag) return false;
            if (now_ns() - start > 2000000000ull) {
                atomicExch(abort_flag, 1u);
                printf("probe watchdog: block %d ll word %d wants flag %u has %u\n", blockIdx.x, 4 * j, flag,
                       (u32)(w[0] >> 32));
                return false;
            }
        }
        xs[j] = make_uint4((u32)w[0], (u32)w[1], (u32)w[2], (u32)w[3]);
    }
    return true;
}

struct Ring {
    u32 data, full, empty;  // shared addresses: the slots, their full barriers, their empty barriers
};

// rows of one chunk: whole rows of the tile; the ring's chunks are one slot, direct loads 4 slots
__host__ __device__ __forceinline__ int rows_per_chunk(int k, bool direct) { return (direct ? 4 : 1) * max(1, SLOT_BYTES / (k * 2)); }

// one chunk of rows from global memory (at most N / UPR of them): each thread takes UPR 16-byte pieces of every row
// (K = 256 x 8 x UPR), all N loads issued before the first product; a warp's partial sums meet in acc
template <int UPR, int N>
__device__ __forceinline__ void gemv_chunk(const uint4* w, const uint4* xs, float* acc, int r0, int rows) {
    constexpr int R = N / UPR, WIDTH = UPR * CONSUMERS;
    const int t = threadIdx.x;
    uint4 v[N];
#pragma unroll
    for (int u = 0; u < N; u++) {
        const uint4* p = w + (u / UPR) * WIDTH + (u % UPR) * CONSUMERS + t;
        v[u] = u / UPR >= rows ? make_uint4(0, 0, 0, 0) : ld_stream(p);
    }
    float part[R];
#pragma unroll
    for (int r = 0; r < R; r++) {
        part[r] = 0.f;
#pragma unroll
        for (int c = 0; c < UPR; c++) part[r] += dot8(v[r * UPR + c], xs[c * CONSUMERS + t]);
    }
#pragma unroll
    for (int o = 16; o; o >>= 1)
#pragma unroll
        for (int r = 0; r < R; r++) part[r] += __shfl_xor_sync(0xffffffffu, part[r], o);
    if ((t & 31) == 0)
#pragma unroll
        for (int r = 0; r < R; r++)
            if (r < rows) atomicAdd(acc + r0 + r, part[r]);
}

// one slot's rows by one warp: each lane takes every 32nd 16-byte piece of a row, so a row's sum meets
// in one shuffle reduction and its result is this warp's alone
template <int UPR>
__device__ __forceinline__ void gemv_warp(const uint4* w, const uint4* xs, float* acc, int r0, int rows) {
    constexpr int PIECES = UPR * CONSUMERS / 32;  // per lane and row: 8 (K = 2048) or 32 (K = 8192)
    const int lane = threadIdx.x & 31;
    for (int r = 0; r < rows; r++) {
        float part[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int i = 0; i < PIECES; i++) part[i & 3] += dot8(w[r * PIECES * 32 + i * 32 + lane], xs[i * 32 + lane]);
        float sum = (part[0] + part[1]) + (part[2] + part[3]);
#pragma unroll
        for (int o = 16; o; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        if (lane == 0) acc[r0 + r] = sum;
    }
}

// direct mode: a chunk of 64 KB of rows straight from global memory
__device__ __forceinline__ void gemv_rows(const void* w, const uint4* xs, float* acc, int r0, int rows, int k) {
    if (k == 2048) gemv_chunk<1, 16>((const uint4*)w, xs, acc, r0, rows);
    else gemv_chunk<4, 16>((const uint4*)w, xs, acc, r0, rows);
}

__global__ void __launch_bounds__(THREADS, 1)
probe(const Task* tasks, const int* task_start, const __nv_bfloat16* weights, __nv_bfloat16* const* bufs, u32* counters,
      u64* stamps, int iterations, int mode, int slots, int lead, u32* abort_flag, u64* const* lls, int cap) {
    extern __shared__ __align__(128) unsigned char smem[];
    uint4* xs = (uint4*)smem;                                   // MAX_K bf16
    float* acc = (float*)(smem + MAX_K * 2);                    // MAX_ROWS floats
    unsigned char* ring_base = smem + MAX_K * 2 + MAX_ROWS * 4; // slots x SLOT_BYTES
    u64* bars = (u64*)(ring_base + (size_t)slots * SLOT_BYTES);
    Ring ring{(u32)__cvta_generic_to_shared(ring_base), (u32)__cvta_generic_to_shared(bars),
              (u32)__cvta_generic_to_shared(bars + slots)};
    const int t = threadIdx.x, first = task_start[blockIdx.x], end = task_start[blockIdx.x + 1];
    if (t == 0) {
        for (int s = 0; s < slots; s++) {
            mbar_init(ring.full + 8 * s, 1);
            mbar_init(ring.empty + 8 * s, 1);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    for (int i = t; i < MAX_ROWS; i += THREADS) acc[i] = 0.f;
    __syncthreads();
    const bool use_ring = mode != DIRECT;
    if (t >= CONSUMERS) {  // the loader warp
        if (!use_ring || t != CONSUMERS) return;
        // a second cursor `lead` chunks ahead of the copies prefetches into L2 (wrapping into the next step)
        int ahead_i = first, ahead_r = 0;
        auto prefetch_next = [&]() {
            for (int n = 0; n <= end - first && !tasks[ahead_i].gemv; n++) ahead_i = ahead_i + 1 < end ? ahead_i + 1 : first;
            const Task& a = tasks[ahead_i];
            if (!a.gemv) return;
            const int per = rows_per_chunk(a.k, false), rows = min(per, a.rows - ahead_r);
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(weights + a.w_off + (long long)ahead_r * a.k),
                         "r"(rows * a.k * 2)
                         : "memory");
            ahead_r += per;
            if (ahead_r >= a.rows) ahead_r = 0, ahead_i = ahead_i + 1 < end ? ahead_i + 1 : first;
        };
        for (int n = 0; n < lead; n++) prefetch_next();
        u32 g = 0;
        for (int it = 0; it < iterations; it++)
            for (int i = first; i < end; i++) {
                const Task& task = tasks[i];
                if (!task.gemv) continue;
                if (mode == GATED && task.dep >= 0) {
                    u32 target = task.first ? (u32)it * task.dep_per_iter : (u32)(it + 1) * task.dep_per_iter;
                    if (!wait_counter(counters + task.dep, target, abort_flag)) return;
                }
                const int per = rows_per_chunk(task.k, false);
                for (int r = 0; r < task.rows; r += per, g++) {
                    const int rows = min(per, task.rows - r), slot = g % slots;
                    const u32 use = g / slots;
                    if (use > 0) mbar_wait(ring.empty + 8 * slot, (use - 1) & 1);
                    if (cap > 0 && g >= (u32)cap) {  // at most `cap` copies landing: chunk g - cap's has
                        const u32 old = g - cap;
                        mbar_wait(ring.full + 8 * (old % slots), (old / slots) & 1);
                    }
                    const u32 bytes = rows * task.k * 2;
                    mbar_expect_tx(ring.full + 8 * slot, bytes);
                    bulk_copy(ring.data + slot * SLOT_BYTES, weights + task.w_off + (long long)r * task.k, bytes,
                              ring.full + 8 * slot);
                    if (lead > 0) prefetch_next();
                }
            }
        return;
    }
    u32 g = 0;
    for (int it = 0; it < iterations; it++)
        for (int i = first; i < end; i++) {
            const Task& task = tasks[i];
            // (ll: a small op reading more than a product's vector, the argmax over the logits, waits as before)
            const bool ll_in = mode == LL && (task.gemv || task.n_in <= MAX_K);
            if (t == 0 && task.dep >= 0 && mode != STREAM && !ll_in) {
                u32 target = task.first ? (u32)it * task.dep_per_iter : (u32)(it + 1) * task.dep_per_iter;
                if (!wait_counter(counters + task.dep, target, abort_flag)) atomicExch(abort_flag, 1u);
            }
            const u32 in_flag = task.first ? (u32)it : (u32)it + 1;  // the iteration + 1 that wrote the input
            consumers_sync();
            if (*(volatile u32*)abort_flag) return;
            const u64 start = now_ns();
            if (t == 0 && it == iterations - 1) atomicMin((unsigned long long*)stamps + 2 * task.stage, start);
            const __nv_bfloat16* in = bufs[task.in_buf];
            __nv_bfloat16* out = bufs[task.out_buf];
            if (task.gemv) {
                if (mode == LL) {
                    if (!ll_read(lls[task.in_buf], xs, task.k / 8, in_flag, abort_flag)) return;
                } else {
                    for (int j = t; j < task.k / 8; j += CONSUMERS) xs[j] = ld_cg((const uint4*)in + j);
                }
                consumers_sync();
                const int per = rows_per_chunk(task.k, !use_ring);
                for (int r = 0; r < task.rows; r += per) {
                    const int rows = min(per, task.rows - r);
                    if (use_ring) {  // slot s is always warp s % 8's, so its phases are waited for in order
                        const int slot = g % slots;
                        if (slot % (CONSUMERS / 32) == t / 32) {
                            mbar_wait(ring.full + 8 * slot, (g / slots) & 1);
                            const uint4* w = (const uint4*)(ring_base + (size_t)slot * SLOT_BYTES);
                            if (task.k == 2048) gemv_warp<1>(w, xs, acc, r, rows);
                            else gemv_warp<4>(w, xs, acc, r, rows);
                            __syncwarp();
                            if ((t & 31) == 0) mbar_arrive(ring.empty + 8 * slot);
                        }
                        g++;
                    } else {
                        gemv_rows(weights + task.w_off + (long long)r * task.k, xs, acc, r, rows, task.k);
                    }
                }
                consumers_sync();
                if (mode == LL)  // (tiles start at even rows: a word's two values are one tile's)
                    for (int r = 2 * t; r < task.rows; r += 2 * CONSUMERS) {
                        const __nv_bfloat162 v = __floats2bfloat162_rn(acc[r], r + 1 < task.rows ? acc[r + 1] : 0.f);
                        ll_store(lls[task.out_buf] + (task.row0 + r) / 2, *(const u32*)&v, (u32)it + 1);
                    }
                for (int r = t; r < task.rows; r += CONSUMERS) {
                    out[task.row0 + r] = __float2bfloat16(acc[r]);
                    acc[r] = 0.f;
                }
            } else if (ll_in) {  // the small op's input through its words, its output both ways
                uint4* tmp = xs;  // (the products' vector: free between tiles)
                for (int j0 = 0; j0 < task.n_out / 8; j0 += task.n_in / 8) {
                    consumers_sync();
                    if (!ll_read(lls[task.in_buf], tmp, min(task.n_in / 8, MAX_K / 8), in_flag, abort_flag)) return;
                    consumers_sync();
                    for (int j = j0 + t; j < min(task.n_out / 8, j0 + task.n_in / 8); j += CONSUMERS) {
                        const uint4 v = tmp[j - j0];
                        ((uint4*)out)[j] = v;
                        ll_store_piece(lls[task.out_buf], j, v, (u32)it + 1);
                    }
                }
                if (t == 0)
                    while (now_ns() - start < (u64)task.delay_ns) {
                    }
            } else {
                uint4 v[8];  // n_out <= 16384: all loads in flight before the first store
#pragma unroll
                for (int u = 0; u < 8; u++) {
                    const int j = t + u * CONSUMERS;
                    if (j < task.n_out / 8) v[u] = ld_cg((const uint4*)in + j % (task.n_in / 8));
                }
#pragma unroll
                for (int u = 0; u < 8; u++) {
                    const int j = t + u * CONSUMERS;
                    if (j < task.n_out / 8) ((uint4*)out)[j] = v[u];
                    if (mode == LL && j < task.n_out / 8) ll_store_piece(lls[task.out_buf], j, v[u], (u32)it + 1);
                }
                if (t == 0)
                    while (now_ns() - start < (u64)task.delay_ns) {
                    }
            }
            consumers_sync();
            if (t == 0) {
                if (it == iterations - 1) atomicMax((unsigned long long*)stamps + 2 * task.stage + 1, now_ns());
                __threadfence();
                red_release(counters + task.stage);
            }
        }
}

// claim modes: one warp's entries of the ring, whole rows each (16-byte pieces, a lane every 32nd), its
// sums stored straight into the stage's output
template <int UPR>
__device__ __forceinline__ void gemv_warp_out(const uint4* w, const uint4* xs, __nv_bfloat16* out, int rows) {
    constexpr int PIECES = UPR * CONSUMERS / 32;
    const int lane = threadIdx.x & 31;
    for (int r = 0; r < rows; r++) {
        float part[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int i = 0; i < PIECES; i++) part[i & 3] += dot8(w[r * PIECES * 32 + i * 32 + lane], xs[i * 32 + lane]);
        float sum = (part[0] + part[1]) + (part[2] + part[3]);
#pragma unroll
        for (int o = 16; o; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        if (lane == 0) out[r] = __float2bfloat16(sum);
    }
}

__device__ __forceinline__ bool mbar_try(u32 bar, u32 parity) {
    u32 done;
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
                 : "=r"(done)
                 : "r"(bar), "r"(parity)
                 : "memory");
    return done;
}

// Loop kernel v3's schedule (claim, cstream): every product is a task on every processor; the loader
// lane claims the product's units from claims[stage] (CLAIMS_IN_FLIGHT outstanding, so each loader makes
// exactly that many failing claims a stage and iteration: iteration k's claims are
// [k (U + P C), (k + 1) (U + P C))), copies each into the next free slot and names its unit in unit_of;
// when the stage runs dry it publishes the ring index where the stage's entries end (ends, tagged with
// the stage's ordinal). Slot s is always consumer warp s % 8's, so its phases are waited for in order.
__global__ void __launch_bounds__(THREADS, 1)
probe_claim(const Task* tasks, const int* task_start, const __nv_bfloat16* weights, __nv_bfloat16* const* bufs,
            u32* counters, u32* claims, u64* stamps, int iterations, int mode, int slots, u32* abort_flag) {
    extern __shared__ __align__(128) unsigned char smem[];
    uint4* xs = (uint4*)smem;                                   // MAX_K bf16
    unsigned char* ring_base = smem + MAX_K * 2 + MAX_ROWS * 4; // slots x SLOT_BYTES
    u64* bars = (u64*)(ring_base + (size_t)slots * SLOT_BYTES);
    __shared__ int unit_of[64];
    __shared__ volatile unsigned long long ends[ENDS];  // (ordinal << 32) | end index
    __shared__ volatile int consumed;                   // stages the consumers finished
    const u32 full = (u32)__cvta_generic_to_shared(bars), empty = full + 8 * slots;
    const int t = threadIdx.x, first = task_start[blockIdx.x], end = task_start[blockIdx.x + 1], P = gridDim.x;
    if (t == 0) {
        for (int s = 0; s < slots; s++) {
            mbar_init(full + 8 * s, 1);
            mbar_init(empty + 8 * s, 1);
        }
        for (int e = 0; e < ENDS; e++) ends[e] = ~0ull;
        consumed = 0;
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (t >= CONSUMERS) {  // the loader lane
        if (t != CONSUMERS) return;
        u32 g = 0;
        int j = 0;
        for (int it = 0; it < iterations; it++)
            for (int i = first; i < end; i++) {
                const Task& task = tasks[i];
                if (!task.gemv) continue;
                // every claimer of the stage's last iteration is past its claims: the counter is this one's
                if (it > 0 && !wait_counter(counters + task.stage, (u32)it * P, abort_flag)) return;
                while (consumed <= j - ENDS)
                    if (*(volatile u32*)abort_flag) return;
                const int per = rows_per_chunk(task.k, false);
                const u32 base = (u32)it * (task.units + P * CLAIMS_IN_FLIGHT);
                u32 c0 = atomicAdd(claims + task.stage, 1u), c1 = atomicAdd(claims + task.stage, 1u);
                u32 c2 = atomicAdd(claims + task.stage, 1u), c3 = atomicAdd(claims + task.stage, 1u);
                for (;;) {
                    const u32 c = c0 - base;
                    c0 = c1, c1 = c2, c2 = c3;
                    if (c >= (u32)task.units) break;  // (c1, c2, c3 were claimed after it: dry too)
                    c3 = atomicAdd(claims + task.stage, 1u);
                    const int slot = g % slots;
                    const u32 use = g / slots;
                    if (use > 0) mbar_wait(empty + 8 * slot, (use - 1) & 1);
                    unit_of[slot] = c;
                    const int rows = min(per, task.rows - (int)c * per);
                    const u32 bytes = rows * task.k * 2;
                    mbar_expect_tx(full + 8 * slot, bytes);
                    bulk_copy((u32)__cvta_generic_to_shared(ring_base) + slot * SLOT_BYTES,
                              weights + task.w_off + (long long)c * per * task.k, bytes, full + 8 * slot);
                    g++;
                }
                ends[j % ENDS] = ((unsigned long long)j << 32) | g;
                j++;
            }
        return;
    }
    u32 g0 = 0;
    int j = 0;
    for (int it = 0; it < iterations; it++)
        for (int i = first; i < end; i++) {
            const Task& task = tasks[i];
            if (t == 0 && task.dep >= 0 && mode != CSTREAM) {
                u32 target = task.first ? (u32)it * task.dep_per_iter : (u32)(it + 1) * task.dep_per_iter;
                if (!wait_counter(counters + task.dep, target, abort_flag)) atomicExch(abort_flag, 1u);
            }
            consumers_sync();
            if (*(volatile u32*)abort_flag) return;
            const u64 start = now_ns();
            if (t == 0 && it == iterations - 1) atomicMin((unsigned long long*)stamps + 2 * task.stage, start);
            const __nv_bfloat16* in = bufs[task.in_buf];
            __nv_bfloat16* out = bufs[task.out_buf];
            if (task.gemv) {
                for (int x = t; x < task.k / 8; x += CONSUMERS) xs[x] = ld_cg((const uint4*)in + x);
                if (t == 0)
                    while (now_ns() - start < (u64)task.prologue_ns) {
                    }
                consumers_sync();
                const int per = rows_per_chunk(task.k, false), warp = t / 32;
                for (u32 gg = g0;; gg++) {
                    const int slot = gg % slots;
                    if (slot % (CONSUMERS / 32) != warp) continue;
                    bool done = false;
                    for (unsigned polls = 0;; polls++) {
                        const unsigned long long e = ends[j % ENDS];
                        if ((int)(e >> 32) == j && gg >= (u32)e) {
                            done = true;
                            break;
                        }
                        if (mbar_try(full + 8 * slot, (gg / slots) & 1)) break;
                        if ((polls & 1023) == 1023 && *(volatile u32*)abort_flag) return;
                    }
                    if (!done) {  // landed: but it may be the next stage's first entry
                        const unsigned long long e = ends[j % ENDS];
                        done = (int)(e >> 32) == j && gg >= (u32)e;
                    }
                    if (done) break;
                    const int c = unit_of[slot], rows = min(per, task.rows - c * per);
                    const uint4* w = (const uint4*)(ring_base + (size_t)slot * SLOT_BYTES);
                    if (task.k == 2048) gemv_warp_out<1>(w, xs, out + c * per, rows);
                    else gemv_warp_out<4>(w, xs, out + c * per, rows);
                    __syncwarp();
                    if ((t & 31) == 0) mbar_arrive(empty + 8 * slot);
                }
                consumers_sync();
                g0 = (u32)ends[j % ENDS];
                j++;
                if (t == 0) consumed = j;
            } else {
                uint4 v[8];
#pragma unroll
                for (int u = 0; u < 8; u++) {
                    const int x = t + u * CONSUMERS;
                    if (x < task.n_out / 8) v[u] = ld_cg((const uint4*)in + x % (task.n_in / 8));
                }
#pragma unroll
                for (int u = 0; u < 8; u++) {
                    const int x = t + u * CONSUMERS;
                    if (x < task.n_out / 8) ((uint4*)out)[x] = v[u];
                }
                if (t == 0)
                    while (now_ns() - start < (u64)task.delay_ns) {
                    }
            }
            consumers_sync();
            if (t == 0) {
                if (it == iterations - 1) atomicMax((unsigned long long*)stamps + 2 * task.stage + 1, now_ns());
                __threadfence();
                red_release(counters + task.stage);
            }
        }
}

__global__ void fill(__nv_bfloat16* w, long long n, float scale, long long seed) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        u64 h = (u64)(i + seed) * 0x9E3779B97F4A7C15ull;
        h ^= h >> 29;
        h *= 0xBF58476D1CE4E5B9ull;
        h ^= h >> 32;
        float u = ((h & 0xffffff) / 16777216.0f) * 2.f - 1.f;
        w[i] = __float2bfloat16(u * scale);
    }
}

struct Stage {
    bool gemv;
    int n, k, delay_ns;
    int prologue_ns = 0;
};

static float bf2f(__nv_bfloat16 b) {
    uint16_t s;
    memcpy(&s, &b, 2);
    u32 u = (u32)s << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

int main(int argc, char** argv) {
    const std::string mode_s = argc > 1 ? argv[1] : "ahead";
    const int slots = argc > 2 ? atoi(argv[2]) : 8;
    const std::string delays = argc > 3 ? argv[3] : "today";
    const int iterations = argc > 4 ? atoi(argv[4]) : 20;
    const int lead = argc > 5 ? atoi(argv[5]) : 0;  // chunks prefetched into L2 ahead of the ring
    const int cap = argc > 6 ? atoi(argv[6]) : 0;   // chunks in flight a loader, at most (0: no cap)
    const int mode = mode_s == "direct"  ? DIRECT
                     : mode_s == "gated"   ? GATED
                     : mode_s == "stream"  ? STREAM
                     : mode_s == "claim"   ? CLAIM
                     : mode_s == "cstream" ? CSTREAM
                     : mode_s == "ll"      ? LL
                                           : AHEAD;
    const bool claiming = mode == CLAIM || mode == CSTREAM;
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    const int P = prop.multiProcessorCount;
    const int H = 2048, I = 8192, V = 128256, L = 16, QKV = 2048 + 512 + 512;
    // small stages: today's loop kernel (docs/runtime.md, profile at 2ae6b15 / 27d035c), or v2's fused
    // instructions (norms inside q/k/v and gate/up, rope into the cache inside q/k/v, silu_mul inside down)
    std::vector<Stage> st;
    auto small = [&](int n, int us10) {
        if (delays == "none") us10 = 0;
        st.push_back({false, n, 0, us10 * 100});
    };
    const bool v3 = delays == "v3" || delays == "v3fast";
    for (int l = 0; v3 && l < L; l++) {  // v3: norms inside, rope and the cache append inside attention,
        st.push_back({true, QKV, H, 0});  // attention one stage, its combine the o projection's prologue
        small(QKV, delays == "v3" ? 45 : 25);
        st.push_back({true, H, H, 0, delays == "v3" ? 1000 : 500});
        st.push_back({true, 2 * I, H, 0});
        st.push_back({true, H, I, 0});
    }
    for (int l = 0; !v3 && l < L; l++) {
        if (delays != "fused") small(H, 13);                      // input norm
        st.push_back({true, QKV, H, 0});
        if (delays != "fused") small(QKV, 20);                    // rope(q) | rope k into the cache, v
        small(QKV, 48);                                           // attention partial
        small(H, 15);                                             // attention combine
        st.push_back({true, H, H, 0});                            // o
        if (delays != "fused") small(H, 16);                      // post-attention norm
        st.push_back({true, 2 * I, H, 0});                        // gate | up
        if (delays != "fused") small(I, 18);                      // silu_mul
        st.push_back({true, H, I, 0});                            // down
    }
    if (!v3) small(H, 13);  // final norm (v3: inside the LM head)
    st.push_back({true, V, H, 0});
    small(H, 30);  // argmax partials + combine, then the embedding
    // buffers: buffer s is stage s's output; stage s reads s - 1's (stage 0 the last's)
    const int S = st.size();
    std::vector<__nv_bfloat16*> bufs(S);
    long long weight_elems = 0;
    for (int s = 0; s < S; s++) {
        CK(cudaMalloc(&bufs[s], (size_t)st[s].n * 2));
        CK(cudaMemset(bufs[s], 0, (size_t)st[s].n * 2));
        if (st[s].gemv) weight_elems += (long long)st[s].n * st[s].k;
    }
    {  // a non-zero start vector for stage 0's input
        std::vector<__nv_bfloat16> x(st[S - 1].n);
        for (size_t i = 0; i < x.size(); i++) x[i] = __float2bfloat16(0.5f * sinf(0.37f * i));
        CK(cudaMemcpy(bufs[S - 1], x.data(), x.size() * 2, cudaMemcpyHostToDevice));
    }
    // ll mode's words: flags no iteration has (all ones), the start vector's with flag 0 (iteration 0 reads it)
    // (again before every run: a run's flags start from iteration 0)
    std::vector<u64*> lls(S);
    for (int s = 0; s < S; s++) CK(cudaMalloc(&lls[s], (size_t)st[s].n * 4));
    std::vector<u64> start_words(st[S - 1].n / 2);
    {
        std::vector<__nv_bfloat16> x(st[S - 1].n);
        CK(cudaMemcpy(x.data(), bufs[S - 1], x.size() * 2, cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < start_words.size(); i++) {
            start_words[i] = 0;  // (flag 0 in the high half)
            memcpy(&start_words[i], &x[2 * i], 4);
        }
    }
    auto reset_words = [&]() {
        for (int s = 0; s < S; s++) CK(cudaMemset(lls[s], 0xff, (size_t)st[s].n * 4));
        CK(cudaMemcpy(lls[S - 1], start_words.data(), start_words.size() * 8, cudaMemcpyHostToDevice));
    };
    u64** d_lls;
    CK(cudaMalloc(&d_lls, S * sizeof(void*)));
    CK(cudaMemcpy(d_lls, lls.data(), S * sizeof(void*), cudaMemcpyHostToDevice));
    __nv_bfloat16* weights;
    CK(cudaMalloc(&weights, weight_elems * 2));
    // tasks, per processor in stage order; small stage s runs on processor (7 s) % P
    std::vector<std::vector<Task>> per(P);
    std::vector<long long> w_off(S, -1);
    std::vector<int> tiles(S);
    long long off = 0;
    for (int s = 0; s < S; s++) {
        const int prev = (s + S - 1) % S;
        if (st[s].gemv && claiming) {  // every processor takes part; its loader claims the units
            w_off[s] = off;
            const int n = st[s].n, unit = rows_per_chunk(st[s].k, false);
            tiles[s] = P;
            for (int p = 0; p < P; p++) {
                Task tk{1, s, -1, 0, s == 0, st[s].k, 0, n, off, prev, s, st[prev].n, n, 0, (n + unit - 1) / unit,
                        st[s].prologue_ns};
                per[p].push_back(tk);
            }
            fill<<<1024, 256>>>(weights + off, (long long)n * st[s].k, sqrtf(3.f / st[s].k), off);
            CK(cudaGetLastError());
            off += (long long)n * st[s].k;
        } else if (st[s].gemv) {
            w_off[s] = off;
            const int n = st[s].n;
            tiles[s] = std::min(P, n);
            for (int p = 0; p < tiles[s]; p++) {  // (at even rows: ll mode's words hold two)
                const int r0 = 2 * (int)((long long)(n / 2) * p / tiles[s]), r1 = 2 * (int)((long long)(n / 2) * (p + 1) / tiles[s]);
                Task tk{1, s, -1, 0, s == 0, st[s].k, r0, r1 - r0, off + (long long)r0 * st[s].k, prev, s, st[prev].n, n, 0,
                        0, st[s].prologue_ns};
                per[p].push_back(tk);
            }
            fill<<<1024, 256>>>(weights + off, (long long)n * st[s].k, sqrtf(3.f / st[s].k), off);
            CK(cudaGetLastError());
            off += (long long)n * st[s].k;
        } else {
            tiles[s] = 1;
            Task tk{0, s, -1, 0, s == 0, 0, 0, 0, 0, prev, s, st[prev].n, st[s].n, st[s].delay_ns, 0, 0};
            per[(7 * s) % P].push_back(tk);
        }
    }
    std::vector<Task> all;
    std::vector<int> start(P + 1);
    for (int p = 0; p < P; p++) {
        start[p] = all.size();
        for (Task tk : per[p]) {
            const int prev = (tk.stage + S - 1) % S;
            tk.dep = prev;
            tk.dep_per_iter = tiles[prev];
            all.push_back(tk);
        }
    }
    start[P] = all.size();
    for (const Task& tk : all)
        if (tk.gemv && ((tk.units == 0 && tk.rows > MAX_ROWS) || tk.k > MAX_K)) {
            printf("tile of %d rows x %d is beyond the probe's shared memory\n", tk.rows, tk.k);
            return 1;
        }
    Task* d_tasks;
    int* d_start;
    __nv_bfloat16** d_bufs;
    u32 *counters, *abort_flag;
    u64* stamps;
    CK(cudaMalloc(&stamps, S * 16));
    CK(cudaMalloc(&d_tasks, all.size() * sizeof(Task)));
    CK(cudaMemcpy(d_tasks, all.data(), all.size() * sizeof(Task), cudaMemcpyHostToDevice));
    CK(cudaMalloc(&d_start, start.size() * 4));
    CK(cudaMemcpy(d_start, start.data(), start.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&d_bufs, S * sizeof(void*)));
    CK(cudaMemcpy(d_bufs, bufs.data(), S * sizeof(void*), cudaMemcpyHostToDevice));
    CK(cudaMalloc(&counters, S * 4));
    u32* claims;
    CK(cudaMalloc(&claims, S * 4));
    CK(cudaMalloc(&abort_flag, 4));
    const int ring_slots = mode == DIRECT ? 0 : slots;
    const size_t shm = MAX_K * 2 + MAX_ROWS * 4 + (size_t)ring_slots * SLOT_BYTES + 2 * std::max(ring_slots, 1) * 8;
    CK(cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)shm));
    CK(cudaFuncSetAttribute(probe_claim, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)shm));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    std::vector<float> times;
    for (int rep = 0; rep < 4; rep++) {
        CK(cudaMemset(counters, 0, S * 4));
        CK(cudaMemset(abort_flag, 0, 4));
        if (mode == LL) reset_words();
        std::vector<u64> init(2 * S, 0);
        for (int s = 0; s < S; s++) init[2 * s] = ~0ull;
        CK(cudaMemcpy(stamps, init.data(), S * 16, cudaMemcpyHostToDevice));
        CK(cudaEventRecord(e0));
        CK(cudaMemset(claims, 0, S * 4));
        if (claiming)
            probe_claim<<<P, THREADS, shm>>>(d_tasks, d_start, weights, d_bufs, counters, claims, stamps, iterations,
                                             mode, ring_slots, abort_flag);
        else
            probe<<<P, THREADS, shm>>>(d_tasks, d_start, weights, d_bufs, counters, stamps, iterations, mode,
                                       ring_slots, lead, abort_flag, d_lls, cap);
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        CK(cudaGetLastError());
        u32 aborted;
        CK(cudaMemcpy(&aborted, abort_flag, 4, cudaMemcpyDeviceToHost));
        if (aborted) {
            printf("aborted\n");
            return 1;
        }
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (rep > 0) times.push_back(ms * 1000.f / iterations);
    }
    std::sort(times.begin(), times.end());
    // the last iteration of the last run: each stage from its first task's start (after its waits) to its
    // last task's end; a handoff from the previous stage's end to this one's start
    std::vector<u64> stamp(2 * S);
    CK(cudaMemcpy(stamp.data(), stamps, S * 16, cudaMemcpyDeviceToHost));
    double gemv_us = 0, small_us = 0, handoff_us = 0, step_us = (stamp[2 * S - 1] - stamp[0]) * 1e-3;
    for (int s = 0; s < S; s++) {
        (st[s].gemv ? gemv_us : small_us) += (stamp[2 * s + 1] - stamp[2 * s]) * 1e-3;
        if (s > 0) handoff_us += ((double)stamp[2 * s] - (double)stamp[2 * s - 1]) * 1e-3;
    }
    // check every product of layer 0 and 4096 rows of the LM head: the last iteration's input and output
    double worst = 0.0;
    int worst_stage = -1, worst_row = -1;
    for (int s = 0; s < S; s++) {
        // stage 0 read the previous iteration's last output, which the last iteration overwrote
        if (!st[s].gemv || s == 0 || (s > 10 && s != S - 2)) continue;
        const int prev = (s + S - 1) % S, n = st[s].n, k = st[s].k;
        std::vector<__nv_bfloat16> x(k), y(n);
        CK(cudaMemcpy(x.data(), bufs[prev], k * 2, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(y.data(), bufs[s], n * 2, cudaMemcpyDeviceToHost));
        const int rows = s == S - 2 ? 4096 : n;
        std::vector<__nv_bfloat16> w((size_t)rows * k);
        CK(cudaMemcpy(w.data(), weights + w_off[s], w.size() * 2, cudaMemcpyDeviceToHost));
        for (int r = 0; r < rows; r++) {
            double ref = 0.0, mag = 0.0;
            for (int j = 0; j < k; j++) {
                const double p = (double)bf2f(w[(size_t)r * k + j]) * bf2f(x[j]);
                ref += p;
                mag += fabs(p);
            }
            // bf16 rounding of the output plus float32 accumulation over k terms
            const double err = fabs(bf2f(y[r]) - ref) / (fabs(ref) * 0.0079 + mag * k * 1.2e-7 + 1e-30);
            if (err > worst) worst = err, worst_stage = s, worst_row = r;
        }
    }
    const double gb = weight_elems * 2 / 1e9;
    printf("{\"mode\": \"%s\", \"cap_kb\": %d, \"l2_lead_kb\": %d, \"slots\": %d, \"ring_kb\": %d, \"delays\": \"%s\", \"stages\": %d, \"weights_gb\": %.3f, "
           "\"us_per_token_median\": %.1f, \"us_per_token_min\": %.1f, \"tb_per_s\": %.2f, \"worst_error_over_bound\": %.3f, "
           "\"worst_at\": [%d, %d], \"last_step_us\": %.1f, \"gemv_stages_us\": %.1f, \"small_stages_us\": %.1f, "
           "\"handoffs_us\": %.1f}\n",
           mode_s.c_str(), cap * SLOT_BYTES / 1024, lead * SLOT_BYTES / 1024, ring_slots, ring_slots * SLOT_BYTES / 1024, delays.c_str(), S, gb, times[times.size() / 2],
           times[0], gb * 1e3 / times[times.size() / 2], worst, worst_stage, worst_row, step_us, gemv_us,
           small_us, handoff_us);
    return mode != STREAM && mode != CSTREAM && worst > 1.0 ? 2 : 0;
}

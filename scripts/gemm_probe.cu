// GEMM probe: how fast can one persistent block per SM multiply bf16 matrices with Hopper's tensor cores,
// under the ways of feeding them that the loop kernel could use? C[M, N] = A[M, K] * B[N, K]^T (both
// K-contiguous, as the loop kernel's matmul tiles see weights), 128 x 256 blocks, fp32 accumulation.
//   mode 1: bulk tensor copies (TMA) into a ring of 4 stages, issued by a producer warp, completing on
//           mbarriers; two consumer warpgroups (64 x 256 each) release stages through "empty" mbarriers.
//   mode 2: as mode 1 in clusters of 2 blocks along M: the two blocks share B's 256 rows, each copies
//           half and multicasts it into both, halving B's traffic from L2.
//   mode 3: clusters of 2 x 2 blocks (A and B both shared by two blocks); mode 4: 1 x 2 (A shared).
// Tiles go to processors as the loop kernel's static lists do: processor p takes tiles p, p + P, ...
// (pairs of tiles for clusters), row-major over (row block, column block) or grouped (GROUP row blocks
// swept column by column, so that concurrent tiles share operands in L2).
// Measures the hardware the matmul tile is designed against; not part of the package.
//   nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -I megaloop/codegen/include -o scripts/gemm_probe.bin scripts/gemm_probe.cu -lcuda
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "megaloop/types.cuh"
#include "megaloop/vec.cuh"
#include "megaloop/wgmma_ops.cuh"
#include "megaloop/wgmma.cuh"

#define CK(x)                                                                  \
    do {                                                                       \
        cudaError_t e = (x);                                                   \
        if (e != cudaSuccess) {                                                \
            printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
            exit(1);                                                           \
        }                                                                      \
    } while (0)

using ml::u32;
using ml::u64;

constexpr int BM = 128, BN = 256, BK = 64, STAGES = 4;
constexpr int A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2, STAGE_BYTES = A_BYTES + B_BYTES;
constexpr int THREADS = 288;  // warpgroups 0, 1 consume; warp 8 produces

__device__ __forceinline__ void mbar_init(u32 bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    asm volatile(
        "{\n .reg .pred p;\n W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra W;\n}" ::"r"(bar),
        "r"(parity)
        : "memory");
}
// arrive on the barrier at the same offset in block `cta` of the cluster (this block included)
__device__ __forceinline__ void mbar_arrive_cluster(u32 bar, u32 cta) {
    asm volatile(
        "{\n .reg .b32 r;\n mapa.shared::cluster.u32 r, %0, %1;\n mbarrier.arrive.release.cluster.shared::cluster.b64 _, [r];\n}" ::"r"(bar),
        "r"(cta)
        : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void tma_load(u32 dst, const CUtensorMap* map, u32 bar, int c0, int c1) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::"r"(dst),
        "l"(map), "r"(bar), "r"(c0), "r"(c1)
        : "memory");
}
__device__ __forceinline__ void tma_load_multicast(u32 dst, const CUtensorMap* map, u32 bar, int c0, int c1, unsigned short mask) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(dst),
        "l"(map), "r"(bar), "r"(c0), "r"(c1), "h"(mask)
        : "memory");
}
__device__ __forceinline__ u32 cluster_rank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// tile t of a tiles_m x tiles_n grid: (row block, column block), row-major or grouped
__device__ __forceinline__ void tile_coords(int t, int tiles_m, int tiles_n, int group, int& tm, int& tn) {
    if (group <= 0) {
        tm = t / tiles_n, tn = t % tiles_n;
        return;
    }
    const int per = group * tiles_n, g = t / per, first = g * group, rows = min(group, tiles_m - first);
    tm = first + (t % per) % rows, tn = (t % per) / rows;
}

// Clusters of CM x CN blocks (rank r: row r % CM, column r / CM): the CN blocks of a row of the
// cluster share A's rows, the CM blocks of a column share B's; each block copies 1 / CN of its A tile and
// 1 / CM of its B tile and multicasts them to the blocks that share them.
// Variants (experiments): EPI 0 skips the stores of C; WAITN is how many slices' wgmmas stay in flight
// when a consumer moves on; FEED 0 copies nothing after the first tile's stages (the tensor cores' issue
// ceiling on stale operands), FEED 2 copies K columns 0-63 for every slice (always in L2).
template <int CM, int CN, int EPI = 1, int WAITN = 1, int FEED = 1>
__global__ void __launch_bounds__(THREADS, 1)
    gemm(const CUtensorMap* maps, __nv_bfloat16* C, int M, int N, int K, int group, u64* cycles) {
    constexpr int CLUSTER = CM * CN;
    extern __shared__ char smem_raw[];
    char* smem = smem_raw + ((1024 - (ml::shared_address(smem_raw) & 1023)) & 1023);
    const u32 s0 = ml::shared_address(smem);
    const u32 full = s0 + STAGES * STAGE_BYTES, empty = full + 8 * STAGES;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const u32 me = CLUSTER > 1 ? cluster_rank() : 0, rm = me % CM, rn = me / CM;
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full + 8 * s, 1);
            mbar_init(empty + 8 * s, 2 * CLUSTER);  // each consumer warpgroup of each block of the cluster
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    if (CLUSTER > 1)
        cluster_sync();
    else
        __syncthreads();
    const int tiles_m = M / BM, tiles_n = N / BN, units = tiles_m * tiles_n / CLUSTER;
    const int proc = blockIdx.x / CLUSTER, procs = gridDim.x / CLUSTER;
    const int slices = K / BK;
    u64 t0 = clock64();
    if (warp == 8) {  // producer
        if (lane == 0) {
            unsigned short a_mask = 0, b_mask = 0;  // the blocks of my cluster row (share A), column (share B)
            for (int j = 0; j < CN; ++j) a_mask |= 1u << (rm + j * CM);
            for (int i = 0; i < CM; ++i) b_mask |= 1u << (i + rn * CM);
            int it = 0;
            for (int u = proc; u < units; u += procs) {
                int tm, tn;
                tile_coords(u, tiles_m / CM, tiles_n / CN, group, tm, tn);
                const int m0 = (tm * CM + rm) * BM, n0 = (tn * CN + rn) * BN;
                for (int s = 0; s < slices; ++s, ++it) {
                    if (!FEED && it >= STAGES) break;
                    const int kc = FEED == 2 ? 0 : s * BK;
                    const int st = it % STAGES;
                    const u32 ph = (it / STAGES) & 1;
                    mbar_wait(empty + 8 * st, ph ^ 1);
                    mbar_expect_tx(full + 8 * st, STAGE_BYTES);
                    const u32 dst = s0 + st * STAGE_BYTES, bar = full + 8 * st;
                    if (CN == 1) tma_load(dst, &maps[0], bar, kc, m0);
                    else tma_load_multicast(dst + rn * (A_BYTES / CN), &maps[3], bar, kc, m0 + rn * (BM / CN), a_mask);
                    if (CM == 1) tma_load(dst + A_BYTES, &maps[1], bar, kc, n0);
                    else tma_load_multicast(dst + A_BYTES + rm * (B_BYTES / CM), &maps[2], bar, kc, n0 + rm * (BN / CM), b_mask);
                }
            }
        }
    } else {  // consumers
        const int wg = warp >> 2, g = lane >> 2, q = lane & 3;
        int it = 0;
        for (int u = proc; u < units; u += procs) {
            int tm, tn;
            tile_coords(u, tiles_m / CM, tiles_n / CN, group, tm, tn);
            const int m0 = (tm * CM + rm) * BM, n0 = (tn * CN + rn) * BN;
            float d[BN / 2];
#pragma unroll
            for (int i = 0; i < BN / 2; ++i) d[i] = 0.0f;
            for (int s = 0; s < slices; ++s, ++it) {
                const int st = it % STAGES;
                if (FEED || it < STAGES) mbar_wait(full + 8 * st, (it / STAGES) & 1);
                const u32 sa = s0 + st * STAGE_BYTES + wg * 64 * BK * 2, sb = s0 + st * STAGE_BYTES + A_BYTES;
                ml::wgmma_fence_registers<BN / 2>(d);
                ml::wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < BK / 16; ++kk)
                    ml::Wgmma<ml::bf16, BN>::mma(d, ml::wgmma_desc(sa + 32 * kk), ml::wgmma_desc(sb + 32 * kk));
                ml::wgmma_commit();
                ml::wgmma_wait<WAITN>();
                ml::wgmma_fence_registers<BN / 2>(d);
                if (FEED && s > 0 && (threadIdx.x & 127) < CLUSTER) {  // slice s - 1 is read: its stage may refill
                    const int prev = (it - 1) % STAGES;
                    mbar_arrive_cluster(empty + 8 * prev, threadIdx.x & 127);
                }
            }
            ml::wgmma_wait<0>();
            ml::wgmma_fence_registers<BN / 2>(d);
            if (FEED && (threadIdx.x & 127) < CLUSTER) mbar_arrive_cluster(empty + 8 * ((it - 1) % STAGES), threadIdx.x & 127);
            if (!EPI) {
                if (d[0] == 1234.5f && d[BN / 2 - 1] == 1.0f) C[0] = __float2bfloat16(d[7]);  // keep the sums live
                continue;
            }
            const int row = m0 + 64 * wg + 16 * (warp & 3) + g;
#pragma unroll
            for (int n = 0; n < BN / 8; ++n) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    __nv_bfloat162 v = __floats2bfloat162_rn(d[4 * n + 2 * h], d[4 * n + 2 * h + 1]);
                    *reinterpret_cast<__nv_bfloat162*>(C + (size_t)(row + 8 * h) * N + n0 + 8 * n + 2 * q) = v;
                }
            }
        }
    }
    if (CLUSTER > 1) cluster_sync();  // no block leaves while another may still write into it
    if (threadIdx.x == 0) cycles[blockIdx.x] = clock64() - t0;
}

static CUtensorMap make_map(void* base, int rows, int K, int box_rows) {
    CUtensorMap m;
    cuuint64_t dims[2] = {(cuuint64_t)K, (cuuint64_t)rows};
    cuuint64_t strides[1] = {(cuuint64_t)K * 2};
    cuuint32_t box[2] = {BK, (cuuint32_t)box_rows};
    cuuint32_t elem[2] = {1, 1};
    CUresult r = cuTensorMapEncodeTiled(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, base, dims, strides, box, elem,
                                        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                        CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
        printf("cuTensorMapEncodeTiled failed: %d\n", (int)r);
        exit(1);
    }
    return m;
}

template <int CM, int CN, int EPI = 1, int WAITN = 1, int FEED = 1>
static float run(const CUtensorMap* maps, __nv_bfloat16* C, int n, int group, u64* cycles, int reps, int warmup = 0) {
    constexpr int CLUSTER = CM * CN;
    auto kernel = gemm<CM, CN, EPI, WAITN, FEED>;
    const int smem = STAGES * STAGE_BYTES + 1024 + 64 * STAGES;
    CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(132);
    cfg.blockDim = dim3(THREADS);
    cfg.dynamicSmemBytes = smem;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = CLUSTER;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    if (CLUSTER > 1) {
        int clusters = 0;
        CK(cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg));
        printf("  max active clusters of %d: %d\n", CLUSTER, clusters);
    }
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    std::vector<float> ms;
    for (int r = 0; r < reps + 3 + warmup; ++r) {
        CK(cudaEventRecord(e0));
        CK(cudaLaunchKernelEx(&cfg, kernel, maps, C, n, n, n, group, cycles));
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        float t;
        CK(cudaEventElapsedTime(&t, e0, e1));
        if (r >= 3 + warmup) ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
}

int main(int argc, char** argv) {
    CK(cudaFree(0));
    // gemm_probe N MODE GROUP: one launch of one configuration (to profile it), no timing
    const int only_n = argc > 3 ? atoi(argv[1]) : 0, only_mode = argc > 3 ? atoi(argv[2]) : 0;
    const int only_group = argc > 3 ? atoi(argv[3]) : 0;
    for (int n : {4096, 8192}) {
        if (only_n && n != only_n) continue;
        const size_t elems = (size_t)n * n;
        std::vector<__nv_bfloat16> ha(elems), hb(elems);
        srand(n);
        for (size_t i = 0; i < elems; ++i) {
            ha[i] = __float2bfloat16((rand() / (float)RAND_MAX) * 2 - 1);
            hb[i] = __float2bfloat16((rand() / (float)RAND_MAX) * 2 - 1);
        }
        __nv_bfloat16 *A, *B, *C;
        CK(cudaMalloc(&A, elems * 2));
        CK(cudaMalloc(&B, elems * 2));
        CK(cudaMalloc(&C, elems * 2));
        CK(cudaMemcpy(A, ha.data(), elems * 2, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(B, hb.data(), elems * 2, cudaMemcpyHostToDevice));
        CUtensorMap hmaps[4] = {make_map(A, n, n, BM), make_map(B, n, n, BN), make_map(B, n, n, BN / 2),
                                make_map(A, n, n, BM / 2)};
        CUtensorMap* maps;
        CK(cudaMalloc(&maps, sizeof(hmaps)));
        CK(cudaMemcpy(maps, hmaps, sizeof(hmaps), cudaMemcpyHostToDevice));
        u64* cycles;
        CK(cudaMalloc(&cycles, 132 * 8));
        // clocks up: about a second of work before the first timed launch
        if (only_n) {
            if (only_mode == 1) run<1, 1>(maps, C, n, only_group, cycles, 1, -3);
            else if (only_mode == 2) run<2, 1>(maps, C, n, only_group, cycles, 1, -3);
            else run<2, 2>(maps, C, n, only_group, cycles, 1, -3);
            CK(cudaDeviceSynchronize());
            return 0;
        }
        if (n == 4096) run<1, 1>(maps, C, n, 0, cycles, 1, 4000);
        for (int mode = 1; mode <= 4; ++mode) {  // clusters 1 x 1, 2 x 1, 2 x 2, 1 x 2
            for (int group : {0, 8, 16}) {
                CK(cudaMemset(C, 0xff, elems * 2));
                const int reps = n == 4096 ? 20 : 5;
                float ms = mode == 1   ? run<1, 1>(maps, C, n, group, cycles, reps)
                           : mode == 2 ? run<2, 1>(maps, C, n, group, cycles, reps)
                           : mode == 3 ? run<2, 2>(maps, C, n, group, cycles, reps)
                                       : run<1, 2>(maps, C, n, group, cycles, reps);
                // spot-check 64 entries against a double-precision dot product
                std::vector<__nv_bfloat16> hc(elems);
                CK(cudaMemcpy(hc.data(), C, elems * 2, cudaMemcpyDeviceToHost));
                double worst = 0;
                for (int s = 0; s < 64; ++s) {
                    const int i = (s * 7919) % n, j = (s * 104729 + 13) % n;
                    double ref = 0;
                    for (int k = 0; k < n; ++k)
                        ref += (double)__bfloat162float(ha[(size_t)i * n + k]) * __bfloat162float(hb[(size_t)j * n + k]);
                    const double got = __bfloat162float(hc[(size_t)i * n + j]);
                    worst = std::max(worst, std::fabs(got - ref) / (std::fabs(ref) + std::sqrt((double)n) * 0.05));
                }
                printf("n %d mode %d group %2d: %.3f ms  %.1f TFLOP/s  worst scaled error %.4f\n", n, mode, group, ms,
                       2.0 * n * n * (double)n / ms / 1e9, worst);
                fflush(stdout);
            }
        }
        if (!only_n && n == 8192) {  // experiments at the group 8 order
            const struct { const char* what; float (*f)(const CUtensorMap*, __nv_bfloat16*, int, int, u64*, int, int); } ex[] = {
                {"cluster 2x1, no stores of C", run<2, 1, 0, 1, 1>},
                {"cluster 2x1, wait<0>", run<2, 1, 1, 0, 1>},
                {"cluster 2x1, operands copied once (issue ceiling)", run<2, 1, 1, 1, 0>},
                {"cluster 2x1, every slice copies the same K columns", run<2, 1, 1, 1, 2>},
                {"no cluster, every slice copies the same K columns", run<1, 1, 1, 1, 2>},
                {"cluster 2x2, every slice copies the same K columns", run<2, 2, 1, 1, 2>},
                {"cluster 2x2, no stores of C", run<2, 2, 0, 1, 1>},
            };
            for (auto& e : ex) {
                const float ms = e.f(maps, C, n, 8, cycles, 5, 0);
                printf("n %d %s: %.3f ms  %.1f TFLOP/s\n", n, e.what, ms, 2.0 * n * n * (double)n / ms / 1e9);
            }
        }
        CK(cudaFree(A));
        CK(cudaFree(B));
        CK(cudaFree(C));
        CK(cudaFree(maps));
        CK(cudaFree(cycles));
    }
    return 0;
}

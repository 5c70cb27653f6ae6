// scripts/sm_bandwidth_probe.cu: how fast each block of a one-block-per-SM grid streams memory while
// every block streams at once (the decode step's products), and which SM it ran on. Answers whether
// the profile's slow processors are a property of the block index (stable across launches) or of the
// SM, before the schedule is told processors' speeds.
//   nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/smbw scripts/sm_bandwidth_probe.cu && /tmp/smbw [MB a block] [launches]
// Prints one JSON object a launch: per block its SM and its microseconds. The last launches ("balanced")
// give each block bytes in proportion to its speed in the first ones, the same bytes in all: does the
// whole stream then end sooner (the fast blocks had room to go faster), or is the total rate fixed?
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); exit(1); } } while (0)

constexpr int SLOTS = 8, SLOT_BYTES = 16384;

__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

__device__ __forceinline__ unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// one lane streams the block's bytes through SLOTS bulk copies in flight; the block's warps read each slot
__global__ void stream(const char* src, long long per_block, const int* block_chunks, unsigned long long* out,
                       float* sink) {
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned long long* bars = reinterpret_cast<unsigned long long*>(smem + SLOTS * SLOT_BYTES);
    const char* mine = src + per_block * blockIdx.x;
    const int chunks = block_chunks[blockIdx.x];
    if (threadIdx.x == 0) {
        for (int s = 0; s < SLOTS; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bars + s)));
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    const unsigned long long t0 = now_ns();
    auto issue = [&](int c) {
        const int s = c % SLOTS;
        const unsigned bar = smem_addr(bars + s);
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(SLOT_BYTES) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     ::"r"(smem_addr(smem + s * SLOT_BYTES)), "l"(mine + (long long)c * SLOT_BYTES), "r"(SLOT_BYTES), "r"(bar)
                     : "memory");
    };
    if (threadIdx.x == 0)
        for (int c = 0; c < SLOTS && c < chunks; ++c) issue(c);
    float acc = 0.f;
    for (int c = 0; c < chunks; ++c) {
        const int s = c % SLOTS;
        const unsigned bar = smem_addr(bars + s), phase = (c / SLOTS) & 1;
        unsigned done = 0;
        while (!done)
            asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                         : "=r"(done) : "r"(bar), "r"(phase) : "memory");
        const float4* v = reinterpret_cast<const float4*>(smem + s * SLOT_BYTES);
        for (int i = threadIdx.x; i < SLOT_BYTES / 16; i += blockDim.x) acc += v[i].x + v[i].w;
        __syncthreads();
        if (threadIdx.x == 0 && c + SLOTS < chunks) {
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            issue(c + SLOTS);
        }
    }
    const unsigned long long t1 = now_ns();
    if (threadIdx.x == 0) {
        unsigned sm;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
        out[3 * blockIdx.x] = t0;
        out[3 * blockIdx.x + 1] = t1;
        out[3 * blockIdx.x + 2] = sm;
    }
    if (acc == 12345.f) sink[blockIdx.x] = acc;
}

int main(int argc, char** argv) {
    const long long mb = argc > 1 ? atoll(argv[1]) : 2;
    const int launches = argc > 2 ? atoi(argv[2]) : 5;
    int sms;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const long long per_block = mb << 20;
    char* src;
    unsigned long long* out;
    float* sink;
    CHECK(cudaMalloc(&src, 2 * per_block * sms));
    CHECK(cudaMemset(src, 1, 2 * per_block * sms));
    CHECK(cudaMalloc(&out, 3 * sizeof(unsigned long long) * sms));
    CHECK(cudaMalloc(&sink, sizeof(float) * sms));
    int* chunks;
    CHECK(cudaMalloc(&chunks, sizeof(int) * sms));
    std::vector<int> hc(sms, (int)(per_block / SLOT_BYTES));
    std::vector<double> speed(sms, 0.0);
    const int smem = SLOTS * SLOT_BYTES + SLOTS * 8 + 60000;  // one block an SM, like the loop kernel
    CHECK(cudaFuncSetAttribute(stream, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    std::vector<unsigned long long> h(3 * sms);
    for (int l = 0; l < 2 * launches; ++l) {
        if (l == launches) {  // bytes in proportion to each block's speed so far, the same total
            double total = 0;
            for (int b = 0; b < sms; ++b) total += speed[b];
            const long long all = (per_block / SLOT_BYTES) * sms;
            for (int b = 0; b < sms; ++b) hc[b] = (int)(all * speed[b] / total);
        }
        CHECK(cudaMemcpy(chunks, hc.data(), sizeof(int) * sms, cudaMemcpyHostToDevice));
        stream<<<sms, 256, smem>>>(src, per_block * 2, chunks, out, sink);
        CHECK(cudaDeviceSynchronize());
        CHECK(cudaMemcpy(h.data(), out, h.size() * 8, cudaMemcpyDeviceToHost));
        unsigned long long first = ~0ull, last = 0;
        for (int b = 0; b < sms; ++b) first = h[3 * b] < first ? h[3 * b] : first, last = h[3 * b + 1] > last ? h[3 * b + 1] : last;
        long long bytes = 0;
        for (int b = 0; b < sms; ++b) bytes += (long long)hc[b] * SLOT_BYTES;
        if (l < launches)
            for (int b = 0; b < sms; ++b) speed[b] += 1.0 / (double)(h[3 * b + 1] - h[3 * b]);
        printf("{\"launch\": %d, \"balanced\": %d, \"mb_a_block\": %lld, \"makespan_us\": %.2f, \"total_gbs\": %.1f, \"sm\": [",
               l, l >= launches, mb, (last - first) / 1e3, bytes / (double)(last - first));
        for (int b = 0; b < sms; ++b) printf("%s%llu", b ? ", " : "", h[3 * b + 2]);
        printf("], \"us\": [");
        for (int b = 0; b < sms; ++b) printf("%s%.2f", b ? ", " : "", (h[3 * b + 1] - h[3 * b]) / 1e3);
        printf("], \"start_us\": [");
        for (int b = 0; b < sms; ++b) printf("%s%.2f", b ? ", " : "", (h[3 * b] - first) / 1e3);
        printf("]}\n");
    }
    return 0;
}

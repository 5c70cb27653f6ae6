// NVLink probe: latency of a hop between two GPUs under each way of handing data over, and bulk
// bandwidth of peer stores (push) against peer loads (pull), one and both directions at once.
// Measures the hardware the collectives are designed against; not part of the package.
//   nvcc -O3 -arch=sm_90a -o /tmp/nvlink_probe scripts/nvlink_probe.cu && /tmp/nvlink_probe
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>
typedef unsigned long long u64;
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); exit(1); } } while (0)

__device__ __forceinline__ u64 now_ns() { u64 t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }
__device__ __forceinline__ u64 ld_relaxed_sys(const u64* p) { u64 v; asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory"); return v; }
__device__ __forceinline__ void st_relaxed_sys(u64* p, u64 v) { asm volatile("st.relaxed.sys.global.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory"); }
__device__ __forceinline__ void red_release_sys(u64* p, u64 v) { asm volatile("red.release.sys.global.add.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory"); }
__device__ __forceinline__ void st_release_sys(u64* p, u64 v) { asm volatile("st.release.sys.global.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory"); }

// mode 0: flag only, relaxed store into the peer's memory, poll own memory.
// mode 1: flag only, red.release.sys into the peer's memory.
// mode 2: 4 KB data stored into the peer (256 threads x 16 B), __syncthreads, thread 0 red.release.sys flag.
// mode 3: pull: flag bumped in own memory (red.release.gpu... sys), peer polls it across NVLink, then loads 4 KB across NVLink.
// mode 4: LL: 4 KB data as (u32 data, u32 flag) packets, 16-byte stores, receiver polls the packets.
// mode 5: like 2 but 32 KB (each thread 8 x 16 B).
// mode 6: LL with 32 KB.
__global__ void pingpong(int mode, int me, int iters, u64* my_flag, u64* peer_flag, uint4* my_buf, uint4* peer_buf,
                         u64* out) {
    const int tid = threadIdx.x;
    __shared__ int ok;
    u64 t0 = now_ns();
    const int packs = (mode == 5 || mode == 6) ? 8 : 1;
    for (int i = 1; i <= iters; ++i) {
        const bool my_turn_first = me == 0;
        for (int phase = 0; phase < 2; ++phase) {
            const bool send = (phase == 0) == my_turn_first;
            const u64 seq = 2 * (u64)i + (send ? (me == 0 ? 0 : 1) : (me == 0 ? 1 : 0));
            (void)seq;
            if (send) {
                if (mode == 0) { if (tid == 0) st_relaxed_sys(peer_flag, i); }
                else if (mode == 1) { if (tid == 0) red_release_sys(peer_flag, 1); }
                else if (mode == 2 || mode == 5) {
                    for (int p = 0; p < packs; ++p) peer_buf[tid + 256 * p] = make_uint4(i, i, i, i);
                    __syncthreads();
                    if (tid == 0) red_release_sys(peer_flag, 1);
                } else if (mode == 3) {
                    for (int p = 0; p < packs; ++p) my_buf[tid + 256 * p] = make_uint4(i, i, i, i);
                    __syncthreads();
                    if (tid == 0) red_release_sys(my_flag, 1);
                } else {  // LL
                    for (int p = 0; p < 2 * packs; ++p) {
                        uint4 v = make_uint4(i * 7u, (unsigned)i, i * 7u + 1, (unsigned)i);
                        asm volatile("st.volatile.global.v4.u32 [%0], {%1,%2,%3,%4};" :: "l"(peer_buf + tid + 256 * p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
                    }
                }
            } else {
                if (mode <= 2 || mode == 5) {
                    if (tid == 0) { while (ld_relaxed_sys(my_flag) < (u64)i) {} asm volatile("fence.acq_rel.sys;" ::: "memory"); }
                    __syncthreads();
                    if (mode == 2 || mode == 5) { uint4 s = my_buf[tid]; if (s.x != (unsigned)i) out[3] = 1; }
                } else if (mode == 3) {
                    if (tid == 0) { while (ld_relaxed_sys(peer_flag) < (u64)i) {} asm volatile("fence.acq_rel.sys;" ::: "memory"); }
                    __syncthreads();
                    unsigned acc = 0;
                    for (int p = 0; p < packs; ++p) {
                        unsigned x, y, z, w;
                        asm volatile("ld.volatile.global.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(x), "=r"(y), "=r"(z), "=r"(w) : "l"(peer_buf + tid + 256 * p) : "memory");
                        acc += x;
                    }
                    if (acc != (unsigned)i * packs) out[3] = 1;
                    __syncthreads();
                } else {
                    for (int p = 0; p < 2 * packs; ++p) {
                        uint4 v;
                        do {
                            asm volatile("ld.volatile.global.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(my_buf + tid + 256 * p) : "memory");
                        } while (v.y != (unsigned)i || v.w != (unsigned)i);
                        if (v.x != i * 7u) out[3] = 1;
                    }
                    __syncthreads();
                }
            }
        }
    }
    if (tid == 0) { out[0] = now_ns() - t0; }
    (void)ok;
}

// bandwidth: every block copies its share of n uint4 from src to dst (either may be the peer's)
__global__ void copy(const uint4* __restrict__ src, uint4* __restrict__ dst, size_t n) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x, stride = (size_t)gridDim.x * blockDim.x;
    for (; i + 3 * stride < n; i += 4 * stride) {
        uint4 a = src[i], b = src[i + stride], c = src[i + 2 * stride], d = src[i + 3 * stride];
        dst[i] = a; dst[i + stride] = b; dst[i + 2 * stride] = c; dst[i + 3 * stride] = d;
    }
    for (; i < n; i += stride) dst[i] = src[i];
}

int main() {
    int n; CK(cudaGetDeviceCount(&n));
    if (n < 2) { printf("needs 2 GPUs\n"); return 1; }
    u64 *flag[2], *out[2]; uint4* buf[2]; uint4 *big[2], *big2[2];
    const size_t bytes = 256ull << 20, nv = bytes / 16;
    for (int d = 0; d < 2; ++d) {
        CK(cudaSetDevice(d)); CK(cudaDeviceEnablePeerAccess(1 - d, 0));
        CK(cudaMalloc(&flag[d], 64)); CK(cudaMalloc(&out[d], 64)); CK(cudaMalloc(&buf[d], 1 << 16));
        CK(cudaMalloc(&big[d], bytes)); CK(cudaMalloc(&big2[d], bytes));
        CK(cudaMemset(big[d], 1, bytes)); CK(cudaMemset(big2[d], 0, bytes));
    }
    const char* names[] = {"flag relaxed store", "flag red.release.sys", "push 4KB + release flag", "pull: poll peer flag + load 4KB", "LL 4KB packets", "push 32KB + release flag", "LL 32KB packets"};
    for (int mode = 0; mode < 7; ++mode) {
        const int iters = 2000;
        for (int d = 0; d < 2; ++d) { CK(cudaSetDevice(d)); CK(cudaMemset(flag[d], 0, 64)); CK(cudaMemset(buf[d], 0, 1 << 16)); CK(cudaMemset(out[d], 0, 64)); CK(cudaDeviceSynchronize()); }
        for (int d = 1; d >= 0; --d) { CK(cudaSetDevice(d)); pingpong<<<1, 256>>>(mode, d, iters, flag[d], flag[1 - d], buf[d], buf[1 - d], out[d]); }
        u64 h[2][4];
        for (int d = 0; d < 2; ++d) { CK(cudaSetDevice(d)); CK(cudaDeviceSynchronize()); CK(cudaMemcpy(h[d], out[d], 32, cudaMemcpyDeviceToHost)); }
        printf("hop %-36s %7.3f us  (errors %llu %llu)\n", names[mode], h[0][0] / 1e3 / (2.0 * iters), h[0][3], h[1][3]);
    }
    cudaEvent_t e0[2], e1[2];
    for (int d = 0; d < 2; ++d) { CK(cudaSetDevice(d)); cudaEventCreate(&e0[d]); cudaEventCreate(&e1[d]); }
    // kind 0: push from GPU0 only; 1: pull by GPU0 only; 2: both push at once; 3: both pull at once; 4: local copy GPU0
    const char* kinds[] = {"push 0->1", "pull 1->0 (GPU0 loads)", "push both ways at once", "pull both ways at once", "local copy (read+write counted once)"};
    for (int kind = 0; kind < 5; ++kind) for (int blocks : {66, 132, 264}) {
        float best = 1e9;
        for (int rep = 0; rep < 6; ++rep) {
            for (int d = 0; d < 2; ++d) {
                if ((kind == 0 || kind == 1 || kind == 4) && d == 1) continue;
                CK(cudaSetDevice(d)); cudaEventRecord(e0[d]);
                const uint4* src = kind == 0 || kind == 2 || kind == 4 ? big[d] : big[1 - d];
                uint4* dst = kind == 0 || kind == 2 ? big2[1 - d] : big2[d];
                copy<<<blocks, 512>>>(src, dst, nv);
                cudaEventRecord(e1[d]);
            }
            float ms = 0;
            for (int d = 0; d < 2; ++d) {
                if ((kind == 0 || kind == 1 || kind == 4) && d == 1) continue;
                CK(cudaSetDevice(d)); CK(cudaEventSynchronize(e1[d])); float m; cudaEventElapsedTime(&m, e0[d], e1[d]); ms = m > ms ? m : ms;
            }
            if (rep > 0 && ms < best) best = ms;
        }
        printf("bw %-40s blocks %3d: %6.1f GB/s per direction\n", kinds[kind], blocks, bytes / (best * 1e-3) / 1e9);
    }
    return 0;
}

"""sample's generated tile without a GPU: the kernels compile for sm_90a and sm_80 without spills, and,
where a host C++ compiler exists, the generated tile function itself (with the real
megaloop/sample.cuh) runs on the CPU through g++: a shim gives it the CUDA builtins it uses, one
fiber per CUDA thread (ucontext), barriers for __syncthreads and the warps' shuffles. Its tokens must be
the reference's bit for bit over vocabulary sizes up to Llama 3's, every dtype, strided and
misaligned rows, ties, NaN and infinite rows and every kind of parameter; mutants of the tile (an FMA
in the polynomial, a top-k boundary that drops ties) must not pass."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import megaloop as ml
from megaloop.codegen import generate
from megaloop.codegen.emit import Operand
from megaloop.codegen.emit_sample import CHUNKS, DATA_KIND, tile
from megaloop.frontend.ops._sampling import EXP2_COEFFS, LOG2E
from megaloop.frontend.ops.sample import sample_tokens
from megaloop.frontend.tiling import Box
from megaloop.plan import make_plan
from megaloop.runtime.compile import INCLUDE, compile_cubin, spills

HEADER = INCLUDE / "megaloop" / "sample.cuh"
AT = INCLUDE / "megaloop" / "at.cuh"  # the tiles' operands (ml::At)
BLOCK = INCLUDE / "megaloop" / "block.cuh"  # the block's threads and barrier (no loader warp here)
F32 = np.float32


def test_the_header_uses_the_definitions_constants() -> None:
    text = HEADER.read_text()
    for c in (*EXP2_COEFFS, LOG2E):
        assert f"0x{int(np.float32(c).view(np.uint32)):08x}u" in text, c
    assert "0x9E3779B9u" in text and "0xD2511F53u" in text and "WEIGHT_BITS = 40" in text
    assert f"DATA_KIND = {DATA_KIND};" in text and f"CHUNKS = {CHUNKS};" in text  # emit_sample's mirrors


def sample_graph(cases: list[tuple[tuple[int, ...], str, int | None]]) -> ml.Graph:
    g = ml.Graph("sample-kernels")
    for i, (shape, dtype, splits) in enumerate(cases):
        rows = shape[:-1]
        x = g.input(f"x{i}", shape, dtype)
        params = [g.input(f"{name}{i}", rows, dt) for name, dt in (("s", "int64"), ("o", "int64"), ("t", "float32"))]
        params += [g.input(f"k{i}", rows, "int64")]
        params += [g.input(f"{name}{i}", rows, "float32") for name in "pq"]
        g.output(f"token{i}", ml.sample(x, *params, splits=splits))
    return g


def test_sample_kernels_compile_without_spills() -> None:
    """Llama 3's vocabulary (bfloat16 logits of two sequences) in the generator's 126 ranges (its combine
    holds the whole row's tile too, its fallback) and a float16 0-d row. Their shared memory stays small:
    what a kernel takes of it, every tile loses of L1 (12 KB, with the loop's 3.4 KB of its own, fits the
    H200's 16 KB carve-out)."""
    cases = [((2, 1, 128256), "bfloat16", 126), ((5,), "float16", None)]
    program = generate(make_plan(sample_graph(cases), processors=16))
    src = program.source
    assert '#include "megaloop/sample.cuh"' in src and src.count("ml::smp::sample_tile<") == 1
    assert src.count("ml::smp::sample_partial_tile<") == 1 and src.count("ml::smp::sample_combine_tile<") == 1
    assert program.shared_bytes <= 12 * 1024, program.shared_bytes
    for arch in ("sm_90a", "sm_80"):
        assert compile_cubin(src, arch, use_cache=False)[:4] == b"\x7fELF"
    found = spills(src, "sm_90a")
    assert not found, f"register spills (stores, loads bytes) per function: {found}"


def test_kernels_without_sample_keep_their_text() -> None:
    g = ml.Graph("plain")
    g.output("y", ml.argmax(g.input("x", (2, 100), "float32"), -1))
    assert "sample.cuh" not in generate(make_plan(g, processors=4)).source


# ---- the generated tile on the CPU ------------------------------------------------------------------------

SHIM = r"""
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ucontext.h>
#include <vector>
#define __device__
#define __noinline__
#define __forceinline__ inline
#define __shared__
struct Dim3 { unsigned x = 0, y = 0, z = 0; };
static Dim3 threadIdx, blockDim, blockIdx;
struct float4 { float x, y, z, w; };
float4 ml_smem4[8192];  // the dynamic shared memory (128 KB)
// One block's threads as fibers on this one thread (ucontext): each runs until it reaches a barrier
// (the block's, or its warp's for a shuffle), and a barrier opens once all its threads are there.
struct Fiber { ucontext_t context; std::vector<char> stack; int waiting = 0; bool done = false; };
static std::vector<Fiber> fibers;
static ucontext_t scheduler;
static int current;
static void wait_at(int kind) {  // 1: the block's barrier, 2: the warp's
    fibers[current].waiting = kind;
    swapcontext(&fibers[current].context, &scheduler);
    threadIdx.x = current;
}
inline void __syncthreads() { wait_at(1); }
static unsigned long long exchange[1024];
template <class T> inline T via_lane(T v, int src) {
    const int t = threadIdx.x, w = t >> 5;
    memcpy(&exchange[t], &v, sizeof(T));
    wait_at(2);
    T r;
    memcpy(&r, &exchange[(w << 5) | src], sizeof(T));
    wait_at(2);
    return r;
}
template <class T> inline T __shfl_xor_sync(unsigned, T v, int m) { return via_lane(v, (threadIdx.x & 31) ^ m); }
template <class T> inline T __shfl_up_sync(unsigned, T v, int d) {
    const int l = threadIdx.x & 31;
    return via_lane(v, l >= d ? l - d : l);
}
template <class T> inline T __shfl_sync(unsigned, T v, int src) { return via_lane(v, src); }
inline unsigned __ballot_sync(unsigned, bool p) {
    unsigned bits = 0;
    const int base = threadIdx.x & ~31;
    exchange[threadIdx.x] = p;
    wait_at(2);
    for (int l = 0; l < 32; ++l) bits |= exchange[base + l] ? 1u << l : 0u;
    wait_at(2);
    return bits;
}
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
    return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
inline unsigned long long __float2ull_rz(float f) { return (unsigned long long)f; }
inline long long __float2ll_rn(float f) { return llrintf(f); }
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
    return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}
inline int __clz(unsigned x) { return x ? __builtin_clz(x) : 32; }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int min(int a, int b) { return a < b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
namespace ml {
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;
constexpr int MAX_DIMS = 6;
struct Task { int sig, op; int lo[MAX_DIMS], hi[MAX_DIMS]; };
struct Args { char* arena; i64* info; };
enum Error : u64 { OK = 0, WATCHDOG = 1, DATA = 2 };
inline void fail(const Args& a, u64 code, i64 i0, i64 i1, i64 i2, i64 i3, i64 i4, i64 i5, i64 i6, i64 i7 = 0) {
    const i64 v[9] = {(i64)code, i0, i1, i2, i3, i4, i5, i6, i7};
    if (a.info[0] == 0) memcpy(a.info, v, sizeof v);
}
struct bf16 { u16 bits; };
struct f16 { u16 bits; };
inline float to_float(bf16 x) { const u32 w = (u32)x.bits << 16; float f; memcpy(&f, &w, 4); return f; }
inline float to_float(f16 x) { _Float16 h; memcpy(&h, &x.bits, 2); return (float)h; }
inline float load(const float* p) { return *p; }
inline float load(const bf16* p) { return to_float(*p); }
inline float load(const f16* p) { return to_float(*p); }
inline void store(i64* p, i64 v) { *p = v; }
inline void store(float* p, float v) { *p = v; }
inline i64 load(const int* p) { return *p; }
inline i64 load(const i64* p) { return *p; }
inline bool load(const bool* p) { return *p; }
template <class T, int N> struct alignas(sizeof(T) * N) Pack { T v[N]; };
template <class T, int N> inline Pack<T, N> load_pack(const T* p) { Pack<T, N> r; memcpy(&r, p, sizeof r); return r; }
template <class T, int N> inline float get(const Pack<T, N>& p, int i) { return load(&p.v[i]); }
inline bool aligned(const void* p, int bytes) { return ((uintptr_t)p & (uintptr_t)(bytes - 1)) == 0; }
template <int N> inline int box_count(const Task& t) {
    int total = 1;
    for (int d = 0; d < N; ++d) total *= t.hi[d] - t.lo[d];
    return total;
}
template <int N> inline void box_index(const Task& t, int e, int* i) {
    for (int d = N - 1; d >= 0; --d) {
        const int ext = t.hi[d] - t.lo[d];
        i[d] = t.lo[d] + e % ext;
        e /= ext;
    }
}
}  // namespace ml
#include "BLOCK_HEADER"
#include "AT_HEADER"
#include "HEADER"
void tile(const ml::Args& a, const ml::Task& t, int tid, const ml::i64* off) {
BODY
}
void tile(const ml::Args& a, const ml::Task& t, int tid, const ml::i64* off);
static const ml::Args* run_args;
static const ml::Task* run_task;
static const long long* run_offsets;
static int run_id;
static void fiber_main(int i) {
    threadIdx.x = i;
    tile(*run_args, *run_task, run_id, run_offsets);
    fibers[i].done = true;
}
static void run_block(int threads) {
    fibers.assign(threads, Fiber{});
    for (int i = 0; i < threads; ++i) {
        Fiber& f = fibers[i];
        f.stack.resize(256 * 1024);
        getcontext(&f.context);
        f.context.uc_stack.ss_sp = f.stack.data();
        f.context.uc_stack.ss_size = f.stack.size();
        f.context.uc_link = &scheduler;
        makecontext(&f.context, (void (*)())fiber_main, 1, i);
    }
    for (;;) {
        int live = 0, ran = 0;
        for (int i = 0; i < threads; ++i) {
            if (fibers[i].done) continue;
            ++live;
            if (fibers[i].waiting) continue;
            current = i;
            threadIdx.x = i;
            swapcontext(&scheduler, &fibers[i].context);
            ++ran;
        }
        if (!live) return;
        int at_block = 0, opened = 0;
        for (int i = 0; i < threads; ++i) at_block += !fibers[i].done && fibers[i].waiting == 1;
        if (at_block && at_block == live) {
            for (auto& f : fibers) f.waiting = 0;
            ++opened;
        }
        for (int w = 0; w < threads / 32; ++w) {
            int at = 0, alive = 0;
            for (int l = 0; l < 32; ++l) {
                const Fiber& f = fibers[w * 32 + l];
                alive += !f.done;
                at += !f.done && f.waiting == 2;
            }
            if (at && at == alive) {
                for (int l = 0; l < 32; ++l) fibers[w * 32 + l].waiting = 0;
                ++opened;
            }
        }
        if (!ran && !opened) {
            fprintf(stderr, "the block's threads wait for each other: a barrier some never reach\n");
            abort();
        }
    }
}
// every task, each by one block of `threads` threads
extern "C" void run(char* arena, const int* lo, const int* hi, int tasks, const long long* off, int threads,
                    long long* info) {
    const ml::Args a{arena, info};
    blockDim.x = threads;
    for (int k = 0; k < tasks; ++k) {
        ml::Task t{};
        memcpy(t.lo, lo + k * ml::MAX_DIMS, sizeof t.lo);
        memcpy(t.hi, hi + k * ml::MAX_DIMS, sizeof t.hi);
        run_args = &a;
        run_task = &t;
        run_offsets = off;
        run_id = k;
        run_block(threads);
    }
}
"""

needs_cxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs a host C++ compiler (g++)")


def build_tile(body: list[str], tmp_path: Path, header: str | None = None, extra: str = "") -> ctypes.CDLL:
    """The tile function ``body`` with sample.cuh (or the text ``header``), and ``extra`` C++ after it,
    compiled into a library."""
    path = HEADER
    if header is not None:
        path = tmp_path / "sample_mutant.cuh"
        path.write_text(header)
    k = len(list(tmp_path.glob("*.so")))
    src = tmp_path / f"tile{k}.cpp"
    shim = SHIM.replace("BLOCK_HEADER", str(BLOCK)).replace("AT_HEADER", str(AT)).replace("HEADER", str(path))
    src.write_text(shim.replace("BODY", "\n".join("    " + line for line in body)) + extra)
    lib = tmp_path / f"tile{k}.so"
    subprocess.run(
        ["g++", "-std=c++17", "-O1", "-ffp-contract=off", "-shared", "-fPIC", "-o", str(lib), str(src)],
        check=True,
        capture_output=True,
    )
    return ctypes.CDLL(str(lib))


def operand(dtype: str, shape: tuple[int, ...], strides: tuple[int, ...] | None = None) -> Operand:
    if strides is None:
        strides = tuple(int(np.prod(shape[d + 1 :])) for d in range(len(shape)))
    return Operand(ml.as_dtype(dtype), shape, strides)


def run_generated(
    lib: ctypes.CDLL,
    arrays: list[np.ndarray],
    strides: list[tuple[int, ...]],
    out_shape: tuple[int, ...],
    boxes: list[Box],
    threads: int,
    misalign: int = 0,
    out_dtype: type = np.int64,
) -> tuple[np.ndarray, np.ndarray]:
    """Run the tile on ``boxes``: input k holds ``arrays[k]`` laid out with ``strides[k]`` (the first
    ``misalign`` elements off a 16-byte boundary), the output (``out_dtype``) is contiguous ``out_shape``.
    The output and the error info."""
    size = np.dtype(out_dtype).itemsize
    spans = [1 + sum((d - 1) * st for d, st in zip(a.shape, sd)) for a, sd in zip(arrays, strides)]
    places = [(span, a.dtype.itemsize, misalign if k == 0 else 0) for k, (a, span) in enumerate(zip(arrays, spans))]
    places.append((max(1, int(np.prod(out_shape))), size, 0))
    offsets, at = [], 64
    for count, size, mis in places:
        offsets.append(at + mis * size)
        at += -(-(count + mis) * size // 64) * 64 + 64
    arena = np.full(at + 64, 0xA5, np.uint8)
    for a, sd, span, offset in zip(arrays, strides, spans, offsets):
        index = np.zeros(a.shape, np.int64)
        for d, (n, st) in enumerate(zip(a.shape, sd)):
            index = index + np.arange(n).reshape([n if k == d else 1 for k in range(a.ndim)]) * st
        arena[offset : offset + span * a.dtype.itemsize].view(a.dtype)[index] = a
    lo = np.zeros((len(boxes), 6), np.int32)
    hi = np.ones((len(boxes), 6), np.int32)
    for k, box in enumerate(boxes):
        lo[k, : len(box.lo)], hi[k, : len(box.hi)] = box.lo, box.hi
    info = np.zeros(9, np.int64)
    off = np.array(offsets, np.int64)
    ptr = ctypes.c_void_p
    lib.run.argtypes = [ptr, ptr, ptr, ctypes.c_int, ptr, ctypes.c_int, ptr]
    lib.run(arena.ctypes.data, lo.ctypes.data, hi.ctypes.data, len(boxes), off.ctypes.data, threads, info.ctypes.data)
    count = max(1, int(np.prod(out_shape)))
    return arena[offsets[-1] : offsets[-1] + size * count].view(out_dtype).reshape(out_shape).copy(), info


def contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(np.prod(shape[d + 1 :])) for d in range(len(shape)))


def run_tile(
    lib: ctypes.CDLL,
    logits: np.ndarray,
    params: list[np.ndarray],
    boxes: list[Box],
    threads: int,
    x_strides: tuple[int, ...] | None = None,
    misalign: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """sample's tile: the tokens for ``logits`` [rows..., n] (laid out with ``x_strides``, ``misalign``
    elements off a 16-byte boundary) and per-row parameters of the rows' shape; the error info."""
    arrays = [logits, *params]
    strides = [x_strides or contiguous(logits.shape)] + [contiguous(p.shape) for p in params]
    return run_generated(lib, arrays, strides, logits.shape[:-1], boxes, threads, misalign)


def row_boxes(rows: tuple[int, ...], per: int = 1) -> list[Box]:
    """A box of ``per`` rows along the first axis each (0-d rows: one box)."""
    if not rows:
        return [Box((), ())]
    return [Box((r,) + (0,) * (len(rows) - 1), (min(rows[0], r + per),) + rows[1:]) for r in range(0, rows[0], per)]


def draw_case(rng: np.random.Generator, rows: tuple[int, ...], n: int, dtype: str) -> tuple[np.ndarray, list]:
    kind = rng.integers(0, 4)
    shape = (*rows, n)
    if kind == 0:
        x = rng.integers(-4, 4, shape).astype(np.float64)  # ties everywhere
    elif kind == 1:
        x = rng.standard_normal(shape) * rng.choice([0.05, 2.0, 20.0])
    elif kind == 2:
        x = rng.standard_normal(shape) * 3 + rng.choice([0.0, 1e4, -1e4])  # far from zero: few bits of difference
    else:
        x = np.log(rng.dirichlet(np.full(n, 0.2), size=rows or None) + 1e-30)
    x = ml.dtypes.round_to(x, ml.as_dtype(dtype))
    params = [
        rng.integers(-(2**63), 2**63 - 1, rows, dtype=np.int64),
        rng.integers(0, 2**40, rows, dtype=np.int64),
        rng.choice(np.array([0.0, 1e-40, 0.01, 0.3, 1.0, 2.0, 50.0], F32), rows),
        rng.choice(np.array([0, 1, 2, 5, 40, max(1, n - 1), n, n + 5]), rows).astype(np.int64),
        rng.choice(np.array([1.0, 0.999, 0.9, 0.5, 0.1, 1e-9], F32), rows),
        rng.choice(np.array([0.0, 0.0, 1e-6, 0.02, 0.3, 1.0], F32), rows),
    ]
    return x, params


def tile_body(x: Operand, rows: tuple[int, ...]) -> list[str]:
    ops = [x] + [operand(dt, rows) for _, dt in (("s", "int64"), ("o", "int64"), ("t", "float32"))]
    ops += [operand("int64", rows), operand("float32", rows), operand("float32", rows)]
    return tile("sample", {}, ops, operand("int64", rows))


CPU_CASES = [
    # (rows, n, dtype, threads, cases)
    ((6,), 1, "float32", 64, 4),
    ((5,), 7, "bfloat16", 64, 10),
    ((4,), 300, "float16", 64, 10),
    ((2, 3), 1000, "float32", 96, 8),  # 3 warps: thread ranges that do not divide the buckets
    ((3,), 5000, "bfloat16", 256, 6),  # several chunks
    ((), 333, "float32", 32, 8),  # 0-d rows, one warp
]


@needs_cxx
@pytest.mark.parametrize("case", range(len(CPU_CASES)))
def test_generated_tile_gives_the_references_tokens_on_the_cpu(case: int, tmp_path: Path) -> None:
    rows, n, dtype, threads, draws = CPU_CASES[case]
    lib = build_tile(tile_body(operand(dtype, (*rows, n)), rows), tmp_path)
    rng = np.random.default_rng(case)
    for draw in range(draws):
        x, params = draw_case(rng, rows, n, dtype)
        if draw == 0 and rows:  # a NaN row, an infinite row, an all -inf row
            flat = x.reshape(-1, n)
            flat[0, n // 2] = np.nan
            if flat.shape[0] > 2:
                flat[1, n - 1], flat[2] = np.inf, -np.inf
        got, info = run_tile(lib, x, params, row_boxes(rows, 2), threads)
        assert info[0] == 0, info
        want = sample_tokens(x, *params)
        assert np.array_equal(got, want), f"draw {draw}: tile {got.tolist()} != reference {want.tolist()}"


@needs_cxx
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_generated_tile_on_llama3s_vocabulary(dtype: str, tmp_path: Path) -> None:
    """128256 logits a row (1002 chunks of 128), rows drawn as a language model's: a few likely tokens
    and a long tail; greedy, temperature alone, top-k, top-p, both, and min-p."""
    n, rows = 128256, (6,)
    lib = build_tile(tile_body(operand(dtype, (*rows, n)), rows), tmp_path)
    rng = np.random.default_rng(7)
    x = ml.dtypes.round_to(
        rng.standard_normal((*rows, n)) * 2.5 + (rng.random((*rows, n)) < 1e-3) * 8, ml.as_dtype(dtype)
    )
    params = [
        np.array([1, 2, 3, 4, 5, 6], np.int64),
        np.array([100, 101, 102, 103, 104, 105], np.int64),
        np.array([0.0, 1.0, 0.7, 0.7, 1.3, 1.3], F32),
        np.array([0, 0, 50, 0, 40, 0], np.int64),
        np.array([1.0, 1.0, 1.0, 0.9, 0.95, 1.0], F32),
        np.array([0.0, 0.0, 0.0, 0.0, 0.01, 0.05], F32),
    ]
    got, info = run_tile(lib, x, params, row_boxes(rows), threads=256)
    assert info[0] == 0 and np.array_equal(got, sample_tokens(x, *params)), (got, sample_tokens(x, *params))


@needs_cxx
@pytest.mark.parametrize("layout", ["strided", "misaligned"])
def test_generated_tile_reads_strided_and_misaligned_rows(layout: str, tmp_path: Path) -> None:
    """Rows that are no contiguous aligned run (the per-element path) give the same tokens."""
    rows, n, dtype = (4,), 517, "bfloat16"
    strides, misalign = ((1, 4), 0) if layout == "strided" else ((n, 1), 1)  # column-major, or one element off
    lib = build_tile(tile_body(operand(dtype, (*rows, n), strides), rows), tmp_path)
    rng = np.random.default_rng(3)
    for _ in range(4):
        x, params = draw_case(rng, rows, n, dtype)
        got, info = run_tile(lib, x, params, row_boxes(rows, 4), 64, strides, misalign)
        assert info[0] == 0 and np.array_equal(got, sample_tokens(x, *params))


@needs_cxx
def test_generated_tile_reports_bad_parameters(tmp_path: Path) -> None:
    rows, n = (3,), 50
    lib = build_tile(tile_body(operand("float32", (*rows, n)), rows), tmp_path)
    x = np.zeros((*rows, n), F32)
    good = [np.zeros(3, np.int64), np.zeros(3, np.int64), np.ones(3, F32), np.zeros(3, np.int64), np.ones(3, F32)]
    good.append(np.zeros(3, F32))
    bads = ((2, -1.0), (2, np.inf), (2, np.nan), (3, -2), (4, 0.0), (4, 1.5), (4, np.nan))
    bads += ((5, -0.1), (5, 1.5), (5, np.nan))
    for k, bad in bads:
        params = [p.copy() for p in good]
        params[k][2] = bad
        _, info = run_tile(lib, x, params, row_boxes(rows, 3), 32)
        assert info[0] == 2 and info[4] == 2 and info[6] == DATA_KIND, (k, bad, info)  # DATA, row 2, kind


ARITHMETIC = r"""
extern "C" void weights(const float* x, int n, float m, float c, unsigned long long* out) {
    for (int i = 0; i < n; ++i) out[i] = ml::smp::weight_of(x[i], m, c);
}
extern "C" void keys(const float* x, int n, unsigned* out) {
    for (int i = 0; i < n; ++i) out[i] = ml::smp::key_of(x[i]);
}
extern "C" void draws(const long long* seed, const long long* offset, int n, unsigned long long* out) {
    for (int i = 0; i < n; ++i) out[i] = ml::smp::uniform64((unsigned long long)seed[i], (unsigned long long)offset[i]);
}
"""


def arithmetic(tmp_path: Path, header: str | None = None) -> ctypes.CDLL:
    lib = build_tile([], tmp_path, header, extra=ARITHMETIC)
    ptr = ctypes.c_void_p
    lib.weights.argtypes = [ptr, ctypes.c_int, ctypes.c_float, ctypes.c_float, ptr]
    lib.keys.argtypes = [ptr, ctypes.c_int, ptr]
    lib.draws.argtypes = [ptr, ptr, ctypes.c_int, ptr]
    return lib


def header_weights(lib: ctypes.CDLL, x: np.ndarray, m: float, c: float) -> np.ndarray:
    x = np.ascontiguousarray(x, F32)
    out = np.zeros(x.size, np.uint64)
    lib.weights(x.ctypes.data, x.size, m, c, out.ctypes.data)
    return out


def weight_inputs(rng: np.random.Generator) -> list[tuple[np.ndarray, float, float]]:
    """(logits, their max, log2(e) / T): for each temperature, logits spread over e in [-45, 0] (the
    cutoff included) below a largest one near 0, near 1e4 or near -1e4, and the specials."""
    cases = []
    for t in (1e-30, 1e-3, 0.3, 1.0, 7.0, 1e30, 3e38):
        for top in (0.0, 1e4, -1e4):
            span = min(45 * t * np.log(2), 1e38)
            x = np.concatenate([top - rng.random(30000) * span, [top, -np.inf]])
            x = np.clip(x, -3e38, 3e38).astype(F32)
            cases.append((x, float(x.max()), float(LOG2E / F32(t))))
    return cases


@needs_cxx
def test_the_headers_arithmetic_is_the_definitions_bit_for_bit(tmp_path: Path) -> None:
    """sample.cuh's weight_of, key_of and uniform64, compiled for the host, against _sampling over
    every range of exponents (the cutoff, subnormal scales), keys of every kind of float, 10^4 draws."""
    from megaloop.frontend.ops import _sampling

    lib = arithmetic(tmp_path)
    rng = np.random.default_rng(1)
    for x, m, c in weight_inputs(rng):
        want = _sampling.weights(x[None], np.array([m], F32), np.array([c], F32))[0]
        assert np.array_equal(header_weights(lib, x, m, c), want), (m, c)
    bits = rng.integers(0, 2**32, 100000, dtype=np.uint64).astype(np.uint32)
    v = bits.view(F32)
    v = v[~np.isnan(v)].copy()
    got = np.zeros(v.size, np.uint32)
    lib.keys(v.ctypes.data, v.size, got.ctypes.data)
    assert np.array_equal(got, _sampling.order_keys(v))
    seed = rng.integers(-(2**63), 2**63 - 1, 10000, dtype=np.int64)
    offset = rng.integers(-(2**63), 2**63 - 1, 10000, dtype=np.int64)
    draws = np.zeros(10000, np.uint64)
    lib.draws(seed.ctypes.data, offset.ctypes.data, 10000, draws.ctypes.data)
    assert np.array_equal(draws, _sampling.uniform64(seed, offset))


@needs_cxx
def test_an_fma_in_the_polynomial_changes_the_weights(tmp_path: Path) -> None:
    """The check above would catch contracted multiply-adds (what ptxas does to a * b + c unless the
    code says __fmul_rn / __fadd_rn): the mutant's weights differ."""
    text = HEADER.read_text()
    mutant = re.sub(r"p = __fadd_rn\(__fmul_rn\(p, f\), ([^;]*)\);", r"p = fmaf(p, f, \1);", text)
    assert mutant != text
    lib = arithmetic(tmp_path, mutant)
    x, m, c = weight_inputs(np.random.default_rng(2))[9]  # T = 1, the largest logit near 0
    from megaloop.frontend.ops import _sampling

    want = _sampling.weights(x[None], np.array([m], F32), np.array([c], F32))[0]
    got = header_weights(lib, x, m, c)
    assert (got != want)[want > 0].mean() > 0.05, (got != want)[want > 0].mean()


@needs_cxx
def test_a_tile_whose_kept_set_drops_the_boundary_ties_does_not_pass(tmp_path: Path) -> None:
    """The chunk sums with a top-k/top-p boundary that leaves out its tie group: other tokens."""
    text = HEADER.read_text()
    mutant = text.replace("if (keymax - key_of(v) <= limit) {", "if (keymax - key_of(v) < limit) {")
    assert mutant != text
    rows, n = (16,), 400
    lib = build_tile(tile_body(operand("float32", (*rows, n)), rows), tmp_path, header=mutant)
    rng = np.random.default_rng(5)
    x = ml.dtypes.round_to(rng.integers(-6, 6, (*rows, n)).astype(np.float64) * 0.25, ml.float32)  # ties
    params = [
        rng.integers(0, 2**62, rows, dtype=np.int64),
        np.arange(16, dtype=np.int64),
        np.full(rows, 0.9, F32),
        np.full(rows, 60, np.int64),
        np.full(rows, 0.8, F32),
        np.zeros(rows, F32),
    ]
    got, _ = run_tile(lib, x, params, row_boxes(rows, 4), 64)
    assert not np.array_equal(got, sample_tokens(x, *params)), "the mutant gave the reference's tokens"


# ---- the split form's tiles (sample_partial, sample_combine) on the CPU ---------------------------------------

SPLIT_CASES = [  # (rows, n, splits, dtype, threads)
    ((3,), 100, 7, "float32", 64),  # ranges of 16: every element a candidate
    ((4,), 1000, 8, "bfloat16", 64),  # ranges of 128, 32 candidates each
    ((2, 2), 5000, 40, "float16", 96),
    ((2,), 128256, 126, "bfloat16", 64),  # Llama 3's vocabulary as the generator splits it
]


def split_inputs(x: np.ndarray, params: list[np.ndarray], splits: int) -> tuple[dict, np.ndarray, np.ndarray]:
    """(the split ops' attributes, argmax_partial's indices, sample_partial's summary) by the references."""
    from megaloop.frontend.ops.argmax_split import ARGMAX_PARTIAL, split_ranges
    from megaloop.frontend.ops.sample_split import SAMPLE_PARTIAL, candidates_for

    ranges, chunk = split_ranges(x.shape[-1], splits)
    attrs = {"splits": ranges, "chunk": chunk, "candidates": candidates_for(ranges)}
    partial = ARGMAX_PARTIAL.reference([x], {"axis": x.ndim - 1, "chunk": chunk})
    return attrs, partial, SAMPLE_PARTIAL.reference([x, partial, params[2]], attrs)


def split_draw(rng: np.random.Generator, rows: tuple[int, ...], n: int, dtype: str, kind: int) -> tuple:
    """Logits a language model might give (kind 0: a few likely tokens and a long tail), a flat row (1:
    thresholds the candidates cannot settle), ties (2), and parameters of every kind."""
    x, params = draw_case(rng, rows, n, dtype)
    if kind == 0:
        x = rng.standard_normal((*rows, n)) * 2 + (rng.random((*rows, n)) < 0.002) * 9
    elif kind == 1:
        x = rng.standard_normal((*rows, n)) * 0.01
    else:
        x = rng.integers(-3, 3, (*rows, n)).astype(np.float64)
    params[2] = rng.choice(np.array([0.0, 0.7, 1.0, 1.5], F32), rows)
    params[3] = rng.choice(np.array([0, 0, 20, 50, n + 1]), rows).astype(np.int64)
    params[4] = rng.choice(np.array([1.0, 0.95, 0.9, 0.6], F32), rows)
    params[5] = rng.choice(np.array([0.0, 0.0, 0.01, 0.2], F32), rows)
    return ml.dtypes.round_to(x, ml.as_dtype(dtype)), params


@needs_cxx
@pytest.mark.parametrize("case", range(len(SPLIT_CASES)))
def test_generated_split_tiles_give_the_references_summaries_and_tokens(case: int, tmp_path: Path) -> None:
    """sample_partial's tile writes the reference's summary bit for bit; sample_combine's, from it, the
    definition's tokens, where the candidates settle the thresholds and where it computes the row whole."""
    from megaloop.frontend.ops import sample_split

    rows, n, splits, dtype, threads = SPLIT_CASES[case]
    rng = np.random.default_rng(40 + case)
    x0, params0 = split_draw(rng, rows, n, dtype, 0)
    attrs, partial, summary = split_inputs(x0, params0, splits)
    ranges, width = attrs["splits"], summary.shape[-1]
    xo, po, to = operand(dtype, (*rows, n)), operand("int64", (*rows, ranges)), operand("float32", rows)
    so = operand("int64", (*rows, ranges, width))
    part_lib = build_tile(tile("sample_partial", attrs, [xo, po, to], so), tmp_path)
    params_dtypes = ("int64", "int64", "float32", "int64", "float32", "float32")
    combine_ops = [xo, po, so] + [operand(dt, rows) for dt in params_dtypes]
    combine_lib = build_tile(tile("sample_combine", attrs, combine_ops, operand("int64", rows)), tmp_path)
    flat_rows = int(np.prod(rows))
    boxes = [
        Box(
            (*np.unravel_index(r, rows), q, 0), (*(i + 1 for i in np.unravel_index(r, rows)), min(ranges, q + 5), width)
        )
        for r in range(flat_rows)
        for q in range(0, ranges, 5)
    ]
    settled = [0, 0]
    real = sample_split.combine_row
    for kind in range(3):
        x, params = (x0, params0) if kind == 0 else split_draw(rng, rows, n, dtype, kind)
        attrs, partial, summary = split_inputs(x, params, splits)
        strides = [contiguous(a.shape) for a in (x, partial, params[2])]
        got, info = run_generated(part_lib, [x, partial, params[2]], strides, summary.shape, boxes, threads)
        assert info[0] == 0 and np.array_equal(got, summary), (
            f"kind {kind}: summaries differ at {np.argwhere(got != summary)[:4]}"
        )
        arrays = [x, partial, summary, *params]
        tokens, info = run_generated(
            combine_lib, arrays, [contiguous(a.shape) for a in arrays], rows, row_boxes(rows), threads
        )
        assert info[0] == 0
        assert np.array_equal(tokens, sample_tokens(x, *params)), (kind, tokens, sample_tokens(x, *params))
        flat = [p.reshape(-1) for p in params]
        for r in range(flat_rows):  # which path the reference's combine took
            xr = x.reshape(-1, n)[r].astype(F32)
            m = float(xr[np.argmax(xr)])
            if flat[2][r] > 0 and np.isfinite(m):
                got_r = real(xr, m, summary.reshape(flat_rows, ranges, width)[r], attrs["chunk"], *(f[r] for f in flat))
                settled[got_r is None] += 1
    if n > 1000:
        assert settled[0] and settled[1], f"settled by the candidates / computed whole: {settled}"

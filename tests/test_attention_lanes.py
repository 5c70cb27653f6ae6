"""The decode attention tile of lanes over keys (KernelOptions.decode_attention = 1, megaloop/attention_lanes.cuh)
without a GPU. (1) The generated tile functions of attention_partial (plain and append form) and of
attention run on the CPU through g++ (a shim for the CUDA headers: every thread of a block a coroutine,
a warp's shuffles and the block's barriers meeting points, cp.async a copy that must be 16-byte
aligned) against a float64 numpy reference: GQA groups of 4, 6 and 1, head_dim 64 and 128, key ranges
that are not multiples of 32, several stages a range, lengths that are not multiples of the range, a
sliding window, softcap, a bool mask, bfloat16, float16 and float32; the worst error printed in ulps;
keys not 16-byte aligned take the other paths. (2) The option is in the plan and off by default; the emitter
sizes the tile; paths it does not take fall back. (3) Llama-3.2-1B's decode step compiles for sm_90a
and sm_80 without spills. The loop kernel on a GPU: tests/test_gpu_lanes.py."""

from __future__ import annotations

import ctypes
import dataclasses
import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import megaloop as ml
from megaloop.cli import PRESETS
from megaloop.codegen import generate
from megaloop.codegen.emit import Operand
from megaloop.codegen.emit_attention import (
    Lanes,
    attention,
    attention_partial,
    attention_shared_bytes,
    decode_lanes,
    lanes_shared_bytes,
)
from megaloop.frontend.ops.attention_split import _appended, split_bounds
from megaloop.frontend.tiling import TileContext
from megaloop.models import build_llama_generator
from megaloop.plan import KernelOptions, Plan, make_plan
from megaloop.runtime.compile import INCLUDE
from tests.test_rope_kv_codegen import SHIM

LANES = KernelOptions(decode_attention=1)

# The threads of a block as coroutines of one thread (ucontext), run in rounds: each runs to its next
# meeting point (a warp's exchange, __syncwarp, the block's barrier) and resumes once every thread it
# meets there has come; shuffles are the GPU's butterflies, so sums and maxima are the GPU's bit for bit.
BLOCK = r"""
#include <functional>
#include <ucontext.h>
#include <vector>
#include <cstdio>
#include <cstdlib>
struct alignas(16) float4 { float x, y, z, w; };
namespace ml {
inline float neg_inf() { return -INFINITY; }
struct Fiber { ucontext_t ctx; int state; long meets, bars; };  // state: 0 runs, 1 warp meet, 2 barrier, 3 done
static std::vector<Fiber> fibers;
static ucontext_t scheduler;
static float exchange[1024];
static std::function<void()>* block_body;
inline void meet(int kind) {
    Fiber& f = fibers[threadIdx.x];
    f.state = kind;
    (kind == 1 ? f.meets : f.bars) += 1;
    swapcontext(&f.ctx, &scheduler);
}
inline void __syncwarp() { meet(1); }
inline void block_sync() { meet(2); }
inline unsigned block_threads() { return blockDim.x; }
inline float __shfl_xor_sync(unsigned, float v, int o) {
    const unsigned me = threadIdx.x;
    exchange[me] = v;
    meet(1);
    const float w = exchange[me ^ o];
    meet(1);
    return w;
}
inline float __shfl_xor_sync(unsigned m, float v, int o, int) { return __shfl_xor_sync(m, v, o); }
inline float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
template <int W> inline float lanes_sum(float v) {
    for (int o = W / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
inline float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) {
        const float w = __shfl_xor_sync(0xffffffffu, v, o);
        v = (w > v || w != w) ? w : v;
    }
    return v;
}
template <int N, class F> inline void for_box_warps(const Task& t, F f) {  // (the fallback paths' rows)
    int ext[N + 1];
    i64 total = 1;
    for (int d = 0; d < N; ++d) { ext[d] = t.hi[d] - t.lo[d]; total *= ext[d]; }
    for (i64 e = threadIdx.x >> 5; e < total; e += blockDim.x >> 5) {
        int i[N + 1];
        i64 r = e;
        for (int d = N - 1; d >= 0; --d) { i[d] = t.lo[d] + (int)(r % ext[d]); r /= ext[d]; }
        f(i, (int)(threadIdx.x & 31));
    }
}
inline bool load(const bool* p) { return *p; }
// (what the other paths of attention.cuh name; the tiles here never call them)
inline float __uint_as_float(u32 x) { float f; memcpy(&f, &x, 4); return f; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned long long atomicCAS(unsigned long long* p, unsigned long long c, unsigned long long v) {
    const unsigned long long old = *p;
    if (old == c) *p = v;
    return old;
}
inline void __threadfence() {}
template <class T, int N> inline float dot(const Pack<T, N>& a, const Pack<T, N>& b) {
    float s = 0.0f;
    for (int i = 0; i < N; ++i) s += get(a, i) * get(b, i);
    return s;
}
static int misaligned_copies = 0;  // (a GPU faults on them)
inline void cp_async16(void* dst, const void* src, bool valid) {
    misaligned_copies += ((uintptr_t)dst | (valid ? (uintptr_t)src : 0)) & 15 ? 1 : 0;
    if (valid) memcpy(dst, src, 16); else memset(dst, 0, 16);
}
inline void cp_async_commit() {}
template <int N> inline void cp_async_wait() {}
static void fiber_entry() { (*block_body)(); fibers[threadIdx.x].state = 3; }
static bool ready(int t) {  // every thread this one meets has come to the meeting
    const Fiber& f = fibers[t];
    if (f.state == 0) return true;
    const int lo = f.state == 1 ? t & ~31 : 0, hi = f.state == 1 ? lo + 32 : (int)fibers.size();
    for (int u = lo; u < hi; ++u) {
        const Fiber& g = fibers[u];
        if (f.state == 1 ? g.meets < f.meets : g.bars < f.bars) return false;
    }
    return true;
}
inline void run_block(int threads, std::function<void()> body) {
    constexpr size_t STACK = 1 << 17;
    static std::vector<char> stacks;
    stacks.resize(threads * STACK);
    fibers.assign(threads, Fiber{});
    block_body = &body;
    for (int t = 0; t < threads; ++t) {
        getcontext(&fibers[t].ctx);
        fibers[t].ctx.uc_stack.ss_sp = stacks.data() + t * STACK;
        fibers[t].ctx.uc_stack.ss_size = STACK;
        fibers[t].ctx.uc_link = &scheduler;
        makecontext(&fibers[t].ctx, fiber_entry, 0);
    }
    for (;;) {
        bool left = false, moved = false;
        for (int t = 0; t < threads; ++t) {
            if (fibers[t].state == 3) continue;
            left = true;
            if (!ready(t)) continue;
            fibers[t].state = 0;
            threadIdx.x = t;
            swapcontext(&scheduler, &fibers[t].ctx);
            moved = true;
        }
        if (!left) return;
        if (!moved) { fprintf(stderr, "the block's threads wait for each other: a divergent meeting\n"); abort(); }
    }
}
}  // namespace ml
"""

TILE = r"""
#include "megaloop/HEADER"
namespace ml {
float4 ml_smem4[1 << 14];  // the dynamic shared memory (poisoned by the caller)
}
void tile(const ml::Args& a, const ml::Task& t, int tid, const ml::i64* off) {
BODY
}
extern "C" int misaligned() { return ml::misaligned_copies; }
extern "C" long long* shared() { return reinterpret_cast<long long*>(ml::ml_smem4); }
extern "C" void run(char* arena, const int* lo, const int* hi, int tasks, const long long* off, int threads,
                    long long* info) {
    const ml::Args a{arena, info};
    blockDim.x = threads;
    for (int k = 0; k < tasks; ++k) {
        ml::Task t{};
        memcpy(t.lo, lo + k * ml::MAX_DIMS, sizeof t.lo);
        memcpy(t.hi, hi + k * ml::MAX_DIMS, sizeof t.hi);
        blockIdx.x = k;
        ml::run_block(threads, [&] { tile(a, t, k, off); });
    }
}
"""

# headers the shim stands in for (their device-only parts): the loop's, the packs', the types', and the
# tensor-core fragments' (declared only: the tiles here never take that path)
STUBS = {
    "vec.cuh": "#pragma once\n",
    "types.cuh": "#pragma once\n",
    "mma.cuh": """#pragma once
namespace ml {
void ldmatrix_x4(u32 (&r)[4], u32 at);
void ldmatrix_x4_trans(u32 (&r)[4], u32 at);
template <class T> void mma_16816(float (&c)[4], const u32 (&a)[4], const u32* b, T);
u32 shared_address(const void* p);
}
""",
}

needs_cxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs a host C++ compiler (g++)")
WARPS = 8  # the plan's default block
POISON = 0x5A5A5A5A5A5A5A5A


def _compile(body: list[str], tmp_path: Path, header: str = "attention.cuh") -> ctypes.CDLL:
    stub = tmp_path / "stub" / "megaloop"
    stub.mkdir(parents=True, exist_ok=True)
    shim = SHIM.replace("inline unsigned block_threads() { return blockDim.x; }", "")
    (stub / "loop.cuh").write_text(shim + BLOCK)
    for name, text in STUBS.items():
        (stub / name).write_text(text)
    src = tmp_path / "tile.cpp"
    src.write_text(TILE.replace("HEADER", header).replace("BODY", "\n".join("    " + line for line in body)))
    lib = tmp_path / "tile.so"
    subprocess.run(
        ["g++", "-std=c++17", "-O1", "-ffp-contract=off", "-D__shared__=", "-D__host__=", "-shared", "-fPIC",
         "-I", str(stub.parent), "-I", str(INCLUDE), "-o", str(lib), str(src)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    return ctypes.CDLL(str(lib))


def run_tiles(body: list[str], shared: int, tmp_path: Path, arrays: list[np.ndarray], boxes: list,
              misalign: int = 0, header: str = "attention.cuh") -> tuple:  # fmt: skip
    """Every box run as one block of WARPS warps by the tile function ``body`` (of an op of megaloop/
    ``header``) over ``arrays`` (its operands, then its output, each 64-byte aligned in one arena; k
    and v ``misalign`` bytes past). Returns the output, the error info, and whether the shared memory
    past ``shared`` bytes kept its poison."""
    lib = _compile(body, tmp_path, header)
    offsets, at = [], 0
    for n, a in enumerate(arrays):
        offsets.append(at + (misalign if n in (1, 2) else 0))
        at += -(-(a.nbytes + misalign) // 64) * 64
    arena = np.zeros(at, np.uint8)
    for a, o in zip(arrays, offsets):
        arena[o : o + a.nbytes] = np.ascontiguousarray(a).view(np.uint8).ravel()
    lo, hi = np.zeros((len(boxes), 6), np.int32), np.ones((len(boxes), 6), np.int32)
    for k, box in enumerate(boxes):
        lo[k, : len(box.lo)], hi[k, : len(box.hi)] = box.lo, box.hi
    lib.shared.restype = ctypes.POINTER(ctypes.c_longlong)
    words = np.ctypeslib.as_array(lib.shared(), (1 << 15,))
    words[:] = POISON
    info, off = np.zeros(9, np.int64), np.array(offsets, np.int64)
    fn = lib.run
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    fn(arena.ctypes.data, lo.ctypes.data, hi.ctypes.data, len(boxes), off.ctypes.data, 32 * WARPS, info.ctypes.data)
    out = arrays[-1]
    got = arena[offsets[-1] : offsets[-1] + out.nbytes].view(out.dtype).reshape(out.shape).copy()
    kept = bool((words[-(-shared // 8) :] == POISON).all())
    assert lib.misaligned() == 0, f"{lib.misaligned()} copies to or from addresses not 16-byte aligned"
    return got, info, kept


def _operand(a: np.ndarray, dtype: ml.DType) -> Operand:
    strides = [1] * a.ndim
    for d in range(a.ndim - 2, -1, -1):
        strides[d] = strides[d + 1] * a.shape[d + 1]
    return Operand(dtype, a.shape, tuple(strides))


@dataclasses.dataclass(frozen=True)
class Case:
    dtype: str
    b: int
    hq: int
    hkv: int
    tk: int
    d: int
    splits: int | None  # None: attention over all keys
    positions: tuple[int, ...]
    processors: int  # the plan's: few make tiles of the whole group of heads, many of one head
    lanes: tuple[int, int, int]  # the Lanes<rows, blocks, row split> emit_attention gives it
    append: str | None = None  # rope's layout: the append form
    window: int | None = None
    softcap: float | None = None
    length: int | None = None  # kv_lengths (every sequence)
    mask: bool = False
    nan_after: bool = False  # the caches past every position NaN: keys nobody sees, never read into a sum


CASES = [
    # GQA 4, a tile of the group's 4 heads (a warp a head of each of 2 key blocks), ranges of 100 in 2
    # stages, the new key at a range's start and at the last slot
    Case("bfloat16", 2, 8, 2, 300, 64, 3, (100, 299), 4, (4, 2, 4), append="neox"),
    # Llama-3.2-1B's decode shape (a head a tile, ranges of 64)
    Case("bfloat16", 1, 8, 2, 256, 64, 4, (171,), 132, (1, 2, 1), append="neox", nan_after=True),
    # group 1, head 128, float32: one block of 32 keys staged at a time (4 stages a range of 100)
    Case("float32", 1, 4, 4, 200, 128, 2, (150,), 64, (1, 1, 1), window=40, softcap=30.0, length=170),
    # attention over all keys, a bool mask, lengths: 3 stages of 64 keys, 2 heads a tile
    Case("bfloat16", 1, 8, 2, 150, 128, None, (120,), 4, (2, 2, 2), length=131, mask=True),
    Case("float32", 1, 8, 2, 70, 64, 2, (69,), 132, (1, 2, 1), append="interleaved", window=9),
    # GQA 6 in float16: 6 rows over 2 warps of each of 3 key blocks (3 rows a warp), ranges of 70
    Case("float16", 1, 12, 2, 140, 64, 2, (139,), 4, (6, 3, 2), window=100, softcap=20.0),
]


def _graph(c: Case) -> tuple[ml.Graph, object]:
    dt = ml.as_dtype(c.dtype)
    g = ml.Graph("lanes")
    q = g.input("q", (c.b, c.hq, 1, c.d), dt)
    k, v = g.input("k", (c.b, c.hkv, c.tk, c.d), dt), g.input("v", (c.b, c.hkv, c.tk, c.d), dt)
    extra = {"q_positions": g.input("pos", (c.b, 1), "int64")}
    if c.length is not None:
        extra["kv_lengths"] = g.input("lens", (c.b,), "int64")
    if c.append:
        extra["k_new"] = g.input("k_new", (c.b, c.hkv, 1, c.d), dt)
        extra["v_new"] = g.input("v_new", (c.b, c.hkv, 1, c.d), dt)
        extra["rope"] = {"theta": 500000.0, "layout": c.append}
    if c.mask:
        extra["mask"] = g.input("mask", (c.b, 1, 1, c.tk), "bool")
    out = ml.attention(q, k, v, causal=True, window=c.window, softcap=c.softcap, kv_splits=c.splits, **extra)
    g.output("out", out)
    node = next(n for n in g.nodes if n.op.name in ("attention", "attention_partial"))
    return g, node


def _feeds(c: Case, g: ml.Graph) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(c.tk + c.d)
    dt = ml.as_dtype(c.dtype)
    feeds = {}
    for name, t in g.inputs.items():
        if name == "pos":
            feeds[name] = np.array(c.positions, np.int64).reshape(c.b, 1)
        elif name == "lens":
            feeds[name] = np.full(c.b, c.length, np.int64)
        elif name == "mask":
            feeds[name] = rng.random(t.shape) < 0.8
        else:
            feeds[name] = ml.dtypes.round_to(rng.standard_normal(t.shape), dt)
    if c.nan_after:
        for name in ("k", "v"):
            feeds[name][:, :, max(c.positions) + 1 :] = np.nan
    return feeds


def reference(c: Case, arrays: list[np.ndarray], attrs: dict) -> np.ndarray:
    """float64 from the operands (the append form's q and new key rotated and rounded by rope's reference
    first): attention_partial's [b, hq, 1, splits, dv + 2] (sums, max score, exp-sum), or attention's."""
    if c.append:
        arrays = _appended(arrays, attrs)
    q, k, v = (a.astype(np.float64) for a in arrays[:3])
    k, v = np.nan_to_num(k, nan=0.0), np.nan_to_num(v, nan=0.0)  # (nan_after: keys no query sees)
    named = dict(zip(["pos", *(["lens"] if c.length is not None else [])], arrays[3:]))
    group = c.hq // c.hkv
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s = np.einsum("bhqd,bhkd->bhqk", q, k) * attrs["scale"]
    if c.softcap:
        s = c.softcap * np.tanh(s / c.softcap)
    j = np.arange(c.tk)
    pos = named["pos"].reshape(c.b, 1, 1, 1)
    seen = (j <= pos) & (j < (c.length if c.length is not None else c.tk))
    if c.window:
        seen &= j > pos - c.window
    if c.mask:
        seen = seen & arrays[-1]
    s = np.where(seen, s, -np.inf)
    ranges = [split_bounds(c.tk, c.splits, r) for r in range(c.splits)] if c.splits else [(0, c.tk)]
    out = np.zeros((c.b, c.hq, 1, len(ranges), c.d + 2))
    for r, (lo, hi) in enumerate(ranges):
        m = s[..., lo:hi].max(axis=-1)
        p = np.exp(s[..., lo:hi] - np.where(np.isfinite(m), m, 0.0)[..., None])
        out[:, :, :, r, : c.d] = np.einsum("bhqk,bhkd->bhqd", p, v[:, :, lo:hi])
        out[:, :, :, r, c.d], out[:, :, :, r, c.d + 1] = m, p.sum(axis=-1)
    if c.splits:
        return out
    total = out[:, :, :, 0, c.d + 1 :]
    return np.where(total > 0, out[:, :, :, 0, : c.d] / np.where(total > 0, total, 1.0), 0.0)


def _ulps(got: np.ndarray, want: np.ndarray, eps: float) -> float:
    """The worst |got - want| / (|want| + max |want|), in units of eps."""
    err = np.abs(got.astype(np.float64) - want) / (np.abs(want) + np.abs(want).max())
    return float(err.max() / eps)


@needs_cxx
@pytest.mark.parametrize("c", CASES, ids=lambda c: f"{c.dtype}-h{c.hq}/{c.hkv}-d{c.d}-tk{c.tk}-s{c.splits}")
def test_the_generated_tile_matches_float64(c: Case, tmp_path: Path, misalign: int = 0) -> None:
    g, node = _graph(c)
    feeds = _feeds(c, g)
    names = {id(t): n for n, t in g.inputs.items()}
    arrays = [feeds[names[id(t)]] for t in node.inputs]
    tiling = node.op.tiling
    tiles = tiling.make(node, tiling.defaults("sm_90"), TileContext(0, 1, c.processors, warps=WARPS))
    boxes = [t.writes[0].box for t in tiles]
    rows = max((box.hi[1] - box.lo[1]) * (box.hi[2] - box.lo[2]) for box in boxes)
    hints = {"warps": WARPS, "shared_memory": 227 * 1024, "decode_attention": 1, "rows": rows}
    attrs = {**node.attrs, "codegen": hints}
    dt = ml.as_dtype(c.dtype)
    ops = [_operand(a, dt if a.dtype.kind == "f" or a.dtype == ml.dtypes.bfloat16.np else ml.as_dtype(a.dtype.name))
           for a in arrays]  # fmt: skip
    out = np.zeros(node.outputs[0].shape, node.outputs[0].dtype.np)
    emit = attention_partial if c.splits else attention
    body = emit(node.op.name, attrs, ops, _operand(out, node.outputs[0].dtype))
    assert any("ml::Lanes<{}, {}, {}>".format(*c.lanes) in line for line in body), body
    shared = attention_shared_bytes(attrs, ops, WARPS)
    got, info, kept = run_tiles(body, shared, tmp_path, [*arrays, out], boxes, misalign)
    assert info[0] == 0, f"the tile reported an error: {info}"
    assert kept, f"the tile wrote shared memory past the {shared} bytes emit_attention gave it"
    want = reference(c, arrays, node.attrs)
    # attention_partial's float32 sums of a range's keys (up to 100 here): a few ulps of float32 each;
    # attention's output rounded once to its dtype (half an ulp of |ref|) or a float32 sum
    eps = 2.0**-8 if c.dtype == "bfloat16" and not c.splits else 2.0**-23
    bound = 1 if eps == 2.0**-8 else 64
    if c.splits:
        d = c.d
        none = ~np.isfinite(want[..., d])
        assert (got[..., d][none] == -np.inf).all(), "a range without keys has max score -inf"
        assert not got[..., :d][none].any() and not got[..., d + 1][none].any(), "and zero sums"
        assert none.sum() < none.size, "every range empty: the case tests nothing"
        worst = {
            "sums": _ulps(got[..., :d][~none], want[..., :d][~none], eps),
            "max score": _ulps(got[..., d][~none], want[..., d][~none], eps),
            "exp-sum": _ulps(got[..., d + 1][~none], want[..., d + 1][~none], eps),
        }
    else:
        worst = {"output": _ulps(got.astype(np.float32), want, eps)}
    print(f"{c}: worst error in ulps of {'bfloat16' if eps > 2.0**-23 else 'float32'} (of |ref| + max |ref|): {worst}")
    assert max(worst.values()) <= bound, worst


@needs_cxx
def test_keys_not_16_byte_aligned_take_the_other_paths(tmp_path: Path) -> None:
    """k and v 8 bytes off 16-byte boundaries (an arena's view): the call checks and takes a warp a row."""
    test_the_generated_tile_matches_float64(CASES[1], tmp_path, misalign=8)


def test_the_option_is_in_the_plan_and_on_by_default(tmp_path: Path) -> None:
    """decode_attention is saved with the plan (a file without it was built with 0: the split-key tile)
    and only 1 puts the tile in the kernel; other values are refused, naming the field."""
    c = CASES[1]
    g, _ = _graph(c)
    assert KernelOptions().decode_attention == 1
    split = generate(make_plan(g, processors=16, arch="sm_90", options=KernelOptions(decode_attention=0))).source
    assert "ml::Lanes<" not in split and "ml::attention_partial<" in split
    plan = make_plan(g, processors=16, arch="sm_90", options=LANES)
    plan.save(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json")
    assert loaded.options.decode_attention == 1
    assert "ml::Lanes<2, 2, 2>" in generate(loaded).source  # tiles of 2 heads (16 processors)
    data = json.loads((tmp_path / "plan.json").read_text())
    del data["options"]["decode_attention"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert generate(Plan.load(tmp_path / "old.json")).source == split
    with pytest.raises(ml.errors.GraphBuildError, match=r"decode_attention: must be an int in \[0, 1\], got 2"):
        make_plan(g, processors=16, options=KernelOptions(decode_attention=2))


def _decode_operands(dtype: str, hq: int, hkv: int, tk: int, d: int, dv: int | None = None) -> list[Operand]:
    dt = ml.as_dtype(dtype)
    shapes = ((hq, 1, d), (hkv, tk, d), (hkv, tk, dv or d))
    return [Operand(dt, (1, h, t, w), (h * t * w, t * w, w, 1)) for h, t, w in shapes]


def test_the_emitter_sizes_the_tile_and_leaves_what_it_cannot_take() -> None:
    """Key blocks as the range needs, within the warps and LANES_MAX_BYTES, stages as even as they go,
    the rows over the warps left; heads not of whole packs, values not of 32 .. 128 dims (16 bytes a
    lane at most), more than LANES_MAX_ROWS rows or unaligned key rows keep the other paths."""

    def lanes(ins: list[Operand], rows: int, splits: int | None = 4, option: int = 1) -> Lanes | None:
        hints = {"warps": WARPS, "decode_attention": option, "rows": rows}
        return decode_lanes({"codegen": hints, **({"splits": splits} if splits else {})}, ins)

    bf64 = _decode_operands("bfloat16", 32, 8, 256, 64)
    assert lanes(bf64, 1) == Lanes(1, 2, 1)  # the 1B step: 64 keys a range, a head a tile
    assert lanes(bf64, 4) == Lanes(4, 2, 4)  # the group's 4 heads: one a warp of each key block
    assert lanes(bf64, 4, option=0) is None
    assert lanes(bf64, 9) is None  # too many rows for a warp's registers
    assert lanes(bf64, 4, splits=None) == Lanes(4, 3, 2)  # 256 keys, 4 blocks do not fit: 3 stages (3, 3, 2)
    f128 = _decode_operands("float32", 8, 8, 1000, 128)
    assert lanes(f128, 1, splits=None) == Lanes(1, 1, 1)  # 33 KB a block of 32 keys: one at a time
    assert lanes_shared_bytes(f128, Lanes(1, 1, 1)) <= 40 * 1024
    assert lanes(_decode_operands("bfloat16", 8, 2, 256, 40), 1) is None  # 5 packs of 8
    assert lanes(_decode_operands("bfloat16", 8, 2, 256, 64, 48), 1) is None  # 48 values over 32 lanes
    assert lanes(_decode_operands("float32", 8, 2, 256, 256), 1) is None  # 8 float32 values a lane
    q, k, v = bf64
    odd = Operand(k.dtype, k.shape, (k.strides[0], k.strides[1], 68, 1))  # rows of 68: not 16-byte aligned
    assert lanes([q, odd, v], 1) is None
    hints = {"warps": WARPS, "decode_attention": 1, "rows": 1}
    attrs = {"causal": True, "window": None, "scale": 0.125, "splits": 4, "absent": (3, 4), "codegen": hints}
    parts = Operand(ml.float32, (1, 32, 1, 4, 66), (8448, 264, 264, 66, 1))
    body = "\n".join(attention_partial("attention_partial", attrs, bf64, parts))
    assert "ml::attention_partial<ml::AttnShape<4, 1, 256, 64, 64, true, 0>, 64, true, ml::Lanes<1, 2, 1>>(" in body


@pytest.mark.parametrize("arch, target", [("sm_90", "sm_90a"), ("sm_80", "sm_80")])
def test_llama_decode_compiles_without_spills(arch: str, target: str) -> None:
    """Llama-3.2-1B's decode step (the append form, bf16, 4 ranges of 64 keys) with the option: its
    attention_partial tiles take lanes over keys, with no spills."""
    from tests.test_attention_templates import assert_compiles_without_spills
    from tests.test_row_templates import tile_functions

    cfg = dataclasses.replace(PRESETS["llama3.2-1b"], max_seq=256, layers=1)
    graph = build_llama_generator(cfg, 1, kv_splits="auto")
    src = generate(make_plan(graph, processors=132, arch=arch, options=LANES)).source
    sigs = {sig for sig, (op, body) in tile_functions(src).items() if "ml::attention_partial<" in body}
    assert sigs and all("ml::Lanes<1, 2, 1>" in tile_functions(src)[s][1] for s in sigs), sigs
    assert_compiles_without_spills(src, target, f"Llama-3.2-1B decode, lanes over keys, on {target}", sigs)

"""The rope and kv_cache_update tile templates without a GPU.

Three kinds of check: (1) kernels with every fast path and fallback compile for sm_90a and sm_80 without
spills; (2) a numpy model of the rope arithmetic (float64 angle and quarter-turn reduction, float32
polynomials and fmas) against the float64 reference, up to position 1e6, and proof that the reduction is
what makes it pass; (3) where a host C++ compiler exists, the generated tile functions themselves run on
the CPU (a small shim stands in for the CUDA headers, one block's threads in turn) over strided views,
partial tiles and misaligned operands, against the reference and the model.
"""

from __future__ import annotations

import ctypes
import math
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

import megaloop as ml
from megaloop.codegen import emit, generate
from megaloop.codegen.emit import Operand
from megaloop.frontend.ops.rope import ROPE, inv_frequencies
from megaloop.frontend.tiling import Box, chunks
from megaloop.plan import make_plan
from megaloop.runtime.compile import INCLUDE, compile_cubin, spills
from tests.helpers import assert_close, tolerance
from tests.op_table import rope_ref

F32 = np.float32
# rope.cuh's constants, for the numpy model: Cephes' sinf/cosf polynomials for |r| <= pi/4 (branch-free,
# no large-argument path), pi/2 in two doubles (k quarter turns come off with an error of k * 6e-33),
# and 1.5 * 2^52 (adding it rounds a float64 below 2^51 to an integer).
ROPE_SIN = (-1.95152959e-4, 8.33216087e-3, -1.66666546e-1)
ROPE_COS = (2.44331571e-5, -1.38873163e-3, 4.16666457e-2)
PIO2_HI = math.pi / 2
PIO2_LO = 6.123233995736766e-17
ROUND_MAGIC = 1.5 * 2.0**52
ROPE_HEADER = INCLUDE / "megaloop" / "rope.cuh"
LLAMA3 = {
    "type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def contiguous(dtype: str, shape: tuple[int, ...]) -> Operand:
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    return Operand(ml.as_dtype(dtype), shape, tuple(strides))


def heads_view(dtype: str, b: int, heads: int, tokens: int, hd: int) -> Operand:
    """[b, tokens, heads * hd] seen as [b, heads, tokens, hd], as the Llama block feeds rope."""
    return Operand(ml.as_dtype(dtype), (b, heads, tokens, hd), (tokens * heads * hd, hd, heads * hd, 1))


def rope_attrs(layout: str = "neox", rd: int = 64, theta: float = 10000.0, scaling: dict | None = None) -> dict:
    return {"theta": theta, "layout": layout, "rotary_dim": rd, "scaling": scaling}


# ---- (1) compiles, without spills, and the fast paths are the ones expected ------------------------------


def rope_kv_graph(dtype: str) -> ml.Graph:
    g = ml.Graph(f"rope-kv-{dtype}")
    n = [0]

    def out(t: ml.Tensor) -> None:
        n[0] += 1
        g.output(f"o{n[0]}", t)

    def heads(b: int, tokens: int, h: int, hd: int) -> ml.Tensor:  # a strided view, as in the Llama block
        n[0] += 1
        return g.input(f"x{n[0]}", (b, tokens, h * hd), dtype).reshape(b, tokens, h, hd).transpose(1, 2)

    for tokens in (1, 128):  # decode and prefill
        pos = g.input(f"p{tokens}", (1, tokens), "int64")
        shapes = ((32, 64, None), (8, 64, None)) if tokens == 1 else ((32, 64, None), (4, 128, 48))
        for layout in ("neox", "interleaved"):
            for h, hd, rd in shapes:
                out(ml.rope(heads(1, tokens, h, hd), pos.reshape(1, 1, tokens), layout=layout, rotary_dim=rd))
        for hd in (64, 6, 3):  # 16-byte packs, narrower packs, single elements (the state update is the result)
            ml.kv_cache_update(g.state(f"c{tokens}_{hd}", (1, 4, 256, hd), dtype), heads(1, tokens, 4, hd), pos)
    out(ml.rope(heads(1, 128, 4, 64), g.input("p", (1, 1, 128), "int64"), theta=500000.0, scaling=LLAMA3))
    p3 = g.input("p3", (2, 5), "int64")
    for layout, hd, rd in (("neox", 10, 10), ("interleaved", 6, 4), ("interleaved", 7, 4), ("neox", 7, 4)):
        out(ml.rope(g.input(f"x3d{hd}{layout}", (2, 5, hd), dtype), p3, layout=layout, rotary_dim=rd))
    return g


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_rope_and_kv_update_kernels_compile_without_spills(dtype: str) -> None:
    src = generate(make_plan(rope_kv_graph(dtype), processors=16)).source
    assert src.count("// per-pair path") == 12 and src.count("// batched path") == 6
    for arch in ("sm_90a", "sm_80"):
        assert compile_cubin(src, arch, use_cache=False)[:4] == b"\x7fELF"
    found = spills(src, "sm_90a")  # the H200's: NVRTC compiles the kernel once more, with ptxas -v
    assert not found, f"register spills (stores, loads bytes) per function: {found}"


@pytest.mark.parametrize(
    ("x", "layout", "rd", "want"),
    [
        (heads_view("bfloat16", 1, 32, 512, 64), "neox", 64, 8),  # Llama prefill: 16-byte packs
        (heads_view("float32", 1, 32, 512, 64), "neox", 64, 4),
        (heads_view("bfloat16", 1, 32, 1, 64), "neox", 64, 4),  # decode, 32 heads: a pack a thread
        (heads_view("bfloat16", 1, 8, 1, 64), "neox", 64, 1),  # decode, 8 kv heads
        (heads_view("bfloat16", 1, 8, 1, 64), "interleaved", 64, 2),  # interleaved: a pair a pack at least
        (heads_view("float16", 1, 4, 128, 128), "neox", 48, 8),  # 24-wide halves, 80 dims copied
        (contiguous("bfloat16", (2, 5, 10)), "neox", 10, 1),  # halves of 5
        (contiguous("bfloat16", (2, 5, 7)), "interleaved", 4, 0),  # 3 dims copied: no pair-sized pack
        (Operand(ml.bfloat16, (2, 5, 8), (80, 1, 5)), "neox", 8, 0),  # last axis not contiguous
    ],
)
def test_rope_pack_width(x: Operand, layout: str, rd: int, want: int) -> None:
    pos = contiguous("int64", x.shape[:-1])
    out = contiguous(x.dtype.name, x.shape)
    body = "\n".join(emit.rope("rope", rope_attrs(layout, rd), x, pos, out))
    if want:
        assert f"// per-pair path: whole rows, {want} elements a load" in body
    else:
        assert "per-pair path" not in body
    # ml::rope<head_dim, rotary_dim, neox, pack width (0: the per-element path only), ...>
    assert f"ml::rope<{x.shape[-1]}, {rd}, {'true' if layout == 'neox' else 'false'}, {want}, " in body


@pytest.mark.parametrize(
    ("dtype", "dim", "new_strides", "want"),
    [
        ("bfloat16", 64, None, 8),
        ("bfloat16", 64, (1, 64, 512, 1), 8),  # v of the Llama block: a view of the projection
        ("float32", 64, None, 4),
        ("bfloat16", 6, None, 2),
        ("bfloat16", 3, None, 1),
        ("float32", 8, (128, 1, 16, 2), 1),  # last axis not contiguous: single elements
    ],
)
def test_kv_update_pack_width(dtype: str, dim: int, new_strides: tuple | None, want: int) -> None:
    cache = contiguous(dtype, (1, 8, 1024, dim))
    new = contiguous(dtype, (1, 8, 512, dim))
    if new_strides:
        new = Operand(new.dtype, new.shape, new_strides)
    body = "\n".join(emit.kv_update("kv_cache_update", {}, cache, new, contiguous("int64", (1, 512)), cache))
    assert f"// batched path: {want} elements a copy" in body
    # ml::kv_update<max_len, tokens, head_dim, skip negative, pack width, ...>(a, t, tid, ...): it reports
    assert f"ml::kv_update<1024, 512, {dim}, false, {want}, " in body and "(a, t, tid, " in body


# ---- (2) the rope arithmetic, modelled in numpy ----------------------------------------------------------


def _split(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    c = 134217729.0 * a  # 2^27 + 1 (Veltkamp)
    hi = c - (c - a)
    return hi, a - hi


def _two_prod(a: np.ndarray, b: float) -> tuple[np.ndarray, np.ndarray]:
    """p + e == a * b exactly (Dekker)."""
    p = a * b
    ah, al = _split(a)
    bh, bl = _split(np.float64(b))
    return p, ((ah * bh - p) + ah * bl + al * bh) + al * bl


def fmaf(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 fma: the product is exact in float64; the sum rounds twice (float64, then float32), which
    can differ from one rounding in the last bit, rarely."""
    return (np.float64(a) * np.float64(b) + np.float64(c)).astype(F32)


def model_sincos_reduced(r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's float32 polynomials for |r| <= pi/4."""
    s0, s1, s2 = (F32(v) for v in ROPE_SIN)
    c0, c1, c2 = (F32(v) for v in ROPE_COS)
    z = r * r
    sr = fmaf(fmaf(fmaf(s0, z, s1), z, s2) * z, r, r)
    cr = fmaf(fmaf(fmaf(fmaf(c0, z, c1), z, c2), z, F32(-0.5)), z, F32(1.0))
    return sr, cr


def model_angle(pos: np.ndarray, inv: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """sin, cos (float32) of pos * inv as the kernel's ``ml::rope_angle`` computes them."""
    ang = pos.astype(np.float64)[..., None] * inv  # the reference's own product
    # k: fma(ang, 2/pi, 1.5 * 2^52) - 1.5 * 2^52, the exact product rounded to an integer (ties aside)
    p, e = _two_prod(ang, 2 / math.pi)
    k = np.rint(p)
    rest = (p - k) + e
    k = k + (rest > 0.5) - (rest < -0.5)
    p, e = _two_prod(k, PIO2_HI)
    r = (ang - p) - e  # fma(-k, hi, ang): ang - p is exact (Sterbenz), so this rounds once, as the fma
    r = (r - k * PIO2_LO).astype(F32)  # fma(-k, lo, r), to within a float64 ulp of r
    sr, cr = model_sincos_reduced(r)
    q = k.astype(np.int64) & 3
    s = np.where(q & 1, cr, sr)
    c = np.where(q & 1, sr, cr)
    return np.where(q & 2, -s, s), np.where((q + 1) & 2, -c, c)


def pairs(x: np.ndarray, rd: int, layout: str) -> tuple[np.ndarray, np.ndarray]:
    if layout == "neox":
        return x[..., : rd // 2], x[..., rd // 2 : rd]
    return x[..., 0:rd:2], x[..., 1:rd:2]


def model_rope(x: np.ndarray, pos: np.ndarray, attrs: dict, sincos=None) -> np.ndarray:
    """The kernel's rope (float32 result, before rounding to a 16-bit dtype). ``sincos`` replaces the
    angle computation (to show what its variants would do)."""
    rd, layout = attrs["rotary_dim"], attrs["layout"]
    inv = inv_frequencies(rd, attrs["theta"], attrs["scaling"])
    s, c = (sincos or model_angle)(np.broadcast_to(pos, x.shape[:-1]), inv)
    x32 = x.astype(F32)
    x1, x2 = pairs(x32, rd, layout)
    out = x32.copy()
    o1, o2 = pairs(out, rd, layout)
    o1[...] = fmaf(x1, c, -(x2 * s))
    o2[...] = fmaf(x2, c, x1 * s)
    return out


def naive_float32_angle(pos: np.ndarray, inv: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ang = pos.astype(F32)[..., None] * inv.astype(F32)
    return np.sin(ang), np.cos(ang)


def unreduced_angle(pos: np.ndarray, inv: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The float64 product, rounded to float32 whole (no reduction first), then float32 sin and cos."""
    ang = (pos.astype(np.float64)[..., None] * inv).astype(F32)
    return np.sin(ang), np.cos(ang)


def worst_ratio(got: np.ndarray, ref: np.ndarray, dtype: ml.DType = ml.float32) -> tuple[float, float]:
    """max |got - ref| / tolerance (the op's accuracy, as the GPU tests judge it), and max |got - ref|."""
    err = np.abs(got.astype(np.float64) - ref)
    return float((err / tolerance(ref, dtype, ROPE.accuracy)).max()), float(err.max())


def far_positions(rng: np.random.Generator, n: int) -> np.ndarray:
    return np.concatenate([np.arange(n), rng.integers(0, 1_000_000, n), np.arange(1_000_000 - n + 1, 1_000_001)])


def test_sin_cos_polynomials_are_within_one_ulp() -> None:
    """Every float32 of [0, pi/4] gives at most 0.73 ulp (sin) and 0.88 ulp (cos); a 2^22 sample here."""
    top = int(np.array(math.pi / 4, F32).view(np.int32))
    r = np.linspace(0, top, 1 << 22).astype(np.int32).view(F32)
    sr, cr = model_sincos_reduced(r)
    for got, want in ((sr, np.sin(r.astype(np.float64))), (cr, np.cos(r.astype(np.float64)))):
        ulp = np.spacing(np.abs(want).astype(F32)).astype(np.float64)
        assert (np.abs(got - want) / ulp).max() <= 1.0
    assert np.array_equal(model_sincos_reduced(-r)[0], -sr)  # odd and even exactly
    assert np.array_equal(model_sincos_reduced(-r)[1], cr)


def test_the_model_uses_the_kernels_constants() -> None:
    text = ROPE_HEADER.read_text()
    literals = re.findall(r"\b(\w+) = (-?0x[0-9a-f.]+p[-+]\d+f?)", text)
    found = {nm: float.fromhex(v.removesuffix("f")) for nm, v in literals}
    for k in range(3):  # float32 literals of exactly the model's float32 values
        assert found[f"SIN{k}"] == float(F32(ROPE_SIN[k])) and found[f"COS{k}"] == float(F32(ROPE_COS[k]))
    want = {"PIO2_HI": PIO2_HI, "PIO2_LO": PIO2_LO, "TWO_OVER_PI": 2 / math.pi, "ROUND_MAGIC": ROUND_MAGIC}
    assert {nm: found[nm] for nm in want} == want
    assert ROUND_MAGIC % 4 == 0 and np.spacing(ROUND_MAGIC) == 1.0
    assert abs((PIO2_HI + PIO2_LO) - math.pi / 2) < 1e-30 and abs(PIO2_LO) < 1e-16


@pytest.mark.parametrize(
    "attrs",
    [
        rope_attrs("neox", 64),
        rope_attrs("interleaved", 64),
        rope_attrs("neox", 128, theta=500000.0),
        rope_attrs("interleaved", 96, theta=500000.0),
        rope_attrs("neox", 128, theta=500000.0, scaling=LLAMA3),
        rope_attrs("neox", 64, scaling={"type": "linear", "factor": 4.0}),
    ],
    ids=lambda a: f"{a['layout']}-{a['rotary_dim']}-{a['theta']:g}-{(a['scaling'] or {}).get('type', 'plain')}",
)
def test_rope_model_matches_the_float64_reference_to_position_1e6(attrs: dict, capsys) -> None:
    rng = np.random.default_rng(5)
    pos = far_positions(rng, 2048)
    hd = 128
    x = rng.standard_normal((len(pos), hd)).astype(F32)
    ref = rope_ref(torch.from_numpy(x.astype(np.float64)), torch.from_numpy(pos), **attrs).numpy()
    got = model_rope(x, pos, attrs)
    ratio, err = worst_ratio(got, ref)
    with capsys.disabled():
        print(f"\nrope model, float32, {attrs}: worst error {err:.3e} = {ratio:.3f} of the tolerance")
    assert_close(got, ref, ml.float32, ROPE.accuracy, what="rope model vs float64")
    assert ratio < 0.5  # room for the last-bit differences of the GPU's own fmas
    # megaloop's numpy reference (rounded to float32 at its end) agrees as well
    assert_close(got, ROPE.reference([x, pos], attrs), ml.float32, ROPE.accuracy, what="rope model vs megaloop")
    # and the 16-bit dtypes: the model rounded once from float32, their inputs drawn in their dtype
    for dtype in (ml.bfloat16, ml.float16):
        xd = x.astype(dtype.np)
        refd = rope_ref(torch.from_numpy(xd.astype(np.float64)), torch.from_numpy(pos), **attrs).numpy()
        assert_close(model_rope(xd, pos, attrs).astype(dtype.np), refd, dtype, ROPE.accuracy, what=dtype.name)


def test_small_rows_leave_the_tolerance_no_scale_to_hide_in() -> None:
    """The tolerance grows with the output's largest value; rows of a single pair at every angle show
    the error is small relative to each pair's own magnitude too."""
    rng = np.random.default_rng(6)
    pos = far_positions(rng, 4096)
    x = rng.standard_normal((len(pos), 2)).astype(F32)
    attrs = rope_attrs("neox", 2)
    got = model_rope(x, pos, attrs)
    ref = rope_ref(torch.from_numpy(x.astype(np.float64)), torch.from_numpy(pos), **attrs).numpy()
    norm = np.linalg.norm(x.astype(np.float64), axis=-1, keepdims=True)
    assert (np.abs(got - ref) / norm).max() < 3 * float(np.finfo(F32).eps)


def test_dropping_the_reduction_breaks_the_tolerance(capsys) -> None:
    rng = np.random.default_rng(7)
    pos = np.arange(1_000_000 - 4095, 1_000_001)
    x = rng.standard_normal((len(pos), 64)).astype(F32)
    attrs = rope_attrs("neox", 64)
    ref = rope_ref(torch.from_numpy(x.astype(np.float64)), torch.from_numpy(pos), **attrs).numpy()
    ours = worst_ratio(model_rope(x, pos, attrs), ref)
    naive = worst_ratio(model_rope(x, pos, attrs, sincos=naive_float32_angle), ref)
    unreduced = worst_ratio(model_rope(x, pos, attrs, sincos=unreduced_angle), ref)
    with capsys.disabled():
        print(
            f"\nat positions near 1e6 (error / tolerance, max error): kernel {ours[0]:.3f}, {ours[1]:.2e}; "
            f"float32 angle {naive[0]:.3g}, {naive[1]:.2e}; float64 angle unreduced {unreduced[0]:.3g}, "
            f"{unreduced[1]:.2e}"
        )
    assert ours[0] < 0.5
    assert naive[0] > 1000 and unreduced[0] > 1000


# ---- (3) the generated tile functions, run on the CPU ----------------------------------------------------

# Stands in for megaloop/loop.cuh and vec.cuh (and the CUDA builtins they use): the real elementwise.cuh,
# rope.cuh and cache.cuh are compiled over it.
SHIM = r"""
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>
#define __device__
#define __noinline__
#define __forceinline__ inline
struct Dim3 { unsigned x, y, z; };
static Dim3 threadIdx, blockDim, blockIdx;
static inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
static inline int min(int a, int b) { return a < b ? a : b; }
static inline long long min(long long a, long long b) { return a < b ? a : b; }
namespace ml {
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;
inline unsigned block_threads() { return blockDim.x; }  // (megaloop/block.cuh without a loader warp)
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
inline i64 load(const int* p) { return *p; }
inline i64 load(const i64* p) { return *p; }
inline void store(float* p, float v) { *p = v; }
inline void store(bf16* p, float v) {  // round to nearest even, as cvt.rn.bf16.f32
    u32 w;
    memcpy(&w, &v, 4);
    p->bits = (w & 0x7fffffffu) > 0x7f800000u ? 0x7fff : (u16)((w + 0x7fffu + ((w >> 16) & 1u)) >> 16);
}
inline void store(f16* p, float v) { const _Float16 h = (_Float16)v; memcpy(&p->bits, &h, 2); }
template <class T, int N> struct alignas(sizeof(T) * N) Pack { T v[N]; };
template <class T, int N> inline Pack<T, N> load_pack(const T* p) { Pack<T, N> r; memcpy(&r, p, sizeof r); return r; }
template <class T, int N> inline void store_pack(T* p, const Pack<T, N>& x) { memcpy(p, &x, sizeof x); }
template <class T, int N> inline float get(const Pack<T, N>& p, int i) { return load(&p.v[i]); }
template <class T, int N, class V> inline void set(Pack<T, N>& p, int i, V value) { store(&p.v[i], value); }
inline bool aligned(const void* p, int bytes) { return ((uintptr_t)p & (uintptr_t)(bytes - 1)) == 0; }
template <int N, class F> inline void for_box(const Task& t, F f) {
    int ext[N + 1];
    i64 total = 1;
    for (int d = 0; d < N; ++d) { ext[d] = t.hi[d] - t.lo[d]; total *= ext[d]; }
    for (i64 e = threadIdx.x; e < total; e += blockDim.x) {
        int i[N + 1];
        i64 r = e;
        for (int d = N - 1; d >= 0; --d) { i[d] = t.lo[d] + (int)(r % ext[d]); r /= ext[d]; }
        f(i);
    }
}
}  // namespace ml
"""

TILE = r"""
#include "megaloop/cache.cuh"
void tile(const ml::Args& a, const ml::Task& t, int tid, const ml::i64* off) {
BODY
}
// every task of the op, each by one block of `threads` threads taken one after another (these tile
// functions never synchronise the block)
extern "C" void run(char* arena, const int* lo, const int* hi, int tasks, const long long* off, int threads,
                    long long* info) {
    const ml::Args a{arena, info};
    blockDim.x = threads;
    for (int k = 0; k < tasks; ++k) {
        ml::Task t{};
        memcpy(t.lo, lo + k * ml::MAX_DIMS, sizeof t.lo);
        memcpy(t.hi, hi + k * ml::MAX_DIMS, sizeof t.hi);
        blockIdx.x = k;
        for (int x = 0; x < threads; ++x) { threadIdx.x = x; tile(a, t, k, off); }
    }
}
"""

needs_cxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs a host C++ compiler (g++)")


def run_on_cpu(body: list[str], tmp_path: Path, arena: np.ndarray, offsets: list[int], boxes: list) -> np.ndarray:
    """Run the tile function ``body`` on every box (one task each); returns the error info (code, ...)."""
    stub = tmp_path / "stub" / "megaloop"
    stub.mkdir(parents=True, exist_ok=True)
    (stub / "loop.cuh").write_text(SHIM)
    (stub / "vec.cuh").write_text("#pragma once\n")  # (in loop.cuh's stand-in)
    src = tmp_path / "tile.cpp"
    src.write_text(TILE.replace("BODY", "\n".join("    " + line for line in body)))
    lib = tmp_path / f"tile{len(list(tmp_path.glob('*.so')))}.so"
    subprocess.run(
        ["g++", "-std=c++17", "-O1", "-ffp-contract=off", "-shared", "-fPIC", "-I", str(stub.parent)]
        + ["-I", str(INCLUDE), "-o", str(lib), str(src)],
        check=True,
        capture_output=True,
    )
    lo = np.zeros((len(boxes), 6), np.int32)
    hi = np.ones((len(boxes), 6), np.int32)
    for k, box in enumerate(boxes):
        lo[k, : len(box.lo)], hi[k, : len(box.hi)] = box.lo, box.hi
    info = np.zeros(9, np.int64)
    off = np.array(offsets, np.int64)
    fn = ctypes.CDLL(str(lib)).run
    ptr = ctypes.c_void_p
    fn.argtypes = [ptr, ptr, ptr, ctypes.c_int, ptr, ctypes.c_int, ptr]
    fn(arena.ctypes.data, lo.ctypes.data, hi.ctypes.data, len(boxes), off.ctypes.data, 256, info.ctypes.data)
    return info


def element_index(o: Operand) -> np.ndarray:
    """Each element's index in its storage, by the operand's strides."""
    idx = np.zeros(o.shape, np.int64)
    for d, (n, s) in enumerate(zip(o.shape, o.strides)):
        shape = [1] * len(o.shape)
        shape[d] = n
        idx = idx + np.arange(n).reshape(shape) * s
    return idx


class Arena:
    """Operands laid out in one byte buffer (``misalign`` bytes off 16-byte boundaries; ``alias`` maps an
    operand to an earlier one whose storage it shares), the rest of it filled with a pattern that must
    survive the run."""

    def __init__(self, operands: list[Operand], misalign: int = 0, alias: dict[int, int] | None = None) -> None:
        self.operands, self.offsets, at = operands, [], 64
        for k, o in enumerate(operands):
            if alias and k in alias:
                self.offsets.append(self.offsets[alias[k]])
                continue
            self.offsets.append(at + misalign)
            at += -(-(int(element_index(o).max()) + 1) * o.dtype.itemsize // 64) * 64 + 64
        self.bytes = np.full(at + 64, 0xA5, np.uint8)
        self.before = self.bytes  # a copy taken before the run, by the caller

    def view(self, k: int, buf: np.ndarray | None = None) -> np.ndarray:
        o = self.operands[k]
        n = int(element_index(o).max()) + 1
        return (self.bytes if buf is None else buf)[self.offsets[k] : self.offsets[k] + n * o.dtype.itemsize].view(
            o.dtype.np
        )

    def write(self, k: int, values: np.ndarray, buf: np.ndarray | None = None) -> None:
        self.view(k, buf)[element_index(self.operands[k])] = values

    def read(self, k: int) -> np.ndarray:
        return self.view(k)[element_index(self.operands[k])]


ROPE_CASES = [
    # (x, pos shape, attrs, rows a task)
    (heads_view("bfloat16", 1, 4, 40, 64), (1, 1, 40), rope_attrs("neox", 64), 32),  # Llama prefill view
    (heads_view("float32", 1, 4, 40, 64), (1, 1, 40), rope_attrs("neox", 64), 32),
    (heads_view("float16", 1, 4, 40, 64), (1, 1, 40), rope_attrs("interleaved", 64), 32),
    (heads_view("bfloat16", 1, 32, 1, 64), (1, 1, 1), rope_attrs("neox", 64), 128),  # decode: 4-wide packs
    (heads_view("bfloat16", 1, 8, 1, 64), (1, 1, 1), rope_attrs("neox", 64), 128),  # single elements
    (heads_view("float32", 2, 3, 24, 128), (2, 1, 24), rope_attrs("neox", 48, 500000.0, LLAMA3), 16),  # copies
    (heads_view("bfloat16", 2, 3, 24, 128), (2, 1, 24), rope_attrs("interleaved", 80), 16),
    (contiguous("float32", (3, 7, 10)), (3, 7), rope_attrs("neox", 10), 4),  # halves of 5, no broadcast
    (contiguous("bfloat16", (3, 7, 6)), (3, 7), rope_attrs("interleaved", 4), 5),
    (contiguous("bfloat16", (3, 7, 7)), (3, 7), rope_attrs("interleaved", 4), 5),  # per-element path only
]


@needs_cxx
@pytest.mark.parametrize("case", range(len(ROPE_CASES)))
def test_generated_rope_runs_on_the_cpu(case: int, tmp_path: Path) -> None:
    x, pos_shape, attrs, rows = ROPE_CASES[case]
    pos, out = contiguous("int64", pos_shape), contiguous(x.dtype.name, x.shape)
    rng = np.random.default_rng(case)
    xv = ml.dtypes.round_to(rng.standard_normal(x.shape), x.dtype)
    pv = rng.integers(0, 1_000_000, pos_shape)
    pv.flat[0] = 0 if pv.size > 1 else pv.flat[0]  # position 0 (no rotation) among others
    body = emit.rope("rope", attrs, x, pos, out)
    # boxes of whole rows, as the rope tiling makes them
    whole = [Box(b.lo + (0,), b.hi + (x.shape[-1],)) for b in chunks(x.shape[:-1], rows)]
    results = []
    for misalign, boxes in ((0, whole), (x.dtype.itemsize, whole), (0, halves(whole))):
        arena = Arena([x, pos, out], misalign)
        arena.write(0, xv)
        arena.write(1, pv)
        expected = arena.bytes.copy()
        info = run_on_cpu(body, tmp_path, arena.bytes, arena.offsets, boxes)
        assert info[0] == 0
        got = arena.read(2)
        arena.write(2, got, expected)  # the outputs in place: nothing else may have changed
        assert np.array_equal(arena.bytes, expected), "a write outside the output's elements"
        results.append(got)
    ref = rope_ref(torch.from_numpy(xv.astype(np.float64)), torch.from_numpy(pv), **attrs).numpy()
    assert_close(results[0], ref, x.dtype, ROPE.accuracy, what=f"rope case {case}")
    # the fast path, the per-element path (misaligned operands, tiles of half rows) agree bit for bit
    assert np.array_equal(results[0].view(np.uint8), results[1].view(np.uint8))
    assert np.array_equal(results[0].view(np.uint8), results[2].view(np.uint8))
    # and the numpy model is the arithmetic that ran (up to its rare double-rounding differences)
    model = model_rope(xv, pv, attrs).astype(x.dtype.np).astype(np.float64)
    differ = results[0].astype(np.float64) != model
    assert differ.mean() < 1e-3
    assert np.all(np.abs(results[0].astype(np.float64) - model) <= np.spacing(np.abs(model).astype(x.dtype.np)))


def halves(boxes: list) -> list:
    """Each box split in two along the last axis: no whole rows, so the per-element path runs."""
    out = []
    for b in boxes:
        mid = b.hi[-1] // 2
        out += [Box(b.lo, b.hi[:-1] + (mid,)), Box(b.lo[:-1] + (mid,), b.hi)]
    return out


KV_CASES = [
    # (cache, new)
    (contiguous("bfloat16", (2, 3, 64, 64)), contiguous("bfloat16", (2, 3, 40, 64))),
    (contiguous("bfloat16", (2, 3, 64, 64)), Operand(ml.bfloat16, (2, 3, 40, 64), (40 * 192, 64, 192, 1))),  # view
    (contiguous("float32", (1, 2, 48, 64)), contiguous("float32", (1, 2, 1, 64))),  # decode
    (contiguous("float16", (2, 2, 32, 6)), contiguous("float16", (2, 2, 9, 6))),  # 2-element packs
    (contiguous("bfloat16", (1, 2, 32, 3)), contiguous("bfloat16", (1, 2, 9, 3))),  # single elements
    (contiguous("float32", (1, 2, 32, 8)), Operand(ml.float32, (1, 2, 9, 8), (400, 200, 20, 2))),  # strided dims
]


def kv_run(case: int, tmp_path: Path, pv: np.ndarray, misalign: int = 0) -> tuple[np.ndarray, np.ndarray, Arena]:
    """The cache after the update, the info words, and the arena (bytes before the run in .before)."""
    cache, new = KV_CASES[case]
    b, h, s, d = cache.shape
    pos = contiguous("int64", (b, new.shape[2]))
    rng = np.random.default_rng(case)
    arena = Arena([cache, new, pos, cache], misalign, alias={3: 0})
    arena.write(0, ml.dtypes.round_to(rng.standard_normal(cache.shape), cache.dtype))
    arena.write(1, ml.dtypes.round_to(rng.standard_normal(new.shape), new.dtype))
    arena.write(2, pv)
    arena.before = arena.bytes.copy()
    boxes = [Box((bi, hi, 0, 0), (bi + 1, hi + 1, s, d)) for bi in range(b) for hi in range(h)]  # as the tiling
    info = run_on_cpu(
        emit.kv_update("kv_cache_update", {}, cache, new, pos, cache), tmp_path, arena.bytes, arena.offsets, boxes
    )
    return arena.read(3), info, arena


@needs_cxx
@pytest.mark.parametrize("case", range(len(KV_CASES)))
def test_generated_kv_update_runs_on_the_cpu(case: int, tmp_path: Path) -> None:
    cache, new = KV_CASES[case]
    rng = np.random.default_rng(100 + case)
    pv = np.stack([rng.permutation(cache.shape[2])[: new.shape[2]] for _ in range(cache.shape[0])])
    got, info, arena = kv_run(case, tmp_path, pv)
    assert info[0] == 0
    ref = arena.view(0, arena.before)[element_index(cache)]
    for bi in range(cache.shape[0]):
        ref[bi][:, pv[bi], :] = arena.view(1, arena.before)[element_index(new)][bi]
    assert np.array_equal(got.view(np.uint8), ref.view(np.uint8))  # bit for bit
    expected = arena.before.copy()
    arena.write(3, got, expected)
    assert np.array_equal(arena.bytes, expected), "a write outside the cache's elements"
    misaligned, info, _ = kv_run(case, tmp_path, pv, misalign=cache.dtype.itemsize)  # the per-element loop
    assert info[0] == 0 and np.array_equal(misaligned.view(np.uint8), ref.view(np.uint8))


@needs_cxx
@pytest.mark.parametrize("case", [0, 2, 4])
@pytest.mark.parametrize("bad", [-1, "max_len"])
def test_kv_update_reports_a_bad_position_and_never_writes_it(case: int, bad, tmp_path: Path) -> None:
    cache, new = KV_CASES[case]
    s = cache.shape[2]
    rng = np.random.default_rng(200 + case)
    pv = np.stack([rng.permutation(s)[: new.shape[2]] for _ in range(cache.shape[0])])
    value = s if bad == "max_len" else bad
    pv[-1, -1] = value
    for misalign in (0, cache.dtype.itemsize):  # the batched path and the per-element loop
        got, info, arena = kv_run(case, tmp_path, pv, misalign)
        assert list(info[:7]) == [2, int(info[1]), int(info[2]), 0, value, s, 1]  # DATA: value, limit, kind
        # only the valid positions' rows may have changed, and nothing outside the cache
        expected = arena.before.copy()
        old = arena.view(0, expected)[element_index(cache)]
        for bi in range(cache.shape[0]):
            keep = np.setdiff1d(np.arange(s), pv[bi])
            assert np.array_equal(got[bi][:, keep].view(np.uint8), old[bi][:, keep].view(np.uint8))
        arena.write(3, got, expected)
        assert np.array_equal(arena.bytes, expected), "a write outside the cache's elements"


FUSED_CASES = [
    # (dtype, batch, kv heads, max_len, head_dim, tokens, attrs)
    ("bfloat16", 1, 8, 48, 64, 1, rope_attrs("neox", 64, 500000.0, LLAMA3)),  # a Llama decode step's keys
    ("bfloat16", 2, 3, 64, 64, 5, rope_attrs("interleaved", 32)),  # dims past rotary_dim copied
    ("float16", 2, 2, 32, 48, 9, rope_attrs("neox", 16)),
    ("float32", 1, 2, 600, 128, 300, rope_attrs("neox", 96, 500000.0, LLAMA3)),  # several items a thread
]


def fused_run(case: int, tmp_path: Path, pv: np.ndarray, nan_payloads: bool = False):
    """rope_kv_cache_update's tile function, and rope's then kv_cache_update's, on the same inputs: the
    two caches, the fused run's info words and its arena (bytes before the run in .before)."""
    dt, b, h, s, d, t, attrs = FUSED_CASES[case]
    cache, new = contiguous(dt, (b, h, s, d)), heads_view(dt, b, h, t, d)  # new: a projection's heads
    pos, rope_pos, rotated = contiguous("int64", (b, t)), contiguous("int64", (b, 1, t)), contiguous(dt, new.shape)
    rng = np.random.default_rng(300 + case)
    nv = ml.dtypes.round_to(rng.standard_normal(new.shape), new.dtype)
    if nan_payloads:  # NaNs with payloads, in rotated and in copied dims
        bits = nv.view(np.uint16 if new.dtype.itemsize == 2 else np.uint32)
        bits.reshape(-1)[::5] = 0xFFC1 if new.dtype.itemsize == 2 else 0xFFC00001
    cv = ml.dtypes.round_to(rng.standard_normal(cache.shape), cache.dtype)
    boxes = [Box((bi, hi, 0, 0), (bi + 1, hi + 1, s, d)) for bi in range(b) for hi in range(h)]  # as the tiling
    fused = Arena([cache, new, pos, cache], alias={3: 0})
    fused.write(0, cv)
    fused.write(1, nv)
    fused.write(2, pv)
    fused.before = fused.bytes.copy()
    info = run_on_cpu(
        emit.rope_kv_update("k", attrs, cache, new, pos, cache), tmp_path, fused.bytes, fused.offsets, boxes
    )
    apart = Arena([cache, new, pos, cache, rope_pos, rotated], alias={3: 0})
    apart.write(0, cv)
    apart.write(1, nv)
    apart.write(2, pv)
    apart.write(4, pv[:, None, :])
    rows = [Box(bx.lo, bx.hi[:2] + (t, d)) for bx in boxes]
    run_on_cpu(
        emit.rope("rope", attrs, new, rope_pos, rotated),
        tmp_path,
        apart.bytes,
        [apart.offsets[k] for k in (1, 4, 5)],
        rows,
    )
    run_on_cpu(
        emit.kv_update("kv", {}, cache, rotated, pos, cache),
        tmp_path,
        apart.bytes,
        [apart.offsets[k] for k in (0, 5, 2, 3)],
        boxes,
    )
    return fused.read(3), apart.read(3), info, fused, nv


@needs_cxx
@pytest.mark.parametrize("nan_payloads", [False, True])
@pytest.mark.parametrize("case", range(len(FUSED_CASES)))
def test_generated_rope_into_the_cache_is_rope_then_the_update(case: int, nan_payloads: bool, tmp_path: Path) -> None:
    """rope_kv_cache_update's tile stores the bytes rope's tile then kv_cache_update's store (the same
    fmas; dims past rotary_dim, NaN payloads included, copied as stored), writes nothing else, and is
    within rope's accuracy of the reference."""
    _, b, _, s, _, t, attrs = FUSED_CASES[case]
    rng = np.random.default_rng(case)
    pv = np.stack([rng.permutation(s)[:t] for _ in range(b)])
    got, want, info, arena, nv = fused_run(case, tmp_path, pv, nan_payloads)
    assert info[0] == 0
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), "fused and two-op caches differ"
    expected = arena.before.copy()
    arena.write(3, got, expected)
    assert np.array_equal(arena.bytes, expected), "a write outside the cache's elements"
    if not nan_payloads:
        ref = rope_ref(torch.from_numpy(nv.astype(np.float64)), torch.from_numpy(pv[:, None, :]), **attrs).numpy()
        written = np.stack([got[bi][:, pv[bi]] for bi in range(b)])
        assert_close(
            written,
            ref,
            got.dtype if isinstance(got.dtype, ml.DType) else ml.as_dtype(got.dtype),
            ROPE.accuracy,
            what=f"fused case {case}",
        )


@needs_cxx
@pytest.mark.parametrize("bad", [-1, "max_len"])
def test_generated_rope_into_the_cache_reports_a_bad_position_and_never_writes_it(bad, tmp_path: Path) -> None:
    _, b, h, s, d, t, _ = FUSED_CASES[1]
    rng = np.random.default_rng(7)
    pv = np.stack([rng.permutation(s)[:t] for _ in range(b)])
    value = s if bad == "max_len" else bad
    pv[-1, -1] = value
    got, _, info, arena, _ = fused_run(1, tmp_path, pv)
    assert list(info[:7]) == [2, int(info[1]), int(info[2]), 0, value, s, 1]  # DATA: value, limit, kind
    old = arena.view(0, arena.before)[element_index(contiguous("bfloat16", (b, h, s, d)))]
    for bi in range(b):  # only the valid positions' rows may have changed
        keep = np.setdiff1d(np.arange(s), pv[bi])
        assert np.array_equal(got[bi][:, keep].view(np.uint8), old[bi][:, keep].view(np.uint8))
    expected = arena.before.copy()
    arena.write(3, got, expected)
    assert np.array_equal(arena.bytes, expected), "a write outside the cache's elements"

"""numpy's integer (and float) power, floor_divide and remainder (megaloop/frontend/ops/elementwise.py)
beyond the op table's rows: the edges numpy defines (negative operands, zero divisors, the smallest
integer over -1, wrap-around on overflow, infinities), on the reference and the fast path, the
device functions of megaloop/math.cuh run on the CPU through g++ over the same edges, the refusals of
a negative integer exponent, and the generated kernel compiled for sm_90a and sm_80."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest

import megaloop as ml
from megaloop.codegen import generate
from megaloop.errors import DataError, GraphBuildError
from megaloop.plan import make_plan
from megaloop.reference.fast import evaluate_fast
from megaloop.runtime.compile import compile_cubin
from tests.helpers import host_library

INCLUDE = Path(ml.__file__).parent / "codegen" / "include" / "megaloop"
I64 = np.iinfo(np.int64)
I32 = np.iinfo(np.int32)


def _edges(dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Every pair of a set of edge values: signs, zero, +-1, the extremes."""
    if dtype.kind == "f":
        v = np.array([7, -7, 0.0, -0.0, 3.5, -3.5, 1e30, 3e-30, np.inf, -np.inf, np.nan, 2, -2, 0.1], dtype)
    else:
        info = np.iinfo(dtype)
        v = np.array([7, -7, 0, 1, -1, 2, -2, 3, 13, -13, info.min, info.max, info.min + 1], dtype)
    a, b = np.meshgrid(v, v, indexing="ij")
    return a.ravel(), b.ravel()


def _numpy(name: str, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        if name == "pow":
            return np.power(a, np.maximum(b, 0) if a.dtype.kind == "i" else b)
        return getattr(np, name)(a, b)


def _same(got: np.ndarray, want: np.ndarray, what: str) -> None:
    ok = (got == want) | (np.isnan(got) & np.isnan(want)) if got.dtype.kind == "f" else got == want
    ok &= np.signbit(got) == np.signbit(want) if got.dtype.kind == "f" else True
    bad = np.flatnonzero(~ok)
    assert bad.size == 0, f"{what}: {bad.size} differ, first at {bad[0]}: got {got[bad[0]]!r}, numpy {want[bad[0]]!r}"


@pytest.mark.parametrize("dtype", ["int32", "int64", "float32"])
@pytest.mark.parametrize("name", ["floor_divide", "remainder", "pow"])
def test_the_edges_are_numpys_on_the_reference_and_the_fast_path(name: str, dtype: str) -> None:
    a, b = _edges(np.dtype(dtype))
    if name == "pow" and dtype != "float32":
        b = np.abs(b).clip(0, 70).astype(dtype)  # (a negative exponent is refused: next test)
    g = ml.Graph(f"{name}-{dtype}")
    x, y = g.input("a", a.shape, dtype), g.input("b", b.shape, dtype)
    g.output("out", getattr(ml, name)(x, y))
    want = _numpy(name, a, b)
    _same(ml.evaluate(g, {"a": a, "b": b}).outputs["out"], want, f"{name} {dtype} reference")
    _same(evaluate_fast(g, {"a": a, "b": b}, {}, {})[0]["out"], want, f"{name} {dtype} fast path")


def test_a_negative_integer_exponent_is_refused() -> None:
    g = ml.Graph("neg-pow")
    x = g.input("x", (3,), "int64")
    with pytest.raises(GraphBuildError, match="pow: an integer tensor to the negative power -2"):
        x**-2
    g.output("y", x ** g.input("e", (3,), "int64"))
    with pytest.raises(DataError, match=r"pow: exponent\[1\] is -1: integers to negative integer powers"):
        ml.evaluate(g, {"x": np.array([2, 3, 4]), "e": np.array([1, -1, 2])})
    assert ml.evaluate(g, {"x": np.array([2, 3, 4]), "e": np.array([1, 0, 2])}).outputs["y"].tolist() == [2, 1, 16]
    assert (ml.Graph("f").input("x", (2,), "float32") ** -2).node.op.name == "pow"  # floats take any power


HOST_TYPES = r"""
#pragma once
#include <math.h>
#include <string.h>
#define __device__
#define __forceinline__ inline
namespace ml { typedef long long i64; typedef unsigned int u32; }
"""

HOST_MAIN = r"""
#include "megaloop/math.cuh"
extern "C" void run_i64(int op, const long long* a, const long long* b, long long* out, int n) {
    for (int i = 0; i < n; ++i)
        out[i] = op == 0 ? ml::floor_divide(a[i], b[i]) : op == 1 ? ml::remainder(a[i], b[i]) : ml::power(a[i], b[i]);
}
extern "C" void run_f32(int op, const float* a, const float* b, float* out, int n) {
    for (int i = 0; i < n; ++i)
        out[i] = op == 0 ? ml::floor_divide(a[i], b[i]) : op == 1 ? ml::remainder(a[i], b[i]) : ml::power(a[i], b[i]);
}
"""


@pytest.fixture(scope="module")
def host_math(tmp_path_factory) -> ctypes.CDLL:
    headers = {"types.cuh": HOST_TYPES, "math.cuh": (INCLUDE / "math.cuh").read_text()}
    dll = host_library(tmp_path_factory.mktemp("math"), headers, HOST_MAIN, "-ffp-contract=off")
    for fn in (dll.run_i64, dll.run_f32):
        fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    return dll


@pytest.mark.parametrize("dtype", ["int32", "int64", "float32"])
@pytest.mark.parametrize("op, name", [(0, "floor_divide"), (1, "remainder"), (2, "pow")])
def test_the_device_functions_give_numpys_values(host_math, op: int, name: str, dtype: str) -> None:
    """math.cuh on the CPU: int32 operands are computed as the kernel does (in 64 bits, the store
    keeping the low 32), floats in float32."""
    if name == "pow" and dtype == "float32":
        pytest.skip("float pow is powf, within 2 ulps (the op table's rows check it on the GPU)")
    a, b = _edges(np.dtype(dtype))
    if name == "pow":
        b = np.abs(b).clip(0, 70).astype(dtype)
    kind = "f32" if dtype == "float32" else "i64"
    wide = np.float32 if kind == "f32" else np.int64
    a64, b64 = np.ascontiguousarray(a, wide), np.ascontiguousarray(b, wide)
    out = np.zeros_like(a64)
    fn = getattr(host_math, f"run_{kind}")
    fn(op, a64.ctypes.data, b64.ctypes.data, out.ctypes.data, out.size)
    _same(out.astype(dtype), _numpy(name, a, b), f"math.cuh {name} {dtype}")


def test_a_negative_integer_exponent_on_the_device_is_the_truncated_quotient(host_math) -> None:
    a = np.array([1, -1, -1, 2, -3, 0], np.int64)
    b = np.array([-3, -3, -2, -1, -1, -2], np.int64)
    out = np.zeros_like(a)
    host_math.run_i64(2, a.ctypes.data, b.ctypes.data, out.ctypes.data, a.size)
    assert out.tolist() == [1, -1, 1, 0, 0, 0]


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_the_ops_compile_for_the_gpu(arch: str) -> None:
    g = ml.Graph("int-ops")
    for dtype in ("int32", "int64", "float32", "bfloat16"):
        x, y = g.input(f"a_{dtype}", (4, 33), dtype), g.input(f"b_{dtype}", (33,), dtype)
        g.output(f"fd_{dtype}", x // y)
        g.output(f"rem_{dtype}", x % 3)
        g.output(f"pow_{dtype}", x**y)
    source = generate(make_plan(g, processors=8, arch=arch.rstrip("a"))).source
    assert "ml::floor_divide(" in source and "ml::remainder(" in source and "ml::power(" in source
    assert compile_cubin(source, arch, use_cache=False)[:4] == b"\x7fELF"

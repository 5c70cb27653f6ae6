"""Zero-size axes (docs/ops.md): a graph with an empty axis (batch 0, an empty slice, K = 0) builds,
plans, runs on the reference, the fast path and the plan interpreter and gives numpy's results (empty
arrays, and numpy's values where an empty axis is reduced: sums 0, means NaN); where numpy has no
value (max, min and argmax over an empty axis) the build refuses by name. The generated kernel
compiles for sm_90a and sm_80 (an op with an empty result makes no task)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import megaloop as ml
from megaloop.codegen import generate
from megaloop.errors import ShapeError
from megaloop.plan import make_plan
from megaloop.reference.fast import evaluate_fast
from megaloop.reference.interpreter import run_plan
from megaloop.runtime.compile import compile_cubin

F32 = "float32"


def _t(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.asarray(x, np.float64) if x.dtype.kind == "f" else x)


# (name, inputs {name: (shape, dtype)}, megaloop builder, numpy/torch reference on the feeds)
CASES: list[tuple[str, dict[str, tuple], Callable[..., Any], Callable[..., Any]]] = [
    ("add-batch0", {"x": ((0, 4), F32)}, lambda x: x + 1.0, lambda x: x + 1.0),
    ("mul-broadcast", {"x": ((0, 4), "bfloat16"), "y": ((4,), "bfloat16")}, lambda x, y: x * y, lambda x, y: x * y),
    ("exp-empty-last", {"x": ((3, 0), F32)}, ml.exp, np.exp),
    (
        "where",
        {"c": ((0, 2), "bool"), "x": ((0, 2), F32)},
        lambda c, x: ml.where(c, x, 0.0),
        lambda c, x: np.where(c, x, 0.0),
    ),
    ("floor-divide-int", {"x": ((0, 3), "int64")}, lambda x: x // 3, lambda x: x // 3),
    ("sum-over-empty", {"x": ((3, 0), F32)}, lambda x: ml.sum(x, 1), lambda x: np.sum(x, 1)),
    ("sum-of-empty-rows", {"x": ((0, 3), F32)}, lambda x: ml.sum(x, 1), lambda x: np.sum(x, 1)),
    ("int-sum-over-empty", {"x": ((2, 0), "int32")}, lambda x: ml.sum(x, 1), lambda x: np.sum(x, 1).astype(np.int32)),
    ("mean-over-empty", {"x": ((3, 0), F32)}, lambda x: ml.mean(x, 1), lambda x: np.full(3, np.nan, np.float32)),
    ("max-of-empty-rows", {"x": ((0, 5), F32)}, lambda x: ml.max(x, 1), lambda x: np.max(x, 1)),
    ("argmax-of-empty-rows", {"x": ((0, 5), F32)}, lambda x: ml.argmax(x, -1), lambda x: np.argmax(x, -1)),
    ("softmax", {"x": ((0, 5), F32)}, lambda x: ml.softmax(x, -1), lambda x: x),
    ("rmsnorm", {"x": ((0, 8), F32), "w": ((8,), F32)}, ml.rmsnorm, lambda x, w: x),
    ("matmul-m0", {"a": ((0, 4), F32), "b": ((4, 3), F32)}, ml.matmul, np.matmul),
    ("matmul-k0", {"a": ((2, 0), F32), "b": ((0, 3), F32)}, ml.matmul, np.matmul),
    ("linear-n0", {"a": ((2, 4), F32), "w": ((0, 4), F32)}, ml.linear, lambda a, w: a @ w.T),
    ("reshape", {"x": ((0, 4), F32)}, lambda x: ml.reshape(x, (2, 0, 2)), lambda x: x.reshape(2, 0, 2)),
    (
        "permute",
        {"x": ((0, 4, 2), F32)},
        lambda x: ml.permute(x, (2, 0, 1)) * 2.0,
        lambda x: np.transpose(x, (2, 0, 1)) * 2,
    ),
    ("empty-slice", {"x": ((3, 4), F32)}, lambda x: x[1:1] * 2.0, lambda x: x[1:1] * 2),
    (
        "concat-with-empty",
        {"x": ((0, 4), F32), "y": ((2, 4), F32)},
        lambda x, y: ml.concat([x, y], 0),
        lambda x, y: np.concatenate([x, y], 0),
    ),
    ("embedding-no-ids", {"t": ((10, 4), F32), "i": ((0,), "int64")}, ml.embedding, lambda t, i: t[i]),
    (
        "attention-batch0",
        {n: ((0, 2, 3, 8), F32) for n in "qkv"},
        lambda q, k, v: ml.attention(q, k, v, causal=True),
        lambda q, k, v: q,
    ),
    (
        "attention-no-keys",
        {"q": ((1, 2, 3, 8), F32), "k": ((1, 2, 0, 8), F32), "v": ((1, 2, 0, 8), F32)},
        lambda q, k, v: ml.attention(q, k, v),
        lambda q, k, v: np.zeros(q.shape, np.float32),
    ),
    ("rope-batch0", {"x": ((0, 2, 3, 8), F32), "p": ((0, 1, 3), "int64")}, ml.rope, lambda x, p: x),
    (
        "cross-entropy-no-rows",
        {"x": ((0, 5), F32), "t": ((0,), "int64")},
        ml.cross_entropy,
        lambda x, t: np.float32(F.cross_entropy(_t(x), _t(t)).nan_to_num(0.0)),
    ),
]


def _graph(name: str, inputs: dict[str, tuple], build: Callable[..., Any]) -> tuple[ml.Graph, dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    g = ml.Graph(name)
    tensors, feeds = [], {}
    for n, (shape, dtype) in inputs.items():
        tensors.append(g.input(n, shape, dtype))
        dt = ml.as_dtype(dtype)
        if dt.is_float:
            feeds[n] = ml.dtypes.round_to(rng.standard_normal(shape), dt)
        elif dt.is_bool:
            feeds[n] = rng.random(shape) < 0.5
        else:
            feeds[n] = rng.integers(0, 3, shape).astype(dt.np)
    g.output("y", build(*tensors))
    return g, feeds


def _same(got: np.ndarray, want: np.ndarray, what: str) -> None:
    want = np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, numpy {want.shape}"
    assert np.array_equal(got.astype(np.float64), want.astype(np.float64), equal_nan=True), f"{what}: {got} vs {want}"


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_an_empty_axis_gives_numpys_result_everywhere(case) -> None:
    name, inputs, build, ref = case
    g, feeds = _graph(name, inputs, build)
    with np.errstate(all="ignore"):
        want = ref(*feeds.values())
    _same(ml.evaluate(g, feeds).outputs["y"], want, f"{name} reference")
    _same(evaluate_fast(g, feeds, {}, {})[0]["y"], want, f"{name} fast path")
    plan = make_plan(g, processors=4)
    _same(run_plan(plan, feeds).outputs["y"], want, f"{name} plan interpreter")


@pytest.mark.parametrize(
    "build, words",
    [
        (lambda g: ml.max(g.input("x", (3, 0), F32), 1), r"max over axes \[1\] of \[3, 0\]: an empty axis has no max"),
        (lambda g: ml.min(g.input("x", (0,), F32)), r"min over axes \[0\] of \[0\]: an empty axis has no min"),
        (lambda g: ml.argmax(g.input("x", (2, 0), F32), 1), "argmax over axis 1 of size 0"),
        (lambda g: ml.argmax(g.input("x", (0, 3), F32)), r"argmax of an empty tensor \[0, 3\]"),
    ],
)
def test_a_reduction_without_identity_over_an_empty_axis_is_refused(build, words) -> None:
    with pytest.raises(ShapeError, match=words):
        build(ml.Graph("no-identity"))


def test_reshape_cannot_infer_a_size_from_nothing() -> None:
    with pytest.raises(ShapeError, match="cannot infer -1 in"):
        ml.reshape(ml.Graph("r").input("x", (0, 4), F32), (-1, 0))


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_a_graph_with_empty_axes_compiles_for_the_gpu(arch: str) -> None:
    g = ml.Graph("empty-gpu")
    x = g.input("x", (0, 64), "bfloat16")
    w = g.input("w", (32, 64), "bfloat16")
    a = g.input("a", (4, 0), "bfloat16")
    g.output("rows", ml.rmsnorm(ml.linear(x, w), g.input("n", (32,), "bfloat16")))
    g.output("k0", ml.linear(a, g.input("b", (8, 0), "bfloat16")))  # (a constant: zeros)
    g.output("mixed", ml.concat([x[:, :32], ml.linear(g.input("z", (2, 64), "bfloat16"), w)], 0) * 2.0)
    plan = make_plan(g, processors=8, arch=arch.rstrip("a"))
    assert compile_cubin(generate(plan).source, arch, use_cache=False)[:4] == b"\x7fELF"

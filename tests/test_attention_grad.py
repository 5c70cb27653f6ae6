"""attention_grad (megaloop/frontend/ops/attention_grad.py): attention's backward with the scores
recomputed a block of keys at a time, against PyTorch autograd of the attention written out in float64
(causal, GQA, sliding window, softcap, q_positions, kv_lengths, bool and float masks, a row that sees no
key), float32 and bfloat16, on the reference, the fast CPU path and the plan interpreter; attention's
rule (ml.grad) through it; its loop-kernel code compiled with NVRTC; the loop kernel on a GPU (gpu)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

import megaloop as ml
from megaloop.codegen import generate
from megaloop.plan import make_plan
from megaloop.reference.fast import FastGraph
from megaloop.reference.interpreter import run_plan
from megaloop.runtime.compile import compile_cubin

# (name, b, hq, hkv, tq, tk, d, keywords: causal, window, softcap, q_positions, kv_lengths, mask)
CASES: list[tuple[str, int, int, int, int, int, int, dict[str, Any]]] = [
    ("causal_gqa", 2, 4, 2, 9, 9, 16, {"causal": True}),
    ("window_softcap", 1, 2, 1, 12, 12, 8, {"causal": True, "window": 4, "softcap": 5.0}),
    ("prefix_lengths_float_mask", 2, 2, 2, 5, 11, 8, {"kv_lengths": [11, 0], "mask": "float"}),
    (
        "positions_bool_mask",
        2,
        3,
        1,
        4,
        10,
        8,
        {"causal": True, "q_positions": [[2, 5, 6, 9], [0, 1, 7, 8]], "mask": "bool"},
    ),
]
ULPS = 16  # of the gradient's largest magnitude, times sqrt(kv_len): sums of products over the keys


def _inputs(case: tuple, dtype: str, seed: int) -> dict[str, np.ndarray]:
    _, b, hq, hkv, tq, tk, d, kw = case
    rng = np.random.default_rng(seed)
    dt = ml.as_dtype(dtype)
    arrays = {
        "q": rng.standard_normal((b, hq, tq, d)),
        "k": rng.standard_normal((b, hkv, tk, d)),
        "v": rng.standard_normal((b, hkv, tk, d)),
        "do": rng.standard_normal((b, hq, tq, d)),
    }
    arrays = {n: ml.dtypes.round_to(a, dt) for n, a in arrays.items()}
    if kw.get("mask") == "bool":
        arrays["mask"] = rng.random((b, 1, tq, tk)) > 0.3
    elif kw.get("mask") == "float":
        arrays["mask"] = ml.dtypes.round_to(rng.standard_normal((1, hq, tq, tk)), dt)
        arrays["mask"][0, 0, 0, :3] = -np.inf
    return arrays


def _graph(case: tuple, dtype: str, arrays: dict[str, np.ndarray], g: ml.Graph | None = None, at: str = "") -> ml.Graph:
    """The case's attention_grad on inputs q, k, v, do (and mask), outputs dq, dk, dv (names after ``at``)."""
    kw = case[-1]
    g = g or ml.Graph(case[0])
    q, k, v, do = (g.input(at + n, arrays[n].shape, dtype) for n in ("q", "k", "v", "do"))
    opts: dict[str, Any] = {key: kw[key] for key in ("causal", "window", "softcap") if key in kw}
    if "q_positions" in kw:
        opts["q_positions"] = g.constant(np.array(kw["q_positions"], np.int64), "int64")
    if "kv_lengths" in kw:
        opts["kv_lengths"] = g.constant(np.array(kw["kv_lengths"], np.int64), "int64")
    if "mask" in arrays:
        opts["mask"] = g.input(at + "mask", arrays["mask"].shape, "bool" if arrays["mask"].dtype == bool else dtype)
    dq, dk, dv = ml.attention_grad(q, k, v, do, **opts)
    for n, t in (("dq", dq), ("dk", dk), ("dv", dv)):
        g.output(at + n, t)
    return g


def torch_gradients(case: tuple, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """softmax(softcap(q k^T / sqrt(d)) + mask) v in float64 with torch, its mask built here from the
    case's rule (bottom-right causal alignment), differentiated by autograd."""
    _, b, hq, hkv, tq, tk, d, kw = case
    t = {n: torch.tensor(np.asarray(arrays[n], np.float64), requires_grad=n in "qkv") for n in ("q", "k", "v")}
    k, v = (t[n].repeat_interleave(hq // hkv, dim=1) for n in ("k", "v"))
    s = t["q"] @ k.transpose(-1, -2) / math.sqrt(d)
    if "softcap" in kw:
        s = kw["softcap"] * torch.tanh(s / kw["softcap"])
    lengths = torch.tensor(kw.get("kv_lengths", [tk] * b)).view(b, 1, 1, 1)
    j = torch.arange(tk).view(1, 1, 1, tk)
    seen = j < lengths
    if kw.get("causal"):
        rows = torch.arange(tq).view(1, 1, tq, 1)
        pos = torch.tensor(kw["q_positions"]).view(b, 1, tq, 1) if "q_positions" in kw else lengths - tq + rows
        seen = seen & (j <= pos)
        if "window" in kw:
            seen = seen & (j > pos - kw["window"])
    if "mask" in arrays and arrays["mask"].dtype == bool:
        seen = seen & torch.tensor(arrays["mask"])
    elif "mask" in arrays:
        s = s + torch.tensor(np.asarray(arrays["mask"], np.float64))
    s = s.masked_fill(~seen, -math.inf)
    p = torch.softmax(s, -1).nan_to_num(0.0)  # a row that sees no key: zeros
    out = p @ v
    out.backward(torch.tensor(np.asarray(arrays["do"], np.float64)))
    return {f"d{n}": t[n].grad.numpy() for n in ("q", "k", "v")}


def check(got: dict[str, np.ndarray], want: dict[str, np.ndarray], dtype: str, tk: int, what: str) -> None:
    eps = ml.as_dtype(dtype).eps
    for n, w in want.items():
        g = np.asarray(got[n], np.float64)
        worst = float(np.max(np.abs(g - w)))
        allowed = ULPS * eps * max(float(np.max(np.abs(w))), 1.0) * math.sqrt(tk)
        print(f"{what} {n}: worst {worst:.3g}, allowed {allowed:.3g}")
        assert worst <= allowed, f"{what} {n}: worst mismatch {worst:.3g} > {allowed:.3g}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_gradients_match_torch_autograd(case: tuple, dtype: str) -> None:
    arrays = _inputs(case, dtype, seed=len(case[0]))
    g = _graph(case, dtype, arrays)
    want = torch_gradients(case, arrays)
    check(ml.evaluate(g, arrays).outputs, want, dtype, case[5], "reference")
    fast = FastGraph(g, {})
    check(fast.run(arrays), want, dtype, case[5], "fast")
    check(run_plan(make_plan(g, processors=5), arrays, {}, seed=1).outputs, want, dtype, case[5], "interpreter")


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_loop_kernel_code_compiles(arch: str) -> None:
    """Every case's three parts in one loop kernel (bfloat16; float32 for the float mask's case)."""
    g = ml.Graph("grads")
    for n, case in enumerate(CASES):
        dtype = "float32" if case[-1].get("mask") == "float" else "bfloat16"
        _graph(case, dtype, _inputs(case, dtype, seed=n), g, f"c{n}.")
    src = generate(make_plan(g, processors=8)).source
    for part in ("rows", "dq", "dkv"):
        assert f"ml::attention_grad_{part}<ml::AttnShape<" in src
    assert compile_cubin(src, arch, use_cache=False)[:4] == b"\x7fELF"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_loop_kernel_matches_torch_autograd(case: tuple, dtype: str) -> None:
    """The three parts' tiles in the loop kernel on a GPU, against torch autograd (skips without one)."""
    from megaloop.runtime.device import gpus
    from megaloop.runtime.loop import LoopKernel

    if not gpus()[0]:
        pytest.skip("no GPU: " + gpus()[1])
    arrays = _inputs(case, dtype, seed=len(case[0]))
    g = _graph(case, dtype, arrays)
    with LoopKernel(make_plan(g, processors=16), {}) as kernel:
        got = kernel.run(arrays)
    check(got, torch_gradients(case, arrays), dtype, case[5], "loop kernel")


def test_attention_rule_uses_the_op_and_stores_no_scores() -> None:
    """ml.grad of an attention: attention_grad's three parts, no tensor as large as the scores."""
    b, hq, hkv, t, d = 1, 4, 2, 32, 8
    g = ml.Graph("rule")
    q = g.parameter("q", (b, hq, t, d), "float32")
    k, v = (g.parameter(n, (b, hkv, t, d), "float32") for n in ("k", "v"))
    loss = ml.sum(ml.attention(q, k, v, causal=True, window=8) * g.input("c", (b, hq, t, d), "float32"))
    grads = ml.grad(g, loss, [q, k, v])
    parts = [n.attrs["part"] for n in g.nodes if n.op.name == "attention_grad"]
    assert sorted(parts) == ["dkv", "dq", "rows"]
    largest = max(o.size for n in g.nodes for o in n.outputs)
    assert largest < b * hq * t * t, f"a tensor of {largest} elements: the scores are {b * hq * t * t}"
    assert all(x.shape == y.shape for x, y in zip(grads, (q, k, v)))


def test_only_the_parts_asked_for_are_built() -> None:
    g = ml.Graph("wrt")
    q, k, v, do = (g.input(n, (1, 2, 4, 8), "float32") for n in ("q", "k", "v", "do"))
    dq, dk, dv = ml.attention_grad(q, k, v, do, causal=True, wrt="q")
    assert dk is None and dv is None and dq.shape == q.shape
    assert sorted(n.attrs["part"] for n in g.nodes if n.op.name == "attention_grad") == ["dq", "rows"]
    assert ml.attention_grad(q, k, v, do, wrt="v")[0] is None
    with pytest.raises(ml.errors.GraphBuildError, match="wrt must name some of q, k and v"):
        ml.attention_grad(q, k, v, do, wrt="x")
    with pytest.raises(ml.errors.ShapeError, match="do must be a float cotangent"):
        ml.attention_grad(q, k, v, g.input("bad", (1, 2, 3, 8), "float32"))

"""Shared test helpers: random inputs rounded through the device dtype, torch conversion, and the
tolerance check that every numeric test uses (it prints the worst element on failure)."""

from __future__ import annotations

import ctypes
import math
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

import megaloop as ml
from megaloop.frontend.opdef import Accuracy

F32_EPS = float(np.finfo(np.float32).eps)

TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}


def random_values(
    rng: np.random.Generator, shape: tuple[int, ...], dtype: ml.DType, domain: object = "normal"
) -> np.ndarray:
    """Values of ``dtype`` (already rounded to it) drawn from ``domain``:
    "normal", "positive" (0.1..3), "ties" (small integers, to create equal elements), "unit" (-1..1),
    "bool", ("int", lo, hi), ("choice", v0, v1, ...): each element one of the values, or ("distinct", n):
    each last-axis row distinct ints below n."""
    if domain == "bool" or dtype.is_bool:
        return rng.random(shape) < 0.5
    if isinstance(domain, tuple) and domain[0] == "choice":
        return ml.dtypes.round_to(rng.choice(np.array(domain[1:], np.float64), shape), dtype)
    if isinstance(domain, tuple) and domain[0] == "distinct":  # rows of distinct ints < domain[1]
        rows = [rng.permutation(domain[1])[: shape[-1]] for _ in range(int(np.prod(shape[:-1])))]
        return np.array(rows).reshape(shape).astype(dtype.np)
    if isinstance(domain, tuple) and domain[0] == "int":
        return rng.integers(domain[1], domain[2], shape).astype(dtype.np)
    if dtype.is_int:
        return rng.integers(-50, 50, shape).astype(dtype.np)
    if domain == "positive":
        x = rng.uniform(0.1, 3.0, shape)
    elif domain == "ties":
        x = rng.integers(-3, 4, shape).astype(np.float64)
    elif domain == "unit":
        x = rng.uniform(-1.0, 1.0, shape)
    else:
        x = rng.standard_normal(shape)
    return ml.dtypes.round_to(x, dtype)


def to_torch64(a: np.ndarray) -> torch.Tensor:
    """An exact float64 (or int64/bool) torch copy of a megaloop-dtype array."""
    if a.dtype.kind == "b":
        return torch.from_numpy(np.array(a, order="C", copy=True))
    if a.dtype.kind in "iu":
        return torch.from_numpy(np.array(a, dtype=np.int64, order="C"))
    return torch.from_numpy(np.array(a, dtype=np.float64, order="C"))


def to_f64(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float64) if a.dtype.kind not in "b" else a


def tolerance(
    ref: np.ndarray, dtype: ml.DType, accuracy: Accuracy, reduce_len: int = 1, scale: float | None = None
) -> np.ndarray:
    """Allowed |out - ref| per element: ``ulps`` of the output dtype relative to |ref| (at least 1 ulp
    for inexact ops, covering a float32 result that rounds to the neighbouring 16-bit value), plus
    float32 accumulation error over ``reduce_len`` terms relative to ``scale``, the magnitude of the
    terms being accumulated (default: the output's largest magnitude; pass e.g. sum(|x|) for a sum,
    whose result can cancel to far below its terms)."""
    eps = dtype.eps
    if scale is None:
        finite = np.abs(ref[np.isfinite(ref)])
        scale = float(finite.max()) if finite.size else 0.0
    ulps = max(accuracy.ulps, 1.0)
    acc_terms = math.sqrt(reduce_len) if accuracy.per_reduction else 1.0
    return ulps * eps * np.abs(ref) + 2 * ulps * F32_EPS * acc_terms * scale + float(np.finfo(np.float32).tiny)


def assert_close(
    out: np.ndarray,
    ref: np.ndarray,
    dtype: ml.DType,
    accuracy: Accuracy,
    reduce_len: int = 1,
    what: str = "",
    scale: float | None = None,
    atol: float = 0.0,
) -> None:
    """Assert ``out`` (a megaloop result) matches the float64 ``ref`` within the op's accuracy contract
    (plus ``atol``: e.g. partial results rounded before they are summed); exact ops (ulps == 0) and
    non-float results must match exactly. NaN must sit where ref has NaN."""
    assert out.shape == tuple(ref.shape), f"{what}: shape {out.shape} != reference {tuple(ref.shape)}"
    o = to_f64(np.asarray(out))
    r = to_f64(np.asarray(ref))
    if not dtype.is_float or accuracy.ulps == 0.0:
        if o.dtype.kind == "f":
            same = (o == r) | (np.isnan(o) & np.isnan(r))
        else:
            same = o == r
        if not np.all(same):
            idx = tuple(int(i) for i in np.argwhere(~same)[0])
            raise AssertionError(
                f"{what}: {np.count_nonzero(~same)} of {o.size} elements differ; first at {idx}: "
                f"got {o[idx]!r}, expected {r[idx]!r}"
            )
        return
    nan_o, nan_r = np.isnan(o), np.isnan(r)
    if np.any(nan_o != nan_r):
        idx = tuple(int(i) for i in np.argwhere(nan_o != nan_r)[0])
        raise AssertionError(f"{what}: NaN mismatch at {idx}: got {o[idx]!r}, expected {r[idx]!r}")
    inf_mismatch = (np.isinf(o) | np.isinf(r)) & (o != r)
    if np.any(inf_mismatch):
        idx = tuple(int(i) for i in np.argwhere(inf_mismatch)[0])
        raise AssertionError(f"{what}: infinity mismatch at {idx}: got {o[idx]!r}, expected {r[idx]!r}")
    ok = ~(nan_o | np.isinf(r))
    err = np.abs(np.where(ok, o, 0.0) - np.where(ok, r, 0.0))  # matching infinities compare as 0, no inf - inf
    tol = tolerance(np.where(ok, r, 0.0), dtype, accuracy, reduce_len, scale) + atol
    ratio = err / tol
    worst = np.unravel_index(int(np.argmax(ratio)), ratio.shape) if ratio.size else ()
    if ratio.size and ratio[worst] > 1.0:
        raise AssertionError(
            f"{what}: {np.count_nonzero(ratio > 1)} of {o.size} elements out of tolerance; worst at "
            f"{tuple(int(i) for i in worst)}: got {o[worst]!r}, expected {r[worst]!r}, error {err[worst]:.3e} > "
            f"tolerance {tol[worst]:.3e} ({dtype.name}, {accuracy}, reduce_len={reduce_len})"
        )


def worst_error_text(out: np.ndarray, ref: np.ndarray) -> str:
    o, r = to_f64(out), to_f64(ref)
    err = np.abs(o - r)
    i = np.unravel_index(int(np.argmax(err)), err.shape)
    return f"max |err| {err[i]:.3e} at {tuple(int(k) for k in i)} (got {o[i]:.6g}, ref {r[i]:.6g})"


def tp_mlp(world: int, tokens: int, hidden: int, ffn: int, scale: float, seed: int) -> tuple[list, np.ndarray, list]:
    """A tensor-parallel MLP on ``world`` ranks, from the partitioner (ml.parallelize of the single-device
    MLP: both weights cut, one all-reduce), with its input and each rank's weights: (graphs, x, params
    per rank)."""
    g = ml.Graph("mlp")
    x = g.input("x", (tokens, hidden), ml.bfloat16)
    w1 = g.parameter("w1", (ffn, hidden), ml.bfloat16)
    w2 = g.parameter("w2", (hidden, ffn), ml.bfloat16)
    g.output("y", ml.linear(ml.silu(ml.linear(x, w1)), w2))
    split = ml.parallelize(g, world, "tp")
    first = split.graphs[0]
    assert all(t.size * world == ffn * hidden for t in first.parameters.values()), "a weight is not cut"
    assert [n.op.name for n in first.nodes if n.op.kind == "collective"] == ["all_reduce"], "not one all-reduce"
    rng = np.random.default_rng(seed)
    x0 = rng.standard_normal((tokens, hidden))
    full = {"w1": rng.standard_normal((ffn, hidden)) * scale, "w2": rng.standard_normal((hidden, ffn)) * scale}
    return split.graphs, x0, split.shard_parameters(full)


def sass(cubin: bytes) -> str:
    """The machine code of a cubin, as nvdisasm prints it (the nvidia-cuda-nvdisasm wheel, a test
    dependency: no GPU needed), for tests that check what ptxas made of generated code."""
    import os
    import subprocess
    import tempfile

    import nvidia

    tools = [os.path.join(p, "cu13", "bin", "nvdisasm") for p in nvidia.__path__]
    tool = next((t for t in tools if os.access(t, os.X_OK)), None)
    assert tool, f"nvdisasm not found in {tools}: pip install nvidia-cuda-nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-c", f.name], check=True, capture_output=True, text=True).stdout


def decode_layer_case(sequences: int, positions=None) -> tuple[ml.Graph, dict, dict]:
    """bench/llama_layer.py's hidden-2048 decode layer for ``sequences`` sequences: (graph, parameters,
    feeds), fresh random hidden states (seeded by the count) at position CONTEXT unless ``positions``."""
    from bench.llama_layer import CONTEXT, layer_config
    from megaloop.models import build_llama, random_parameters

    cfg = layer_config(2048, 1)
    rng = np.random.default_rng(sequences)
    feeds = {
        "hidden": rng.standard_normal((sequences, 1, 2048)).astype(np.float32),
        "positions": np.full((sequences, 1), CONTEXT) if positions is None else np.asarray(positions),
    }
    return build_llama(cfg, sequences, 1), random_parameters(cfg, seed=0), feeds


def save_tiny_transformers_llama(folder, vocab: int):
    """A random float32 LlamaForCausalLM (seed 0; 2 layers, hidden 32, 4 heads over 2 KV heads, untied)
    saved by transformers into ``folder``: the training tests' checkpoint."""
    import torch
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    cfg = HFConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, rms_norm_eps=1e-5,
    )  # fmt: skip
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(folder)
    return folder


def assert_generator_matches_reference(loop_kernel, **plan_args) -> None:
    """12 greedy steps of a float32 Llama generator on the loop kernel (``loop_kernel(plan, params,
    state)``, the plan made with ``plan_args``): the numpy reference's tokens, and its states within
    float32's tolerance."""
    from megaloop.models import LlamaConfig, random_parameters
    from megaloop.models.llama import build_llama_generator
    from megaloop.plan import make_plan

    cfg = LlamaConfig(hidden=128, heads=4, kv_heads=2, intermediate=256, layers=2, max_seq=64, vocab=300)
    params = random_parameters(cfg, seed=6)
    state = {"token": np.array([[5]]), "position": np.array([[0]])}
    g = build_llama_generator(cfg, 1, kv_splits=3)
    want = ml.evaluate(g, {}, params, state, iterations=12)
    with loop_kernel(make_plan(g, processors=132, **plan_args), params, state) as k:
        k.run(iterations=12)
        got = k.state()
    assert got["token"].tolist() == want.state["token"].tolist()
    for n, w in want.state.items():
        if w.dtype.kind == "f":
            assert np.abs(got[n] - w).max() <= 1e-4 * max(1.0, np.abs(w).max()), f"state {n}"


def assert_watchdog_names_the_stuck_wait(options=None) -> None:
    """A tiny Llama step on the loop kernel (``options``: its KernelOptions) whose first wait has a target
    no counter reaches: the watchdog names it within 0.5 s, and the next kernel runs normally."""
    import pytest

    from megaloop.codegen import generate
    from megaloop.models import LlamaConfig, build_llama, random_parameters
    from megaloop.plan import make_plan
    from megaloop.runtime.loop import LoopKernel, LoopKernelError

    cfg = LlamaConfig(hidden=64, heads=4, kv_heads=2, intermediate=96, layers=1, max_seq=8, vocab=50)
    plan = make_plan(build_llama(cfg, 1, 1), processors=16, options=options)
    params = random_parameters(cfg)
    program = generate(plan)
    first = int(np.flatnonzero(program.waits["lag"] == 0)[0])
    program.waits["per_iteration"][first] = 1_000_000  # a target no counter will reach
    feeds = {"tokens": [[3]], "positions": [[0]]}
    stuck = r"watchdog: rank 0 processor \d+ waited more than 0.5 s .* counter \d+ \(done"
    with pytest.raises(LoopKernelError, match=stuck):
        with LoopKernel(plan, params, timeout_s=0.5, program=program) as k:
            k.run(feeds)
    with LoopKernel(plan, params) as k:  # and the next kernel runs normally
        out = k.run(feeds)
    assert np.isfinite(out["logits"].astype(np.float32)).all()


def host_library(root: Path, headers: dict[str, str], main: str, *flags: str) -> ctypes.CDLL:
    """``main`` (C++ with ``extern "C"`` entries) built by g++ into a shared library over ``headers``
    (name -> text, placed as megaloop/<name>): device code run on the CPU. Skips without g++."""
    if shutil.which("g++") is None:
        pytest.skip("needs a host C++ compiler (g++)")
    (root / "megaloop").mkdir(parents=True, exist_ok=True)
    for name, text in headers.items():
        (root / "megaloop" / name).write_text(text)
    (root / "main.cpp").write_text(main)
    lib = root / "host.so"
    cmd = ["g++", "-std=c++17", "-O1", *flags, "-shared", "-fPIC", "-I", str(root), "-o", str(lib)]
    subprocess.run([*cmd, str(root / "main.cpp")], check=True, capture_output=True)
    return ctypes.CDLL(str(lib))

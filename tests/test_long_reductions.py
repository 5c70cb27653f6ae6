"""Reductions over long contiguous runs (the argmax over a Llama vocabulary of logits, sums over long
rows) take the whole block per output element (ml::reduce_block, megaloop/reduce.cuh) instead of a
warp: which path each case takes, that the kernel compiles without spills, and (GPU) that every case
matches numpy in float64, argmax ties and NaNs included. The same graph runs on the CPU reference."""

from __future__ import annotations

import numpy as np
import pytest

import megaloop as ml
from megaloop.codegen import generate
from megaloop.codegen.emit_reduce import BLOCK_REDUCTION_MIN
from megaloop.plan import make_plan
from megaloop.runtime.compile import spills
from megaloop.runtime.device import gpus
from tests.helpers import assert_close

# name: (op, dtype, shape, axis): every op, every dtype kind, rows long enough for the block path, odd
# lengths (rows that start off a 16-byte boundary and a tail past the last whole pack), several axes
CASES = {
    "vocab_argmax": ("argmax", "bfloat16", (1, 128256), -1),  # a Llama-3.2 step's logits
    "odd_argmax": ("argmax", "float32", (3, 40001), -1),  # rows 1 and 2 start unaligned
    "int_argmax": ("argmax", "int32", (2, 33333), 1),
    "long_sum": ("sum", "bfloat16", (2, 50000), -1),
    "two_axis_mean": ("mean", "float32", (2, 100, 120), (1, 2)),
    "half_max": ("max", "float16", (4, 9000), -1),
    "int_min": ("min", "int32", (2, 20000), -1),
    "int_sum": ("sum", "int64", (2, 16384), -1),
    "wrapping_sum": ("sum", "int32", (2, 24000), -1),  # past int32's range: wraps, as the reference
    "scalar_argmax": ("argmax", "float32", (), None),  # nothing reduced: a warp, the one element
    "no_axis_sum": ("sum", "float32", (3, 4), ()),
    "all_sum": ("sum", "float32", (300, 100), None),  # every axis: a 0-d result
    "all_argmax": ("argmax", "bfloat16", (40, 1000), None),  # the index into the flattened tensor
    "column_sum": ("sum", "float32", (20000, 3), 0),  # not a contiguous run: a warp an output element
    "short_max": ("max", "float32", (64, 500), -1),  # too short: a warp an output element
}
BLOCK_PATH = {
    "vocab_argmax",
    "odd_argmax",
    "int_argmax",
    "long_sum",
    "two_axis_mean",
    "half_max",
    "int_min",
    "int_sum",
    "wrapping_sum",
    "all_sum",
    "all_argmax",
}


# several output elements a task on the block path (the loop over them, its barrier between elements)
TILES = {"max": {"elements": 1 << 16}}


def long_reductions_graph() -> ml.Graph:
    g = ml.Graph("long-reductions")
    for name, (op, dtype, shape, axis) in CASES.items():
        x = g.input(f"{name}_x", shape, dtype)
        g.output(name, getattr(ml, op)(x, axis=axis) if op == "argmax" else getattr(ml, op)(x, axis))
    return g


def reduced_count(name: str) -> int:
    _, _, shape, axis = CASES[name]
    return int(np.prod([shape[a] for a in (range(len(shape)) if axis is None else np.atleast_1d(axis).astype(int))]))


def feeds_for(g: ml.Graph, seed: int) -> dict[str, np.ndarray]:
    """Fresh random values, with what the argmax must get right planted: the vocabulary's largest
    value twice (the first index wins), a NaN in one row of the odd argmax (its index wins) and a
    row of equal integers (index 0)."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for name, t in g.inputs.items():
        if name.startswith("wrapping"):
            feeds[name] = rng.integers(2**29, 2**30, t.shape).astype(t.dtype.name)
        elif t.dtype.is_int:
            feeds[name] = rng.integers(-1000, 1000, t.shape).astype(t.dtype.name)
        else:
            feeds[name] = ml.dtypes.round_to(rng.standard_normal(t.shape) * 4, t.dtype)
    v = feeds["vocab_argmax_x"]
    first, second = sorted(rng.choice(v.shape[1], 2, replace=False))
    v[0, first] = v[0, second] = v.max() + 1
    feeds["odd_argmax_x"][2, 12345] = np.nan
    feeds["int_argmax_x"][1] = 7
    return feeds


def numpy_result(name: str, x: np.ndarray) -> np.ndarray:
    op, _, _, axis = CASES[name]
    x64 = x.astype(np.float64) if x.dtype.kind == "f" or x.dtype.name == "bfloat16" else x.astype(np.int64)
    if op == "argmax":
        return np.asarray(np.argmax(x64, axis=axis))
    out = getattr(np, op)(x64, axis=axis)
    return out.astype(x.dtype) if x.dtype.kind == "i" else out  # integer sums wrap to the input's type


def check(got: dict[str, np.ndarray], feeds: dict[str, np.ndarray], where: str) -> None:
    for name, (op, dtype, _, _) in CASES.items():
        x = feeds[f"{name}_x"]
        want = numpy_result(name, x)
        reduced = reduced_count(name)
        dt = ml.int64 if op == "argmax" else ml.as_dtype(dtype)
        assert_close(got[name], want, dt, ml.REGISTRY[op].accuracy, reduced, f"{name} ({where})")
    assert got["vocab_argmax"][0] == np.argmax(feeds["vocab_argmax_x"][0])  # the first of the two
    assert got["odd_argmax"][2] == 12345 and got["int_argmax"][1] == 0


def test_long_contiguous_reductions_take_the_block_and_compile_without_spills() -> None:
    plan = make_plan(long_reductions_graph(), processors=132, tiles=TILES)
    rp = plan.ranks[0]
    (half_max,) = [op.id for op in rp.ops if op.op == "max" and rp.tensors[op.inputs[0]].shape == (4, 9000)]
    assert max(t.writes[0].box.size for t in rp.tasks if t.op == half_max) > 1  # several elements a task
    src = generate(plan).source
    blocks = {name for name in CASES if "the whole block on each output element" in _function_of(src, name)}
    assert blocks == BLOCK_PATH
    assert all(reduced_count(name) >= BLOCK_REDUCTION_MIN for name in blocks)  # long enough
    assert spills(src) == {}


def _function_of(src: str, name: str) -> str:
    """The tile function of case ``name``: the one whose comment names its input's shape (unique here)."""
    shape = "[" + ",".join(map(str, CASES[name][2])) + "]"
    found = [
        c for c in src.split("\n// sig_")[1:] if "<- " in c.split("\n", 1)[0] and c.split("\n", 1)[0].endswith(shape)
    ]
    assert len(found) == 1, f"{name}: {len(found)} tile functions read {shape}"
    return found[0]


def test_the_cpu_reference_runs_the_same_graph() -> None:
    g = long_reductions_graph()
    feeds = feeds_for(g, 1)
    check(ml.evaluate(g, feeds).outputs, feeds, "CPU reference")


@pytest.mark.gpu
@pytest.mark.skipif(not gpus()[0], reason="no GPU: " + gpus()[1])
def test_long_reductions_match_numpy_on_the_gpu() -> None:
    from megaloop.runtime.loop import LoopKernel

    g = long_reductions_graph()
    with LoopKernel(make_plan(g, processors=132, tiles=TILES)) as k:
        for seed in (2, 3):  # fresh values each run (the first run cannot leave the right answer behind)
            feeds = feeds_for(g, seed)
            check(k.run(feeds), feeds, f"GPU, seed {seed}")

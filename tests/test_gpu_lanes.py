"""The decode attention tile of lanes over keys (KernelOptions.decode_attention = 1) on the loop kernel
(skipped without a GPU). attention_partial with its combine against the numpy reference for decode
shapes (GQA 4 and 1, head_dim 64 and 128, several key ranges, positions at a range's boundary and at
the last slot, bf16 and f32), three runs bit for bit alike; attention over all keys (lengths, a
window); a Llama generator for 100 iterations in one run against the same without the option, bit
for bit alike in two runs, and 12 steps against the reference. The CPU side:
tests/test_attention_lanes.py."""

from __future__ import annotations

import numpy as np
import pytest

import megaloop as ml
from megaloop.codegen import generate
from megaloop.frontend.ops.attention import ATTENTION
from megaloop.frontend.ops.attention_split import ATTENTION_PARTIAL
from megaloop.models import LlamaConfig, random_parameters
from megaloop.models.llama import build_llama_generator
from megaloop.plan import KernelOptions, make_plan
from megaloop.runtime.device import gpus
from tests.helpers import assert_close, assert_generator_matches_reference
from tests.test_attention_append import _append_graph, rounded

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpus()[0], reason="no GPU: " + gpus()[1])]
LANES = KernelOptions(decode_attention=1)


def loop_kernel(plan, params=None, state=None):
    from megaloop.runtime.loop import LoopKernel

    return LoopKernel(plan, params, state)


@pytest.mark.parametrize(
    "dtype, hq, hkv, d, tk, splits, positions",
    [
        ("bfloat16", 8, 2, 64, 100, 4, [0, 25, 99]),  # ranges of 25: 0, a boundary, the last slot
        ("float32", 8, 2, 64, 90, 3, [29, 31, 89]),
        ("bfloat16", 4, 4, 128, 256, 4, [5, 130, 255]),  # group 1, head 128
        ("float32", 8, 2, 128, 300, 2, [150, 151, 299]),  # ranges of 150: stages of 32 keys
        ("bfloat16", 32, 8, 64, 256, 4, [7, 64, 200]),  # Llama-3.2-1B's shape
    ],
)
def test_the_op_against_the_reference(dtype, hq, hkv, d, tk, splits, positions) -> None:
    dt = ml.as_dtype(dtype)
    b = len(positions)
    g = _append_graph(dt, b, hq, hkv, tk, splits, d, {}, None)
    rng = np.random.default_rng(d + tk)
    feeds = {n: rounded(rng.standard_normal(t.shape), dt) for n, t in g.inputs.items() if n != "pos"}
    feeds["pos"] = np.array(positions, np.int64).reshape(b, 1)
    want = ml.evaluate(g, feeds).outputs["out"]
    plan = make_plan(g, processors=132, options=LANES)
    assert "ml::Lanes<" in generate(plan).source
    with loop_kernel(plan) as k:
        first = None
        for run in range(3):
            got = k.run(feeds)["out"]
            what = f"lanes [{dtype}, {hq}/{hkv} heads, d {d}, {splits} ranges of {tk} keys] run {run}"
            assert_close(got, want.astype(np.float64), dt, ATTENTION_PARTIAL.accuracy, tk + d, what)
            first = got if first is None else first
            assert got.tobytes() == first.tobytes(), f"{what}: not the bits of run 0"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_attention_over_all_keys(dtype) -> None:
    """A decode step's attention without key ranges (lengths, a window): stages of the keys in turn."""
    dt = ml.as_dtype(dtype)
    g = ml.Graph("whole")
    q = g.input("q", (2, 8, 1, 128), dt)
    k, v = g.input("k", (2, 2, 333, 128), dt), g.input("v", (2, 2, 333, 128), dt)
    pos, lens = g.input("pos", (2, 1), "int64"), g.input("lens", (2,), "int64")
    g.output("out", ml.attention(q, k, v, causal=True, q_positions=pos, kv_lengths=lens, window=200))
    rng = np.random.default_rng(3)
    feeds = {n: rounded(rng.standard_normal(t.shape), dt) for n, t in g.inputs.items() if n not in ("pos", "lens")}
    feeds["pos"], feeds["lens"] = np.array([[300], [40]]), np.array([333, 41])
    want = ml.evaluate(g, feeds).outputs["out"]
    plan = make_plan(g, processors=132, options=LANES)
    assert "ml::Lanes<" in generate(plan).source
    with loop_kernel(plan) as kern:
        got = kern.run(feeds)["out"]
    assert_close(got, want.astype(np.float64), dt, ATTENTION.accuracy, 333, f"attention [{dtype}]")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_hundred_decode_steps_in_one_run(dtype) -> None:
    """A GQA Llama generator (kv_splits 4 over 120 slots: ranges of 30) for 100 iterations in one run,
    with the option and without it (split keys): float32 tokens equal and caches within float32's
    tolerance (the tiles sum in other orders), bf16 the first steps' caches; two runs with the option
    bit for bit alike."""
    cfg = LlamaConfig(hidden=256, heads=8, kv_heads=2, intermediate=512, layers=2, max_seq=120, vocab=500, dtype=dtype)
    params = random_parameters(cfg, seed=5)
    state = {"token": np.array([[3], [7]]), "position": np.array([[0], [10]])}
    g = build_llama_generator(cfg, 2, kv_splits=4)
    runs = []
    for options in (LANES, LANES, KernelOptions()):
        with loop_kernel(make_plan(g, processors=132, options=options), params, state) as k:
            k.run(iterations=100)
            runs.append(k.state())
    got, again, plain = runs
    assert int(got["position"][0, 0]) == 100
    for n in got:
        assert got[n].tobytes() == again[n].tobytes(), f"state {n}: two runs with the option differ"
    caches = [n for n in plain if "cache" in n]
    if dtype == "float32":
        assert got["token"].tolist() == plain["token"].tolist()
        for n in caches:
            assert np.abs(got[n] - plain[n]).max() <= 1e-4 * max(1.0, np.abs(plain[n]).max()), f"state {n}"
    else:
        for n in caches:
            a, b = got[n][:, :, :4].astype(np.float32), plain[n][:, :, :4].astype(np.float32)
            assert np.abs(a - b).max() <= 0.05 * max(1.0, np.abs(b).max()), f"{n}: first steps differ"


def test_the_generator_with_the_option_equals_the_reference() -> None:
    """12 greedy steps of a float32 generator on the loop kernel with the option: the numpy reference's
    tokens and caches within float32's tolerance."""
    assert_generator_matches_reference(loop_kernel, options=LANES)

"""attention_merged on the loop kernel (skipped without a GPU): the key-range tiles whose last arrival
merges them. The op against the unfused graph's numpy reference for decode shapes (GQA, several key
ranges, lengths that are not multiples of the range, split keys and a warp a row, bf16 and f32); 100
iterations in one run with the arrival words reused (a decode step whose caches carry on), against
the reference iterated as often; the Llama generator with the rule equal to the one without it. The
CPU side: tests/test_attention_merged.py."""

from __future__ import annotations

import numpy as np
import pytest

import megaloop as ml
from megaloop.frontend.ops.attention_merged import ATTENTION_MERGED
from megaloop.models import LlamaConfig, random_parameters
from megaloop.models.llama import build_llama_generator
from megaloop.plan import make_plan
from megaloop.runtime.device import gpus
from tests.helpers import assert_close, assert_generator_matches_reference
from tests.test_attention_append import _append_graph, rounded

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpus()[0], reason="no GPU: " + gpus()[1])]
MERGE = ml.FuseOptions(on=("attention_merge",))


def loop_kernel(plan, params=None, state=None):
    from megaloop.runtime.loop import LoopKernel

    return LoopKernel(plan, params, state)


@pytest.mark.parametrize(
    "dtype, d, tk, splits, positions",
    [
        ("bfloat16", 64, 100, 4, [0, 25, 99]),  # split keys, ranges of 25: 0, a boundary, the last slot
        ("float32", 64, 90, 3, [29, 31, 89]),
        ("bfloat16", 40, 77, 5, [0, 47, 76]),  # 5 packs of 8: a warp a row; ranges of 16 (the last 13)
        ("bfloat16", 128, 256, 16, [5, 130, 255]),  # 16 ranges
    ],
)
def test_the_op_against_the_unfused_reference(dtype, d, tk, splits, positions) -> None:
    dt = ml.as_dtype(dtype)
    b, hq, hkv = 3, 8, 2
    g = _append_graph(dt, b, hq, hkv, tk, splits, d, {}, None)
    rng = np.random.default_rng(d + tk)
    feeds = {n: rounded(rng.standard_normal(t.shape), dt) for n, t in g.inputs.items() if n != "pos"}
    feeds["pos"] = np.array(positions, np.int64).reshape(b, 1)
    want = ml.evaluate(g, feeds).outputs["out"]
    plan = make_plan(g, processors=132, fusion=MERGE)
    assert any(op.op == "attention_merged" for op in plan.ranks[0].ops)
    with loop_kernel(plan) as k:
        for run in range(3):  # the arrival words of one run reused by the next
            got = k.run(feeds)["out"]
            what = f"merged [{dtype}, d {d}, {splits} ranges of {tk} keys] run {run}"
            assert_close(got, want.astype(np.float64), dt, ATTENTION_MERGED.accuracy, tk + d, what)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_hundred_decode_steps_in_one_run(dtype) -> None:
    """A GQA Llama generator (kv_splits 4 over 120 slots: ranges of 30) for 100 iterations in one run:
    every arrival word reused 100 times, the steps overlapping as the plan lets them. The tokens and
    caches equal the same plan without the rule, run the same way (float32: bit for bit; bf16: the
    first tokens, then a near tie may part them)."""
    cfg = LlamaConfig(hidden=256, heads=8, kv_heads=2, intermediate=512, layers=2, max_seq=120, vocab=500, dtype=dtype)
    params = random_parameters(cfg, seed=5)
    state = {"token": np.array([[3], [7]]), "position": np.array([[0], [10]])}
    g = build_llama_generator(cfg, 2, kv_splits=4)
    results = {}
    for name, fusion in (("merged", MERGE), ("plain", ml.FuseOptions())):
        plan = make_plan(g, processors=132, fusion=fusion)
        with loop_kernel(plan, params, state) as k:
            k.run(iterations=100)
            results[name] = k.state()
    merged, plain = results["merged"], results["plain"]
    assert int(merged["position"][0, 0]) == 100
    if dtype == "float32":
        for n in plain:
            assert merged[n].tobytes() == plain[n].tobytes(), f"state {n} differs after 100 steps"
    else:
        cache = next(n for n in plain if n.endswith("k_cache") or "cache" in n)
        a, b = merged[cache][:, :, :4].astype(np.float32), plain[cache][:, :, :4].astype(np.float32)
        assert np.abs(a - b).max() <= 0.05 * max(1.0, np.abs(b).max()), f"{cache}: first steps differ"


def test_the_generator_with_the_rule_equals_the_reference() -> None:
    """12 greedy steps of a float32 generator on the loop kernel with the rule: the numpy reference's
    tokens and caches within float32's tolerance."""
    assert_generator_matches_reference(loop_kernel, fusion=MERGE)

"""attention_partial's append form on the loop kernel (skipped without a GPU): the op against its numpy
reference (split keys and a warp a row, bf16 and fp32, positions at 0, at a split boundary, at the
last slot), and a few decode steps of a tiny Llama generator with the append fusion equal to the same
generator without it, tokens and caches. The CPU side: tests/test_attention_append.py."""

from __future__ import annotations

import numpy as np
import pytest

import megaloop as ml
from megaloop.frontend.ops.attention_split import ATTENTION_PARTIAL
from megaloop.models import LlamaConfig, random_parameters
from megaloop.models.llama import build_llama_generator
from megaloop.plan import make_plan
from megaloop.runtime.device import gpus
from tests.helpers import assert_close
from tests.test_attention_append import _append_graph, rounded

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpus()[0], reason="no GPU: " + gpus()[1])]


def loop_kernel(plan, params=None, state=None):
    from megaloop.runtime.loop import LoopKernel

    return LoopKernel(plan, params, state)


@pytest.mark.parametrize(
    "dtype, d, rope, positions",
    [
        ("bfloat16", 64, {}, [0, 32, 95]),  # split keys (ranges of 32): 0, a boundary, the last slot
        ("float32", 64, {"layout": "interleaved"}, [31, 33, 64]),
        ("bfloat16", 40, {}, [0, 47, 90]),  # 5 packs of 8: a warp a row
        ("bfloat16", 128, {"rotary_dim": 64, "theta": 500000.0}, [5, 63, 94]),
    ],
)
def test_the_op_against_its_reference(dtype, d, rope, positions) -> None:
    dt = ml.as_dtype(dtype)
    b, hq, hkv, tk = 3, 8, 2, 96
    g = _append_graph(dt, b, hq, hkv, tk, 3, d, rope, None)
    rng = np.random.default_rng(d)
    feeds = {n: rounded(rng.standard_normal(t.shape), dt) for n, t in g.inputs.items() if n != "pos"}
    feeds["pos"] = np.array(positions, np.int64).reshape(b, 1)
    want = ml.evaluate(g, feeds).outputs["out"]
    with loop_kernel(make_plan(g, processors=132)) as k:
        got = k.run(feeds)["out"]
    assert_close(got, want.astype(np.float64), dt, ATTENTION_PARTIAL.accuracy, tk + d, f"append [{dtype}, d {d}]")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_steps_with_append_equal_those_without(dtype) -> None:
    """The loop kernel's generator with and without the fusion: the same tokens (float32; bf16 its first
    ones, then a near tie may part them) and caches as the reference's after 12 steps."""
    cfg = LlamaConfig(hidden=256, heads=8, kv_heads=2, intermediate=512, layers=2, max_seq=128, vocab=500, dtype=dtype)
    params = random_parameters(cfg, seed=3)
    state = {"token": np.array([[3], [7]]), "position": np.array([[0], [40]])}
    tokens = {}
    g = build_llama_generator(cfg, 2, kv_splits=4)
    for name, fusion in (("append", ml.FuseOptions()), ("none", ml.FuseOptions(off=("attention_append",)))):
        plan = make_plan(g, processors=132, fusion=fusion)
        appends = any(n.op.name == "attention_partial" and "theta" in n.attrs for n in plan.ranks[0].graph.nodes)
        assert appends == (name == "append")
        with loop_kernel(plan, params, state) as k:
            k.run({}, iterations=12)
            tokens[name] = k.state()
    ref = ml.evaluate(g, {}, params, state, iterations=12)
    got, base = tokens["append"]["generated"], tokens["none"]["generated"]
    if dtype == "bfloat16":
        assert np.array_equal(got[:, :, :3], base[:, :, :3]) and np.array_equal(got[:, :, 40:43], base[:, :, 40:43])
        return
    assert np.array_equal(got, base) and np.array_equal(got, ref.state["generated"])
    key = "model.layers.0.self_attn.k_cache"  # the rotated keys the append form's writes stored
    rel = np.linalg.norm(tokens["append"][key].astype(np.float64) - ref.state[key].astype(np.float64))
    assert rel <= 1e-5 * np.linalg.norm(ref.state[key].astype(np.float64)), f"{key}: relative difference {rel}"

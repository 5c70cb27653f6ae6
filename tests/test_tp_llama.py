"""The hand-sharded tensor-parallel Llama of tests/helpers.tp_llama (the graphs the one-GPU group
test runs on two ranks: tests/test_gpu_shared.py) against the single-device model on the CPU
reference: a prefill then decode steps with each model's own KV caches, float32 within 1e-5 and
bfloat16 within its rounding, and the plan interpreter bitwise the graph evaluation."""

from __future__ import annotations

import numpy as np
import pytest

import megaloop as ml
from megaloop.models import LlamaConfig, build_llama, random_parameters
from megaloop.plan import make_plan
from megaloop.reference.interpreter import run_plan
from tests.helpers import shard_llama, tp_llama

CFG = LlamaConfig(hidden=64, heads=4, kv_heads=2, intermediate=96, layers=2, max_seq=16, vocab=50)


def relative(got: np.ndarray, want: np.ndarray) -> float:
    g, w = got.astype(np.float64), want.astype(np.float64)
    return float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30))


@pytest.mark.parametrize(("dtype", "tol"), [("float32", 1e-5), ("bfloat16", 2e-2)])
@pytest.mark.parametrize("world", [2])
def test_tp_llama_matches_the_single_device_model(dtype: str, tol: float, world: int) -> None:
    cfg = LlamaConfig(**{**CFG.__dict__, "dtype": dtype})
    params = random_parameters(cfg, seed=1)
    shards = shard_llama(params, cfg, world)
    rng = np.random.default_rng(2)
    prompt = {"tokens": rng.integers(0, 50, (1, 5)), "positions": np.arange(5)[None]}
    one = ml.evaluate(build_llama(cfg, 1, 5), prompt, params)
    tp = ml.evaluate(tp_llama(cfg, world, 1, 5), [prompt] * world, shards)
    for r in range(world):
        err = relative(tp[r].outputs["logits"], one.outputs["logits"])
        assert err <= tol, f"{dtype} prefill rank {r}: relative difference {err:.2e}"
    assert tp[0].outputs["logits"].tobytes() == tp[1].outputs["logits"].tobytes(), "ranks disagree"
    one_state, tp_state = one.state, [t.state for t in tp]
    decode_one, decode_tp = build_llama(cfg, 1, 1, kv_splits=None), tp_llama(cfg, world, 1, 1)
    for step in range(2):
        feed = {"tokens": rng.integers(0, 50, (1, 1)), "positions": np.array([[5 + step]])}
        one = ml.evaluate(decode_one, feed, params, one_state)
        tp = ml.evaluate(decode_tp, [feed] * world, shards, tp_state)
        one_state, tp_state = one.state, [t.state for t in tp]
        err = relative(tp[0].outputs["logits"], one.outputs["logits"])
        assert err <= tol, f"{dtype} decode step {step}: relative difference {err:.2e}"


def test_tp_llama_plan_interpreter_is_the_evaluation() -> None:
    graphs = tp_llama(CFG, 2, 1, 4)
    shards = shard_llama(random_parameters(CFG, seed=3), CFG, 2)
    feed = {"tokens": np.array([[1, 7, 3, 9]]), "positions": np.arange(4)[None]}
    want = ml.evaluate(graphs, [feed] * 2, shards)
    got = run_plan(make_plan(graphs, processors=6), [feed] * 2, shards, seed=4)
    for r in range(2):
        assert got[r].outputs["logits"].tobytes() == want[r].outputs["logits"].tobytes(), f"rank {r}"


def test_tp_llama_refuses_heads_that_do_not_divide() -> None:
    with pytest.raises(ValueError, match="kv_heads 2 does not divide by 4 ranks"):
        tp_llama(CFG, 4, 1, 1)

"""The graphs of the checkpoint families (biases, Qwen3's q/k norms, a sliding window on some layers,
tied embeddings; Gemma 2/3's sandwich norms, softcaps, GeGLU and local rope, Phi-3's longrope and
partial rotary dims, OLMo 2's post norms) and the gathering prefill, as the loop kernel runs them:
planned, run by the plan interpreter in random legal orders bit-equal to the graph's evaluation, and
their generated CUDA compiled by NVRTC (no GPU needed). The GPU run itself: tests/test_gpu_generate.py."""

from __future__ import annotations

import numpy as np
import pytest

import megaloop as ml
from megaloop.codegen import generate
from megaloop.models import LlamaConfig, build_llama, build_llama_generator, random_parameters
from megaloop.models.llama import build_llama_prefill
from megaloop.plan import make_plan
from megaloop.reference.interpreter import run_plan

CFG = LlamaConfig(
    hidden=64, heads=4, kv_heads=2, intermediate=128, layers=2, vocab=96, max_seq=32, head_dim=32, qkv_bias=True,
    o_bias=True, mlp_bias=True, qk_norm=True, sliding_window=5, sliding_layers=(1,), tie_word_embeddings=True,
)  # fmt: skip
SMALL = dict(hidden=64, heads=4, kv_heads=2, intermediate=128, layers=2, vocab=96, max_seq=32, head_dim=32)
# the variants of the families added with Gemma, Phi-3 and OLMo 2 (megaloop.models.llama)
FAMILY_CFGS = {
    "gemma2": LlamaConfig(
        **SMALL, norms="sandwich", norm_offset=1.0, activation="gelu_tanh", embed_scale=8.0, attn_scale=0.2,
        attn_softcap=5.0, final_softcap=6.0, sliding_window=5, sliding_layers=(0,), tie_word_embeddings=True,
    ),
    "gemma3": LlamaConfig(
        **SMALL, norms="sandwich", norm_offset=1.0, activation="gelu_tanh", embed_scale=8.0, qk_norm=True,
        sliding_window=4, sliding_layers=(0,), local_rope_theta=100.0, local_rope_layers=(0,),
        rope_scaling={"type": "linear", "factor": 2.0},
    ),
    "phi3": LlamaConfig(
        **SMALL, rotary_dim=24, sliding_window=9,
        rope_scaling={"type": "longrope", "short_factor": tuple(np.linspace(1, 2, 12)),
                      "long_factor": tuple(np.linspace(1, 8, 12)), "original_max_position_embeddings": 8,
                      "attention_factor": 1.2},
    ),
    "olmo2": LlamaConfig(**SMALL, norms="post", qk_norm=True, qk_norm_over="projection"),
}  # fmt: skip
# every new attribute in one model, for the compile check: softcapped scores (a 16-query prefill takes
# the tensor-core path), longrope over 24 of 32 dims, GeGLU, final softcap, a local rope theta
MIXED = LlamaConfig(
    **{**FAMILY_CFGS["phi3"].__dict__, "norms": "sandwich", "norm_offset": 1.0, "activation": "gelu_tanh",
       "embed_scale": 8.0, "attn_softcap": 5.0, "final_softcap": 6.0, "sliding_layers": (0,),
       "local_rope_theta": 100.0, "local_rope_layers": (0,)}
)  # fmt: skip
PREFILL_FEEDS = {
    "tokens": np.arange(16).reshape(2, 8),
    "positions": np.broadcast_to(np.arange(8), (2, 8)),
    "last": np.array([7, 3]),
}
START = {"token": np.array([[3], [4]]), "position": np.array([[9], [5]])}


@pytest.fixture(scope="module")
def plans():
    graphs = [build_llama_prefill(CFG, 2, 8), build_llama_generator(CFG, 2)]
    graphs += [build_llama_prefill(MIXED, 1, 16), build_llama_generator(MIXED, 2)]
    return [make_plan(g, processors=16) for g in graphs]


CASES = [("llama", "float32"), ("llama", "bfloat16"), *((name, "bfloat16") for name in FAMILY_CFGS)]


@pytest.mark.parametrize(("family", "dtype"), CASES)
def test_the_plan_interpreter_agrees_with_the_graph(family, dtype) -> None:
    cfg = LlamaConfig(**{**FAMILY_CFGS.get(family, CFG).__dict__, "dtype": dtype})
    params = random_parameters(cfg, seed=3)
    for graph, feeds, state, iterations in [
        (build_llama_prefill(cfg, 2, 8), PREFILL_FEEDS, None, 1),
        (build_llama_generator(cfg, 2), {}, START, 6),
    ]:
        plan = make_plan(graph, processors=16)
        want = ml.evaluate(graph, feeds, params, state, iterations=iterations)
        for seed in (0, 1):
            got = run_plan(plan, feeds, params, state, iterations=iterations, seed=seed)
            assert got.outputs["logits"].tobytes() == want.outputs["logits"].tobytes()
            if state:
                assert np.array_equal(got.state["generated"], want.state["generated"])
    if family == "llama":
        assert cfg.window(0) is None and cfg.window(1) == 5


def test_the_gathered_prefill_is_the_last_rows_of_the_full_one() -> None:
    cfg = LlamaConfig(**{**CFG.__dict__, "dtype": "float32"})
    params = random_parameters(cfg, seed=4)
    full = ml.evaluate(build_llama(cfg, 2, 8), {k: PREFILL_FEEDS[k] for k in ("tokens", "positions")}, params)
    last = ml.evaluate(build_llama_prefill(cfg, 2, 8), PREFILL_FEEDS, params)
    want = full.outputs["logits"][np.arange(2), PREFILL_FEEDS["last"]]
    assert np.abs(last.outputs["logits"][:, 0] - want).max() <= 1e-5 * np.abs(want).max()
    for name, cache in full.state.items():  # the same KV caches
        assert np.array_equal(cache, last.state[name]), name


def test_their_kernels_compile(plans) -> None:
    from megaloop.runtime.compile import compile_many

    sources = [generate(p).source for p in plans]
    assert "/* softcap 5 */" in sources[2] and "/* softcap 5 */" in sources[3]  # (the tiles that cap)
    cubins = compile_many(sources, "sm_90a")
    assert all(c[:4] == b"\x7fELF" for c in cubins)


@pytest.mark.parametrize("family", sorted(FAMILY_CFGS))
def test_the_new_families_split_over_two_devices_compute_the_same_logits(family) -> None:
    """tp2 and dp2 (rows at different positions: Phi-3's longrope switch is the batch's, so a split by
    sequences must share the maximum position) give the one-device logits within float32 rounding."""
    cfg = LlamaConfig(**{**FAMILY_CFGS[family].__dict__, "dtype": "float32", "max_seq": 16})
    params = random_parameters(cfg, seed=5)
    g = build_llama(cfg, 2, 6)
    feeds = {"tokens": np.arange(12).reshape(2, 6), "positions": np.array([np.arange(6), np.arange(6) + 4])}
    want = ml.evaluate(g, feeds, params).outputs["logits"]
    for strategy in ("tp", "dp"):
        split = ml.parallelize(g, 2, strategy)
        ranks = ml.evaluate(split.graphs, split.shard_inputs(feeds), split.shard_parameters(params))
        got = split.gather_outputs(ranks)["logits"]
        err = float(np.abs(got - want).max() / np.abs(want).max())
        print(family, strategy, f"worst relative difference {err:.2e}")
        assert err < 1e-5

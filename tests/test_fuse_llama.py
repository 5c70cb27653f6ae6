"""The fuse stage on the Llama models, which are built plain (megaloop.models.llama):

- the fused graphs of build_llama, build_llama_generator and build_llama_prefill are what the
  hand-fused builders made before the fuse stage existed (main at c934c34, tests/data/fused_llama_graphs.json),
  node for node, on small configurations and on the Llama-3.2-1B shape: the GPU runs the same plans;
- fused and plain give the same values bit for bit (ml.evaluate of both, the plan interpreter of the
  plan make_plan fuses) for a decode step with GQA, biases, Qwen3's q/k norms, tied embeddings, a
  sliding window, several generator steps and a prefill;
- a Llama decoder written here by hand from plain ops (rmsnorm, linear, rope, kv_cache_update,
  attention, silu, mul, add) plans to the same tasks as build_llama's, for a decode step and for the
  self-feeding generator, and runs to the same values.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import megaloop as ml
from megaloop.models import LlamaConfig, build_llama, build_llama_generator, build_llama_prefill, random_parameters
from megaloop.models.llama import auto_argmax_splits, auto_kv_splits
from megaloop.plan import Plan, make_plan
from megaloop.reference.interpreter import run_plan
from tests.graph_signature import digest, first_difference, op_counts, signature
from tests.test_plan_interpreter import same

FIXTURE = json.loads((Path(__file__).parent / "data" / "fused_llama_graphs.json").read_text())
BUILDERS = {"llama": build_llama, "generator": build_llama_generator, "prefill": build_llama_prefill}
# the rules that stand for the hand-fused builders' other Fusions (they always made norm_residual,
# rope_kv_cache_update and silu_mul themselves)
ALWAYS = ("norm_residual", "rope_kv_cache_update", "silu_mul")
FUSIONS = {
    "none": ml.FuseOptions.only(*ALWAYS),
    "norms": ml.FuseOptions.only(*ALWAYS, "rmsnorm_linear"),
    "swiglu": ml.FuseOptions.only(*ALWAYS, "swiglu_linear"),
    "append": ml.FuseOptions.only(*ALWAYS, "attention_append"),
    "norms,swiglu,split_k": ml.FuseOptions(off=("attention_append",)),
}


def _fixture_graph(case: dict[str, Any], fusion: ml.FuseOptions | None = None) -> ml.Graph:
    cfg = LlamaConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in case["config"].items()})
    args = dict(case["args"])
    fusion = FUSIONS[args.pop("fusions")] if "fusions" in args else fusion or ml.FuseOptions()
    if "eos_ids" in args:
        args["eos_ids"] = tuple(args["eos_ids"])
    return ml.fuse(BUILDERS[case["builder"]](cfg, **args), fusion)


def _one_sequence_prefill(case: dict[str, Any]) -> bool:
    return case["builder"] == "prefill" and case["args"]["batch"] == 1


@pytest.mark.parametrize("name", sorted(FIXTURE["cases"]))
def test_the_fused_graphs_are_those_the_hand_fused_builders_made(name: str) -> None:
    """So that the GPU runs the plans it ran before (decode, generator, prefill; batch 2; 3 tokens; biases;
    Qwen3; tied embeddings; windows; split-K steps; the 1B shape) and each other Fusions has its options.
    One difference: a one-sequence prefill's LM head reads one row, as a decode step's does, and takes its
    norm inside (rmsnorm_linear) where the hand-fused builder had kept it apart."""
    case = FIXTURE["cases"][name]
    g = _fixture_graph(case, ml.FuseOptions(off=("rmsnorm_linear",)) if _one_sequence_prefill(case) else None)
    sig = signature(g)
    if "signature" in case:
        assert sig == case["signature"], first_difference(sig, case["signature"])
    assert op_counts(g) == case["counts"], f"ops: {op_counts(g)}\nthen: {case['counts']}"
    assert digest(sig) == case["digest"], "the same ops, but in another order or with other operands or attributes"
    if _one_sequence_prefill(case):
        fused, apart = Counter(op_counts(_fixture_graph(case))), Counter(op_counts(g))
        assert fused - apart == Counter(rmsnorm_linear=1) and apart - fused == Counter(rmsnorm=1, matmul=1)


# ---- the same values ----------------------------------------------------------------------------------

TINY = LlamaConfig(hidden=32, heads=4, kv_heads=2, intermediate=48, layers=2, max_seq=12, vocab=40)
VARIANTS = {
    "gqa": TINY,
    "biases": dataclasses.replace(TINY, qkv_bias=True, o_bias=True, mlp_bias=True),
    "qwen3": dataclasses.replace(TINY, qk_norm=True, qkv_bias=True, heads=8, head_dim=8),
    "tied": dataclasses.replace(TINY, tie_word_embeddings=True),
    "window": dataclasses.replace(TINY, sliding_window=3, sliding_layers=(1,)),
    "float32": dataclasses.replace(TINY, dtype="float32"),
}


def _state(g: ml.Graph, seed: int) -> dict[str, np.ndarray]:
    """Caches half full of values the dtype holds (the rest of the state as the graph starts it)."""
    rng = np.random.default_rng(seed)
    return {
        n: ml.dtypes.round_to(0.5 * rng.standard_normal(t.shape), t.dtype)
        for n, t in g.states.items()
        if n.endswith("_cache")
    }


def _check_plain_and_fused(g: ml.Graph, feeds: dict, params: dict, state: dict, iterations: int = 1) -> None:
    fused = ml.fuse(g)
    assert op_counts(fused) != op_counts(g)
    want = ml.evaluate(g, feeds, params, state, iterations=iterations)
    same(ml.evaluate(fused, feeds, params, state, iterations=iterations), want, f"{g.name}: fused graph")
    plan = make_plan(g, processors=7)
    assert op_counts(plan.ranks[0].graph) == op_counts(fused)
    for seed in range(2):
        same(run_plan(plan, feeds, params, state, iterations=iterations, seed=seed), want, f"{g.name}: plan {seed}")


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_fused_decode_step_gives_the_plain_steps_values_bit_for_bit(variant: str) -> None:
    cfg = VARIANTS[variant]
    g = build_llama(cfg, 1, 1, kv_splits=3)
    feeds = {"tokens": np.array([[7]]), "positions": np.array([[6]])}
    _check_plain_and_fused(g, feeds, random_parameters(cfg, seed=1), _state(g, 2))


@pytest.mark.parametrize("batch", [1, 2])
def test_generator_steps_fused_give_the_plain_ones_bit_for_bit(batch: int) -> None:
    g = build_llama_generator(TINY, batch, kv_splits=3)
    start = {"token": np.array([[3], [9]])[:batch], "position": np.array([[0], [4]])[:batch]}
    _check_plain_and_fused(g, {}, random_parameters(TINY, seed=3), start, iterations=3)


def test_a_fused_prefill_gives_the_plain_ones_values_bit_for_bit() -> None:
    """Four rows: the norms inside the products (rmsnorm_linear, swiglu_linear) on few rows, no append."""
    g = build_llama_prefill(TINY, 1, 4)
    feeds = {"tokens": np.array([[1, 5, 9, 3]]), "positions": np.arange(4)[None], "last": np.array([2])}
    _check_plain_and_fused(g, feeds, random_parameters(TINY, seed=4), {})
    assert {"rmsnorm_linear", "swiglu_linear"} <= set(op_counts(ml.fuse(g)))


# ---- a Llama decoder written by hand --------------------------------------------------------------------

SMALL = LlamaConfig(hidden=64, heads=8, kv_heads=2, intermediate=96, layers=2, max_seq=128, vocab=80)


def hand_model(g: ml.Graph, cfg: LlamaConfig, tokens: ml.Tensor, pos: ml.Tensor, swap: bool = False) -> ml.Tensor:
    """A Llama model as a user would write it from plain ops (no scopes, no residual tricks, silu and mul
    apart, the three projections before any rope): the logits [batch, tokens, vocab]. ``swap``: each
    residual add written update + stream rather than stream + update."""
    b, t = pos.shape
    d, hd, dt = cfg.hidden, cfg.head_dim, cfg.dtype
    x = ml.embedding(g.parameter("model.embed_tokens.weight", (cfg.vocab, d), dt), tokens)
    for i in range(cfg.layers):

        def w(name: str, *shape: int, i: int = i) -> ml.Tensor:
            return g.parameter(f"model.layers.{i}.{name}", shape, dt)

        h = ml.rmsnorm(x, w("input_layernorm.weight", d), eps=cfg.rms_eps)
        q = ml.linear(h, w("self_attn.q_proj.weight", cfg.heads * hd, d))
        k = ml.linear(h, w("self_attn.k_proj.weight", cfg.kv_heads * hd, d))
        v = ml.linear(h, w("self_attn.v_proj.weight", cfg.kv_heads * hd, d))
        q, k, v = (y.reshape(b, t, y.shape[-1] // hd, hd).transpose(1, 2) for y in (q, k, v))
        q = ml.rope(q, pos.reshape(b, 1, t), theta=cfg.rope_theta)
        k = ml.rope(k, pos.reshape(b, 1, t), theta=cfg.rope_theta)
        shape = (b, cfg.kv_heads, cfg.max_seq, hd)
        k = ml.kv_cache_update(g.state(f"model.layers.{i}.self_attn.k_cache", shape, dt), k, pos)
        v = ml.kv_cache_update(g.state(f"model.layers.{i}.self_attn.v_cache", shape, dt), v, pos)
        splits = auto_kv_splits(cfg, b, t)  # (the builder's choice of key ranges, to compare like with like)
        o = ml.attention(q, k, v, causal=True, q_positions=pos, kv_splits=splits)
        o = ml.linear(o.transpose(1, 2).reshape(b, t, cfg.heads * hd), w("self_attn.o_proj.weight", d, cfg.heads * hd))
        x = o + x if swap else x + o
        h = ml.rmsnorm(x, w("post_attention_layernorm.weight", d), eps=cfg.rms_eps)
        gate = ml.linear(h, w("mlp.gate_proj.weight", cfg.intermediate, d))
        up = ml.linear(h, w("mlp.up_proj.weight", cfg.intermediate, d))
        down = ml.linear(ml.silu(gate) * up, w("mlp.down_proj.weight", d, cfg.intermediate))
        x = down + x if swap else x + down
    h = ml.rmsnorm(x, g.parameter("model.norm.weight", (d,), dt), eps=cfg.rms_eps)
    return ml.linear(h, g.parameter("lm_head.weight", (cfg.vocab, d), dt))


def hand_decode_step(cfg: LlamaConfig, batch: int, swap: bool = False) -> ml.Graph:
    g = ml.Graph("by-hand")
    pos = g.input("positions", (batch, 1), "int64")
    g.output("logits", hand_model(g, cfg, g.input("tokens", (batch, 1), "int64"), pos, swap))
    return g


def hand_generator(cfg: LlamaConfig, batch: int) -> ml.Graph:
    """Greedy decoding that feeds itself (build_llama_generator's states, no end-of-sequence ids)."""
    g = ml.Graph("by-hand-generate")
    token = g.state("token", (batch, 1), "int64")
    position = g.state("position", (batch, 1), "int64")
    generated = g.state("generated", (batch, 1, cfg.max_seq, 1), "float32")
    stop = g.state("stop", (batch, 1), "int64", init=np.full((batch, 1), cfg.max_seq, np.int64))
    active = ml.less(position, stop)
    kept = ml.where(active, 0, token)
    written = ml.where(active, position, -1)
    ml.kv_cache_update(generated, token.astype("float32").reshape(batch, 1, 1, 1), written, ignore_negative=True)
    logits = hand_model(g, cfg, token, ml.minimum(position, cfg.max_seq - 1))
    chosen = ml.argmax(logits, axis=-1, splits=auto_argmax_splits(cfg))
    g.assign(token, ml.where(active, chosen, kept))
    g.assign(position, ml.where(active, position + 1, position))
    g.output("logits", logits)
    return g


def tasks_of(plan: Plan) -> list:
    """Each rank's ops (kind, tile parameters, place), tasks (op, tile, work, waits) and task lists."""
    out = []
    for rp in plan.ranks:
        ops = [(op.op, sorted(op.tile.items()), op.seq) for op in rp.ops]
        tasks = [(t.op, t.coords, t.flops, t.bytes, t.cost_ns, t.waits) for t in rp.tasks]
        out.append((ops, tasks, rp.processors))
    return out


@pytest.mark.parametrize("kind", ["decode", "generator"])
def test_a_llama_written_by_hand_plans_to_the_same_tasks_as_build_llamas(kind: str) -> None:
    """The issue's test: nothing in the builder chooses a fused op any more, so a decoder written by hand
    (silu and mul, rope then the cache writes, norms of the residual sums) plans to build_llama's tasks:
    the same fused ops, tiles, waits and processor lists, and so the same values and the same speed."""
    if kind == "decode":
        ours, theirs = hand_decode_step(SMALL, 1), build_llama(SMALL, 1, 1)
        feeds = {"tokens": np.array([[11]]), "positions": np.array([[70]])}
        state = _state(ours, 5)
    else:
        ours, theirs = hand_generator(SMALL, 1), build_llama_generator(SMALL, 1)
        feeds, state = {}, {"token": np.array([[11]]), "position": np.array([[70]])}
    assert not {"rmsnorm_linear", "swiglu_linear", "silu_mul"} & set(op_counts(ours))
    plans = [make_plan(g, processors=16) for g in (ours, theirs)]
    fused = plans[0].ranks[0].graph
    assert {"rmsnorm_linear", "swiglu_linear", "rope_kv_cache_update"} <= set(op_counts(fused))
    assert any(n.op.name == "attention_partial" and "theta" in n.attrs for n in fused.nodes)  # the append form
    assert op_counts(fused) == op_counts(plans[1].ranks[0].graph)
    mine, built = tasks_of(plans[0]), tasks_of(plans[1])
    for what, a, b in zip(("ops", "tasks", "processor lists"), mine[0], built[0]):
        assert a == b, f"{kind}: the {what} differ; first at {next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)}"
    params = random_parameters(SMALL, seed=6)
    runs = [run_plan(p, feeds, params, state, iterations=2, seed=1) for p in plans]
    same(runs[0], runs[1], f"{kind}: the hand-written model's plan against build_llama's")


def test_the_order_of_a_residual_adds_operands_changes_no_task() -> None:
    """norm(stream + update) and norm(update + stream) fuse to norms with x and residual the other way
    round; products that norm their rows count as siblings (sharing the processors) only with products
    of the same rows and residual, so layer 0's MLP (its residual the embedding, the rows q, k and v
    read) is none of q, k and v's either way (tasks.processor_share)."""
    plans = [make_plan(hand_decode_step(SMALL, 1, swap), processors=16) for swap in (False, True)]
    assert tasks_of(plans[0]) == tasks_of(plans[1])


@pytest.mark.gpu
def test_the_hand_written_generator_runs_like_build_llamas_on_the_gpu() -> None:
    """On the loop kernel (skipped without a GPU): the same tokens, and the same time a step within the
    noise of a shared GPU (the plans are the same; the lead's benchmarks measure it on the 1B shape)."""
    from bench.common import resident_seconds
    from megaloop.runtime.device import gpus
    from megaloop.runtime.loop import LoopKernel

    found, reason = gpus()
    if not found:
        pytest.skip(f"no GPU: {reason}")
    cfg = dataclasses.replace(SMALL, hidden=512, intermediate=1376, layers=4, vocab=2048)
    params = random_parameters(cfg, seed=7)
    start = {"token": np.array([[11]]), "position": np.array([[40]])}
    tokens, seconds = [], []
    for g in (hand_generator(cfg, 1), build_llama_generator(cfg, 1)):
        plan = make_plan(g, processors=found[0].sm_count, arch=found[0].plan_arch)
        with LoopKernel(plan, params, start) as k:
            k.run({}, iterations=32)
            tokens.append(k.state()["generated"].copy())
            seconds.append(resident_seconds(k, 32))
    assert np.array_equal(tokens[0], tokens[1])
    print(f"by hand {seconds[0] * 1e6:.1f} us a step, build_llama {seconds[1] * 1e6:.1f} us")
    assert seconds[0] <= 1.2 * seconds[1] and seconds[1] <= 1.2 * seconds[0], seconds

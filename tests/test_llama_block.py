"""A two-layer Llama-style decoder (RMSNorm, GQA attention with RoPE and a KV cache, SwiGLU) built
with megaloop, against the same model written directly in PyTorch: a prefill step and two decode
steps that read the cache the earlier steps wrote."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import megaloop as ml
from megaloop.models import LlamaConfig, build_llama, random_parameters
from tests.helpers import to_torch64

CFG = LlamaConfig(
    hidden=128,
    heads=8,
    kv_heads=2,
    intermediate=352,
    layers=2,
    max_seq=32,
    rope_theta=10000.0,
    rms_eps=1e-5,
    dtype=ml.bfloat16,
)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], -1)


class TorchLlama:
    """The block in plain PyTorch, HF-style, computing in ``dtype`` (float64: the reference)."""

    def __init__(self, cfg: LlamaConfig, params: dict[str, np.ndarray], batch: int, dtype: torch.dtype) -> None:
        self.cfg, self.dtype = cfg, dtype
        self.p = {k: to_torch64(ml.dtypes.round_to(v, cfg.dtype)).to(dtype) for k, v in params.items()}
        shape = (batch, cfg.kv_heads, cfg.max_seq, cfg.head_dim)
        self.cache = {(i, kv): torch.zeros(shape, dtype=dtype) for i in range(cfg.layers) for kv in "kv"}

    def rmsnorm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + self.cfg.rms_eps) * w

    def step(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        b, t, _ = x.shape
        hd = cfg.head_dim
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
        ang = pos.to(torch.float64)[..., None] * inv
        cos = torch.cat([ang, ang], -1).cos()[:, None].to(self.dtype)
        sin = torch.cat([ang, ang], -1).sin()[:, None].to(self.dtype)
        j = torch.arange(cfg.max_seq)
        mask = (j[None, None, :] <= pos[:, :, None])[:, None]  # [b, 1, t, max_seq]
        for i in range(cfg.layers):
            p = lambda n, i=i: self.p[f"model.layers.{i}.{n}"]
            h = self.rmsnorm(x, p("input_layernorm.weight"))
            q = (h @ p("self_attn.q_proj.weight").T).view(b, t, cfg.heads, hd).transpose(1, 2)
            k = (h @ p("self_attn.k_proj.weight").T).view(b, t, cfg.kv_heads, hd).transpose(1, 2)
            v = (h @ p("self_attn.v_proj.weight").T).view(b, t, cfg.kv_heads, hd).transpose(1, 2)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            for bi in range(b):
                self.cache[i, "k"][bi, :, pos[bi]] = k[bi]
                self.cache[i, "v"][bi, :, pos[bi]] = v[bi]
            rep = cfg.heads // cfg.kv_heads
            kk = self.cache[i, "k"].repeat_interleave(rep, 1)
            vv = self.cache[i, "v"].repeat_interleave(rep, 1)
            o = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)
            x = x + o.transpose(1, 2).reshape(b, t, -1) @ p("self_attn.o_proj.weight").T
            h = self.rmsnorm(x, p("post_attention_layernorm.weight"))
            mlp = F.silu(h @ p("mlp.gate_proj.weight").T) * (h @ p("mlp.up_proj.weight").T)
            x = x + mlp @ p("mlp.down_proj.weight").T
        return self.rmsnorm(x, self.p["model.norm.weight"])


def rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("prompt", [6, 9])
def test_two_layer_block_matches_pytorch(prompt: int) -> None:
    """Prefill (prompts of 6 and 9) then two decode steps, the MLP's silu(gate) * up as one op (silu_mul,
    silu in float32 where PyTorch rounds it to bf16 first)."""
    batch = 2
    params = random_parameters(CFG, seed=1)
    rng = np.random.default_rng(2)
    ref64 = TorchLlama(CFG, params, batch, torch.float64)
    ref16 = TorchLlama(CFG, params, batch, torch.bfloat16)  # PyTorch's own bf16 eager, as a yardstick
    prefill, decode = build_llama(CFG, batch, prompt, "prefill"), build_llama(CFG, batch, 1, "decode")
    for graph in (prefill, decode):
        assert any(n.op.name == "silu_mul" for n in graph.nodes)
    state = None
    steps = [(prefill, np.tile(np.arange(prompt), (batch, 1)))] + [
        (decode, np.full((batch, 1), prompt + s)) for s in range(2)
    ]
    eps = CFG.dtype.eps
    for n, (graph, pos) in enumerate(steps):
        x = ml.dtypes.round_to(rng.standard_normal((batch, pos.shape[1], CFG.hidden)), CFG.dtype)
        out = ml.evaluate(graph, {"hidden": x, "positions": pos}, params, state)
        state = out.state
        ours = out.outputs["hidden"]
        with torch.no_grad():
            want = ref64.step(to_torch64(x), torch.from_numpy(pos)).numpy()
            torch_bf16 = ref16.step(to_torch64(x).to(torch.bfloat16), torch.from_numpy(pos)).double().numpy()
        err, torch_err = rel_l2(ours, want), rel_l2(torch_bf16, want)
        diff = np.abs(ours.astype(np.float64) - want)
        bound = 4 * eps * (np.abs(want) + np.sqrt(np.mean(want**2)))
        worst = np.unravel_index(int(np.argmax(diff / bound)), diff.shape)
        print(
            f"step {n}: rel L2 error megaloop bf16 {err:.2e}, torch bf16 {torch_err:.2e}; worst element "
            f"{tuple(int(i) for i in worst)} got {float(ours[worst]):.5f} want {want[worst]:.5f}"
        )
        assert err < 2 * eps, f"step {n}: relative L2 error {err:.2e} above 2 bf16 eps"
        assert err <= 1.5 * torch_err, (
            f"step {n}: megaloop bf16 ({err:.2e}) much worse than torch bf16 ({torch_err:.2e})"
        )
        assert np.all(diff <= bound), f"step {n}: element {worst} off by {diff[worst]:.3e} > {bound[worst]:.3e}"
    # the caches megaloop carried equal the ones PyTorch wrote
    for i in range(CFG.layers):
        for kv in "kv":
            ours = state[f"model.layers.{i}.self_attn.{kv}_cache"].astype(np.float64)
            want = ref64.cache[i, kv].numpy()
            assert rel_l2(ours, want) < eps, f"layer {i} {kv} cache"


def test_split_key_attention_gives_the_same_logits() -> None:
    """Decode with the cache split into key ranges (attention_partial + attention_combine) against
    the plain graph, through the reference and through a plan."""
    from megaloop.plan import make_plan
    from megaloop.reference.interpreter import run_plan

    cfg = LlamaConfig(hidden=64, heads=4, kv_heads=2, intermediate=96, layers=2, max_seq=24, vocab=50)
    params = random_parameters(cfg, seed=5)
    rng = np.random.default_rng(5)
    state = {}
    prefill = build_llama(cfg, 2, 9)
    state = ml.evaluate(
        prefill, {"tokens": rng.integers(0, 50, (2, 9)), "positions": np.tile(np.arange(9), (2, 1))}, params
    ).state
    feeds = {"tokens": rng.integers(0, 50, (2, 1)), "positions": np.full((2, 1), 9)}
    plain = ml.evaluate(build_llama(cfg, 2, 1), feeds, params, state).outputs["logits"].astype(np.float64)
    split_graph = build_llama(cfg, 2, 1, kv_splits=5)
    assert any(n.op.name == "attention_partial" for n in split_graph.nodes)
    split = ml.evaluate(split_graph, feeds, params, state).outputs["logits"].astype(np.float64)
    planned = run_plan(make_plan(split_graph, processors=7), feeds, params, state, seed=3).outputs["logits"]
    rel = np.linalg.norm(split - plain) / np.linalg.norm(plain)
    assert rel < 50 * cfg.dtype.eps, f"split-key logits differ from the plain graph's by {rel:.2e} (relative L2)"
    assert planned.tobytes() == ml.evaluate(split_graph, feeds, params, state).outputs["logits"].tobytes()


def test_generator_feeds_itself_the_same_tokens_as_host_steps() -> None:
    """build_llama_generator: n loop iterations (no host work between them) pick the same greedy tokens
    as n host-driven decode steps, through the reference and through a plan."""
    from megaloop.models import build_llama_generator
    from megaloop.plan import make_plan
    from megaloop.reference.interpreter import run_plan

    cfg = LlamaConfig(hidden=64, heads=4, kv_heads=2, intermediate=96, layers=2, max_seq=16, vocab=50)
    params = random_parameters(cfg, seed=8)
    rng = np.random.default_rng(8)
    prompt = rng.integers(0, 50, (2, 5))
    pre = ml.evaluate(build_llama(cfg, 2, 5), {"tokens": prompt, "positions": np.tile(np.arange(5), (2, 1))}, params)
    first = pre.outputs["logits"][:, -1].astype(np.float32).argmax(-1)
    # host-driven: one decode step per token
    decode, state, token, want = build_llama(cfg, 2, 1), pre.state, first, []
    for i in range(4):
        want.append(token)
        out = ml.evaluate(decode, {"tokens": token[:, None], "positions": np.full((2, 1), 5 + i)}, params, state)
        state, token = out.state, out.outputs["logits"][:, -1].astype(np.float32).argmax(-1)
    want = np.stack(want, 1)
    # self-feeding: four iterations of one graph (the next token's argmax whole, and in 3 ranges of the
    # 50 logits: 3 argmax_partial tiles and a combine)
    start = {**pre.state, "token": first[:, None], "position": np.full((2, 1), 5)}
    for splits in (None, 3):
        gen = build_llama_generator(cfg, 2, argmax_splits=splits)
        assert any(n.op.name == "argmax_partial" for n in gen.nodes) == (splits is not None)
        ref = ml.evaluate(gen, {}, params, start, iterations=4)
        got = ref.state["generated"][:, 0, 5:9, 0].astype(np.int64)
        assert np.array_equal(got, want), f"generator {got.tolist()} vs host steps {want.tolist()}"
        assert np.array_equal(ref.state["token"][:, 0], token) and (ref.state["position"] == 9).all()
        planned = run_plan(make_plan(gen, processors=5), {}, params, start, iterations=4, seed=2)
        assert planned.state["generated"].tobytes() == ref.state["generated"].tobytes()


def test_norms_do_not_wait_for_the_residual_add() -> None:
    """build_llama's norms take the residual stream's last update as their ``residual`` operand
    (decoder_layer_parts): each reads the sublayer's output (its last matmul) itself, not the add of it
    to the stream, so none waits for that add on a decode step's critical path; the adds still feed the
    next residual. The same values as norming the sums (rmsnorm rounds x + residual as the add does):
    here against decoder_layer's graph, whose input norms and final norm read the adds' outputs, bit
    for bit."""
    from megaloop.models.llama import decoder_layer

    cfg = LlamaConfig(hidden=64, heads=4, kv_heads=2, intermediate=96, layers=3, max_seq=16, vocab=40)
    g = ml.fuse(build_llama(cfg, 1, 1), ml.FuseOptions(off=("rmsnorm_linear",)))  # (the norms as ops of their own)
    norms = [n for n in g.nodes if n.op.name == "rmsnorm"]
    assert len(norms) == 2 * cfg.layers + 1
    assert len(norms[0].inputs) == 2 and norms[0].inputs[0].node.op.name == "embedding"
    for n in norms[1:]:  # x, weight, residual: one of x and residual the sublayer's matmul, not an add of it
        stream = {n.inputs[0].node.op.name, n.inputs[2].node.op.name} - {"matmul"}
        assert len(n.inputs) == 3 and len(stream) == 1 and stream <= {"add", "embedding"}, n
        for add in (t.node for t in n.inputs if t.node.op.name == "add"):
            assert not {t.node.id for t in add.inputs} & {t.node.id for t in n.inputs}, f"{n} waits for its add"

    summed = ml.Graph("summed")  # the same layers through decoder_layer, which norms the adds' outputs
    tokens = summed.input("tokens", (1, 1), "int64")
    positions = summed.input("positions", (1, 1), "int64")
    x = ml.embedding(summed.parameter("model.embed_tokens.weight", (40, 64), cfg.dtype), tokens)
    for layer in range(cfg.layers):
        x = decoder_layer(summed, cfg, x, positions, layer)
    x = ml.rmsnorm(x, summed.parameter("model.norm.weight", (64,), cfg.dtype), eps=cfg.rms_eps)
    summed.output("logits", ml.linear(x, summed.parameter("lm_head.weight", (40, 64), cfg.dtype)))
    params = random_parameters(cfg, seed=2)
    rng = np.random.default_rng(2)
    state = {
        name: rng.standard_normal(t.shape).astype(np.float32) * 0.5
        for name, t in g.states.items()
        if name in summed.states
    }
    feeds = {"tokens": np.array([[7]]), "positions": np.array([[5]])}
    want = ml.evaluate(summed, feeds, params, state).outputs["logits"]
    got = ml.evaluate(g, feeds, params, state).outputs["logits"]
    assert got.tobytes() == want.tobytes(), np.max(np.abs(got.astype(np.float64) - want.astype(np.float64)))


def test_decode_rotates_keys_on_their_way_into_the_cache() -> None:
    """Decode steps (one token) write each layer's key with rope_kv_cache_update once fused (no rope op
    between the key projection and the cache: a stage fewer before attention); prefill keeps rope then
    kv_cache_update. The same values either way: test_two_layer_block_matches_pytorch checks both
    against PyTorch, and here the fused decode step's logits and caches equal the plain graph's (rope
    then kv_cache_update), bit for bit, through the reference and a plan."""
    from megaloop.plan import make_plan
    from megaloop.reference.interpreter import run_plan

    cfg = LlamaConfig(hidden=64, heads=4, kv_heads=2, intermediate=96, layers=2, max_seq=16, vocab=40)
    plain, prefill = build_llama(cfg, 2, 1), ml.fuse(build_llama(cfg, 2, 5))
    decode = ml.fuse(plain)
    ops_of = [n.op.name for n in decode.nodes], [n.op.name for n in prefill.nodes]
    assert ops_of[0].count("rope_kv_cache_update") == 2 and ops_of[0].count("rope") == 2  # q's rope
    assert "rope_kv_cache_update" not in ops_of[1] and ops_of[1].count("rope") == 4
    assert "rope_kv_cache_update" not in [n.op.name for n in plain.nodes]
    params = random_parameters(cfg, seed=4)
    rng = np.random.default_rng(4)
    state = ml.evaluate(
        prefill, {"tokens": rng.integers(0, 40, (2, 5)), "positions": np.tile(np.arange(5), (2, 1))}, params
    ).state
    feeds = {"tokens": rng.integers(0, 40, (2, 1)), "positions": np.array([[5], [9]])}
    fused = ml.evaluate(decode, feeds, params, state)
    want = ml.evaluate(plain, feeds, params, state)
    assert fused.outputs["logits"].tobytes() == want.outputs["logits"].tobytes()
    for name in want.state:
        assert fused.state[name].tobytes() == want.state[name].tobytes(), name
    planned = run_plan(make_plan(plain, processors=6), feeds, params, state, seed=1)
    assert planned.outputs["logits"].tobytes() == want.outputs["logits"].tobytes()


def test_decode_keys_match_a_longer_prefill_with_scaled_rope() -> None:
    """The decode step's key (rope_kv_cache_update, with the model's theta and Llama-3 scaling) is the
    one a prefill one token longer writes (rope then kv_cache_update) into the cache: a decode call that
    lost the rope arguments would fail here (a review's mutant passed the other tests)."""
    scaling = {
        "type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8,
    }
    cfg = LlamaConfig(
        hidden=64,
        heads=4,
        kv_heads=2,
        intermediate=96,
        layers=1,
        max_seq=48,
        vocab=40,
        rope_theta=500000.0,
        rope_scaling=scaling,
        dtype=ml.float32,
    )
    params = random_parameters(cfg, seed=6)
    tokens = np.random.default_rng(6).integers(0, 40, (1, 40))
    longer = ml.evaluate(build_llama(cfg, 1, 40), {"tokens": tokens, "positions": np.arange(40)[None]}, params)
    shorter = ml.evaluate(build_llama(cfg, 1, 39), {"tokens": tokens[:, :39], "positions": np.arange(39)[None]}, params)
    step = ml.evaluate(
        build_llama(cfg, 1, 1), {"tokens": tokens[:, 39:], "positions": np.array([[39]])}, params, shorter.state
    )
    for name in ("model.layers.0.self_attn.k_cache", "model.layers.0.self_attn.v_cache"):
        got, want = step.state[name][:, :, :40], longer.state[name][:, :, :40]
        assert np.max(np.abs(got - want)) < 1e-4 * max(1.0, np.max(np.abs(want))), name

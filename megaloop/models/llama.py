"""Llama-family decoder built with the graph API: RMSNorm, grouped-query attention with RoPE and a
KV cache, SwiGLU MLP, residuals; with the variants of the families megaloop loads (LlamaConfig's
fields): Gemma 2/3's sandwich norms, (1 + w) norm weights, GeGLU, scaled embeddings, softcapped
attention scores and logits and local rope on sliding layers, OLMo 2's norms after each block and of
whole q/k projections, Phi-3's longrope and partial rotary dims. Each is made of general ops.

Parameter names follow the Hugging Face checkpoint keys (``model.layers.0.self_attn.q_proj.weight``),
linear weights are stored [out_features, in_features] as there, so a checkpoint loads by name. One
graph is one step: ``tokens`` new tokens per sequence at the given positions, attending to everything
already in the cache (prefill when tokens > 1, decode when tokens == 1).

The graphs are plain: every norm, product, rotation, cache write and attention an op of its own.
Which of them the loop kernel makes together (the norms inside the projections of a decode step,
q's rope and the new key inside attention, products over ranges of K for a prefill, ...) is decided
when the graph is planned: ``make_plan`` rewrites it (megaloop.fuse, docs/fuse.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import megaloop.frontend.ops as ops
from megaloop.dtypes import DType, as_dtype, bfloat16, round_to
from megaloop.errors import GraphBuildError
from megaloop.frontend.graph import Graph
from megaloop.frontend.tensor import Tensor
from megaloop.frontend.validate import as_int
from megaloop.models.decoding import PLAIN, Decoding, next_token


@dataclass(frozen=True)
class LlamaConfig:
    hidden: int = 256
    heads: int = 8
    kv_heads: int = 2
    intermediate: int = 688
    layers: int = 2
    max_seq: int = 128
    vocab: int | None = None  # None: the graph takes and returns hidden states, no embedding/lm head
    head_dim: int | None = None  # None: hidden // heads
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    rms_eps: float = 1e-5
    dtype: DType = bfloat16
    # Variants of the families megaloop loads (megaloop.models.hf_config): Qwen2's q/k/v biases, Llama's
    # attention_bias (q/k/v and o) and mlp_bias, Qwen3's RMSNorm of each head's q and k before rope, a
    # sliding attention window (Mistral; Qwen2/3 on some layers), the LM head sharing the embedding.
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] | None = None  # the layers with the window (None: all of them)
    tie_word_embeddings: bool = False
    # Gemma 2/3, OLMo 2, Phi-3 (module docstring). norms: "pre" (Llama: before attention and MLP),
    # "sandwich" (Gemma: before and after each), "post" (OLMo 2: after each, on the block's output);
    # qk_norm_over: "head" (Qwen3, Gemma 3: each head) or "projection" (OLMo 2: the whole q and k);
    # norm_offset: norms multiply by (offset + weight) (Gemma: 1); local_rope_theta: the rope (unscaled)
    # of local_rope_layers (Gemma 3's sliding layers, kept where a window past the cache is dropped);
    # rope_scaling may be longrope (hf_config: short/long factors).
    norms: str = "pre"
    qk_norm_over: str = "head"
    norm_offset: float = 0.0
    activation: str = "silu"  # the MLP's gate: silu (SwiGLU) or gelu_tanh (GeGLU)
    embed_scale: float | None = None  # embeddings multiplied by it (Gemma: sqrt(hidden))
    attn_scale: float | None = None  # attention's score scale (None: 1/sqrt(head_dim))
    attn_softcap: float | None = None  # scores softcapped: c * tanh(s / c)
    final_softcap: float | None = None  # logits softcapped likewise
    rotary_dim: int | None = None  # dims of a head that rope turns (None: all)
    local_rope_theta: float | None = None
    local_rope_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", as_dtype(self.dtype))
        for name in ("hidden", "heads", "kv_heads", "intermediate", "layers", "max_seq"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise GraphBuildError(f"LlamaConfig: {name} must be an int >= 1, got {value!r}")
        if self.vocab is not None and (not isinstance(self.vocab, int) or self.vocab < 1):
            raise GraphBuildError(f"LlamaConfig: vocab must be None or an int >= 1, got {self.vocab!r}")
        if self.head_dim is None:
            if self.hidden % self.heads:
                raise GraphBuildError(
                    f"LlamaConfig: hidden {self.hidden} is not divisible by heads {self.heads}; set head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        if self.heads % self.kv_heads:
            raise GraphBuildError(f"LlamaConfig: heads {self.heads} must be a multiple of kv_heads {self.kv_heads}")
        for name in ("qkv_bias", "o_bias", "mlp_bias", "qk_norm", "tie_word_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise GraphBuildError(f"LlamaConfig: {name} must be a bool, got {getattr(self, name)!r}")
        window = self.sliding_window
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise GraphBuildError(f"LlamaConfig: sliding_window must be None or an int >= 1, got {window!r}")
        if self.sliding_layers is not None:
            layers = tuple(self.sliding_layers)
            if window is None or any(not isinstance(i, int) or not 0 <= i < self.layers for i in layers):
                raise GraphBuildError(
                    f"LlamaConfig: sliding_layers {self.sliding_layers!r} must be layer indices below {self.layers}, "
                    "with a sliding_window set"
                )
            object.__setattr__(self, "sliding_layers", tuple(sorted(set(layers))))
        choices = (("norms", NORMS), ("qk_norm_over", ("head", "projection")), ("activation", ACTIVATIONS))
        for name, allowed in choices:
            if getattr(self, name) not in allowed:
                raise GraphBuildError(f"LlamaConfig: {name} must be one of {allowed}, got {getattr(self, name)!r}")
        for name in ("embed_scale", "attn_scale", "attn_softcap", "final_softcap", "local_rope_theta"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise GraphBuildError(f"LlamaConfig: {name} must be None or a number > 0, got {value!r}")
        rd, hd = self.rotary_dim, self.head_dim
        if rd is not None and (isinstance(rd, bool) or not isinstance(rd, int) or rd % 2 or not 2 <= rd <= hd):
            raise GraphBuildError(f"LlamaConfig: rotary_dim must be None or even in [2, {self.head_dim}], got {rd!r}")
        local = self.local_rope_layers
        if not isinstance(local, tuple) or any(isinstance(i, bool) or not isinstance(i, int) for i in local) or (
            local and (self.local_rope_theta is None or not all(0 <= i < self.layers for i in local))
        ):
            raise GraphBuildError(
                f"LlamaConfig: local_rope_layers {local!r} must be a tuple of layer indices below {self.layers}, "
                "with local_rope_theta set"
            )

    def rope(self, layer: int) -> tuple[float, dict[str, Any] | None]:
        """Rope's theta and scaling on ``layer``: local_rope_theta, unscaled, on the local_rope_layers."""
        if layer in self.local_rope_layers:
            return self.local_rope_theta, None
        return self.rope_theta, self.rope_scaling

    def later_variants(self) -> list[str]:
        """The fields of the variants added with Gemma, Phi-3 and OLMo 2 that this config sets (builders
        that do not make them yet refuse such a config by these names)."""
        return [name for name in LATER_VARIANTS if getattr(self, name) != LATER_VARIANTS[name]]

    def norm_names(self) -> tuple[str, ...]:
        """A layer's norms (names before ``.weight``), in the order the layer applies them."""
        return NORM_NAMES[self.norms]

    def window(self, layer: int) -> int | None:
        """The sliding attention window of ``layer`` (None: it attends to every earlier position)."""
        if self.sliding_layers is not None and layer not in self.sliding_layers:
            return None
        return self.sliding_window

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter's name and shape, in checkpoint naming."""
        d = self.hidden
        shapes: dict[str, tuple[int, ...]] = {}
        if self.vocab is not None:
            shapes["model.embed_tokens.weight"] = (self.vocab, d)
        for i in range(self.layers):
            p = f"model.layers.{i}."
            norms = self.norm_names()  # (in the order random_parameters has always drawn Llama's)
            shapes.update({f"{p}{n}.weight": (d,) for n in norms if n == "input_layernorm"})
            for name, shape in self.attention_shapes().items():
                shapes[p + "self_attn." + name] = shape
            shapes.update({f"{p}{n}.weight": (d,) for n in norms if n != "input_layernorm"})
            for name, shape in self.mlp_shapes().items():
                shapes[p + "mlp." + name] = shape
        shapes["model.norm.weight"] = (d,)
        if self.vocab is not None and not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab, d)
        return shapes

    def attention_shapes(self) -> dict[str, tuple[int, ...]]:
        """A layer's attention parameters (names under ``self_attn.``) and shapes."""
        d, hd = self.hidden, self.head_dim
        out = {n: (self.kv_heads * hd if n in "kv" else self.heads * hd, d) for n in "qkv"}
        shapes = {f"{n}_proj.weight": s for n, s in out.items()}
        shapes["o_proj.weight"] = (d, self.heads * hd)
        if self.qkv_bias:
            shapes.update({f"{n}_proj.bias": (s[0],) for n, s in out.items()})
        if self.o_bias:
            shapes["o_proj.bias"] = (d,)
        if self.qk_norm and self.qk_norm_over == "head":
            shapes.update({"q_norm.weight": (hd,), "k_norm.weight": (hd,)})
        elif self.qk_norm:
            shapes.update({"q_norm.weight": out["q"][:1], "k_norm.weight": out["k"][:1]})
        return shapes

    def mlp_shapes(self) -> dict[str, tuple[int, ...]]:
        """A layer's MLP parameters (names under ``mlp.``) and shapes."""
        d, f = self.hidden, self.intermediate
        shapes = {"gate_proj.weight": (f, d), "up_proj.weight": (f, d), "down_proj.weight": (d, f)}
        if self.mlp_bias:
            shapes.update({"gate_proj.bias": (f,), "up_proj.bias": (f,), "down_proj.bias": (d,)})
        return shapes


NORMS = ("pre", "sandwich", "post")
NORM_NAMES = {
    "pre": ("input_layernorm", "post_attention_layernorm"),
    "sandwich": (
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    ),
    "post": ("post_attention_layernorm", "post_feedforward_layernorm"),
}
ACTIVATIONS = ("silu", "gelu_tanh")
LATER_VARIANTS = {
    "norms": "pre", "qk_norm_over": "head", "norm_offset": 0.0, "activation": "silu", "embed_scale": None,
    "attn_scale": None, "attn_softcap": None, "final_softcap": None, "rotary_dim": None, "local_rope_theta": None,
    "local_rope_layers": (),
}  # fmt: skip


def random_parameters(cfg: LlamaConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Weights drawn like a trained model's scale (float32; evaluation rounds them to cfg.dtype)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in cfg.parameter_shapes().items():
        if name.endswith("norm.weight"):
            out[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        elif name.endswith(".bias"):
            out[name] = (0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            out[name] = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
    return out


# Decode attention is one tile per (sequence, query head) unless the cache is split into key ranges:
# a few long tiles take longer than several short ones and their merge (docs/experiments.md).
# "auto" splits single-token steps until about this many tiles, keeping at least 64 keys a range.
AUTO_SPLIT_TILES = 128
AUTO_SPLIT_MAX = 8
AUTO_SPLIT_MIN_KEYS = 64


def auto_kv_splits(cfg: LlamaConfig, batch: int, tokens: int) -> int | None:
    """How many key ranges ``kv_splits="auto"`` gives attention: decode (one token) only."""
    if tokens != 1:
        return None
    splits = min(AUTO_SPLIT_MAX, AUTO_SPLIT_TILES // (batch * cfg.heads), cfg.max_seq // AUTO_SPLIT_MIN_KEYS)
    return splits if splits > 1 else None


def attention_block(
    g: Graph, cfg: LlamaConfig, x: Tensor, positions: Tensor, layer: int, kv_splits: int | str | None = "auto"
) -> Tensor:
    """``x`` [batch, tokens, hidden] (normed): the q, k and v projections, q and k rotated at their
    positions, the new keys and values written into the caches, attention over them (``kv_splits``:
    its keys in that many ranges, "auto": ``auto_kv_splits``), the output projection."""
    b, t = positions.shape
    if kv_splits == "auto":
        kv_splits = auto_kv_splits(cfg, b, t)
    hd, p = cfg.head_dim, f"model.layers.{layer}.self_attn."
    w = {name: g.parameter(p + name, shape, cfg.dtype) for name, shape in cfg.attention_shapes().items()}

    def heads(n: str, count: int) -> Tensor:  # the n projection, [b, t, count*hd] -> [b, count, t, hd] (a view)
        y = ops.linear(x, w[f"{n}_proj.weight"], w.get(f"{n}_proj.bias"))
        if f"{n}_norm.weight" in w and cfg.qk_norm_over == "projection":  # OLMo 2: the whole projection
            y = norm(cfg, y, w[f"{n}_norm.weight"])
        y = y.reshape(b, t, count, hd)
        if f"{n}_norm.weight" in w and cfg.qk_norm_over == "head":  # Qwen3, Gemma 3: each head before rope
            y = norm(cfg, y, w[f"{n}_norm.weight"])
        return y.transpose(1, 2)

    rope_pos = positions.reshape(b, 1, t)
    cache_shape = (b, cfg.kv_heads, cfg.max_seq, hd)
    q = rotate(cfg, layer, heads("q", cfg.heads), positions, rope_pos)
    k = heads("k", cfg.kv_heads)
    v = heads("v", cfg.kv_heads)
    k_cache = g.state(p + "k_cache", cache_shape, cfg.dtype)
    k_all = ops.kv_cache_update(k_cache, rotate(cfg, layer, k, positions, rope_pos), positions)
    v_all = ops.kv_cache_update(g.state(p + "v_cache", cache_shape, cfg.dtype), v, positions)
    o = ops.attention(
        q, k_all, v_all, causal=True, q_positions=positions, window=cfg.window(layer), kv_splits=kv_splits,
        scale=cfg.attn_scale, softcap=cfg.attn_softcap,
    )  # fmt: skip
    o = o.transpose(1, 2).reshape(b, t, cfg.heads * hd)
    return ops.linear(o, w["o_proj.weight"], w.get("o_proj.bias"))


def rotate(cfg: LlamaConfig, layer: int, x: Tensor, positions: Tensor, pos: Tensor) -> Tensor:
    """Rope of ``x`` [b, heads, t, hd] at ``positions`` [b, t] (``pos``: them as [b, 1, t]) with the
    layer's theta and scaling.
    longrope (Phi-3) turns the step by its short factors, or by its long ones when a position of the
    step (of any sequence) is at original_max_position_embeddings or past it, as transformers does;
    then both are scaled by its attention_factor."""
    theta, scaling = cfg.rope(layer)
    if scaling is None or scaling["type"] != "longrope":
        return ops.rope(x, pos, theta=theta, scaling=scaling, rotary_dim=cfg.rotary_dim)
    turn = {name: {"type": "longrope", "factors": scaling[name]} for name in ("short_factor", "long_factor")}
    y = ops.rope(x, pos, theta=theta, scaling=turn["short_factor"], rotary_dim=cfg.rotary_dim)
    if cfg.max_seq > scaling["original_max_position_embeddings"] and turn["long_factor"] != turn["short_factor"]:
        long = ops.rope(x, pos, theta=theta, scaling=turn["long_factor"], rotary_dim=cfg.rotary_dim)
        y = ops.where(ops.greater_equal(ops.max(positions), scaling["original_max_position_embeddings"]), long, y)
    factor, rd, hd = scaling["attention_factor"], cfg.rotary_dim or cfg.head_dim, cfg.head_dim
    if factor == 1.0 or rd == hd:
        return y if factor == 1.0 else y * factor
    # only the rotated dims are scaled (transformers scales cos and sin)
    scale = np.concatenate([np.full(rd, factor), np.ones(hd - rd)]).astype(np.float32)
    return y * x.graph.constant(scale, cfg.dtype, name=f"rope_attention_factor_{len(x.graph.nodes)}")


def norm(cfg: LlamaConfig, x: Tensor, weight: Tensor) -> Tensor:
    """RMSNorm over x's last axis, multiplied by (cfg.norm_offset + weight) (Gemma's 1 + w)."""
    return ops.rmsnorm(x, weight + cfg.norm_offset if cfg.norm_offset else weight, eps=cfg.rms_eps)


def mlp_block(g: Graph, cfg: LlamaConfig, x: Tensor, layer: int) -> Tensor:
    """``x`` [batch, tokens, hidden] (normed): SwiGLU, silu(x @ gate.T) * (x @ up.T), or GeGLU (gelu's
    tanh form for silu), then the down projection."""
    p = f"model.layers.{layer}.mlp."
    w = {name: g.parameter(p + name, shape, cfg.dtype) for name, shape in cfg.mlp_shapes().items()}
    gate = ops.linear(x, w["gate_proj.weight"], w.get("gate_proj.bias"))
    up = ops.linear(x, w["up_proj.weight"], w.get("up_proj.bias"))
    # silu(gate) * up as one op (silu kept in float32: Hugging Face's LlamaMLP rounds it to the model's
    # dtype before the product, so results differ by that rounding)
    gated = ops.silu_mul(gate, up) if cfg.activation == "silu" else ops.gelu(gate, approximate="tanh") * up
    return ops.linear(gated, w["down_proj.weight"], w.get("down_proj.bias"))


def decoder_layer(
    g: Graph, cfg: LlamaConfig, x: Tensor, positions: Tensor, layer: int, kv_splits: int | str | None = "auto"
) -> Tensor:
    h, update = decoder_layer_parts(g, cfg, x, None, positions, layer, kv_splits)
    with g.scope(f"layers.{layer}"), g.scope("mlp"):
        return h + update


def decoder_layer_parts(
    g: Graph,
    cfg: LlamaConfig,
    x: Tensor,
    update: Tensor | None,
    positions: Tensor,
    layer: int,
    kv_splits: int | str | None = "auto",
) -> tuple[Tensor, Tensor]:
    """The layer on the residual stream ``x + update`` (``x`` alone when ``update`` is None), returned
    the same way: ``(h, mlp)`` whose sum is the layer's output (the next layer, or the head, adds
    them: the sum is made in the scope of the layer it ends)."""
    p = f"model.layers.{layer}."
    stream = x
    if update is not None:  # the previous layer's output, summed where a profile looks for it
        with g.scope(f"layers.{layer - 1}"), g.scope("mlp"):
            stream = x + update
    with g.scope(f"layers.{layer}"):
        ln = {n: g.parameter(f"{p}{n}.weight", (cfg.hidden,), cfg.dtype) for n in cfg.norm_names()}
        before = ln.get("input_layernorm")
        after = ln.get("post_attention_layernorm") if cfg.norms != "pre" else None
        with g.scope("attn"):
            normed = norm(cfg, stream, before) if before is not None else stream
            attn = attention_block(g, cfg, normed, positions, layer, kv_splits)
            h = stream + (norm(cfg, attn, after) if after is not None else attn)
        before = ln["post_attention_layernorm"] if cfg.norms == "pre" else ln.get("pre_feedforward_layernorm")
        after = ln.get("post_feedforward_layernorm")
        with g.scope("mlp"):
            mlp = mlp_block(g, cfg, norm(cfg, h, before) if before is not None else h, layer)
            return h, norm(cfg, mlp, after) if after is not None else mlp


def _require_config(cfg: Any, who: str) -> None:
    if not isinstance(cfg, LlamaConfig):
        raise GraphBuildError(f"{who}: cfg must be a LlamaConfig, got {type(cfg).__name__} {cfg!r:.60}")


def build_llama(
    cfg: LlamaConfig,
    batch: int,
    tokens: int,
    name: str = "llama",
    *,
    kv_splits: int | str | None = "auto",
) -> Graph:
    """One step of the model for ``tokens`` new tokens per sequence. ``kv_splits`` splits each
    attention's cache into that many key ranges computed by separate tiles (decode over a long cache);
    "auto" (the default) does so for single-token steps (``auto_kv_splits``), None never.

    Inputs: ``positions`` int64 [batch, tokens] (where the new tokens go in the cache) and either
    ``tokens`` int64 [batch, tokens] (when cfg.vocab is set) or ``hidden`` [batch, tokens, hidden].
    Outputs: ``logits`` [batch, tokens, vocab] (with a vocabulary) or ``hidden``. The graph is plain
    (norms, products, rope, cache writes, attention apart); ``make_plan`` fuses them (megaloop.fuse).
    """
    _require_config(cfg, "build_llama")
    batch = as_int(batch, "build_llama: batch", minimum=1)
    tokens = as_int(tokens, "build_llama: tokens", minimum=1)
    if tokens > cfg.max_seq:
        raise GraphBuildError(f"build_llama: {tokens} tokens do not fit a cache of max_seq={cfg.max_seq}")
    g = Graph(name)
    positions = g.input("positions", (batch, tokens), "int64")
    if cfg.vocab is not None:
        x = g.input("tokens", (batch, tokens), "int64")
    else:
        x = g.input("hidden", (batch, tokens, cfg.hidden), cfg.dtype)
    out = _model(g, cfg, x, positions, kv_splits)
    g.output("hidden" if cfg.vocab is None else "logits", out)
    return g


def build_llama_prefill(
    cfg: LlamaConfig, batch: int, tokens: int, name: str = "llama-prefill", *, kv_splits: int | str | None = "auto"
) -> Graph:
    """A prompt step (``build_llama``'s inputs and KV caches) that returns only the logits each
    sequence's next token is chosen from: those of its last prompt token, ``last`` int64 [batch]
    (an index into the step's tokens), so that prompts of different lengths share one padded step.
    That row of the residual stream is picked (the others zeroed and summed away) before the final
    norm and the LM head, which then run on one row a sequence. Output: ``logits`` [batch, 1, vocab];
    ``last`` outside [0, tokens) is the caller's error."""
    if cfg.vocab is None:
        raise GraphBuildError("build_llama_prefill: the model needs a vocabulary (cfg.vocab)")
    if tokens > cfg.max_seq:
        raise GraphBuildError(f"build_llama_prefill: {tokens} tokens do not fit a cache of max_seq={cfg.max_seq}")
    g = Graph(name)
    positions = g.input("positions", (batch, tokens), "int64")
    ids = g.input("tokens", (batch, tokens), "int64")
    last = g.input("last", (batch,), "int64")
    x, update = _decoder(g, cfg, ids, positions, kv_splits)
    with g.scope("head"):
        stream = x if update is None else x + update
        # the row kept, the others zeros, summed over the tokens: exactly that row, by an op per sequence
        # (so that data parallelism cuts the batch through it, not just ``last``)
        index = g.constant(np.arange(tokens, dtype=np.int64).reshape(1, tokens, 1), "int64", name="token_index")
        picked = ops.sum(ops.where(ops.equal(index, last.reshape(batch, 1, 1)), stream, 0.0), axis=1, keepdims=True)
    g.output("logits", _head(g, cfg, picked, None))
    return g


# The next token's argmax over the vocabulary, split into ranges of about this many logits (argmax's
# splits: a range a tile, each starting once the LM head's tiles over it end, then one combine), not a
# long stage on one processor (docs/experiments.md). At most ARGMAX_MAX_SPLITS ranges (one round).
ARGMAX_RANGE = 1024
ARGMAX_MAX_SPLITS = 128


def auto_argmax_splits(cfg: LlamaConfig) -> int | None:
    """How many ranges ``argmax_splits="auto"`` splits the vocabulary into (None: one)."""
    splits = min(ARGMAX_MAX_SPLITS, -(-(cfg.vocab or 0) // ARGMAX_RANGE))
    return splits if splits > 1 else None


def build_llama_generator(
    cfg: LlamaConfig,
    batch: int,
    name: str = "llama-generate",
    *,
    kv_splits: int | str | None = "auto",
    argmax_splits: int | str | None = "auto",
    sampling: bool = False,
    eos_ids: Sequence[int] = (),
    decoding: Decoding = PLAIN,
) -> Graph:
    """Decoding that feeds itself: each loop iteration runs one decode step on the ``token`` at
    ``position`` (both states), records that token in ``generated`` at its position, and makes the
    next token (the argmax of the logits, or with ``sampling`` a draw of ``ml.sample``) and position + 1
    the next iteration's token and position. One ``run(iterations=n)`` then generates n tokens with no
    host work between them.

    States (besides the KV caches, named as in ``build_llama``): ``token`` int64 [batch, 1] (set it to
    the first token to feed, e.g. the argmax of the prefill's last logits), ``position`` int64
    [batch, 1] (where that token goes: the prompt length), ``generated`` float32
    [batch, 1, max_seq, 1] (token ids by position; float32 holds ids below 2^24 exactly), ``stop``
    int64 [batch, 1] (initially max_seq): a sequence whose position has reached its stop, or whose
    token is one of ``eos_ids``, is finished: its token and position no longer change and nothing more
    is written to ``generated`` (its decode step still runs, at min(position, max_seq - 1), rewriting
    its own last cache slot). So ``generated[b, 0, p, 0]`` for prompt length <= p < final position are
    the tokens fed, an end-of-sequence token stays in ``token`` unwritten.
    With ``sampling``, also ``temperature`` float32 (initially 1.0; 0: the argmax), ``top_k`` int64
    (0: off), ``top_p`` float32 (1.0: off) and ``seed`` int64 (initially the row: 0, 1, ...), all
    [batch, 1]: the next token is ``ml.sample(logits, seed, position, temperature, top_k, top_p)`` (the
    offset is the position of the token whose logits are sampled; sample the prefill's last logits with
    offset prompt length - 1 to continue the scheme). Rows draw independently only if their seeds
    differ: a sequence's draws depend on its seed and positions alone, not on its batch slot.
    Output: ``logits`` [batch, 1, vocab] of the last step. ``argmax_splits``: the next token's argmax
    (or draw) in that many ranges of the vocabulary, each a tile ("auto": ranges of about ARGMAX_RANGE
    logits); the same tokens whatever it is. ``decoding``: penalties before the choice and log-probabilities
    recorded each step, with their states (megaloop.models.decoding); ``min_p`` is a sampling state too.
    """
    _require_config(cfg, "build_llama_generator")
    if cfg.vocab is None:
        raise GraphBuildError("build_llama_generator: the model needs a vocabulary (cfg.vocab) to pick tokens")
    batch = as_int(batch, "build_llama_generator: batch", minimum=1)
    eos = _eos_ids(cfg, eos_ids)
    g = Graph(name)
    token = g.state("token", (batch, 1), "int64")
    position = g.state("position", (batch, 1), "int64")
    history = g.state("generated", (batch, 1, cfg.max_seq, 1), "float32")
    stop = g.state("stop", (batch, 1), "int64", init=np.full((batch, 1), cfg.max_seq, np.int64))
    active = _still_generating(g, token, position, stop, eos)
    # the token a finished sequence keeps, read at the start: the last op then reads no state (a state
    # read by the op that makes its next value costs a copy after it, on the path to the next step)
    kept = ops.where(active, 0, token)
    written = ops.where(active, position, -1)  # a finished sequence writes nothing
    ops.kv_cache_update(history, token.astype("float32").reshape(batch, 1, 1, 1), written, ignore_negative=True)
    logits = _model(g, cfg, token, ops.minimum(position, cfg.max_seq - 1), kv_splits)
    if argmax_splits == "auto":
        argmax_splits = auto_argmax_splits(cfg)
    chosen = next_token(g, logits, token, position, active, written, argmax_splits, sampling, decoding)
    g.assign(token, ops.where(active, chosen, kept))
    g.assign(position, ops.where(active, position + 1, position))
    g.output("logits", logits)
    return g


def _model(g: Graph, cfg: LlamaConfig, x: Tensor, positions: Tensor, kv_splits: int | str | None) -> Tensor:
    """Embedding (when ``x`` holds token ids), the decoder layers, the final norm and the LM head."""
    x, update = _decoder(g, cfg, x, positions, kv_splits)
    return _head(g, cfg, x, update)


def _decoder(
    g: Graph, cfg: LlamaConfig, x: Tensor, positions: Tensor, kv_splits: int | str | None
) -> tuple[Tensor, Tensor | None]:
    """Embedding (when ``x`` holds token ids) and the decoder layers: the residual stream as
    ``(x, update)``, whose sum it is (decoder_layer_parts)."""
    if cfg.vocab is not None:
        x = ops.embedding(g.parameter("model.embed_tokens.weight", (cfg.vocab, cfg.hidden), cfg.dtype), x)
        if cfg.embed_scale is not None:  # rounded to the model's dtype first, as transformers' Gemma does
            x = x * float(round_to(np.asarray(cfg.embed_scale, np.float32), cfg.dtype).astype(np.float32))
    update = None
    for layer in range(cfg.layers):
        x, update = decoder_layer_parts(g, cfg, x, update, positions, layer, kv_splits)
    return x, update


def _head(g: Graph, cfg: LlamaConfig, x: Tensor, update: Tensor | None) -> Tensor:
    """The final norm of the stream ``x + update`` and the LM head (the embedding when tied)."""
    weight = g.parameter("model.norm.weight", (cfg.hidden,), cfg.dtype)
    normed = norm(cfg, x if update is None else x + update, weight)
    if cfg.vocab is None:
        return normed
    if cfg.tie_word_embeddings:
        logits = ops.linear(normed, g.parameters["model.embed_tokens.weight"])
    else:
        logits = ops.linear(normed, g.parameter("lm_head.weight", (cfg.vocab, cfg.hidden), cfg.dtype))
    if cfg.final_softcap is None:
        return logits
    return ops.tanh(logits / cfg.final_softcap) * cfg.final_softcap  # (Gemma 2's softcapping)


def _eos_ids(cfg: LlamaConfig, eos_ids: Sequence[int]) -> tuple[int, ...]:
    """The end-of-sequence ids, checked against the vocabulary."""
    ids = tuple(eos_ids)
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= int(i) < (cfg.vocab or 0):
            raise GraphBuildError(
                f"build_llama_generator: eos_ids must be token ids in [0, {cfg.vocab}), got {i!r} in {list(ids)}"
            )
    return tuple(sorted({int(i) for i in ids}))


def _still_generating(g: Graph, token: Tensor, position: Tensor, stop: Tensor, eos: tuple[int, ...]) -> Tensor:
    """bool [batch, 1]: the sequence has not reached its stop position and its token is no end-of-sequence."""
    active = ops.less(position, stop)
    if len(eos) == 1:
        active = ops.logical_and(active, ops.not_equal(token, eos[0]))
    elif eos:  # every id in one comparison: [batch, ids] hits summed
        hits = ops.equal(token, g.constant(np.array(eos, np.int64), name="eos_ids"))
        active = ops.logical_and(active, ops.equal(ops.sum(hits.astype("int64"), -1, keepdims=True), 0))
    return active

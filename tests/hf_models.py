"""Tiny random models of each family megaloop loads, made and saved by transformers itself (the
installed version's layout), for tests that compare megaloop with transformers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SIZE = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 96,
    "max_position_embeddings": 64,
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
# name: (config class, settings)
FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "llama3-tied": ("LlamaConfig", {"rope_parameters": LLAMA3_ROPE, "tie_word_embeddings": True}),
    "llama-linear-bias": (
        "LlamaConfig",
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}, "attention_bias": True,
         "mlp_bias": True},
    ),
    "mistral-window": ("MistralConfig", {"sliding_window": 5, "head_dim": 16}),
    "qwen2": ("Qwen2Config", {"rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}),
    "qwen2-window": ("Qwen2Config", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}),
    "qwen3": ("Qwen3Config", {"head_dim": 16, "tie_word_embeddings": True}),
    # Gemma 2: sandwich norms, (1 + w) weights, GeGLU, scaled embeddings, softcapped scores and logits,
    # query_pre_attn_scalar; layer 0 sliding (window 5), layer 1 global
    "gemma2": (
        "Gemma2Config",
        {"head_dim": 16, "sliding_window": 5, "query_pre_attn_scalar": 24, "attn_logit_softcapping": 3.0,
         "final_logit_softcapping": 4.0, "num_hidden_layers": 3},
    ),
    # Gemma 3: per-head q/k norms, a local rope base on the sliding layers (0 and 1), linear scaling on the global one
    "gemma3": (
        "Gemma3TextConfig",
        {"head_dim": 16, "sliding_window": 4, "query_pre_attn_scalar": 16, "num_hidden_layers": 3,
         "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
         "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                             "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0}}},
    ),
    # Phi-3 128k-style: fused qkv and gate_up, longrope switching to its long factors at position 16, a
    # sliding window (6) on every layer
    "phi3-longrope": (
        "Phi3Config",
        {"original_max_position_embeddings": 16, "pad_token_id": 0, "sliding_window": 6,
         "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.2, 1.5, 2.0],
                             "long_factor": [1.0, 2.0, 4.0, 8.0], "original_max_position_embeddings": 16}},
    ),
    # Phi-4-mini-style: 3/4 of each head rotated, tied embeddings, longrope with a given attention_factor
    "phi4-mini": (
        "Phi3Config",
        {"hidden_size": 64, "tie_word_embeddings": True, "original_max_position_embeddings": 16, "pad_token_id": 0,
         "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                             "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                             "long_factor": [1.0, 3.0, 5.0, 7.0, 9.0, 11.0],
                             "original_max_position_embeddings": 16, "attention_factor": 1.25}},
    ),
    # OLMo 2: norms after attention and MLP, q/k norms over the whole projections
    "olmo2": ("Olmo2Config", {"pad_token_id": 0, "eos_token_id": 1}),
}  # fmt: skip


def make_model(name: str, folder: Path, seed: int = 0, **changes):
    """The family's tiny model (its settings with ``changes``) with weights of a trained model's scale
    (transformers' init is 0.02, whose logits are all but flat), saved to ``folder``; returns the model
    (float32, eval mode)."""
    cls_name, settings = FAMILIES[name]
    config = getattr(transformers, cls_name)(**{**SIZE, **settings, **changes}, attn_implementation="eager")
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    _trained_scale(model)
    model.save_pretrained(folder)
    return model


def to_4x_layout(folder: Path) -> dict:
    """Rewrite config.json the way transformers 4.x wrote it (rope_theta + rope_scaling, torch_dtype)."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    kind = rope.pop("rope_type")
    config["rope_scaling"] = None if kind == "default" else {"rope_type": kind, **rope}
    config["torch_dtype"] = config.pop("dtype")
    config["transformers_version"] = "4.46.0"
    path.write_text(json.dumps(config, indent=2))
    return config


def shrink(published: dict) -> dict:
    """A published config.json made tiny (2 layers, 8 or 9 heads of 8, vocabulary 96, token ids
    within it), every other field as published: the same ratio of query to key/value heads, a
    head_dim apart from hidden/heads where the model has one (Qwen3)."""
    heads = published["num_attention_heads"]
    ratio = heads // (published.get("num_key_value_heads") or heads)
    tiny_heads = 9 if heads == 9 else 8
    out = {**published, "num_attention_heads": tiny_heads, "num_key_value_heads": max(1, tiny_heads // ratio)}
    out.update(hidden_size=8 * tiny_heads, intermediate_size=48, num_hidden_layers=2, vocab_size=96)
    if "head_dim" in published:
        out["head_dim"] = 8 if published["head_dim"] * heads == published["hidden_size"] else 16
    _shrink_longrope(published, out)
    for key, value in published.items():  # token ids into the small vocabulary (transformers checks pad's)
        if key.endswith("_token_id") and isinstance(value, int):
            out[key] = value % 96
        elif key.endswith("_token_id") and isinstance(value, list):
            out[key] = [v % 96 for v in value]
    return out


def _shrink_longrope(published: dict, out: dict) -> None:
    """longrope's factor lists cut to the tiny head's rotary pairs (their first ones)."""
    for field in ("rope_scaling", "rope_parameters"):
        rope = published.get(field)
        if isinstance(rope, dict) and "short_factor" in rope:
            head = out.get("head_dim") or out["hidden_size"] // out["num_attention_heads"]
            pairs = int(head * rope.get("partial_rotary_factor", published.get("partial_rotary_factor", 1.0))) // 2
            out[field] = {**rope, **{k: rope[k][:pairs] for k in ("short_factor", "long_factor")}}


def make_published(config: dict, folder: Path, seed: int = 0):
    """A tiny random model of ``config``'s architecture built by transformers from that very
    config.json, its weights saved beside it; returns the model (float32, eval mode)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    hf_config = transformers.AutoConfig.from_pretrained(folder)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager").float().eval()
    _trained_scale(model)
    model.save_pretrained(folder / "saved")  # the weights; config.json stays as published
    (folder / "model.safetensors").write_bytes((folder / "saved" / "model.safetensors").read_bytes())
    return model


def _trained_scale(model) -> None:
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif pname.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]))

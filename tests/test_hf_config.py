"""config.json -> LlamaConfig: what each family's fields build, and every refused field named in
its CheckpointError (table-driven; the tables are what megaloop promises about configs)."""

from __future__ import annotations

import re

import pytest

from megaloop.errors import CheckpointError
from megaloop.models.hf_config import llama_config
from tests.published_configs import PUBLISHED

BASE = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "vocab_size": 100,
    "max_position_embeddings": 256,
}
FAMILY = {
    "llama": {"model_type": "llama", "architectures": ["LlamaForCausalLM"]},
    "mistral": {"model_type": "mistral", "architectures": ["MistralForCausalLM"]},
    "qwen2": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]},
    "qwen3": {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]},
    "gemma2": {"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"], "head_dim": 16},
    "gemma3_text": {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "head_dim": 16},
    "phi3": {"model_type": "phi3", "architectures": ["Phi3ForCausalLM"]},
    "olmo2": {"model_type": "olmo2", "architectures": ["Olmo2ForCausalLM"]},
}
SHORT, LONG = [1.0, 1.1, 1.2, 1.4, 1.6, 2.0, 2.5, 3.0], [1.0, 2.0, 4.0, 8.0, 16.0, 24.0, 32.0, 40.0]


def config(family: str = "llama", **fields) -> dict:
    out = {**BASE, **FAMILY[family], **fields}
    return {k: v for k, v in out.items() if v is not Ellipsis}  # ...: leave the field out


LLAMA3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}

# (config, the LlamaConfig fields it must give)
ACCEPTED = [
    pytest.param(config(rope_theta=500000.0, rope_scaling=LLAMA3, tie_word_embeddings=True, torch_dtype="bfloat16",
                        head_dim=16, attention_bias=False, mlp_bias=False, pretraining_tp=1),
                 {"rope_theta": 500000.0, "tie_word_embeddings": True, "dtype": "bfloat16", "head_dim": 16,
                  "rope_scaling": {"type": "llama3", **{k: float(v) for k, v in LLAMA3.items() if k != "rope_type"}}},
                 id="llama3.2-4.x"),
    pytest.param(config(rope_parameters={"rope_theta": 500000.0, **LLAMA3}, dtype="float32"),
                 {"rope_theta": 500000.0, "dtype": "float32", "rope_scaling": {"type": "llama3", "factor": 32.0,
                  "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192.0}},
                 id="llama3.2-5.x"),
    pytest.param(config(rope_scaling={"type": "linear", "factor": 2.0}),
                 {"rope_scaling": {"type": "linear", "factor": 2.0}}, id="llama-linear-4.x"),
    pytest.param(config(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0}),
                 {"rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 256.0}},
                 id="llama3-default-original-length"),
    pytest.param(config(rope_scaling={"rope_type": "default"}, max_sequence_length=2048, pad_token_id=0),
                 {"rope_scaling": None, "rope_theta": 10000.0, "rms_eps": 1e-6}, id="llama1"),
    pytest.param(config(attention_bias=True, mlp_bias=True),
                 {"qkv_bias": True, "o_bias": True, "mlp_bias": True}, id="llama-biases"),
    pytest.param(config(num_key_value_heads=None, head_dim=None), {"kv_heads": 4, "head_dim": 16}, id="llama-nulls"),
    pytest.param(config("mistral", sliding_window=32), {"sliding_window": 32, "sliding_layers": None}, id="mistral"),
    pytest.param(config("mistral", sliding_window=None), {"sliding_window": None}, id="mistral-v0.3"),
    pytest.param(config("mistral", sliding_window=...), {"sliding_window": None}, id="mistral-4096-over-256"),
    pytest.param(config("mistral", sliding_window=..., max_position_embeddings=8192), {"sliding_window": 4096},
                 id="mistral-default-window"),
    pytest.param(config("qwen2", use_sliding_window=False, sliding_window=32768, max_window_layers=21,
                        rope_theta=1000000.0, tie_word_embeddings=True),
                 {"qkv_bias": True, "o_bias": False, "sliding_window": None, "rope_theta": 1e6,
                  "tie_word_embeddings": True}, id="qwen2.5"),
    pytest.param(config("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=2),
                 {"sliding_window": 16, "sliding_layers": (2, 3)}, id="qwen2-window-layers"),
    pytest.param(config("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=0,
                        layer_types=["sliding_attention"] * 4), {"sliding_window": 16, "sliding_layers": None},
                 id="qwen2-all-sliding"),
    pytest.param(config("qwen2", use_sliding_window=False, layer_types=["full_attention"] * 4, num_key_value_heads=...,
                        num_attention_heads=32, hidden_size=256, rms_norm_eps=...),
                 {"sliding_window": None, "kv_heads": 32, "rms_eps": 1e-6}, id="qwen2-defaults"),
    pytest.param(config("qwen3", head_dim=32, rope_scaling=None, rope_theta=1000000, attention_bias=False),
                 {"qk_norm": True, "head_dim": 32, "qkv_bias": False, "rope_theta": 1e6}, id="qwen3"),
    pytest.param(config("qwen3", head_dim=...), {"head_dim": 128}, id="qwen3-default-head-dim"),
    pytest.param(config("qwen3", attention_bias=True), {"qkv_bias": True, "o_bias": True}, id="qwen3-bias"),
    pytest.param({**config(), "model_type": ...}, {"hidden": 64}, id="architectures-only"),
    # Gemma 2: sandwich norms of (1 + w), GeGLU, sqrt(hidden) embeddings, softcaps, every other layer sliding
    pytest.param(config("gemma2", sliding_window=32, hidden_act="gelu_pytorch_tanh", cache_implementation="hybrid"),
                 {"norms": "sandwich", "norm_offset": 1.0, "activation": "gelu_tanh", "embed_scale": 8.0,
                  "attn_scale": 1 / 16, "attn_softcap": 50.0, "final_softcap": 30.0, "sliding_window": 32,
                  "sliding_layers": (0, 2), "tie_word_embeddings": True, "rms_eps": 1e-6, "local_rope_theta": None},
                 id="gemma2-defaults"),
    pytest.param(config("gemma2", query_pre_attn_scalar=144, attn_logit_softcapping=None,
                        final_logit_softcapping=None, sliding_window=512),
                 {"attn_scale": 1 / 12, "attn_softcap": None, "final_softcap": None, "sliding_window": None},
                 id="gemma2-no-caps-window-past-context"),
    # Gemma 3: q/k norms per head, a local rope theta on sliding layers (4.x fields and 5.x's per layer type)
    pytest.param(config("gemma3_text", sliding_window=32, sliding_window_pattern=2, rope_local_base_freq=10000.0,
                        rope_theta=1000000.0, rope_scaling={"rope_type": "linear", "factor": 8.0}),
                 {"qk_norm": True, "qk_norm_over": "head", "sliding_layers": (0, 2), "local_rope_theta": 10000.0,
                  "local_rope_layers": (0, 2),
                  "rope_theta": 1e6, "rope_scaling": {"type": "linear", "factor": 8.0}, "attn_softcap": None,
                  "final_softcap": None}, id="gemma3-4.x"),
    pytest.param(config("gemma3_text", sliding_window=32, layer_types=["sliding_attention"] * 3 + ["full_attention"],
                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                         "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}),
                 {"sliding_layers": (0, 1, 2), "local_rope_theta": 10000.0, "rope_theta": 1e6, "rope_scaling": None},
                 id="gemma3-5.x"),
    pytest.param(config("gemma3_text", sliding_window=32, num_hidden_layers=6),
                 {"sliding_layers": (0, 1, 2, 3, 4), "local_rope_theta": 10000.0, "rope_theta": 1e6},
                 id="gemma3-default-pattern"),
    pytest.param(config("gemma3_text", sliding_window=512, sliding_window_pattern=2),
                 {"sliding_window": None, "sliding_layers": None, "local_rope_layers": (0, 2)},
                 id="gemma3-window-past-the-context"),
    # Phi-3: longrope (4.x "su", 5.x "longrope"), Phi-4-mini's partial rotary dims and its remote-code fields
    pytest.param(config("phi3", original_max_position_embeddings=64, sliding_window=2047,
                        rope_scaling={"type": "su", "short_factor": SHORT, "long_factor": LONG}),
                 {"rope_scaling": {"type": "longrope", "short_factor": tuple(SHORT), "long_factor": tuple(LONG),
                                   "original_max_position_embeddings": 64,
                                   "attention_factor": (1 + __import__("math").log(4) / __import__("math").log(64))
                                   ** 0.5}, "sliding_window": None, "norms": "pre"},
                 id="phi3-128k-4.x"),
    pytest.param(config("phi3", rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                 "partial_rotary_factor": 0.75, "short_factor": SHORT[:6],
                                                 "long_factor": LONG[:6], "original_max_position_embeddings": 64,
                                                 "attention_factor": 1.5},
                        auto_map={"AutoConfig": "configuration_phi3.Phi3Config"}, full_attn_mod=1,
                        interpolate_factor=1, lm_head_bias=False, attention_bias=False, mlp_bias=False),
                 {"rotary_dim": 12, "rope_scaling": {"type": "longrope", "short_factor": tuple(SHORT[:6]),
                                                     "long_factor": tuple(LONG[:6]),
                                                     "original_max_position_embeddings": 64,
                                                     "attention_factor": 1.5}}, id="phi4-mini-5.x"),
    pytest.param(config("phi3", sliding_window=32), {"sliding_window": 32, "sliding_layers": None, "qk_norm": False},
                 id="phi3-window"),
    # OLMo 2: norms after attention and MLP, q/k norms over the whole projections
    pytest.param(config("olmo2", attention_bias=False, rope_theta=500000),
                 {"norms": "post", "qk_norm": True, "qk_norm_over": "projection", "rope_theta": 500000.0},
                 id="olmo2"),
    pytest.param(config(hidden_act="swish", quantization_config=None, sliding_window=None), {"hidden": 64},
                 id="harmless-nulls"),
]


@pytest.mark.parametrize("cfg, expected", ACCEPTED)
def test_accepted_configs_build_these_models(cfg: dict, expected: dict) -> None:
    got = llama_config({k: v for k, v in cfg.items() if v is not Ellipsis})
    for field, value in expected.items():
        have = getattr(got, field)
        assert (have.name if field == "dtype" else have) == value, field


# (config, the field its error must name)
REFUSED = [
    (config(model_type="gemma"), "model_type"),
    (config(model_type=["llama"]), "model_type"),
    (config(rope_scaling={"rope_type": ["llama3"]}), "rope_type"),
    (config(architectures=["GemmaForCausalLM"]), "architectures"),
    (config(architectures=["LlamaForSequenceClassification"]), "architectures"),
    (config("qwen2", architectures=["LlamaForCausalLM"]), "architectures"),
    ({**config(), "model_type": ..., "architectures": ...}, "model_type"),
    (config(hidden_act="gelu"), "hidden_act"),
    (config(hidden_act="relu"), "hidden_act"),
    (config(rope_scaling="linear"), "rope_scaling"),
    (config(rope_parameters=["default"]), "rope_parameters"),
    (config(rope_theta="10000"), "rope_theta"),
    (config(rope_theta=0.5), "rope_theta"),
    (config(rope_theta=float("nan")), "rope_theta"),
    (config(rope_parameters={"rope_type": "default", "rope_theta": True}), "rope_parameters.rope_theta"),
    (config(rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}), "rope_type"),
    (config(rope_scaling={"type": "dynamic", "factor": 2.0}), "rope_type"),
    (config(rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0}), "rope_parameters.short_factor"),
    (config(rope_scaling={"type": "longrope", "short_factor": SHORT, "long_factor": LONG}),
     "original_max_position_embeddings"),
    (config("phi3", rope_scaling={"type": "longrope", "short_factor": SHORT[:3], "long_factor": LONG,
                                  "original_max_position_embeddings": 64}), "rope_scaling.short_factor"),
    (config("phi3", rope_scaling={"type": "longrope", "short_factor": SHORT, "long_factor": [1.0, -2.0],
                                  "original_max_position_embeddings": 64}), "rope_scaling.long_factor"),
    (config("phi3", partial_rotary_factor=0.1), "partial_rotary_factor"),
    (config("phi3", full_attn_mod=2), "full_attn_mod"),
    (config("phi3", lm_head_bias=True), "lm_head_bias"),
    (config("phi3", attention_bias=True), "attention_bias"),
    (config("gemma2", hidden_activation="gelu"), "hidden_activation"),
    (config("gemma2", hidden_activation=["gelu"]), "hidden_activation"),
    (config("gemma2", use_bidirectional_attention=True), "use_bidirectional_attention"),
    (config("gemma2", sliding_window=32, layer_types=["sliding_attention"] * 3), "layer_types"),
    (config("gemma2", sliding_window_pattern=3), "sliding_window_pattern"),
    (config("gemma2", query_pre_attn_scalar=0), "query_pre_attn_scalar"),
    (config("gemma2", attn_logit_softcapping="50"), "attn_logit_softcapping"),
    (config("gemma3_text", sliding_window=32, sliding_window_pattern=0), "sliding_window_pattern"),
    (config("gemma3_text", sliding_window=32, rope_local_base_freq=-1.0), "rope_local_base_freq"),
    (config("gemma3_text", sliding_window=32,
            rope_parameters={"sliding_attention": {"rope_type": "linear", "factor": 2.0},
                             "full_attention": {"rope_type": "default"}}), "rope_parameters.sliding_attention"),
    (config("gemma3_text", rope_parameters={"full_attention": {"rope_type": "yarn"},
                                            "sliding_attention": {"rope_type": "default"}}),
     "rope_parameters.full_attention.rope_type"),
    (config("olmo2", sliding_window=16), "sliding_window"),
    (config("olmo2", auto_map={"AutoModelForCausalLM": "modeling_olmo.OLMoForCausalLM"}), "auto_map"),
    (config(rope_scaling={"type": "linear"}), "rope_scaling.factor"),
    (config(rope_scaling={"type": "linear", "factor": "2"}), "rope_scaling.factor"),
    (config(rope_scaling={**LLAMA3, "high_freq_factor": 1.0}), "high_freq_factor"),
    (config(rope_scaling={**LLAMA3, "attention_factor": 2.0}), "rope_scaling.attention_factor"),
    (config(rope_parameters={"full_attention": {"rope_type": "default"}, "sliding_attention": {}}), "rope_parameters"),
    (config(rope_scaling={"type": "linear", "factor": 2.0}, rope_parameters={"rope_type": "default"}), "rope_scaling"),
    (config(partial_rotary_factor=0.5), "partial_rotary_factor"),
    (config(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.25}), "partial_rotary_factor"),
    (config(num_experts=8, num_experts_per_tok=2), "num_experts"),
    (config("mistral", num_local_experts=8), "num_local_experts"),
    (config("qwen2", moe_intermediate_size=64), "moe_intermediate_size"),
    (config(quantization_config={"quant_method": "gptq", "bits": 4}), "quantization_config"),
    (config(auto_map={"AutoModelForCausalLM": "modeling_x.XForCausalLM"}), "auto_map"),
    (config(sliding_window=4096), "sliding_window"),
    (config("mistral", attention_bias=True), "attention_bias"),
    (config("qwen2", mlp_bias=True), "mlp_bias"),
    (config("mistral", layer_types=["full_attention"] * 4), "layer_types"),
    (config("qwen2", layer_types=["chunked_attention"] * 4), "layer_types"),
    (config("qwen2", layer_types=["full_attention"] * 3), "layer_types"),
    (config("mistral", sliding_window=0), "sliding_window"),
    (config("qwen2", use_sliding_window="yes"), "use_sliding_window"),
    (config("qwen2", max_window_layers=-1, use_sliding_window=True), "max_window_layers"),
    (config(num_key_value_heads=3), "num_key_value_heads"),
    (config(hidden_size=-64), "hidden_size"),
    (config(hidden_size="64"), "hidden_size"),
    (config(hidden_size=62), "hidden_size"),  # not divisible by 4 heads, no head_dim
    (config(num_hidden_layers=2.0), "num_hidden_layers"),
    (config(vocab_size=0), "vocab_size"),
    (config(intermediate_size=True), "intermediate_size"),
    (config(max_position_embeddings=0), "max_position_embeddings"),
    (config(rms_norm_eps="1e-5"), "rms_norm_eps"),
    (config(rms_norm_eps=-1e-5), "rms_norm_eps"),
    (config(rms_norm_eps=None), "rms_norm_eps"),
    (config(head_dim=15), "head_dim"),
    (config(dtype="float8_e4m3fn"), "dtype"),
    (config(torch_dtype="int8"), "torch_dtype"),
    (config(torch_dtype=["bfloat16"]), "torch_dtype"),
    (config(tie_word_embeddings="yes"), "tie_word_embeddings"),
    (config(mlp_bias="true"), "mlp_bias"),
    (config(attention_bias=1), "attention_bias"),
    (config(pretraining_tp=0), "pretraining_tp"),
    (config(is_encoder_decoder=True), "is_encoder_decoder"),
    (config(final_logit_softcapping=30.0), "final_logit_softcapping"),
    (config("qwen3", use_qk_norm=False), "use_qk_norm"),
    (config(embedding_multiplier=12.0), "embedding_multiplier"),
]


@pytest.mark.parametrize("cfg, field", REFUSED, ids=[f"{i}-{f}" for i, (_, f) in enumerate(REFUSED)])
def test_refused_fields_are_named(cfg: dict, field: str) -> None:
    with pytest.raises(CheckpointError, match=rf"config\.json.*\b{re.escape(field)}\b") as info:
        llama_config({k: v for k, v in cfg.items() if v is not Ellipsis})
    print(info.value)


def test_missing_and_malformed() -> None:
    with pytest.raises(CheckpointError, match=r"lacks \['vocab_size'\]"):
        llama_config(config(vocab_size=...))
    with pytest.raises(CheckpointError, match="JSON object"):
        llama_config(["hidden_size"])  # type: ignore[arg-type]


def test_a_tied_checkpoint_may_store_the_head_only_as_the_embedding(tmp_path) -> None:
    import json

    import ml_dtypes

    from megaloop.models import LlamaConfig, load_llama, random_parameters, write_safetensors

    cfg = LlamaConfig(hidden=32, heads=4, kv_heads=2, intermediate=48, layers=1, vocab=40, tie_word_embeddings=True)
    params = {n: v.astype(ml_dtypes.bfloat16) for n, v in random_parameters(cfg).items()}
    (tmp_path / "config.json").write_text(json.dumps(config(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                                            vocab_size=40, tie_word_embeddings=True)))  # fmt: skip
    write_safetensors(tmp_path / "model.safetensors", {**params, "lm_head.weight": params["model.embed_tokens.weight"]})
    loaded_cfg, loaded = load_llama(tmp_path)
    assert loaded_cfg.tie_word_embeddings and "lm_head.weight" not in loaded
    other = params["model.embed_tokens.weight"].copy()
    other[0, 0] += 1
    (tmp_path / "model.safetensors").unlink()  # a new file: the loaded one stays mapped
    write_safetensors(tmp_path / "model.safetensors", {**params, "lm_head.weight": other})
    with pytest.raises(CheckpointError, match=r"lm_head\.weight differs from model\.embed_tokens\.weight"):
        load_llama(tmp_path)
    untied = config(hidden_size=32, intermediate_size=48, num_hidden_layers=1, vocab_size=40)
    (tmp_path / "config.json").write_text(json.dumps(untied))
    (tmp_path / "model.safetensors").unlink()
    write_safetensors(tmp_path / "model.safetensors", params)
    with pytest.raises(CheckpointError, match="tie_word_embeddings is false"):
        load_llama(tmp_path)


def test_any_config_gives_a_model_or_a_checkpoint_error() -> None:
    """Hostile configs: every field of every family set to values of every JSON type; only
    CheckpointError may come out (never a TypeError or KeyError from inside the reader)."""
    import random

    from megaloop.models.hf_config import FAMILIES, MODEL_FIELDS

    values = [None, True, False, 0, -1, 1, 3, 7.5, float("inf"), "", "silu", "llama3", [], [1], ["x"], {},
              {"rope_type": "llama3"}, {"type": "linear", "factor": 2}, {"a": {"b": 1}}]  # fmt: skip
    fields = sorted(MODEL_FIELDS | set().union(*(f.fields for f in FAMILIES.values())) | {"model_type", "layer_types"})
    rng = random.Random(0)
    built = 0
    for _ in range(3000):
        cfg = config(rng.choice(sorted(FAMILY)))
        for _ in range(rng.randint(1, 3)):
            cfg[rng.choice(fields)] = rng.choice(values)
        try:
            llama_config(cfg)
            built += 1
        except CheckpointError:
            pass
    assert built > 100  # the fuzz also reaches configs that build


# ---- fields as published checkpoints carry them --------------------------------------------------------
# (field, value, family): each leaves the model alone, so the config builds the same LlamaConfig as without it
NEUTRAL = [
    ("_name_or_path", "meta-llama/Llama-3.2-1B", "llama"),
    ("_model_name_or_path", "HuggingFaceTB/SmolLM2-135M-Instruct", "llama"),
    ("_commit_hash", "9b5b8d3", "llama"),
    ("_attn_implementation", "sdpa", "llama"),
    ("attn_implementation", "flash_attention_2", "qwen2"),
    ("_pre_quantization_dtype", "torch.bfloat16", "llama"),
    ("transformers_version", "4.42.3", "llama"),
    ("architectures", ["LlamaForCausalLM"], "llama"),
    ("model_type", "llama", "llama"),
    ("bos_token_id", 128000, "llama"),
    ("eos_token_id", [128001, 128008, 128009], "llama"),
    ("pad_token_id", -1, "llama"),  # Llama 1 conversions
    ("unk_token_id", 0, "llama"),
    ("sep_token_id", None, "llama"),
    ("decoder_start_token_id", 0, "mistral"),
    ("use_cache", False, "llama"),
    ("initializer_range", 0.041666666666666664, "llama"),
    ("gradient_checkpointing", True, "llama"),
    ("is_llama_config", True, "llama"),
    ("rope_interleaved", False, "llama"),
    ("rope_interleaved", None, "qwen3"),
    ("use_mrope", False, "qwen2"),
    ("transformers.js_config", {"kv_cache_dtype": {"q4f16": "float16", "fp16": "float16"}}, "llama"),
    ("unsloth_fixed", True, "llama"),
    ("unsloth_version", "2024.11.7", "qwen2"),
    ("attention_dropout", 0.0, "qwen3"),
    ("attention_dropout", 0.1, "llama"),  # dropout is off at inference, whatever training used
    ("hidden_dropout", 0.1, "llama"),
    ("embd_pdrop", 0.0, "llama"),
    ("resid_pdrop", 0.1, "mistral"),
    ("attention_probs_dropout_prob", 0.1, "llama"),
    ("pretraining_tp", 4, "llama"),  # how training split the matmuls
    ("max_sequence_length", 2048, "llama"),
    ("temperature", 0.7, "llama"),  # generation settings: the Generator's business, not the model's
    ("top_p", 0.9, "qwen2"),
    ("quantization_config", None, "llama"),
    ("auto_map", None, "llama"),
    ("final_logit_softcapping", None, "llama"),  # null: not set
    ("num_experts", None, "qwen2"),
    ("is_encoder_decoder", False, "llama"),
    ("is_encoder_decoder", None, "llama"),
    ("sliding_window", None, "llama"),  # another family's switch, off
    ("use_sliding_window", False, "llama"),
    ("tie_word_embeddings", False, "llama"),
    ("cache_implementation", "hybrid", "gemma2"),
    ("hidden_act", "gelu_pytorch_tanh", "gemma3_text"),  # Gemma's MLP reads hidden_activation
    ("use_bidirectional_attention", False, "gemma3_text"),
    ("final_logit_softcapping", None, "gemma3_text"),
    ("auto_map", {"AutoConfig": "configuration_phi3.Phi3Config"}, "phi3"),  # transformers' own Phi3 runs
    ("full_attn_mod", 1, "phi3"),
    ("interpolate_factor", 1, "phi3"),
    ("lm_head_bias", False, "phi3"),
    ("original_max_position_embeddings", 4096, "phi3"),  # read by longrope only
    ("resid_pdrop", 0.0, "phi3"),
]


@pytest.mark.parametrize("field, value, family", NEUTRAL, ids=[f"{f}={v!r:.20}" for f, v, _ in NEUTRAL])
def test_fields_that_change_nothing_are_accepted(field: str, value, family: str) -> None:
    import warnings

    base = llama_config(config(family))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # accepted outright, not ignored as unknown
        assert llama_config(config(family, **{field: value})) == base


# (field, value): refused, the message naming the field and the value
CHANGING = [
    ("rope_interleaved", "yes"),
    ("use_mrope", True),
    ("use_mrope", 0),
    ("mrope_section", [16, 24, 24]),
    ("attention_dropout", 1.5),
    ("attention_dropout", "0.1"),
    ("hidden_dropout", -0.1),
    ("num_experts", 8),
    ("num_experts_per_tok", 2),
    ("n_routed_experts", 64),
    ("final_logit_softcapping", 30.0),
    ("attn_logit_softcapping", 50.0),
    ("query_pre_attn_scalar", 256),
    ("logits_scaling", 8.0),
    ("residual_multiplier", 0.22),
    ("attention_multiplier", 0.0078125),
    ("no_rope_layers", [1, 1, 1, 0]),
    ("attention_chunk_size", 8192),
    ("use_qk_norm", True),
    ("vision_config", {"hidden_size": 1280}),
    ("is_decoder", True),
    ("pruned_heads", {"0": [1]}),
    ("quantization_config", {"quant_method": "bitsandbytes", "load_in_4bit": True}),
    ("frobnicate_layers", 3),  # unknown: could change anything
    ("rope_type", "default"),  # a rope key at the top level: not where transformers reads it
]


@pytest.mark.parametrize("field, value", CHANGING, ids=[f"{f}={v!r:.20}" for f, v in CHANGING])
def test_fields_that_change_the_model_are_refused_by_name_and_value(field: str, value) -> None:
    with pytest.raises(CheckpointError) as info:
        llama_config(config(**{field: value}))
    message = str(info.value)
    print(message)
    assert re.search(rf"config\.json: {re.escape(field)} = ", message) and repr(value)[:30] in message


def test_an_unknown_field_says_how_to_accept_it() -> None:
    import warnings

    cfg = config(frobnicate_layers=3, unsloth_fixed=True)
    with pytest.raises(CheckpointError, match=r"frobnicate_layers = 3: megaloop does not know") as info:
        llama_config(cfg)
    assert "allow_unknown_fields=True" in str(info.value) and "--allow-unknown-config-fields" in str(info.value)
    with pytest.warns(UserWarning, match=r"allow_unknown_fields.*\['frobnicate_layers'\]"):
        assert llama_config(cfg, allow_unknown_fields=True) == llama_config(config())
    for known in ({"num_experts": 8}, {"final_logit_softcapping": 30.0}, {"rope_theta": "x"}, {"use_mrope": True}):
        with warnings.catch_warnings(record=True) as seen, pytest.raises(CheckpointError, match=next(iter(known))):
            llama_config(config(**known, frobnicate_layers=3), allow_unknown_fields=True)  # still refused
        assert not seen  # and nothing said about ignoring


def test_max_seq_past_the_context_needs_the_opt_in() -> None:
    cfg = config(max_position_embeddings=256)
    assert llama_config(cfg).max_seq == 256 and llama_config(cfg, max_seq=256).max_seq == 256
    with pytest.raises(CheckpointError, match=r"max_seq 300 is past the model's context.*max_position_embeddings = 256"
                       ) as info:  # fmt: skip
        llama_config(cfg, max_seq=300)
    assert "allow_long_context=True" in str(info.value) and "--allow-long-context" in str(info.value)
    assert llama_config(cfg, max_seq=300, allow_long_context=True).max_seq == 300
    llama3 = config(max_position_embeddings=512, rope_scaling={**LLAMA3, "original_max_position_embeddings": 128})
    assert llama_config(llama3, max_seq=512).max_seq == 512  # llama3's scaled context is max_position_embeddings
    with pytest.raises(CheckpointError, match="max_position_embeddings = 512"):
        llama_config(llama3, max_seq=513)
    for bad in (0, True, 2.5):
        with pytest.raises(CheckpointError, match="max_seq must be an integer"):
            llama_config(cfg, max_seq=bad)


def test_interleaved_rope_is_for_load_llama() -> None:
    """A LlamaConfig computes half-split rope: a config with rope_interleaved true is refused here
    (load_llama permutes the checkpoint's q/k so that it fits, tests/test_hf_models.py)."""
    with pytest.raises(CheckpointError, match=r"rope_interleaved = True.*load_llama"):
        llama_config(config(rope_interleaved=True))


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_configs_load(name: str) -> None:
    """config.json of published checkpoints as they ship (tests/published_configs.py): each builds
    what the model is, with no field ignored as unknown."""
    import warnings

    published, expected = PUBLISHED[name]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = llama_config(published)
    for field, value in expected.items():
        have = getattr(got, field)
        assert (have.name if field == "dtype" else have) == value, field
    assert got.layers == published["num_hidden_layers"] and got.vocab == published["vocab_size"]

"""Hugging Face ``config.json`` -> LlamaConfig, for the families megaloop builds: Llama 1/2/3/3.1/3.2,
Mistral, Qwen2/2.5, Qwen3, Gemma 2, Gemma 3 (text), Phi-3/Phi-4-mini and OLMo 2.

Both layouts transformers writes are read: 4.x (``rope_theta``, ``rope_scaling``, ``torch_dtype``) and
5.x (``rope_parameters``, ``dtype``). Every field that changes the model is checked against what
megaloop builds; a value it does not implement (another model type or activation, a rope type, MoE
or quantization settings: CHANGES_THE_MODEL) is a CheckpointError naming the field and the value: a
model megaloop cannot build exactly is refused, never approximated. Fields that change nothing
(metadata, token ids, dropout, exporters' marks: IGNORED) are accepted; a field megaloop does not know
is refused unless the caller passes ``allow_unknown_fields``. Absent fields take the defaults of the
family's transformers configuration class (5.x), as transformers would. docs/generate.md has the lists.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from megaloop.dtypes import as_dtype
from megaloop.errors import CheckpointError, MegaloopError
from megaloop.models.llama import LlamaConfig


@dataclass(frozen=True)
class Family:
    """One model family: its transformers class, the config fields it adds to the common ones, the
    defaults transformers gives absent fields, and the parameters its architecture always has."""

    model_type: str
    architecture: str
    fields: frozenset[str]
    defaults: Mapping[str, Any]
    qkv_bias: bool = False  # Qwen2: q/k/v biases, no o bias, whatever the config says
    qk_norm: bool = False  # Qwen3: RMSNorm of each head's q and k
    # "all": sliding_window on every layer (Mistral, Phi-3); "qwen": use_sliding_window etc.; "types":
    # layer_types, else every window_pattern-th layer global, the others sliding (Gemma)
    windows: str = "none"
    window_pattern: int = 0
    # LlamaConfig fields the architecture fixes (Gemma's sandwich norms, OLMo 2's post norms, ...)
    builds: Mapping[str, Any] = field(default_factory=dict)
    activation_field: str = "hidden_act"  # where the MLP's activation is (Gemma: hidden_activation)
    embed_scale: bool = False  # embeddings times sqrt(hidden_size) (Gemma)
    partial_rotary: bool = False  # partial_rotary_factor honoured (Phi-3: Phi-4-mini rotates 3/4)
    fused: bool = False  # qkv_proj and gate_up_proj stored fused (Phi-3), split at load
    native_auto_map: bool = False  # transformers runs its own class, not the repository's code
    # fields of the family's remote code that transformers' class ignores, accepted at these values only
    neutral: Mapping[str, Any] = field(default_factory=dict)


_QWEN_WINDOW = frozenset({"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"})
_QWEN_DEFAULTS = {
    "num_key_value_heads": 32,
    "max_position_embeddings": 32768,
    "use_sliding_window": False,
    "sliding_window": 4096,
    "max_window_layers": 28,
}
_GEMMA_FIELDS = frozenset(
    {"attention_bias", "sliding_window", "layer_types", "query_pre_attn_scalar", "final_logit_softcapping",
     "attn_logit_softcapping", "hidden_activation", "use_bidirectional_attention", "cache_implementation"}
)  # fmt: skip
_GEMMA_DEFAULTS = {
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "rms_norm_eps": 1e-6,
}
_GEMMA_BUILDS = {"norms": "sandwich", "norm_offset": 1.0}
FAMILIES = {
    f.model_type: f
    for f in (
        Family(
            "llama",
            "LlamaForCausalLM",
            frozenset({"attention_bias", "mlp_bias", "pretraining_tp"}),
            {"max_position_embeddings": 2048},
        ),
        Family(
            "mistral",
            "MistralForCausalLM",
            frozenset({"sliding_window"}),
            {"num_key_value_heads": 8, "max_position_embeddings": 131072, "sliding_window": 4096},
            windows="all",
        ),
        Family("qwen2", "Qwen2ForCausalLM", _QWEN_WINDOW, _QWEN_DEFAULTS, qkv_bias=True, windows="qwen"),
        Family(
            "qwen3",
            "Qwen3ForCausalLM",
            _QWEN_WINDOW | {"attention_bias"},
            {**_QWEN_DEFAULTS, "head_dim": 128},
            qk_norm=True,
            windows="qwen",
        ),
        Family(
            "gemma2",
            "Gemma2ForCausalLM",
            _GEMMA_FIELDS,
            {**_GEMMA_DEFAULTS, "max_position_embeddings": 8192, "final_logit_softcapping": 30.0,
             "attn_logit_softcapping": 50.0},
            windows="types",
            window_pattern=2,
            builds=_GEMMA_BUILDS,
            activation_field="hidden_activation",
            embed_scale=True,
        ),
        Family(
            "gemma3_text",
            "Gemma3ForCausalLM",
            _GEMMA_FIELDS | {"rope_local_base_freq", "sliding_window_pattern", "_sliding_window_pattern"},
            {**_GEMMA_DEFAULTS, "max_position_embeddings": 131072, "rope_theta": 1000000.0,
             "rope_local_base_freq": 10000.0, "sliding_window_pattern": 6},
            qk_norm=True,
            windows="types",
            window_pattern=6,
            builds=_GEMMA_BUILDS,
            activation_field="hidden_activation",
            embed_scale=True,
        ),
        Family(
            "phi3",
            "Phi3ForCausalLM",
            frozenset({"original_max_position_embeddings", "sliding_window"}),
            {"max_position_embeddings": 4096, "sliding_window": None},
            windows="all",
            partial_rotary=True,
            fused=True,
            native_auto_map=True,
            # Phi-4-mini's: no biases, every layer's attention full, no interpolation
            neutral={"attention_bias": False, "mlp_bias": False, "lm_head_bias": False, "full_attn_mod": 1,
                     "interpolate_factor": 1},
        ),
        Family(
            "olmo2",
            "Olmo2ForCausalLM",
            frozenset({"attention_bias"}),
            {"max_position_embeddings": 2048},
            qk_norm=True,
            builds={"norms": "post", "qk_norm_over": "projection"},
        ),
    )
}  # fmt: skip
ARCHITECTURES = {f.architecture: f for f in FAMILIES.values()}

# Fields every family reads (besides the family's own).
MODEL_FIELDS = frozenset(
    {
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "num_hidden_layers",
        "vocab_size",
        "head_dim",
        "rms_norm_eps",
        "max_position_embeddings",
        "hidden_act",
        "tie_word_embeddings",
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "partial_rotary_factor",
        "dtype",
        "torch_dtype",
    }
)
REQUIRED = ("hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers", "vocab_size")
# Fields that leave the computation alone whatever they hold: names and provenance, training,
# generation and export settings (transformers' PretrainedConfig wrote them all in 4.x), the markers
# exporters add. Token ids and dropout probabilities match TOKEN_IDS and DROPOUT.
IGNORED = frozenset(
    {
        "architectures", "model_type", "transformers_version", "_name_or_path", "name_or_path",
        "_model_name_or_path", "_commit_hash", "_attn_implementation", "attn_implementation",
        "_attn_implementation_autoset", "_attn_implementation_internal", "_pre_quantization_dtype",
        "use_cache", "initializer_range", "max_sequence_length", "gradient_checkpointing",
        "output_attentions", "output_hidden_states", "return_dict", "use_return_dict", "torchscript",
        "use_bfloat16", "tf_legacy_loss", "chunk_size_feed_forward", "tokenizer_class", "prefix",
        "task_specific_params", "problem_type", "id2label", "label2id", "finetuning_task",
        "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
        "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
        "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
        "num_return_sequences", "output_scores", "return_dict_in_generate",
        "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
        "is_llama_config",  # nanotron's export marker (SmolLM2)
        "transformers.js_config",  # transformers.js's settings (KV cache dtype per quantization)
        "unsloth_fixed", "unsloth_version",  # unsloth's marks on the fine-tunes it saves
    }
)  # fmt: skip
TOKEN_IDS = re.compile(r"^[a-z0-9_]+_token_ids?$")  # bos/eos/pad/unk/...: the tokenizer's and generate's
# Dropout is off at inference (transformers' eval mode and generate), whatever the training used.
DROPOUT = re.compile(r"(dropout|_pdrop)(_prob|_rate)?$")
# Ignored only while they hold these values (anything else changes what the model is).
OFF_VALUES = {
    "is_encoder_decoder": (False,),
    "is_decoder": (False,),
    "add_cross_attention": (False,),
    "cross_attention_hidden_size": (None,),
    "tie_encoder_decoder": (False,),
    "pruned_heads": ({},),
    "use_mrope": (False,),  # Qwen2-VL's multimodal rope (Qwen2.5 text models write false)
}
_MOE = "mixture-of-experts layers are not part of the models megaloop builds"
# Fields known to change the model in ways megaloop does not build: refused whenever set (not null),
# allow_unknown_fields or not.
CHANGES_THE_MODEL = {
    **dict.fromkeys(
        ("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "n_routed_experts",
         "n_shared_experts", "shared_expert_intermediate_size", "decoder_sparse_step", "mlp_only_layers",
         "first_k_dense_replace", "moe_layer_freq", "norm_topk_prob", "output_router_logits",
         "router_aux_loss_coef", "interleave_moe_layer_step"),
        _MOE,
    ),
    "final_logit_softcapping": "megaloop softcaps the logits of gemma2 and gemma3_text models only",
    "attn_logit_softcapping": "megaloop softcaps attention scores of gemma2 and gemma3_text models only",
    "query_pre_attn_scalar": "megaloop reads it for gemma2 and gemma3_text models only",
    "embedding_multiplier": "megaloop does not scale the embeddings",
    "logits_scaling": "megaloop does not scale the logits",
    "logit_scale": "megaloop does not scale the logits",
    "residual_multiplier": "megaloop does not scale the residual branches",
    "attention_multiplier": "megaloop scales attention scores by 1/sqrt(head_dim) only",
    "use_qk_norm": "q/k norms are those of qwen3, gemma3_text and olmo2 (by model_type)",
    "qk_layernorm": "q/k norms are those of qwen3, gemma3_text and olmo2 (by model_type)",
    "no_rope_layers": "megaloop applies rope on every layer",
    "no_rope_layer_interval": "megaloop applies rope on every layer",
    "attention_chunk_size": "megaloop builds no chunked attention",
    "mrope_section": "multimodal rope (Qwen2-VL) is not part of the models megaloop builds",
    "rope_local_base_freq": "megaloop reads a local rope theta for gemma3_text models only",
    "sliding_window_pattern": "megaloop reads it for gemma3_text models only",
    "use_parallel_residual": "megaloop builds sequential residual blocks",
    "vision_config": "megaloop builds the text models only",
    "text_config": "a multimodal model's config: megaloop builds the text models only",
}  # fmt: skip
DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32", "half": "float16", "float": "float32"}
ROPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor"),
}
ROPE_OPTIONAL = {  # read when present
    "default": (),
    "linear": (),
    "llama3": (),
    "longrope": ("original_max_position_embeddings", "factor", "attention_factor"),
}


def refuse(field: str, value: Any, why: str) -> CheckpointError:
    return CheckpointError(f"config.json: {field} = {value!r:.200}: {why}")


def family_of(config: Mapping[str, Any]) -> Family:
    """The family config.json describes, from ``model_type`` and ``architectures``."""
    kind = config.get("model_type")
    if kind is not None and (not isinstance(kind, str) or kind not in FAMILIES):
        raise refuse("model_type", kind, f"megaloop builds {sorted(FAMILIES)}")
    archs = config.get("architectures")
    if archs is not None and (not isinstance(archs, list) or not all(isinstance(a, str) for a in archs)):
        raise refuse("architectures", archs, "expected a list of class names")
    for arch in archs or ():
        family = ARCHITECTURES.get(arch)
        if family is None or (kind is not None and family.model_type != kind):
            want = FAMILIES[kind].architecture if kind else sorted(ARCHITECTURES)
            raise refuse("architectures", archs, f"megaloop builds causal language models: {want}")
        kind = family.model_type
    if kind is None:
        raise CheckpointError(
            "config.json names no model_type or architectures; megaloop needs one of "
            f"{sorted(FAMILIES)} (model_type) to know which model it is"
        )
    return FAMILIES[kind]


def llama_config(
    config: Mapping[str, Any],
    *,
    max_seq: int | None = None,
    dtype: Any = None,
    allow_long_context: bool = False,
    allow_unknown_fields: bool = False,
) -> LlamaConfig:
    """A LlamaConfig from a Hugging Face ``config.json`` dict; ``max_seq`` sizes the KV cache
    (default: the model's context, max_position_embeddings; past it only with
    ``allow_long_context``), ``dtype`` the compute dtype (default: the config's).
    ``allow_unknown_fields``: fields megaloop does not know are ignored (with a warning naming them)
    instead of refused; fields known to change the model stay refused."""
    if not isinstance(config, Mapping):
        raise CheckpointError(f"config.json: expected a JSON object, got {type(config).__name__}")
    missing = [k for k in REQUIRED if k not in config]
    if missing:
        raise CheckpointError(f"config.json lacks {missing}; is this a Llama-family model?")
    family = family_of(config)
    if rope_interleaved(config):
        raise refuse(
            "rope_interleaved", True, "this LlamaConfig computes rope on half-split pairs; load_llama permutes "
            "the q/k projections of such a checkpoint so that it does: load it with load_llama"
        )  # fmt: skip
    ignored = _check_fields(config, family, allow_unknown_fields)
    c = _Reader(config, family)
    if "pretraining_tp" in family.fields:
        c.int("pretraining_tp", none=1)  # how training split the matmuls: the same model whatever it is
    heads = c.int("num_attention_heads")
    hidden = c.int("hidden_size")
    kv_heads = c.int("num_key_value_heads", none=heads)
    if heads % kv_heads:
        raise refuse("num_key_value_heads", kv_heads, f"must divide num_attention_heads = {heads}")
    head_dim = c.int("head_dim", none=None)
    if head_dim is None:
        if hidden % heads:
            raise refuse("hidden_size", hidden, f"not divisible by num_attention_heads = {heads}; give head_dim")
        head_dim = hidden // heads
    if head_dim % 2:
        raise refuse("head_dim", head_dim, "rotary embeddings need an even head_dim")
    layers = c.int("num_hidden_layers")
    positions = c.int("max_position_embeddings")
    max_seq = _context(max_seq, positions, allow_long_context)
    theta, scaling = rope_settings(config, positions, family)
    attention_bias = c.bool("attention_bias") if "attention_bias" in family.fields else False
    window, sliding = _windows(c, family, layers)
    local_theta = local_rope_theta(config, family) if window is not None else None
    local_layers = (sliding if sliding is not None else tuple(range(layers))) if local_theta is not None else ()
    if window is not None and window >= max_seq:  # the window never drops a key of this cache
        window = sliding = None
    settings = dict(
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        intermediate=c.int("intermediate_size"),
        layers=layers,
        vocab=c.int("vocab_size"),
        head_dim=head_dim,
        rope_theta=theta,
        rope_scaling=scaling,
        rms_eps=c.number("rms_norm_eps", 1e-6),
        max_seq=max_seq,
        dtype=as_dtype(dtype) if dtype is not None else as_dtype(_dtype(config)),
        qkv_bias=family.qkv_bias or attention_bias,
        o_bias=attention_bias,
        mlp_bias=c.bool("mlp_bias") if "mlp_bias" in family.fields else False,
        qk_norm=family.qk_norm,
        sliding_window=window,
        sliding_layers=sliding,
        tie_word_embeddings=c.bool("tie_word_embeddings"),
        **family.builds,
        **_family_settings(c, family, head_dim, hidden, scaling),
    )
    if local_theta is not None:
        settings.update(local_rope_theta=local_theta, local_rope_layers=local_layers)
    try:
        built = LlamaConfig(**settings)
    except MegaloopError as e:
        raise CheckpointError(f"config.json: {e}") from None
    if ignored:
        warnings.warn(
            f"config.json: ignoring fields megaloop does not know, as allow_unknown_fields asks: {ignored}; the "
            "model is built as if they were absent (if one of them changes the model, its output is wrong)",
            stacklevel=2,
        )
    return built


ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def _family_settings(
    c: _Reader, family: Family, head_dim: int, hidden: int, scaling: dict[str, Any] | None
) -> dict[str, Any]:
    """The LlamaConfig fields that the family's own config fields set: the MLP's activation, the
    attention scale and softcaps (Gemma), the scaled embeddings, rope's rotary dims (Phi-3)."""
    out: dict[str, Any] = {}
    act = c.get(family.activation_field, "silu")
    if not isinstance(act, str) or act not in ACTIVATIONS:
        raise refuse(family.activation_field, act, f"megaloop builds MLPs gated by {sorted(ACTIVATIONS)}")
    out["activation"] = ACTIVATIONS[act]
    if "query_pre_attn_scalar" in family.fields:
        out["attn_scale"] = c.number("query_pre_attn_scalar", 256) ** -0.5
    for key, name in (("attn_logit_softcapping", "attn_softcap"), ("final_logit_softcapping", "final_softcap")):
        if key in family.fields and c.get(key) is not None:
            out[name] = c.number(key, 1.0)
    if family.embed_scale:
        out["embed_scale"] = math.sqrt(hidden)
    if "use_bidirectional_attention" in family.fields and c.bool("use_bidirectional_attention"):
        raise refuse("use_bidirectional_attention", True, "megaloop builds causal language models")
    partial = _partial_rotary(c.config)
    if partial not in (1, 1.0, None):
        if not family.partial_rotary:
            why = f"megaloop's {family.model_type} models rotate the whole head"
            raise refuse("partial_rotary_factor", partial, why)
        rotary = int(head_dim * positive_number("partial_rotary_factor", partial))
        if rotary % 2 or not 2 <= rotary <= head_dim:
            raise refuse("partial_rotary_factor", partial, f"head_dim {head_dim} * it must be an even count >= 2")
        out["rotary_dim"] = rotary
    rotary = out.get("rotary_dim", head_dim)
    if scaling is not None and scaling["type"] == "longrope":
        for key in ("short_factor", "long_factor"):
            if len(scaling[key]) != rotary // 2:
                count = f"{len(scaling[key])} factors"
                raise refuse(f"rope_scaling.{key}", count, f"expected {rotary // 2}, one a rotary pair")
    return out


def _partial_rotary(config: Mapping[str, Any]) -> Any:
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(rope, Mapping):
        return 1.0
    return rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))


def _context(max_seq: Any, positions: int, allow_long_context: bool) -> int:
    """The KV cache's length: ``max_seq``, checked against the model's context. That is
    max_position_embeddings, also under the rope scalings megaloop builds: a llama3 or linear
    checkpoint states there the context its scaling reaches (the original one in the scaling)."""
    if max_seq is None:
        return positions
    if isinstance(max_seq, bool) or not isinstance(max_seq, int) or max_seq < 1:
        raise CheckpointError(f"max_seq must be an integer >= 1, got {max_seq!r}")
    if max_seq > positions and not allow_long_context:
        raise CheckpointError(
            f"max_seq {max_seq} is past the model's context, config.json's max_position_embeddings = {positions}: "
            "positions beyond it were never trained (the text degrades, often into noise). Use a max_seq of at most "
            f"{positions}, or pass allow_long_context=True (megaloop generate --allow-long-context) to run past it "
            "at your own risk"
        )
    return max_seq


def rope_interleaved(config: Mapping[str, Any]) -> bool:
    """Whether rope rotates adjacent pairs (2i, 2i+1) (``rope_interleaved``, nanotron's exports) rather
    than the half-split pairs (i, i + head_dim/2) transformers' Llama uses."""
    value = config.get("rope_interleaved", False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise refuse("rope_interleaved", value, "expected true or false")
    return value


def _check_fields(config: Mapping[str, Any], family: Family, allow_unknown: bool) -> list[str]:
    """Refuse the fields that change the model in ways megaloop does not build; the unknown fields
    ignored (only with ``allow_unknown``)."""
    if config.get("quantization_config") is not None:
        raise refuse("quantization_config", config["quantization_config"], "megaloop reads unquantized weights only")
    if config.get("auto_map") is not None and not family.native_auto_map:
        raise refuse("auto_map", config["auto_map"], "the model comes with its own code, which megaloop does not run")
    ignored = []
    for key, value in config.items():
        if key in MODEL_FIELDS or key in family.fields or key in IGNORED or key == "rope_interleaved":
            continue
        if key == "auto_map" or key in family.neutral:  # (auto_map: checked above)
            if key != "auto_map" and value != family.neutral[key]:
                why = f"megaloop builds {family.model_type} models with {key} = {family.neutral[key]!r} only"
                raise refuse(key, value, why)
            continue
        if TOKEN_IDS.match(key):
            continue
        if value is None:  # transformers reads null as "not set"
            continue
        if DROPOUT.search(key):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise refuse(key, value, "expected a dropout probability in [0, 1] (dropout is off at inference)")
            continue
        if key in OFF_VALUES:
            if value not in OFF_VALUES[key] or type(value) is not type(OFF_VALUES[key][0]):
                raise refuse(key, value, f"megaloop builds the model with {key} = {OFF_VALUES[key][0]!r} only")
            continue
        if key in CHANGES_THE_MODEL:
            raise refuse(key, value, CHANGES_THE_MODEL[key])
        if key in FAMILIES["qwen3"].fields | FAMILIES["llama"].fields | FAMILIES["mistral"].fields:
            if value in (None, False):  # another family's switch, off
                continue
            raise refuse(key, value, f"{family.model_type} models have no such setting")
        if not allow_unknown:
            raise refuse(
                key, value, f"megaloop does not know what this field does to a {family.model_type} model. If it "
                "changes nothing megaloop computes (a note an exporter or trainer added), pass allow_unknown_fields="
                "True (megaloop generate --allow-unknown-config-fields) to build the model as if it were absent, at "
                "your own risk"
            )  # fmt: skip
        ignored.append(key)
    return ignored


class _Reader:
    """Typed reads of config fields, absent ones from the family's defaults."""

    def __init__(self, config: Mapping[str, Any], family: Family) -> None:
        self.config, self.family = config, family

    def get(self, key: str, default: Any = None) -> Any:
        return self.config[key] if key in self.config else self.family.defaults.get(key, default)

    def int(self, key: str, *, none: Any = "required", minimum: int = 1) -> Any:
        value = self.get(key, none if none != "required" else None)
        if value is None and none != "required":
            return none
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise refuse(key, value, f"expected an integer >= {minimum}")
        return value

    def bool(self, key: str) -> bool:
        value = self.get(key, False)
        if value is None:
            return False
        if not isinstance(value, bool):
            raise refuse(key, value, "expected true or false")
        return value

    def number(self, key: str, default: float) -> float:
        return positive_number(key, self.get(key, default))


def positive_number(field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise refuse(field, value, "expected a finite number > 0")
    return float(value)


def _dtype(config: Mapping[str, Any]) -> str:
    field = "dtype" if config.get("dtype") is not None else "torch_dtype"
    value = config.get(field)
    if value is None:
        return "bfloat16"
    name = value.removeprefix("torch.") if isinstance(value, str) else None
    if name not in DTYPES:
        raise refuse(field, value, f"megaloop computes in {sorted(set(DTYPES.values()))} (or pass dtype=...)")
    return DTYPES[name]


def rope_settings(
    config: Mapping[str, Any], max_positions: int, family: Family | None = None
) -> tuple[float, dict[str, Any] | None]:
    """Rope's theta and scaling (LlamaConfig's ``rope_scaling``, or None) from either layout: 4.x's
    ``rope_theta`` + ``rope_scaling``, 5.x's ``rope_parameters`` (which holds the theta; per layer type
    for Gemma 3, whose full_attention layers' rope this is: local_rope_theta reads the others')."""
    field, rope = _rope_parameters(config)
    if any(isinstance(v, Mapping) for v in rope.values()):
        if family is None or "rope_local_base_freq" not in family.fields or set(rope) != set(LAYER_TYPES):
            raise refuse(field, rope, "rope parameters per layer type are megaloop's for gemma3_text models only")
        field, rope = f"{field}.full_attention", rope["full_attention"]
        if not isinstance(rope, Mapping):
            raise refuse(field, rope, "expected an object such as {'rope_type': 'default', 'rope_theta': 1e6}")
    return _rope_of(config, field, rope, max_positions, family)


LAYER_TYPES = ("full_attention", "sliding_attention")


def _rope_parameters(config: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    """Which field holds rope's parameters, and them ({} when neither does)."""
    params, scaling = config.get("rope_parameters"), config.get("rope_scaling")
    if params is not None and scaling is not None and params != scaling:
        raise refuse("rope_scaling", scaling, f"config.json also has rope_parameters = {params!r}; give one")
    field = "rope_scaling" if scaling is not None else "rope_parameters"
    rope = scaling if scaling is not None else params if params is not None else {}
    if not isinstance(rope, Mapping):
        raise refuse(field, rope, "expected an object such as {'rope_type': 'llama3', 'factor': 8.0, ...}")
    return field, rope


def local_rope_theta(config: Mapping[str, Any], family: Family) -> float | None:
    """The sliding layers' rope theta where it is their own (Gemma 3: rope_local_base_freq, or 5.x's
    rope_parameters.sliding_attention, which must be unscaled), else None."""
    if "rope_local_base_freq" not in family.fields:
        return None
    field, rope = _rope_parameters(config)
    local = rope.get("sliding_attention") if isinstance(rope.get("sliding_attention"), Mapping) else None
    if local is None:
        return positive_number("rope_local_base_freq", config.get("rope_local_base_freq", 10000.0))
    theta, scaling = _rope_of(config, f"{field}.sliding_attention", local, 0, family)
    if scaling is not None:
        raise refuse(f"{field}.sliding_attention", local, "megaloop builds Gemma 3's sliding layers with unscaled rope")
    return theta


def _rope_of(
    config: Mapping[str, Any], field: str, rope: Mapping[str, Any], max_positions: int, family: Family | None
) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) of one rope parameter object, checked."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    kind = "longrope" if kind == "su" else kind  # Phi-3's first name for it
    if not isinstance(kind, str) or kind not in ROPE_KEYS:
        raise refuse(f"{field}.rope_type", kind, f"megaloop implements rope types {sorted(ROPE_KEYS)}")
    theta_field = f"{field}.rope_theta" if "rope_theta" in rope else "rope_theta"
    theta = rope["rope_theta"] if "rope_theta" in rope else config.get("rope_theta", _default_theta(family))
    if positive_number(theta_field, theta) <= 1.0:
        raise refuse(theta_field, theta, "expected a number > 1")
    known = {"rope_type", "type", "rope_theta", "partial_rotary_factor", *ROPE_KEYS[kind], *ROPE_OPTIONAL[kind]}
    for key, value in rope.items():
        if key not in known:
            raise refuse(f"{field}.{key}", value, f"not a setting of rope type {kind!r} that megaloop implements")
    if kind == "default":
        return float(theta), None
    if kind == "longrope":
        return float(theta), _longrope(config, field, rope, max_positions)
    out: dict[str, Any] = {"type": kind}
    for key in ROPE_KEYS[kind]:
        value = rope.get(key, max_positions if key == "original_max_position_embeddings" else None)
        if value is None:
            raise refuse(f"{field}.{key}", None, f"rope type {kind!r} needs it")
        out[key] = positive_number(f"{field}.{key}", value)
    if kind == "llama3" and not out["high_freq_factor"] > out["low_freq_factor"]:
        raise refuse(f"{field}.high_freq_factor", out["high_freq_factor"], "must exceed low_freq_factor")
    return float(theta), out


def _default_theta(family: Family | None) -> float:
    return float(family.defaults.get("rope_theta", 10000.0)) if family is not None else 10000.0


def _longrope(config: Mapping[str, Any], field: str, rope: Mapping[str, Any], max_positions: int) -> dict[str, Any]:
    """longrope's (Phi-3's) settings as transformers reads them: the short and long factors, the
    context they switch at (original_max_position_embeddings, in the object or beside it) and the
    factor cos and sin are scaled by (attention_factor, else from max_position_embeddings / that)."""
    out: dict[str, Any] = {"type": "longrope"}
    for key in ("short_factor", "long_factor"):
        factors = rope.get(key)
        if not isinstance(factors, list) or not factors:
            raise refuse(f"{field}.{key}", factors, "longrope needs a list of factors, one a rotary pair")
        out[key] = tuple(positive_number(f"{field}.{key}", f) for f in factors)
    where = field if "original_max_position_embeddings" in rope else "original_max_position_embeddings"
    original = rope.get("original_max_position_embeddings", config.get("original_max_position_embeddings"))
    if isinstance(original, bool) or not isinstance(original, int) or original < 2:
        raise refuse(where, original, "longrope needs original_max_position_embeddings, an integer >= 2")
    out["original_max_position_embeddings"] = original
    factor = rope.get("factor")
    factor = positive_number(f"{field}.factor", factor) if factor is not None else max_positions / original
    attention = rope.get("attention_factor")
    if attention is not None:
        out["attention_factor"] = positive_number(f"{field}.attention_factor", attention)
    else:
        out["attention_factor"] = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return out


def _windows(c: _Reader, family: Family, layers: int) -> tuple[int | None, tuple[int, ...] | None]:
    """The sliding window and the layers it applies to (None: all), as transformers 5 applies them:
    Mistral and Phi-3 on every layer; Qwen2/3 only with use_sliding_window, on the layers ``layer_types``
    names sliding_attention (by default those from max_window_layers on); Gemma on the layers
    ``layer_types`` names, by default all but every 2nd (Gemma 2) or sliding_window_pattern-th (Gemma 3)."""
    if family.windows == "none":
        return None, None
    window = c.int("sliding_window", none=None)
    if family.windows == "all":
        return window, None
    types = c.get("layer_types")
    if family.windows == "types" and types is None:  # Gemma: every pattern-th layer global
        pattern = c.get("sliding_window_pattern", c.get("_sliding_window_pattern", family.window_pattern))
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise refuse("sliding_window_pattern", pattern, "expected an integer >= 1")
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if family.windows == "qwen" and not c.bool("use_sliding_window"):
        window = None
    if types is None:
        start = c.int("max_window_layers", minimum=0)
        types = ["sliding_attention" if window is not None and i >= start else "full_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers:
        raise refuse("layer_types", types, f"expected a list of {layers} layer types")
    for t in types:
        if t not in ("full_attention", "sliding_attention"):
            raise refuse("layer_types", types, f"layer type {t!r}: megaloop builds full_attention, sliding_attention")
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if window is None or not sliding:
        return None, None
    return window, (None if len(sliding) == layers else sliding)

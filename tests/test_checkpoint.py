"""Hugging Face Llama checkpoints (config.json + safetensors): a written checkpoint loads back
bit for bit, single-file and sharded, tied embeddings, and damaged or foreign checkpoints fail
naming the file and the tensor."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

import megaloop as ml
from megaloop.errors import CheckpointError
from megaloop.models import LlamaConfig, build_llama, load_llama, random_parameters, write_safetensors

CFG = LlamaConfig(hidden=32, heads=4, kv_heads=2, intermediate=48, layers=2, max_seq=16, vocab=40)
HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "vocab_size": 40,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 16,
    "torch_dtype": "bfloat16",
}


def checkpoint(tmp_path, params: dict, config: dict = HF_CONFIG, shards: int = 1):
    (tmp_path / "config.json").write_text(json.dumps(config))
    names = list(params)
    if shards == 1:
        write_safetensors(tmp_path / "model.safetensors", params)
        return tmp_path
    weight_map = {}
    for s in range(shards):
        part = {n: params[n] for n in names[s::shards]}
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        write_safetensors(tmp_path / file, part)
        weight_map.update({n: file for n in part})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return tmp_path


def bf16(params: dict) -> dict:
    return {n: v.astype(ml_dtypes.bfloat16) for n, v in params.items()}


@pytest.mark.parametrize("shards", [1, 3])
def test_a_written_checkpoint_loads_back_and_runs(tmp_path, shards: int) -> None:
    params = bf16(random_parameters(CFG, seed=1))
    cfg, loaded = load_llama(checkpoint(tmp_path, params, shards=shards))
    assert cfg == CFG
    assert set(loaded) == set(params)
    for n, v in params.items():
        assert loaded[n].dtype == v.dtype and loaded[n].tobytes() == v.tobytes(), n
    g = build_llama(cfg, 1, 3)
    feeds = {"tokens": np.array([[1, 2, 3]]), "positions": np.arange(3)[None]}
    want = ml.evaluate(g, feeds, params).outputs["logits"]
    assert ml.evaluate(g, feeds, loaded).outputs["logits"].tobytes() == want.tobytes()


def test_tied_embeddings_and_rope_scaling(tmp_path) -> None:
    params = bf16(random_parameters(CFG, seed=2))
    del params["lm_head.weight"]
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8,
    }
    config = {**HF_CONFIG, "tie_word_embeddings": True, "rope_scaling": scaling}
    cfg, loaded = load_llama(checkpoint(tmp_path, params, config), max_seq=12)
    assert cfg.tie_word_embeddings and "lm_head.weight" not in loaded  # the LM head is the embedding
    assert cfg.max_seq == 12 and cfg.rope_scaling["type"] == "llama3"


@pytest.mark.parametrize(
    "damage, message",
    [
        (
            lambda p, c: p.pop("model.layers.1.mlp.up_proj.weight"),
            r"1 parameters missing, e\.g\. \['model\.layers\.1\.mlp",
        ),
        (lambda p, c: p.__setitem__("model.norm.weight", p["model.norm.weight"][:5]), r"model\.norm\.weight \(5,\)"),
        (lambda p, c: p.__setitem__("model.layers.0.self_attn.q_proj.bias", p["model.norm.weight"]), r"q_proj\.bias"),
        (lambda p, c: c.pop("hidden_size"), r"config\.json lacks \['hidden_size'\]"),
        (lambda p, c: c.__setitem__("rope_scaling", {"rope_type": "yarn", "factor": 4.0}), r"'yarn'"),
    ],
)
def test_damaged_or_foreign_checkpoints_are_named(tmp_path, damage, message) -> None:
    params, config = bf16(random_parameters(CFG, seed=3)), dict(HF_CONFIG)
    damage(params, config)
    with pytest.raises(CheckpointError, match=message):
        load_llama(checkpoint(tmp_path, params, config))


def test_a_truncated_file_is_reported(tmp_path) -> None:
    path = checkpoint(tmp_path, bf16(random_parameters(CFG, seed=4)))
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="damaged"):
        load_llama(path)

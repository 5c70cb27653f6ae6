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


# ---- stored dtypes -----------------------------------------------------------------------------------
SAFETENSORS_NAMES = {
    np.dtype(np.int8): "I8", np.dtype(np.int32): "I32", np.dtype(np.uint8): "U8", np.dtype(np.bool_): "BOOL",
    np.dtype(np.float64): "F64", np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3", np.dtype(np.float16): "F16",
    np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(np.float32): "F32",
}  # fmt: skip


def write_any_safetensors(path, tensors: dict) -> None:
    """safetensors with any dtype the format has (write_safetensors writes the float types megaloop runs)."""
    header, blobs, at = {}, [], 0
    for name, value in tensors.items():
        a = np.ascontiguousarray(value)
        end = at + a.nbytes
        header[name] = {"dtype": SAFETENSORS_NAMES[a.dtype], "shape": list(a.shape), "data_offsets": [at, end]}
        blobs.append(a.tobytes())
        at = end
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + b"".join(blobs))


@pytest.mark.parametrize(
    "dtype, name",
    [(np.int8, "I8"), (np.int32, "I32"), (np.uint8, "U8"), (np.bool_, "BOOL"), (ml_dtypes.float8_e4m3fn, "F8_E4M3")],
)
def test_a_parameter_stored_as_a_non_float_is_refused(tmp_path, dtype, name: str) -> None:
    """An int8 (bool, float8, ...) tensor of the right shape is a quantized checkpoint's raw numbers,
    not weights: refused naming the file, the tensor, the stored dtype and the expected ones (main
    ran the model on the raw integers)."""
    params = bf16(random_parameters(CFG, seed=5))
    q = "model.layers.1.self_attn.q_proj.weight"
    params[q] = (np.asarray(params[q], np.float32) * 100).astype(dtype)
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIG))
    write_any_safetensors(tmp_path / "model.safetensors", params)
    with pytest.raises(CheckpointError) as info:
        load_llama(tmp_path)
    message = str(info.value)
    print(message)
    assert "model.safetensors" in message and f"tensor {q!r} is stored as {name}" in message
    assert "BF16, F16, F32, F64" in message and "bfloat16" in message


def test_float_parameters_of_any_width_load(tmp_path) -> None:
    """float16, float32 and float64 weights of a bfloat16 model load and round as the evaluator rounds
    them: the logits equal those of the same arrays handed over directly."""
    params = random_parameters(CFG, seed=6)
    widths = {n: v.astype([np.float16, np.float32, np.float64][i % 3]) for i, (n, v) in enumerate(params.items())}
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIG))
    write_any_safetensors(tmp_path / "model.safetensors", widths)
    cfg, loaded = load_llama(tmp_path)
    assert {loaded[n].dtype for n in loaded} == {np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)}
    g = build_llama(cfg, 1, 3)
    feeds = {"tokens": np.array([[1, 2, 3]]), "positions": np.arange(3)[None]}
    want = ml.evaluate(g, feeds, widths).outputs["logits"]
    assert ml.evaluate(g, feeds, loaded).outputs["logits"].tobytes() == want.tobytes()


# ---- the context, unknown fields, interleaved rope -------------------------------------------------------
def test_max_seq_past_the_context_is_refused_unless_allowed(tmp_path) -> None:
    folder = checkpoint(tmp_path, bf16(random_parameters(CFG, seed=7)))  # max_position_embeddings 16
    assert load_llama(folder, max_seq=16)[0].max_seq == 16
    with pytest.raises(CheckpointError, match=r"max_seq 20 is past .* = 16.*allow_long_context"):
        load_llama(folder, max_seq=20)
    assert load_llama(folder, max_seq=20, allow_long_context=True)[0].max_seq == 20
    with pytest.raises(CheckpointError, match="allow_long_context"):
        ml.Generator(folder, backend="cpu", max_seq=20)
    gen = ml.Generator(folder, backend="cpu", max_seq=20, allow_long_context=True, eos_token_ids=())
    assert len(gen.generate([1, 2, 3], max_new_tokens=17)[0].tokens) == 17  # 20 positions


def test_unknown_config_fields_load_only_when_allowed(tmp_path) -> None:
    folder = checkpoint(tmp_path, bf16(random_parameters(CFG, seed=8)), {**HF_CONFIG, "exporter_flavour": "x"})
    with pytest.raises(CheckpointError, match=r"exporter_flavour.*allow_unknown_fields=True"):
        load_llama(folder)
    with pytest.warns(UserWarning, match="exporter_flavour"):
        assert load_llama(folder, allow_unknown_fields=True)[0] == CFG
    with pytest.warns(UserWarning, match="exporter_flavour"):
        assert ml.Generator(folder, backend="cpu", allow_unknown_fields=True).cfg == CFG


def test_deinterleaving_is_megaloops_own_interleaved_rope() -> None:
    """deinterleave_rope's reordering turns rope's interleaved layout into its neox layout: rope
    (interleaved) of x, reordered, equals rope (neox) of x reordered, for llama3 scaling too."""
    from megaloop.models.checkpoint import deinterleave_rope

    hd, heads, tokens = 16, 3, 5
    x = np.random.default_rng(9).standard_normal((1, heads, tokens, hd)).astype(np.float32)
    cfg = LlamaConfig(hidden=48, heads=heads, kv_heads=1, intermediate=8, layers=1, head_dim=hd)
    rows = np.arange(heads * hd, dtype=np.float32)[:, None]  # a q_proj whose rows hold their own index
    moved = deinterleave_rope(cfg, {"model.layers.0.self_attn.q_proj.weight": rows})
    moved = moved["model.layers.0.self_attn.q_proj.weight"][:, 0].astype(int).reshape(heads, hd)
    perm = moved[0]
    assert (moved == perm + hd * np.arange(heads)[:, None]).all()  # each head's rows stay in the head
    scaling = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8.0}  # fmt: skip
    for rope_scaling in (None, scaling):
        g = ml.Graph("rope")
        xt = g.input("x", x.shape, ml.float32)
        pos = g.input("positions", (1, 1, tokens), ml.int64)
        g.output("interleaved", ml.rope(xt, pos, theta=500.0, layout="interleaved", scaling=rope_scaling))
        g.output("neox", ml.rope(xt, pos, theta=500.0, layout="neox", scaling=rope_scaling))
        feeds = {"positions": np.arange(tokens)[None, None] * 3}
        a = ml.evaluate(g, {**feeds, "x": x}).outputs["interleaved"]
        b = ml.evaluate(g, {**feeds, "x": x[..., perm]}).outputs["neox"]
        np.testing.assert_allclose(a[..., perm], b, rtol=0, atol=1e-6)
        assert not np.allclose(a, ml.evaluate(g, {**feeds, "x": x}).outputs["neox"], atol=1e-3)

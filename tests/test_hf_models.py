"""Checkpoints that transformers itself saved (the installed version's layout), one tiny random model
per family megaloop loads, against transformers as the reference (float32, CPU): the logits of a
prefill and of teacher-forced decode steps within 1e-5 (relative to the logits' scale, the worst
element printed), and greedy generation equal to transformers' ``generate`` for 32 tokens."""

from __future__ import annotations

import dataclasses
import sys
import warnings

import numpy as np
import pytest

import megaloop as ml
from megaloop.models import build_llama, load_llama
from tests.hf_models import FAMILIES, make_model, make_published, shrink, to_4x_layout, torch
from tests.published_configs import PUBLISHED

TOL = 1e-5  # float32 through a few layers: megaloop's rope is float64, torch's float32 (~1e-6 seen)
PROMPT, DECODE = 8, 6


def worst(got: np.ndarray, ref: np.ndarray, what: str) -> float:
    """max |got - ref| / max |ref|, printed with the worst element."""
    err = np.abs(got.astype(np.float64) - ref)
    at = np.unravel_index(int(err.argmax()), err.shape)
    rel = float(err[at] / np.abs(ref).max())
    print(f"{what}: worst {rel:.2e} at {at} (megaloop {got[at]:.6g}, transformers {ref[at]:.6g})")
    return rel


def megaloop_logits(cfg, params, seq: np.ndarray) -> list[np.ndarray]:
    """The prefill's logits over the first PROMPT tokens, then each decode step's, fed seq's tokens."""
    feeds = {"tokens": seq[:, :PROMPT], "positions": np.arange(PROMPT)[None]}
    out = ml.evaluate(build_llama(cfg, 1, PROMPT), feeds, params)
    logits, state = [out.outputs["logits"][0]], out.state
    step = build_llama(cfg, 1, 1)
    for i in range(PROMPT, seq.shape[1]):
        out = ml.evaluate(step, {"tokens": seq[:, i : i + 1], "positions": np.array([[i]])}, params, state)
        logits.append(out.outputs["logits"][0])
        state = out.state
    return logits


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, folder, make_model(request.param, folder)


def test_logits_match_transformers(family) -> None:
    name, folder, model = family
    cfg, params = load_llama(folder, dtype="float32")
    seq = np.random.default_rng(0).integers(0, cfg.vocab, (1, PROMPT + DECODE))
    with torch.no_grad():
        ref = model(torch.tensor(seq)).logits[0].double().numpy()
    got = megaloop_logits(cfg, params, seq)
    assert worst(got[0], ref[:PROMPT], f"{name} prefill") < TOL
    for i, step in enumerate(got[1:]):
        assert worst(step[0], ref[PROMPT + i], f"{name} decode step {i}") < TOL


# Phi-3's longrope: a prompt past original_max_position_embeddings (16), so that every step uses the
# long factors (the logits test's 14 positions use the short ones). A generation that crosses it makes
# transformers' generate recompute the cache with the long factors; megaloop keeps the keys it has
# (test_longrope_steps_across_the_switch_match_transformers_forward; docs/models.md).
PROMPT_LENGTH = {"phi3-longrope": 20, "phi4-mini": 20}


def test_greedy_tokens_match_transformers_generate(family) -> None:
    name, folder, model = family
    prompt = np.random.default_rng(1).integers(0, 96, PROMPT_LENGTH.get(name, 7)).tolist()
    ids = torch.tensor([[0, *prompt[1:]]])  # id 0 is pad_token_id: the mask keeps generate from hiding it
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False, eos_token_id=None,
            pad_token_id=0,
        )
    prompt = ids[0].tolist()
    want = out[0, len(prompt) :].tolist()
    result = ml.Generator(folder, backend="cpu", dtype="float32", eos_token_ids=()).generate(prompt, max_new_tokens=32)
    print(name, result.stats.summary())
    assert result[0].tokens == want
    assert result[0].finish_reason == "length" and len(want) == 32


@pytest.mark.parametrize("name", ["phi3-longrope", "phi4-mini"])
def test_longrope_steps_across_the_switch_match_transformers_forward(name: str, tmp_path) -> None:
    """Decode steps from position 8 to 21 (the long factors from 16 on: a step of a position past
    original_max_position_embeddings turns q and the new key by them) equal transformers' forward
    with its cache fed the same steps, within 1e-5."""
    model = make_model(name, tmp_path)
    cfg, params = load_llama(tmp_path, dtype="float32")
    seq = np.random.default_rng(0).integers(0, cfg.vocab, (1, 22))
    got = megaloop_logits(cfg, params, seq)
    with torch.no_grad():
        out = model(torch.tensor(seq[:, :PROMPT]), use_cache=True)
        assert worst(got[0], out.logits[0].double().numpy(), f"{name} prefill") < TOL
        for i in range(PROMPT, seq.shape[1]):
            out = model(
                torch.tensor(seq[:, i : i + 1]), cache=out.cache, use_cache=True,
                position_ids=torch.tensor([[i]]),
            )  # fmt: skip
            assert worst(got[i - PROMPT + 1][0], out.logits[0, 0].double().numpy(), f"{name} position {i}") < TOL


def test_gemma3_keeps_its_local_rope_where_the_window_is_past_the_cache(tmp_path) -> None:
    """A sliding window longer than the cache masks nothing and is left out (at load, and by the
    Generator for its shorter cache), but Gemma 3's sliding layers keep their own rope theta: the
    greedy tokens are still transformers'."""
    model = make_model("gemma3", tmp_path, sliding_window=100)
    cfg, _ = load_llama(tmp_path, dtype="float32")
    assert cfg.sliding_window is None and cfg.local_rope_layers == (0, 1) and cfg.local_rope_theta == 100.0
    ids = torch.tensor([[0, *np.random.default_rng(3).integers(1, 96, 6).tolist()]])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                             eos_token_id=None, pad_token_id=0)  # fmt: skip
    gen = ml.Generator(tmp_path, backend="cpu", dtype="float32", eos_token_ids=(), max_seq=48)
    assert gen.generate(ids[0].tolist(), max_new_tokens=32)[0].tokens == out[0, 7:].tolist()


def test_features_are_what_the_logits_depend_on(tmp_path) -> None:
    """The comparisons can fail: without the window, the q/k norms, the biases, llama3 scaling, the
    softcap, the local rope, longrope or its attention factor the logits are far from transformers'."""
    checks = {
        "mistral-window": {"sliding_window": None},
        "qwen2-window": {"sliding_layers": None},  # the window on every layer instead of layer 1's
        "qwen3": {"qk_norm": False},
        "llama-linear-bias": {"mlp_bias": False},
        "llama3-tied": {"rope_scaling": None},
        "gemma2": {"attn_softcap": None},
        "gemma3": {"local_rope_layers": ()},
        "olmo2": {"qk_norm_over": "head", "qk_norm": False},
        "phi4-mini": {"rope_scaling": lambda cfg: {**cfg.rope_scaling, "attention_factor": 1.0}},
        "phi3-longrope": {"rope_scaling": lambda cfg: {**cfg.rope_scaling, "type": "linear", "factor": 1.0}},
    }
    for name, change in checks.items():
        model = make_model(name, tmp_path / name)
        cfg, params = load_llama(tmp_path / name, dtype="float32")
        seq = np.random.default_rng(0).integers(0, cfg.vocab, (1, PROMPT + DECODE))
        with torch.no_grad():
            ref = model(torch.tensor(seq)).logits[0].double().numpy()
        wrong = dataclasses.replace(cfg, **{k: v(cfg) if callable(v) else v for k, v in change.items()})
        kept = {n: params[n] for n in wrong.parameter_shapes()}
        logits = megaloop_logits(wrong, kept, seq)
        assert worst(logits[-1][0], ref[-1], f"{name} with {change}") > 1e-3


def test_a_4x_layout_config_loads_the_same_model(tmp_path) -> None:
    """The same checkpoint with its config.json as transformers 4.x wrote it (rope_theta, rope_scaling,
    torch_dtype): the same LlamaConfig and bit-identical logits."""
    for name in ("llama3-tied", "llama-linear-bias", "qwen2"):
        folder = tmp_path / name
        make_model(name, folder)
        cfg5, params = load_llama(folder, dtype="float32")
        old = to_4x_layout(folder)
        assert "rope_parameters" not in old and "torch_dtype" in old
        cfg4, params4 = load_llama(folder, dtype="float32")
        assert cfg4 == cfg5 and cfg4.rope_scaling == cfg5.rope_scaling
        seq = np.random.default_rng(2).integers(0, cfg5.vocab, (1, PROMPT + 2))
        a, b = megaloop_logits(cfg5, params, seq), megaloop_logits(cfg4, params4, seq)
        assert all(x.tobytes() == y.tobytes() for x, y in zip(a, b))


def reference_and_megaloop(model, folder, seq: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    with torch.no_grad():
        ref = model(torch.tensor(seq)).logits[0].double().numpy()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no field ignored as unknown
        cfg, params = load_llama(folder, dtype="float32", max_seq=seq.shape[1])
    return ref, megaloop_logits(cfg, params, seq)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_configs_compute_what_transformers_computes(name: str, tmp_path) -> None:
    """Each published config.json (tests/published_configs.py), made tiny with every other field as
    published, built by transformers from that file: megaloop's logits within 1e-5 of transformers'.
    transformers' own save of the same model (its 5.x layout, the extra fields kept) loads to the
    same LlamaConfig and the same logits, bit for bit."""
    model = make_published(shrink(PUBLISHED[name][0]), tmp_path)
    seq = np.random.default_rng(0).integers(0, 96, (1, PROMPT + DECODE))
    ref, got = reference_and_megaloop(model, tmp_path, seq)
    assert worst(got[0], ref[:PROMPT], f"{name} prefill") < TOL
    for i, step in enumerate(got[1:]):
        assert worst(step[0], ref[PROMPT + i], f"{name} decode step {i}") < TOL
    resaved = load_llama(tmp_path / "saved", dtype="float32", max_seq=seq.shape[1])
    assert resaved[0] == load_llama(tmp_path, dtype="float32", max_seq=seq.shape[1])[0]
    again = megaloop_logits(*resaved, seq)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(again, got))


def interleaved_rope(q, k, cos, sin, unsqueeze_dim=1):
    """transformers' apply_rotary_pos_emb with GPT-J's pairs: (2i, 2i+1) rotated by frequency i."""
    half = cos.shape[-1] // 2  # transformers' tables hold each frequency twice: [f_0..f_{d/2-1}, f_0..]
    cos = cos[..., :half].repeat_interleave(2, -1).unsqueeze(unsqueeze_dim)
    sin = sin[..., :half].repeat_interleave(2, -1).unsqueeze(unsqueeze_dim)

    def turn(x):  # each pair (a, b) -> (-b, a)
        return torch.stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)

    return q * cos + turn(q) * sin, k * cos + turn(k) * sin


@pytest.mark.parametrize("name", ["SmolLM2-135M-Instruct", "Llama-3.2-1B", "Qwen2.5-0.5B", "Qwen3-0.6B"])
def test_interleaved_rope_matches_transformers_with_interleaved_pairs(name: str, tmp_path, monkeypatch) -> None:
    """rope_interleaved: true (nanotron's layout): transformers with its rotation made GPT-J style is
    the reference. megaloop permutes q/k rows (biases, Qwen3's q/k norms) at load; unpermuted, the
    logits are far off, so the comparison can fail."""
    config = {**shrink(PUBLISHED[name][0]), "rope_interleaved": True}
    model = make_published(config, tmp_path)
    module = sys.modules[type(model.model.layers[0].self_attn).__module__]
    monkeypatch.setattr(module, "apply_rotary_pos_emb", interleaved_rope)
    seq = np.random.default_rng(1).integers(0, 96, (1, PROMPT + DECODE))
    ref, got = reference_and_megaloop(model, tmp_path, seq)
    assert worst(got[0], ref[:PROMPT], f"{name} interleaved prefill") < TOL
    for i, step in enumerate(got[1:]):
        assert worst(step[0], ref[PROMPT + i], f"{name} interleaved decode step {i}") < TOL
    (tmp_path / "config.json").write_text(__import__("json").dumps({**config, "rope_interleaved": False}))
    _, unpermuted = reference_and_megaloop(model, tmp_path, seq)
    assert worst(unpermuted[-1][0], ref[-1], f"{name} read as half-split") > 1e-3

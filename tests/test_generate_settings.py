"""``Generator.generate``'s settings on the CPU reference, with the tiny checkpoint: generation_config.json's
defaults (explicit arguments and flags win; the command says which came from the file), the repetition
penalty greedy as transformers applies it, the penalties and min-p through the whole call as host-driven
steps with the ops' definitions compute them, seeds (drawn and printed when missing; any integer), n
sequences a prompt, log-probabilities against log_softmax of transformers' logits, stop strings that
span tokens."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

import megaloop as ml
from megaloop.cli import main
from megaloop.generation import GenerationError, GenerationSettings
from megaloop.models.tiny import make_tiny_checkpoint

PROMPTS = ["Hi", "Once upon a loop, a kernel", "A loop kernel is one program that stays on the GPU and runs"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def gen(tiny):
    return ml.Generator(tiny, backend="cpu")


def with_generation_config(tiny, folder, **fields):
    """A copy of the tiny checkpoint whose generation_config.json also holds ``fields``."""
    shutil.copytree(tiny, folder)
    path = folder / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))
    return folder


# ---- generation_config.json --------------------------------------------------------------------------------

QWEN_LIKE = {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.05,
             "max_new_tokens": 9}  # fmt: skip


def test_generation_config_defaults_apply_and_arguments_win(tiny, gen, tmp_path) -> None:
    """A Qwen2.5-Instruct-like generation_config.json: sampling with its temperature, top_k, top_p and
    repetition penalty, its max_new_tokens; an argument overrides a field; do_sample false is greedy
    whatever the temperature; max_length counts the prompt."""
    folder = with_generation_config(tiny, tmp_path / "qwen-like", **QWEN_LIKE)
    model = ml.Generator(folder, backend="cpu")
    got = model.generate(PROMPTS[1], seed=4)
    want = gen.generate(PROMPTS[1], seed=4, **{k: v for k, v in QWEN_LIKE.items() if k != "do_sample"})
    assert got[0].tokens == want[0].tokens and len(got[0].tokens) == 9
    assert got.stats.from_file == {
        "temperature": "temperature 0.7 (do_sample true)", "top_k": "top_k 20", "top_p": "top_p 0.8",
        "repetition_penalty": "repetition_penalty 1.05", "max_new_tokens": "max_new_tokens 9",
    }  # fmt: skip
    greedy = model.generate(PROMPTS[1], temperature=0.0, max_new_tokens=12)  # arguments win
    assert greedy[0].tokens == gen.generate(PROMPTS[1], repetition_penalty=1.05, max_new_tokens=12)[0].tokens
    assert "temperature" not in greedy.stats.from_file and "max_new_tokens" not in greedy.stats.from_file
    per_prompt = model.generate(PROMPTS[1], settings=GenerationSettings(top_k=3), seed=4, top_k=50)
    assert per_prompt[0].tokens == gen.generate(PROMPTS[1], seed=4, **{**want_args(), "top_k": 3})[0].tokens
    off = ml.Generator(with_generation_config(tiny, tmp_path / "off", do_sample=False, temperature=0.9), backend="cpu")
    assert off.generate(PROMPTS[0], max_new_tokens=6)[0].tokens == gen.generate(PROMPTS[0], max_new_tokens=6)[0].tokens
    n = len(gen.encode(PROMPTS[2]))
    folder = with_generation_config(tiny, tmp_path / "len", max_length=n + 5)
    capped = ml.Generator(folder, backend="cpu", eos_token_ids=()).generate(PROMPTS[2])
    assert len(capped[0].tokens) == 5 and capped.stats.from_file["max_new_tokens"] == f"max_length {n + 5}"


def want_args() -> dict:
    return {k: v for k, v in QWEN_LIKE.items() if k != "do_sample"}


def test_the_command_says_which_defaults_came_from_the_file(tiny, tmp_path, capsys) -> None:
    folder = with_generation_config(tiny, tmp_path / "qwen-like", **QWEN_LIKE)
    args = ["generate", "--model", str(folder), "--prompt", PROMPTS[0], "--backend", "cpu", "--seed", "1"]
    assert main([*args, "--top-p", "0.5"]) == 0
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if "generation_config.json" in x)
    assert "temperature 0.7 (do_sample true)" in line and "top_k 20" in line and "repetition_penalty 1.05" in line
    assert "top_p" not in line, line  # the flag won
    assert main([*args, "--temperature", "0", "--max-new-tokens", "3"]) == 0
    line = next(x for x in capsys.readouterr().err.splitlines() if "generation_config.json" in x)
    assert "temperature" not in line and "max_new_tokens" not in line and "top_k 20" in line


def test_a_bad_generation_config_is_named(tiny, tmp_path) -> None:
    folder = with_generation_config(tiny, tmp_path / "bad", do_sample=True, top_p=1.5)
    with pytest.raises(GenerationError, match=r"generation_config.json: top_p must be a number in \(0, 1\]"):
        ml.Generator(folder, backend="cpu")


# ---- penalties, min-p ----------------------------------------------------------------------------------------


def test_greedy_with_a_repetition_penalty_is_transformers_generate(tiny) -> None:
    """transformers applies repetition_penalty when greedy too (the issue: Qwen2.5's 1.05 changed its
    greedy tokens from the 5th on); float32, 24 tokens, as transformers' generate."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    gen32 = ml.Generator(tiny, backend="cpu", dtype="float32", eos_token_ids=())
    ids = gen32.encode(PROMPTS[2])
    prompt = torch.tensor([ids])
    for penalty in (1.3, 1.05):
        with torch.no_grad():
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24, do_sample=False,
                                 repetition_penalty=penalty, eos_token_id=None)  # fmt: skip
        want = out[0, len(ids) :].tolist()
        assert gen32.generate(ids, max_new_tokens=24, repetition_penalty=penalty)[0].tokens == want, penalty
    plain = gen32.generate(ids, max_new_tokens=24)[0].tokens
    assert plain != gen32.generate(ids, max_new_tokens=24, repetition_penalty=1.3)[0].tokens


def test_penalties_and_min_p_through_generate_are_the_definitions_step_by_step(gen) -> None:
    """Sampled with all three penalties and min-p: the tokens host-driven steps give (each step's
    logits from the decode graph, ml.penalize's definition with the prompt's tokens and the counts so
    far, ml.sample's with the sequence's seed and offset): the prefill's first token included."""
    from megaloop.frontend.ops.sample import sample_tokens
    from megaloop.frontend.ops.sample_penalty import penalized
    from megaloop.models import build_llama
    from megaloop.models.llama import build_llama_prefill

    kw = {"temperature": 0.9, "min_p": 0.02, "repetition_penalty": 1.4, "presence_penalty": 0.7,
          "frequency_penalty": 0.3, "seed": 21}  # fmt: skip
    ids = gen.encode(PROMPTS[1])
    got = gen.generate(ids, max_new_tokens=10, **kw)[0].tokens
    cfg = ml.models.llama.LlamaConfig(**{**gen.cfg.__dict__, "max_seq": len(ids) + 10})
    feeds = {"tokens": np.array([ids]), "positions": np.arange(len(ids))[None], "last": np.array([len(ids) - 1])}
    out = ml.evaluate(build_llama_prefill(cfg, 1, len(ids)), feeds, gen.params)
    state, logits = out.state, out.outputs["logits"][0, 0]
    counts, mask, tokens = np.zeros(cfg.vocab), np.isin(np.arange(cfg.vocab), ids), []
    decode = build_llama(cfg, 1, 1)
    for step in range(10):
        scores = penalized(logits.astype(np.float32), counts, mask, 1.4, 0.7, 0.3)
        token = int(sample_tokens(scores, 21, len(ids) - 1 + step, 0.9, 0, 1.0, 0.02))
        tokens.append(token)
        counts[token] += 1
        step_out = ml.evaluate(decode, {"tokens": [[token]], "positions": [[len(ids) + step]]}, gen.params, state)
        state, logits = step_out.state, step_out.outputs["logits"][0, 0]
    assert got == tokens, (got, tokens)
    assert got != gen.generate(ids, max_new_tokens=10, temperature=0.9, seed=21)[0].tokens


def test_settings_out_of_range_are_named(gen) -> None:
    for kw, words in (
        ({"min_p": 1.5}, r"min_p must be a number in \[0, 1\]"),
        ({"repetition_penalty": 0}, "repetition_penalty must be a number > 0"),
        ({"presence_penalty": float("nan")}, "presence_penalty must be a finite number"),
        ({"n": 0}, "n must be an int >= 1"),
        ({"logprobs": 21}, r"logprobs must be an int in \[0, 20\]"),
        ({"stop": ""}, "stop must be a non-empty string"),
        ({"seed": 1.5}, "seed must be an int or one int per prompt"),
        ({"settings": [GenerationSettings()] * 2}, "one per prompt"),
    ):
        with pytest.raises(GenerationError, match=words):
            gen.generate("Hi", **kw)


# ---- seeds, n --------------------------------------------------------------------------------------------


def test_a_sampled_call_without_a_seed_draws_one_that_repeats_it(gen) -> None:
    first = gen.generate(PROMPTS[1], temperature=1.0, max_new_tokens=12)
    second = gen.generate(PROMPTS[1], temperature=1.0, max_new_tokens=12)
    assert first.stats.seed_drawn and first.stats.seed != second.stats.seed
    assert first[0].tokens != second[0].tokens  # 12 draws of a near-flat model: equal by chance ~never
    again = gen.generate(PROMPTS[1], temperature=1.0, max_new_tokens=12, seed=first.stats.seed)
    assert again[0].tokens == first[0].tokens and not again.stats.seed_drawn
    assert gen.generate(PROMPTS[1], max_new_tokens=3).stats.seed is None  # greedy: no seed at all


def test_any_integer_seed_works_mod_2_64(gen, tiny, capsys) -> None:
    big = 99999999999999999999
    kw = {"temperature": 1.0, "max_new_tokens": 6}
    assert gen.generate("Hi", seed=big, **kw)[0].tokens == gen.generate("Hi", seed=big % 2**64, **kw)[0].tokens
    assert gen.generate("Hi", seed=-5, **kw)[0].tokens == gen.generate("Hi", seed=2**64 - 5, **kw)[0].tokens
    args = ["generate", "--model", str(tiny), "--prompt", "Hi", "--backend", "cpu", "--temperature", "1"]
    assert main([*args, "--seed", str(big), "--max-new-tokens", "6"]) == 0
    out, err = capsys.readouterr()
    assert out == gen.generate("Hi", seed=big, **kw)[0].text + "\n"
    assert f"--seed {big} is reduced mod 2^64 to {big % 2**64}" in err and "OverflowError" not in err


def test_the_command_prints_a_drawn_seed_that_repeats_the_run(tiny, capsys) -> None:
    args = ["generate", "--model", str(tiny), "--prompt", PROMPTS[0], "--backend", "cpu", "--temperature", "1",
            "--max-new-tokens", "10"]  # fmt: skip
    assert main(args) == 0
    out, err = capsys.readouterr()
    seed = int(next(x for x in err.splitlines() if "seed" in x).split("--seed ")[1].split()[0])
    assert main([*args, "--seed", str(seed)]) == 0
    assert capsys.readouterr().out == out


def test_n_sequences_a_prompt_each_what_its_seed_gives_alone(gen) -> None:
    result = gen.generate([PROMPTS[0], PROMPTS[1]], n=3, temperature=1.0, seed=5, max_new_tokens=8)
    assert [(c.index, c.sample, c.seed) for c in result] == [(0, 0, 5), (0, 1, 6), (0, 2, 7), (1, 0, 8), (1, 1, 9),
                                                             (1, 2, 10)]  # fmt: skip
    for c in result:
        assert c.tokens == gen.generate([PROMPTS[0], PROMPTS[1]][c.index], seed=c.seed, temperature=1.0,
                                        max_new_tokens=8)[0].tokens  # fmt: skip
    assert len({tuple(c.tokens) for c in result[:3]}) == 3
    mixed = gen.generate(PROMPTS[:2], settings=[GenerationSettings(n=2, seed=40), GenerationSettings()],
                         temperature=1.0, seed=5, max_new_tokens=4)  # fmt: skip
    assert [c.seed for c in mixed] == [40, 41, 7]  # its own seed s + j; the others the call's seed + row


# ---- log-probabilities ---------------------------------------------------------------------------------------


def test_logprobs_are_log_softmax_of_the_models_logits(tiny) -> None:
    """Each token's log-probability and the 4 likeliest against torch's log_softmax of transformers'
    logits (float32) for the same prefix, greedy and sampled (the model's log-probabilities, before
    penalties and temperature): within float32 rounding; the first token's comes from the prefill."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    gen32 = ml.Generator(tiny, backend="cpu", dtype="float32", eos_token_ids=())
    ids = gen32.encode(PROMPTS[1])
    for kw in ({}, {"temperature": 1.2, "seed": 3, "repetition_penalty": 1.5}):
        c = gen32.generate(ids, max_new_tokens=8, logprobs=4, **kw)[0]
        assert [e.token for e in c.logprobs] == c.tokens
        with torch.no_grad():
            logits = model(torch.tensor([ids + c.tokens])).logits[0, len(ids) - 1 : -1]
        want = torch.log_softmax(logits.double(), -1).numpy()
        worst = 0.0
        for k, e in enumerate(c.logprobs):
            worst = max(worst, abs(e.logprob - want[k, e.token]), *(abs(lp - want[k, t]) for t, lp in e.top))
            assert [t for t, _ in e.top] == np.argsort(-want[k], kind="stable")[:4].tolist(), k
        assert worst < 2e-5, worst
    assert gen32.generate(ids, max_new_tokens=3, logprobs=0)[0].logprobs[0].top == []
    assert gen32.generate(ids, max_new_tokens=3)[0].logprobs is None


def test_the_command_prints_logprobs(tiny, capsys) -> None:
    args = ["generate", "--model", str(tiny), "--prompt", PROMPTS[0], "--backend", "cpu", "--max-new-tokens", "4"]
    assert main([*args, "--logprobs", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    table = out[out.index("token\tlogprob\tlikeliest (token: logprob)") + 1 :]
    assert len(table) == 4 and all(len(row.split("\t")) == 3 and row.split("\t")[2].count(": ") == 2 for row in table)
    assert main([*args, "--logprobs", "2", "--n", "2"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert len(lines) == 2 and len(lines[0]["logprobs"]) == 4 and len(lines[0]["logprobs"][0]["top"]) == 2


# ---- stop strings --------------------------------------------------------------------------------------------


def test_a_stop_string_across_tokens_ends_the_text_before_it(gen) -> None:
    """A stop string made of the end of one token's text and the start of the next one's: the text ends
    right before it (not printed, as OpenAI's API does), the streamed pieces add up to that text, the
    tokens end with the one that completed it; the earliest of several stops wins."""
    free = gen.generate(PROMPTS[2], max_new_tokens=30)[0]
    pieces = [gen.tokenizer.decode(free.tokens[: k + 1]) for k in range(len(free.tokens))]
    k = next(k for k in range(3, 25) if len(pieces[k]) - len(pieces[k - 1]) >= 2 and len(pieces[k - 1]) >= 2
             and pieces[k - 1][-2:].isprintable())  # fmt: skip
    at = len(pieces[k - 1]) - 2
    stop = free.text[at : at + 4]  # two characters of token k - 1, two of token k
    assert free.text.find(stop) == at, "pick a stop string that first occurs there"
    streamed: list[str] = []
    got = gen.generate(
        PROMPTS[2], max_new_tokens=30, stop=["never appears", stop], on_text=lambda i, t: streamed.append(t)
    )
    c = got[0]
    assert c.text == free.text[:at] and "".join(streamed) == c.text
    assert c.finish_reason == "stop" and c.stop == stop and c.tokens == free.tokens[: k + 1]
    later = free.text[at + 6 : at + 9]
    assert gen.generate(PROMPTS[2], max_new_tokens=30, stop=[later, stop])[0].stop == stop  # the earliest
    assert gen.generate(PROMPTS[2], max_new_tokens=30, stop="never appears")[0].text == free.text


def test_stop_strings_in_a_batch_end_only_their_sequence(gen) -> None:
    free = gen.generate(PROMPTS, max_new_tokens=16)
    stop = free[1].text[5:8]
    result = gen.generate(PROMPTS, max_new_tokens=16, settings=[GenerationSettings(), GenerationSettings(stop=stop),
                                                                GenerationSettings()])  # fmt: skip
    assert result[1].text == free[1].text[: free[1].text.find(stop)] and result[1].finish_reason == "stop"
    assert result[0].tokens == free[0].tokens and result[2].tokens == free[2].tokens


@pytest.mark.parametrize("strategy", ["tp", "dp"])
def test_penalties_min_p_and_logprobs_split_over_two_devices(tiny, strategy) -> None:
    """The new states (counts, prompt tokens, penalties, min_p, the logprobs history) split with the
    generator: the tokens one device draws, the log-probabilities within tp's reassociation."""
    kw = {"max_new_tokens": 8, "temperature": 0.8, "seed": 3, "repetition_penalty": 1.3, "presence_penalty": 0.5,
          "frequency_penalty": 0.2, "min_p": 0.01, "logprobs": 2}  # fmt: skip
    one = ml.Generator(tiny, backend="cpu", dtype="float32", eos_token_ids=()).generate(["Hi", "Once upon"], **kw)
    two = ml.Generator(tiny, backend="cpu", dtype="float32", eos_token_ids=(), devices=2, strategy=strategy)
    got = two.generate(["Hi", "Once upon"], **kw)
    assert [c.tokens for c in got] == [c.tokens for c in one]
    worst = max(abs(x.logprob - y.logprob) for c, d in zip(got, one) for x, y in zip(c.logprobs, d.logprobs))
    assert worst <= 1e-5, worst

"""``megaloop generate`` on the loop kernel (skipped without a GPU): the tiny checkpoint's greedy
tokens equal to the CPU reference's, batched and alone; checkpoints of every family saved by
transformers (Gemma 2/3, Phi-3 and OLMo 2 included) equal to transformers' generate (float32); the
command line on the GPU. The CPU paths of all of it: tests/test_generate.py, tests/test_hf_models.py,
tests/test_family_kernels.py."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest

import megaloop as ml
from megaloop.cli import main
from megaloop.models.tiny import make_tiny_checkpoint
from megaloop.runtime.device import gpus

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpus()[0], reason="no GPU: " + gpus()[1])]

PROMPTS = ["Hi", "Once upon a loop, a kernel", "A loop kernel is one program that stays on the GPU and runs"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


def test_the_loop_kernel_generates_the_cpu_references_tokens(tiny) -> None:
    gpu = ml.Generator(tiny, backend="gpu", dtype="float32")
    cpu = ml.Generator(tiny, backend="cpu", dtype="float32")
    assert gpu.backend == "gpu"
    batch = gpu.generate(PROMPTS, max_new_tokens=40)
    print(batch.stats.summary())
    want = cpu.generate(PROMPTS, max_new_tokens=40)
    assert [c.tokens for c in batch] == [c.tokens for c in want]
    for prompt, c in zip(PROMPTS, batch):  # alone: the same tokens as in the batch
        assert gpu.generate(prompt, max_new_tokens=40)[0].tokens == c.tokens
    again = ml.Generator(tiny, backend="gpu", dtype="float32").generate(PROMPTS, max_new_tokens=40)
    assert [c.tokens for c in again] == [c.tokens for c in batch]  # plans from the cache: the same run
    assert batch.stats.decode_steps == 39 and batch.stats.per_token_s > 0


def test_sampling_on_the_loop_kernel_draws_the_cpu_references_tokens(tiny) -> None:
    """The same seed, the same tokens on the GPU as on the CPU reference (float32: the logits agree
    to rounding, a draw parts only if it falls within that of a boundary)."""
    kw = {"temperature": 0.9, "top_k": 40, "top_p": 0.95, "seed": 11, "max_new_tokens": 32}
    gpu = ml.Generator(tiny, backend="gpu", dtype="float32").generate(PROMPTS, **kw)
    cpu = ml.Generator(tiny, backend="cpu", dtype="float32").generate(PROMPTS, **kw)
    assert [c.tokens for c in gpu] == [c.tokens for c in cpu]


def test_bfloat16_on_the_loop_kernel_stays_close_to_float32(tiny) -> None:
    """bfloat16 tokens may part from float32's after a near tie; the first ones agree."""
    bf16 = ml.Generator(tiny, backend="gpu").generate(PROMPTS[2], max_new_tokens=8)[0].tokens
    ref = ml.Generator(tiny, backend="cpu").generate(PROMPTS[2], max_new_tokens=8)[0].tokens
    assert bf16[:2] == ref[:2], (bf16, ref)


@pytest.mark.parametrize("name", ["llama3-tied", "llama-linear-bias", "mistral-window", "qwen2-window", "qwen3"])
def test_every_family_on_the_loop_kernel_matches_transformers(name, tmp_path) -> None:
    from tests.hf_models import make_model, torch

    model = make_model(name, tmp_path)
    prompt = [0, *np.random.default_rng(1).integers(1, 96, 6).tolist()]
    ids = torch.tensor([prompt])  # id 0 is pad_token_id: the mask keeps generate from hiding it
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                             eos_token_id=None, pad_token_id=0)  # fmt: skip
    got = ml.Generator(tmp_path, backend="gpu", dtype="float32", eos_token_ids=()).generate(prompt, max_new_tokens=16)
    assert got[0].tokens == out[0, len(prompt) :].tolist()


NEW_FAMILIES = ["gemma2", "gemma3", "phi3-longrope", "phi4-mini", "olmo2"]


@pytest.mark.parametrize("name", NEW_FAMILIES)
def test_the_new_families_on_the_loop_kernel_match_transformers(name, tmp_path) -> None:
    """Gemma 2/3 (softcaps, sandwich norms, local rope, GeGLU), Phi-3/Phi-4-mini (fused weights,
    longrope: a prompt past its switch, as in tests/test_hf_models.py), OLMo 2: 32 greedy tokens of the
    loop kernel equal to transformers' generate (float32)."""
    from tests.hf_models import make_model, torch
    from tests.test_hf_models import PROMPT_LENGTH

    model = make_model(name, tmp_path)
    prompt = [0, *np.random.default_rng(1).integers(1, 96, PROMPT_LENGTH.get(name, 7) - 1).tolist()]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                             eos_token_id=None, pad_token_id=0)  # fmt: skip
    got = ml.Generator(tmp_path, backend="gpu", dtype="float32", eos_token_ids=()).generate(prompt, max_new_tokens=32)
    assert got[0].tokens == out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("name", NEW_FAMILIES)
def test_the_new_families_on_the_loop_kernel_are_the_cpu_reference(name, tmp_path) -> None:
    """Batched, short prompts (Phi-3's longrope switches to its long factors during decoding), float32
    and bfloat16 (the tensor-core prefill with softcapped scores): the loop kernel's greedy tokens are
    the CPU reference's (bfloat16: the first ones, which no near tie has parted)."""
    from tests.hf_models import make_model

    make_model(name, tmp_path)
    prompts = [[0, *np.random.default_rng(s).integers(1, 96, n).tolist()] for s, n in ((1, 6), (2, 17), (3, 2))]
    for dtype, agree in (("float32", 40), ("bfloat16", 2)):
        gpu = ml.Generator(tmp_path, backend="gpu", dtype=dtype, eos_token_ids=()).generate(prompts, max_new_tokens=40)
        cpu = ml.Generator(tmp_path, backend="cpu", dtype=dtype, eos_token_ids=()).generate(prompts, max_new_tokens=40)
        for g, c in zip(gpu, cpu):
            assert g.tokens[:agree] == c.tokens[:agree], (dtype, g.tokens, c.tokens)


def test_the_command_on_the_gpu(tiny, capsys) -> None:
    assert main(["generate", "--model", str(tiny), "--prompt", PROMPTS[1], "--max-new-tokens", "24"]) == 0
    out, err = capsys.readouterr()
    assert "on the loop kernel" in err and re.search(r"\d+ decode steps in [\d.]+ s", err), err
    assert out.strip()


def test_penalties_min_p_and_logprobs_on_the_loop_kernel_are_the_cpu_references(tiny) -> None:
    """The penalties (counts and prompt tokens in states), min-p and the top-3 log-probabilities made
    in the loop kernel: float32, the CPU reference's tokens (a draw parts only within rounding of a
    boundary), log-probabilities within float32 rounding of the reference's, greedy with a repetition
    penalty too; stop strings and n sequences through the same run."""
    kw = {"temperature": 0.9, "min_p": 0.02, "repetition_penalty": 1.3, "presence_penalty": 0.4,
          "frequency_penalty": 0.2, "seed": 11, "max_new_tokens": 32, "logprobs": 3}  # fmt: skip
    gpu = ml.Generator(tiny, backend="gpu", dtype="float32")
    cpu = ml.Generator(tiny, backend="cpu", dtype="float32")
    for settings in (kw, {**kw, "temperature": 0.0}, {**kw, "n": 2, "stop": ["e"]}):
        got, want = gpu.generate(PROMPTS, **settings), cpu.generate(PROMPTS, **settings)
        assert [c.tokens for c in got] == [c.tokens for c in want], settings
        assert [c.text for c in got] == [c.text for c in want]
        worst = max(abs(a.logprob - b.logprob) for c, d in zip(got, want) for a, b in zip(c.logprobs, d.logprobs))
        assert worst < 5e-5, f"log-probabilities {worst:.1e} from the reference's"
        for c, d in zip(got, want):
            assert [[t for t, _ in a.top] for a in c.logprobs] == [[t for t, _ in b.top] for b in d.logprobs]


def test_greedy_repetition_penalty_on_the_loop_kernel_is_transformers(tmp_path) -> None:
    from tests.hf_models import make_model, torch

    model = make_model("qwen2", tmp_path)
    prompt = [0, *np.random.default_rng(2).integers(1, 96, 6).tolist()]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                             repetition_penalty=1.05, eos_token_id=None, pad_token_id=0)  # fmt: skip
    gen = ml.Generator(tmp_path, backend="gpu", dtype="float32", eos_token_ids=())
    assert gen.generate(prompt, max_new_tokens=16, repetition_penalty=1.05)[0].tokens == out[0, len(prompt) :].tolist()


def test_the_command_on_the_gpu_with_the_new_settings(tiny, capsys) -> None:
    args = ["generate", "--model", str(tiny), "--prompt", PROMPTS[1], "--max-new-tokens", "12", "--temperature", "0.8",
            "--min-p", "0.05", "--repetition-penalty", "1.2", "--n", "2", "--logprobs", "2"]  # fmt: skip
    assert main(args) == 0
    out, err = capsys.readouterr()
    lines = [json.loads(x) for x in out.splitlines()]
    assert len(lines) == 2 and all(len(x["logprobs"]) == len(x["tokens"]) for x in lines)
    assert "on the loop kernel" in err and "drawn: --seed" in err


def test_ctrl_c_on_the_loop_kernel_stops_cleanly(tiny, tmp_path) -> None:
    """SIGINT while the generator's loop kernel runs: the text so far and a newline, the timings, exit
    status 130, no traceback; the kernel stopped (a second run in a new process works). The tiny
    model with a 32K context, so that its run lasts seconds on a GPU (2048 tokens take ~0.1 s)."""
    from tests.test_generate_cli import interrupt

    long = tmp_path / "tiny-32k"
    shutil.copytree(tiny, long)
    config = json.loads((long / "config.json").read_text())
    (long / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 32768}))
    args = ["generate", "--model", str(long), "--prompt", "Once", "--max-new-tokens", "32000", "--temperature", "1",
            "--seed", "1", "--no-progress"]  # fmt: skip
    code, out, err, took = interrupt(args, ready="", after=0.3)
    assert code == 130 and took < 10 and "Traceback" not in err, (code, took, err)
    assert out.endswith("\n") and "interrupted after" in err and "on the loop kernel" in err
    assert main(["generate", "--model", str(tiny), "--prompt", "Hi", "--max-new-tokens", "4"]) == 0

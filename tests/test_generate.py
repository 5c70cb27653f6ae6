"""``megaloop generate`` and ``megaloop.Generator`` end to end on the CPU reference, on the tiny
checkpoint ``megaloop make-tiny-checkpoint`` writes: streamed text, stops at the model's
end-of-sequence tokens or max tokens, the timing line, batches of prompts of different lengths
giving each the tokens it gets alone; and the tiny checkpoint as transformers reads it."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import megaloop as ml
from megaloop.cli import main
from megaloop.errors import CheckpointError
from megaloop.generation import GenerationError
from megaloop.models.tiny import make_tiny_checkpoint

PROMPTS = ["Hi", "Once upon a loop, a kernel", "A loop kernel is one program that stays on the GPU and runs"]
TIMING = (
    r"prefill [\d.]+ ms \(first token after [\d.]+ s\); \d+ decode steps in [\d.]+ s: [\d.]+ ms/token, "
    r"[\d.]+ tokens/s"
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    assert main(["make-tiny-checkpoint", str(folder)]) == 0
    return folder


@pytest.fixture(scope="module")
def gen(tiny):
    return ml.Generator(tiny, backend="cpu")


def test_generate_streams_text_and_reports_timing(tiny, gen, capsys) -> None:
    assert main(["generate", "--model", str(tiny), "--prompt", PROMPTS[1], "--max-new-tokens", "12",
                 "--backend", "cpu"]) == 0  # fmt: skip
    out, err = capsys.readouterr()
    want = gen.generate(PROMPTS[1], max_new_tokens=12)[0]
    assert out == want.text + "\n"  # stdout is the text alone
    assert want.finish_reason == "length" and len(want.tokens) == 12
    assert "on the CPU (numpy and BLAS) (asked for)" in err and re.search(TIMING, err), err


def test_text_arrives_piece_by_piece(gen) -> None:
    pieces: list[tuple[int, str]] = []
    result = gen.generate(PROMPTS[2], max_new_tokens=20, on_text=lambda i, t: pieces.append((i, t)))
    assert len(pieces) > 3 and {i for i, _ in pieces} == {0}
    assert "".join(t for _, t in pieces) == result[0].text == gen.tokenizer.decode(result[0].tokens)


def test_generation_stops_at_an_end_of_sequence_token(tiny, tmp_path, capsys) -> None:
    """The model's stop tokens (generation_config.json's eos_token_id list): a copy of the tiny
    checkpoint whose list holds the 6th token greedy decoding makes stops right before it."""
    free = ml.Generator(tiny, backend="cpu", eos_token_ids=()).generate(PROMPTS[0], max_new_tokens=16)[0].tokens
    at = next(i for i in range(3, 16) if free[i] not in free[:i])
    folder = tmp_path / "stops"
    shutil.copytree(tiny, folder)
    path = folder / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "eos_token_id": [free[at]]}))
    assert main(["generate", "--model", str(folder), "--prompt", PROMPTS[0], "--max-new-tokens", "16",
                 "--backend", "cpu"]) == 0  # fmt: skip
    out, err = capsys.readouterr()
    result = ml.Generator(folder, backend="cpu").generate(PROMPTS[0], max_new_tokens=16)[0]
    assert result.tokens == free[:at] and result.finish_reason == "stop"
    assert out == result.text + "\n" and f"{at} decode steps" in err  # the stop token came from step at


def test_a_batch_gives_each_prompt_its_own_tokens(tiny, gen, tmp_path, capsys) -> None:
    """Prompts of different lengths in one batch (a padded prefill; each sequence from its own last
    prompt position) get exactly the tokens each gets alone (greedy)."""
    batch = tmp_path / "prompts.txt"
    batch.write_text("\n".join(PROMPTS) + "\n\n")
    assert main(["generate", "--model", str(tiny), "--batch-file", str(batch), "--max-new-tokens", "10",
                 "--backend", "cpu"]) == 0  # fmt: skip
    out, err = capsys.readouterr()
    lines = [json.loads(line) for line in out.splitlines()]
    assert [line["prompt"] for line in lines] == PROMPTS and "3 sequences" in err
    lengths = {len(gen.encode(p)) for p in PROMPTS}
    assert len(lengths) == 3
    for line, prompt in zip(lines, PROMPTS):
        alone = gen.generate(prompt, max_new_tokens=10)[0]
        assert line["tokens"] == alone.tokens and line["text"] == alone.text
    chats = gen.generate(PROMPTS, chat=True, max_new_tokens=6)  # the same with the chat template
    assert [c.tokens for c in chats] == [gen.generate(p, chat=True, max_new_tokens=6)[0].tokens for p in PROMPTS]


def test_a_sequence_that_ended_stops_changing(tiny) -> None:
    """In a batch, a sequence that met its stop token keeps its result while the others go on."""
    free = ml.Generator(tiny, backend="cpu", eos_token_ids=()).generate(PROMPTS, max_new_tokens=12)
    stop = free[0].tokens[4]
    others = [c.tokens for c in free[1:]]
    gen = ml.Generator(tiny, backend="cpu", eos_token_ids=[stop])
    result = gen.generate(PROMPTS, max_new_tokens=12)
    assert result[0].tokens == free[0].tokens[: free[0].tokens.index(stop)] and result[0].finish_reason == "stop"
    for c, tokens in zip(result[1:], others):
        cut = tokens.index(stop) if stop in tokens else len(tokens)
        assert c.tokens == tokens[:cut]


def test_prompts_that_cannot_be_served_are_named(tiny, gen, tmp_path) -> None:
    with pytest.raises(GenerationError, match=r"need 2051 positions; the context is 2048"):
        gen.generate([1] * 2000, max_new_tokens=51)
    with pytest.raises(GenerationError, match="the prompt is empty"):
        gen.generate([[5, 6], []], max_new_tokens=1)
    with pytest.raises(GenerationError, match="no prompts"):
        gen.generate([])
    assert gen.encode("") == [gen.tokenizer.bos_token_id]  # text gets the tokenizer's BOS
    with pytest.raises(GenerationError, match=r"outside the vocabulary \[0, 512\)"):
        gen.generate([1, 512])
    with pytest.raises(GenerationError, match="max_new_tokens"):
        gen.generate("Hi", max_new_tokens=0)
    with pytest.raises(GenerationError, match="top_p"):
        gen.generate("Hi", top_p=0.0)
    no_tokenizer = tmp_path / "bare"
    shutil.copytree(tiny, no_tokenizer)
    (no_tokenizer / "tokenizer.json").unlink()
    bare = ml.Generator(no_tokenizer, backend="cpu")
    assert bare.generate([1, 2, 3], max_new_tokens=3)[0].tokens == gen.generate([1, 2, 3], max_new_tokens=3)[0].tokens
    with pytest.raises(GenerationError, match=r"no tokenizer\.json"):
        bare.generate("Hi")


def test_make_tiny_checkpoint_never_overwrites_other_files(tmp_path, capsys) -> None:
    folder = tmp_path / "t"
    make_tiny_checkpoint(folder)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    make_tiny_checkpoint(folder)  # the same bytes: nothing to do
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    (folder / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"already has config\.json"):
        make_tiny_checkpoint(folder)
    assert main(["make-tiny-checkpoint", str(folder)]) == 2
    assert "already has config.json" in capsys.readouterr().err
    assert main(["make-tiny-checkpoint", str(folder), "--force"]) == 0
    assert (folder / "config.json").read_bytes() == before["config.json"]


def test_transformers_reads_the_tiny_checkpoint(tiny, gen) -> None:
    """The tiny checkpoint is an ordinary Hugging Face one: transformers loads the model and the
    tokenizer, and generates the same greedy tokens (float32) from the same chat prompt."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(tiny)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "What is a loop? 🙂"}]  # fmt: skip
    text = gen.tokenizer.apply_chat_template(chat)
    assert text == tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    ids = gen.encode(chat)
    assert ids == tok(text, add_special_tokens=False).input_ids
    with torch.no_grad():
        prompt = torch.tensor([ids])
        want = model.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24, do_sample=False, eos_token_id=None
        )
    got = ml.Generator(tiny, backend="cpu", dtype="float32", eos_token_ids=()).generate(chat, max_new_tokens=24)
    assert got[0].tokens == want[0, len(ids) :].tolist()


def test_the_command_line_basics(tmp_path) -> None:
    run = lambda *a: subprocess.run([sys.executable, "-m", "megaloop", *a], capture_output=True, text=True)
    assert run("--version").stdout.strip() == f"megaloop {ml.__version__}"
    proc = subprocess.Popen([sys.executable, "-m", "megaloop", "ops"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # as `megaloop ops | head` does once it has its lines
    assert proc.wait(timeout=120) == 1 and proc.stderr.read() == b""  # no BrokenPipeError traceback
    bad = run("generate", "--model", str(tmp_path), "--prompt", "x", "--max-new-tokens", "0")
    assert bad.returncode == 2 and "expected an integer >= 1" in bad.stderr
    missing = run("generate", "--model", str(tmp_path), "--prompt", "x", "--backend", "cpu")
    assert missing.returncode == 2 and "config.json" in missing.stderr and "Traceback" not in missing.stderr


def test_sampling_settings(gen) -> None:
    """temperature > 0 samples in the kernel: the same seed gives the same tokens, another seed
    others; each sequence's draws depend on its seed and positions, not on the rest of the batch; the
    first token is drawn from the prefill's logits as the generator draws the next ones."""
    from megaloop.frontend.ops.sample import sample_tokens
    from megaloop.models.llama import build_llama_prefill

    kw = {"temperature": 0.8, "top_k": 20, "top_p": 0.9, "max_new_tokens": 12}
    first = gen.generate(PROMPTS, seed=7, **kw)
    assert [c.tokens for c in gen.generate(PROMPTS, seed=7, **kw)] == [c.tokens for c in first]
    assert [c.tokens for c in gen.generate(PROMPTS, seed=8, **kw)] != [c.tokens for c in first]
    assert [gen.generate(p, seed=7 + i, **kw)[0].tokens for i, p in enumerate(PROMPTS)] == [c.tokens for c in first]
    copies = gen.generate([PROMPTS[0]] * 2, seed=7, **kw)  # prompt i draws with seed + i: copies differ
    assert copies[0].tokens == first[0].tokens and copies[1].tokens != copies[0].tokens
    assert gen.generate([PROMPTS[0]] * 2, seed=[5, 5], **kw).completions[1].tokens == gen.generate(
        PROMPTS[0], seed=5, **kw
    )[0].tokens
    ids = gen.encode(PROMPTS[1])
    cfg = dataclasses.replace(gen.cfg, max_seq=len(ids))
    feeds = {"tokens": np.array([ids]), "positions": np.arange(len(ids))[None], "last": np.array([len(ids) - 1])}
    logits = ml.evaluate(build_llama_prefill(cfg, 1, len(ids)), feeds, gen.params).outputs["logits"]
    assert first[1].tokens[0] == int(sample_tokens(logits[0, 0], 7 + 1, len(ids) - 1, 0.8, 20, 0.9))
    greedy = gen.generate(PROMPTS[0], max_new_tokens=6)[0].tokens
    assert gen.generate(PROMPTS[0], temperature=1e-39, max_new_tokens=6, seed=3)[0].tokens == greedy  # T < 2^-126

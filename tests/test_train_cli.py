"""``megaloop train`` (megaloop/training/commands.py) on the README's tiny checkpoint (bfloat16, tied
embeddings, a real tokenizer) on the CPU: the checkpoint it writes loads in transformers with the
logits megaloop's reference computes from the trained weights, and ``megaloop generate`` loads it;
hostile inputs are refused before any work, naming the file or flag.

Tolerance of the logits: transformers runs the bfloat16 model in bfloat16 (its products' sums in
float32, each op's result rounded to bfloat16); megaloop's reference rounds at the same points, but
their roundings may fall on either side of a tie, so the logits agree within a few bfloat16 ulps of
the largest: 8 eps_bf16 of the largest logit (the worst is printed)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import megaloop as ml
from megaloop.cli import main
from megaloop.models import build_llama, load_llama
from megaloop.models.tiny import CORPUS, make_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text(CORPUS * 3)
    return path


def train(tiny: Path, text: Path, out: Path, *extra: str) -> int:
    args = ["train", "--model", str(tiny), "--data", str(text), "--output", str(out), "--backend", "cpu"]
    return main([*args, "--steps", "6", "--batch", "2", "--seq", "32", "--lr", "3e-3", "--no-progress", *extra])


def test_train_writes_a_checkpoint_transformers_and_generate_load(tiny, text, tmp_path, capsys) -> None:
    out = tmp_path / "tuned"
    assert train(tiny, text, out, "--save-every", "4", "--warmup", "2") == 0
    summary = capsys.readouterr().out
    assert "trained 6 steps on cpu" in summary and "MFU n/a" in summary, summary
    record = json.loads((out / "megaloop_training.json").read_text())
    assert record["steps"] == 6 and len(record["losses"]) == 6 and record["losses"][-1] < record["losses"][0]
    assert (out / "checkpoint-4" / "model.safetensors").is_file()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (tiny / name).read_bytes(), name
    cfg, params = load_llama(out)
    _, before = load_llama(tiny)
    assert all(params[n].dtype == before[n].dtype for n in params)  # the checkpoint's own dtypes (bfloat16)
    assert not all(np.array_equal(params[n], before[n]) for n in params)  # (trained)
    ids = np.array([[5, 77, 120, 300, 12, 9, 44, 250]], np.int64)
    g = build_llama(cfg.__class__(**{**cfg.__dict__, "max_seq": 16}), 1, ids.shape[1])
    ours = ml.evaluate(g, {"tokens": ids, "positions": np.arange(8)[None]}, params).outputs["logits"]
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    with torch.no_grad():
        theirs = model(torch.from_numpy(ids)).logits.float().numpy()
    err = np.abs(ours.astype(np.float32) - theirs)
    bound = 8 * float(ml.bfloat16.eps) * float(np.abs(theirs).max())
    print(f"logits: worst error {float(err.max()):.3g} = {float(err.max()) / bound:.3f} of the tolerance")
    assert err.max() <= bound
    assert main(["generate", "--model", str(out), "--prompt", "Once", "--max-new-tokens", "3", "--backend", "cpu"]) == 0


@pytest.mark.parametrize(
    "case,words",
    [
        ("missing-data", ("does not exist", "nope.txt")),
        ("seq-too-long", ("seq 4096", "2048 positions")),
        ("output-not-empty", ("not empty", "--overwrite")),
        ("strategy", ("unknown --strategy", "'ring'")),
        ("devices", ("--strategy 'pp2xtp2' does not fit --devices 2",)),
        ("too-little-data", ("fewer than one batch",)),
        ("output-is-model", ("checkpoint being trained",)),
    ],
)
def test_hostile_inputs_are_refused(case, words, tiny, text, tmp_path, capsys) -> None:
    out = tmp_path / "out"
    extra: list[str] = []
    data = text
    if case == "missing-data":
        data = tmp_path / "nope.txt"
    elif case == "seq-too-long":
        extra = ["--seq", "4096"]
    elif case == "output-not-empty":
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    elif case == "strategy":
        extra = ["--strategy", "ring"]
    elif case == "devices":
        extra = ["--devices", "2", "--strategy", "pp2xtp2"]
    elif case == "too-little-data":
        data = tmp_path / "short.txt"
        data.write_text("a few words")
    elif case == "output-is-model":
        out = tiny
    assert train(tiny, data, out, *extra) == 2
    err = capsys.readouterr().err
    assert "megaloop train:" in err and all(w in err for w in words), err
    if case == "output-not-empty":
        assert (out / "notes.txt").read_text() == "mine" and len(list(out.iterdir())) == 1

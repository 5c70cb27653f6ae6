"""``ml.Trainer`` with ``devices`` > 1 (megaloop/training/split.py): the training step split by
``ml.parallelize_training`` and run on the CPU's multi-rank reference, each rank's token windows
resident and read by the step counter (one step, one iteration; several steps a run). A tiny Llama
(transformers' random init, saved with save_pretrained) trained 4 AdamW steps by DP2, ZeRO-2 (with 2
accumulated micro-batches a step), TP2 and PP2 (2 micro-batches) against one device's Trainer on the
same windows: each step's loss, learning rate and gradient norm on every rank, and the weights at the
end. ``megaloop train --devices 2 --strategy dp`` writes the checkpoint one device's run writes (names,
dtypes, a tied head left out) and transformers loads it; bad combinations are refused naming the flag.

Tolerances (as tests/test_train_split.py derives them): the ranks sum the same float32 products in
other orders, so losses and gradient norms within 64 float32 eps of their size; AdamW normalises each
element's step to about lr, so a weight whose gradient is a near-cancelling sum may move by a fraction
of lr more or less: 2^-10 lr a step. The worst ratio to the tolerance is printed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from transformers import AutoModelForCausalLM

import megaloop as ml
from megaloop.cli import main
from megaloop.errors import UsageError
from megaloop.models import build_llama, load_llama
from megaloop.models.tiny import CORPUS, make_tiny_checkpoint
from megaloop.training.graph import OptimizerSettings
from megaloop.training.trainer import Trainer, TrainSettings
from tests.helpers import save_tiny_transformers_llama

EPS = float(np.finfo(np.float32).eps)
STEPS, BATCH, SEQ, VOCAB, LR = 4, 4, 16, 97, 3e-3


def optimizer(accumulate: int = 1) -> OptimizerSettings:
    return OptimizerSettings(
        lr=LR, weight_decay=0.1, betas=(0.9, 0.95), warmup=1, min_lr=3e-4, max_norm=1.0, accumulate=accumulate
    )


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> Path:
    return save_tiny_transformers_llama(tmp_path_factory.mktemp("tiny-hf"), VOCAB)


TOKENS = np.random.default_rng(0).integers(0, VOCAB, 5 * BATCH * (SEQ + 1))  # 5 batches: the steps wrap around


def run(folder: Path, **kw) -> tuple[ml.TrainResult, dict[str, np.ndarray], list[dict[str, list[float]]]]:
    accumulate = kw.pop("accumulate", 1)
    settings = TrainSettings(
        steps=STEPS, batch=BATCH, seq=SEQ, optimizer=optimizer(accumulate), backend="reference", steps_per_run=3, **kw
    )
    trainer = Trainer(folder, settings, progress=False)
    result = trainer.train(TOKENS)
    return result, trainer.weights(), trainer.histories()


@pytest.fixture(scope="module")
def one_device(tiny_hf):
    cache: dict[int, tuple] = {}

    def get(accumulate: int):
        if accumulate not in cache:
            cache[accumulate] = run(tiny_hf, accumulate=accumulate)
        return cache[accumulate]

    return get


CASES = [("dp", {}), ("zero2", {"accumulate": 2}), ("tp", {}), ("pp", {"micro_batches": 2})]


@pytest.mark.parametrize(("strategy", "kw"), CASES, ids=[c[0] for c in CASES])
def test_a_split_trainer_trains_like_one_device(tiny_hf, one_device, strategy, kw) -> None:
    want, want_weights, want_hist = one_device(kw.get("accumulate", 1))
    got, weights, hist = run(tiny_hf, devices=2, strategy=strategy, **kw)
    assert len(got.micro_losses) == len(want.micro_losses) == STEPS * kw.get("accumulate", 1)
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(got.micro_losses, want.micro_losses))
    (ref,) = want_hist
    assert len(hist) == 2 and all("lr" in h and "grad_norm" in h for h in hist)
    assert sum("loss" in h for h in hist) == (1 if strategy == "pp" else 2)  # (a pipeline's last stage)
    norm_err = 0.0
    for rank, h in enumerate(hist):
        assert h["lr"] == pytest.approx(ref["lr"], rel=4 * EPS), f"rank {rank}'s learning rates"
        norm_err = max(norm_err, *(abs(a - b) / b for a, b in zip(h["grad_norm"], ref["grad_norm"])))
        if "loss" in h:
            assert h["loss"] == got.micro_losses, f"rank {rank}'s loss history"
    worst, name = 0.0, ""
    for key, ref_w in want_weights.items():
        assert weights[key].dtype == ref_w.dtype and weights[key].shape == ref_w.shape, key
        err = float(np.max(np.abs(weights[key].astype(np.float64) - ref_w)))
        if err / (STEPS * LR * 2**-10) > worst:
            worst, name = err / (STEPS * LR * 2**-10), key
    print(
        f"{strategy}: losses {got.losses} vs one device's {want.losses}: worst {loss_err / (64 * EPS):.3f} of the "
        f"tolerance; grad norms {norm_err / (64 * EPS):.3f}; worst weight {name} at {worst:.3f}"
    )
    assert set(weights) == set(want_weights)
    assert loss_err <= 64 * EPS, f"{strategy}: losses {got.micro_losses} against {want.micro_losses}"
    assert norm_err <= 64 * EPS, f"{strategy}: gradient norms off by {norm_err:.2e} relative"
    assert worst <= 1.0, f"{strategy}: weight {name} off by {worst:.2f}x the tolerance"
    assert got.losses[-1] < got.losses[0]


def test_megaloop_train_on_two_ranks_writes_one_devices_checkpoint(tmp_path, capsys) -> None:
    """The README's tiny checkpoint (bfloat16, tied embeddings, its tokenizer): DP2 on the CPU and one
    device write the same files (names, dtypes; the tied head not stored), losses within 2 (s + 1)
    bfloat16 eps; transformers loads the DP2 checkpoint with the logits megaloop's reference gives on
    its weights (8 bfloat16 eps of the largest, as tests/test_train_cli.py)."""
    tiny = make_tiny_checkpoint(tmp_path / "tiny-llama")
    text = tmp_path / "corpus.txt"
    text.write_text(CORPUS * 3)
    outs = {}
    for label, extra in (("one", []), ("dp2", ["--devices", "2", "--strategy", "dp"])):
        outs[label] = tmp_path / label
        args = ["train", "--model", str(tiny), "--data", str(text), "--output", str(outs[label])]
        args += ["--backend", "reference", "--steps", "3", "--batch", "2", "--seq", "32", "--lr", "3e-3"]
        assert main([*args, "--no-progress", *extra]) == 0
    printed = capsys.readouterr()
    assert "split over 2 ranks: dp2" in printed.err and "trained 3 steps on reference (dp2)" in printed.out, printed
    one, dp = (load_file(str(outs[k] / "model.safetensors")) for k in ("one", "dp2"))
    assert sorted(one) == sorted(dp) and "lm_head.weight" not in dp
    assert all(one[n].dtype == dp[n].dtype == ml.bfloat16.np for n in one)
    losses = [json.loads((outs[k] / "megaloop_training.json").read_text())["losses"] for k in ("one", "dp2")]
    for s, (a, b) in enumerate(zip(*losses)):
        assert abs(a - b) <= 2 * (s + 1) * float(ml.bfloat16.eps) * abs(a), (s, losses)
    cfg, params = load_llama(outs["dp2"])
    ids = np.array([[5, 77, 120, 300, 12, 9, 44, 250]], np.int64)
    g = build_llama(cfg.__class__(**{**cfg.__dict__, "max_seq": 16}), 1, ids.shape[1])
    ours = ml.evaluate(g, {"tokens": ids, "positions": np.arange(8)[None]}, params).outputs["logits"]
    model = AutoModelForCausalLM.from_pretrained(outs["dp2"], dtype=torch.bfloat16)
    with torch.no_grad():
        theirs = model(torch.from_numpy(ids)).logits.float().numpy()
    err = float(np.abs(ours.astype(np.float32) - theirs).max())
    bound = 8 * float(ml.bfloat16.eps) * float(np.abs(theirs).max())
    print(f"losses {losses}; logits: worst error {err:.3g} = {err / bound:.3f} of the tolerance")
    assert err <= bound


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"devices": 2, "strategy": "pp2xtp2"}, ("--strategy 'pp2xtp2' does not fit --devices 2", "uses 4")),
        ({"devices": 3, "strategy": "tp2"}, ("does not fit --devices 3",)),
        ({"devices": 2, "strategy": "ring"}, ("unknown --strategy 'ring'", "zero2")),
        ({"devices": 2, "strategy": "dpxdp"}, ("unknown --strategy", "twice")),
        ({"devices": 1, "micro_batches": 2}, ("--micro-batches", "'pp'")),
        ({"devices": 2, "strategy": "dp", "gpus": (0,)}, ("one GPU for each of the 2",)),
    ],
)
def test_bad_combinations_are_refused_naming_the_setting(kw, words) -> None:
    with pytest.raises(UsageError) as e:
        TrainSettings(steps=1, **kw)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_the_cli_refuses_a_strategy_the_devices_do_not_fit(tmp_path, capsys) -> None:
    args = ["train", "--model", str(tmp_path), "--data", "x.txt", "--output", str(tmp_path / "o"), "--steps", "1"]
    assert main([*args, "--devices", "2", "--strategy", "pp2xtp2"]) == 2
    err = capsys.readouterr().err
    assert "megaloop train:" in err and "--devices 2" in err and "'pp2xtp2'" in err, err


def test_the_split_step_on_the_plan_interpreter_matches_the_reference() -> None:
    """PP2 (2 micro-batches) and ZeRO-2 ranks with their resident windows and histories, planned
    (verified) for the loop kernels and run on the plan interpreter (random legal orders of the
    tiles): 3 iterations in one run are the multi-rank reference's, bit for bit."""
    from megaloop.plan import make_plan
    from megaloop.reference.interpreter import run_plan
    from megaloop.training.split import build_split_training

    cfg = ml.models.LlamaConfig(hidden=32, heads=4, kv_heads=2, intermediate=64, layers=2, max_seq=32, vocab=VOCAB,
                                dtype="bfloat16")  # fmt: skip
    params = ml.models.random_parameters(cfg, 0)
    windows = np.random.default_rng(1).integers(0, VOCAB, (2, 4, 9))
    for strategy, mb in (("pp", 2), ("zero2", None)):
        st = build_split_training(
            cfg, batch=4, seq=8, batches=2, iterations=3, optimizer=optimizer(), devices=2, strategy=strategy,
            micro_batches=mb,
        )  # fmt: skip
        states = st.initial_state(params, windows)
        want = [r.state for r in ml.evaluate(st.graphs, None, None, states, iterations=3)]
        got = run_plan(make_plan(st.graphs, processors=4), None, None, states, iterations=3, seed=2)
        for rank, (w, g) in enumerate(zip(want, got)):
            assert int(g.state["train.step"]) == 3
            for name, value in w.items():
                assert np.array_equal(np.asarray(g.state[name]), np.asarray(value)), (strategy, rank, name)

"""Training a tiny Llama with ml.Trainer (megaloop/training) against PyTorch: the same initialisation
(a transformers LlamaForCausalLM saved with save_pretrained), the same batches (the trainer's
windows, step s reading window s mod n), torch.optim.AdamW with the same warmup-cosine schedule
(transformers'), weight decay on the matrices only and torch.nn.utils.clip_grad_norm_; 20 steps.

Tolerances, from the float32 roundings. A step's loss is a float32 forward whose sums are within a few
eps of float64 (tests/test_grad.py: every gradient within 64 eps of the largest); the weights it reads
differ from torch's by the earlier steps' roundings, so step s's loss is held to 16 (s + 1) eps of its
size. A step moves a weight by lr times m / (sqrt(v) + eps), whose relative error is the gradients'
(64 eps), and rounds it (an eps of the weight): after s steps, s lr 64 eps + 8 s eps |w|. The worst
ratio to the tolerance is printed (measured: 0.05 for the losses, 0.4 for the weights)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaConfig as HFConfig
from transformers import LlamaForCausalLM, get_cosine_with_min_lr_schedule_with_warmup

import megaloop as ml
from megaloop.training.graph import OptimizerSettings
from megaloop.training.trainer import Trainer, TrainSettings
from tests.helpers import save_tiny_transformers_llama

EPS = float(np.finfo(np.float32).eps)
STEPS, BATCH, SEQ, VOCAB = 20, 2, 16, 97
OPT = OptimizerSettings(lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95), warmup=3, min_lr=3e-4, max_norm=1.0)


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> Path:
    return save_tiny_transformers_llama(tmp_path_factory.mktemp("tiny-hf"), VOCAB)


def torch_steps(folder: Path, windows: np.ndarray, steps: int, opt: OptimizerSettings):
    """(each step's loss, the weights after the steps) of the same training in PyTorch."""
    model = LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32, attn_implementation="eager")
    params = dict(model.named_parameters())
    groups = [
        {"params": [p for p in params.values() if p.ndim > 1], "weight_decay": opt.weight_decay},
        {"params": [p for p in params.values() if p.ndim == 1], "weight_decay": 0.0},
    ]
    adam = torch.optim.AdamW(groups, lr=opt.lr, betas=opt.betas, eps=opt.eps)
    sched = get_cosine_with_min_lr_schedule_with_warmup(adam, opt.warmup, steps, min_lr=opt.min_lr)
    losses = []
    k = opt.accumulate
    for s in range(steps):
        adam.zero_grad()
        total = 0.0
        for m in range(k):  # micro-batches: their gradients summed, then the mean taken
            window = torch.from_numpy(windows[(s * k + m) % len(windows)])
            logits = model(window[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), window[:, 1:].reshape(-1))
            (loss / k).backward()
            total += loss.item() / k
        torch.nn.utils.clip_grad_norm_(list(params.values()), opt.max_norm)
        adam.step()
        sched.step()
        losses.append(total)
    return losses, {n: p.detach().numpy().copy() for n, p in params.items()}


def tokens(n: int = 4000, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, n)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_twenty_steps_match_pytorch(tiny_hf: Path, backend: str, tmp_path: Path) -> None:
    settings = TrainSettings(steps=STEPS, batch=BATCH, seq=SEQ, optimizer=OPT, backend=backend, steps_per_run=7)
    trainer = Trainer(tiny_hf, settings, output=tmp_path / "out")
    data = tokens(3 * BATCH * (SEQ + 1))  # 3 batches: the steps read them again and again (and learn them)
    windows = trainer.windows(data)
    result = trainer.train(data)
    want, weights = torch_steps(tiny_hf, windows, STEPS, OPT)
    worst = 0.0
    for s, (ours, theirs) in enumerate(zip(result.losses, want)):
        bound = 16 * (s + 1) * EPS * abs(theirs)
        worst = max(worst, abs(ours - theirs) / bound)
        assert abs(ours - theirs) <= bound, f"step {s}: loss {ours} vs torch {theirs}"
    print(f"losses: worst error {worst:.3f} of the tolerance; {result.losses[0]:.4f} -> {result.losses[-1]:.4f}")
    assert result.losses[-1] < result.losses[0] - 0.05  # (it learns: the data repeats)
    got = trainer.weights()
    ratio = 0.0
    for name, theirs in weights.items():
        bound = STEPS * OPT.lr * 64 * EPS + 8 * STEPS * EPS * np.abs(theirs)
        err = np.abs(got[name].astype(np.float64) - theirs)
        ratio = max(ratio, float(np.max(err / bound)))
        assert np.all(err <= bound), f"{name}: worst {float(err.max()):.3g}"
    print(f"weights after {STEPS} steps: worst error {ratio:.3f} of the tolerance")


def test_runs_are_bitwise_identical(tiny_hf: Path) -> None:
    settings = TrainSettings(steps=4, batch=BATCH, seq=SEQ, optimizer=OPT, backend="cpu", steps_per_run=3)
    runs = []
    for _ in range(2):
        trainer = Trainer(tiny_hf, settings)
        runs.append((trainer.train(tokens(5 * BATCH * (SEQ + 1), seed=1)), trainer.weights()))
    (first, w1), (second, w2) = runs
    assert first.micro_losses == second.micro_losses
    for name in w1:
        assert w1[name].tobytes() == w2[name].tobytes(), name


def test_accumulation_and_a_model_built_in_python() -> None:
    """A LlamaConfig and weights (no folder), token ids, 2 micro-batches a step: torch with the
    micro-batches' gradients averaged."""
    cfg = ml.models.LlamaConfig(hidden=32, heads=4, kv_heads=2, intermediate=64, layers=1, max_seq=32, vocab=VOCAB,
                                dtype="float32")  # fmt: skip
    params = ml.models.random_parameters(cfg, seed=3)
    opt = OptimizerSettings(lr=5e-3, warmup=1, max_norm=0.5, accumulate=2, schedule="linear")
    trainer = Trainer(cfg, TrainSettings(steps=3, batch=BATCH, seq=SEQ, optimizer=opt, backend="reference"),
                      params=params)  # fmt: skip
    data = tokens(7 * BATCH * (SEQ + 1), seed=2)
    result = trainer.train(data)
    assert len(result.micro_losses) == 6 and len(result.losses) == 3
    windows = trainer.windows(data)
    model = LlamaForCausalLM(HFConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      tie_word_embeddings=False, rms_norm_eps=1e-5))  # fmt: skip
    model.load_state_dict({n: torch.from_numpy(v) for n, v in params.items()}, strict=True)
    p = dict(model.named_parameters())
    adam = torch.optim.AdamW(list(p.values()), lr=opt.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(adam, lambda s: s if s < 1 else max(0.0, 1 - (s - 1) / 2))
    for s in range(3):
        adam.zero_grad()
        total = 0.0
        for m in range(2):
            w = torch.from_numpy(windows[(2 * s + m) % len(windows)])
            loss = torch.nn.functional.cross_entropy(model(w[:, :-1]).logits.reshape(-1, VOCAB), w[:, 1:].reshape(-1))
            (loss / 2).backward()
            total += loss.item() / 2
        torch.nn.utils.clip_grad_norm_(list(p.values()), opt.max_norm)
        adam.step()
        sched.step()
        assert abs(result.losses[s] - total) <= 16 * (s + 1) * EPS * total, (s, result.losses[s], total)
    got = trainer.weights()
    for name, param in p.items():
        theirs = param.detach().numpy()
        bound = 3 * opt.lr * 64 * EPS + 24 * EPS * np.abs(theirs)
        assert np.all(np.abs(got[name] - theirs) <= bound), name


def test_the_step_on_the_plan_interpreter_matches_the_reference() -> None:
    """The training graph planned (verified) for the loop kernel and run on the plan interpreter
    (random legal orders of its tiles, poisoned buffers): 4 iterations (2 updates of 2 micro-batches)
    are the reference's, bit for bit."""
    from megaloop.plan import make_plan
    from megaloop.reference.interpreter import run_plan
    from megaloop.training.graph import build_training_graph

    cfg = ml.models.LlamaConfig(hidden=32, heads=4, kv_heads=2, intermediate=64, layers=1, max_seq=32, vocab=VOCAB,
                                dtype="bfloat16")  # fmt: skip
    opt = OptimizerSettings(lr=1e-2, warmup=1, accumulate=2, weight_decay=0.1)
    tg = build_training_graph(cfg, batch=2, seq=8, batches=3, iterations=4, optimizer=opt)
    state = tg.initial_state(
        ml.models.random_parameters(cfg, 0), np.random.default_rng(0).integers(0, VOCAB, (3, 2, 9))
    )
    want = ml.evaluate(tg.graph, {}, state=state, iterations=4).state
    got = run_plan(make_plan(tg.graph, processors=6), {}, state=state, iterations=4, seed=1).state
    assert int(got["train.step"]) == 4 and int(got["optim.step"]) == 4
    for name, value in want.items():
        assert np.array_equal(np.asarray(got[name]), np.asarray(value)), name


def test_weights_and_histories_outlive_the_runner(tiny_hf: Path, monkeypatch) -> None:
    """A GPU runner's memory is freed when train() returns: the trained weights and the histories are
    read before, so a runner that forgets everything on close changes nothing."""
    from megaloop.training import runners

    def forget(runner) -> None:
        del runner.fast

    settings = TrainSettings(steps=3, batch=BATCH, seq=SEQ, optimizer=OPT, backend="cpu")
    kept = Trainer(tiny_hf, settings)
    kept.train(tokens(seed=4))
    expected = kept.weights(), kept.histories()
    monkeypatch.setattr(runners.FastRunner, "close", forget)
    trainer = Trainer(tiny_hf, settings)
    trainer.train(tokens(seed=4))
    weights, histories = trainer.weights(), trainer.histories()
    assert histories == expected[1] and len(histories[0]["loss"]) == 3
    initial = Trainer(tiny_hf, settings).weights()
    for name, value in weights.items():
        assert value.tobytes() == expected[0][name].tobytes(), name
        assert value.tobytes() != initial[name].tobytes(), f"{name} is still its initial value"

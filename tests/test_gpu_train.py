"""Training in the loop kernel on a GPU (skipped without one; the lead runs these): a small Llama
trained 20 steps by ml.Trainer on the GPU backend, all 20 steps in one run of the kernel
(iterations=20, no host work between steps), against the CPU reference's losses and weights, and
bitwise the same run to run.

Tolerance: the GPU sums products in another order than numpy (tiles of K, tensor cores), a few eps
times the square root of the longest sum a step, compounding over the steps as in tests/test_train.py:
float32 losses within 64 (s + 1) eps of the loss; bfloat16 ones within 2 (s + 1) bfloat16 eps (a
forward of bfloat16 roundings, any of which may fall the other way)."""

from __future__ import annotations

import numpy as np
import pytest

import megaloop as ml
from megaloop.models import LlamaConfig, random_parameters
from megaloop.runtime.device import gpus

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpus()[0], reason="no GPU: " + gpus()[1])]

STEPS = 20


@pytest.mark.parametrize("dtype,eps_units", [("float32", 64.0), ("bfloat16", 2.0)])
def test_twenty_steps_in_one_run_match_the_reference(dtype: str, eps_units: float) -> None:
    cfg = LlamaConfig(hidden=128, heads=4, kv_heads=2, intermediate=256, layers=2, max_seq=64, vocab=256, dtype=dtype)
    params = random_parameters(cfg, 0)
    tokens = np.random.default_rng(0).integers(0, 256, 3 * 4 * 65)  # 3 batches: the steps wrap around them
    opt = ml.OptimizerSettings(lr=1e-3, weight_decay=0.1, warmup=2, min_lr=1e-4, max_norm=1.0)
    results = {}
    for backend, runs in (("reference", 1), ("gpu", 2)):
        settings = ml.TrainSettings(steps=STEPS, batch=4, seq=64, optimizer=opt, backend=backend, steps_per_run=STEPS)
        for run in range(runs):
            trainer = ml.Trainer(cfg, settings, params=params, progress=False)
            result = trainer.train(tokens)
            results[backend, run] = (result, trainer.weights())
    ref, ref_weights = results["reference", 0]
    (gpu, weights), (again, weights_again) = results["gpu", 0], results["gpu", 1]
    assert gpu.micro_losses == again.micro_losses, "the GPU's losses differ run to run"
    assert all(weights[n].tobytes() == weights_again[n].tobytes() for n in weights), "weights differ run to run"
    eps = ml.as_dtype(dtype).eps
    worst = 0.0
    for s, (ours, want) in enumerate(zip(gpu.losses, ref.losses)):
        bound = eps_units * (s + 1) * eps * abs(want)
        worst = max(worst, abs(ours - want) / bound)
        assert abs(ours - want) <= bound, f"step {s}: GPU loss {ours}, reference {want}"
    print(f"[{dtype}] losses {ref.losses[0]:.4f} -> {ref.losses[-1]:.4f}; worst {worst:.3f} of the tolerance; "
          f"{gpu.tokens_per_second:,.0f} tokens/s")  # fmt: skip
    assert ref.losses[-1] < ref.losses[0]
    if dtype == "float32":  # (16-bit gradients' roundings steer Adam's tiny updates: the losses say enough)
        for name, want in ref_weights.items():
            bound = STEPS * opt.lr * 64 * eps + 8 * STEPS * eps * np.abs(want)
            assert np.all(np.abs(weights[name] - want) <= bound), name


@pytest.mark.parametrize("strategy", ["dp", "zero2"])
def test_two_ranks_sharing_one_gpu_match_one_device_on_the_cpu(strategy: str) -> None:
    """Trainer with devices=2 (DP2, ZeRO-2), both ranks' loop kernels on GPU 0 (gpus=(0, 0), each on
    half its SMs), 10 float32 steps in two runs: the losses against one device's on the CPU
    reference within the float32 tolerance above, each rank's history alike, and the weights."""
    cfg = LlamaConfig(hidden=128, heads=4, kv_heads=2, intermediate=256, layers=2, max_seq=64, vocab=256,
                      dtype="float32")  # fmt: skip
    params = random_parameters(cfg, 0)
    tokens = np.random.default_rng(0).integers(0, 256, 3 * 4 * 65)
    opt = ml.OptimizerSettings(lr=1e-3, weight_decay=0.1, warmup=2, min_lr=1e-4, max_norm=1.0)
    steps = 10
    ref_settings = ml.TrainSettings(steps=steps, batch=4, seq=64, optimizer=opt, backend="reference")
    ref_trainer = ml.Trainer(cfg, ref_settings, params=params, progress=False)
    ref = ref_trainer.train(tokens)
    settings = ml.TrainSettings(steps=steps, batch=4, seq=64, optimizer=opt, backend="gpu", steps_per_run=5,
                                devices=2, strategy=strategy, gpus=(0, 0))  # fmt: skip
    trainer = ml.Trainer(cfg, settings, params=params, progress=False)
    got = trainer.train(tokens)
    hist = trainer.histories()
    assert all(h["lr"] == hist[0]["lr"] for h in hist) and all(h["loss"] == got.micro_losses for h in hist)
    eps = ml.as_dtype("float32").eps
    worst = 0.0
    for s, (ours, want) in enumerate(zip(got.losses, ref.losses)):
        bound = 64 * (s + 1) * eps * abs(want)
        worst = max(worst, abs(ours - want) / bound)
        assert abs(ours - want) <= bound, f"{strategy} step {s}: GPU loss {ours}, one device's {want}"
    print(f"{strategy} on one GPU: worst loss {worst:.3f} of the tolerance; {got.tokens_per_second:,.0f} tokens/s")
    weights, want_weights = trainer.weights(), ref_trainer.weights()
    for name, want in want_weights.items():
        bound = steps * opt.lr * 2**-8 + 8 * steps * eps * np.abs(want)
        assert np.all(np.abs(weights[name] - want) <= bound), name

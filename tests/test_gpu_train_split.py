"""ml.parallelize_training's DP2, ZeRO-2, TP2 and PP2 (4 micro-batches, 1F1B) ranks sharing ONE GPU
(each rank a loop kernel on half its SMs, LoopKernelGroup(devices=[0, 0])), a tiny float32 Llama
trained 3 AdamW steps (weights and moments staying on the GPU between steps), against one device's
steps on the CPU reference: losses, gradient norms and the weights read back at the end. Skipped
without a GPU; tests/test_train_split.py runs the same splits on the reference and plan interpreter.

Tolerances: the GPU's float32 sums are reassociated against the reference's as the split's are, so
those of tests/test_train_split.py, four times looser (the GPU tiles sum in their own orders too)."""

from __future__ import annotations

import numpy as np
import pytest

import megaloop as ml
from megaloop.plan import make_plan
from megaloop.runtime.device import gpus
from tests.test_train_split import F32_EPS, LR, STEPS, WEIGHTS, batches, forward

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpus()[0], reason="no GPU: " + gpus()[1])]

SPLITS = [("dp", {}), ("zero2", {}), ("tp", {}), ("pp", {"micro_batches": 4})]


def one_device() -> tuple[list[float], list[float], dict[str, np.ndarray]]:
    split = ml.parallelize_training(
        forward(), "loss", ml.optim.OptimizerSpec("adamw", lr=LR, weight_decay=0.1, max_norm=100.0)
    )
    states = split.initial_state(WEIGHTS)
    losses, norms = [], []
    for feed in batches():
        res = [ml.evaluate(split.graphs[0], split.shard_inputs(feed)[0], None, states[0])]
        out = split.gather_outputs(res)
        losses.append(float(out["loss"]))
        norms.append(float(out["train.grad_norm"]))
        states = [res[0].state]
    return losses, norms, split.gather_weights(states)


@pytest.mark.parametrize(("strategy", "kw"), SPLITS, ids=[s for s, _ in SPLITS])
def test_split_training_on_one_gpu_matches_one_device(strategy: str, kw: dict) -> None:
    from megaloop.runtime.group import LoopKernelGroup

    spec = ml.optim.OptimizerSpec("adamw", lr=LR, weight_decay=0.1, max_norm=100.0)
    ref_losses, ref_norms, ref_weights = one_device()
    split = ml.parallelize_training(forward(), "loss", spec, devices=2, strategy=strategy, **kw)
    plan = make_plan(split.graphs, processors=gpus()[0][0].sm_count // 2)
    losses, norms = [], []
    with LoopKernelGroup(plan, None, split.initial_state(WEIGHTS), devices=[0, 0]) as group:
        for feed in batches():
            out = split.gather_outputs(group.run(split.shard_inputs(feed)))
            losses.append(float(out["loss"]))
            norms.append(float(out["train.grad_norm"]))
        weights = split.gather_weights(group.state())
    print(f"{strategy}: losses {losses} vs one device's {ref_losses}; norms {norms} vs {ref_norms}")
    for got, want, what in ((losses, ref_losses, "loss"), (norms, ref_norms, "gradient norm")):
        err = max(abs(a - b) / abs(b) for a, b in zip(got, want))
        assert err <= 256 * F32_EPS, f"{strategy}: {what} {got} against {want} ({err:.2e} relative)"
    worst = max(float(np.max(np.abs(weights[k].astype(np.float64) - v))) for k, v in ref_weights.items())
    print(f"{strategy}: worst weight error {worst:.3e} (allowed {STEPS * LR * 2**-8:.3e})")
    assert worst <= STEPS * LR * 2**-8, f"{strategy}: weights off by {worst:.3e}"

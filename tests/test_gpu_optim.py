"""The optimizer's ops in the loop kernel on a real GPU (skipped without one): N iterations of one plan
(AdamW with bfloat16 parameters and float32 master weights, a warmup-cosine schedule, global-norm
clipping over gradients tiled over the processors and accumulation over 2 micro-batches, beside SGD with
Nesterov momentum on float32 parameters) against the CPU reference's N iterations and torch.optim.AdamW,
and bitwise the same states run after run. (The op table's rows run in tests/test_gpu.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import megaloop as ml
from megaloop.plan import make_plan
from megaloop.runtime.device import gpus
from tests.test_optim import check, draw, f32, torch_params

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpus()[0], reason="no GPU: " + gpus()[1])]

SHAPES = [(1024, 1024), (4096,), (256, 3, 40), ()]
ITERATIONS = 8  # 4 updates of 2 micro-batches


def training_graph():
    g = ml.Graph("optim-gpu")
    params = {f"p{i}": g.state(f"p{i}", s, "bfloat16") for i, s in enumerate(SHAPES)}
    grads = {f"p{i}": g.input(f"g{i}", s, "bfloat16") for i, s in enumerate(SHAPES)}
    sched = ml.optim.Schedule(total=10, warmup=2, min_lr=1e-4)
    opt = ml.optim.adamw(g, params, grads, lr=1e-2, weight_decay=0.1, schedule=sched, max_norm=50.0, accumulate=2)
    g.output("norm", opt.grad_norm)
    g.output("lr", opt.lr)
    q = {f"q{i}": g.state(f"q{i}", s, "float32") for i, s in enumerate(SHAPES[1:])}
    h = {f"q{i}": g.input(f"h{i}", s, "float32") for i, s in enumerate(SHAPES[1:])}
    sgd = ml.optim.sgd(g, q, h, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3, prefix="sgd")
    return g, opt, sgd


def test_training_iterations_match_the_reference_and_torch() -> None:
    from megaloop.runtime.loop import LoopKernel

    rng = np.random.default_rng(0)
    g, opt, sgd = training_graph()
    master = draw(rng, SHAPES, "float32")
    state = {f"p{i}": ml.dtypes.round_to(w, ml.bfloat16) for i, w in enumerate(master)}
    state.update({f"q{i}": w for i, w in enumerate(draw(rng, SHAPES[1:], "float32"))})
    state.update(opt.initial_state(dict((f"p{i}", w) for i, w in enumerate(master))))
    state.update(sgd.initial_state())
    feeds = {f"g{i}": x for i, x in enumerate(draw(rng, SHAPES, "bfloat16", 0.05))}
    feeds.update({f"h{i}": x for i, x in enumerate(draw(rng, SHAPES[1:], "float32"))})
    ref = ml.evaluate(g, feeds, state=state, iterations=ITERATIONS)
    plan = make_plan(g, processors=132)
    runs = []
    for _ in range(2):
        with LoopKernel(plan, None, state) as k:
            out = k.run(feeds, iterations=ITERATIONS)
            runs.append((out, k.state()))
    (out, got), (_, again) = runs
    for name in got:
        assert got[name].tobytes() == again[name].tobytes(), f"{name}: not bitwise run to run"
    assert int(got["optim.step"]) == ITERATIONS and int(got["sgd.step"]) == ITERATIONS
    updates = ITERATIONS // 2
    for name, value in ref.state.items():
        if value.dtype == np.int64:
            assert np.array_equal(got[name], value), name
        elif value.dtype == np.float32:
            check(f"GPU {name}", got[name], value, 4 * (updates + 1))
        else:
            check(f"GPU {name}", got[name], value, 1, float(ml.bfloat16.eps))
    n = sum(int(np.prod(s)) for s in SHAPES)
    check("GPU norm", out["norm"], ref.outputs["norm"], 2 * np.sqrt(n))
    assert out["lr"] == ref.outputs["lr"]
    # torch: the mean of two identical micro-batches is the gradient itself
    tp = torch_params(master)
    topt = torch.optim.AdamW(tp, lr=1e-2, weight_decay=0.1)
    lrs = [1e-2 * s / 2 if s < 2 else 1e-4 + (1e-2 - 1e-4) * 0.5 * (1 + np.cos(np.pi * (s - 2) / 8)) for s in range(4)]
    for s in range(updates):
        for group in topt.param_groups:
            group["lr"] = lrs[s]
        for p, i in zip(tp, range(len(SHAPES))):
            p.grad = torch.tensor(f32(feeds[f"g{i}"]), dtype=torch.float32)
        torch.nn.utils.clip_grad_norm_(tp, 50.0)
        topt.step()
    for i, p in enumerate(tp):
        check(f"GPU master p{i} vs torch", got[f"optim.master.p{i}"], p.detach().numpy(), 4 * (updates + 1))

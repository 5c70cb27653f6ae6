"""Training ops: optimizers, gradient accumulation, norms, schedules, batches, losses."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

import megaloop as ml
from tests.op_table._base import FLOATS, INTS, Sample, rand_shape, row

COUNTER = ("int", 0, 7)  # micro-batches done: with accumulate 1-3, some draws update and some do not


def _optim_sample(n_like: int, scalars: int) -> Callable[[np.random.Generator], Sample]:
    """``n_like`` operands of one random shape, ``scalars`` float32 0-d ones, then the counter."""

    def sample(rng: np.random.Generator) -> Sample:
        shape = rand_shape(rng, 0, 3, dmax=40)
        kw = {"accumulate": int(rng.integers(1, 4))}
        return Sample([shape] * n_like + [()] * (scalars + 1), kw)

    return sample


def _step(counter: torch.Tensor, accumulate: int) -> tuple[bool, bool, int]:
    c = int(counter)
    return (c + 1) % accumulate == 0, c % accumulate == 0, (c + 1) // accumulate


def _grad_accumulate_ref(buffer, grad, counter, *, accumulate, **k):
    return grad if _step(counter, accumulate)[1] else buffer + grad


row(
    "grad_accumulate",
    "micro-batches",
    lambda g, b, x, c, **kw: ml.grad_accumulate(b, x, c, **kw),
    _grad_accumulate_ref,
    _optim_sample(2, 0),
    fixed={0: "float32", 2: "int64"},
    domains=("normal", "normal", COUNTER),
    states=(0,),
)


def _moment_sample(rng: np.random.Generator) -> Sample:
    s = _optim_sample(2, 1)(rng)
    return Sample(s.shapes, {**s.kw, "beta": float(rng.choice([0.9, 0.999, 0.5])), "square": bool(rng.random() < 0.5)})


def _adam_moment_ref(state, grad, scale, counter, *, beta, square, accumulate, **k):
    if not _step(counter, accumulate)[0]:
        return state
    x = grad * scale
    return beta * state + (1 - beta) * (x * x if square else x)


row(
    "adam_moment",
    "first-and-second",
    lambda g, st, x, sc, c, **kw: ml.adam_moment(st, x, c, scale=sc, **kw),
    _adam_moment_ref,
    _moment_sample,
    fixed={0: "float32", 2: "float32", 3: "int64"},
    domains=("positive", "normal", "positive", COUNTER),
    states=(0,),
)

ADAMW_KW = {"beta1": 0.9, "beta2": 0.95, "eps": 1e-6, "weight_decay": 0.1}


def _adamw_update_ref(param, m, v, lr, counter, *, accumulate, **k):
    update, _, t = _step(counter, accumulate)
    if not update:
        return param
    b1, b2, eps, wd = (ADAMW_KW[n] for n in ("beta1", "beta2", "eps", "weight_decay"))
    denom = v.sqrt() / math.sqrt(1 - b2**t) + eps
    return param * (1 - lr * wd) - lr / (1 - b1**t) * m / denom


row(
    "adamw_update",
    "bias-corrected",
    lambda g, p, m, v, lr, c, **kw: ml.adamw_update(p, m, v, c, lr=lr, **ADAMW_KW, **kw),
    _adamw_update_ref,
    _optim_sample(3, 1),
    fixed={1: "float32", 2: "float32", 3: "float32", 4: "int64"},
    domains=("normal", "normal", "positive", "positive", COUNTER),
    states=(0,),
)


def _sgd_sample(rng: np.random.Generator) -> Sample:
    s = _optim_sample(3, 1)(rng)
    return Sample(
        s.shapes, {**s.kw, "momentum": 0.9, "dampening": float(rng.choice([0.0, 0.25])), "weight_decay": 0.01}
    )


def _sgd_momentum_ref(buf, grad, param, scale, counter, *, momentum, dampening, weight_decay, accumulate, **k):
    update, _, t = _step(counter, accumulate)
    if not update:
        return buf
    d = grad * scale + weight_decay * param
    return d if t == 1 else momentum * buf + (1 - dampening) * d


row(
    "sgd_momentum",
    "dampened",
    lambda g, b, x, p, sc, c, **kw: ml.sgd_momentum(b, x, p, c, scale=sc, **kw),
    _sgd_momentum_ref,
    _sgd_sample,
    fixed={0: "float32", 3: "float32", 4: "int64"},
    domains=("normal", "normal", "normal", "positive", COUNTER),
    states=(0,),
)


def _sgd_update_sample(rng: np.random.Generator) -> Sample:
    s = _optim_sample(3, 2)(rng)
    momentum = float(rng.choice([0.0, 0.9]))
    return Sample(s.shapes, {**s.kw, "momentum": momentum, "nesterov": momentum > 0 and rng.random() < 0.5})


def _sgd_update_ref(param, grad, buf, lr, scale, counter, *, momentum, nesterov, accumulate, **k):
    if not _step(counter, accumulate)[0]:
        return param
    d = grad * scale + 0.01 * param
    u = d if momentum == 0 else d + momentum * buf if nesterov else buf
    return param - lr * u


row(
    "sgd_update",
    "plain-momentum-nesterov",
    lambda g, p, x, b, lr, sc, c, momentum, nesterov, **kw: ml.sgd_update(
        p,
        x,
        c,
        lr=lr,
        buf=b if momentum else None,
        momentum=momentum,
        nesterov=nesterov,
        weight_decay=0.01,
        scale=sc,
        **kw,
    ),
    _sgd_update_ref,
    _sgd_update_sample,
    fixed={2: "float32", 3: "float32", 4: "float32", 5: "int64"},
    domains=("normal", "normal", "normal", "positive", "positive", COUNTER),
    states=(0,),
)


def _square_sum_sample(rng: np.random.Generator) -> Sample:
    shape = rand_shape(rng, 0, 3, dmax=30)
    rows = shape[0] if shape else 1
    per = int(rng.integers(1, rows + 1))
    return Sample([shape], {"splits": -(-rows // per)})


def _square_sum_ref(x, *, splits, **k):
    x = x.reshape(1) if x.ndim == 0 else x
    per = -(-x.shape[0] // splits)
    return torch.stack([(x[i * per : (i + 1) * per] ** 2).sum() for i in range(splits)])


row(
    "square_sum",
    "ranges-of-rows",
    lambda g, x, **kw: ml.square_sum(x, **kw),
    _square_sum_ref,
    _square_sum_sample,
    reduce_len=lambda s: max(1, math.prod(s.shapes[0])) // s.kw["splits"] + 1,
)


def _lr_sample(rng: np.random.Generator) -> Sample:
    kind = str(rng.choice(["cosine", "linear", "constant"]))
    kw = {"lr": 3e-4, "min_lr": 1e-5, "warmup": int(rng.integers(0, 4)), "total": 6, "kind": kind}
    return Sample([()], {**kw, "accumulate": int(rng.integers(1, 3))}, domains=(("int", 0, 20),))


def _lr_ref(counter, *, lr, min_lr, warmup, total, kind, accumulate, **k):
    s = int(counter) // accumulate
    if s < warmup:
        value = lr * s / warmup
    elif kind == "constant":
        value = lr
    else:
        p = min(1.0, (s - warmup) / max(1, total - warmup))
        decay = 0.5 * (1 + math.cos(math.pi * p)) if kind == "cosine" else 1 - p
        value = min_lr + (lr - min_lr) * decay
    return torch.tensor(value, dtype=torch.float64)


row(
    "lr_schedule",
    "warmup-and-decay",
    lambda g, c, **kw: ml.lr_schedule(c, **kw),
    _lr_ref,
    _lr_sample,
    ("int64",),
)


def _step_batch_sample(rng: np.random.Generator) -> Sample:
    """data [n, *batch] and a counter past n now and then (the data wraps around)."""
    n = int(rng.integers(1, 6))
    return Sample([(n, *rand_shape(rng, 0, 3)), ()], domains=("normal", ("int", 0, 3 * n)))


row(
    "step_batch",
    "wraps",
    lambda g, d, c: ml.step_batch(d, c),
    lambda d, c, **k: d[int(c) % d.shape[0]],
    _step_batch_sample,
    FLOATS + INTS,
    fixed={1: "int64"},
)


def _loss_sample(extra: bool, ignoring: bool = True) -> Callable[[np.random.Generator], Sample]:
    """logits [*lead, vocab] and targets [*lead] in the vocabulary; ignore_index one of its ids (so that
    some targets are ignored) or -100; with ``extra``, a float32 cotangent of each row."""

    def sample(rng: np.random.Generator) -> Sample:
        lead, v = rand_shape(rng, 1, 3, 5), int(rng.integers(2, 40))
        ignore = int(rng.integers(0, v)) if ignoring else -100
        shapes = [(*lead, v), lead] + ([lead] if extra else [])
        return Sample(shapes, {"ignore_index": ignore}, domains=("normal", ("int", 0, v), "normal"))

    return sample


def _cross_entropy_ref(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, **k: Any) -> torch.Tensor:
    v = logits.shape[-1]
    out = F.cross_entropy(logits.reshape(-1, v), targets.reshape(-1), ignore_index=ignore_index, reduction="none")
    return out.reshape(targets.shape)


def _cross_entropy_grad_ref(logits, targets, c, ignore_index: int, **k: Any) -> torch.Tensor:
    p = torch.softmax(logits, -1) - F.one_hot(targets, logits.shape[-1]).double()
    return p * torch.where(targets == ignore_index, 0.0, c)[..., None]


row(
    "cross_entropy",
    "per-token",
    lambda g, x, t, ignore_index: ml.cross_entropy(x, t, ignore_index=ignore_index, reduction="none"),
    _cross_entropy_ref,
    _loss_sample(False),
    fixed={1: "int64"},
    reduce_len=lambda s: s.shapes[0][-1],
)
row(
    "cross_entropy",
    "mean",
    lambda g, x, t, ignore_index: ml.cross_entropy(x, t, ignore_index=ignore_index),
    lambda x, t, ignore_index, **k: F.cross_entropy(x.reshape(-1, x.shape[-1]), t.reshape(-1)),
    _loss_sample(False, ignoring=False),
    fixed={1: "int32"},
    reduce_len=lambda s: int(np.prod(s.shapes[0])),
)
row(
    "cross_entropy_grad",
    "rows",
    lambda g, x, t, c, ignore_index: ml.cross_entropy_grad(x, t, c, ignore_index=ignore_index),
    _cross_entropy_grad_ref,
    _loss_sample(True),
    fixed={1: "int64", 2: "float32"},
    reduce_len=lambda s: s.shapes[0][-1],
)

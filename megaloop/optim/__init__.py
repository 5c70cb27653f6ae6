"""Optimizers attached to a training graph: the ops of megaloop/frontend/ops/optim.py (AdamW, SGD,
gradient accumulation) and optim_norm.py (global-norm clipping, learning-rate schedule) wired to a
graph's parameter states and gradients, with the states they need (moments, momentum buffers, float32
master weights, accumulation buffers, the step counter). One iteration of the graph is one
micro-batch; N iterations run N / accumulate optimizer steps with no host work.

    opt = ml.optim.adamw(g, params, grads, lr=3e-4, weight_decay=0.1, max_norm=1.0,
                         schedule=ml.optim.Schedule(total=1000, warmup=100, min_lr=3e-5))
    state = opt.initial_state(weights)   # master copies, zero moments and counter
    ml.evaluate(g, feeds, state={**weights, **state}, iterations=10)
"""

from megaloop.optim.attach import NormOver, Optimizer, Schedule, adamw, sgd
from megaloop.optim.spec import OptimizerSpec

__all__ = ["NormOver", "Optimizer", "OptimizerSpec", "Schedule", "adamw", "sgd"]

"""The training step as one graph, so that one loop iteration is one step with no host work between
steps: the step's batch out of token data uploaded once (``step_batch`` by the step counter, wrapping
around at the end of the data), the model's loss, its gradients (``grad``), the optimizer's update of
the weights in place (megaloop.optim), the step's loss written into a history by the counter.

States of the graph (besides the optimizer's ``optim.*`` and the KV caches the forward writes):

- every weight, under its checkpoint name (``model.layers.0.self_attn.q_proj.weight``), in the
  model's dtype (16-bit weights: the optimizer's float32 master copy rounded, each step);
- ``data.tokens`` int64 [batches, batch, seq + 1]: the token windows, uploaded once; step s trains on
  window s mod batches (tokens [:, :seq] predicting [:, 1:]);
- ``train.step`` int64: the steps (micro-batches) done;
- ``train.losses`` float32 [1, 1, iterations, 1]: micro-batch s's mean loss at [0, 0, s, 0], so that
  the host reads every step's loss after running many of them at once; ``train.lrs`` and
  ``train.grad_norms`` (with clipping) the same for the learning rate and the gradients' norm.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

import megaloop.frontend.ops as ops
from megaloop.errors import GraphBuildError
from megaloop.frontend import sources
from megaloop.frontend.autodiff import grad
from megaloop.frontend.graph import Graph
from megaloop.frontend.tensor import Tensor
from megaloop.models.gradients import llama_loss
from megaloop.models.llama import LlamaConfig
from megaloop.optim import Optimizer, OptimizerSpec, Schedule

DATA, STEP, LOSSES = "data.tokens", "train.step", "train.losses"
LRS, NORMS = "train.lrs", "train.grad_norms"
OPTIMIZERS = ("adamw", "sgd")


@dataclass(frozen=True)
class OptimizerSettings:
    """What the optimizer does each update (megaloop.optim): ``kind`` "adamw" (torch.optim.AdamW) or
    "sgd" (with ``momentum``); ``lr`` after ``warmup`` updates rising from 0, then ``schedule``
    ("cosine", "linear" or "constant") down to ``min_lr`` at the last update; gradients clipped to a
    global norm of ``max_norm`` (None: not clipped) and averaged over ``accumulate`` micro-batches.
    ``weight_decay`` applies to the matrices; norms and biases (1-D weights) take none unless
    ``decay_all``, as Hugging Face's Trainer does."""

    kind: str = "adamw"
    lr: float = 3e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    momentum: float = 0.0
    warmup: int = 0
    schedule: str = "cosine"
    min_lr: float = 0.0
    max_norm: float | None = 1.0
    accumulate: int = 1
    decay_all: bool = False

    def __post_init__(self) -> None:
        if self.kind not in OPTIMIZERS:
            raise GraphBuildError(f"optimizer: kind must be one of {OPTIMIZERS}, got {self.kind!r}")
        for name in ("warmup", "accumulate"):
            value = getattr(self, name)
            low = 1 if name == "accumulate" else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise GraphBuildError(f"optimizer: {name} must be an int >= {low}, got {value!r}")

    def decay_of(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, float]:
        return {n: self.weight_decay if self.decay_all or len(s) > 1 else 0.0 for n, s in shapes.items()}

    def spec(self, shapes: Mapping[str, tuple[int, ...]], updates: int) -> OptimizerSpec:
        """The optimizer for weights of these shapes (by name) over a run of ``updates`` updates, as
        one device's step and every rank of a split one attach it."""
        schedule = Schedule(total=max(1, updates), warmup=self.warmup, min_lr=self.min_lr, kind=self.schedule)
        common = {"lr": self.lr, "weight_decay": self.decay_of(shapes), "schedule": schedule}
        common.update(max_norm=self.max_norm, accumulate=self.accumulate)
        if self.kind == "sgd":
            return OptimizerSpec("sgd", momentum=self.momentum, **common)
        return OptimizerSpec("adamw", betas=self.betas, eps=self.eps, **common)


@dataclass
class TrainingGraph:
    """A built training step: the graph, its optimizer, and the sizes it was built for. ``updates``:
    the optimizer updates the schedule spans (iterations / accumulate)."""

    graph: Graph
    optimizer: Optimizer
    cfg: LlamaConfig
    batch: int
    seq: int
    batches: int
    iterations: int
    weights: tuple[str, ...]
    accumulate: int = 1

    @property
    def updates(self) -> int:
        return self.iterations // self.accumulate

    def initial_state(self, params: Mapping[str, Any], data: np.ndarray) -> dict[str, Any]:
        """The states to start from: the weights (``params``, any float dtype), their optimizer states
        (float32 masters from ``params``, zero moments and counters), the token windows ``data``."""
        data = np.asarray(data)
        if data.shape != (self.batches, self.batch, self.seq + 1) or data.dtype.kind not in "iu":
            raise GraphBuildError(
                f"training data must be int [{self.batches}, {self.batch}, {self.seq + 1}] (batches of windows of "
                f"seq + 1 tokens), got {data.dtype}{list(data.shape)}"
            )
        missing = [n for n in self.weights if n not in params]
        if missing:
            raise GraphBuildError(f"training: no values for the weights {missing[:4]} ({len(missing)} missing)")
        state: dict[str, Any] = {n: params[n] for n in self.weights}
        state.update(self.optimizer.initial_state({n: params[n] for n in self.optimizer.masters}))
        state[DATA] = data.astype(np.int64)
        return state


def parameters_as_states(graph: Graph) -> None:
    """Make every parameter of ``graph`` a state of the same name, shape and dtype (the update writes
    it in place each iteration); the nodes that read it, the backward's included, are unchanged."""
    for name, t in graph.parameters.items():
        if name in graph.states:
            raise GraphBuildError(f"graph {graph.name!r}: parameter {name!r} has the name of a state already")
        t.node.op = sources.STATE
        graph.states[name] = t
    graph.parameters = {}


def build_training_graph(
    cfg: LlamaConfig,
    *,
    batch: int,
    seq: int,
    batches: int,
    iterations: int,
    optimizer: OptimizerSettings | None = None,
    name: str = "llama-train",
) -> TrainingGraph:
    """The training step of a Llama-family model (module docstring) on ``batch`` windows of ``seq``
    tokens a step, ``batches`` of them in the data, for a run of ``iterations`` micro-batches."""
    opt = optimizer or OptimizerSettings()
    if not isinstance(cfg, LlamaConfig) or cfg.vocab is None:
        raise GraphBuildError("build_training_graph: cfg must be a LlamaConfig with a vocabulary")
    for what, value in (("batch", batch), ("seq", seq), ("batches", batches), ("iterations", iterations)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise GraphBuildError(f"build_training_graph: {what} must be an int >= 1, got {value!r}")
    if seq > cfg.max_seq:
        raise GraphBuildError(f"build_training_graph: seq {seq} is beyond the model's {cfg.max_seq} positions")
    if iterations % opt.accumulate:
        raise GraphBuildError(
            f"build_training_graph: {iterations} iterations are not whole updates of {opt.accumulate} micro-batches"
        )
    model = dataclasses.replace(cfg, max_seq=seq)  # (the KV caches the forward writes: one window each)
    g = Graph(name)
    data = g.state(DATA, (batches, batch, seq + 1), "int64")
    step = g.state(STEP, (), "int64")
    with g.scope("data"):
        window = ops.step_batch(data, step)
        ids, targets = window[:, :seq], window[:, 1:]
    loss, _ = llama_loss(g, model, ids, targets)
    grads = grad(g, loss)
    parameters_as_states(g)
    weights = {n: g.states[n] for n in grads}
    spec = opt.spec({n: t.shape for n, t in weights.items()}, iterations // opt.accumulate)
    settings = spec.attach(g, weights, grads)
    histories(g, iterations, step, {LOSSES: loss, LRS: settings.lr, NORMS: settings.grad_norm})
    with g.scope("train"):
        g.assign(step, step + 1)
    g.output("loss", loss)
    g.output("lr", settings.lr)
    if settings.grad_norm is not None:
        g.output("grad_norm", settings.grad_norm)
    return TrainingGraph(g, settings, cfg, batch, seq, batches, iterations, tuple(weights), opt.accumulate)


def histories(g: Graph, iterations: int, step: Tensor, values: Mapping[str, Tensor | None]) -> None:
    """Each value (one float a step) written into a state [1, 1, iterations, 1] of its name at the
    step counter, so that the host reads a run's every step at once."""
    for name, value in values.items():
        if value is not None:
            history = g.state(name, (1, 1, iterations, 1), "float32")
            with g.scope("train"):
                value = value if value.dtype.name == "float32" else ops.cast(value, "float32")
                ops.kv_cache_update(history, value.reshape(1, 1, 1, 1), step.reshape(1, 1))

"""``adamw`` and ``sgd``: an optimizer's update added to a graph whose parameters are states and whose
gradients are tensors of it (the backward graph's, or inputs). What each iteration does, in order:

1. With ``accumulate`` = K > 1, each gradient is added into a float32 buffer state (``grad_accumulate``:
   the sum restarts on the first micro-batch of each cycle of K); the update uses the buffers' mean.
2. With ``max_norm``, the global norm of the (mean) gradients: each gradient's ``square_sum`` over
   ranges of its rows (tiles over the processors), the ranges' sums added, the square root; the
   gradients are scaled by min(1, max_norm / (norm + 1e-6)), as torch.nn.utils.clip_grad_norm_.
3. The learning rate: ``lr``, or ``schedule``'s value for the step counter's update (``lr_schedule``).
4. The update, in place on the parameters (or their float32 master copies: 16-bit parameters get one
   by default, and their 16-bit state is the master rounded, each iteration) and the moments or
   momentum buffers, on the iterations that end a cycle of K (the others leave them as they are).
5. The step counter (int64 0-d state, micro-batches done) goes up by one.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import megaloop.frontend.ops as ops
from megaloop.dtypes import float32, int64
from megaloop.errors import GraphBuildError
from megaloop.frontend import sources
from megaloop.frontend.graph import Graph
from megaloop.frontend.ops.optim_norm import SCHEDULES
from megaloop.frontend.tensor import Tensor

CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s: max_norm / (norm + 1e-6)
CONCAT_GROUP = 15  # partial sums concatenated at once (the loop kernel's ops take at most 16 operands)


@dataclass(frozen=True)
class Schedule:
    """A learning rate schedule over optimizer updates: ``warmup`` updates rising linearly from 0 to the
    optimizer's lr, then a ``kind`` ("cosine", "linear" or "constant") decay to ``min_lr`` at ``total``
    updates, min_lr after (megaloop.frontend.ops.optim_norm)."""

    total: int
    warmup: int = 0
    min_lr: float = 0.0
    kind: str = "cosine"

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise GraphBuildError(f"Schedule: kind must be one of {list(SCHEDULES)}, got {self.kind!r}")


@dataclass(frozen=True)
class NormOver:
    """Clipping over several ranks (a split training step, megaloop.parallel.training): each rank's
    gradients are pieces of the whole; ``shares[i]`` weighs gradient i's square sum (1 / the number of
    ranks holding the same piece) and the weighted sums are all-reduced over ``group``."""

    group: tuple[int, ...]
    shares: tuple[float, ...]


@dataclass
class Optimizer:
    """What ``adamw`` or ``sgd`` added to a graph: the step counter (micro-batches done), this iteration's
    learning rate and (with clipping) the gradients' global norm before clipping, every state it made
    by name, each parameter's next value, and the float32 master state of each 16-bit parameter."""

    graph: Graph
    counter: Tensor
    lr: Tensor
    grad_norm: Tensor | None
    states: dict[str, Tensor] = field(default_factory=dict)
    updated: dict[str, Tensor] = field(default_factory=dict)
    masters: dict[str, str] = field(default_factory=dict)  # parameter state -> its master state

    def initial_state(self, params: Mapping[str, Any] | None = None) -> dict[str, np.ndarray]:
        """Starting values of the states the optimizer made: each master copy from its parameter's
        value in ``params`` (by the parameter state's name; float32 values keep their precision),
        zeros for the rest (moments, buffers, the counter)."""
        params = params or {}
        missing = [p for p in self.masters if p not in params]
        if missing:
            raise GraphBuildError(
                f"optimizer: initial_state needs the values of {missing} for their float32 master copies"
            )
        out = {name: np.zeros(t.shape, t.dtype.np) for name, t in self.states.items()}
        for param, master in self.masters.items():
            out[master] = np.asarray(params[param], dtype=np.float64).astype(np.float32).reshape(out[master].shape)
        return out


def _pairs(graph: Graph, params: Any, grads: Any) -> list[tuple[str, Tensor, Tensor]]:
    """(name, parameter state, gradient) for each parameter, checked."""
    if isinstance(params, Mapping):
        if not isinstance(grads, Mapping) or set(grads) != set(params):
            raise GraphBuildError(
                "optimizer: grads must be a mapping with the same names as params; missing "
                f"{sorted(set(params) - set(grads or {}))}, extra {sorted(set(grads or {}) - set(params))}"
            )
        items = [(n, params[n], grads[n]) for n in params]
    else:
        params, grads = list(params), list(grads)
        if len(params) != len(grads):
            raise GraphBuildError(f"optimizer: {len(params)} params but {len(grads)} grads")
        items = [(getattr(p, "name", str(i)), p, g) for i, (p, g) in enumerate(zip(params, grads))]
    out = []
    for name, p, g in items:
        if not isinstance(p, Tensor) or p.graph is not graph or p.node.op is not sources.STATE:
            raise GraphBuildError(
                f"optimizer: parameter {name!r} must be a state of graph {graph.name!r} (graph.state), which the "
                f"update changes in place; got {p!r}"
            )
        if not isinstance(g, Tensor) or g.graph is not graph or g.shape != p.shape or not g.dtype.is_float:
            raise GraphBuildError(
                f"optimizer: the gradient of {name!r} must be a float tensor of graph {graph.name!r} of the "
                f"parameter's shape {p.shape}; got {g!r}"
            )
        out.append((p.node.attrs["name"], p, g))
    if not out:
        raise GraphBuildError("optimizer: no parameters to update")
    return out


@contextmanager
def _all_or_nothing(graph: Graph) -> Iterator[None]:
    """An optimizer that fails part-way leaves no node, state or assignment behind."""
    nodes, constants = len(graph.nodes), len(graph.constants)
    states, updates = dict(graph.states), dict(graph.state_updates)
    try:
        yield
    except Exception:
        del graph.nodes[nodes:], graph.constants[constants:]
        graph.states, graph.state_updates = states, updates
        raise


def _per_parameter(what: str, value: Any, pairs: list[tuple[str, Tensor, Tensor]]) -> dict[str, float]:
    """``value`` (a number, or a mapping from every parameter's name to one) for each parameter."""
    names = [n for n, _, _ in pairs]
    if not isinstance(value, Mapping):
        return dict.fromkeys(names, value)
    missing, extra = sorted(set(names) - set(value)), sorted(set(value) - set(names))
    if missing or extra:
        raise GraphBuildError(
            f"optimizer: {what} by parameter must name every parameter and no other: missing {missing}, unknown {extra}"
        )
    return {n: value[n] for n in names}


class _Builder:
    """The shared part of an optimizer: counter, accumulation, clipping, learning rate, masters."""

    def __init__(self, graph: Graph, prefix: str, accumulate: int, master: bool | None) -> None:
        if f"{prefix}.step" in graph.states:
            raise GraphBuildError(f"optimizer: graph {graph.name!r} has an optimizer named {prefix!r} already")
        if not isinstance(accumulate, int) or isinstance(accumulate, bool) or accumulate < 1:
            raise GraphBuildError(f"optimizer: accumulate must be an int >= 1, got {accumulate!r}")
        self.graph, self.prefix, self.k, self.master = graph, prefix, accumulate, master
        self.states: dict[str, Tensor] = {}
        self.counter = self.state("step", (), int64)

    def state(self, what: str, shape: tuple[int, ...], dtype: Any = float32) -> Tensor:
        name = f"{self.prefix}.{what}"
        self.states[name] = self.graph.state(name, shape, dtype)
        return self.states[name]

    def gradients(self, pairs: list[tuple[str, Tensor, Tensor]]) -> list[Tensor]:
        """The gradients the update uses: the accumulation buffers' new values where K > 1."""
        if self.k == 1:
            return [g for _, _, g in pairs]
        return [
            ops.grad_accumulate(self.state(f"grad_sum.{n}", p.shape), g, self.counter, accumulate=self.k)
            for n, p, g in pairs
        ]

    def clip_scale(
        self, grads: list[Tensor], max_norm: float | None, norm_over: NormOver | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """(the scale the gradients take: clipping times 1 / K, the mean gradients' global norm)."""
        if max_norm is None:
            return self.graph.constant(1.0 / self.k, "float32", name=f"{self.prefix}.grad_scale"), None
        if not isinstance(max_norm, (int, float)) or isinstance(max_norm, bool) or not max_norm > 0:
            raise GraphBuildError(f"optimizer: max_norm must be a number > 0 (or None: no clipping), got {max_norm!r}")
        with self.graph.scope(f"{self.prefix}.clip"):
            sums = [ops.square_sum(g) for g in grads]
            if norm_over is not None:  # (a piece held by k ranks counts 1/k on each)
                sums = [s if w == 1.0 else s * float(w) for s, w in zip(sums, norm_over.shares)]
            while len(sums) > 1 or sums[0].ndim:
                groups = [sums[i : i + CONCAT_GROUP] for i in range(0, len(sums), CONCAT_GROUP)]
                sums = [ops.sum(s[0] if len(s) == 1 else ops.concat([x.reshape(-1) for x in s], 0)) for s in groups]
            total = sums[0] if norm_over is None else ops.all_reduce(sums[0], group=norm_over.group)
            norm = ops.sqrt(total)
            if self.k > 1:
                norm = norm * (1.0 / self.k)
            coef = ops.minimum(float(max_norm) / (norm + CLIP_EPS), 1.0)
            return (coef * (1.0 / self.k) if self.k > 1 else coef), norm

    def learning_rate(self, lr: float, schedule: Schedule | None) -> Tensor:
        if not isinstance(lr, (int, float)) or isinstance(lr, bool) or not lr >= 0:
            raise GraphBuildError(f"optimizer: lr must be a number >= 0, got {lr!r}")
        if schedule is None:
            return self.graph.constant(float(lr), "float32", name=f"{self.prefix}.lr")
        if not isinstance(schedule, Schedule):
            raise GraphBuildError(f"optimizer: schedule must be a megaloop.optim.Schedule, got {schedule!r}")
        with self.graph.scope(self.prefix):
            return ops.lr_schedule(
                self.counter,
                lr=float(lr),
                total=schedule.total,
                warmup=schedule.warmup,
                min_lr=schedule.min_lr,
                kind=schedule.kind,
                accumulate=self.k,
            )

    def target(self, name: str, param: Tensor, masters: dict[str, str]) -> Tensor:
        """What the update writes: the parameter, or its float32 master copy (16-bit parameters)."""
        wants = param.dtype.itemsize < 4 if self.master is None else self.master
        if not wants or param.dtype == float32:
            return param
        masters[name] = f"{self.prefix}.master.{name}"
        return self.state(f"master.{name}", param.shape)

    def finish(
        self,
        pairs: list,
        targets: list[Tensor],
        news: list[Tensor],
        lr: Tensor,
        norm: Tensor | None,
        masters: dict[str, str],
    ) -> Optimizer:
        updated = {}
        for (name, param, _), target, new in zip(pairs, targets, news):
            if target is not param:
                new = ops.cast(new, param.dtype)
                self.graph.assign(param, new)
            updated[name] = new
        self.graph.assign(self.counter, self.counter + 1)
        return Optimizer(self.graph, self.counter, lr, norm, self.states, updated, masters)


def adamw(
    graph: Graph,
    params: Mapping[str, Tensor] | Sequence[Tensor],
    grads: Mapping[str, Tensor] | Sequence[Tensor],
    *,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float | Mapping[str, float] = 0.01,
    schedule: Schedule | None = None,
    max_norm: float | None = None,
    accumulate: int = 1,
    master: bool | None = None,
    prefix: str = "optim",
    norm_over: NormOver | None = None,
) -> Optimizer:
    """torch.optim.AdamW's update of ``params`` (graph states) by ``grads``, each iteration of ``graph``
    a micro-batch of ``accumulate``; ``master``: keep float32 master weights (None: for 16-bit params).
    ``weight_decay``: one value, or one a parameter keyed by the parameter states' names (no decay for
    norms and biases, say). Its
    states are named ``{prefix}.*``. See megaloop.optim.attach for the order of things."""
    with _all_or_nothing(graph):
        b = _Builder(graph, prefix, accumulate, master)
        pairs = _pairs(graph, params, grads)
        decay = _per_parameter("weight_decay", weight_decay, pairs)
        grad_values = b.gradients(pairs)
        scale, norm = b.clip_scale(grad_values, max_norm, norm_over)
        lr_t = b.learning_rate(lr, schedule)
        masters: dict[str, str] = {}
        targets, news = [], []
        for (name, param, _), g in zip(pairs, grad_values):
            with graph.scope(f"{prefix}.{name}"):
                m = ops.adam_moment(
                    b.state(f"m.{name}", param.shape), g, b.counter, beta=betas[0], scale=scale, accumulate=accumulate
                )
                v = ops.adam_moment(
                    b.state(f"v.{name}", param.shape),
                    g,
                    b.counter,
                    beta=betas[1],
                    square=True,
                    scale=scale,
                    accumulate=accumulate,
                )
                target = b.target(name, param, masters)
                news.append(
                    ops.adamw_update(
                        target,
                        m,
                        v,
                        b.counter,
                        lr=lr_t,
                        beta1=betas[0],
                        beta2=betas[1],
                        eps=eps,
                        weight_decay=decay[name],
                        accumulate=accumulate,
                    )
                )
                targets.append(target)
        return b.finish(pairs, targets, news, lr_t, norm, masters)


def sgd(
    graph: Graph,
    params: Mapping[str, Tensor] | Sequence[Tensor],
    grads: Mapping[str, Tensor] | Sequence[Tensor],
    *,
    lr: float,
    momentum: float = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    weight_decay: float | Mapping[str, float] = 0.0,
    schedule: Schedule | None = None,
    max_norm: float | None = None,
    accumulate: int = 1,
    master: bool | None = None,
    prefix: str = "optim",
    norm_over: NormOver | None = None,
) -> Optimizer:
    """torch.optim.SGD's update (momentum, dampening, Nesterov, L2 weight decay) of ``params`` (graph
    states) by ``grads``; the rest as ``adamw``."""
    with _all_or_nothing(graph):
        b = _Builder(graph, prefix, accumulate, master)
        pairs = _pairs(graph, params, grads)
        decay = _per_parameter("weight_decay", weight_decay, pairs)
        grad_values = b.gradients(pairs)
        scale, norm = b.clip_scale(grad_values, max_norm, norm_over)
        lr_t = b.learning_rate(lr, schedule)
        masters: dict[str, str] = {}
        targets, news = [], []
        for (name, param, _), g in zip(pairs, grad_values):
            with graph.scope(f"{prefix}.{name}"):
                target = b.target(name, param, masters)
                buf = None
                if momentum:
                    buf = ops.sgd_momentum(
                        b.state(f"momentum.{name}", param.shape),
                        g,
                        target,
                        b.counter,
                        momentum=momentum,
                        dampening=dampening,
                        weight_decay=decay[name],
                        scale=scale,
                        accumulate=accumulate,
                    )
                news.append(
                    ops.sgd_update(
                        target,
                        g,
                        b.counter,
                        lr=lr_t,
                        buf=buf,
                        momentum=momentum,
                        nesterov=nesterov,
                        weight_decay=decay[name],
                        scale=scale,
                        accumulate=accumulate,
                    )
                )
                targets.append(target)
        return b.finish(pairs, targets, news, lr_t, norm, masters)

"""The training step split over several ranks (``Trainer`` with ``devices`` > 1): one device's
forward and loss handed to ``ml.parallelize_training`` (data, ZeRO, tensor or pipeline parallel, the
cost model's choice for "auto"), then on each rank what graph.py builds into one device's step:

- the token data resident: each rank's inputs (its sequences of the batch, its micro-batches)
  become states holding its piece of every batch, read by the step counter ``train.step``
  (megaloop.parallel.step_inputs), so one iteration is one step with no host work between steps;
- the histories: ``train.losses`` on the ranks that hold the loss (every rank but a pipeline's
  earlier stages; the split's loss is one device's mean, all-reduced), ``train.lrs`` and
  ``train.grad_norms`` on every rank.

The weights come back through ``gather_weights``, each from its float32 master where the optimizer
keeps one (a ZeRO rank's shard of the bucket it stands for), so a checkpoint is one device's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from megaloop.errors import GraphBuildError, UsageError
from megaloop.frontend.graph import Graph
from megaloop.models.gradients import llama_loss
from megaloop.models.llama import LlamaConfig
from megaloop.parallel.step_inputs import StepInputs, inputs_by_step
from megaloop.parallel.train_split import TrainingSplit
from megaloop.parallel.training import KINDS, parallelize_training, parse_strategy, split_axes
from megaloop.training.graph import LOSSES, LRS, NORMS, STEP, OptimizerSettings, histories

STRATEGIES = ("auto", *KINDS)  # and axes joined by "x" with sizes: "pp2xtp2", "zero2_2xtp2"


def check_strategy(strategy: str, devices: int) -> None:
    """Refuse a strategy parallelize_training does not know, or one whose ranks are not ``devices``,
    naming the settings (``--strategy``, ``--devices``)."""
    if strategy == "auto":
        return
    try:
        parse_strategy(strategy)
    except GraphBuildError as e:
        why = str(e).removeprefix("parallelize_training: ")
        raise UsageError(
            f"unknown --strategy {strategy!r} ({why}); the strategies are {', '.join(STRATEGIES)}, or axes joined by "
            "'x' with sizes (e.g. 'pp2xtp2')"
        ) from None
    try:
        split_axes(strategy, devices)
    except GraphBuildError as e:
        why = str(e).removeprefix("parallelize_training: ")
        raise UsageError(
            f"--strategy {strategy!r} does not fit --devices {devices}: {why}; give sizes whose product is --devices "
            f"(e.g. 'pp2xtp2' for 4) or change --devices"
        ) from None


@dataclass
class SplitTraining:
    """A training step split over ranks: the split, its resident inputs, and the run's sizes."""

    split: TrainingSplit
    inputs: StepInputs
    cfg: LlamaConfig
    batch: int
    seq: int
    batches: int
    iterations: int
    accumulate: int

    @property
    def graphs(self) -> list[Graph]:
        return self.split.graphs

    @property
    def loss_rank(self) -> int:
        """The first rank that writes the loss history."""
        return next(r for r, g in enumerate(self.graphs) if LOSSES in g.states)

    def initial_state(self, params: Mapping[str, Any], data: np.ndarray) -> list[dict[str, Any]]:
        """Each rank's starting state: its weight pieces and optimizer states from ``params`` (one
        device's weights by name), its pieces of the token windows ``data`` [batches, batch, seq + 1]."""
        data = np.asarray(data)
        if data.shape != (self.batches, self.batch, self.seq + 1) or data.dtype.kind not in "iu":
            raise GraphBuildError(
                f"training data must be int [{self.batches}, {self.batch}, {self.seq + 1}] (batches of windows of "
                f"seq + 1 tokens), got {data.dtype}{list(data.shape)}"
            )
        data = data.astype(np.int64)
        weights = {n: params[n] for n in self.split.original.parameters if n in params}
        states = self.split.initial_state(weights)
        windows = self.inputs.state({"tokens": data[:, :, :-1], "targets": data[:, :, 1:]})
        return [{**a, **b} for a, b in zip(states, windows)]

    def masters(self, read: Any) -> dict[str, np.ndarray]:
        """One device's weights by name, each from its float32 master where there is one. ``read``:
        names -> one dict a rank of the values it holds (the runner's ``read_ranks``)."""
        names = [
            [*step.weights, *step.optimizer.masters.values(), *step.shards]
            for step in self.split.steps  # (every rank's states of the weights)
        ]
        values = read(sorted({n for rank in names for n in rank}))
        states = []
        for step, got in zip(self.split.steps, values):
            mine = {n: got[step.optimizer.masters.get(n, n)] for n in step.weights}
            states.append(mine)
        for bucket in self.split.buckets:  # a ZeRO bucket's pieces from its members' float32 shards
            if not bucket.shard_state:
                continue
            flat = np.concatenate([values[r][bucket.shard_state] for r in bucket.group])
            for r in bucket.group:
                local = {piece: n for n, piece in self.split.steps[r].weights.items()}
                for piece, off in zip(bucket.pieces, bucket.offsets):
                    states[r][local[piece]] = flat[off : off + piece.size].reshape(piece.shape)
        return self.split.gather_weights(states)


def build_split_training(
    cfg: LlamaConfig,
    *,
    batch: int,
    seq: int,
    batches: int,
    iterations: int,
    optimizer: OptimizerSettings,
    devices: int,
    strategy: str = "auto",
    micro_batches: int | None = None,
    recompute: bool = False,
    memory_per_device: int | None = None,
) -> SplitTraining:
    """The training step of ``cfg`` on ``batch`` windows of ``seq`` tokens split over ``devices``
    ranks by ``strategy`` (module docstring), for a run of ``iterations`` micro-batches."""
    check_strategy(strategy, devices)
    if iterations % optimizer.accumulate:
        raise GraphBuildError(
            f"build_split_training: {iterations} iterations are not whole updates of {optimizer.accumulate} "
            "micro-batches"
        )
    model = dataclasses.replace(cfg, max_seq=seq)  # (the KV caches the forward writes: one window each)
    g = Graph("llama-train")
    tokens = g.input("tokens", (batch, seq), "int64")
    targets = g.input("targets", (batch, seq), "int64")
    loss, _ = llama_loss(g, model, tokens, targets)
    g.output("loss", loss)
    spec = optimizer.spec({n: t.shape for n, t in g.parameters.items()}, iterations // optimizer.accumulate)
    split = parallelize_training(
        g, "loss", spec, devices=devices, strategy=None if strategy == "auto" else strategy,
        micro_batches=micro_batches, recompute=recompute, memory_per_device=memory_per_device,
    )  # fmt: skip
    inputs = inputs_by_step(split.forward, batches, STEP)
    for part in split.forward.parts:
        rg = part.graph
        loss_local = next((local for local, (orig, _) in part.outputs.items() if orig == "loss"), None)
        values = {
            LOSSES: rg.outputs[loss_local] if loss_local is not None else None,
            LRS: rg.outputs["train.lr"],
            NORMS: rg.outputs.get("train.grad_norm"),
        }
        histories(rg, iterations, rg.states[STEP], values)
        rg.validate()
    return SplitTraining(split, inputs, cfg, batch, seq, batches, iterations, optimizer.accumulate)


def rank_histories(graphs: Sequence[Graph], read: Any, done: int) -> list[dict[str, list[float]]]:
    """Each rank's loss (where it holds one), learning rate and gradient norm for the ``done``
    iterations run, from the histories (``read`` as in ``SplitTraining.masters``)."""
    names = [LOSSES, LRS, NORMS]
    values = read(names)
    out = []
    for g, got in zip(graphs, values):
        mine = {}
        for name, key in zip(names, ("loss", "lr", "grad_norm")):
            if name in g.states:
                mine[key] = [float(x) for x in np.asarray(got[name]).reshape(-1)[:done]]
        out.append(mine)
    return out

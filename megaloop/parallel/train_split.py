"""``TrainingSplit``: each rank's training-step graph, with what a caller needs to run it as if it were
one device's step (each rank's starting state cut from one device's weights, its inputs, the loss and
the weights put back together), the cost model's prediction, each rank's memory by kind (parameters,
gradients, optimizer states, activations), the candidates compared and an account in words."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from megaloop.errors import EvaluationError, PartitionMemoryError
from megaloop.frontend.graph import Graph
from megaloop.parallel.partition import Partition, Prediction
from megaloop.parallel.predict import memory_bytes
from megaloop.parallel.train_step import Bucket, Piece, RankStep, shard_value


@dataclass
class MemoryAccount:
    """A rank's bytes by kind. ``gradients``: those the optimizer reads after the exchange (a ZeRO-2
    rank's shard) plus accumulation buffers; ``activations``: the intermediates alive at once at the
    peak in program order (the backward's transient gradients among them); ``other_state``: states
    the forward carries (KV caches). ``total`` counts the persistent kinds once and the peak."""

    parameters: int = 0
    gradients: int = 0
    optimizer: int = 0
    activations: int = 0
    other_state: int = 0
    saved: int = 0  # forward values the backward reads (what recompute=True cuts), within activations
    largest: dict[str, list[tuple[str, int]]] = field(default_factory=dict)  # kind -> biggest tensors

    @property
    def total(self) -> int:
        accumulated = sum(n for _, n in self.largest.get("accumulation", []))
        return self.parameters + self.optimizer + accumulated + self.other_state + self.activations


def account(g: Graph, step: RankStep) -> MemoryAccount:
    opt_states = set(step.optimizer.states) | set(step.shards)
    out = MemoryAccount()
    kinds: dict[str, list[tuple[str, int]]] = {}
    for name, t in g.states.items():
        if name in step.weights:
            kind = "parameters"
        elif name in opt_states and ".grad_sum." in name:
            kind = "accumulation"
        elif name in opt_states:
            kind = "optimizer"
        else:
            kind = "other_state"
        kinds.setdefault(kind, []).append((name, t.nbytes))
    out.parameters = sum(n for _, n in kinds.get("parameters", []))
    out.optimizer = sum(n for _, n in kinds.get("optimizer", []))
    out.other_state = sum(n for _, n in kinds.get("other_state", []))
    out.gradients = step.grad_bytes + sum(n for _, n in kinds.get("accumulation", []))
    held = sum(t.nbytes for n in g.nodes if n.op.kind == "source" for t in n.outputs)
    out.activations = max(memory_bytes(g) - held, 0)
    out.saved = saved_for_backward(g)
    out.largest = {k: sorted(v, key=lambda x: -x[1]) for k, v in kinds.items()}
    out.largest["accumulation"] = kinds.get("accumulation", [])
    return out


def saved_for_backward(g: Graph) -> int:
    """Bytes of the forward's intermediates that the backward reads (kept from one to the other)."""
    saved: dict[Any, int] = {}
    for n in g.nodes:
        if n.scope == "grad" or n.scope.startswith("grad."):
            for t in n.inputs:
                src = t.base.node
                if src.op.kind != "source" and not src.scope.startswith(("grad", "recompute")):
                    if src.op.inplace_operand is None:
                        saved[t.base] = t.base.nbytes
    return sum(saved.values())


@dataclass
class Candidate:
    options: Any  # TrainingOptions
    predicted: Prediction | None
    peak_bytes: int
    error: str = ""


class TrainingSplit:
    def __init__(
        self,
        original: Graph,
        forward: Partition,
        options: Any,
        steps: Sequence[RankStep],
        buckets: Sequence[Bucket],
        holders: Mapping[Piece, tuple[int, ...]],
        predicted: Prediction,
    ) -> None:
        self.original, self.forward, self.options = original, forward, options
        self.graphs = [p.graph for p in forward.parts]
        self.steps, self.buckets, self.holders = list(steps), list(buckets), dict(holders)
        self.predicted = predicted
        self.memory: list[MemoryAccount] = []
        self.candidates: list[Candidate] = []
        self.memory_limit: int | None = None
        self.notes: list[str] = []

    @property
    def world_size(self) -> int:
        return len(self.graphs)

    @property
    def peak_bytes(self) -> int:
        return max(m.total for m in self.memory)

    # ---- handing values to the ranks ------------------------------------------------------------
    def initial_state(self, weights: Mapping[str, Any]) -> list[dict[str, np.ndarray]]:
        """Each rank's starting state from one device's weights (by parameter name): its pieces of
        them, its ZeRO shards (float32), and its optimizer's states (masters, zero moments, counter)."""
        names = set(self.original.parameters)
        missing, unknown = sorted(names - set(weights)), sorted(set(weights) - names)
        if missing or unknown:
            raise EvaluationError(f"parallelize_training: weights missing {missing[:5]}, unknown {unknown[:5]}")
        out = []
        for g, step in zip(self.graphs, self.steps):
            mine: dict[str, np.ndarray] = {}
            for name, piece in step.weights.items():
                value = np.asarray(weights[piece.name])
                if value.shape != self.original.parameters[piece.name].shape:
                    raise EvaluationError(
                        f"parallelize_training: weight {piece.name!r} has shape {value.shape}; the graph expects "
                        f"{self.original.parameters[piece.name].shape}"
                    )
                mine[name] = value[tuple(slice(lo, hi) for lo, hi in piece.box)].astype(g.states[name].dtype.np)
            for shard, (bucket, member) in step.shards.items():
                mine[shard] = shard_value(bucket, member, weights)
            params = {**mine}
            mine.update(step.optimizer.initial_state({k: params[k] for k in step.optimizer.masters}))
            out.append(mine)
        return out

    def shard_inputs(self, inputs: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Each rank's inputs (its sequences of the batch, its micro-batches), cut from one device's."""
        return self.forward.shard_inputs(inputs)

    # ---- putting results back together ----------------------------------------------------------------
    def gather_outputs(self, results: Sequence[Any]) -> dict[str, np.ndarray]:
        """One device's outputs (the loss among them) from the ranks' results, and each rank's
        ``train.lr`` (and ``train.grad_norm`` with clipping) as rank 0 has them."""
        per_rank = [r.outputs if hasattr(r, "outputs") else r for r in results]
        if len(per_rank) != self.world_size:
            raise EvaluationError(f"parallelize_training: {len(per_rank)} results for {self.world_size} ranks")
        out: dict[str, np.ndarray] = {}
        for name, t in self.original.outputs.items():
            pieces = [
                (box, outs[local])
                for part, outs in zip(self.forward.parts, per_rank)
                for local, (orig, box) in part.outputs.items()
                if orig == name
            ]
            out[name] = Partition._assemble(t, pieces, f"output {name!r}")
        for extra in ("train.lr", "train.grad_norm"):
            if extra in per_rank[0]:
                out[extra] = per_rank[0][extra]
        return out

    def loss(self, results: Sequence[Any]) -> float:
        return float(self.gather_outputs(results)[self.options.loss])

    def gather_weights(self, states: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """One device's weights from the ranks' states (each piece from the first rank holding it)."""
        if len(states) != self.world_size:
            raise EvaluationError(f"parallelize_training: {len(states)} states for {self.world_size} ranks")
        out: dict[str, np.ndarray] = {}
        covered: dict[str, np.ndarray] = {}
        for step, st in zip(self.steps, states):
            st = st.state if hasattr(st, "state") else st
            for name, piece in step.weights.items():
                t = self.original.parameters[piece.name]
                if piece.name not in out:
                    out[piece.name] = np.zeros(t.shape, dtype=np.asarray(st[name]).dtype)
                    covered[piece.name] = np.zeros(t.shape, bool)
                sl = tuple(slice(lo, hi) for lo, hi in piece.box)
                out[piece.name][sl] = st[name]
                covered[piece.name][sl] = True
        bad = [n for n, c in covered.items() if not c.all()]
        if bad or set(out) != set(self.original.parameters):
            raise EvaluationError(
                "parallelize_training: the ranks' states do not cover "
                f"{bad or sorted(set(self.original.parameters) - set(out))}"
            )
        return out

    # ---- accounts ---------------------------------------------------------------------------------------
    def describe(self) -> str:
        from megaloop.parallel.train_describe import describe

        return describe(self)

    def summary(self) -> str:
        from megaloop.parallel.train_describe import summary

        return summary(self)

    def __repr__(self) -> str:
        return f"TrainingSplit({self.original.name!r}, {self.options.strategy}, {self.world_size} ranks)"


def too_big(split: TrainingSplit, limit: int, explicit: bool) -> PartitionMemoryError:
    """The error for a split (the smallest tried) that does not fit: each kind's bytes, the largest."""
    r = max(range(split.world_size), key=lambda i: split.memory[i].total)
    m = split.memory[r]
    kinds = {
        "parameters": m.parameters,
        "optimizer states": m.optimizer,
        "gradients": m.gradients,
        "activations": m.activations,
        "other state (KV caches)": m.other_state,
    }
    worst = max(kinds, key=kinds.get)
    key = {"parameters": "parameters", "optimizer states": "optimizer", "other state (KV caches)": "other_state"}
    names = ", ".join(f"{n} {_size(b)}" for n, b in m.largest.get(key.get(worst, ""), [])[:3])
    what = (
        f"{split.options.strategy} needs" if explicit else f"the smallest split tried, {split.options.strategy}, needs"
    )
    return PartitionMemoryError(
        f"parallelize_training: memory_per_device = {_size(limit)} is too little; {what} {_size(m.total)} on rank {r}: "
        + ", ".join(f"{k} {_size(v)}" for k, v in kinds.items())
        + f". The largest is {worst}"
        + (f" ({names})" if names else "")
        + "; give more devices or memory, shard the optimizer (strategy 'zero2'), cut the weights ('tp', 'pp'), "
        "recompute activations (recompute=True) or use a smaller batch"
    )


def _size(n: int) -> str:
    if n >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    if n >= 2**20:
        return f"{n / 2**20:.2f} MiB"
    return f"{n / 2**10:.1f} KiB"

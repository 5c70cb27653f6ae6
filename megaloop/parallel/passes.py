"""Building one candidate of ``parallelize``: the passes in order over the program's parts
(micro-batches, dp, tp, then the pipeline or device stages) and the cost model's prediction."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from megaloop.errors import GraphBuildError, PartitionMemoryError
from megaloop.frontend.graph import Graph, Node
from megaloop.frontend.placement import OnDevice, Placement, Replicate, Shard, Strategy, even_sizes, resolve
from megaloop.frontend.tensor import Tensor
from megaloop.parallel.axes import batch_tensors, never_batch, only_batch
from megaloop.parallel.cost import Machine, Pricer, exchange_us
from megaloop.parallel.mesh import Mesh
from megaloop.parallel.partition import Partition, Prediction
from megaloop.parallel.predict import node_us, predict_step
from megaloop.parallel.search import search
from megaloop.parallel.shard import Part, shard
from megaloop.parallel.stages import device_stages, pipeline_stages, split


@dataclass(frozen=True)
class Plan:
    """One candidate: a kind of parallelism per mesh axis (and micro-batches for a pipeline)."""

    mesh: Mesh
    kinds: tuple[str, ...]
    micro_batches: int = 1
    forced: bool = False  # the user asked for these kinds: tensor parallelism cuts every weight matrix

    @property
    def label(self) -> str:
        parts = [f"{k}{s}" for k, s in zip(self.kinds, self.mesh.shape) if s > 1]
        text = " x ".join(parts) or "1 device"
        return text + (f" ({self.micro_batches} micro-batches)" if self.micro_batches > 1 else "")

    def size(self, kind: str) -> int:
        out = 1
        for k, s in zip(self.kinds, self.mesh.shape):
            out *= s if k == kind else 1
        return out


def batch_size(graph: Graph) -> int:
    """The batch: axis 0 of the inputs and states that hold the most bytes along one axis class."""
    found = batch_tensors(Part.whole(graph))
    return found[0].shape[0] if found else 1


def build(
    graph: Graph,
    plan: Plan,
    pins: Mapping[Tensor, Placement],
    machine: Machine,
    memory: int | None,
    tiles: dict | None = None,
) -> Partition:
    """The partition ``plan`` describes: the passes in order, then the cost model's prediction.
    ``tiles``: nodes' tile times by what they depend on, shared between candidates."""
    tiles = {} if tiles is None else tiles
    _check_pins_fit(plan, pins)
    mesh, world = plan.mesh, plan.mesh.size
    notes: list[str] = []
    stride = {k: _stride(plan, k) for k in ("pp", "dp", "tp", "device")}
    parts = [Part.whole(graph)]
    decisions: dict[str, dict[Node, Any]] = {}
    exchanges: dict[str, list] = {}
    stage_of: dict[Node, int] = {}
    if plan.micro_batches > 1:
        parts = _micro_batch(parts[0], plan.micro_batches, machine)
        notes.append(f"the batch runs as {plan.micro_batches} micro-batches (chains that pipeline stages overlap)")
    for kind in ("dp", "tp"):
        n = plan.size(kind)
        if n == 1:
            continue
        out: list[Part] = []
        first: tuple[Part, dict[Node, Strategy]] | None = None
        user = kind == "tp" or plan.size("tp") == 1  # the user's pins apply to the axis that cuts tensors
        for part in parts:
            ranks = [part.graph.rank + j * stride[kind] for j in range(n)]
            allow = only_batch(part, n) if kind == "dp" else _tensor_parallel(part, n, plan.forced)
            if first is not None:  # every part cut alike, so that their collectives match
                allow = _like(part, *first, allow)
            part_pins = _local_pins(part, pins, n) if user else {}
            if kind == "dp":
                part_pins = _merge_dp_pins(part_pins, _dp_pins(part, n))
            found = search(part, n, Pricer(machine, n, tuple(ranks)), pins=part_pins, allow=allow, memory_limit=memory)
            made = shard(
                part, n, found.choice, ranks=ranks, world_size=world, remap=lambda r, j, s=stride[kind]: r + j * s
            )
            if first is None:  # (the first part's account stands for all)
                first = (part, found.choice.strategies)
                decisions[kind] = {part.origin[nd]: st for nd, st in found.choice.strategies.items()}
                exchanges[kind] = made[0].exchanges
            out += made
        parts = out
    for kind in ("pp", "device"):
        n = plan.size(kind)
        if n == 1:
            continue
        cost = _origin_costs(parts[0], machine, tiles)
        link = machine.link(range(0, world, max(stride[kind], 1)))
        link_us = lambda b, link=link: exchange_us("send", b, 2, link)
        if kind == "pp":
            stages = pipeline_stages(graph, cost, n, link_us, _origin_held(parts[0]), memory)
        else:
            stages = device_stages(graph, cost, n, link_us, _device_pins(graph, pins, n))
            used = len({stages[nd] for nd in graph.nodes if nd.op.kind not in ("source", "view")})
            notes.append(f"independent branches on {used} of {n} devices")
        stage_of = stages
        staged = split(parts, stages, n, stride[kind], world)
        parts = [p for stage in staged for p in stage]
    parts = sorted(parts, key=lambda p: p.graph.rank)
    if [p.graph.rank for p in parts] != list(range(world)):
        raise GraphBuildError(f"partition: internal error, ranks {[p.graph.rank for p in parts]} for {world}")
    partition = Partition(graph, parts, mesh=mesh, notes=notes)
    partition.plan, partition.decisions, partition.exchanges = plan, decisions, exchanges
    partition.stage_of = stage_of
    step = predict_step(partition.graphs, machine, tiles)
    partition.predicted = Prediction(step["step_us"], step["exchanged_bytes"], step["memory_bytes"], step)
    return partition


def _tensor_parallel(part: Part, n: int, forced: bool) -> Any:
    """Strategies that never cut the batch; asked for by name, also none that keeps a weight matrix
    (a parameter of two or more axes, one of them cut-able) whole on every device. An embedding table
    may stay whole (a lookup reads a few rows), unless another op reads it too (an LM head tied to
    it): a rank stores a parameter once, so the whole table would stand for the head's share."""
    base = never_batch(part, n)
    if not forced:
        return base
    readers: dict[Tensor, int] = {}
    for node in part.graph.nodes:
        for t in set(node.inputs):
            readers[t] = readers.get(t, 0) + 1

    def allow(node: Node, s: Any) -> bool:
        for t, p in zip(node.inputs, s.inputs):
            if (
                t.node.op.name == "parameter"
                and t.ndim >= 2
                and isinstance(p, Replicate)
                and max(t.shape) >= n
                and (node.op.name != "embedding" or readers[t] > 1)
            ):
                return False
        return base(node, s)

    allow.why = getattr(base, "why", "")  # type: ignore[attr-defined]
    return allow


def _stride(plan: Plan, kind: str) -> int:
    """Rank distance between neighbours along the kind's axes (several tp axes, adjacent, act as one)."""
    if kind not in plan.kinds:
        return 1
    last = len(plan.kinds) - 1 - plan.kinds[::-1].index(kind)
    return plan.mesh.stride(plan.mesh.names[last])


def _micro_batch(part: Part, m: int, machine: Machine) -> list[Part]:
    """The batch cut into ``m`` chains of one graph: data parallel onto members that share it."""
    allow = only_batch(part, m)
    pins = _dp_pins(part, m)
    found = search(part, m, Pricer(replace(machine, same_gpu=None), m), pins=pins, allow=allow, shared=True)
    return shard(part, m, found.choice, ranks=None, world_size=1)


def _dp_pins(part: Part, n: int) -> dict[Tensor, Placement]:
    """Data parallel: the inputs of the batch cut along axis 0, every parameter whole."""
    batch = batch_tensors(part)
    if not batch or batch[0].shape[0] < n:
        what = f"{batch[0].name!r} has {batch[0].shape[0]}" if batch else f"{part.graph.name!r} has no batch"
        raise GraphBuildError(
            f"parallelize: data parallelism over {n} devices needs a batch of at least {n} (axis 0 of the inputs "
            f"and states that carry it); {what}"
        )
    pins: dict[Tensor, Placement] = {t: Replicate() for t in part.graph.parameters.values()}
    for t in batch:
        if t.node.op.name == "input":
            pins[t] = Shard(0, even_sizes(t.shape[0], n))
    return pins


def _merge_dp_pins(user: dict[Tensor, Placement], dp: dict[Tensor, Placement]) -> dict[Tensor, Placement]:
    for t, p in user.items():
        if t in dp and dp[t] != p:
            raise GraphBuildError(
                f"parallelize: layout pins {t.name!r} to {p}, but data parallelism keeps it {dp[t]} (parameters "
                "whole, the batch cut along axis 0); drop the pin or add a tensor-parallel axis"
            )
    return {**dp, **user}


def _like(part: Part, first: Part, chosen: dict[Node, Strategy], allow: Any) -> Any:
    """A part's strategies restricted to the first part's kind of cut for the node in the same place
    (the parts of one pass are the same program, their pieces maybe of other sizes)."""
    by_place = {i: chosen[n] for i, n in enumerate(first.graph.nodes) if n in chosen}
    ops = [n.op for n in first.graph.nodes]

    def shape_of(s: Strategy) -> tuple:
        return tuple((type(p), getattr(p, "axis", None)) for p in (*s.inputs, *s.outputs))

    def allowed(node: Node, s: Strategy) -> bool:
        i = node.id
        want = by_place.get(i) if i < len(ops) and ops[i] is node.op else None
        return allow(node, s) and (want is None or shape_of(s) == shape_of(want))

    allowed.why = getattr(allow, "why", "")  # type: ignore[attr-defined]
    return allowed


def _check_pins_fit(plan: Plan, pins: Mapping[Tensor, Placement]) -> None:
    """Pins that no axis of the plan can honour are refused (auto drops the candidate)."""
    for t, p in pins.items():
        if isinstance(p, OnDevice) and "device" not in plan.kinds:
            raise GraphBuildError(
                f"parallelize: layout pins {t.name!r} to {p}, which only device parallelism places "
                f"({plan.label} has no device axis); use strategy='device'"
            )
        if isinstance(p, Shard) and plan.size("tp") == 1 and plan.size("dp") == 1:
            raise GraphBuildError(
                f"parallelize: layout pins {t.name!r} to {p}, but {plan.label} cuts no tensors (pipeline and "
                "device parallelism keep each tensor whole on its devices)"
            )


def _device_pins(graph: Graph, pins: Mapping[Tensor, Placement], n: int) -> dict[Node, int]:
    """Nodes a pin puts on one device: the op making a pinned tensor, or those reading a pinned source."""
    out: dict[Node, int] = {}
    for t, p in pins.items():
        if not isinstance(p, OnDevice):
            continue
        if not 0 <= p.device < n:
            raise GraphBuildError(f"parallelize: layout pins {t.name!r} to device {p.device}; the mesh has {n}")
        users = [nd for nd in graph.nodes if t in nd.inputs] if t.node.op.kind == "source" else [t.node]
        for nd in users:
            out[nd] = p.device
    return out


def _local_pins(part: Part, pins: Mapping[Tensor, Placement], n: int) -> dict[Tensor, Placement]:
    """The user's pins, on this part's tensors: sources by name, others through their origin node."""
    if not pins:
        return {}
    wanted = {t.name: p for t, p in pins.items()}
    out = {}
    for node in part.graph.nodes:
        if node.op.kind == "source":
            name = part.sources[node].name
        else:
            origin = part.origin.get(node)
            if origin is None or origin.op is not node.op:
                continue
            name = origin.outputs[0].name if origin.outputs else None
        if name in wanted:
            t = node.outputs[0]
            p = resolve(wanted[name], t.shape, n)
            if p is None:
                raise GraphBuildError(
                    f"parallelize: layout pins {name!r} (shape {t.shape}) to {wanted[name]}, which {n} devices "
                    "cannot hold (an axis out of range, or pieces of less than one element)"
                )
            out[t] = p
    return out


def _origin_costs(part: Part, machine: Machine, tiles: dict) -> dict[Node, float]:
    """Each original node's time on one rank: what its part's nodes made for it take."""
    cost: dict[Node, float] = {}
    for node in part.graph.nodes:
        origin = part.origin.get(node)
        if origin is not None and node.op.kind not in ("source", "view"):
            cost[origin] = cost.get(origin, 0.0) + node_us(node, machine, tiles)
    return cost


def _origin_held(part: Part) -> dict[Node, dict[Tensor, int]]:
    """Per original node, the bytes of each stored source (parameter, state) a rank reads for it."""
    held: dict[Node, dict[Tensor, int]] = {}
    for node in part.graph.nodes:
        origin = part.origin.get(node)
        if origin is None or node.op.kind == "source":
            continue
        for t in node.inputs:
            src = t.base
            if src.node.op.name in ("parameter", "state"):
                held.setdefault(origin, {})[src] = src.nbytes
    return held


def too_big(partition: Partition, memory: int) -> PartitionMemoryError:
    lines = []
    for r, g in enumerate(partition.graphs):
        biggest = sorted((t for t in [*g.parameters.values(), *g.states.values()]), key=lambda t: -t.nbytes)[:3]
        names = ", ".join(f"{t.name} {_size(t.nbytes)}" for t in biggest)
        lines.append(f"rank {r}: {_size(partition.predicted.memory_bytes[r])} (largest: {names})")
    return PartitionMemoryError(
        f"parallelize: memory_per_device = {_size(memory)} is too little; the smallest split tried, "
        f"{partition.plan.label}, needs:\n  "
        + "\n  ".join(lines[:8])
        + "\n  give more devices, more memory, or a smaller model/cache (max_seq)"
    )


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"

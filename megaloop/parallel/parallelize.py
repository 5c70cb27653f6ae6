"""``parallelize``: a single-device graph split over a mesh of devices, the split chosen by the cost model.

Each axis of the mesh is one kind of parallelism, applied in this order (each step a graph
transformation over the previous step's parts, megaloop.parallel.shard and .stages):

1. micro-batches (for a pipeline): the batch cut into chains that share the rank's graph;
2. ``dp``, data parallel: the batch cut over the axis, parameters whole;
3. ``tp``, tensor parallel: every op by the cheapest of its strategies (Megatron's column- then
   row-parallel pairs come out of the search, as do sequence-parallel norms where they pay);
4. ``pp``, pipeline parallel: the program's order cut into contiguous stages;
   ``device``: each op on the device where it finishes first (independent branches side by side).

``strategy="auto"`` tries every assignment of kinds to the mesh's axes (for an int, every
factorisation of the devices into pp x dp x tp, and device placement) and keeps the lowest predicted
step that fits ``memory_per_device``; ``Partition.candidates`` holds the table it compared.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from megaloop.errors import GraphBuildError
from megaloop.frontend.graph import Graph, Node
from megaloop.frontend.placement import Placement, Replicate, Shard, even_sizes, resolve
from megaloop.frontend.tensor import Tensor
from megaloop.parallel.cost import H200, Machine, Pricer, exchange_us
from megaloop.parallel.mesh import Mesh, as_mesh
from megaloop.parallel.partition import Partition, Prediction
from megaloop.parallel.predict import node_us, predict_step
from megaloop.parallel.reshard import check_placement
from megaloop.parallel.search import never_batch, only_batch, search
from megaloop.parallel.shard import Part, shard
from megaloop.parallel.stages import device_stages, pipeline_stages, split

STRATEGIES = ("auto", "tp", "pp", "dp", "device")
KINDS = ("tp", "pp", "dp", "device")


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
        return math.prod(s for k, s in zip(self.kinds, self.mesh.shape) if k == kind)


@dataclass
class Candidate:
    plan: Plan
    predicted: Prediction | None
    error: str = ""


def parallelize(
    graph: Graph,
    devices: int | Mesh,
    strategy: str | Mapping[str, str] = "auto",
    *,
    layout: Mapping[str, Placement] | None = None,
    memory_per_device: int | None = None,
    machine: Machine | None = None,
    micro_batches: int | None = None,
) -> Partition:
    """Split ``graph`` (one device's program) over ``devices`` (a count or a ``Mesh``).

    ``strategy``: "tp", "pp", "dp", "device" (every device in one way), "auto" (the cost model picks),
    or a dict naming a kind per mesh axis ({"pp": "pp", "tp": "tp"}). ``layout`` pins placements by
    tensor name (parameters and inputs by their names, other tensors by their node's name):
    ``{"lm_head.weight": ml.Shard(0)}``. ``memory_per_device``: bytes a device may hold; plans that
    need more are refused. ``machine``: the cost model's device and links (the measured H200 by default).
    """
    machine = machine or H200
    _check_single_device(graph)
    mesh = as_mesh(devices)
    pins = _pins(graph, layout)
    plans = _plans(graph, mesh, strategy, micro_batches)
    candidates: list[Candidate] = []
    best: tuple[float, Partition] | None = None
    tiles: dict = {}
    for plan in plans:
        try:
            partition = build(graph, plan, pins, machine, memory_per_device, tiles)
        except GraphBuildError as e:
            memory = "memory_per_device" in str(e)
            if len(plans) == 1 and not memory:
                raise
            candidates.append(
                Candidate(plan, None, "does not fit memory_per_device" if memory else str(e).splitlines()[0])
            )
            continue
        candidates.append(Candidate(plan, partition.predicted))
        fits = memory_per_device is None or max(partition.predicted.memory_bytes) <= memory_per_device
        if not fits:
            candidates[-1].error = "does not fit memory_per_device"
            if len(plans) == 1:
                raise _too_big(partition, memory_per_device)
            continue
        if best is None or partition.predicted.step_us < best[0]:
            best = (partition.predicted.step_us, partition)
    if best is None:
        if memory_per_device is not None and any(c.error == "does not fit memory_per_device" for c in candidates):
            unlimited = [
                build(graph, c.plan, pins, machine, None) for c in candidates[:4] if c.error.startswith("does")
            ]
            raise _too_big(min(unlimited, key=lambda p: max(p.predicted.memory_bytes)), memory_per_device)
        reasons = "; ".join(f"{c.plan.label}: {c.error}" for c in candidates)
        raise GraphBuildError(f"parallelize: no way to split {graph.name!r} over {mesh}: {reasons}")
    partition = best[1]
    partition.candidates = candidates
    return partition


def _check_single_device(graph: Graph) -> None:
    if not isinstance(graph, Graph):
        raise GraphBuildError(f"parallelize: expected a megaloop.Graph, got {type(graph).__name__}")
    if graph.world_size != 1:
        raise GraphBuildError(
            f"parallelize: graph {graph.name!r} is rank {graph.rank} of {graph.world_size}; parallelize takes a "
            "single-device graph (world_size 1) and makes the ranks' graphs itself"
        )
    comm = [n for n in graph.nodes if n.op.kind in ("collective", "p2p")]
    if comm:
        raise GraphBuildError(
            f"parallelize: graph {graph.name!r} already exchanges data ({comm[0].op.name} {comm[0].name}); "
            "give the single-device program"
        )
    graph.validate()


def _pins(graph: Graph, layout: Mapping[str, Placement] | None) -> dict[Tensor, Placement]:
    if not layout:
        return {}
    if not isinstance(layout, Mapping):
        raise GraphBuildError(f"parallelize: layout must map tensor names to placements, got {type(layout).__name__}")
    by_name: dict[str, Tensor] = {}
    for node in graph.nodes:
        for t in node.outputs:
            by_name.setdefault(t.name, t)
    out = {}
    for name, p in layout.items():
        if name not in by_name:
            close = sorted(n for n in by_name if n.split(".")[-1] == str(name).split(".")[-1])[:3]
            raise GraphBuildError(
                f"parallelize: layout names {name!r}, which is no tensor of graph {graph.name!r}"
                + (f" (did you mean {close}?)" if close else "")
            )
        out[by_name[name]] = check_placement(p, f"parallelize: layout[{name!r}]")
    return out


def _plans(graph: Graph, mesh: Mesh, strategy: Any, micro_batches: int | None) -> list[Plan]:
    if isinstance(strategy, Mapping):
        unknown = sorted(set(strategy) - set(mesh.names))
        if unknown:
            raise GraphBuildError(f"parallelize: strategy names axes {unknown}; the mesh's axes are {list(mesh.names)}")
        kinds = tuple(strategy.get(n, n) for n in mesh.names)
        return [_checked(graph, Plan(mesh, kinds, forced=True), micro_batches)]
    if strategy not in STRATEGIES:
        raise GraphBuildError(
            f"parallelize: strategy must be one of {STRATEGIES} or a dict per mesh axis, got {strategy!r}"
        )
    if strategy != "auto":
        if len(mesh.shape) == 1:
            return [_checked(graph, Plan(mesh, (strategy,), forced=True), micro_batches)]
        raise GraphBuildError(
            f"parallelize: strategy {strategy!r} for the {len(mesh.shape)}-axis mesh {mesh}: give one kind per axis, "
            "e.g. strategy={" + ", ".join(f"{n!r}: 'tp'" for n in mesh.names) + "}"
        )
    if all(n in KINDS for n in mesh.names) and len(mesh.shape) > 1:
        return [_checked(graph, Plan(mesh, mesh.names, forced=True), micro_batches)]
    return _auto_plans(graph, mesh, micro_batches)


def _checked(graph: Graph, plan: Plan, micro_batches: int | None) -> Plan:
    bad = [k for k in plan.kinds if k not in KINDS]
    if bad:
        raise GraphBuildError(f"parallelize: unknown kind(s) {bad}; each mesh axis is one of {KINDS}")
    tp_axes = [i for i, k in enumerate(plan.kinds) if k == "tp"]
    if tp_axes and tp_axes != list(range(tp_axes[0], tp_axes[-1] + 1)):
        raise GraphBuildError(f"parallelize: the tp axes of {plan.mesh} must be next to each other (they act as one)")
    for kind in ("pp", "dp", "device"):
        if plan.kinds.count(kind) > 1:
            raise GraphBuildError(f"parallelize: at most one {kind} axis (the mesh {plan.mesh} has several)")
    if "device" in plan.kinds and len([s for s in plan.mesh.shape if s > 1]) > 1:
        raise GraphBuildError("parallelize: device parallelism takes the whole mesh (one axis)")
    if plan.size("pp") > 1:
        return replace(plan, micro_batches=micro_batches or _micro_batches(graph, plan.size("pp")))
    return plan


def _batch(graph: Graph) -> int:
    first = next(iter(graph.inputs.values()), None)
    if first is None:
        first = next(iter(graph.states.values()), None)
    return first.shape[0] if first is not None and first.ndim else 1


def _micro_batches(graph: Graph, stages: int) -> int:
    """As many chains as stages, where the batch allows: each stage then has one to work on."""
    batch = _batch(graph)
    return max(d for d in range(1, min(batch, stages) + 1) if batch % d == 0)


def _auto_plans(graph: Graph, mesh: Mesh, micro_batches: int | None) -> list[Plan]:
    out = []
    if len(mesh.shape) == 1:
        n = mesh.size
        batch = _batch(graph)
        for pp, dp in itertools.product(_divisors(n), _divisors(n)):
            if n % (pp * dp) or dp > batch:
                continue
            tp = n // (pp * dp)
            axes = [(s, k) for s, k in ((pp, "pp"), (dp, "dp"), (tp, "tp")) if s > 1] or [(1, "tp")]
            shape, kinds = tuple(a[0] for a in axes), tuple(a[1] for a in axes)
            out.append(_checked(graph, Plan(Mesh(shape, kinds), kinds), micro_batches))
        if n > 1:
            out.append(Plan(Mesh((n,), ("device",)), ("device",)))
        return out
    batch = _batch(graph)
    for kinds in itertools.product(("tp", "pp", "dp"), repeat=len(mesh.shape)):
        if kinds.count("pp") > 1 or kinds.count("dp") > 1:
            continue
        if any(k == "dp" and s > batch for k, s in zip(kinds, mesh.shape)):
            continue  # (no batch to cut that far)
        out.append(_checked(graph, Plan(Mesh(mesh.shape, mesh.names), kinds), micro_batches))
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# ---- building one candidate ---------------------------------------------------------------------


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
        out = []
        for part in parts:
            ranks = [part.graph.rank + j * stride[kind] for j in range(n)]
            allow = only_batch(part, n) if kind == "dp" else _tensor_parallel(part, n, plan.forced)
            part_pins = _local_pins(part, pins, n) if kind == "tp" else {}
            if kind == "dp":
                part_pins.update(_dp_pins(part, n))
            found = search(part, n, Pricer(machine, n, tuple(ranks)), pins=part_pins, allow=allow, memory_limit=memory)
            made = shard(
                part, n, found.choice, ranks=ranks, world_size=world, remap=lambda r, j, s=stride[kind]: r + j * s
            )
            if not out:  # (every part is split alike: the first one's account stands for all)
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
            stages = pipeline_stages(graph, cost, n, link_us)
        else:
            stages = device_stages(graph, cost, n, link_us)
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
    (a parameter of two or more axes, one of them cut-able) whole on every device."""
    base = never_batch(part, n)
    if not forced:
        return base

    def allow(node: Node, s: Any) -> bool:
        for t, p in zip(node.inputs, s.inputs):
            if (
                t.node.op.name == "parameter"
                and t.ndim >= 2
                and isinstance(p, Replicate)
                and max(t.shape) >= n
                and node.op.name not in ("embedding",)
            ):
                return False
        return base(node, s)

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
    """Data parallel: every input cut along its batch axis (axis 0), every parameter whole."""
    pins: dict[Tensor, Placement] = {}
    for node in part.graph.nodes:
        t = node.outputs[0] if node.outputs else None
        if node.op.name == "parameter":
            pins[t] = Replicate()
        elif node.op.name == "input" and t.ndim and t.shape[0] >= n:
            pins[t] = Shard(0, even_sizes(t.shape[0], n))
    if _batch(part.graph) < n:
        raise GraphBuildError(
            f"parallelize: data parallelism over {n} devices needs a batch of at least {n} (axis 0 of the inputs, "
            f"or of the state for a graph fed by state); {part.graph.name!r} has {_batch(part.graph)}"
        )
    return pins


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


def _too_big(partition: Partition, memory: int) -> GraphBuildError:
    lines = []
    for r, g in enumerate(partition.graphs):
        biggest = sorted((t for t in [*g.parameters.values(), *g.states.values()]), key=lambda t: -t.nbytes)[:3]
        names = ", ".join(f"{t.name} {t.nbytes / 2**20:.0f} MiB" for t in biggest)
        lines.append(f"rank {r}: {partition.predicted.memory_bytes[r] / 2**30:.2f} GiB (largest: {names})")
    return GraphBuildError(
        f"parallelize: {partition.plan.label} needs more than memory_per_device = {memory / 2**30:.2f} GiB:\n  "
        + "\n  ".join(lines[:8])
        + "\n  give more devices, more memory, or a smaller model/cache (max_seq)"
    )

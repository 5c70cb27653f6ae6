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
step that fits ``memory_per_device``; one device (a partition of one rank, the program as it is) wins
unless a split is predicted faster. ``Partition.candidates`` holds the table it compared.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from megaloop.errors import GraphBuildError, PartitionMemoryError
from megaloop.frontend.graph import Graph
from megaloop.frontend.placement import OnDevice, Partial, Placement
from megaloop.frontend.tensor import Tensor
from megaloop.frontend.validate import as_int
from megaloop.parallel.cost import H200, Machine
from megaloop.parallel.mesh import Mesh, as_mesh
from megaloop.parallel.partition import Partition, Prediction
from megaloop.parallel.passes import Plan, batch_size, build, too_big
from megaloop.parallel.reshard import check_placement

STRATEGIES = ("auto", "tp", "pp", "dp", "device")
KINDS = ("tp", "pp", "dp", "device")


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
    if memory_per_device is not None:
        memory_per_device = as_int(memory_per_device, "parallelize: memory_per_device", minimum=1)
    if micro_batches is not None:
        micro_batches = as_int(micro_batches, "parallelize: micro_batches", minimum=1)
    pins = _pins(graph, layout)
    plans = _plans(graph, mesh, strategy, micro_batches)
    candidates: list[Candidate] = []
    best: Partition | None = None
    tiles: dict = {}
    alone = build(graph, Plan(Mesh((1,), ("tp",)), ("tp",)), {}, machine, None, tiles)
    if strategy == "auto" and mesh.size > 1 and not pins and not all(p.forced for p in plans):
        plans = [alone.plan, *plans]  # (a split must beat one device)
    for plan in plans:
        try:
            partition = alone if plan is alone.plan else build(graph, plan, pins, machine, memory_per_device, tiles)
            if memory_per_device is not None and max(partition.predicted.memory_bytes) > memory_per_device:
                raise PartitionMemoryError("does not fit memory_per_device")
        except GraphBuildError as e:
            if len(plans) == 1 and not isinstance(e, PartitionMemoryError):
                raise
            fit = isinstance(e, PartitionMemoryError)
            candidates.append(
                Candidate(plan, None, "does not fit memory_per_device" if fit else str(e).splitlines()[0])
            )
            continue
        candidates.append(Candidate(plan, partition.predicted))
        if best is None or partition.predicted.step_us < best.predicted.step_us:
            best = partition  # (ties keep the earlier: one device, then fewer pipeline stages)
    if best is None:
        unfit = [c.plan for c in candidates if c.error == "does not fit memory_per_device"][:4]
        if unfit:
            smallest = min((build(graph, p, pins, machine, None, tiles) for p in unfit), key=_peak)
            raise too_big(smallest, memory_per_device)
        reasons = "; ".join(f"{c.plan.label}: {c.error}" for c in candidates)
        raise GraphBuildError(f"parallelize: no way to split {graph.name!r} over {mesh}: {reasons}")
    best.candidates, best.one_device = candidates, alone.predicted
    if best.world_size == 1 and mesh.size > 1:
        splits = [c for c in candidates if c.predicted is not None and c.plan.mesh.size > 1]
        fastest = min(splits, key=lambda c: c.predicted.step_us, default=None)
        than = (
            f" (the fastest, {fastest.plan.label}, {fastest.predicted.step_us:.1f} us a step against "
            f"{best.predicted.step_us:.1f} us)"
            if fastest
            else ""
        )
        best.notes.append(f"no split over {mesh.size} devices is predicted faster than one device{than}")
    return best


def _peak(p: Partition) -> int:
    return max(p.predicted.memory_bytes)


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
        t = by_name[name]
        if isinstance(p, OnDevice):
            out[t] = p
            continue
        out[t] = check_placement(p, f"parallelize: layout[{name!r}]")
        if isinstance(p, Partial) and t.node.op.kind == "source":
            raise GraphBuildError(
                f"parallelize: layout[{name!r}] = {p}: a {t.node.op.name} is handed in whole or cut, never as "
                "partial sums (only an op makes those); pin the op's output instead"
            )
    return out


def _plans(graph: Graph, mesh: Mesh, strategy: Any, micro_batches: int | None) -> list[Plan]:
    if isinstance(strategy, Mapping):
        unknown = sorted(set(strategy) - set(mesh.names))
        if unknown:
            raise GraphBuildError(f"parallelize: strategy names axes {unknown}; the mesh's axes are {list(mesh.names)}")
        missing = [n for n in mesh.names if n not in strategy]
        if missing:
            raise GraphBuildError(
                f"parallelize: strategy gives no kind for mesh axis {missing[0]!r} (e.g. {missing[0]}='tp'); "
                f"give one for each of {list(mesh.names)}"
            )
        kinds = tuple(strategy[n] for n in mesh.names)
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
        if micro_batches is not None and micro_batches > batch_size(graph):
            raise GraphBuildError(
                f"parallelize: {micro_batches} micro-batches of a batch of {batch_size(graph)}; at most one a sequence"
            )
        return replace(plan, micro_batches=micro_batches or _micro_batches(graph, plan.size("pp")))
    if micro_batches not in (None, 1) and plan.forced:
        raise GraphBuildError(f"parallelize: micro_batches are for a pipeline; {plan.label} has no pp axis")
    return plan


def _micro_batches(graph: Graph, stages: int) -> int:
    """As many chains as stages, where the batch allows: each stage then has one to work on."""
    batch = batch_size(graph)
    return max(d for d in range(1, min(batch, stages) + 1) if batch % d == 0)


def _auto_plans(graph: Graph, mesh: Mesh, micro_batches: int | None) -> list[Plan]:
    out = []
    if len(mesh.shape) == 1:
        n = mesh.size
        batch = batch_size(graph)
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
    batch = batch_size(graph)
    for kinds in itertools.product(("tp", "pp", "dp"), repeat=len(mesh.shape)):
        if kinds.count("pp") > 1 or kinds.count("dp") > 1:
            continue
        if any(k == "dp" and s > batch for k, s in zip(kinds, mesh.shape)):
            continue  # (no batch to cut that far)
        try:
            out.append(_checked(graph, Plan(Mesh(mesh.shape, mesh.names), kinds), micro_batches))
        except GraphBuildError:
            continue  # (e.g. tp axes apart)
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]

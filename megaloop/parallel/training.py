"""``parallelize_training``: a single-device forward graph with a loss, split over ranks into each
rank's whole training step (forward, backward, gradient exchange, optimizer), the split chosen by the
cost model when not named.

The forward is split by ``parallelize`` (data, tensor, pipeline parallel, micro-batches); then on
each rank (megaloop.parallel.train_step): weights become states, ``grad`` adds the backward (the
collectives' and transfers' rules give the backward's exchanges), the gradients of pieces several
ranks hold are summed in buckets (all-reduce, or ZeRO's reduce-scatter and all-gather), the
optimizer is attached, and optionally a layer's forward is recomputed in its backward
(megaloop.parallel.recompute) and a pipeline's micro-batches run one forward, one backward
(megaloop.parallel.pipeline_order). Every choice is in ``TrainingOptions`` (no module state).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from megaloop.errors import GraphBuildError
from megaloop.frontend.graph import Graph
from megaloop.frontend.tensor import Tensor
from megaloop.frontend.validate import as_int
from megaloop.optim import OptimizerSpec
from megaloop.parallel import train_step as ts
from megaloop.parallel.cost import H200, Machine
from megaloop.parallel.mesh import Mesh
from megaloop.parallel.parallelize import parallelize
from megaloop.parallel.partition import Partition, Prediction
from megaloop.parallel.passes import Plan, build
from megaloop.parallel.pipeline_order import one_forward_one_backward
from megaloop.parallel.predict import predict_step
from megaloop.parallel.recompute import recompute_layers
from megaloop.parallel.train_split import Candidate, TrainingSplit, account, too_big

KINDS = ("pp", "dp", "zero1", "zero2", "tp")  # mesh axes outermost first: tp ranks are neighbours
_TOKEN = re.compile(r"^(pp|dp|zero1|zero2|tp)_?(\d*)$")  # "zero2_4": ZeRO-2 over 4


@dataclass(frozen=True)
class TrainingOptions:
    """Everything that shaped a split training step, serializable (``as_dict``)."""

    strategy: str  # e.g. "zero2", "pp2xtp2", "1 device"
    axes: tuple[tuple[str, int], ...]  # (kind, size) per mesh axis, outermost first
    micro_batches: int
    recompute: bool
    bucket_mb: float
    loss: str
    optimizer: OptimizerSpec

    @property
    def zero(self) -> int:
        return next((int(k[-1]) for k, _ in self.axes if k.startswith("zero")), 0)

    @property
    def world(self) -> int:
        out = 1
        for _, s in self.axes:
            out *= s
        return out

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["axes"] = [list(a) for a in self.axes]
        d["optimizer"] = self.optimizer.as_dict()
        return d


def parallelize_training(
    graph: Graph,
    loss: Tensor | str,
    optimizer: OptimizerSpec,
    *,
    devices: int = 1,
    strategy: str | None = None,
    micro_batches: int | None = None,
    recompute: bool = False,
    bucket_mb: float = 25.0,
    memory_per_device: int | None = None,
    machine: Machine | None = None,
) -> TrainingSplit:
    """Each rank's training step for ``graph`` (one device's forward: parameters, inputs, and the
    scalar ``loss``, a tensor of it or its output's name) over ``devices`` ranks.

    ``strategy``: None (the cost model picks among every split that fits ``memory_per_device``,
    default the machine's memory), "dp", "zero1", "zero2", "tp", "pp", or axes joined by "x" with
    sizes, e.g. "pp2xtp2", "dp2xtp2", "zero2_2xtp2" ("zero2" is the ZeRO stage, "_2" its size; sizes left out take
    what is left of ``devices``). ``micro_batches``: chains a pipeline cuts the batch into (default:
    one a stage), run one forward one backward. ``recompute``: recompute each layer's forward in its
    backward instead of keeping its activations. ``bucket_mb``: the gradient exchange's bucket size."""
    machine = machine or H200
    devices = as_int(devices, "parallelize_training: devices", minimum=1)
    if not isinstance(optimizer, OptimizerSpec):
        raise GraphBuildError(
            "parallelize_training: optimizer must be an ml.optim.OptimizerSpec (e.g. OptimizerSpec('adamw', lr=3e-4)), "
            f"got {optimizer!r:.80}"
        )
    loss_name = _loss_name(graph, loss)
    if micro_batches is not None:
        micro_batches = as_int(micro_batches, "parallelize_training: micro_batches", minimum=1)
    if not isinstance(bucket_mb, (int, float)) or not bucket_mb > 0:
        raise GraphBuildError(f"parallelize_training: bucket_mb must be a number > 0, got {bucket_mb!r}")
    limit = (
        machine.memory_bytes if memory_per_device is None else as_int(memory_per_device, "memory_per_device", minimum=1)
    )
    options = [
        TrainingOptions(
            _label(axes),
            axes,
            (micro_batches or 1) if strategy is not None or dict(axes).get("pp", 1) > 1 else 1,
            bool(recompute),
            float(bucket_mb),
            loss_name,
            optimizer,
        )
        for axes in _candidates(devices, strategy)
    ]
    built: list[tuple[TrainingOptions, TrainingSplit | None, str]] = []
    for opt in options:
        try:
            built.append((opt, build_split(graph, opt, machine), ""))
        except GraphBuildError as e:
            if strategy is not None:
                raise
            built.append((opt, None, str(e).splitlines()[0]))
    fits = [s for _, s, _ in built if s is not None and s.peak_bytes <= limit]
    candidates = [
        Candidate(
            s.options if s else o,
            s.predicted if s else None,
            s.peak_bytes if s else 0,
            err or ("" if s.peak_bytes <= limit else "does not fit"),
        )
        for o, s, err in built
    ]
    if not fits:
        made = [s for _, s, _ in built if s is not None]
        if not made:
            raise GraphBuildError(
                "parallelize_training: no split works: "
                + "; ".join(f"{c.options.strategy}: {c.error}" for c in candidates)
            )
        raise too_big(min(made, key=lambda s: s.peak_bytes), limit, explicit=strategy is not None)
    best = min(fits, key=lambda s: (s.predicted.step_us, s.peak_bytes))  # (ties: earlier, fewer bytes)
    best.candidates, best.memory_limit = candidates, limit
    return best


def build_split(graph: Graph, opt: TrainingOptions, machine: Machine) -> TrainingSplit:
    """The training split ``opt`` describes (no choosing)."""
    forward = _split_forward(graph, opt, machine)
    if forward.plan.micro_batches != opt.micro_batches:  # (a pipeline's default: one chain a stage)
        opt = replace(opt, micro_batches=forward.plan.micro_batches)
    notes: list[str] = []
    steps = [ts.RankStep(weights=ts.weights_to_states(part)) for part in forward.parts]
    holders: dict[ts.Piece, list[int]] = {}
    dtypes: dict[ts.Piece, Any] = {}
    for r, (part, step) in enumerate(zip(forward.parts, steps)):
        for name, piece in step.weights.items():
            holders.setdefault(piece, []).append(r)
            dtypes[piece] = part.graph.states[name].dtype
    groups = {p: tuple(sorted(set(rs))) for p, rs in holders.items()}
    for piece, rs in holders.items():
        if len(rs) != len(set(rs)):
            raise GraphBuildError(f"parallelize_training: a rank holds {piece.name} {piece.box} twice")
    loss_holders = sum(1 for part in forward.parts if any(o[0] == opt.loss for o in part.outputs.values()))
    grads = [ts.backward(part, opt.loss, loss_holders, step.weights) for part, step in zip(forward.parts, steps)]
    if opt.recompute:
        copied = [recompute_layers(part.graph) for part in forward.parts]
        notes.append(f"recompute: {max(copied)} forward nodes a rank run again in the backward (layers' activations)")
    order = _program_order(graph)
    decay = opt.optimizer.get("weight_decay", 0.0)
    buckets = ts.make_buckets(
        groups, order, dtypes, int(opt.bucket_mb * 2**20), opt.zero, decay if isinstance(decay, Mapping) else {}
    )
    for part, step, g in zip(forward.parts, steps, grads):
        params, pgrads, decay_of = ts.exchange(part.graph, step, g, buckets, opt.zero)
        ts.attach_optimizer(part.graph, step, opt.optimizer, params, pgrads, decay_of, groups, len(forward.parts))
        part.graph.output("train.lr", step.optimizer.lr)
        if step.optimizer.grad_norm is not None:
            part.graph.output("train.grad_norm", step.optimizer.grad_norm)
    if opt.micro_batches > 1 and dict(opt.axes).get("pp", 1) > 1:
        gates = one_forward_one_backward(forward, dict(opt.axes)["pp"])
        notes.append(
            f"1F1B: {gates} gates hold each stage's later micro-batches until an earlier one's backward is done"
            if gates
            else "1F1B gates would make the ranks wait on each other in a cycle: the planner's order (forward first)"
        )
    graphs = [p.graph for p in forward.parts]
    for g in graphs:
        g.validate()
    step_model = predict_step(graphs, machine)
    predicted = Prediction(step_model["step_us"], step_model["exchanged_bytes"], step_model["memory_bytes"], step_model)
    split = TrainingSplit(graph, forward, opt, steps, buckets, groups, predicted)
    split.notes = notes
    split.memory = [account(p.graph, s) for p, s in zip(forward.parts, steps)]
    return split


def _split_forward(graph: Graph, opt: TrainingOptions, machine: Machine) -> Partition:
    axes = [(("dp" if k.startswith("zero") else k), s) for k, s in opt.axes]
    pp = dict(axes).get("pp", 1)
    if opt.micro_batches > 1 and pp == 1:
        raise GraphBuildError(f"parallelize_training: micro_batches are for a pipeline; {opt.strategy} has no pp axis")
    if opt.world == 1:
        clone = _clone(graph)
        return build(clone, Plan(Mesh((1,), ("tp",)), ("tp",)), {}, machine, None)
    mesh = Mesh(tuple(s for _, s in axes), tuple(k for k, _ in axes))
    mb = opt.micro_batches if pp > 1 and opt.micro_batches > 1 else None
    return parallelize(graph, mesh, {k: k for k, _ in axes}, micro_batches=mb, machine=machine)


def split_axes(strategy: str, devices: int) -> tuple[tuple[str, int], ...]:
    """The mesh axes (kind, size), outermost first, that a named ``strategy`` gives over ``devices``;
    a strategy parallelize_training would refuse is refused here the same way."""
    return _candidates(as_int(devices, "parallelize_training: devices", minimum=1), strategy)[0]


def parse_strategy(strategy: str) -> list[tuple[str, int | None]]:
    """A named strategy's axes as (kind, size or None where left out), in the order given; an
    unknown kind or a kind named twice is refused."""
    if not isinstance(strategy, str):
        raise GraphBuildError(
            f"parallelize_training: strategy must be None or a string like 'pp2xtp2', got {strategy!r}"
        )
    parsed = []
    for tok in strategy.split("x"):
        m = _TOKEN.match(tok)
        if m is None:
            raise GraphBuildError(
                f"parallelize_training: strategy {strategy!r}: {tok!r} is not one of {list(KINDS)} with an optional "
                "size (e.g. 'dp', 'zero2', 'pp2xtp2')"
            )
        parsed.append((m.group(1), int(m.group(2)) if m.group(2) else None))
    kinds = [k for k, _ in parsed]
    if len(set(("dp" if k.startswith("zero") else k) for k in kinds)) != len(kinds):
        raise GraphBuildError(f"parallelize_training: strategy {strategy!r} names a kind twice")
    return parsed


def _candidates(devices: int, strategy: str | None) -> list[tuple[tuple[str, int], ...]]:
    if strategy is None:
        out = []
        divisors = [d for d in range(1, devices + 1) if devices % d == 0]
        for pp, dp in itertools.product(divisors, divisors):
            if devices % (pp * dp):
                continue
            tp = devices // (pp * dp)
            for dkind in ("dp", "zero1", "zero2") if dp > 1 else ("dp",):
                axes = tuple((k, s) for k, s in (("pp", pp), (dkind, dp), ("tp", tp)) if s > 1)
                out.append(axes)
        return out
    parsed = parse_strategy(strategy)
    known = 1
    for _, s in parsed:
        known *= s or 1
    missing = [k for k, s in parsed if s is None]
    if devices % known:
        raise GraphBuildError(
            f"parallelize_training: strategy {strategy!r} uses {known} devices (or a multiple), not {devices}"
        )
    if len(missing) > 1:
        raise GraphBuildError(
            f"parallelize_training: strategy {strategy!r} over {devices} devices: give the sizes (e.g. 'pp2xtp2')"
        )
    sizes = [(k, s if s is not None else devices // known) for k, s in parsed]
    total = 1
    for _, s in sizes:
        total *= s
    if total != devices:
        raise GraphBuildError(f"parallelize_training: strategy {strategy!r} uses {total} devices, not {devices}")
    rank_of = {k: i for i, k in enumerate(KINDS)}
    return [tuple(sorted(((k, s) for k, s in sizes if s > 1), key=lambda a: rank_of[a[0]]))]


def _label(axes: tuple[tuple[str, int], ...]) -> str:
    return "x".join(f"{k}_{s}" if k.startswith("zero") else f"{k}{s}" for k, s in axes) or "1 device"


def _loss_name(graph: Graph, loss: Tensor | str) -> str:
    if not isinstance(graph, Graph):
        raise GraphBuildError(f"parallelize_training: expected a megaloop.Graph, got {type(graph).__name__}")
    if isinstance(loss, str):
        if loss not in graph.outputs:
            raise GraphBuildError(
                f"parallelize_training: graph {graph.name!r} has no output {loss!r} "
                f"(its outputs: {sorted(graph.outputs)})"
            )
        t = graph.outputs[loss]
    elif isinstance(loss, Tensor) and loss.graph is graph:
        names = [n for n, t in graph.outputs.items() if t is loss]
        if not names:
            raise GraphBuildError("parallelize_training: name the loss a graph output (graph.output('loss', loss))")
        t, loss = loss, names[0]
    else:
        raise GraphBuildError(f"parallelize_training: loss must be a tensor of {graph.name!r} or its output's name")
    if t.size != 1 or not t.dtype.is_float:
        raise GraphBuildError(
            f"parallelize_training: the loss {t!r} must be one float value (e.g. ml.cross_entropy's mean)"
        )
    return loss


def _program_order(graph: Graph) -> dict[str, int]:
    """Each parameter's first reader's position in the program."""
    out: dict[str, int] = {}
    for i, node in enumerate(graph.nodes):
        for t in node.inputs:
            if t.base.node.op.name == "parameter":
                out.setdefault(t.base.node.attrs["name"], i)
    for name in graph.parameters:
        out.setdefault(name, len(graph.nodes))
    return out


def _clone(graph: Graph) -> Graph:
    """A copy of ``graph`` (the one-device split changes its graph in place)."""
    g = Graph(graph.name, rank=graph.rank, world_size=graph.world_size)
    made: dict[Tensor, Tensor] = {}
    for node in graph.nodes:
        t = node.outputs[0] if node.outputs else None
        kind = node.op.name
        if node.op.kind == "source":
            name = node.attrs["name"]
            if kind == "input":
                made[t] = g.input(name, t.shape, t.dtype)
            elif kind == "parameter":
                made[t] = g.parameter(name, t.shape, t.dtype)
            elif kind == "state":
                made[t] = g.state(name, t.shape, t.dtype, node.attrs.get("init"))
            else:
                made[t] = g.constant(node.attrs["value"], t.dtype, name=name, allow_nonfinite=True)
            continue
        scope = g.scope(node.scope) if node.scope else _nothing()
        with scope:
            outs = g.apply(node.op, [made[x] for x in node.inputs], dict(node.attrs))
        made.update(zip(node.outputs, outs))
    for name, v in graph.state_updates.items():
        g.state_updates[name] = made[v]
    for name, v in graph.outputs.items():
        g.outputs[name] = made[v]
    return g


def _nothing() -> Any:
    import contextlib

    return contextlib.nullcontext()

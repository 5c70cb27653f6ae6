"""One step of partitioning: a graph (a ``Part``) split over a group of members, each node run the way
its chosen ``Strategy`` says, conversions inserted where an operand's placement is not the one its
consumer needs. The members are ranks (one graph each, collectives between them) or micro-batches (one
graph for all of them, plain ops between them).

Every part remembers where it came from: which node of the original single-device graph each of its
nodes stands for (``origin``), which piece of which original source each of its sources holds, and
which piece of each original output each of its outputs is (boxes in the original's coordinates), so
that parameters, inputs and state are handed to the ranks, and outputs gathered, without the user
slicing anything by hand.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from megaloop.errors import GraphBuildError, InternalError
from megaloop.frontend.graph import Graph, Node
from megaloop.frontend.placement import REPLICATE, LocalCall, Partial, Placement, Replicate, Shard, Strategy, bounds
from megaloop.frontend.tensor import Tensor
from megaloop.parallel.reshard import Combine, conversion

Box = tuple[tuple[int, int], ...]
SOURCE_KINDS = ("input", "parameter", "constant", "state")


@dataclass(frozen=True)
class SourceInfo:
    kind: str  # input, parameter, constant, state
    name: str  # its name in the original graph
    box: Box  # the piece it holds, in the original tensor's coordinates


@dataclass
class Part:
    """A graph of one rank (or of a whole program, before it is split) and its map to the original."""

    graph: Graph
    sources: dict[Node, SourceInfo] = field(default_factory=dict)
    outputs: dict[str, tuple[str, Box]] = field(default_factory=dict)  # name -> (original name, piece)
    origin: dict[Node, Node] = field(default_factory=dict)
    # the conversions made for it: (original producer, step kind, from, to, original consumer or None)
    exchanges: list[tuple[Node, str, Placement, Placement, Node | None]] = field(default_factory=list)

    @staticmethod
    def whole(graph: Graph) -> Part:
        part = Part(graph)
        for node in graph.nodes:
            part.origin[node] = node
            if node.op.kind == "source":
                part.sources[node] = SourceInfo(node.op.name, node.attrs["name"], _full(node.outputs[0].shape))
        part.outputs = {name: (name, _full(t.shape)) for name, t in graph.outputs.items()}
        return part


def _full(shape: Sequence[int]) -> Box:
    return tuple((0, s) for s in shape)


@dataclass
class Choice:
    """How a part is split: a strategy per node, and the placement of the sources that have one fixed
    (pinned by the user): those are made so first, and other placements of them are converted."""

    strategies: dict[Node, Strategy]
    fixed: dict[Tensor, Placement] = field(default_factory=dict)


class _Collectives:
    """What a member's builder may call to combine values across its group."""

    def __init__(self, sharder: _Sharder, member: int) -> None:
        self.sharder, self.member = sharder, member

    def all_gather(self, x: Tensor, axis: int) -> Tensor:
        return _ops().all_gather(x, axis, group=self.sharder.ranks)

    def all_reduce(self, x: Tensor, op: str = "sum") -> Tensor:
        return _ops().all_reduce(x, op, group=self.sharder.ranks)

    def outer(self, call: LocalCall) -> tuple[Tensor, ...]:
        """A collective or transfer of the part, issued by this member with the same member of every
        rank it names."""
        node, attrs = call.node, call.attrs()
        remap = self.sharder.remap
        if "group" in attrs:
            attrs["group"] = tuple(sorted(remap(r, self.member) for r in node.attrs["group"]))
        for key in ("src", "dst"):
            if key in attrs:
                attrs[key] = remap(attrs[key], self.member)
        if node.op.name == "recv":
            return call.graph.apply(node.op, [], attrs)
        return call.graph.apply(node.op, call.operands, attrs)


class _Sharder:
    def __init__(
        self,
        part: Part,
        members: int,
        ranks: Sequence[int] | None,
        world_size: int,
        remap: Callable[[int, int], int],
        choice: Choice,
    ) -> None:
        self.part, self.n, self.choice, self.remap = part, members, choice, remap
        g = part.graph
        if ranks is None:  # micro-batches: one graph
            shared = Graph(g.name, rank=g.rank, world_size=g.world_size)
            self.graphs = [shared] * members
        else:
            self.graphs = [Graph(g.name, rank=r, world_size=world_size) for r in ranks]
        self.ranks = None if ranks is None else tuple(sorted(ranks))
        self.combine = Combine(self.graphs, None if ranks is None else list(ranks))
        self.parts = [Part(x) for x in self.graphs] if ranks is not None else [Part(self.graphs[0])]
        self.have: dict[Tensor, dict[Placement, list[Tensor]]] = {}
        self.home: dict[Tensor, Placement] = {}  # states: the placement their storage has
        self.taken = {n.attrs["name"] for n in g.nodes if n.op.kind == "source" and n.op.name != "constant"}

    # ---- sources ----------------------------------------------------------------------------------
    def _part_of(self, member: int) -> Part:
        return self.parts[member if len(self.parts) > 1 else 0]

    def _source(self, t: Tensor, p: Placement) -> list[Tensor]:
        """The members' pieces of a source of the part, in placement ``p`` (made now). Members sharing a
        graph share a whole piece (a state excepted: each chain updates its own). A Partial source (only
        tests ask for one) is the value on member 0 and zeros (maxima: the value) on the others."""
        node = t.node
        kind = node.op.name
        info = self.part.sources.get(node) or SourceInfo(kind, node.attrs["name"], _full(t.shape))  # (made by a pass)
        pieces: list[Tensor] = []
        for i, g in enumerate(self.graphs):
            if pieces and self.ranks is None and not isinstance(p, Shard) and kind != "state":
                pieces.append(pieces[0])
                continue
            if i and isinstance(p, Partial) and p.op == "sum":
                zero = g.constant(0 if t.dtype.is_int else 0.0, t.dtype)
                pieces.append(_ops().broadcast_to(_ops().reshape(zero, (1,) * t.ndim), t.shape) if t.ndim else zero)
                continue
            rng = _range(p, i)
            box = _sub_box(info.box, rng)
            name = self._name(i, kind, node.attrs["name"])
            shape = tuple(hi - lo for lo, hi in _sub_box(_full(t.shape), rng))
            if kind == "input":
                x = g.input(name, shape, t.dtype)
            elif kind == "parameter":
                x = g.parameter(name, shape, t.dtype)
            elif kind == "state":
                init = node.attrs.get("init")
                x = g.state(name, shape, t.dtype, None if init is None else init[_slices(rng, t.ndim)])
            else:
                x = g.constant(node.attrs["value"][_slices(rng, t.ndim)], t.dtype, name=name, allow_nonfinite=True)
            self._part_of(i).sources[x.node] = SourceInfo(kind, info.name, box)
            self._part_of(i).origin[x.node] = self.part.origin[node]
            pieces.append(x)
        return pieces

    def _name(self, member: int, kind: str, name: str) -> str:
        """The source's name, or ``name@k`` for another piece of it on one graph (a name the program does
        not use already)."""
        g = self.graphs[member]
        table = {"input": g.inputs, "parameter": g.parameters, "state": g.states}.get(kind)
        taken = (self.taken - {name}) | (set(table) if table is not None else set())
        if name not in taken:
            return name
        k = 1
        while f"{name}@{k}" in taken:
            k += 1
        return f"{name}@{k}"

    # ---- placements -----------------------------------------------------------------------------
    def get(self, t: Tensor, p: Placement, consumer: Node | None = None) -> list[Tensor]:
        have = self.have.setdefault(t, {})
        if p in have:
            return have[p]
        if t.node.op.kind == "source" and t not in self.home:  # free: make this piece of it now
            pieces = self._source(t, p)
            if t.node.op.name in ("state", "parameter"):  # stored once: other pieces come from this one
                self.home[t] = p
            have[p] = pieces
            return pieces
        steps = conversion(have, p, t.shape)
        if steps is None:
            raise InternalError(
                f"partition: {t.node.op.name} {t.node.name} is {', '.join(map(str, have)) or 'not made'}; "
                f"it cannot become {p}"
            )
        start = steps[0].source if steps else p
        before = [len(g.nodes) for g in self.graphs]
        with self._scope(t.node):
            pieces = self.combine.run(steps, have[start])
        for i, g in enumerate(self.graphs):  # the conversion's nodes stand for the value's producer
            for new in g.nodes[before[i] :]:
                self._part_of(i).origin.setdefault(new, self.part.origin[t.node])
        made_for = None if consumer is None else self.part.origin.get(consumer)
        for step in steps:
            if step.kind != "slice":
                self.parts[0].exchanges.append(
                    (self.part.origin[t.node], step.kind, step.source, step.target, made_for)
                )
        have[p] = pieces
        return pieces

    def _scope(self, node: Node) -> Any:
        import contextlib

        stack = contextlib.ExitStack()
        if node.scope:
            for g in dict.fromkeys(self.graphs):
                stack.enter_context(g.scope(node.scope))
        return stack

    # ---- nodes ------------------------------------------------------------------------------------
    def node(self, node: Node) -> None:
        strategy = self.choice.strategies[node]
        operands = [self.get(t, p, node) for t, p in zip(node.inputs, strategy.inputs)]
        if node.op.inplace_operand is not None:
            cache = node.inputs[node.op.inplace_operand]
            if self.home.get(cache) != strategy.inputs[node.op.inplace_operand]:
                raise InternalError(f"partition: {node.name} updates {cache.name} in place in another placement")
        outs: list[tuple[Tensor, ...]] = []
        with self._scope(node):
            for i, g in enumerate(self.graphs):
                before = len(g.nodes)
                call = LocalCall(g, node, [o[i] for o in operands], i, self.n, strategy, _Collectives(self, i))
                made = strategy.build(call) if strategy.build else call.default()
                made = made if isinstance(made, tuple) else (made,)
                if len(made) != len(node.outputs):
                    raise InternalError(
                        f"partition: {node.name}'s strategy {strategy.label!r} built {len(made)} outputs"
                    )
                for new in g.nodes[before:]:
                    self._part_of(i).origin.setdefault(new, self.part.origin[node])
                outs.append(made)
        for k, t in enumerate(node.outputs):
            p = strategy.outputs[k]
            self.have.setdefault(t, {})[p] = [o[k] for o in outs]
            if node.op.inplace_operand is not None and k == 0:
                self.home[t] = p

    def finish(self) -> list[Part]:
        g = self.part.graph
        for name, value in g.state_updates.items():
            state = g.states[name]
            home = self.home.get(state)
            if home is None:  # a state nothing reads: keep it whole
                self.get(state, REPLICATE)
                home = REPLICATE
            pieces = self.get(value, home)
            locals_ = self.have[state][home]
            for i, (target, piece) in enumerate(zip(locals_, pieces)):
                if piece is not target:
                    self.graphs[i].assign(target, piece)
        for name, t in g.outputs.items():
            p = _whole_or_pieces(self.have.get(t, {})) or REPLICATE
            if t.node.op.kind == "source" and t not in self.have:
                p = REPLICATE
            pieces = self.get(t, p)
            for i, x in enumerate(pieces):
                out_name = name if len(self.parts) > 1 else f"{name}@{i}" if self.n > 1 else name
                self.graphs[i].output(out_name, x)
                original, box = self.part.outputs[name]
                self._part_of(i).outputs[out_name] = (original, _sub_box(box, _range(p, i)))
        return self.parts


def _whole_or_pieces(have: Mapping[Placement, Any]) -> Placement | None:
    for p in have:
        if isinstance(p, Replicate):
            return p
    for p in have:
        if isinstance(p, Shard):
            return p
    return None


def _range(p: Placement, member: int) -> tuple[int, int, int] | None:
    if not isinstance(p, Shard):
        return None
    lo, hi = bounds(p.sizes)[member]
    return p.axis, lo, hi


def _sub_box(box: Box, rng: tuple[int, int, int] | None) -> Box:
    if rng is None:
        return box
    axis, lo, hi = rng
    start = box[axis][0]
    return (*box[:axis], (start + lo, start + hi), *box[axis + 1 :])


def _slices(rng: tuple[int, int, int] | None, ndim: int) -> tuple[slice, ...]:
    out = [slice(None)] * ndim
    if rng is not None:
        out[rng[0]] = slice(rng[1], rng[2])
    return tuple(out)


def shard(
    part: Part,
    members: int,
    choice: Choice,
    *,
    ranks: Sequence[int] | None,
    world_size: int,
    remap: Callable[[int, int], int] | None = None,
) -> list[Part]:
    """Split ``part`` over ``members`` as ``choice`` says. ``ranks``: the members' ranks (in a world of
    ``world_size``), or None for micro-batches that share one graph; ``remap(rank, member)``: the rank
    of member ``member`` of the part that was rank ``rank`` (collectives already in the part)."""
    sharder = _Sharder(part, members, ranks, world_size, remap or (lambda r, m: r), choice)
    for t, p in choice.fixed.items():
        sharder.have.setdefault(t, {})[p] = sharder._source(t, p)
        sharder.home[t] = p
    for node in part.graph.nodes:
        if node.op.kind != "source":
            sharder.node(node)
    return sharder.finish()


def _ops() -> Any:
    from megaloop.frontend import ops

    return ops


def check_choice(part: Part, choice: Choice) -> None:
    for node in part.graph.nodes:
        if node.op.kind != "source" and node not in choice.strategies:
            raise GraphBuildError(f"partition: no strategy chosen for {node.op.name} {node.name}")

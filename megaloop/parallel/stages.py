"""Pipeline and device parallelism: each node of a part runs on one stage (a device, or a group of
them), and what one stage makes and another reads crosses as a send/recv inside the loop kernels.

``split`` takes the parts of one group (say the tensor-parallel ranks of a program) and a stage for
every original node, and gives each stage its copy of every member: stage s's member r becomes rank
``s * stride + r`` (so tensors cross between the same member of two stages, in whatever placement
they have). Sources go to every stage that reads them (parameters and inputs are handed in there).
Small values that depend only on sources, such as a position counter's ``position + 1``, are worked
out again on every stage that needs them rather than sent; a state whose next value is such a value
(the generator's position) then lives on each of those stages. Any other state lives on the stage
that updates it in place, or first reads it; its next value is sent there.

``pipeline_stages`` cuts a program's order into contiguous stages of about equal time (what crosses
a cut priced in), between a model's layers, each within the memory a device has; ``device_stages``
places independent branches on different devices (list scheduling on the cost model: each node
where it would finish first).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from megaloop.errors import GraphBuildError, PartitionMemoryError
from megaloop.frontend.graph import Graph, Node
from megaloop.frontend.tensor import Tensor
from megaloop.parallel.shard import Part

SMALL = 4096  # bytes: values up to this size that depend only on sources are recomputed, not sent


def _recomputable(part: Part) -> set[Node]:
    """Nodes cheap to run again on every stage that reads them: views and small elementwise values
    whose operands are sources or such nodes."""
    out: set[Node] = set()
    for node in part.graph.nodes:
        if node.op.kind == "source" or node.op.inplace_operand is not None:
            continue
        small = node.op.kind == "view" or (
            node.op.category == "elementwise" and all(t.nbytes <= SMALL for t in node.outputs)
        )
        if small and all(t.node.op.kind == "source" or t.node in out for t in node.inputs):
            out.add(node)
    return out


class _Splitter:
    def __init__(self, part: Part, stage_of: Mapping[Node, int], stages: int, rank: Callable[[int], int], world: int):
        self.part, self.stages, self.rank = part, stages, rank
        g = part.graph
        self.graphs = [Graph(g.name, rank=rank(s), world_size=world) for s in range(stages)]
        self.parts = [Part(x) for x in self.graphs]
        self.local: dict[tuple[int, Tensor], Tensor] = {}
        self.tags: dict[tuple[int, int], int] = {}
        self.redo = _recomputable(part)
        self.stage_of = stage_of
        self.node_stage = {n: stage_of[part.origin[n]] for n in g.nodes if n.op.kind != "source" and n not in self.redo}

    def get(self, t: Tensor, s: int) -> Tensor:
        found = self.local.get((s, t))
        if found is not None:
            return found
        node = t.node
        if node.op.kind == "source" and (node.op.name != "state" or self._everywhere(t)):
            self._copy_source(node, s)
        elif node in self.redo:
            self._copy(node, s)
        elif node.op.kind == "source":  # a state read away from its home: its value this iteration, sent
            self._transfer(t, self.home[t], s)
        else:
            self._transfer(t, self.node_stage[node], s)
        return self.local[(s, t)]

    def _everywhere(self, state: Tensor) -> bool:
        """A state whose next value every stage can work out itself: each stage keeps its own."""
        value = self.part.graph.state_updates.get(state.node.attrs["name"])
        return value is not None and value.node in self.redo

    def _copy_source(self, node: Node, s: int) -> None:
        g, t = self.graphs[s], node.outputs[0]
        kind, name = node.op.name, node.attrs["name"]
        if kind == "input":
            x = g.input(name, t.shape, t.dtype)
        elif kind == "parameter":
            x = g.parameter(name, t.shape, t.dtype)
        elif kind == "state":
            x = g.state(name, t.shape, t.dtype, node.attrs.get("init"))
        else:
            x = g.constant(node.attrs["value"], t.dtype, name=name, allow_nonfinite=True)
        if node in self.part.sources:  # (not a constant a pass made)
            self.parts[s].sources[x.node] = self.part.sources[node]
        self.parts[s].origin[x.node] = self.part.origin.get(node, node)
        self.local[(s, t)] = x

    def _transfer(self, t: Tensor, src: int, dst: int) -> None:
        x = self.get(t, src)
        key = (src, dst)
        tag = self.tags[key] = self.tags.get(key, -1) + 1
        with _scope(self.graphs[src], t.node), _scope(self.graphs[dst], t.node):
            _ops().send(x, self.rank(dst), tag=tag)
            self.local[(dst, t)] = _ops().recv(self.graphs[dst], self.rank(src), t.shape, t.dtype, tag=tag)
        for s in (src, dst):
            self.parts[s].origin[self.graphs[s].nodes[-1]] = self.part.origin[t.node]

    def _copy(self, node: Node, s: int) -> None:
        g = self.graphs[s]
        operands = [self.get(t, s) for t in node.inputs]
        attrs = dict(node.attrs)
        if "group" in attrs:
            attrs["group"] = tuple(self.rank_in_stage(r, s) for r in attrs["group"])
        before = len(g.nodes)
        with _scope(g, node):
            outs = g.apply(node.op, operands, attrs)
        for n in g.nodes[before:]:
            self.parts[s].origin[n] = self.part.origin[node]
        for t, x in zip(node.outputs, outs):
            self.local[(s, t)] = x

    def rank_in_stage(self, r: int, s: int) -> int:
        return self.rank(s) - self.rank(0) + r

    def run(self) -> list[Part]:
        g = self.part.graph
        self.home = self._state_homes()
        for node in g.nodes:
            if node.op.kind == "source" or node in self.redo:
                continue
            self._copy(node, self.node_stage[node])
        for name, value in g.state_updates.items():
            state = g.states[name]
            for s in self._state_stages(state):
                local_state = self.get(state, s) if (s, state) not in self.local else self.local[(s, state)]
                v = self.get(value, s)
                if v is not local_state:
                    self.graphs[s].assign(local_state, v)
        for name, t in g.outputs.items():
            s = self.node_stage.get(t.node, 0) if t.node.op.kind != "source" else 0
            self.graphs[s].output(name, self.get(t, s))
            self.parts[s].outputs[name] = self.part.outputs[name]
        return self.parts

    def _state_homes(self) -> dict[Tensor, int]:
        """Each state's stage: where an op updates it in place, else where it is first read."""
        g = self.part.graph
        homes: dict[Tensor, int] = {}
        readers: dict[Tensor, list[int]] = {}
        for node in g.nodes:
            if node.op.kind == "source" or node in self.redo:
                continue
            for i, t in enumerate(node.inputs):
                if t.node.op.name == "state":
                    readers.setdefault(t, []).append(self.node_stage[node])
                    if i == node.op.inplace_operand:
                        homes[t] = self.node_stage[node]
        for t, stages in readers.items():
            homes.setdefault(t, stages[0])
        for t in g.states.values():
            homes.setdefault(t, 0)
        for t, s in homes.items():
            if not self._everywhere(t):
                self._copy_source(t.node, s)
        return homes

    def _state_stages(self, state: Tensor) -> list[int]:
        """A state whose next value is recomputable lives on every stage that reads it."""
        if self._everywhere(state):
            return sorted({s for (s, t) in self.local if t is state}) or [self.home[state]]
        return [self.home[state]]


def _scope(g: Graph, node: Node) -> Any:
    import contextlib

    return g.scope(node.scope) if node.scope else contextlib.nullcontext()


def _ops() -> Any:
    from megaloop.frontend import ops

    return ops


def split(
    parts: Sequence[Part], stage_of: Mapping[Node, int], stages: int, stride: int, world: int
) -> list[list[Part]]:
    """Parts per stage: ``out[s][r]`` is member r of ``parts`` on stage s, rank ``s * stride + r``
    (``parts[r]``'s rank). ``stage_of`` maps every node of the original graph to its stage."""
    out: list[list[Part]] = [[None] * len(parts) for _ in range(stages)]  # type: ignore[list-item]
    for r, part in enumerate(parts):
        base = part.graph.rank
        splitter = _Splitter(part, stage_of, stages, lambda s, b=base: s * stride + b, world)
        for s, p in enumerate(splitter.run()):
            out[s][r] = p
    return out


# ---- choosing the stages ----------------------------------------------------------------------------


def pipeline_stages(
    original: Graph,
    cost: Mapping[Node, float],
    stages: int,
    link_us: Callable[[int], float],
    held: Mapping[Node, Mapping[Any, int]] | None = None,
    memory: int | None = None,
) -> dict[Node, int]:
    """Contiguous stages of the original's order with the least time of the slowest stage (its nodes'
    cost plus receiving what crosses the cut before it), cut between a model's layers where there are
    enough of them. ``held``: per node, the bytes of each stored value it reads (parameters, states:
    a stage holds each value any of its nodes reads once); ``memory``: the most a stage may hold."""
    nodes = [n for n in original.nodes if n.op.kind != "source"]
    if stages > len(nodes):
        raise GraphBuildError(f"partition: {stages} pipeline stages for a program of {len(nodes)} ops")
    prefix = [0.0]
    for n in nodes:
        prefix.append(prefix[-1] + cost.get(n, 0.0))
    crossing = _crossing_bytes(original, nodes)
    layer = _layers(nodes)
    cuts = [i for i in range(1, len(nodes)) if layer[i - 1] != layer[i]]  # between a model's layers
    if len(cuts) < stages - 1:
        cuts = list(range(1, len(nodes)))
    points = [0, *cuts, len(nodes)]
    fits = _fits(nodes, points, held, memory) if memory is not None and held else None
    best = _cut_dp(points, prefix, crossing, stages, link_us, fits)
    stage_of = {}
    for s, (lo, hi) in enumerate(itertools.pairwise(best)):
        for n in nodes[lo:hi]:
            stage_of[n] = s
    for n in original.nodes:
        stage_of.setdefault(n, 0)
    return stage_of


def _fits(
    nodes: list[Node], points: list[int], held: Mapping[Node, Mapping[Any, int]], memory: int
) -> Callable[[int, int], bool]:
    """Whether the stage of nodes[points[i]:points[j]] holds at most ``memory`` bytes of stored values
    (each value once, however many of its nodes read it)."""
    rows: dict[int, list[int]] = {}

    def row(i: int) -> list[int]:  # the bytes held from points[i] to each later point
        seen: set[Any] = set()
        total, out = 0, [0] * len(points)
        for j in range(i + 1, len(points)):
            for n in nodes[points[j - 1] : points[j]]:
                for value, nbytes in held.get(n, {}).items():
                    if value not in seen:
                        seen.add(value)
                        total += nbytes
            out[j] = total
        return out

    def fits(i: int, j: int) -> bool:
        if i not in rows:
            rows[i] = row(i)
        return rows[i][j] <= memory

    return fits


def _layers(nodes: list[Node]) -> list[str]:
    """Each node's layer: the first two parts of its scope ("layers.3"); a residual add belongs to what
    follows it (a layer's input is the previous one's output plus its update, summed as it starts)."""
    out = [".".join(n.scope.split(".")[:2]) for n in nodes]
    for i in range(len(nodes) - 2, -1, -1):
        if nodes[i].op.name == "add":
            out[i] = out[i + 1]
    return out


def _crossing_bytes(g: Graph, nodes: list[Node]) -> list[int]:
    """Bytes of computed values made before position i and read at or after it."""
    pos = {n: i for i, n in enumerate(nodes)}
    last: dict[Tensor, int] = {}
    for n in nodes:
        for t in n.inputs:
            if t.node.op.kind != "source":
                last[t] = max(last.get(t, 0), pos[n])
    delta = [0] * (len(nodes) + 1)
    for t, end in last.items():
        start = pos[t.node] + 1
        if end >= start:
            delta[start] += t.nbytes
            delta[end + 1] -= t.nbytes
    out, run = [], 0
    for d in delta:
        run += d
        out.append(run)
    return out


def _cut_dp(
    points: list[int],
    prefix: list[float],
    crossing: list[int],
    stages: int,
    link_us: Callable[[int], float],
    fits: Callable[[int, int], bool] | None = None,
) -> list[int]:
    """The cut points (indices into the order) that minimise the slowest stage's time, each stage
    within memory where ``fits`` says."""
    inf = float("inf")
    k = len(points)
    best = [[inf] * k for _ in range(stages + 1)]
    back = [[-1] * k for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for j in range(1, k):
            for i in range(j):
                if best[s - 1][i] == inf or (fits is not None and not fits(i, j)):
                    continue
                seg = prefix[points[j]] - prefix[points[i]] + (link_us(crossing[points[i]]) if i else 0.0)
                value = max(best[s - 1][i], seg)
                if value < best[s][j]:
                    best[s][j], back[s][j] = value, i
    if best[stages][k - 1] == inf:
        raise (
            GraphBuildError(f"partition: the program cannot be cut into {stages} pipeline stages")
            if fits is None
            else PartitionMemoryError(f"partition: no cut into {stages} pipeline stages fits memory_per_device")
        )
    out, j = [], k - 1
    for s in range(stages, 0, -1):
        out.append(points[j])
        j = back[s][j]
    out.append(0)
    return out[::-1]


def device_stages(
    original: Graph,
    cost: Mapping[Node, float],
    devices: int,
    link_us: Callable[[int], float],
    fixed: Mapping[Node, int] | None = None,
) -> dict[Node, int]:
    """Each node on the device where it would finish first (list scheduling in program order), views
    and small values with the device of what they read; ``fixed`` nodes on the device given."""
    fixed = fixed or {}
    free = [0.0] * devices
    finish: dict[Node, float] = {}
    stage_of: dict[Node, int] = {}
    for n in original.nodes:
        if n.op.kind == "source":
            continue
        producers = [t.node for t in n.inputs if t.node.op.kind != "source"]
        if n not in fixed and (n.op.kind == "view" or cost.get(n, 0.0) == 0.0):
            stage_of[n] = stage_of[producers[0]] if producers else 0
            finish[n] = max((finish[p] for p in producers), default=0.0)
            continue
        options = []
        for d in [fixed[n]] if n in fixed else range(devices):
            ready = max(
                (
                    finish[p] + (0.0 if stage_of[p] == d else link_us(t.nbytes))
                    for t in n.inputs
                    if (p := t.node).op.kind != "source"
                ),
                default=0.0,
            )
            options.append((max(ready, free[d]) + cost.get(n, 0.0), d))
        end, d = min(options)
        stage_of[n], finish[n], free[d] = d, end, end
    for n in original.nodes:
        stage_of.setdefault(n, 0)
    return stage_of

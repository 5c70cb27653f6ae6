"""``fuse``: a graph rewritten by the fusion rules (megaloop/fuse/rules/), and the ``Rewriter`` through
which a rule changes the graph.

The rules run in their order (``megaloop.fuse.rule.ordered_rules``), each once over the nodes, on a
copy of the graph: the caller's graph never changes. A rule builds its fused op with the public
builders (``megaloop.frontend.ops``) at the place of the node it replaces, so that the fused graph
lists its ops in the order a hand-fused builder would; then it rewires the users of the values it
replaces; nodes of the pattern left without users are dropped. At the end the nodes are put in that
order and every node is checked again by its op's rules (``Graph.reorder``).

While rules run, a view whose operand was replaced still names the old storage as its base (the end
re-derives layouts): rules follow node operands (``Node.inputs``), not ``Tensor.base``.
"""

from __future__ import annotations

import contextlib
import heapq
from collections.abc import Iterator

from megaloop.errors import GraphBuildError
from megaloop.frontend.graph import Graph, Node
from megaloop.frontend.tensor import Tensor
from megaloop.fuse.options import FuseOptions
from megaloop.fuse.rule import ordered_rules

SOURCE_TABLES = ("input", "parameter", "state")


def fuse(graph: Graph, options: FuseOptions | None = None) -> Graph:
    """``graph`` with the rewrites of ``options`` (default: all of them) made: a new graph, or
    ``graph`` itself when no rule applies. Inputs, parameters, states and outputs keep their names."""
    options = FuseOptions() if options is None else options
    if not isinstance(options, FuseOptions):
        raise GraphBuildError(f"fuse: options must be a megaloop.FuseOptions, got {type(options).__name__}")
    if not isinstance(graph, Graph):
        raise GraphBuildError(f"fuse: expected a megaloop.Graph, got {type(graph).__name__}")
    options.check(GraphBuildError, "fuse: options")
    rules = [r for r in ordered_rules() if options.applies(r.name)]
    if not rules:
        return graph
    work = copy_graph(graph)
    rw = Rewriter(work)
    for rule in rules:
        for node in list(work.nodes):
            if node.op.name in rule.roots and rw.alive(node) and rule.fire(node, rw):
                rw.changed = True
                rw.sweep()
    if not rw.changed:
        return graph
    rw.finish()
    return work


def copy_graph(graph: Graph) -> Graph:
    """A new graph with the same nodes (scopes, labels, attributes), sources, outputs and state updates."""
    new = Graph(graph.name, rank=graph.rank, world_size=graph.world_size)
    twin: dict[Tensor, Tensor] = {}
    tables = {"input": new.inputs, "parameter": new.parameters, "state": new.states}
    for node in graph.topological_order():
        outs = new.apply(node.op, [twin[t] for t in node.inputs], dict(node.attrs))
        made = new.nodes[-1]
        made.scope, made.label = node.scope, node.label
        twin.update(zip(node.outputs, outs))
        if node.op.name in SOURCE_TABLES:
            tables[node.op.name][node.attrs["name"]] = outs[0]
        elif node.op.name == "constant":
            new.constants.append(outs[0])
    new.outputs.update({name: twin[t] for name, t in graph.outputs.items()})
    new.state_updates.update({name: twin[t] for name, t in graph.state_updates.items()})
    return new


class Rewriter:
    """The graph under rewrite: who reads each value, where each node goes, which nodes are gone."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.changed = False
        self.key: dict[Node, tuple[int, ...]] = {n: (i,) for i, n in enumerate(graph.nodes)}
        self._users: dict[Tensor, list[Node]] = graph.users()
        self._dead: set[Node] = set()
        self._maybe_dead: list[Node] = []
        self._names = {n.name for n in graph.nodes}
        self._state_order = list(graph.state_updates)

    # ---- looking -------------------------------------------------------------------------------
    def alive(self, node: Node) -> bool:
        return node not in self._dead

    def users(self, t: Tensor) -> list[Node]:
        """The live nodes that read ``t`` (once each)."""
        return list(dict.fromkeys(self._users.get(t, ())))

    def kept(self, t: Tensor) -> bool:
        """Whether ``t`` is read after the iteration: an output or a state's next value."""
        return any(v is t for v in (*self.graph.outputs.values(), *self.graph.state_updates.values()))

    def sole_user(self, t: Tensor) -> Node | None:
        """The one node that reads ``t``, when nothing else does (no other node, output or state)."""
        users = self.users(t)
        return users[0] if len(users) == 1 and not self.kept(t) else None

    # ---- changing ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def build(self, anchor: Node, *, after: bool = False) -> Iterator[None]:
        """Nodes built inside go where ``anchor`` is (``after``: right after it and what is built at
        it), in ``anchor``'s scope."""
        g = self.graph
        start = len(g.nodes)
        with g.scope(anchor.scope) if anchor.scope else contextlib.nullcontext():  # (the copy has no scope open)
            yield
        for j, node in enumerate(g.nodes[start:]):
            self.key[node] = (*self.key[anchor], int(after), j)
            if node.name in self._names:  # (a label another node already has: labels name nodes)
                node.label = f"{node.label}_f{len(g.nodes)}_{j}"
            self._names.add(node.name)
            for t in node.inputs:
                self._users.setdefault(t, []).append(node)

    def replace(self, old: Tensor, new: Tensor) -> None:
        """Every reader of ``old`` (nodes, outputs, states) reads ``new`` (same shape and dtype)."""
        if old.shape != new.shape or old.dtype != new.dtype:
            raise GraphBuildError(f"fuse: {new!r} cannot stand in for {old!r} (a rule's bug)")
        for user in self.users(old):
            user.inputs = tuple(new if t is old else t for t in user.inputs)
            self._users.setdefault(new, []).append(user)
        self._users[old] = []
        for table in (self.graph.outputs, self.graph.state_updates):
            for name, t in table.items():
                if t is old:
                    table[name] = new
        self._maybe_dead.append(old.node)

    def discard(self, *nodes: Node) -> None:
        """Drop ``nodes`` (the pattern's) once nothing reads them; those still read stay."""
        self._maybe_dead.extend(nodes)

    def unassign(self, state: Tensor) -> None:
        """Free ``state``'s next value, so that a builder (a cache write) can give it another."""
        name = state.node.attrs["name"]
        value = self.graph.state_updates.pop(name)
        self._maybe_dead.append(value.node)

    def sweep(self) -> None:
        """Drop the discarded nodes nothing reads any more, and those this leaves unread among them and
        among the views they read (a view is no work: one only a dropped node read goes with it)."""
        progress = True
        while progress:
            progress = False
            for node in self._maybe_dead:
                if node in self._dead or any(self._users.get(t) or self.kept(t) for t in node.outputs):
                    continue
                self._dead.add(node)
                progress = True
                for t in node.inputs:
                    readers = self._users.get(t, [])
                    if node in readers:
                        readers.remove(node)
                    if t.node.op.kind == "view" and t.node not in self._maybe_dead:
                        self._maybe_dead.append(t.node)
        self._maybe_dead = [n for n in self._maybe_dead if n not in self._dead]

    def finish(self) -> None:
        """The live nodes in order (each at its key, after its operands' producers), checked again."""
        live = [n for n in self.graph.nodes if n not in self._dead]
        waiting = {n: len({t.node for t in n.inputs}) for n in live}
        readers: dict[Node, set[Node]] = {n: set() for n in live}
        for n in live:
            for t in n.inputs:
                readers[t.node].add(n)
        heap = [(self.key[n], n.id, n) for n in live if waiting[n] == 0]
        heapq.heapify(heap)
        order = []
        while heap:
            *_, n = heapq.heappop(heap)
            order.append(n)
            for r in readers[n]:
                waiting[r] -= 1
                if waiting[r] == 0:
                    heapq.heappush(heap, (self.key[r], r.id, r))
        if len(order) != len(live):
            raise GraphBuildError(f"fuse: the rewritten graph {self.graph.name!r} has a cycle (a rule's bug)")
        updates = self.graph.state_updates
        ranked = [n for n in self._state_order if n in updates] + [n for n in updates if n not in self._state_order]
        self.graph.state_updates = {name: updates[name] for name in ranked}
        self.graph.reorder(order)

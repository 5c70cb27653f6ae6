"""Programs of several ranks: build one graph per rank (``spmd``) and check that they fit together.

``match_ranks`` pairs every collective with its counterparts on the other members of its group and
every send with its recv, and refuses programs that could not run: unknown ranks, ranks that disagree
about a collective (kind, shape, dtype, attributes, order), unmatched transfers, and cycles of waits
that cross ranks (rank 0 waits for rank 1 which waits for rank 0). The result (``RankMatching``) is
what the reference backend (and later the planner) uses to connect ranks.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from megaloop.errors import CollectiveMismatchError, CycleError, RankError
from megaloop.frontend.graph import Graph, Node
from megaloop.frontend.shapes import format_shape
from megaloop.frontend.tensor import Tensor

RankNode = tuple[int, Node]


@dataclass
class Collective:
    """One collective as all members of its group issue it: ``nodes[i]`` is group[i]'s node."""

    op: str
    group: tuple[int, ...]
    index: int  # how many collectives this group issued before this one
    nodes: tuple[Node, ...]


@dataclass
class Transfer:
    """A send on ``src`` and the recv on ``dst`` it feeds."""

    src: int
    dst: int
    tag: int
    index: int  # position among transfers with the same (src, dst, tag)
    send: Node
    recv: Node


@dataclass
class RankMatching:
    graphs: list[Graph]
    collectives: list[Collective] = field(default_factory=list)
    transfers: list[Transfer] = field(default_factory=list)
    collective_of: dict[Node, Collective] = field(default_factory=dict)
    transfer_of: dict[Node, Transfer] = field(default_factory=dict)
    order: list[RankNode] = field(default_factory=list)  # sequential order of the whole program


def spmd(build: Callable[[Graph], Any], world_size: int, name: str = "graph") -> list[Graph]:
    """Call ``build(graph)`` once per rank with ``Graph(name, rank=r, world_size=world_size)`` and check
    that the rank graphs fit together. Returns the graphs, rank order."""
    if not isinstance(world_size, int) or world_size < 1:
        raise RankError(f"spmd: world_size must be an int >= 1, got {world_size!r}")
    graphs = []
    for rank in range(world_size):
        g = Graph(name, rank=rank, world_size=world_size)
        build(g)
        graphs.append(g)
    match_ranks(graphs)
    return graphs


def _describe(rank: int, node: Node) -> str:
    shapes = ", ".join(f"{t.dtype.short}{format_shape(t.shape)}" for t in node.inputs) or "-"
    attrs = {k: v for k, v in node.attrs.items() if k not in ("group",)}
    return f"rank {rank}: {node.op.name} {node.name} on {shapes} {attrs}"


def match_ranks(graphs: Sequence[Graph]) -> RankMatching:
    """Pair up collectives and transfers across ``graphs`` (one per rank, in rank order)."""
    graphs = list(graphs)
    if not graphs:
        raise RankError("a program needs at least one rank graph")
    world = graphs[0].world_size
    for i, g in enumerate(graphs):
        if g.world_size != world or g.rank != i:
            raise RankError(
                f"graph {i} ({g.name!r}) says rank {g.rank} of {g.world_size}, expected rank {i} of {world}: "
                "pass one graph per rank, in rank order, all with the same world_size"
            )
    if len(graphs) != world:
        raise RankError(f"world_size is {world} but {len(graphs)} rank graph(s) were given")
    orders = [g.topological_order() for g in graphs]
    matching = RankMatching(graphs)
    _match_collectives(orders, matching)
    _match_transfers(orders, matching)
    _check_acyclic(orders, matching)
    return matching


def _match_collectives(orders: list[list[Node]], m: RankMatching) -> None:
    issued: dict[tuple[int, ...], dict[int, list[Node]]] = {}
    for rank, order in enumerate(orders):
        for node in order:
            if node.op.kind == "collective":
                issued.setdefault(node.attrs["group"], {}).setdefault(rank, []).append(node)
    for group, by_rank in issued.items():
        counts = {r: len(by_rank.get(r, [])) for r in group}
        if len(set(counts.values())) > 1:
            detail = ", ".join(f"rank {r} issues {c}" for r, c in counts.items())
            raise CollectiveMismatchError(
                f"ranks of group {list(group)} issue different numbers of collectives on it ({detail}); "
                "every member must issue each collective of its group, in the same order"
            )
        for k in range(counts[group[0]]):
            nodes = tuple(by_rank[r][k] for r in group)
            first = nodes[0]
            for r, node in zip(group[1:], nodes[1:]):
                same = (
                    node.op is first.op
                    and node.attrs == first.attrs
                    and [(t.shape, t.dtype) for t in node.inputs] == [(t.shape, t.dtype) for t in first.inputs]
                )
                if not same:
                    raise CollectiveMismatchError(
                        f"collective #{k} of group {list(group)} differs between ranks:\n  "
                        f"{_describe(group[0], first)}\n  {_describe(r, node)}\n"
                        "members must issue the same op with the same shapes, dtypes and arguments, in the same order"
                    )
            c = Collective(first.op.name, group, k, nodes)
            m.collectives.append(c)
            for node in nodes:
                m.collective_of[node] = c


def _match_transfers(orders: list[list[Node]], m: RankMatching) -> None:
    sends: dict[tuple[int, int, int], list[Node]] = {}
    recvs: dict[tuple[int, int, int], list[Node]] = {}
    for rank, order in enumerate(orders):
        for node in order:
            if node.op.name == "send":
                sends.setdefault((rank, node.attrs["dst"], node.attrs["tag"]), []).append(node)
            elif node.op.name == "recv":
                recvs.setdefault((node.attrs["src"], rank, node.attrs["tag"]), []).append(node)
    for key in sorted(set(sends) | set(recvs)):
        src, dst, tag = key
        s, r = sends.get(key, []), recvs.get(key, [])
        if len(s) != len(r):
            raise CollectiveMismatchError(
                f"rank {src} sends {len(s)} tensor(s) to rank {dst} with tag {tag}, but rank {dst} receives "
                f"{len(r)} from rank {src} with that tag; every send needs exactly one matching recv"
            )
        for k, (sn, rn) in enumerate(zip(s, r)):
            x, y = sn.inputs[0], rn.outputs[0]
            if x.shape != y.shape or x.dtype != y.dtype:
                raise CollectiveMismatchError(
                    f"transfer #{k} from rank {src} to rank {dst} (tag {tag}): the send ({sn.name}) holds "
                    f"{x.dtype.short}{format_shape(x.shape)} but the recv ({rn.name}) expects "
                    f"{y.dtype.short}{format_shape(y.shape)}"
                )
            t = Transfer(src, dst, tag, k, sn, rn)
            m.transfers.append(t)
            m.transfer_of[sn] = m.transfer_of[rn] = t


def _inplace_readers(order: list[Node]) -> dict[Node, list[Node]]:
    """For each op that overwrites an operand's storage in place (kv_cache_update), the other nodes that
    read that storage's old value; they must run first. One that depends on the in-place op's result
    cannot, and is refused."""
    out: dict[Node, list[Node]] = {}
    reading: dict[Tensor, list[Node]] = {}  # storage -> the nodes reading it, in order
    for other in order:
        for base in dict.fromkeys(t.base for t in other.inputs):
            reading.setdefault(base, []).append(other)
    for node in order:
        if node.op.inplace_operand is None:
            continue
        storage = node.inputs[node.op.inplace_operand].base
        others = [n for n in reading.get(storage, []) if n is not node]
        after = _descendants(node, order) if others else set()
        readers = []
        for other in others:
            if other in after:
                raise CycleError(
                    f"{other.op.name} {other.name} reads the old value of {storage.name!r} but runs after "
                    f"{node.op.name} {node.name}, which overwrites it in place; read the op's result instead"
                )
            readers.append(other)
        out[node] = readers
    return out


def _descendants(node: Node, order: list[Node]) -> set[Node]:
    seen = {node}
    for other in order:
        if any(t.node in seen for t in other.inputs):
            seen.add(other)
    seen.discard(node)
    return seen


def _check_acyclic(orders: list[list[Node]], m: RankMatching) -> None:
    """Kahn's algorithm over all ranks' nodes, a collective being one vertex shared by its members and
    a recv depending on its send. Leftover vertices lie on (or behind) a cycle of waits. On success,
    ``m.order`` is the program's sequential order: every (rank, node), producers before consumers
    across ranks, a collective's members next to each other, earlier-built nodes first."""
    vertex: dict[RankNode, Any] = {}
    members: dict[Any, list[RankNode]] = {}
    index = {id(c): i for i, c in enumerate(m.collectives)}
    for rank, order in enumerate(orders):
        for node in order:
            c = m.collective_of.get(node)
            v = ("collective", index[id(c)]) if c is not None else (rank, node.id)
            vertex[(rank, node)] = v
            members.setdefault(v, []).append((rank, node))
    preds: dict[Any, set[Any]] = {v: set() for v in vertex.values()}
    for rank, order in enumerate(orders):
        for node in order:
            v = vertex[(rank, node)]
            for t in node.inputs:
                preds[v].add(vertex[(rank, t.node)])
            tr = m.transfer_of.get(node)
            if tr is not None and node is tr.recv:
                preds[v].add(vertex[(tr.src, tr.send)])
        for node, readers in _inplace_readers(order).items():  # the old value is read before it is overwritten
            for reader in readers:
                preds[vertex[(rank, node)]].add(vertex[(rank, reader)])
                tr = m.transfer_of.get(reader)
                if tr is not None and reader is tr.send:  # the recv on the other rank reads it too
                    preds[vertex[(rank, node)]].add(vertex[(tr.dst, tr.recv)])
    succs: dict[Any, list[Any]] = {v: [] for v in preds}
    for v, ps in preds.items():
        for p in ps:
            succs[p].append(v)
    indeg = {v: len(ps) for v, ps in preds.items()}

    def priority(v: Any) -> tuple[int, int]:  # earliest-built node first, then lowest rank
        return min((node.id, rank) for rank, node in members[v])

    ready = [(priority(v), n, v) for n, v in enumerate(indeg) if indeg[v] == 0]
    heapq.heapify(ready)
    counter = len(ready)
    done: list[Any] = []
    while ready:
        _, _, v = heapq.heappop(ready)
        done.append(v)
        for s in succs[v]:
            indeg[s] -= 1
            if indeg[s] == 0:
                heapq.heappush(ready, (priority(s), counter, s))
                counter += 1
    if len(done) == len(preds):
        m.order = [rn for v in done for rn in members[v]]
        return
    names = {v: f"rank {rn[0]} {rn[1].op.name} {rn[1].name}" for rn, v in vertex.items()}
    stuck = {v for v, d in indeg.items() if d > 0}
    v = min(stuck, key=str)
    path, seen = [], {}
    while v not in seen:
        seen[v] = len(path)
        path.append(v)
        v = min((p for p in preds[v] if p in stuck), key=str)
    loop = path[seen[v] :]
    raise CycleError(
        "the ranks wait on each other in a cycle: "
        + " <- ".join(names[x] for x in [*loop, loop[0]])
        + "\n  reorder so that each rank sends what the others need before it waits for their data"
    )

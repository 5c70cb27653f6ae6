"""What one step of a program of one or more ranks takes, by the cost model (megaloop.parallel.cost).

Ops start once what they read is made (a collective once every member's operand is, a recv once its
send's is); ops of a rank that become ready together share its processors (a group takes the longest
of its ops' longest tiles and the sum of their work over the processors); a rank takes at least the
sum of its groups. The step is the last rank's end. Also: the bytes the ranks exchange in a step,
the memory each holds (parameters, state, and the intermediates alive at once, by program order) and
the work each does (its ops' tiles over its processors: what a split divides).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from megaloop.frontend.graph import Graph, Node
from megaloop.parallel.cost import Machine, attrs_key, exchange_us, tiles_us
from megaloop.parallel.ranks import match_ranks

Vertex = tuple[int, int]  # (rank, node id); a collective is the vertex of its first member


def predict_step(graphs: Sequence[Graph], machine: Machine, tiles: dict | None = None) -> dict[str, Any]:
    """``tiles``: a cache of nodes' tile times at tile_scale 1 (kept between calls on the same graphs
    with machines that differ only in their fitted constants)."""
    graphs = list(graphs)
    tiles = {} if tiles is None else tiles
    m = match_ranks(graphs)
    vertex: dict[tuple[int, Node], Vertex] = {}
    members: dict[Vertex, list[tuple[int, Node]]] = {}
    for c in m.collectives:
        v = (c.group[0], c.nodes[0].id)
        for r, node in zip(c.group, c.nodes):
            vertex[(r, node)] = v
        members[v] = list(zip(c.group, c.nodes))
    for r, g in enumerate(graphs):
        for node in g.nodes:
            v = vertex.setdefault((r, node), (r, node.id))
            members.setdefault(v, [(r, node)])
    preds: dict[Vertex, set[Vertex]] = {v: set() for v in members}
    for v, mem in members.items():
        for r, node in mem:
            for t in node.inputs:
                preds[v].add(vertex[(r, t.node)])
            tr = m.transfer_of.get(node)
            if tr is not None and node is tr.recv:
                preds[v].add(vertex[(tr.src, tr.send)])
    cost = {v: _vertex_cost(mem, machine, tiles) for v, mem in members.items()}
    finish, busy = _simulate(preds, cost, members)
    ends = [0.0] * len(graphs)
    for v, f in finish.items():
        for r, _ in members[v]:
            ends[r] = max(ends[r], f)
    step = max(max(e, b) for e, b in zip(ends, busy))
    return {
        "step_us": step,
        "rank_end_us": ends,
        "rank_busy_us": busy,
        "exchanged_bytes": sum(_exchanged(mem) for mem in members.values()),
        "memory_bytes": [memory_bytes(g) for g in graphs],
        "work_us": [sum(cost[v][0] for v, mem in members.items() if mem[0][0] == r) for r in range(len(graphs))],
    }


def _vertex_cost(mem: list[tuple[int, Node]], machine: Machine, tiles: dict) -> tuple[float, float, float]:
    """(work, span, fixed) in us of a vertex: a node's tiles, or an exchange's time."""
    r, node = mem[0]
    kind = node.op.kind
    if kind == "source" or kind == "view":
        return 0.0, 0.0, 0.0
    if kind in ("collective", "p2p"):
        if node.op.name == "send":
            return 0.0, 0.0, 0.0
        ranks = [x for x, _ in mem] if kind == "collective" else [r, node.attrs["src"]]
        nbytes = (node.outputs or node.inputs)[0].nbytes
        if node.op.name == "reduce_scatter":
            nbytes = node.inputs[0].nbytes
        us = exchange_us(node.op.name, nbytes, len(ranks) if kind == "collective" else 2, machine.link(ranks))
        return 0.0, us, 0.0
    key = _signature(node), machine.l2_scale
    if key not in tiles:
        tiles[key] = tiles_us(node, replace(machine, tile_scale=1.0), len(mem))
    work, span = tiles[key]
    return work * machine.tile_scale, span * machine.tile_scale, machine.stage_us


def node_us(node: Node, machine: Machine, tiles: dict) -> float:
    """A node's time on its rank (as cost.op_us), its tiles looked up in ``tiles`` first."""
    work, span, fixed = _vertex_cost([(0, node)], machine, tiles)
    return 0.0 if work == span == 0.0 else max(work, span) + fixed


def _signature(node: Node) -> Any:
    """What a node's tiles depend on: its op, attributes and operand and output layouts (a model's
    layers share them)."""
    layouts = tuple((t.shape, t.dtype.name, t.strides, t.offset) for t in (*node.inputs, *node.outputs))
    return node.op.name, layouts, attrs_key(node.attrs)


def _simulate(preds: dict[Vertex, set[Vertex]], cost: dict, members: dict) -> tuple[dict, list[float]]:
    """Finish time of every vertex, and each rank's busy time (the sum of its groups)."""
    succs: dict[Vertex, list[Vertex]] = {v: [] for v in preds}
    indeg = {v: len(ps) for v, ps in preds.items()}
    for v, ps in preds.items():
        for p in ps:
            succs[p].append(v)
    busy = [0.0] * (1 + max(r for mem in members.values() for r, _ in mem))
    ready = {v: 0.0 for v in preds}
    heap = [_entry(0.0, v, members) for v, d in indeg.items() if d == 0]
    heapq.heapify(heap)
    finish: dict[Vertex, float] = {}
    while heap:
        t, rank, alone, v = heapq.heappop(heap)
        group = [v]
        while not alone and heap and heap[0][:3] == (t, rank, False):
            group.append(heapq.heappop(heap)[3])
        work = sum(cost[g][0] for g in group)
        took = max(work, max(cost[g][1] for g in group)) + max(cost[g][2] for g in group)
        for r in {r for g in group for r, _ in members[g]}:
            busy[r] += took
        for g in group:
            finish[g] = t + took
            for s in succs[g]:
                ready[s] = max(ready[s], finish[g])
                indeg[s] -= 1
                if indeg[s] == 0:
                    heapq.heappush(heap, _entry(ready[s], s, members))
    return finish, busy


def _entry(t: float, v: Vertex, members: dict) -> tuple[float, int, bool, Vertex]:
    """Heap order: time (to the ns, so that what becomes ready together groups), rank, collectives alone."""
    return round(t, 3), members[v][0][0], len(members[v]) > 1, v


def _exchanged(mem: list[tuple[int, Node]]) -> int:
    node = mem[0][1]
    if node.op.kind == "collective":
        return sum(n.inputs[0].nbytes for _, n in mem)
    if node.op.name == "send":
        return node.inputs[0].nbytes
    return 0


def memory_bytes(g: Graph) -> int:
    """Parameters, state, inputs and constants, plus the most intermediate bytes alive at once when the
    nodes run in program order (views hold none of their own)."""
    held = sum(t.nbytes for n in g.nodes if n.op.kind == "source" for t in n.outputs if n.op.name != "constant") + sum(
        t.nbytes for t in g.constants
    )
    last: dict[Any, int] = {}
    for i, n in enumerate(g.nodes):
        for t in n.inputs:
            last[t.base] = i
    for t in g.outputs.values():
        last[t.base] = len(g.nodes)
    alive = peak = 0
    ending: dict[int, int] = {}
    for i, n in enumerate(g.nodes):
        if n.op.kind not in ("source", "view") and n.op.inplace_operand is None:
            for t in n.outputs:
                alive += t.nbytes
                ending[last.get(t, i)] = ending.get(last.get(t, i), 0) + t.nbytes
        peak = max(peak, alive)
        alive -= ending.pop(i, 0)
    return held + peak

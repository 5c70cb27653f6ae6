"""One forward, one backward (1F1B) for a pipeline's micro-batches inside the loop kernel.

A stage's graph holds the forward and backward of every micro-batch (chain) at once; the planner
places tasks by dependency depth, so left alone every forward would come before any backward
(GPipe's order, every chain's activations alive at once). 1F1B bounds that: on stage s of S, the
forward of chain j waits for the backward of chain j - (S - s) on the same stage, so at most S - s
chains are in flight there (S - s - 1 forwards of warm-up, then one forward, one backward).

The wait is a data dependency the planner sees: the chain's first float values on the stage (what
it receives, or its embedding) are read through ``where(c == c, x, x)``, c one element of the last
gradient that chain j - (S - s)'s backward makes on the stage. The result is x, bit for bit, NaN or
not; its cost is one elementwise pass over each gated value.

Chains are found by labelling: a chain's input pieces start it, a node whose labelled operands are
all of one chain is of that chain, a recv is of its send's chain. Nodes of several chains (the
loss's sums, the weights' gradients) are of none.
"""

from __future__ import annotations

from typing import Any

import megaloop.frontend.ops as ops
from megaloop.errors import CycleError
from megaloop.frontend.graph import Graph, Node
from megaloop.frontend.tensor import Tensor
from megaloop.parallel.ranks import match_ranks

MIXED = -1


def one_forward_one_backward(forward: Any, stages: int) -> int:
    """Gate each stage's chains as 1F1B says (``forward``: the Partition whose rank graphs hold the
    training step). Returns the number of gates added (0 where they would make a cycle: then the
    plan keeps the order the planner finds)."""
    graphs = [p.graph for p in forward.parts]
    labels = _chain_labels(forward)
    per_stage = len(graphs) // stages
    added: list[tuple[Graph, list[Node], dict[Node, tuple]]] = []
    for r, g in enumerate(graphs):
        stage = r // per_stage
        added.append(_gate(g, labels[r], stages - stage))
    try:
        match_ranks(graphs)
    except CycleError:
        for g, nodes, rewired in added:
            _undo(g, nodes, rewired)
        return 0
    return sum(len(nodes) for _, nodes, _ in added)


def _chain_labels(forward: Any) -> list[dict[Node, int]]:
    """Each rank's nodes labelled with their chain (MIXED: several; absent: none)."""
    graphs = [p.graph for p in forward.parts]
    labels: list[dict[Node, int]] = [{} for _ in graphs]
    for r, part in enumerate(forward.parts):
        starts: dict[str, list[tuple[int, Node]]] = {}
        for node, info in part.sources.items():
            if info.kind == "input" and info.box:
                starts.setdefault(info.name, []).append((info.box[0][0], node))
        for pieces in starts.values():
            if len(pieces) > 1:
                for j, (_, node) in enumerate(sorted(pieces, key=lambda x: x[0])):
                    labels[r][node] = j
    matching = match_ranks(graphs)
    changed = True
    while changed:
        changed = False
        for r, g in enumerate(graphs):
            for node in g.nodes:
                if node.op.kind == "source":
                    continue
                if node.op.name == "recv":
                    tr = matching.transfer_of[node]
                    found = {labels[tr.src].get(tr.send)} - {None}
                else:
                    found = {labels[r][t.node] for t in node.inputs if t.node in labels[r]}
                if not found:
                    continue
                label = found.pop() if len(found) == 1 else MIXED
                if labels[r].get(node) != label:
                    labels[r][node] = label
                    changed = True
    return labels


def _is_backward(node: Node) -> bool:
    return node.scope == "grad" or node.scope.startswith("grad.")


def _gate(g: Graph, label: dict[Node, int], in_flight: int) -> tuple[Graph, list[Node], dict[Node, tuple]]:
    chains = sorted({c for c in label.values() if c != MIXED})
    last_backward: dict[int, Tensor] = {}
    entries: dict[int, list[Tensor]] = {}
    for node in g.nodes:
        c = label.get(node)
        if c is None or c == MIXED:
            continue
        if _is_backward(node):
            floats = [t for t in node.outputs if t.dtype.is_float]
            if floats:
                last_backward[c] = floats[0]
        elif _entry(node, label, c):
            entries.setdefault(c, []).extend(t for t in node.outputs if t.dtype.is_float)
    before = len(g.nodes)
    rewired: dict[Node, tuple] = {}
    for j in chains:
        source = last_backward.get(j - in_flight)
        if j - in_flight < 0 or source is None or not entries.get(j):
            continue
        with g.scope("pipeline_1f1b"):
            first = ops.slice_(ops.reshape(_contiguous(source), (-1,)), [0], [1])
            cond = ops.equal(first, first)
            for x in entries[j]:
                gated = ops.where(cond, x, x)
                for node in g.nodes[:before]:
                    if not _is_backward(node) and label.get(node) == j and x in node.inputs:
                        rewired.setdefault(node, node.inputs)
                        node.inputs = tuple(gated if t is x else t for t in node.inputs)
    nodes = g.nodes[before:]
    if nodes:
        g.reorder(g.topological_order())
    return g, nodes, rewired


def _contiguous(t: Tensor) -> Tensor:
    return t if t.base is t and t.offset == 0 else ops.copy(t)


def _entry(node: Node, label: dict[Node, int], c: int) -> bool:
    """A chain's first float value on the stage: a recv, or a float op reading the chain's input piece
    directly and no float value of the chain (an embedding lookup)."""
    if node.op.name == "recv":
        return True
    if not any(t.dtype.is_float for t in node.outputs):
        return False
    reads_input = any(t.node.op.kind == "source" and label.get(t.node) == c for t in node.inputs)
    reads_float = any(t.dtype.is_float and label.get(t.node) == c for t in node.inputs)
    return reads_input and not reads_float


def _undo(g: Graph, nodes: list[Node], rewired: dict[Node, tuple]) -> None:
    for node, inputs in rewired.items():
        node.inputs = inputs
    gone = set(nodes)
    if gone:
        g.reorder([n for n in g.topological_order() if n not in gone])

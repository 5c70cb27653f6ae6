"""Activation recomputation: each layer's forward is run again in its backward, so that the values
the backward reads need not stay alive from the forward to the backward.

What is recomputed: for each model layer (the first two parts of a node's scope, ``layers.3``), the
layer's forward nodes whose values its backward reads, and the nodes of the layer that those read in
turn. What is kept: the layer's inputs (the residual stream entering it), the weights, what a
collective or a transfer made (recomputing one would exchange again), and in-place updates (KV
caches). The backward reads the copies; the originals are then read only by the forward and die
there.

The copies must not run early (that would keep them alive as long as the originals): the layer's
kept activations are read through ``where(c == c, x, x)``, c one element of the last gradient made
before the layer's backward starts (the next layer's, or the head's), the same value bit for bit.
"""

from __future__ import annotations

from megaloop.frontend import ops
from megaloop.frontend.graph import Graph, Node
from megaloop.frontend.tensor import Tensor


def _layer(node: Node) -> str | None:
    scope = node.scope.removeprefix("grad.") if node.scope.startswith("grad.") else node.scope
    parts = scope.split(".")
    return ".".join(parts[:2]) if len(parts) >= 2 and parts[0] == "layers" and parts[1].isdigit() else None


def _backward(node: Node) -> bool:
    return node.scope == "grad" or node.scope.startswith("grad.")


def recompute_layers(g: Graph) -> int:
    """Recompute each layer's activations in ``g``'s backward (``grad`` already added). Returns the
    number of nodes copied."""
    forward = [n for n in g.nodes if not _backward(n)]
    backward = [n for n in g.nodes if _backward(n)]
    layers: dict[str, list[Node]] = {}
    for n in forward:
        name = _layer(n)
        if name is not None and n.op.kind not in ("source", "collective", "p2p") and n.op.inplace_operand is None:
            layers.setdefault(name, []).append(n)
    copied = 0
    before = len(g.nodes)
    for name, nodes in layers.items():
        copied += _recompute(g, name, set(nodes), forward, backward)
    if len(g.nodes) > before:
        g.reorder(g.topological_order())
    return copied


def _recompute(g: Graph, name: str, own: set[Node], forward: list[Node], backward: list[Node]) -> int:
    readers = [n for n in backward if _layer(n) == name and any(t.node in own for t in n.inputs)]
    if not readers:
        return 0
    needed: set[Node] = set()
    stack = [t.node for n in readers for t in n.inputs if t.node in own]
    while stack:
        n = stack.pop()
        if n in needed:
            continue
        needed.add(n)
        stack.extend(t.node for t in n.inputs if t.node in own)
    first = min(n.id for n in backward if _layer(n) == name)
    gate = _gate_source(backward, first, name)
    made: dict[Tensor, Tensor] = {}
    cond = None
    with g.scope(f"recompute.{name}"):
        if gate is not None:
            first_value = ops.slice_(ops.reshape(_contiguous(gate), (-1,)), [0], [1])
            cond = ops.equal(first_value, first_value)
        for node in [n for n in forward if n in needed]:
            operands = []
            for t in node.inputs:
                if t in made:
                    operands.append(made[t])
                elif cond is not None and t.dtype.is_float and t.node.op.kind != "source":
                    made[t] = ops.where(cond, t, t)  # (a kept activation, read once the gradient arrives)
                    operands.append(made[t])
                else:
                    operands.append(t)
            with g.scope(node.scope) if node.scope else _nothing():
                outs = g.apply(node.op, operands, dict(node.attrs))
            made.update(zip(node.outputs, outs))
    for n in readers:
        n.inputs = tuple(made.get(t, t) if t.node in needed else t for t in n.inputs)
    return len(needed)


def _gate_source(backward: list[Node], before_id: int, name: str) -> Tensor | None:
    """The last float value the backward makes before the layer's own backward starts."""
    for n in sorted(backward, key=lambda n: -n.id):
        if n.id < before_id and _layer(n) != name:
            floats = [t for t in n.outputs if t.dtype.is_float]
            if floats:
                return floats[0]
    return None


def _contiguous(t: Tensor) -> Tensor:
    return t if t.base is t and t.offset == 0 else ops.copy(t)


def _nothing():
    import contextlib

    return contextlib.nullcontext()

"""A tree of elementwise ops -> one fused_elementwise: an elementwise node (the root) with the elementwise
nodes of its shape whose every reader is in the tree (nothing else reading them), made one op whose steps
round each intermediate as storing it would (the plain ops' bits). A chain of small ops (a serving
step's bookkeeping over its slots, a generator's next-token bookkeeping) is then one task and one
handoff where it was one each. Off by default until measured on the GPU (FuseOptions(on=...))."""

from __future__ import annotations

import weakref
from collections import Counter

import megaloop.frontend.ops as ops
from megaloop.frontend.graph import Node
from megaloop.frontend.opdef import REGISTRY
from megaloop.frontend.ops.fused_elementwise import MAX_INPUTS
from megaloop.frontend.shapes import broadcast_shapes
from megaloop.frontend.tensor import Tensor
from megaloop.fuse.rewrite import Rewriter
from megaloop.fuse.rule import Rule, register_rule

MAX_STEPS = 32  # (a tile's code: each step is a few instructions an element)


def _candidate(node: Node) -> bool:
    """An elementwise op the fused op can take as a step: its lowering an expression, no data rule."""
    op = node.op
    return op.lowering is not None and op.lowering.template == "elementwise" and op.check_data is None


_TREES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # rewriter -> {node: its tree's root}


def _trees(rw: Rewriter) -> dict[Node, Node]:
    """Each elementwise node's tree (its root), for the graph under rewrite: from the last node back, a
    node joins the tree of its readers when they all are in one tree of its shape and nothing else
    reads it; else it roots its own. (Fusing one tree leaves the others' members as they were.)"""
    if rw not in _TREES:
        root: dict[Node, Node] = {}
        size: Counter = Counter()
        for n in reversed([n for n in rw.graph.nodes if rw.alive(n)]):
            if not _candidate(n):
                continue
            t, users = n.outputs[0], rw.users(n.outputs[0])
            roots = {root.get(u) for u in users}
            joins = users and not rw.kept(t) and len(roots) == 1 and None not in roots
            joins = joins and all(u.outputs[0].shape == t.shape for u in users) and size[root.get(users[0])] < MAX_STEPS
            root[n] = root[users[0]] if joins else n
            size[root[n]] += 1
        _TREES[rw] = root
    return _TREES[rw]


def _fire(node: Node, rw: Rewriter) -> bool:
    trees = _trees(rw)
    if trees.get(node) is not node:
        return False  # (not elementwise, or its readers' tree takes it)
    members = sorted((m for m, r in trees.items() if r is node and rw.alive(m)), key=lambda n: rw.key[n])
    index = {m: k for k, m in enumerate(members)}
    operands: list[Tensor] = []
    steps = []
    for m in members:
        args = []
        for t in m.inputs:
            if t.node in index:
                args.append(["step", index[t.node]])
            else:
                if t not in operands:
                    operands.append(t)
                args.append(["in", operands.index(t)])
        steps.append({"op": m.op.name, "attrs": dict(m.attrs), "args": args, "dtype": m.outputs[0].dtype.name})
    shape = node.outputs[0].shape
    if len(members) < 2 or len(operands) > MAX_INPUTS:
        return False
    if tuple(broadcast_shapes(*[t.shape for t in operands])) != shape:
        return False  # (the operands alone must span the root's shape)
    with rw.build(node):
        out = ops.fused_elementwise(operands, steps)
    rw.replace(node.outputs[0], out)
    rw.discard(*members)
    return True


register_rule(
    Rule(
        name="elementwise_chain",
        makes="fused_elementwise",
        roots=tuple(name for name, op in REGISTRY.items() if op.lowering and op.lowering.template == "elementwise"),
        doc="an elementwise node and the elementwise nodes of its shape whose every reader is in its tree, "
        "at least 2 and at most 32, at most 8 operands from outside",
        fire=_fire,
        last=True,  # (other rules' patterns hold elementwise ops: they take theirs first)
        default=False,
    )
)

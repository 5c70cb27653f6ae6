"""A tree of elementwise ops -> one fused_elementwise: an elementwise node (the root) with the elementwise
nodes that feed only it, or only others of the tree, all of the root's shape, made one op whose steps
round each intermediate as storing it would (the plain ops' bits). A chain of small ops (a serving
step's bookkeeping over its slots, a generator's next-token bookkeeping) is then one task and one
handoff where it was one each. Off by default until measured on the GPU (FuseOptions(on=...))."""

from __future__ import annotations

import megaloop.frontend.ops as ops
from megaloop.frontend.graph import Node
from megaloop.frontend.opdef import REGISTRY
from megaloop.frontend.ops.fused_elementwise import MAX_INPUTS
from megaloop.frontend.shapes import broadcast_shapes
from megaloop.frontend.tensor import Tensor
from megaloop.fuse.rewrite import Rewriter
from megaloop.fuse.rule import Rule, register_rule

MAX_STEPS = 32  # (a tile's code: each step is a few instructions an element)
# the rules whose patterns hold elementwise ops (or reach them): they take theirs first
AFTER = ("silu_mul", "norm_residual", "swiglu_linear", "rmsnorm_linear", "rope_paged_kv_cache_update",
         "attention_append", "rope_kv_cache_update", "empty_inputs", "split_k_linear")


def _candidate(node: Node) -> bool:
    """An elementwise op the fused op can take as a step: its lowering an expression, no data rule."""
    op = node.op
    return op.lowering is not None and op.lowering.template == "elementwise" and op.check_data is None


def _absorbed(t: Tensor, rw: Rewriter) -> bool:
    """Whether ``t``'s maker goes into its reader's tree: one reader, elementwise, of the same shape."""
    user = rw.sole_user(t)
    return user is not None and _candidate(t.node) and _candidate(user) and user.outputs[0].shape == t.shape


def _tree(root: Node, rw: Rewriter) -> list[Node]:
    """The root and the nodes absorbed into it, in graph order (each after its operands' makers)."""
    members, stack = {root}, [root]
    while stack:
        for t in stack.pop().inputs:
            if t.node not in members and t.index == 0 and _absorbed(t, rw):
                members.add(t.node)
                stack.append(t.node)
    return sorted(members, key=lambda n: rw.key[n])


def _fire(node: Node, rw: Rewriter) -> bool:
    if not _candidate(node) or _absorbed(node.outputs[0], rw):
        return False  # (not a root: its reader's tree takes it)
    members = _tree(node, rw)
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
    if len(members) < 2 or len(members) > MAX_STEPS or len(operands) > MAX_INPUTS:
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
        doc="an elementwise node and the elementwise nodes of its shape that feed only it (or only others "
        "of the tree), at least 2 and at most 32, at most 8 operands from outside",
        fire=_fire,
        after=AFTER,
        default=False,
    )
)

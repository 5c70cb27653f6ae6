"""attention_combine -> its heads concatenated -> x @ w.T (the o projection) -> combine_linear(partial,
w): the projection's tiles merge attention's key ranges of their rows themselves, so the combine is no
stage of its own (loop kernel v3, docs/runtime.md). Off by default until measured on the GPU:
FuseOptions(on=("combine_linear",)), or --fusion +combine_linear."""

from __future__ import annotations

import megaloop.frontend.ops as ops
from megaloop.frontend.graph import Node
from megaloop.fuse.patterns import linear
from megaloop.fuse.rewrite import Rewriter
from megaloop.fuse.rule import Rule, register_rule


def _fire(node: Node, rw: Rewriter) -> bool:
    b, heads, rows, dv = node.outputs[0].shape
    swap = rw.sole_user(node.outputs[0])  # [b, heads, rows, dv] -> [b, rows, heads, dv], a view
    if swap is None or swap.op.name != "permute" or tuple(swap.attrs["axes"]) != (0, 2, 1, 3):
        return False
    flat = rw.sole_user(swap.outputs[0])  # -> [b, rows, heads * dv], a view (no copy between)
    if flat is None or flat.op.name != "reshape" or flat.outputs[0].shape != (b, rows, heads * dv):
        return False
    product = rw.sole_user(flat.outputs[0])
    lin = linear(product)
    if lin is None or lin.x is not flat.outputs[0] or lin.w.dtype != node.attrs["dtype"]:
        return False
    with rw.build(product):
        out = ops.combine_linear(node.inputs[0], lin.w, dtype=node.attrs["dtype"])
    rw.replace(product.outputs[0], out)
    rw.discard(product, flat, swap, node)
    return True


register_rule(
    Rule(
        name="combine_linear",
        makes="combine_linear",
        roots=("attention_combine",),
        doc="attention_combine(partial) -> transpose(1, 2) -> reshape to [b, rows, heads * v_dim] -> x @ w.T, "
        "each read by nothing else, w of the combine's dtype",
        fire=_fire,
        after=("attention_append",),
        default=False,
    )
)

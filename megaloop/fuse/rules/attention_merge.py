"""attention_combine(attention_partial(...)) -> attention_merged(...): the key-range tiles merge their
ranges themselves (the last of a block of rows to arrive), so the readers of attention's output wait
for the attention tiles and no combine stage runs (megaloop/frontend/ops/attention_merged.py)."""

from __future__ import annotations

from megaloop.frontend.graph import Node
from megaloop.frontend.ops.attention_merged import attention_merged
from megaloop.fuse.patterns import made_by
from megaloop.fuse.rewrite import Rewriter
from megaloop.fuse.rule import Rule, register_rule


def _fire(node: Node, rw: Rewriter) -> bool:
    partial = made_by(node.inputs[0], "attention_partial")
    if partial is None or rw.sole_user(partial.outputs[0]) is not node:
        return False
    if node.attrs["dtype"] != partial.inputs[0].dtype:  # (combine's dtype is q's where ml.attention built it)
        return False
    with rw.build(partial):
        out = attention_merged(partial.outputs[0])
    rw.replace(node.outputs[0], out)
    rw.discard(node, partial)
    return True


register_rule(
    Rule(
        name="attention_merge",
        makes="attention_merged",
        roots=("attention_combine",),
        doc="attention_combine(attention_partial(...)) where the partial sums are read by nothing else: the "
        "last key-range tile of a block of rows merges them (an arrival count), no combine stage",
        fire=_fire,
        after=("attention_append",),
        default=False,  # not yet measured on a GPU (docs/runtime.md)
    )
)

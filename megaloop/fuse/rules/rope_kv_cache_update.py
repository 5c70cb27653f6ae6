"""kv_cache_update(cache, rope(k, positions), positions) -> rope_kv_cache_update(cache, k, positions) on
a decode step (one new token a sequence): the key is rotated on its way into the cache, one stage
fewer before attention. Many tokens (a prefill) keep rope's packed tiles over every token."""

from __future__ import annotations

import megaloop.frontend.ops as ops
from megaloop.frontend.graph import Node
from megaloop.fuse.patterns import made_by, rope_attrs, same_values
from megaloop.fuse.rewrite import Rewriter
from megaloop.fuse.rule import Rule, register_rule


def _fire(node: Node, rw: Rewriter) -> bool:
    cache, new, positions = node.inputs
    rope = made_by(new, "rope")
    if rope is None or node.attrs.get("ignore_negative") or new.shape[2] != 1 or rw.sole_user(new) is not node:
        return False
    if not same_values(rope.inputs[1], positions):  # (each token rotated at the slot it is written to)
        return False
    rw.unassign(cache)
    with rw.build(node):
        out = ops.rope_kv_cache_update(cache, rope.inputs[0], positions, **rope_attrs(rope))
    rw.replace(node.outputs[0], out)
    rw.discard(node, rope)
    return True


register_rule(
    Rule(
        name="rope_kv_cache_update",
        makes="rope_kv_cache_update",
        roots=("kv_cache_update",),
        doc="kv_cache_update(cache, rope(k, p), positions) with p the positions (reshaped) and one token a "
        "sequence, rope's result read by nothing else",
        fire=_fire,
        after=("attention_append",),
    )
)

"""paged_kv_cache_update(pool, rope(k, p'), table, slots, p) -> rope_paged_kv_cache_update(pool, k, table,
slots, p), where p' is p (or maximum(p, 0): rows at negative positions write nothing): the key is rotated
on its way into the pool, one stage fewer before a serving step's attention in every layer."""

from __future__ import annotations

import megaloop.frontend.ops as ops
from megaloop.frontend.graph import Node
from megaloop.fuse.patterns import made_by, rope_attrs, same_where_used
from megaloop.fuse.rewrite import Rewriter
from megaloop.fuse.rule import Rule, register_rule


def _fire(node: Node, rw: Rewriter) -> bool:
    pool, new, table, slots, positions = node.inputs
    rope = made_by(new, "rope")
    if rope is None or rw.sole_user(new) is not node:
        return False
    b, t = positions.shape
    if rope.inputs[1].size != b * t or not same_where_used(rope.inputs[1], positions):  # (each row at its position)
        return False
    rw.unassign(pool)
    with rw.build(node):
        out = ops.rope_paged_kv_cache_update(pool, rope.inputs[0], table, slots, positions, **rope_attrs(rope))
    rw.replace(node.outputs[0], out)
    rw.discard(node, rope)
    return True


register_rule(
    Rule(
        name="rope_paged_kv_cache_update",
        makes="rope_paged_kv_cache_update",
        roots=("paged_kv_cache_update",),
        doc="paged_kv_cache_update(pool, rope(k, p), table, slots, positions) with p the positions (reshaped, "
        "or clamped at 0), rope's result read by nothing else",
        fire=_fire,
    )
)

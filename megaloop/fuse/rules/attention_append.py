"""The append form of a decode step's attention (attention_partial with k_new, v_new and rope's
attributes): q's rope and the new key and value made by the attention tiles themselves, the caches'
writes after attention, off its path. From the plain step: attention over the caches' updated values,

    attention(rope(q, p), kv_cache_update(kc, rope(k, p), p), kv_cache_update(vc, v, p), q_positions=p)

(kv_splits set: attention_partial and attention_combine; or the key's write already
rope_kv_cache_update) -> attention(q, kc, vc, q_positions=p, k_new=k, v_new=v, rope=...), then
rope_kv_cache_update(kc, k, p) and kv_cache_update(vc, v, p) placed after the projection that reads
attention's output, so that the processors take it first (docs/runtime.md)."""

from __future__ import annotations

from typing import Any

import megaloop.frontend.ops as ops
from megaloop.frontend.graph import Node
from megaloop.frontend.ops._tilings import MASK, attention_slots
from megaloop.frontend.tensor import Tensor
from megaloop.fuse.patterns import linear, made_by, rope_attrs, same_values
from megaloop.fuse.rewrite import Rewriter
from megaloop.fuse.rule import Rule, register_rule


def _key_write(t: Tensor, rw: Rewriter) -> tuple[list[Node], Tensor, dict[str, Any]] | None:
    """(the write and its rope, the new key before rope, rope's keywords) of the k cache's updated
    value ``t``."""
    write = made_by(t, "kv_cache_update", "rope_kv_cache_update")
    if write is None or write.attrs.get("ignore_negative"):
        return None
    if write.op.name == "rope_kv_cache_update":
        return [write], write.inputs[1], rope_attrs(write)
    rope = made_by(write.inputs[1], "rope")
    if rope is None or rw.sole_user(rope.outputs[0]) is not write or not same_values(rope.inputs[1], write.inputs[2]):
        return None
    return [write, rope], rope.inputs[0], rope_attrs(rope)


def _writes_anchor(out: Tensor, rw: Rewriter) -> Node:
    """Where the cache writes go: after the linear layer (its bias included) that reads attention's
    output ``out`` through views, or after attention."""
    node = out.node
    while len(readers := rw.users(out)) == 1 and readers[0].op.kind == "view":
        out = readers[0].outputs[0]
    if len(readers) == 1 and linear(readers[0]) is not None:
        node = readers[0]
        after = rw.users(node.outputs[0])
        if len(after) == 1 and after[0].op.name == "add" and any(t.ndim == 1 for t in after[0].inputs):
            node = after[0]  # the bias
    return node


def _fire(node: Node, rw: Rewriter) -> bool:
    attrs = node.attrs
    slot = attention_slots(attrs)
    if "theta" in attrs or 3 not in slot or 4 in slot or not attrs["causal"]:
        return False
    q, k_all, v_all = node.inputs[:3]
    positions = node.inputs[slot[3]]
    combine = rw.sole_user(node.outputs[0])
    rope_q = made_by(q, "rope")
    if q.shape[2] != 1 or combine is None or combine.op.name != "attention_combine" or rope_q is None:
        return False
    key = _key_write(k_all, rw)
    v_write = made_by(v_all, "kv_cache_update")
    if key is None or v_write is None or v_write.attrs.get("ignore_negative"):
        return False
    k_nodes, k_new, rope = key
    k_write = k_nodes[0]
    checks = (
        rw.sole_user(q) is node,
        rw.users(k_all) == [node] and rw.users(v_all) == [node],
        rope == rope_attrs(rope_q),
        all(same_values(p, positions) for p in (rope_q.inputs[1], k_write.inputs[2], v_write.inputs[2])),
        _splits_kept(attrs["splits"], k_all.shape[2]),
    )
    if not all(checks):
        return False
    k_cache, v_cache, v_new = k_write.inputs[0], v_write.inputs[0], v_write.inputs[1]
    anchor = _writes_anchor(combine.outputs[0], rw)
    rw.unassign(k_cache)
    rw.unassign(v_cache)
    with rw.build(node):
        out = ops.attention(
            rope_q.inputs[0], k_cache, v_cache, causal=True, q_positions=positions, window=attrs["window"],
            scale=attrs["scale"], kv_splits=attrs["splits"], k_new=k_new, v_new=v_new, rope=rope,
            softcap=attrs.get("softcap"), mask=node.inputs[slot[MASK]] if MASK in slot else None,
        )  # fmt: skip
    with rw.build(anchor, after=True):
        ops.rope_kv_cache_update(k_cache, k_new, k_write.inputs[2], **rope)
        ops.kv_cache_update(v_cache, v_new, v_write.inputs[2])
    rw.replace(combine.outputs[0], out)
    rw.discard(combine, node, rope_q, *k_nodes, v_write)
    return True


def _splits_kept(splits: int, keys: int) -> bool:
    """Whether ``ops.attention(kv_splits=splits)`` over ``keys`` keys makes ``splits`` ranges again."""
    return -(-keys // -(-keys // splits)) == splits


register_rule(
    Rule(
        name="attention_append",
        makes="attention_partial",
        roots=("attention_partial",),
        doc="attention_partial + attention_combine of one query a sequence (causal, at q_positions, no "
        "kv_lengths) over the caches' values just written: q and the new key roped at those positions, rope's "
        "and the writes' results read by nothing else",
        fire=_fire,
    )
)

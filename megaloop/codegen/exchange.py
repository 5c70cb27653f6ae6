"""The tile function of a pushing all_reduce (megaloop/plan/rendezvous.py, which also lays out the inboxes
after the plan's buffers; megaloop/codegen/include/megaloop/exchange.cuh).

An op's inbox has two slots (iteration parity) per other member and tile; the same layout on every member,
since the members' tiles are the same. Tiles of at most ``LL_MAX_TILE_BYTES`` travel in LL lines (16
bytes carry 8 of data and the flags), larger ones as plain stores followed by a flag per (sender, tile).
"""

from __future__ import annotations

from megaloop.codegen.emit import Operand
from megaloop.plan.model import Plan
from megaloop.plan.rendezvous import Inbox

# A bulk tile goes in chunks, each summed while the next is on the link (megaloop/exchange.cuh): a
# quarter of the tile, within these bounds (the best measured at 16 and 256 MB: docs/experiments.md).
BULK_CHUNK_BYTES = (32768, 65536)


def bulk_chunk(tile_bytes: int) -> int:
    low, high = BULK_CHUNK_BYTES
    return min(high, max(low, -(-tile_bytes // 64) * 16))


def member_inbox_offsets(plan: Plan, rank: int, op_id: int, boxes: list[dict[int, Inbox]]) -> list[int]:
    """The inbox offset of ``op_id``'s counterpart on every member, in group order (each in its arena);
    ``boxes[m]`` is ``inboxes(plan, m)``."""
    rp = plan.ranks[rank]
    c = plan.matching.collective_of[rp.graph.nodes[rp.ops[op_id].node]]
    out = []
    for m, peer_node in zip(c.group, c.nodes):
        (peer_op,) = [o for o in plan.ranks[m].ops if o.node == peer_node.id]
        out.append(boxes[m][peer_op.id].offset)
    return out


def all_reduce_push(
    attrs: dict, group: tuple[int, ...], rank: int, x: Operand, out: Operand, inbox: Inbox
) -> list[str]:
    """The tile (``ml::push_all_reduce_ll`` or ``_bulk``): its box as one run of x and out (pushable: both
    contiguous), handed to the members and combined with theirs in rank order."""
    nd = len(out.shape)
    strides = [1] * nd
    for d in range(nd - 2, -1, -1):
        strides[d] = strides[d + 1] * out.shape[d + 1]
    at = ", ".join(str(s) for s in strides)
    path = "ll" if inbox.ll else "bulk"
    size = inbox.slot_bytes // 16 if inbox.ll else f"{inbox.slot_bytes}, {bulk_chunk(inbox.slot_bytes)}"
    sums = str(attrs["op"] == "sum").lower()
    targs = f"{sums}, {inbox.tiles}, {size}, {group.index(rank)}, {', '.join(str(m) for m in group)}"
    return [
        f"// pushed ({'LL lines' if inbox.ll else 'stores + flag'}): this rank's box of x to the other "
        f"{len(group) - 1} member(s), theirs combined with it in rank order",
        f"const {x.ctype}* in0 = (const {x.ctype}*)(a.arena + off[0]);",
        f"{out.ctype}* out0 = ({out.ctype}*)(a.arena + off[1]);",
        f"ml::push_all_reduce_{path}<{targs}>(a, t, tid, k, proc, off, ml::at<{at}>(in0), ml::at<{at}>(out0));",
    ]

"""Rendezvous tiles: a pushing all_reduce's tile i on every member of its group is one meeting.

Each member's tile, once its own waits are met (its box of x is ready on its rank), stores that box
into every other member's inbox (peer memory, over NVLink), then waits for the others' boxes to land in
its own inbox and sums all of them in rank order. No task waits on another rank's counter: the data
carries its own arrival flag (megaloop/codegen/include/megaloop/exchange.cuh), so a hop costs one
one-way trip instead of a signal, a wait and a read across the link and back.

What the plan states about such a tile: it reads only this rank's x and writes its output box (the
inbox is the op's private memory, outside the plan's buffers). What makes it correct:

- data: member m's box in my inbox is m's x after m's tile's waits, i.e. after m's producers;
- the inbox is reused every other iteration (two slots, by iteration parity). My tile of iteration
  k + 2 overwrites slot k % 2 of m's inbox only after my tile of iteration k + 1 saw m's box of k + 1,
  which m pushed after its tile of iteration k had read slot k % 2 (one task, run in order);
- progress: a member's tile finishes only once every member's tile has started. The scheduler puts a
  meeting's tiles next to each other in the global order every processor list follows, and the
  verifier checks that program order, waits and meetings (each member inherits what the others wait
  for before they start) form no cycle.
"""

from __future__ import annotations

from dataclasses import dataclass

from megaloop.errors import PlanError
from megaloop.plan.memory import align
from megaloop.plan.model import Plan, PlanOp, RankPlan, Task

# Pushed tiles up to this size go as LL lines (data and flag in one store), larger ones as stores +
# release + flag: the two cross near 8-12 KB on 2 H200s (scripts/nvlink_probe.cu, docs/experiments.md).
LL_MAX_TILE_BYTES = 8192


def pushing_tiles(rp: RankPlan) -> dict[int, list[Task]]:
    """Op id -> its tasks in tile order, for every all_reduce of ``rp`` whose tiles push (they read no
    other rank's memory); one pass over the tasks."""
    by_op: dict[int, list[Task]] = {}
    for t in rp.tasks:
        by_op.setdefault(t.op, []).append(t)
    out = {}
    for op in rp.ops:
        tasks = by_op.get(op.id, [])
        if op.op != "all_reduce" or len(op.attrs.get("group") or ()) < 2 or not tasks:
            continue
        if all(acc.rank == rp.rank for t in tasks for acc in t.reads):
            out[op.id] = sorted(tasks, key=lambda t: t.coords)
    return out


def pushes(rp: RankPlan, op: PlanOp) -> bool:
    """Whether ``op`` is an all_reduce whose tiles push."""
    return op.id in pushing_tiles(rp)


def meetings(plan: Plan) -> list[list[tuple[int, int]]]:
    """Every meeting as (rank, task id) per member in group order, tile by tile, for all pushing
    all_reduces. Raises PlanError when members disagree (one pushes and another pulls, or their tiles
    differ): they would wait for data that never comes."""
    if plan.matching is None or plan.world_size < 2:
        return []
    op_of = [{op.node: op for op in rp.ops if op.node is not None} for rp in plan.ranks]
    pushing = [pushing_tiles(rp) for rp in plan.ranks]
    out: list[list[tuple[int, int]]] = []
    for c in plan.matching.collectives:
        if c.op != "all_reduce":
            continue
        ops = [op_of[r].get(node.id) for r, node in zip(c.group, c.nodes)]
        if any(op is None for op in ops):
            continue
        flags = [op.id in pushing[r] for r, op in zip(c.group, ops)]  # type: ignore[union-attr]
        if not any(flags):
            continue
        names = [f"rank {r} {op.name}" for r, op in zip(c.group, ops)]  # type: ignore[union-attr]
        if not all(flags):
            raise PlanError(
                f"all_reduce {names[0]}: {[n for n, f in zip(names, flags) if f]} push but "
                f"{[n for n, f in zip(names, flags) if not f]} pull; give the tile parameter push the same "
                "value on every member"
            )
        tiles = [pushing[r][op.id] for r, op in zip(c.group, ops)]  # type: ignore[union-attr]
        first = tiles[0]
        for name, ts in zip(names[1:], tiles[1:]):
            if [(t.coords, t.writes[0].box) for t in ts] != [(t.coords, t.writes[0].box) for t in first]:
                raise PlanError(
                    f"all_reduce {names[0]} and {name} cut the tensor into different tiles; a pushed tile "
                    "meets the same tile on every member: give them the same tile parameters"
                )
        for i in range(len(first)):
            out.append([(r, ts[i].id) for r, ts in zip(c.group, tiles)])
    return out


@dataclass(frozen=True)
class Inbox:
    offset: int  # bytes from the start of this rank's arena
    ll: bool  # LL lines, or plain stores and a flag per (sender, tile)
    tiles: int
    slot_bytes: int  # one (parity, sender, tile) slot
    nbytes: int  # slots, then (bulk) the (G - 1) x tiles u64 flags


def inboxes(plan: Plan, rank: int) -> dict[int, Inbox]:
    """Op id -> its inbox, for every pushing all_reduce of ``rank``."""
    rp = plan.ranks[rank]
    at = align(rp.arena_bytes)
    out: dict[int, Inbox] = {}
    for op_id, tasks in pushing_tiles(rp).items():
        op = rp.ops[op_id]
        item = rp.tensors[op.inputs[0]].dtype.itemsize
        tile_bytes = max(t.writes[0].box.size for t in tasks) * item
        members = len(op.attrs["group"])
        ll = tile_bytes <= LL_MAX_TILE_BYTES
        slot = -(-tile_bytes // 8) * 16 if ll else -(-tile_bytes // 16) * 16
        senders = members - 1  # the others: a member never writes its own inbox
        nbytes = 2 * senders * len(tasks) * slot + (0 if ll else 8 * senders * len(tasks))
        out[op.id] = Inbox(at, ll, len(tasks), slot, nbytes)
        at += align(nbytes)
    return out


def exchange_region(plan: Plan, rank: int) -> tuple[int, int]:
    """(offset, bytes) of all of ``rank``'s inboxes: zeroed before the kernel starts (no LL flag or
    bulk count matches a zero)."""
    start = align(plan.ranks[rank].arena_bytes)
    boxes = inboxes(plan, rank).values()
    return start, sum(align(b.nbytes) for b in boxes)

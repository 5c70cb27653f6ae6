"""Offsets in one arena per rank: pinned regions for parameters, constants, inputs, state and
outputs, then a scratch pool where intermediates whose lifetimes do not overlap share bytes.

Lifetimes are closed intervals of sequential positions (``PlanOp.seq``): from the first op that
writes a buffer to the last op (on any rank) that reads it. Placement is greedy, largest first, at
the lowest aligned offset that does not collide with an already placed buffer alive at the same
time. Sharing bytes is not free in a loop kernel: the writers of the later tensor must wait for every
reader of the earlier one, which can serialise branches that would otherwise overlap. So sharing is
used only when the scratch pool would otherwise exceed ``budget`` bytes, and then only for buffers of
at least ``reuse_min_bytes``; everything else (all of a decode step's activations, typically) gets
bytes of its own, as does everything with ``reuse=False``.
"""

from __future__ import annotations

from dataclasses import dataclass

from megaloop.plan.model import BUFFER_KINDS

ALIGN = 256  # bytes: wide enough for 16-byte vector access and the bulk-copy engine's 128-byte rule


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class Request:
    key: int  # caller's id for the buffer
    kind: str
    nbytes: int
    first: int  # lifetime [first, last] in sequential positions (scratch only)
    last: int


@dataclass
class Layout:
    offsets: dict[int, int]
    arena_bytes: int
    scratch_bytes: int  # size of the scratch pool after reuse
    scratch_unshared: int  # what the pool would need without reuse
    region_bytes: dict[str, int]


REUSE_MIN_BYTES = 1 << 20
SCRATCH_BUDGET = 4 << 30


def place(
    requests: list[Request], reuse: bool = True, budget: int = SCRATCH_BUDGET, reuse_min_bytes: int | None = None
) -> Layout:
    if reuse_min_bytes is None:  # read at call time, so that tests can lower it
        reuse_min_bytes = REUSE_MIN_BYTES
    offsets: dict[int, int] = {}
    at = 0
    regions: dict[str, int] = {}
    for kind in BUFFER_KINDS:
        if kind == "scratch":
            continue
        start = at
        for r in requests:
            if r.kind == kind:
                offsets[r.key] = at
                at += align(r.nbytes)
        regions[kind] = at - start
    pool_start = at
    scratch = sorted((r for r in requests if r.kind == "scratch"), key=lambda r: (-r.nbytes, r.first, r.key))
    share = reuse and sum(align(r.nbytes) for r in scratch) > budget
    shared = [r for r in scratch if share and r.nbytes >= reuse_min_bytes]
    private = [r for r in scratch if not (share and r.nbytes >= reuse_min_bytes)]
    placed: list[tuple[int, int, Request]] = []  # (offset, end, request) inside the pool
    pool_end = 0
    for r in shared:
        size = align(r.nbytes)
        busy = sorted((o, e) for o, e, q in placed if q.first <= r.last and r.first <= q.last)
        offset = 0
        for o, e in busy:  # first gap large enough
            if offset + size <= o:
                break
            offset = max(offset, e)
        placed.append((offset, offset + size, r))
        pool_end = max(pool_end, offset + size)
        offsets[r.key] = pool_start + offset
    for r in private:  # after everything shared: these bytes belong to one buffer only
        offsets[r.key] = pool_start + pool_end
        pool_end += align(r.nbytes)
    regions["scratch"] = pool_end
    return Layout(offsets, pool_start + pool_end, pool_end, sum(align(r.nbytes) for r in scratch), regions)

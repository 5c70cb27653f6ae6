"""Offsets in one arena per rank: pinned regions for parameters, constants, inputs, state and
outputs, then a scratch pool where intermediates whose lifetimes do not overlap share bytes.

Lifetimes are closed intervals of sequential positions (``PlanOp.seq``): from the first op that
writes a buffer to the last op (on any rank) that reads it. Placement is greedy, largest first, at
the lowest aligned offset that does not collide with an already placed buffer alive at the same
time; with ``reuse=False`` every buffer gets bytes of its own.
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


def place(requests: list[Request], reuse: bool = True) -> Layout:
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
    placed: list[tuple[int, int, Request]] = []  # (offset, end, request) inside the pool
    pool_end = 0
    for r in scratch:
        size = align(r.nbytes)
        if not reuse:
            offset = pool_end
        else:
            busy = sorted((o, e) for o, e, q in placed if q.first <= r.last and r.first <= q.last)
            offset = 0
            for o, e in busy:  # first gap large enough
                if offset + size <= o:
                    break
                offset = max(offset, e)
        placed.append((offset, offset + size, r))
        pool_end = max(pool_end, offset + size)
        offsets[r.key] = pool_start + offset
    regions["scratch"] = pool_end
    return Layout(offsets, pool_start + pool_end, pool_end, sum(align(r.nbytes) for r in scratch), regions)

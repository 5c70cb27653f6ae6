"""From "task a must come before task c" requirements to the fewest counter waits that guarantee them.

Each task signals its own counter once per iteration. Happens-before (HB) among task instances comes
from two sources only: program order on a processor, and waits. Because each processor runs its list
in order, what HB-precedes a task on processor p is a prefix of p's list, so the whole ancestry of a
task is a vector clock: for every processor, the last position known to have finished. A requirement
(a before c) holds when a's position is within c's clock.

For each task, in an order consistent with HB, the clock starts from its program predecessor; for
every requirement not yet covered a wait on the producer is added (latest producers first, since
their clocks cover the most), and afterwards every wait whose removal leaves all requirements covered
is dropped again. The result is irredundant: removing any single wait leaves some conflicting pair
unordered, which is what the verifier's mutation tests rely on.

Iteration 1 is the steady state: lag-0 waits are fixed from iteration 0 (paths between same-
iteration instances never leave the iteration), then lag-1 requirements (previous iteration's
instance first) are covered the same way with clocks of iteration 0.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

import numpy as np

from megaloop.errors import InternalError


@dataclass
class Layout:
    """Processor placement of global tasks: ``proc[g]`` (global processor), ``index[g]`` (position
    in its list) and the lists themselves."""

    proc: np.ndarray
    index: np.ndarray
    lists: list[list[int]]

    @property
    def processors(self) -> int:
        return len(self.lists)


def program_predecessors(layout: Layout) -> np.ndarray:
    pred = np.full(len(layout.proc), -1, np.int64)
    for lst in layout.lists:
        for a, b in itertools.pairwise(lst):
            pred[b] = a
    return pred


def hb_order(layout: Layout, req0: list[list[int]]) -> list[int] | None:
    """A topological order of program order plus same-iteration requirements (None on a cycle)."""
    n = len(layout.proc)
    succ: list[list[int]] = [[] for _ in range(n)]
    indeg = np.zeros(n, np.int64)
    pred = program_predecessors(layout)
    for c in range(n):
        if pred[c] >= 0:
            succ[pred[c]].append(c)
            indeg[c] += 1
        for a in req0[c]:
            succ[a].append(c)
            indeg[c] += 1
    heap = [c for c in range(n) if indeg[c] == 0]
    heapq.heapify(heap)
    order = []
    while heap:
        a = heapq.heappop(heap)
        order.append(a)
        for c in succ[a]:
            indeg[c] -= 1
            if indeg[c] == 0:
                heapq.heappush(heap, c)
    return order if len(order) == n else None


def deadlock_cycle(layout: Layout, req0: list[list[int]]) -> list[int]:
    """Tasks that wait on each other in a loop (when ``hb_order`` found none): each needs the one
    before it in the list to have run (program order or a requirement), the first needs the last."""
    n = len(layout.proc)
    pred = program_predecessors(layout)
    needs = [([int(pred[c])] if pred[c] >= 0 else []) + list(req0[c]) for c in range(n)]
    done = set(hb_order_partial(n, needs))
    start = next(c for c in range(n) if c not in done)
    path: list[int] = []
    seen: dict[int, int] = {}
    c = start
    while c not in seen:
        seen[c] = len(path)
        path.append(c)
        c = next(a for a in needs[c] if a not in done)  # a stuck task waits on another stuck task
    return path[seen[c] :][::-1]


def hb_order_partial(n: int, needs: list[list[int]]) -> list[int]:
    """Kahn's order over ``needs`` (predecessor lists), as far as it goes."""
    succ: list[list[int]] = [[] for _ in range(n)]
    indeg = [len(x) for x in needs]
    for c, xs in enumerate(needs):
        for a in xs:
            succ[a].append(c)
    ready = [c for c in range(n) if indeg[c] == 0]
    order = []
    while ready:
        a = ready.pop()
        order.append(a)
        for c in succ[a]:
            indeg[c] -= 1
            if indeg[c] == 0:
                ready.append(c)
    return order


def derive_waits(
    layout: Layout, req0: list[list[int]], req1: list[list[int]], order: list[int]
) -> list[list[tuple[int, int]]]:
    """Waits per task as (producer task, lag); ``order`` must be consistent with program order and req0."""
    n, g = len(layout.proc), layout.processors
    proc, index = layout.proc, layout.index
    lengths = np.array([len(lst) for lst in layout.lists], np.int64)
    pred = program_predecessors(layout)
    last = {p: lst[-1] for p, lst in enumerate(layout.lists) if lst}
    rank_in_order = np.empty(n, np.int64)
    rank_in_order[np.asarray(order, np.int64)] = np.arange(n)
    vc0 = np.full((n, g), -1, np.int64)
    vc1 = np.full((n, g), -1, np.int64)
    waits: list[list[tuple[int, int]]] = [[] for _ in range(n)]

    def cover(base: np.ndarray, need: np.ndarray, clocks: np.ndarray) -> list[int]:
        """Waits for the producers in ``need`` not yet covered by ``base``: greedily, latest first,
        then only those no other chosen wait already happens after (an antichain: irredundant)."""
        chosen: list[int] = []
        cur = base.copy()
        for a in need[np.argsort(-rank_in_order[need], kind="stable")].tolist():
            if index[a] > cur[proc[a]]:
                chosen.append(a)
                np.maximum(cur, clocks[a], out=cur)
        if len(chosen) > 1:
            ch = np.asarray(chosen)
            seen = clocks[ch][:, proc[ch]]  # seen[x, j]: how far chosen x's clock reaches on chosen j's processor
            np.fill_diagonal(seen, -1)
            chosen = ch[~(seen.max(axis=0) >= index[ch])].tolist()
        return chosen

    req0_arr = [np.asarray(r, np.int64) for r in req0]
    req1_arr = [np.asarray(r, np.int64) for r in req1]
    no_clock = np.full(g, -1, np.int64)
    proc_l, index_l, pred_l = proc.tolist(), index.tolist(), pred.tolist()

    for c in order:  # iteration 0: same-iteration requirements
        row = vc0[c]  # filled in place
        row[:] = vc0[pred_l[c]] if pred_l[c] >= 0 else no_clock
        row[proc_l[c]] = index_l[c]
        need = req0_arr[c]
        if len(need):
            need = need[index[need] > row[proc[need]]]
            if len(need):
                chosen = cover(row, need, vc0)
                for a in chosen:
                    np.maximum(row, vc0[a], out=row)
                waits[c] = [(a, 0) for a in chosen]
    for c in order:  # iteration 1: clocks count positions of iteration 1 as length + index
        row = vc1[c]
        row[:] = vc1[pred_l[c]] if pred_l[c] >= 0 else vc0[last[proc_l[c]]]
        row[proc_l[c]] = lengths[proc_l[c]] + index_l[c]
        for a, _ in waits[c]:
            np.maximum(row, vc1[a], out=row)
        need = req1_arr[c]
        if len(need):
            need = need[index[need] > row[proc[need]]]
            if len(need):
                chosen = cover(row, need, vc0)
                for a in chosen:
                    np.maximum(row, vc0[a], out=row)
                waits[c] = waits[c] + [(a, 1) for a in chosen]
    _self_check(layout, req0, req1, vc0, vc1, order)
    return waits


def _self_check(
    layout: Layout, req0: list[list[int]], req1: list[list[int]], vc0: np.ndarray, vc1: np.ndarray, order: list[int]
) -> None:
    """Every requirement is covered in the steady state (iteration 1); the verifier checks the plan
    independently, this only guards the derivation itself."""
    lengths = np.array([len(lst) for lst in layout.lists], np.int64)
    for reqs, shift in ((req0, True), (req1, False)):
        after = np.repeat(np.arange(len(reqs)), [len(r) for r in reqs])
        before = np.fromiter((a for r in reqs for a in r), np.int64, len(after))
        p = layout.proc[before]
        pos = layout.index[before] + (lengths[p] if shift else 0)
        bad = np.flatnonzero(pos > vc1[after, p])
        if len(bad):
            raise InternalError(f"task {after[bad[0]]}: requirement on task {before[bad[0]]} not covered")

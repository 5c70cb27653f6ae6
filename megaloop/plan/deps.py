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

Groups (all of one set before all of another: buffers sharing bytes) enter once tasks are placed, as
the last member of one set on each processor before the first member of the other on each processor:
program order does the rest, so the waits are those of the groups spelled out pair by pair.

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


@dataclass
class Waits:
    """Task c waits on ``producer[start[c]:start[c + 1]]`` (global tasks) with those ``lag``s."""

    start: np.ndarray
    producer: np.ndarray
    lag: np.ndarray

    def of(self, c: int) -> list[tuple[int, int]]:
        lo, hi = int(self.start[c]), int(self.start[c + 1])
        return list(zip(self.producer[lo:hi].tolist(), self.lag[lo:hi].tolist()))


@dataclass
class Groups:
    """Requirements kept as groups: every task of set ``before[k]`` before every task of set
    ``after[k]``, ``lag[k]`` iterations apart (buffers sharing bytes: the last users of one before the
    first writers of the other). Set s holds ``members[start[s]:start[s + 1]]`` (sorted). Spelled out
    task by task, a group of thousands of tiles on each side would be millions of requirements."""

    start: np.ndarray
    members: np.ndarray
    before: np.ndarray
    after: np.ndarray
    lag: np.ndarray

    @staticmethod
    def none() -> Groups:
        empty = np.empty(0, np.int64)
        return Groups(np.zeros(1, np.int64), empty, empty, empty, empty)

    def tasks(self, s: int) -> np.ndarray:
        return self.members[self.start[s] : self.start[s + 1]]

    def dense(self, n: int) -> tuple[list[list[int]], list[list[int]]]:
        """Every group as per-task requirements (req0, req1) of ``n`` tasks: small plans and tests only."""
        out: tuple[list[list[int]], list[list[int]]] = ([[] for _ in range(n)], [[] for _ in range(n)])
        for b, a, lag in zip(self.before.tolist(), self.after.tolist(), self.lag.tolist()):
            for c in self.tasks(a).tolist():
                out[lag][c].extend(self.tasks(b).tolist())
        return out

    def last_per_processor(self, layout: Layout) -> np.ndarray:
        """(sets, processors): the highest list position among each set's members, -1 where none."""
        counts = np.diff(self.start)
        out = np.full((len(counts), layout.processors), -1, np.int64)
        owner = np.repeat(np.arange(len(counts)), counts)
        np.maximum.at(out, (owner, layout.proc[self.members]), layout.index[self.members])
        return out


def program_predecessors(layout: Layout) -> np.ndarray:
    pred = np.full(len(layout.proc), -1, np.int64)
    for lst in layout.lists:
        for a, b in itertools.pairwise(lst):
            pred[b] = a
    return pred


def hb_order(layout: Layout, req0: list[list[int]], groups: Groups | None = None) -> list[int] | None:
    """The least topological order (smallest task first among those ready) of program order plus
    same-iteration requirements (None on a cycle)."""
    n = len(layout.proc)
    pred = program_predecessors(layout)
    before, start = _grouped(req0, *_group_pairs(layout, groups, 0))
    has_pred = pred >= 0
    src = np.concatenate([pred[has_pred], before])
    dst = np.concatenate([np.flatnonzero(has_pred), np.repeat(np.arange(n), np.diff(start))])
    by = np.argsort(src, kind="stable")
    succ, first = dst[by].tolist(), np.searchsorted(src[by], np.arange(n + 1)).tolist()
    indeg = np.bincount(dst, minlength=n).tolist()
    heap = [c for c in range(n) if indeg[c] == 0]
    heapq.heapify(heap)
    order = []
    while heap:
        a = heapq.heappop(heap)
        order.append(a)
        for c in succ[first[a] : first[a + 1]]:
            indeg[c] -= 1
            if indeg[c] == 0:
                heapq.heappush(heap, c)
    return order if len(order) == n else None


def deadlock_cycle(layout: Layout, req0: list[list[int]], groups: Groups | None = None) -> list[int]:
    """Tasks that wait on each other in a loop (when ``hb_order`` found none): each needs the one
    before it in the list to have run (program order or a requirement), the first needs the last."""
    n = len(layout.proc)
    pred = program_predecessors(layout)
    before, start = _grouped(req0, *_group_pairs(layout, groups, 0))
    needs = [([int(pred[c])] if pred[c] >= 0 else []) + before[start[c] : start[c + 1]].tolist() for c in range(n)]
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


def _ranges(start: np.ndarray, stop: np.ndarray) -> np.ndarray:
    """The concatenation of ``range(start[i], stop[i])`` for every i."""
    sizes = stop - start
    ends = np.cumsum(sizes)
    return np.arange(int(ends[-1]) if len(ends) else 0) + np.repeat(start - ends + sizes, sizes)


def _grouped(
    reqs: list[list[int]], more_after: np.ndarray | None = None, more_before: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Requirements as arrays: ``before`` (the producers, each task's in its list's order; with
    ``more_after[k]`` -> ``more_before[k]`` added, each task's distinct producers by task number) and
    ``start`` (task c's producers are ``before[start[c]:start[c + 1]]``)."""
    n = len(reqs)
    sizes = np.fromiter(map(len, reqs), np.int64, n)
    start = np.concatenate([[0], np.cumsum(sizes)])
    before = np.fromiter(itertools.chain.from_iterable(reqs), np.int64, int(start[-1]))
    if more_after is None or not len(more_after):
        return before, start
    key = np.sort(np.concatenate([np.repeat(np.arange(n), sizes), more_after]) * n + np.append(before, more_before))
    key = key[np.append(True, key[1:] != key[:-1])]
    return key % n, np.searchsorted(key // n, np.arange(n + 1))


def _group_pairs(layout: Layout, groups: Groups | None, lag: int) -> tuple[np.ndarray, np.ndarray]:
    """(after, before) task pairs that stand for the groups of ``lag`` once tasks are placed: the
    last member of a ``before`` set on each processor before the first member of its ``after`` set on
    each processor; program order orders the rest (the same happens-before, at most processors^2)."""
    empty = np.empty(0, np.int64)
    if groups is None or not np.any(groups.lag == lag):
        return empty, empty
    sel = groups.lag == lag
    last = groups.last_per_processor(layout)
    needed = np.full((len(last), layout.processors), -1, np.int64)  # per after set: positions to follow
    np.maximum.at(needed, groups.after[sel], last[groups.before[sel]])
    lists = [np.asarray(lst, np.int64) for lst in layout.lists]
    after_parts, before_parts = [], []
    for a in np.unique(groups.after[sel]).tolist():
        members = groups.tasks(a)
        by = np.lexsort((layout.index[members], layout.proc[members]))
        p = layout.proc[members[by]]
        firsts = members[by][np.append(True, p[1:] != p[:-1])]
        procs = np.flatnonzero(needed[a] >= 0)
        reps = np.array([lists[q][needed[a, q]] for q in procs.tolist()], np.int64)
        after_parts.append(np.repeat(firsts, len(reps)))
        before_parts.append(np.tile(reps, len(firsts)))
    return np.concatenate(after_parts), np.concatenate(before_parts)


def levels(n: int, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """Each node's longest-path depth over the edges ``src -> dst`` (-1 for nodes on or after a
    cycle): nodes of one level have no edges between them, so their clocks can be found together."""
    by_src = np.argsort(src, kind="stable")
    out_dst = dst[by_src]
    out_start = np.searchsorted(src[by_src], np.arange(n + 1))
    indeg = np.bincount(dst, minlength=n)
    level = np.full(n, -1, np.int64)
    frontier, depth = np.flatnonzero(indeg == 0), 0
    while len(frontier):
        level[frontier] = depth
        reached, count = np.unique(out_dst[_ranges(out_start[frontier], out_start[frontier + 1])], return_counts=True)
        indeg[reached] -= count
        frontier, depth = reached[indeg[reached] == 0], depth + 1
    return level


def derive_waits(
    layout: Layout, req0: list[list[int]], req1: list[list[int]], order: list[int], groups: Groups | None = None
) -> Waits:
    """Waits per task, latest producer (in ``order``) first; ``order`` must
    be consistent with program order and req0. Tasks are handled a level (``levels``) at a time."""
    n, g = len(layout.proc), layout.processors
    proc, index = layout.proc, layout.index
    lengths = np.array([len(lst) for lst in layout.lists], np.int64)
    pred = program_predecessors(layout)
    has_pred = pred >= 0
    before0, start0 = _grouped(req0, *_group_pairs(layout, groups, 0))
    before1, start1 = _grouped(req1, *_group_pairs(layout, groups, 1))
    after0 = np.repeat(np.arange(n), np.diff(start0))
    level = levels(n, np.concatenate([pred[has_pred], before0]), np.concatenate([np.flatnonzero(has_pred), after0]))
    if np.any(level < 0):
        raise InternalError("derive_waits: program order and requirements form a cycle (hb_order found none)")
    by_level = np.argsort(level, kind="stable")
    bounds = np.searchsorted(level[by_level], np.arange(int(level.max(initial=-1)) + 2))
    # clocks hold positions of two iterations; row n is "no clock" (before a list's first task)
    dtype = np.int16 if 2 * int(lengths.max(initial=0)) < np.iinfo(np.int16).max else np.int32
    vc0 = np.full((n + 1, g), -1, dtype)
    vc1 = np.full((n + 1, g), -1, dtype)
    pred_row = np.where(has_pred, pred, n)
    last = np.array([lst[-1] if lst else n for lst in layout.lists], np.int64)
    chosen: list[tuple[np.ndarray, np.ndarray, int]] = [(np.empty(0, np.int64), np.empty(0, np.int64), 0)]
    lag0: list[tuple[np.ndarray, np.ndarray]] = []
    for k in range(len(bounds) - 1):  # iteration 0: same-iteration requirements
        tasks = by_level[bounds[k] : bounds[k + 1]]
        row = vc0[pred_row[tasks]]
        row[np.arange(len(tasks)), proc[tasks]] = index[tasks]
        local, a = _cover(row, tasks, before0, start0, vc0, proc, index)
        vc0[tasks] = row
        lag0.append((local, a))
        chosen.append((tasks[local], a, 0))
    for k in range(len(bounds) - 1):  # iteration 1: positions of iteration 1 count as length + index
        tasks = by_level[bounds[k] : bounds[k + 1]]
        row = vc1[pred_row[tasks]]
        first = ~has_pred[tasks]
        row[first] = vc0[last[proc[tasks[first]]]]
        row[np.arange(len(tasks)), proc[tasks]] = lengths[proc[tasks]] + index[tasks]
        local, a = lag0[k]
        if len(a):
            _merge(row, local, vc1[a])
        local, a = _cover(row, tasks, before1, start1, vc0, proc, index)
        vc1[tasks] = row
        chosen.append((tasks[local], a, 1))
    _self_check(lengths, layout, (before0, start0), (before1, start1), vc1)
    c = np.concatenate([x[0] for x in chosen])
    a = np.concatenate([x[1] for x in chosen])
    lag = np.concatenate([np.full(len(x[0]), x[2], np.int64) for x in chosen])
    rank_in_order = np.empty(n, np.int64)
    rank_in_order[np.asarray(order, np.int64)] = np.arange(n)
    by = np.lexsort((-rank_in_order[a], lag, c))
    return Waits(np.searchsorted(c[by], np.arange(n + 1)), a[by], lag[by])


def _merge(row: np.ndarray, local: np.ndarray, clocks: np.ndarray) -> None:
    """``row[local[j]] = max(row[local[j]], clocks[j])`` for every j; ``local`` is sorted."""
    first = np.flatnonzero(np.concatenate([[True], local[1:] != local[:-1]]))
    seg = local[first]
    row[seg] = np.maximum(row[seg], np.maximum.reduceat(clocks, first, axis=0))


def _cover(
    row: np.ndarray,
    tasks: np.ndarray,
    before: np.ndarray,
    start: np.ndarray,
    clocks: np.ndarray,
    proc: np.ndarray,
    index: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """The waits that cover the producers of ``tasks`` (one level) not already covered by their
    clocks ``row``: the producers no other producer of the task happens after, i.e. the maximal ones
    (an antichain: irredundant). ``row`` becomes the clocks with the waits; returns (row index, producer).

    Maximal, because clocks are closed downwards: a producer x happens before another, y, iff y's
    clock without y itself reaches x's position, so a producer is covered by the others exactly when
    the max of their strict clocks (own entry one less) reaches it; its own strict clock never does."""
    sizes = start[tasks + 1] - start[tasks]
    a = before[_ranges(start[tasks], start[tasks + 1])]
    local = np.repeat(np.arange(len(tasks)), sizes)
    p, i = proc[a], index[a]
    keep = i > row[local, p]
    a, local, p, i = a[keep], local[keep], p[keep], i[keep]
    if not len(a):
        return local, a
    strict = clocks[a]
    strict[np.arange(len(a)), p] = i - 1
    _merge(row, local, strict)
    keep = i > row[local, p]
    a, local, p, i = a[keep], local[keep], p[keep], i[keep]
    row[local, p] = i  # the chosen are on distinct processors (a later one would cover an earlier)
    return local, a


def _self_check(
    lengths: np.ndarray,
    layout: Layout,
    req0: tuple[np.ndarray, np.ndarray],
    req1: tuple[np.ndarray, np.ndarray],
    vc1: np.ndarray,
) -> None:
    """Every requirement is covered in the steady state (iteration 1); the verifier checks the plan
    independently, this only guards the derivation itself."""
    for (before, start), shift in ((req0, True), (req1, False)):
        after = np.repeat(np.arange(len(start) - 1), np.diff(start))
        p = layout.proc[before]
        pos = layout.index[before] + (lengths[p] if shift else 0)
        bad = np.flatnonzero(pos > vc1[after, p])
        if len(bad):
            raise InternalError(f"task {after[bad[0]]}: requirement on task {before[bad[0]]} not covered")

"""Static schedule: which processor runs each task, in what order.

Tasks are placed one at a time in order of depth: a task's depth is one more than its deepest
same-iteration producer's, and among the tasks whose producers are all placed the shallowest goes
next (program order breaks ties). Each goes to the processor of its rank that can start it soonest,
given when the tasks it depends on are estimated to finish; on a tie the processor that ran one of
its producers wins (its data is warm). Every processor's list is then a subsequence of one global
order (the order of placement) that respects all same-iteration dependencies, so no cycle of waits
can arise.

Why depth, not program order: in ``silu(x @ Wg) * (x @ Wu)`` the silu comes before the up projection
in program order, so its tasks would take the processors that the gate's last partial wave leaves free
and wait there, the up projection queued behind them; by depth the two projections are level and go
first. Why not by estimated readiness: that follows the cost model, and where the model is off
(matmuls run at about half the math rate below) the order it gives interleaves ropes, cache updates
and attention tiles badly (docs/experiments.md has the prefill measured both ways).

The cost model is deliberately simple (megaloop.frontend.tiling.task_cost_ns): per task, a fixed
overhead plus the larger of its memory time and its math time at a per-processor share of the chip's
measured rates.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from megaloop.errors import DeadlockError
from megaloop.frontend.tiling import RATES, Rates, task_cost_ns

__all__ = ["RATES", "Rates", "Schedule", "list_schedule", "task_cost_ns"]


@dataclass
class Schedule:
    processor: list[int]  # per task in the order given: processor index on its rank
    lists: list[list[list[int]]]  # per rank, per processor: positions (in the given order) of its tasks
    start_ns: list[float]
    finish_ns: list[float]
    makespan_ns: float


def list_schedule(
    ranks: list[int],
    costs: list[float],
    preds: list[list[int]],
    processors: int,
    world: int,
    groups: list[list[int]] | None = None,
    gates: Gates | None = None,
) -> Schedule:
    """``ranks[i]``, ``costs[i]`` and ``preds[i]`` (positions of same-iteration predecessors, all < i)
    describe task i of a sequence already in dependency order. ``groups``: positions that are placed
    one right after another (a meeting's tiles, megaloop.plan.rendezvous), as one task whose producers
    are all its members' producers. ``gates``: more predecessors, a whole set at a time (after
    ``preds[i]`` in the order of producers)."""
    n = len(costs)
    gates = Gates([], []) if gates is None else gates
    gate_state = _GateState(gates)
    unit = list(range(n))  # the group a position belongs to, named by its first position
    members: dict[int, list[int]] = {}
    for g in groups or []:
        for i in g:
            unit[i] = g[0]
        members[g[0]] = list(g)
    succs: list[list[int]] = [[] for _ in range(n)]
    missing = [0] * n  # per unit: producers in other units not yet placed
    for i, ps in enumerate(preds):
        for p in ps:
            succs[p].append(i)
            if unit[p] != unit[i]:
                missing[unit[i]] += 1
    for i, sets in gate_state.closed_by.items():
        missing[unit[i]] += len(sets)
    free = [[0.0] * processors for _ in range(world)]
    proc = [0] * n
    start = [0.0] * n
    finish = [0.0] * n
    lists: list[list[list[int]]] = [[[] for _ in range(processors)] for _ in range(world)]
    depth = [0] * n  # per unit: one more than its deepest producer's (known once all are placed)
    ready = [0.0] * n  # per task: when its producers are estimated to finish (known once all are placed)
    heap = [(0, u) for u in range(n) if unit[u] == u and missing[u] == 0]
    heapq.heapify(heap)
    placed = 0
    while heap:
        _, u = heapq.heappop(heap)
        for i in members.get(u, (u,)):
            r, fr = ranks[i], free[ranks[i]]
            at = ready[i]  # every producer is placed (one in its own group just before it)
            earliest = min(fr)
            soonest = max(earliest, at)
            pick = next((proc[p] for p in preds[i] if ranks[p] == r and fr[proc[p]] <= soonest), None)
            if pick is None and i in gate_state.closed_by:
                pick = next((p for p in gate_state.candidates(i, r) if fr[p] <= soonest), None)
            if pick is None:
                pick = fr.index(earliest)
            proc[i] = pick
            start[i] = max(fr[pick], at)
            finish[i] = start[i] + costs[i]
            fr[pick] = finish[i]
            lists[r][pick].append(i)
            placed += 1
            for c in succs[i]:
                if finish[i] > ready[c]:
                    ready[c] = finish[i]
                v = unit[c]
                if v == u:
                    continue
                depth[v] = max(depth[v], depth[u] + 1)
                missing[v] -= 1
                if missing[v] == 0:
                    heapq.heappush(heap, (depth[v], v))
            for c, at_c, depth_c in gate_state.placed(i, r, pick, finish[i], depth[u]):
                v = unit[c]
                ready[c] = max(ready[c], at_c)
                depth[v] = max(depth[v], depth_c + 1)
                missing[v] -= 1
                if missing[v] == 0:
                    heapq.heappush(heap, (depth[v], v))
    if placed < n:
        stuck = next(i for i in range(n) if missing[unit[i]] > 0)
        raise DeadlockError(
            f"plan: task {stuck} of the schedule's order can never be placed: its group "
            f"{members.get(unit[stuck], [stuck])} (a meeting's tiles, which run together) depends on itself "
            "through another group"
        )
    return Schedule(proc, lists, start, finish, max(finish, default=0.0))


@dataclass
class Gates:
    """Predecessors a set at a time: every position of ``sets[b]`` before every position of
    ``sets[a]``, for each ``(b, a)`` of ``pairs`` (buffers sharing bytes, megaloop.plan.hazards).
    A set's positions are in the order of their tasks' ids."""

    sets: list[list[int]]
    pairs: list[tuple[int, int]]


class _GateState:
    """Which sets are placed, and what opens when one is: per set that follows others, the latest
    finish and depth among them, and the processors its members prefer (``candidates``)."""

    def __init__(self, gates: Gates) -> None:
        self.gates = gates
        self.member_of: dict[int, list[tuple[int, int]]] = {}  # position -> (before set, place in it)
        self.left = [len(m) for m in gates.sets]
        self.into: dict[int, list[int]] = {}  # before set -> the after sets it closes
        self.from_: dict[int, list[int]] = {}  # after set -> its before sets
        self.waiting = [0] * len(gates.sets)  # after set -> before sets not yet placed
        self.closed_by: dict[int, list[int]] = {}  # position -> the after sets it is in
        for b, a in gates.pairs:
            self.into.setdefault(b, []).append(a)
            self.from_.setdefault(a, []).append(b)
            self.waiting[a] += 1
        for b in self.into:
            for k, i in enumerate(gates.sets[b]):
                self.member_of.setdefault(i, []).append((b, k))
        for a in dict.fromkeys(a for _, a in gates.pairs):
            for i in gates.sets[a]:
                self.closed_by.setdefault(i, []).append(a)
        self.finish = [0.0] * len(gates.sets)
        self.depth = [0] * len(gates.sets)
        self.first_on: list[dict[tuple[int, int], int]] = [{} for _ in gates.sets]  # (rank, proc) -> first place
        self.prefer: dict[int, list[tuple[int, int]]] = {}  # after set -> (rank, proc), first producers first

    def placed(self, i: int, rank: int, proc: int, finish: float, depth: int) -> list[tuple[int, float, int]]:
        """Position ``i`` is placed; the positions of the sets it opens, with their producers' latest
        finish and greatest depth."""
        out = []
        for b, k in self.member_of.get(i, ()):
            self.left[b] -= 1
            self.finish[b] = max(self.finish[b], finish)
            self.depth[b] = max(self.depth[b], depth)
            on = self.first_on[b]
            on[rank, proc] = min(on.get((rank, proc), k), k)
            if self.left[b]:
                continue
            for a in self.into[b]:
                self.finish[a] = max(self.finish[a], self.finish[b])
                self.depth[a] = max(self.depth[a], self.depth[b])
                self.waiting[a] -= 1
                if not self.waiting[a]:
                    out += [(c, self.finish[a], self.depth[a]) for c in self.gates.sets[a]]
        return out

    def candidates(self, i: int, rank: int) -> list[int]:
        """The processors of rank ``rank`` that ran a set-producer of ``i``, in the order of producers."""
        procs: list[int] = []
        for a in self.closed_by[i]:
            if a not in self.prefer:
                self.prefer[a] = self._prefer(a)
            procs += [p for r, p in self.prefer[a] if r == rank]
        return procs

    def _prefer(self, a: int) -> list[tuple[int, int]]:
        seen: dict[tuple[int, int], None] = {}
        for b in self.from_[a]:
            seen.update((key, None) for key, _ in sorted(self.first_on[b].items(), key=lambda kv: kv[1]))
        return list(seen)

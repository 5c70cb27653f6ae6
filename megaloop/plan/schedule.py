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
) -> Schedule:
    """``ranks[i]``, ``costs[i]`` and ``preds[i]`` (positions of same-iteration predecessors, all < i)
    describe task i of a sequence already in dependency order. ``groups``: positions that are placed
    one right after another (a meeting's tiles, megaloop.plan.rendezvous), as one task whose producers
    are all its members' producers."""
    n = len(costs)
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
    if placed < n:
        stuck = next(i for i in range(n) if missing[unit[i]] > 0)
        raise DeadlockError(
            f"plan: task {stuck} of the schedule's order can never be placed: its group "
            f"{members.get(unit[stuck], [stuck])} (a meeting's tiles, which run together) depends on itself "
            "through another group"
        )
    return Schedule(proc, lists, start, finish, max(finish, default=0.0))

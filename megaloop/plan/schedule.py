"""Static schedule: which processor runs each task, in what order.

Tasks are taken in the program's sequential order (op by op) and each goes to the processor of its
rank that can start it soonest, given when the tasks it depends on are estimated to finish; on a tie
the processor that ran one of its producers wins (its data is warm). Every processor's list is
then a subsequence of one global order that respects all same-iteration dependencies, so no cycle of
waits can arise. The cost model is deliberately simple: per task, a fixed overhead plus the larger of
its memory time and its math time at a per-processor share of the chip's measured rates.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Rates:
    hbm: float  # bytes/s, whole chip (device-to-device copy, read + write)
    math: float  # flop/s, whole chip (dense bf16 tensor cores)
    peer: float  # bytes/s to another GPU (NVLink), whole chip
    task_overhead_ns: float = 600.0  # dependency check, signal and task dispatch


# Measured on H200 (ARCHITECTURE.md) for sm_90; vendor figures for the others.
RATES = {
    "sm_90": Rates(hbm=4.2e12, math=790e12, peer=394e9),
    "sm_80": Rates(hbm=1.9e12, math=300e12, peer=250e9),
    "sm_86": Rates(hbm=0.9e12, math=140e12, peer=50e9),
    "sm_89": Rates(hbm=0.95e12, math=300e12, peer=30e9),
}


def task_cost_ns(arch: str, processors: int, local_bytes: int, remote_bytes: int, flops: int) -> float:
    r = RATES[arch]
    share = 1.0 / processors
    seconds = max(local_bytes / (r.hbm * share), remote_bytes / (r.peer * share), flops / (r.math * share))
    return r.task_overhead_ns + seconds * 1e9


@dataclass
class Schedule:
    processor: list[int]  # per task in the order given: processor index on its rank
    lists: list[list[list[int]]]  # per rank, per processor: positions (in the given order) of its tasks
    start_ns: list[float]
    finish_ns: list[float]
    makespan_ns: float


def list_schedule(
    ranks: list[int], costs: list[float], preds: list[list[int]], processors: int, world: int
) -> Schedule:
    """``ranks[i]``, ``costs[i]`` and ``preds[i]`` (positions of same-iteration predecessors, all < i)
    describe task i of a sequence already in dependency order."""
    free = [[0.0] * processors for _ in range(world)]
    proc = [0] * len(costs)
    start = [0.0] * len(costs)
    finish = [0.0] * len(costs)
    lists: list[list[list[int]]] = [[[] for _ in range(processors)] for _ in range(world)]
    for i, (r, cost) in enumerate(zip(ranks, costs)):
        ready = max((finish[p] for p in preds[i]), default=0.0)
        fr = free[r]
        earliest = min(fr)
        soonest = max(earliest, ready)
        pick = next((proc[p] for p in preds[i] if ranks[p] == r and fr[proc[p]] <= soonest), None)
        if pick is None:
            pick = fr.index(earliest)
        proc[i] = pick
        start[i] = max(fr[pick], ready)
        finish[i] = start[i] + cost
        fr[pick] = finish[i]
        lists[r][pick].append(i)
    return Schedule(proc, lists, start, finish, max(finish, default=0.0))

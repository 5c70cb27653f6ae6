"""Which weights each processor pulls into L2 ahead of the tasks that read them.

A decode step is a chain of dependent stages; most processors wait most of the step (for an
attention, a norm, a residual add) while memory idles, then every one of them streams its block of
weights at once. Weights (parameter buffers) never change while the kernel runs, so a processor
may fetch its next tasks' blocks into L2 as soon as it starts waiting, and the tasks then read them
from L2. Prefetching is only a hint to the cache (L2 is where every SM's view of memory meets), so it
cannot change a result, only when bytes arrive.

The schedule is static, like the task lists: walking a processor's list (cyclically: the last tasks
of a step fetch for the first of the next), at each task it issues the parameter bytes of the tasks
from there on, in list order, as long as the bytes issued and not yet read stay within a budget
(PREFETCH_BYTES: the processors together keep a share of L2, not more, so that nothing is evicted
before it is read). A block bigger than what the budget leaves is issued in part (its first bytes).
Warp 1 issues them when it copies the next task's descriptor (ml::fill_slot), while warp 0 waits
for the current task's producers; the bulk prefetch exists on sm_90 and later only."""

from __future__ import annotations

import numpy as np

from megaloop.plan.bytes import box_runs, merge_runs
from megaloop.plan.model import Plan, RankPlan

# Bytes a processor keeps issued ahead and not yet read: x 132 processors, 25 MB of an H200's 50 MB L2
PREFETCH_BYTES = 192 * 1024
PREFETCH_ARCHS = ("sm_90", "sm_90a", "sm_100", "sm_100a", "sm_120")  # cp.async.bulk.prefetch.L2
MAX_ENTRIES = 32  # ranges one task's slot issues: one per lane of warp 1
MAX_RUNS = 8  # a task's parameter bytes in more pieces than this are not prefetched (strided views)
PREFETCH_DTYPE = np.dtype([("offset", np.int64), ("bytes", np.int64)])


def read_once_parameters(rp: RankPlan, rank: int) -> set[int]:
    """Parameter tensors whose bytes the tasks of each op reading them read once a step between them
    (a decode matmul's weight blocks): those are worth fetching ahead. A block several tiles share
    (prefill) is read from L2 after its first reader anyway."""
    seen: dict[tuple[int, int], int] = {}  # (op, tensor) -> elements read by its tasks
    for t in rp.tasks:
        for acc in t.reads:
            if acc.rank == rank and _parameter(rp, acc.tensor):
                seen[(t.op, acc.tensor)] = seen.get((t.op, acc.tensor), 0) + acc.box.size
    once = set()
    for (_, tensor), elements in seen.items():
        if elements <= int(np.prod(rp.tensors[tensor].shape)):
            once.add(tensor)
    return once


def _parameter(rp: RankPlan, tensor: int) -> bool:
    return rp.buffers[rp.tensors[tensor].buffer].kind == "parameter"


def task_runs(rp: RankPlan, rank: int, task_id: int, prefetchable: set[int]) -> list[tuple[int, int]]:
    """Arena byte runs [start, end) of the task's parameter reads, 16-byte aligned outwards (the bulk
    prefetch's rule; buffers are 256-byte aligned, so the runs stay inside their buffer's padding)."""
    t = rp.tasks[task_id]
    pieces = []
    for acc in t.reads:
        if acc.rank != rank or acc.tensor not in prefetchable:
            continue
        pt = rp.tensors[acc.tensor]
        base = rp.buffers[pt.buffer].offset
        runs = box_runs(acc.box, pt.strides, pt.offset, pt.dtype.itemsize, base)
        if len(runs) > MAX_RUNS:
            continue
        pieces.append(runs)
    if not pieces:
        return []
    runs = np.concatenate(pieces)
    runs[:, 0] = runs[:, 0] // 16 * 16
    runs[:, 1] = (runs[:, 1] + 15) // 16 * 16
    return [(int(a), int(b)) for a, b in merge_runs(runs)]


def _take(runs: list[tuple[int, int]], budget: int) -> list[tuple[int, int]]:
    """The first ``budget`` bytes of ``runs`` (whole 16-byte units)."""
    out = []
    for a, b in runs:
        if budget < 16:
            break
        end = min(b, a + budget // 16 * 16)
        out.append((a, end))
        budget -= end - a
    return out


def schedule(runs: list[list[tuple[int, int]]], budget: int) -> list[list[tuple[int, int]]]:
    """For one processor's list (each task's byte runs, in list order): the runs issued when the task
    at each position starts waiting. Simulated over two laps, the second (steady: the first tasks'
    bytes were issued by the previous step's last tasks) kept."""
    n = len(runs)
    sizes = [sum(b - a for a, b in r) for r in runs]
    issued: list[list[tuple[int, int]]] = [[] for _ in range(n)]  # per position, in the steady lap
    got: dict[int, int] = {}  # absolute position (over the laps) -> bytes issued for it
    ahead = 0  # the next absolute position nothing has been issued for
    for i in range(2 * n):
        ahead = max(ahead, i)
        outstanding = sum(got[p] for p in range(i, ahead))  # issued, and read by position i on
        while ahead < i + n:  # a lap at most: never a task's bytes twice a step
            size, room = sizes[ahead % n], budget - outstanding
            if size and room < 16:
                break
            part = runs[ahead % n] if size <= room else _take(runs[ahead % n], room)
            got[ahead] = sum(b - a for a, b in part)
            if i >= n:
                issued[i - n].extend(part)
            outstanding += got[ahead]
            ahead += 1
            if got[ahead - 1] < size:  # in part: the budget is spent
                break
    return issued


def plan_prefetches(plan: Plan, rank: int, budget: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(per task: (first entry, count) of the ranges issued when its slot is filled, PREFETCH_DTYPE
    entries). A task's slot is filled when the task before it on its processor starts waiting, so
    the ranges scheduled at position i go with the task at position i + 1."""
    budget = PREFETCH_BYTES if budget is None else budget
    rp = plan.ranks[rank]
    spans = np.zeros((len(rp.tasks), 2), np.int32)
    entries: list[tuple[int, int]] = []
    if budget <= 0 or plan.arch not in PREFETCH_ARCHS:
        return spans, np.zeros(0, PREFETCH_DTYPE)
    prefetchable = read_once_parameters(rp, rank)
    if not prefetchable:
        return spans, np.zeros(0, PREFETCH_DTYPE)
    for lst in rp.processors:
        if not lst:
            continue
        per_task = [task_runs(rp, rank, tid, prefetchable) for tid in lst]
        for i, ranges in enumerate(schedule(per_task, budget)):
            ranges = _at_most(ranges, MAX_ENTRIES)
            filled = lst[(i + 1) % len(lst)]
            spans[filled] = (len(entries), len(ranges))
            entries.extend((a, b - a) for a, b in ranges)
    return spans, np.array(entries, PREFETCH_DTYPE)


def _at_most(ranges: list[tuple[int, int]], count: int) -> list[tuple[int, int]]:
    """Merge neighbours (closest first) until ``count`` ranges remain; what lies between is fetched
    too (a few bytes of the same weights, usually)."""
    ranges = sorted(ranges)
    while len(ranges) > count:
        gaps = [ranges[j + 1][0] - ranges[j][1] for j in range(len(ranges) - 1)]
        j = int(np.argmin(gaps))
        ranges[j : j + 2] = [(ranges[j][0], ranges[j + 1][1])]
    return ranges

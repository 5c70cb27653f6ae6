"""Numbers that describe a plan: task and dependency counts, the critical path, how evenly the
processors are loaded, and how much memory each rank's arena needs."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from megaloop.plan.hazards import Orderings, build_access_table, find_orderings, task_bases
from megaloop.plan.memory import align
from megaloop.plan.model import BUFFER_KINDS, Plan
from megaloop.plan.rendezvous import exchange_region


@dataclass
class RankStats:
    rank: int
    ops: int
    tasks: int
    waits: int
    cross_rank_waits: int
    critical_path_ns: float  # longest chain of same-iteration data dependencies, at estimated task costs
    makespan_ns: float  # one iteration as scheduled (program order and waits), at estimated task costs
    busy_ns: list[float]  # per processor: sum of its tasks' estimated costs
    arena_bytes: int
    region_bytes: dict[str, int]
    scratch_without_reuse: int

    @property
    def load_balance(self) -> float:
        """Mean over max processor load (1.0: perfectly even)."""
        busy = [b for b in self.busy_ns if b > 0] or [0.0]
        return float(np.mean(busy) / max(busy)) if max(busy) > 0 else 1.0


def plan_stats(plan: Plan) -> list[RankStats]:
    base = task_bases(plan)
    n = base[-1] + len(plan.ranks[-1].tasks)
    cost = np.zeros(n)
    seq = np.zeros(n, np.int64)
    for r, rp in enumerate(plan.ranks):
        for t in rp.tasks:
            cost[base[r] + t.id] = t.cost_ns
            seq[base[r] + t.id] = rp.ops[t.op].seq
    orderings = find_orderings(plan, build_access_table(plan), seq)
    same = orderings.lag == 0
    critical = _longest_path(*_with_groups(cost, orderings, orderings.before[same], orderings.after[same]))[:n]
    makespan = _scheduled_finish(plan, base, cost)
    out = []
    for r, rp in enumerate(plan.ranks):
        ids = np.arange(base[r], base[r] + len(rp.tasks))
        layout = rp.memory
        busy = [float(sum(rp.tasks[t].cost_ns for t in lst)) for lst in rp.processors]
        inbox_at, inbox_bytes = exchange_region(plan, r)  # pushing all_reduces' inboxes, after the buffers
        out.append(
            RankStats(
                rank=r,
                ops=len(rp.ops),
                tasks=len(rp.tasks),
                waits=sum(len(t.waits) for t in rp.tasks),
                cross_rank_waits=sum(1 for t in rp.tasks for w in t.waits if w.rank != r),
                critical_path_ns=float(critical[ids].max(initial=0.0)),
                makespan_ns=float(makespan[ids].max(initial=0.0)),
                busy_ns=busy,
                arena_bytes=inbox_at + inbox_bytes if inbox_bytes else rp.arena_bytes,
                region_bytes={
                    **(dict(layout.region_bytes) if layout else _regions(rp)),
                    **({"inboxes": inbox_bytes} if inbox_bytes else {}),
                },
                scratch_without_reuse=layout.scratch_unshared if layout else _scratch_unshared(rp),
            )
        )
    return out


def estimated_times(plan: Plan) -> list[np.ndarray]:
    """Per rank, (tasks, 2) start and end of every task in one iteration, in ns, when each starts as
    soon as the task before it on its processor and every task it waits for have finished, at the
    cost model's estimates: what ``megaloop profile`` shows when there is no GPU to measure."""
    base = task_bases(plan)
    n = base[-1] + len(plan.ranks[-1].tasks)
    cost = np.zeros(n)
    for r, rp in enumerate(plan.ranks):
        for t in rp.tasks:
            cost[base[r] + t.id] = t.cost_ns
    finish = _scheduled_finish(plan, base, cost)
    out = []
    for r, rp in enumerate(plan.ranks):
        end = finish[base[r] : base[r] + len(rp.tasks)]
        out.append(np.stack([end - cost[base[r] : base[r] + len(rp.tasks)], end], axis=1))
    return out


def _scheduled_finish(plan: Plan, base: list[int], cost: np.ndarray) -> np.ndarray:
    """Finish time of every task as scheduled: program order and same-iteration waits (each on the
    counter's last signaler on its processor)."""
    n = len(cost)
    # the schedule as it will run: program order and same-iteration waits (from a counter's last signaler)
    position: dict[int, int] = {}
    for r, rp in enumerate(plan.ranks):
        for lst in rp.processors:
            for i, t in enumerate(lst):
                position[base[r] + t] = i
    last: dict[tuple[int, int], int] = {}
    for r, rp in enumerate(plan.ranks):
        for t in rp.tasks:
            key, gid = (r, t.signal), base[r] + t.id
            if key not in last or position[gid] > position[last[key]]:
                last[key] = gid
    before, after = [], []
    for r, rp in enumerate(plan.ranks):
        for lst in rp.processors:
            for a, b in itertools.pairwise(lst):
                before.append(base[r] + a)
                after.append(base[r] + b)
        for t in rp.tasks:
            for w in t.waits:
                if w.lag == 0:
                    before.append(last[(w.rank, w.counter)])
                    after.append(base[r] + t.id)
    return _longest_path(n, cost, np.array(before, np.int64), np.array(after, np.int64))


def _regions(rp) -> dict[str, int]:
    """Bytes of each arena region of a loaded plan (which carries offsets but not the planner's
    layout): the span its buffers cover, as the planner counts it."""
    out: dict[str, int] = {}
    for kind in BUFFER_KINDS:
        own = [b for b in rp.buffers if b.kind == kind and not b.peer]
        out[kind] = max((b.offset + align(b.nbytes) for b in own), default=0) - min((b.offset for b in own), default=0)
    return out


def _scratch_unshared(rp) -> int:
    return sum(align(b.nbytes) for b in rp.buffers if b.kind == "scratch" and not b.peer)


def _with_groups(
    cost: np.ndarray, orderings: Orderings, before: np.ndarray, after: np.ndarray
) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """Costs and edges with the same-iteration groups (buffers sharing bytes) as free nodes: set s
    done (n + s) after its members, set s open (n + sets + s) after the sets before it."""
    n, groups = len(cost), orderings.reuse.groups
    sets = len(groups.start) - 1
    owner = np.repeat(np.arange(sets), np.diff(groups.start))
    same = groups.lag == 0
    src = [before, groups.members, n + groups.before[same], n + sets + owner]
    dst = [after, n + owner, n + sets + groups.after[same], groups.members]
    return n + 2 * sets, np.append(cost, np.zeros(2 * sets)), np.concatenate(src), np.concatenate(dst)


def _longest_path(n: int, cost: np.ndarray, before: np.ndarray, after: np.ndarray) -> np.ndarray:
    """Finish time of every task when each starts as soon as all its predecessors finished."""
    preds: list[list[int]] = [[] for _ in range(n)]
    indeg = np.zeros(n, np.int64)
    for a, b in zip(before.tolist(), after.tolist()):
        preds[b].append(a)
        indeg[b] += 1
    succs: list[list[int]] = [[] for _ in range(n)]
    for b in range(n):
        for a in preds[b]:
            succs[a].append(b)
    finish = np.zeros(n)
    stack = [c for c in range(n) if indeg[c] == 0]
    while stack:
        c = stack.pop()
        start = max((finish[a] for a in preds[c]), default=0.0)
        finish[c] = start + cost[c]
        for d in succs[c]:
            indeg[d] -= 1
            if indeg[d] == 0:
                stack.append(d)
    return finish


def format_stats(plan: Plan, stats: list[RankStats]) -> str:
    lines = [f"plan for {plan.arch}, {plan.processors} processors x {plan.warps} warps, {plan.world_size} rank(s)"]
    for s in stats:
        regions = ", ".join(f"{k} {_mib(v)}" for k, v in s.region_bytes.items() if v)
        lines += [
            f"rank {s.rank}: {s.ops} ops -> {s.tasks} tasks, {s.waits} waits ({s.cross_rank_waits} on other ranks)",
            f"  estimated iteration {s.makespan_ns / 1e3:.1f} us; critical path {s.critical_path_ns / 1e3:.1f} us; "
            f"load balance {s.load_balance:.2f} (mean/max busy time)",
            f"  arena {_mib(s.arena_bytes)}: {regions}; scratch without reuse {_mib(s.scratch_without_reuse)}",
        ]
    return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"

"""Per-task timelines of a plan, written as Chrome trace JSON (open it in https://ui.perfetto.dev or
chrome://tracing: one track per processor) and as a PNG, plus a text summary by op.

A timeline comes either from the loop kernel's ``%globaltimer`` stamps (``LoopKernel.profile_ns``,
measured) or from the planner's cost model (``estimated_times``, what ``megaloop profile`` shows
without a GPU). Both give every task a start and an end per iteration; the source is written into
every output so that an estimate is never mistaken for a measurement.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megaloop.errors import MegaloopError
from megaloop.plan.model import Plan, RankPlan
from megaloop.plan.stats import estimated_times


class TraceError(MegaloopError, ValueError):
    """Timestamps that do not describe a run of the plan."""


@dataclass
class Timeline:
    plan: Plan
    rank: int
    times_ns: np.ndarray  # (iterations, tasks, 2) start and end, ns from the first start
    source: str  # "measured on <GPU>" or "estimated by the cost model"

    @property
    def rp(self) -> RankPlan:
        return self.plan.ranks[self.rank]

    def processor_of(self) -> np.ndarray:
        """The processor (thread block) each task runs on."""
        where = np.full(len(self.rp.tasks), -1, np.int64)
        for p, lst in enumerate(self.rp.processors):
            where[lst] = p
        return where

    @property
    def span_ns(self) -> float:
        return float(self.times_ns[..., 1].max() - self.times_ns[..., 0].min()) if self.times_ns.size else 0.0


def measured_timeline(plan: Plan, profile_ns: np.ndarray, source: str, rank: int = 0) -> Timeline:
    """A timeline from the kernel's raw stamps ((iterations, tasks, 2) globaltimer values)."""
    stamps = np.asarray(profile_ns)
    tasks = len(plan.ranks[rank].tasks)
    if stamps.ndim != 3 or stamps.shape[1:] != (tasks, 2) or stamps.shape[0] < 1:
        raise TraceError(f"profile stamps of shape {stamps.shape}; expected (iterations, {tasks}, 2) for rank {rank}")
    stamps = stamps.astype(np.int64)
    unstamped = np.argwhere((stamps[..., 0] == 0) | (stamps[..., 1] == 0))
    if len(unstamped):
        k, t = (int(v) for v in unstamped[0])
        raise TraceError(
            f"{plan.task_label(rank, t)} has no timestamps for iteration {k} ({len(unstamped)} missing in all): "
            "profile only iterations that ran"
        )
    backwards = np.argwhere(stamps[..., 1] < stamps[..., 0])
    if len(backwards):
        k, t = (int(v) for v in backwards[0])
        raise TraceError(f"{plan.task_label(rank, t)} ends before it starts in iteration {k}")
    return Timeline(plan, rank, (stamps - stamps[..., 0].min()).astype(np.float64), source)


def estimated_timeline(plan: Plan, rank: int = 0, iterations: int = 1) -> Timeline:
    """The cost model's timeline, iterations back to back (no overlap between them is modelled)."""
    one = estimated_times(plan)[rank]
    span = float(one[:, 1].max(initial=0.0))
    times = np.stack([one + k * span for k in range(iterations)])
    return Timeline(plan, rank, times, "estimated by the cost model")


def chrome_trace(tl: Timeline) -> dict:
    """The Chrome trace event format: one complete ("X") event per task and iteration, one thread
    per processor, in microseconds."""
    rp, where = tl.rp, tl.processor_of()
    events: list[dict] = [
        {"ph": "M", "pid": tl.rank, "name": "process_name", "args": {"name": f"rank {tl.rank} ({tl.source})"}}
    ]
    for p in range(len(rp.processors)):
        events.append({"ph": "M", "pid": tl.rank, "tid": p, "name": "thread_name", "args": {"name": f"processor {p}"}})
        events.append({"ph": "M", "pid": tl.rank, "tid": p, "name": "thread_sort_index", "args": {"sort_index": p}})
    for k in range(tl.times_ns.shape[0]):
        for t in rp.tasks:
            start, end = tl.times_ns[k, t.id]
            op = rp.ops[t.op]
            events.append(
                {
                    "ph": "X",
                    "pid": tl.rank,
                    "tid": int(where[t.id]),
                    "name": rp.task_name(t),
                    "cat": op.op,
                    "ts": start / 1e3,
                    "dur": (end - start) / 1e3,
                    "args": {"iteration": k, "task": t.id, "op": op.name, "estimated_ns": round(t.cost_ns, 1)},
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ns", "otherData": {"source": tl.source}}


def save_chrome_trace(tl: Timeline, path: str | Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(tl)))
    return path


def op_summary(tl: Timeline) -> list[tuple[str, int, float, float]]:
    """(op kind, tasks, busy ns summed over processors and iterations, share of all busy time),
    busiest first."""
    busy: dict[str, float] = {}
    count: dict[str, int] = {}
    dur = tl.times_ns[..., 1] - tl.times_ns[..., 0]
    for t in tl.rp.tasks:
        kind = tl.rp.ops[t.op].op
        busy[kind] = busy.get(kind, 0.0) + float(dur[:, t.id].sum())
        count[kind] = count.get(kind, 0) + 1
    total = sum(busy.values()) or 1.0
    return sorted(((k, count[k], v, v / total) for k, v in busy.items()), key=lambda row: -row[2])


def format_summary(tl: Timeline) -> str:
    iterations = tl.times_ns.shape[0]
    busy = float((tl.times_ns[..., 1] - tl.times_ns[..., 0]).sum())
    used = len([lst for lst in tl.rp.processors if lst])
    occupancy = busy / (used * tl.span_ns) if tl.span_ns > 0 and used else 0.0
    lines = [
        f"rank {tl.rank}, {tl.source}: {iterations} iteration(s) in {tl.span_ns / 1e3:.1f} us "
        f"({tl.span_ns / iterations / 1e3:.1f} us each); {len(tl.rp.tasks)} tasks on {used} processors, "
        f"busy {100 * occupancy:.0f}% of the time",
        f"  {'op':<18}{'tasks':>8}{'busy us':>12}{'share':>8}",
    ]
    for kind, n, ns, share in op_summary(tl):
        lines.append(f"  {kind:<18}{n:>8}{ns / 1e3:>12.1f}{100 * share:>7.1f}%")
    return "\n".join(lines)


@dataclass(frozen=True)
class PathStep:
    """A task on an iteration's critical path: its iteration, id, start and end (ns), and what it waited
    for: ``after`` is "wait" (the last of the producers it waits on to end), "order" (the task before it
    on its processor) or "" (the first step), ``ready_ns`` when that predecessor ended."""

    iteration: int
    task: int
    start_ns: float
    end_ns: float
    after: str
    ready_ns: float

    @property
    def handoff_ns(self) -> float:
        """From the predecessor's end to this task's start: the signal, the wait and the task's launch
        (0 for a first step with no predecessor on this rank)."""
        return self.start_ns - self.ready_ns


def critical_path(tl: Timeline, iteration: int | None = None) -> list[PathStep]:
    """The chain of tasks that made ``iteration`` (the last one by default) end when it did: from its
    last task back, each step's predecessor is whichever ended last of the producers it waits on (this
    rank's counters) and the task before it on its processor; the walk stops where it leaves the
    iteration. In order of time. Measured timelines say where a step's time goes: the tasks' own time
    and the handoffs between them (docs/runtime.md)."""
    rp, times = tl.rp, tl.times_ns
    k = times.shape[0] - 1 if iteration is None else iteration
    if not 0 <= k < times.shape[0]:
        raise TraceError(f"iteration {k}: the timeline has {times.shape[0]}")
    signalers: dict[int, list[int]] = {}
    for t in rp.tasks:
        signalers.setdefault(t.signal, []).append(t.id)
    # task -> (lag, the task before it on its processor): the one before in the list, or for the first
    # task the list's last one of the iteration before (iterations overlap: no barrier between them)
    before: dict[int, tuple[int, int]] = {}
    for lst in rp.processors:
        for a, b in itertools.pairwise(lst):
            before[b] = (0, a)
        if lst:
            before[lst[0]] = (1, lst[-1])
    steps: list[PathStep] = []
    tid = int(np.argmax(times[k, :, 1]))
    while True:
        task = rp.tasks[tid]
        candidates = []  # (end ns, iteration, task, why)
        for w in task.waits:
            if w.rank == tl.rank and w.lag <= k:
                candidates += [(times[k - w.lag, p, 1], k - w.lag, p, "wait") for p in signalers.get(w.counter, [])]
        lag, prev = before.get(tid, (k + 1, -1))
        if lag <= k:
            candidates.append((times[k - lag, prev, 1], k - lag, prev, "order"))
        start, end = times[k, tid]
        ready = max(candidates) if candidates else None
        if ready is None:  # nothing on this rank before it: the first task, or one only other ranks gate
            remote = any(w.rank != tl.rank for w in task.waits)
            steps.append(PathStep(k, tid, float(start), float(end), "other rank" if remote else "", float(start)))
            break
        steps.append(PathStep(k, tid, float(start), float(end), ready[3], float(ready[0])))
        if ready[1] != k:  # its predecessor is the previous iteration's: the path starts here
            break
        tid = ready[2]
    return steps[::-1]


def format_critical_path(tl: Timeline, iteration: int | None = None) -> str:
    """critical_path as a table, consecutive tasks of one op merged into a stage: its tasks' time on the
    path and its handoffs (the one before it and any between its tasks); then the sums, which the
    columns add up to. The first stage's handoff is from the previous iteration's task (or 0): the sums
    cover the step from that task's end to the iteration's end."""
    steps = critical_path(tl, iteration)
    rp = tl.rp
    rows: list[list] = []  # [op name, tasks, first start, busy ns, handoffs ns, after]
    for st in steps:
        name = rp.ops[rp.tasks[st.task].op].name
        if rows and rows[-1][0] == name:
            rows[-1][1] += 1
            rows[-1][3] += st.end_ns - st.start_ns
            rows[-1][4] += st.handoff_ns
        else:
            rows.append([name, 1, st.start_ns, st.end_ns - st.start_ns, st.handoff_ns, st.after])
    base = steps[0].start_ns if steps else 0.0
    lines = [
        f"critical path of iteration {steps[0].iteration if steps else '-'}: {len(steps)} tasks in {len(rows)} stages",
        f"  {'op':<40}{'tasks':>6}{'from us':>9}{'tasks us':>10}{'handoffs us':>13}  after",
    ]
    for name, n, start, busy_ns, handoff_ns, after in rows:
        lines.append(
            f"  {name:<40}{n:>6}{(start - base) / 1e3:>9.1f}{busy_ns / 1e3:>10.2f}{handoff_ns / 1e3:>13.2f}  {after}"
        )
    busy = sum(st.end_ns - st.start_ns for st in steps)
    handoffs = sum(st.handoff_ns for st in steps)
    counted = sum(1 for st in steps if st.after and st.after != "other rank")
    lines.append(f"  tasks {busy / 1e3:.1f} us, handoffs {handoffs / 1e3:.1f} us ({counted} of them)")
    return "\n".join(lines)


def save_png(tl: Timeline, path: str | Path, *, title: str | None = None) -> Path:
    """A Gantt chart: processors down, time across, one colour per op kind."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise TraceError("the PNG timeline needs matplotlib: pip install 'megaloop[profile]'") from None
    rp, where = tl.rp, tl.processor_of()
    kinds = [row[0] for row in op_summary(tl)]
    colours = plt.get_cmap("tab20")
    from matplotlib.patches import Patch

    fig, ax = plt.subplots(figsize=(14, min(3.0 + 0.08 * len(rp.processors), 14.0)))
    for c, kind in enumerate(kinds):
        ids = np.array([t.id for t in rp.tasks if rp.ops[t.op].op == kind], np.int64)
        for p in np.unique(where[ids]):
            spans = tl.times_ns[:, ids[where[ids] == p]].reshape(-1, 2) / 1e3
            ax.broken_barh(
                list(zip(spans[:, 0], spans[:, 1] - spans[:, 0])), (p - 0.45, 0.9), facecolors=colours(c % 20)
            )
    ax.set_xlabel("time (us)")
    ax.set_ylabel("processor (thread block)")
    ax.set_ylim(len(rp.processors) - 0.5, -0.5)
    ax.set_title(title or f"{tl.plan.ranks[tl.rank].graph.name}: rank {tl.rank}, {tl.source}")
    handles = [Patch(color=colours(c % 20), label=kind) for c, kind in enumerate(kinds)]
    ax.legend(handles=handles, loc="upper right", fontsize=7, ncol=2)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

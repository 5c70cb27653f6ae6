"""The verifier: every plan passes it before it can run.

It trusts nothing the planner derived. From the plan alone (tasks, accesses, buffers, counters,
waits, processor lists) it checks:

1. structure: each task on exactly one processor, counters signalled from a single processor, waits
   naming real counters, accesses inside their tensors, no task writing a read-only buffer, buffers
   inside the arena and sharing bytes only when their lifetimes are disjoint, no op reading a
   scratch or output buffer before an op that writes it in the sequential (``seq``) order;
2. deadlock freedom: program order plus same-iteration waits form no cycle (every counter target is
   then reached, since each counter's signalers all run every iteration); a pushing all_reduce's
   tile finishes only once the same tile of every member has started (``megaloop.plan.rendezvous``),
   so each member also inherits what the others need before they start;
3. race freedom: every pair of tasks that touch overlapping bytes of a writable buffer, one of them
   writing, is ordered by happens-before, within an iteration and across consecutive iterations.

Happens-before is tracked with vector clocks over two unrolled iterations (the second is the steady
state: everything later is the same pattern shifted). A failure names the two tasks, the buffer and
the byte range, or the cycle.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from megaloop.errors import DeadlockError, PlanError, RaceError
from megaloop.plan.bytes import overlapping_pairs
from megaloop.plan.hazards import Orderings, build_access_table, find_orderings, task_bases, task_name
from megaloop.plan.model import Plan
from megaloop.plan.rendezvous import meetings


@dataclass
class Report:
    tasks: int
    waits: int
    orderings: int  # required orderings checked


def verify_plan(plan: Plan) -> Report:
    base = task_bases(plan)
    n = base[-1] + len(plan.ranks[-1].tasks) if plan.ranks else 0
    proc, index, lists = _placement(plan, base, n)
    last_signaler = _counters(plan, base, proc, index)
    _check_structure(plan)
    table = build_access_table(plan)
    if table.read_only_writes:
        gid, owner, buf = table.read_only_writes[0]
        b = plan.ranks[owner].buffers[buf]
        raise PlanError(
            f"{task_name(plan, base, gid)} writes {b.kind} buffer {b.name!r} (rank {owner}), which tasks must only read"
        )
    seq = _sequence(plan, base, n)
    _check_memory(plan, seq, base)
    edges = _wait_edges(plan, base, last_signaler)
    # meetings only for progress: races are checked on waits and program order alone, as planned
    order = _acyclic(plan, base, lists, _with_meetings(plan, base, lists, proc, index, edges), n)
    _, vc1 = _clocks(order, proc, index, lists, edges, n)
    orderings = find_orderings(plan, table, seq)
    if orderings.overlapping_writers:
        a, b, owner, buf = orderings.overlapping_writers[0]
        raise RaceError(
            f"{task_name(plan, base, a)} and {task_name(plan, base, b)} belong to one op and both write "
            f"{plan.ranks[owner].buffers[buf].name!r}: the op's tiles overlap"
        )
    lengths = np.array([len(lst) for lst in lists], np.int64)
    before, after, lag = orderings.before, orderings.after, orderings.lag
    # x(i) happens before y(1) iff x's position in iteration i is within y's clock: i = 1 - lag
    pos = np.where(lag == 0, lengths[proc[before]], 0) + index[before]
    unordered = np.flatnonzero(pos > vc1[after, proc[before]])
    if len(unordered):
        _race(plan, base, orderings, int(unordered[0]))
    waits = sum(len(t.waits) for rp in plan.ranks for t in rp.tasks)
    return Report(n, waits, len(orderings.before))


def _placement(plan: Plan, base: list[int], n: int) -> tuple[np.ndarray, np.ndarray, list[list[int]]]:
    proc = np.full(n, -1, np.int64)
    index = np.full(n, -1, np.int64)
    lists: list[list[int]] = []
    for r, rp in enumerate(plan.ranks):
        if len(rp.processors) > plan.processors:
            raise PlanError(
                f"rank {r} has {len(rp.processors)} processor lists but the plan has {plan.processors} processors"
            )
        for p, lst in enumerate(rp.processors):
            g = len(lists)
            lists.append([])
            for i, t in enumerate(lst):
                if not 0 <= t < len(rp.tasks):
                    raise PlanError(f"rank {r} processor {p} lists task {t}, which does not exist")
                gid = base[r] + t
                if proc[gid] >= 0:
                    raise PlanError(f"{plan.task_label(r, t)} is listed twice (processor {p} and another)")
                proc[gid], index[gid] = g, i
                lists[-1].append(gid)
        missing = [t.id for t in rp.tasks if proc[base[r] + t.id] < 0]
        if missing:
            raise PlanError(f"{plan.task_label(r, missing[0])} is on no processor ({len(missing)} tasks unplaced)")
    return proc, index, lists


def _counters(
    plan: Plan, base: list[int], proc: np.ndarray, index: np.ndarray
) -> dict[tuple[int, int], tuple[int, int]]:
    """(rank, counter) -> (last signaler's gid, number of signalers); all signalers on one processor."""
    out: dict[tuple[int, int], tuple[int, int]] = {}
    for r, rp in enumerate(plan.ranks):
        for t in rp.tasks:
            if not 0 <= t.signal < len(rp.counters):
                raise PlanError(f"{plan.task_label(r, t.id)} signals counter {t.signal}, which does not exist")
            gid = base[r] + t.id
            key = (r, t.signal)
            if key in out:
                prev, count = out[key]
                if proc[prev] != proc[gid]:
                    raise PlanError(
                        f"counter {t.signal} of rank {r} ({rp.counters[t.signal].name}) is signalled by "
                        f"{task_name(plan, base, prev)} and {task_name(plan, base, gid)} on different processors: "
                        "its count would not say which of them finished"
                    )
                out[key] = (gid if index[gid] > index[prev] else prev, count + 1)
            else:
                out[key] = (gid, 1)
    return out


def _check_structure(plan: Plan) -> None:
    for r, rp in enumerate(plan.ranks):
        for t in rp.tasks:
            for kind, accesses in (("reads", t.reads), ("writes", t.writes)):
                for acc in accesses:
                    if not 0 <= acc.rank < plan.world_size or not 0 <= acc.tensor < len(plan.ranks[acc.rank].tensors):
                        raise PlanError(
                            f"{plan.task_label(r, t.id)} {kind} tensor {acc.tensor} of rank {acc.rank}, "
                            "which does not exist"
                        )
                    tensor = plan.ranks[acc.rank].tensors[acc.tensor]
                    box = acc.box
                    if len(box.lo) != len(tensor.shape) or any(
                        not 0 <= lo < hi <= d for lo, hi, d in zip(box.lo, box.hi, tensor.shape)
                    ):
                        raise PlanError(
                            f"{plan.task_label(r, t.id)} {kind} box {box} outside tensor {tensor.name!r} "
                            f"of shape {list(tensor.shape)}"
                        )
            for w in t.waits:
                if not 0 <= w.rank < plan.world_size or not 0 <= w.counter < len(plan.ranks[w.rank].counters):
                    raise PlanError(
                        f"{plan.task_label(r, t.id)} waits on counter {w.counter} of rank {w.rank}, "
                        "which does not exist"
                    )
                if w.lag < 0:
                    raise PlanError(f"{plan.task_label(r, t.id)} waits with lag {w.lag}; lags are >= 0")
        for b in rp.buffers:
            if b.offset < 0 or b.offset + b.nbytes > rp.arena_bytes:
                raise PlanError(
                    f"rank {r} buffer {b.name!r} [{b.offset}, {b.offset + b.nbytes}) lies outside the "
                    f"arena of {rp.arena_bytes} bytes"
                )
        for tensor in rp.tensors:
            b = rp.buffers[tensor.buffer]
            extent = [s * (d - 1) for d, s in zip(tensor.shape, tensor.strides)]
            lo = tensor.offset + sum(e for e in extent if e < 0)
            hi = tensor.offset + sum(e for e in extent if e > 0) + 1
            if lo < 0 or hi * tensor.dtype.itemsize > b.nbytes:
                raise PlanError(f"rank {r} tensor {tensor.name!r} reaches outside its buffer {b.name!r}")


def _sequence(plan: Plan, base: list[int], n: int) -> np.ndarray:
    """Each task's sequential position (its op's ``seq``), after checking that ops come after the ops
    that write what they read (scratch and outputs; state and read-only buffers hold older values)."""
    seq = np.zeros(n, np.int64)
    for r, rp in enumerate(plan.ranks):
        first_write: dict[int, int] = {}
        for op in rp.ops:
            for t in op.outputs:
                b = rp.tensors[t].buffer
                first_write[b] = min(first_write.get(b, op.seq), op.seq)
        for op in rp.ops:
            for t in op.inputs:
                b = rp.buffers[rp.tensors[t].buffer]
                if b.kind in ("scratch", "output") and first_write.get(b.id, op.seq) >= op.seq:
                    raise PlanError(
                        f"rank {r} op {op.name} (seq {op.seq}) reads {rp.tensors[t].name!r} before any "
                        "op writes it in the sequential order"
                    )
        for t in rp.tasks:
            seq[base[r] + t.id] = rp.ops[t.op].seq
    return seq


def _check_memory(plan: Plan, seq: np.ndarray, base: list[int]) -> None:
    """Buffers may share bytes only when both are scratch and no op touches both while both hold data."""
    for r, rp in enumerate(plan.ranks):
        life: dict[int, list[int]] = {}
        for rr, other in enumerate(plan.ranks):
            for t in other.tasks:
                for acc in t.reads + t.writes:
                    if acc.rank == r:
                        b = rp.tensors[acc.tensor].buffer
                        life.setdefault(b, []).append(int(seq[base[rr] + t.id]))
        if not rp.buffers:
            continue
        starts = np.array([b.offset for b in rp.buffers], np.int64)
        ends = np.array([b.offset + max(b.nbytes, 1) for b in rp.buffers], np.int64)
        for i, j in zip(*overlapping_pairs(starts, ends)):
            bi, bj = rp.buffers[int(i)], rp.buffers[int(j)]
            li, lj = life.get(bi.id), life.get(bj.id)
            disjoint = li is None or lj is None or max(li) < min(lj) or max(lj) < min(li)
            if bi.kind != "scratch" or bj.kind != "scratch" or not disjoint:
                raise PlanError(
                    f"rank {r}: buffers {bi.name!r} ({bi.kind}) and {bj.name!r} ({bj.kind}) share bytes "
                    f"[{max(bi.offset, bj.offset)}, {min(bi.offset + bi.nbytes, bj.offset + bj.nbytes)}) "
                    "while both hold live data"
                )


def _wait_edges(plan: Plan, base: list[int], last_signaler: dict) -> list[list[tuple[int, int]]]:
    """For each task: (source gid, lag) edges its waits create (source: last signaler of the counter)."""
    edges: list[list[tuple[int, int]]] = []
    for r, rp in enumerate(plan.ranks):
        for t in rp.tasks:
            row = []
            for w in t.waits:
                src = last_signaler.get((w.rank, w.counter))
                if src is None:
                    raise DeadlockError(
                        f"{plan.task_label(r, t.id)} waits on counter {w.counter} of rank {w.rank}, "
                        "which no task signals: its target is never reached"
                    )
                row.append((src[0], w.lag))
            edges.append(row)
    return edges


def _with_meetings(
    plan: Plan,
    base: list[int],
    lists: list[list[int]],
    proc: np.ndarray,
    index: np.ndarray,
    edges: list[list[tuple[int, int]]],
) -> list[list[tuple[int, int]]]:
    """``edges`` plus the meetings': a meeting's tile finishes after every other member's tile
    started, i.e. after that tile's program predecessor (in the previous iteration for a list's first
    task) and its waits."""
    groups = meetings(plan)
    if not groups:
        return edges
    out = [list(e) for e in edges]
    for group in groups:
        gids = [base[r] + t for r, t in group]
        for c in gids:
            for other in gids:
                if other == c:
                    continue
                i, lst = int(index[other]), lists[int(proc[other])]
                out[c].append((lst[i - 1], 0) if i > 0 else (lst[-1], 1))
                out[c].extend(edges[other])
    return out


def _acyclic(
    plan: Plan, base: list[int], lists: list[list[int]], edges: list[list[tuple[int, int]]], n: int
) -> list[int]:
    preds: list[list[int]] = [[] for _ in range(n)]
    for lst in lists:
        for a, b in itertools.pairwise(lst):
            preds[b].append(a)
    for c in range(n):
        preds[c].extend(src for src, lag in edges[c] if lag == 0)
    succs: list[list[int]] = [[] for _ in range(n)]
    indeg = np.zeros(n, np.int64)
    for c in range(n):
        for a in preds[c]:
            succs[a].append(c)
            indeg[c] += 1
    stack = [c for c in range(n) if indeg[c] == 0]
    order = []
    while stack:
        a = stack.pop()
        order.append(a)
        for c in succs[a]:
            indeg[c] -= 1
            if indeg[c] == 0:
                stack.append(c)
    if len(order) == n:
        return order
    stuck = {c for c in range(n) if indeg[c] > 0}
    c = min(stuck)
    path, seen = [], {}
    while c not in seen:
        seen[c] = len(path)
        path.append(c)
        c = next(a for a in preds[c] if a in stuck)
    loop = path[seen[c] :]
    raise DeadlockError(
        "tasks wait on each other in a cycle (each waits for the next, through a counter, a pushing "
        "all_reduce's meeting, or because it comes later on the same processor): "
        + " <- ".join(task_name(plan, base, x) for x in [*loop, loop[0]])
    )


def _clocks(
    order: list[int],
    proc: np.ndarray,
    index: np.ndarray,
    lists: list[list[int]],
    edges: list[list[tuple[int, int]]],
    n: int,
) -> tuple[np.ndarray, np.ndarray]:
    g = len(lists)
    lengths = np.array([len(lst) for lst in lists], np.int64)
    pred = np.full(n, -1, np.int64)
    for lst in lists:
        for a, b in itertools.pairwise(lst):
            pred[b] = a
    vc0 = np.full((n, g), -1, np.int64)
    vc1 = np.full((n, g), -1, np.int64)
    for c in order:
        v = vc0[pred[c]].copy() if pred[c] >= 0 else np.full(g, -1, np.int64)
        v[proc[c]] = index[c]
        for src, lag in edges[c]:
            if lag == 0:
                np.maximum(v, vc0[src], out=v)
        vc0[c] = v
    for c in order:
        if pred[c] >= 0:
            v = vc1[pred[c]].copy()
        else:
            v = vc0[lists[proc[c]][-1]].copy()
        v[proc[c]] = lengths[proc[c]] + index[c]
        for src, lag in edges[c]:
            if lag == 0:
                np.maximum(v, vc1[src], out=v)
            elif lag == 1:
                np.maximum(v, vc0[src], out=v)
        vc1[c] = v
    return vc0, vc1


def _race(plan: Plan, base: list[int], o: Orderings, k: int) -> None:
    x, y = int(o.before[k]), int(o.after[k])
    owner = int(o.owner[k])
    buf = plan.ranks[owner].buffers[int(o.buffer[k])]
    what = {
        (True, True): "both write it",
        (True, False): "the first writes, the second reads it",
        (False, True): "the first reads, the second writes it",
    }[(bool(o.before_writes[k]), bool(o.after_writes[k]))]
    when = "in the same iteration" if o.lag[k] == 0 else "across iterations (the first of one, the second of the next)"
    where = f" of rank {owner}" if plan.world_size > 1 else ""
    extra = f" ({o.witness[k]})" if o.witness[k] else ""
    raise RaceError(
        f"race on buffer {buf.name!r}{where}{extra}: {task_name(plan, base, x)} must finish before "
        f"{task_name(plan, base, y)} {when}; {what}, but nothing orders them"
    )

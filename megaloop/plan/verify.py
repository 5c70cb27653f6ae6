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
from megaloop.plan.hazards import (
    Hazards,
    Orderings,
    ReuseOrderings,
    build_access_table,
    find_orderings,
    task_bases,
    task_name,
)
from megaloop.plan.model import Plan
from megaloop.plan.programs import check_programs
from megaloop.plan.rendezvous import meetings


@dataclass
class Report:
    tasks: int
    waits: int
    orderings: int  # required orderings checked


def verify_plan(plan: Plan, hazards: Hazards | None = None) -> Report:
    """Check ``plan`` (see the module's docstring), and each of its other programs, and that the
    programs fit one kernel (megaloop/plan/programs.py). ``hazards``: its access table and orderings
    when the caller has just found them from these very tasks' accesses and ops (make_plan, whose
    linking sets only processors, counters and waits); else they are found here. The report is the
    first program's."""
    report = _verify_program(plan, hazards)
    if plan.others:
        for other in plan.others:
            _verify_program(other, None)
        check_programs(plan)
    return report


def _verify_program(plan: Plan, hazards: Hazards | None) -> Report:
    base = task_bases(plan)
    n = base[-1] + len(plan.ranks[-1].tasks) if plan.ranks else 0
    proc, index, lists = _placement(plan, base, n)
    last_signaler = _counters(plan, base, proc, index)
    waits = _flat_waits(plan, base)
    _check_structure(plan, waits, base)
    table = hazards.table if hazards is not None else build_access_table(plan)
    if table.read_only_writes:
        gid, owner, buf = table.read_only_writes[0]
        b = plan.ranks[owner].buffers[buf]
        raise PlanError(
            f"{task_name(plan, base, gid)} writes {b.kind} buffer {b.name!r} (rank {owner}), which tasks must only read"
        )
    seq = _sequence(plan, base, n)
    _check_memory(plan, seq, base)
    edges = _wait_edges(plan, base, last_signaler, waits)
    # meetings only for progress: races are checked on waits and program order alone, as planned
    level = _levels(plan, base, lists, _with_meetings(plan, base, lists, proc, index, edges), n)
    _, vc1 = _clocks(level, proc, index, lists, edges, n)
    orderings = hazards.orderings if hazards is not None else find_orderings(plan, table, seq)
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
    _check_reuse(plan, base, orderings.reuse, (proc, index, lists), vc1)
    return Report(n, len(waits[0]), len(orderings.before) + orderings.reuse.count())


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


def _flat_waits(plan: Plan, base: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Every wait of the plan: the waiting task's gid and (rank, counter, lag), in task order."""
    dst, waits = [np.empty(0, np.int64)], [np.empty((0, 3), np.int64)]
    for r, rp in enumerate(plan.ranks):
        ids = np.fromiter((t.id for t in rp.tasks), np.int64, len(rp.tasks))
        dst.append(np.repeat(base[r] + ids, np.fromiter((len(t.waits) for t in rp.tasks), np.int64, len(rp.tasks))))
        flat = itertools.chain.from_iterable(itertools.chain.from_iterable(t.waits for t in rp.tasks))
        waits.append(np.fromiter(flat, np.int64).reshape(-1, 3))
    return np.concatenate(dst), np.concatenate(waits)


def _check_waits(plan: Plan, waits: tuple[np.ndarray, np.ndarray], base: list[int]) -> None:
    dst, w = waits
    counters = np.array([len(rp.counters) for rp in plan.ranks] + [0], np.int64)
    rank_ok = (w[:, 0] >= 0) & (w[:, 0] < plan.world_size)
    bad = ~rank_ok | (w[:, 1] < 0) | (w[:, 1] >= counters[np.where(rank_ok, w[:, 0], -1)]) | (w[:, 2] < 0)
    if np.any(bad):
        k = int(np.argmax(bad))
        r = int(np.searchsorted(base, dst[k], side="right") - 1)
        label, (wr, wc, lag) = plan.task_label(r, int(dst[k]) - base[r]), w[k].tolist()
        if lag >= 0 or not rank_ok[k] or not 0 <= wc < counters[wr]:
            raise PlanError(f"{label} waits on counter {wc} of rank {wr}, which does not exist")
        raise PlanError(f"{label} waits with lag {lag}; lags are >= 0")


def _check_structure(plan: Plan, waits: tuple[np.ndarray, np.ndarray], base: list[int]) -> None:
    world = plan.world_size
    for r, rp in enumerate(plan.ranks):
        for t in rp.tasks:
            for kind, accesses in (("reads", t.reads), ("writes", t.writes)):
                for acc in accesses:
                    if not 0 <= acc.rank < world or not 0 <= acc.tensor < len(plan.ranks[acc.rank].tensors):
                        raise PlanError(
                            f"{plan.task_label(r, t.id)} {kind} tensor {acc.tensor} of rank {acc.rank}, "
                            "which does not exist"
                        )
                    shape = plan.ranks[acc.rank].tensors[acc.tensor].shape
                    box = acc.box
                    if len(box.lo) != len(shape) or any(
                        not 0 <= lo < hi <= d for lo, hi, d in zip(box.lo, box.hi, shape)
                    ):
                        raise PlanError(
                            f"{plan.task_label(r, t.id)} {kind} box {box} outside tensor "
                            f"{plan.ranks[acc.rank].tensors[acc.tensor].name!r} of shape {list(shape)}"
                        )
    _check_waits(plan, waits, base)
    for r, rp in enumerate(plan.ranks):
        for b in rp.buffers:
            if b.offset < 0 or b.offset + b.nbytes > rp.arena_bytes:
                raise PlanError(
                    f"rank {r} buffer {b.name!r} [{b.offset}, {b.offset + b.nbytes}) lies outside the "
                    f"arena of {rp.arena_bytes} bytes"
                )
        for tensor in rp.tensors:
            b = rp.buffers[tensor.buffer]
            if 0 in tensor.shape:
                continue  # (an empty tensor reaches no byte)
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
            if not (bi.nbytes and bj.nbytes):
                continue  # (an empty tensor's buffer holds no byte)
            li, lj = life.get(bi.id), life.get(bj.id)
            disjoint = li is None or lj is None or max(li) < min(lj) or max(lj) < min(li)
            if bi.kind != "scratch" or bj.kind != "scratch" or not disjoint:
                raise PlanError(
                    f"rank {r}: buffers {bi.name!r} ({bi.kind}) and {bj.name!r} ({bj.kind}) share bytes "
                    f"[{max(bi.offset, bj.offset)}, {min(bi.offset + bi.nbytes, bj.offset + bj.nbytes)}) "
                    "while both hold live data"
                )


@dataclass
class _Edges:
    """Happens-before edges ``src -> dst`` with their lags, grouped by ``dst`` (``dst`` sorted,
    each task's in the order of its waits)."""

    dst: np.ndarray
    src: np.ndarray
    lag: np.ndarray

    @staticmethod
    def of(dst: np.ndarray, src: np.ndarray, lag: np.ndarray) -> _Edges:
        by = np.argsort(dst, kind="stable")
        return _Edges(dst[by], src[by], lag[by])

    def select(self, keep: np.ndarray) -> _Edges:
        return _Edges(self.dst[keep], self.src[keep], self.lag[keep])

    def into(self, tasks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(position in ``tasks``, source) of the edges into ``tasks`` (sorted, distinct)."""
        lo, hi = np.searchsorted(self.dst, tasks), np.searchsorted(self.dst, tasks, side="right")
        sizes = hi - lo
        ends = np.cumsum(sizes)
        k = np.arange(int(ends[-1]) if len(ends) else 0) + np.repeat(lo - ends + sizes, sizes)
        return np.repeat(np.arange(len(tasks)), sizes), self.src[k]


def _wait_edges(plan: Plan, base: list[int], last_signaler: dict, waits: tuple[np.ndarray, np.ndarray]) -> _Edges:
    """The edges the waits create (source: the last signaler of the counter waited on)."""
    counter_base = np.cumsum([0] + [len(rp.counters) for rp in plan.ranks])
    signaler = np.full(int(counter_base[-1]), -1, np.int64)
    for (r, counter), (gid, _) in last_signaler.items():
        signaler[counter_base[r] + counter] = gid
    d, w = waits
    src = signaler[counter_base[w[:, 0]] + w[:, 1]]
    if np.any(src < 0):
        k = int(np.argmax(src < 0))
        r = int(np.searchsorted(base, d[k], side="right") - 1)
        raise DeadlockError(
            f"{plan.task_label(r, int(d[k]) - base[r])} waits on counter {w[k, 1]} of rank {w[k, 0]}, "
            "which no task signals: its target is never reached"
        )
    return _Edges.of(d, src, w[:, 2])


def _with_meetings(
    plan: Plan, base: list[int], lists: list[list[int]], proc: np.ndarray, index: np.ndarray, edges: _Edges
) -> _Edges:
    """``edges`` plus the meetings': a meeting's tile finishes after every other member's tile
    started, i.e. after that tile's program predecessor (in the previous iteration for a list's first
    task) and its waits."""
    groups = meetings(plan)
    if not groups:
        return edges
    dst, src, lag = [edges.dst], [edges.src], [edges.lag]
    for group in groups:
        gids = [base[r] + t for r, t in group]
        for c in gids:
            for other in gids:
                if other == c:
                    continue
                i, lst = int(index[other]), lists[int(proc[other])]
                _, s = edges.into(np.array([other]))
                lo = np.searchsorted(edges.dst, other)
                dst.append(np.full(len(s) + 1, c))
                src.append(np.concatenate([[lst[i - 1] if i > 0 else lst[-1]], s]))
                lag.append(np.concatenate([[0 if i > 0 else 1], edges.lag[lo : lo + len(s)]]))
    return _Edges.of(np.concatenate(dst), np.concatenate(src), np.concatenate(lag))


def _predecessors(lists: list[list[int]], n: int) -> np.ndarray:
    pred = np.full(n, -1, np.int64)
    for lst in lists:
        if len(lst) > 1:
            pred[lst[1:]] = lst[:-1]
    return pred


def _levels(plan: Plan, base: list[int], lists: list[list[int]], edges: _Edges, n: int) -> np.ndarray:
    """Each task's longest-path depth over program order and same-iteration edges (tasks of one level
    have no edges between them); a DeadlockError naming a cycle when there is one."""
    pred = _predecessors(lists, n)
    same = edges.lag == 0
    has = pred >= 0
    src = np.concatenate([pred[has], edges.src[same]])
    dst = np.concatenate([np.flatnonzero(has), edges.dst[same]])
    by = np.argsort(src, kind="stable")
    out_dst, out_start = dst[by], np.searchsorted(src[by], np.arange(n + 1))
    indeg = np.bincount(dst, minlength=n)
    level = np.full(n, -1, np.int64)
    frontier, depth = np.flatnonzero(indeg == 0), 0
    while len(frontier):
        level[frontier] = depth
        lo, hi = out_start[frontier], out_start[frontier + 1]
        sizes = hi - lo
        ends = np.cumsum(sizes)
        k = np.arange(int(ends[-1]) if len(ends) else 0) + np.repeat(lo - ends + sizes, sizes)
        reached, count = np.unique(out_dst[k], return_counts=True)
        indeg[reached] -= count
        frontier, depth = reached[indeg[reached] == 0], depth + 1
    if np.all(level >= 0):
        return level
    stuck = set(np.flatnonzero(level < 0).tolist())
    preds: dict[int, list[int]] = {c: [int(pred[c])] if pred[c] >= 0 else [] for c in stuck}
    for c, a in zip(edges.dst[same].tolist(), edges.src[same].tolist()):
        if c in stuck:
            preds[c].append(a)
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
    level: np.ndarray, proc: np.ndarray, index: np.ndarray, lists: list[list[int]], edges: _Edges, n: int
) -> tuple[np.ndarray, np.ndarray]:
    """Vector clocks of every task in iterations 0 and 1 (positions of iteration 1 count as list
    length + index), a level at a time: a task's clock is the max of its program predecessor's and
    its wait sources' (of iteration 0 for a lag-1 wait), with its own position."""
    g = len(lists)
    lengths = np.array([len(lst) for lst in lists], np.int64)
    pred = _predecessors(lists, n)
    pred_row = np.where(pred >= 0, pred, n)  # row n: no clock
    last = np.array([lst[-1] if lst else n for lst in lists], np.int64)
    dtype = np.int16 if 2 * int(lengths.max(initial=0)) < np.iinfo(np.int16).max else np.int32
    vc0 = np.full((n + 1, g), -1, dtype)
    vc1 = np.full((n + 1, g), -1, dtype)
    same, previous = edges.select(edges.lag == 0), edges.select(edges.lag == 1)
    by_level = np.argsort(level, kind="stable")
    bounds = np.searchsorted(level[by_level], np.arange(int(level.max(initial=-1)) + 2))
    for k in range(len(bounds) - 1):
        tasks = by_level[bounds[k] : bounds[k + 1]]
        row = vc0[pred_row[tasks]]
        row[np.arange(len(tasks)), proc[tasks]] = index[tasks]
        _join(row, *same.into(tasks), vc0)
        vc0[tasks] = row
    for k in range(len(bounds) - 1):
        tasks = by_level[bounds[k] : bounds[k + 1]]
        row = vc1[pred_row[tasks]]
        first = pred[tasks] < 0
        row[first] = vc0[last[proc[tasks[first]]]]
        row[np.arange(len(tasks)), proc[tasks]] = lengths[proc[tasks]] + index[tasks]
        _join(row, *same.into(tasks), vc1)
        _join(row, *previous.into(tasks), vc0)
        vc1[tasks] = row
    return vc0[:n], vc1[:n]


def _join(row: np.ndarray, local: np.ndarray, src: np.ndarray, clocks: np.ndarray) -> None:
    """``row[local[j]] = max(row[local[j]], clocks[src[j]])`` for every j (``local`` sorted)."""
    if not len(local):
        return
    first = np.flatnonzero(np.concatenate([[True], local[1:] != local[:-1]]))
    at = local[first]
    row[at] = np.maximum(row[at], np.maximum.reduceat(clocks[src], first, axis=0))


def _check_reuse(
    plan: Plan, base: list[int], reuse: ReuseOrderings, placement: tuple[np.ndarray, np.ndarray, list], vc1: np.ndarray
) -> None:
    """Every task of each group's ``before`` set happens before every task of its ``after`` set:
    clocks are prefixes of each list, so it is enough that each ``after`` task's clock reaches the
    last ``before`` task on every processor (one row of processors per task, not one per pair)."""
    proc, index, lists = placement
    groups = reuse.groups
    if not len(groups.before):
        return
    lengths = np.array([len(lst) for lst in lists], np.int64)
    sizes = np.diff(groups.start)
    last = np.full((len(sizes), len(lists)), -1, np.int64)
    np.maximum.at(last, (np.repeat(np.arange(len(sizes)), sizes), proc[groups.members]), index[groups.members])
    for lag in (0, 1):
        sel = np.flatnonzero(groups.lag == lag)
        for a in np.unique(groups.after[sel]).tolist():
            into = sel[groups.after[sel] == a]
            need = last[groups.before[into]].max(axis=0)
            pos = np.where(need >= 0, need + (lengths if lag == 0 else 0), -1)
            y = groups.tasks(a)
            bad = np.argwhere(vc1[y] < pos)
            if len(bad):
                i, p = bad[0].tolist()
                k = int(into[np.argmax(last[groups.before[into], p])])
                x = lists[p][need[p]]
                where = (int(reuse.owner[k]), int(reuse.buffer[k]), reuse.witness[k])
                _report_race(plan, base, x, int(y[i]), lag, where, (True, True))


def _race(plan: Plan, base: list[int], o: Orderings, k: int) -> None:
    where = (int(o.owner[k]), int(o.buffer[k]), str(o.witness[k]))
    _report_race(
        plan,
        base,
        int(o.before[k]),
        int(o.after[k]),
        int(o.lag[k]),
        where,
        (bool(o.before_writes[k]), bool(o.after_writes[k])),
    )


def _report_race(
    plan: Plan, base: list[int], x: int, y: int, lag: int, where_: tuple[int, int, str], writes: tuple[bool, bool]
) -> None:
    owner, buffer, witness = where_
    buf = plan.ranks[owner].buffers[buffer]
    what = {
        (True, True): "both write it",
        (True, False): "the first writes, the second reads it",
        (False, True): "the first reads, the second writes it",
    }[writes]
    when = "in the same iteration" if lag == 0 else "across iterations (the first of one, the second of the next)"
    where = f" of rank {owner}" if plan.world_size > 1 else ""
    extra = f" ({witness})" if witness else ""
    raise RaceError(
        f"race on buffer {buf.name!r}{where}{extra}: {task_name(plan, base, x)} must finish before "
        f"{task_name(plan, base, y)} {when}; {what}, but nothing orders them"
    )

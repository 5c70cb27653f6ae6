"""Conflicting accesses: pairs of tasks that touch overlapping bytes of a writable buffer where at
least one of them writes. In the program's sequential order (ops by ``seq``, iteration after
iteration) every such pair has a first and a second access, and a correct plan orders them:

- the earlier op's task before the later op's task in the same iteration (lag 0), and
- the later op's task of iteration k before the earlier op's task of iteration k+1 (lag 1).

Tasks are named globally as ``gid = base[rank] + task.id``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megaloop.plan.bytes import box_runs, overlapping_pairs
from megaloop.plan.model import READ_ONLY_KINDS, Access, Plan


@dataclass
class AccessTable:
    """Every access of every task as byte runs in the arena of the rank that owns the tensor."""

    base: list[int]  # gid of each rank's task 0
    owner: list[np.ndarray]  # per rank arena: arrays of the runs' fields
    start: list[np.ndarray]
    end: list[np.ndarray]
    task: list[np.ndarray]  # gid
    write: list[np.ndarray]  # bool
    buffer: list[np.ndarray]  # buffer id in the owner's plan
    read_only_writes: list[tuple[int, int, int]]  # (gid, owner rank, buffer) of writes to read-only buffers


def task_bases(plan: Plan) -> list[int]:
    base, at = [], 0
    for rp in plan.ranks:
        base.append(at)
        at += len(rp.tasks)
    return base


def access_runs(plan: Plan, access: Access) -> tuple[np.ndarray, int]:
    rp = plan.ranks[access.rank]
    t = rp.tensors[access.tensor]
    buf = rp.buffers[t.buffer]
    return box_runs(access.box, t.strides, t.offset, t.dtype.itemsize, buf.offset), buf.id


def build_access_table(plan: Plan, include_read_only: bool = False) -> AccessTable:
    base = task_bases(plan)
    cols: list[dict[str, list[np.ndarray]]] = [
        {k: [] for k in ("start", "end", "task", "write", "buffer")} for _ in plan.ranks
    ]
    bad: list[tuple[int, int, int]] = []
    for r, rp in enumerate(plan.ranks):
        for task in rp.tasks:
            gid = base[r] + task.id
            for accesses, is_write in ((task.reads, False), (task.writes, True)):
                for acc in accesses:
                    runs, buf = access_runs(plan, acc)
                    kind = plan.ranks[acc.rank].buffers[buf].kind
                    if kind in READ_ONLY_KINDS:
                        if is_write:
                            bad.append((gid, acc.rank, buf))
                        if not include_read_only:
                            continue
                    c = cols[acc.rank]
                    c["start"].append(runs[:, 0])
                    c["end"].append(runs[:, 1])
                    c["task"].append(np.full(len(runs), gid, np.int64))
                    c["write"].append(np.full(len(runs), is_write))
                    c["buffer"].append(np.full(len(runs), buf, np.int64))

    def cat(c: dict[str, list[np.ndarray]], key: str, dtype: type) -> np.ndarray:
        return np.concatenate(c[key]) if c[key] else np.empty(0, dtype)

    return AccessTable(
        base=base,
        owner=[np.full(len(cat(c, "start", np.int64)), r) for r, c in enumerate(cols)],
        start=[cat(c, "start", np.int64) for c in cols],
        end=[cat(c, "end", np.int64) for c in cols],
        task=[cat(c, "task", np.int64) for c in cols],
        write=[cat(c, "write", bool) for c in cols],
        buffer=[cat(c, "buffer", np.int64) for c in cols],
        read_only_writes=bad,
    )


@dataclass
class Conflicts:
    """Unordered conflicting task pairs (a < b by gid), with one overlapping byte range each."""

    a: np.ndarray
    b: np.ndarray
    a_writes: np.ndarray
    b_writes: np.ndarray
    owner: np.ndarray  # rank whose arena holds the bytes
    buffer: np.ndarray
    lo: np.ndarray
    hi: np.ndarray


def find_conflicts(table: AccessTable) -> Conflicts:
    parts: list[tuple[np.ndarray, ...]] = []
    for r in range(len(table.start)):
        s, e, t, w, b = table.start[r], table.end[r], table.task[r], table.write[r], table.buffer[r]
        i, j = overlapping_pairs(s, e)
        keep = (w[i] | w[j]) & (t[i] != t[j])
        i, j = i[keep], j[keep]
        swap = t[i] > t[j]
        i, j = np.where(swap, j, i), np.where(swap, i, j)
        lo, hi = np.maximum(s[i], s[j]), np.minimum(e[i], e[j])
        parts.append((t[i], t[j], w[i], w[j], np.full(len(i), r), b[i], lo, hi))
    if not parts:
        empty = np.empty(0, np.int64)
        return Conflicts(empty, empty, empty.astype(bool), empty.astype(bool), empty, empty, empty, empty)
    cols = [np.concatenate([p[k] for p in parts]) for k in range(8)]
    # one row per task pair; a pair's flags are merged over all its overlapping runs
    key = cols[0] * (int(cols[1].max(initial=0)) + 1) + cols[1]
    uniq, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    a_writes = np.zeros(len(uniq), bool)
    b_writes = np.zeros(len(uniq), bool)
    np.logical_or.at(a_writes, inverse, cols[2])
    np.logical_or.at(b_writes, inverse, cols[3])
    return Conflicts(
        cols[0][first],
        cols[1][first],
        a_writes,
        b_writes,
        cols[4][first],
        cols[5][first],
        cols[6][first],
        cols[7][first],
    )

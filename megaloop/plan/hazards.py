"""Which task instances must be ordered, from what each task reads and writes.

Every access is first expressed as a box in the index space of the *storage* it touches (the
buffer's own row-major shape): views map back exactly when they can (permutes, reshapes that split
or merge whole axes, plain slices) and to a covering box otherwise. Per storage, the boundaries of all
boxes cut the index space into cells; the program's sequential order (ops by ``seq``, iteration after
iteration) gives every cell a history of accesses. In that history, consecutive accesses by one op
form a group; consecutive read groups merge into one epoch (reads commute) and every write group is
an epoch of its own. A correct plan orders

- every task of an epoch before every task of the next epoch of that cell (lag 0), and
- every task of a cell's last epoch before every task of its first epoch one iteration later
  (lag 1: the next iteration overwrites what this one still reads).

That is enough: any two conflicting accesses of an element are then ordered through the chain of
epochs between them. Buffers that share bytes (scratch reuse) are ordered as wholes: the last users
of the earlier one before the first writers of the later one, and back across iterations. Those are
kept as groups of two task sets (``ReuseOrderings``): with thousands of tiles on each side, pair by
pair they would be millions of orderings.

Both the planner (to derive waits) and the verifier (to check them) use these orderings; all of it is
numpy over all accesses at once. Tasks are named globally as ``gid = base[rank] + task.id``.
Read-only buffers (parameters, constants, inputs) are left out; writes to them are reported.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megaloop.frontend.shapes import contiguous_strides
from megaloop.frontend.tiling import Box
from megaloop.plan.bytes import overlapping_pairs
from megaloop.plan.deps import Groups
from megaloop.plan.model import READ_ONLY_KINDS, Plan


def task_bases(plan: Plan) -> list[int]:
    base, at = [], 0
    for rp in plan.ranks:
        base.append(at)
        at += len(rp.tasks)
    return base


def task_name(plan: Plan, base: list[int], gid: int) -> str:
    """The readable name of the task numbered ``gid`` across all ranks (``base`` from ``task_bases``)."""
    r = max(i for i, b in enumerate(base) if b <= gid)
    return plan.task_label(r, gid - base[r])


def storage_box(box: Box, strides: tuple[int, ...], offset: int, shape: tuple[int, ...]) -> tuple[Box, bool]:
    """The box of the storage (row-major ``shape``) holding the elements of ``box`` of a view with
    element ``strides`` and ``offset``; ``exact`` is False when it had to be widened."""
    base = offset + sum(lo * s for lo, s in zip(box.lo, strides))
    dims = []
    for n, s in zip(box.shape, strides):
        if n > 1 and s != 0:
            if s < 0:  # walk negative strides forwards from the lowest element
                base += s * (n - 1)
                s = -s
            dims.append((n, s))
    root = contiguous_strides(shape)
    first = _unravel(base, shape, root)
    groups: dict[int, list[tuple[int, int]]] = {}
    exact = True
    for n, s in dims:
        k = next((k for k, r in enumerate(root) if s >= r and shape[k] > 1), len(root) - 1)
        if s % root[k]:
            exact = False
            break
        groups.setdefault(k, []).append((n, s // root[k]))
    lo, hi = list(first), [f + 1 for f in first]
    if exact:
        for k, members in groups.items():
            members.sort(key=lambda d: d[1])
            expected = 1
            for n, m in members:
                if m != expected:
                    exact = False
                expected = m * n
            span = expected if exact else sum((n - 1) * m for n, m in members) + 1
            if first[k] + span > shape[k]:  # runs over into the next row: not a box of this dim
                exact = False
                break
            hi[k] = first[k] + span
    if exact:
        return Box(tuple(lo), tuple(hi)), True
    last = _unravel(base + sum((n - 1) * s for n, s in dims), shape, root)
    return _cover(first, last, shape), False


def _unravel(index: int, shape: tuple[int, ...], strides: tuple[int, ...]) -> list[int]:
    out = []
    for d, s in zip(shape, strides):
        out.append((index // s) % d if d > 1 else 0)
    return out


def _cover(first: list[int], last: list[int], shape: tuple[int, ...]) -> Box:
    """Smallest box holding every element of the row-major range from ``first`` to ``last``."""
    lo, hi = [], []
    for k, (a, b) in enumerate(zip(first, last)):
        lo.append(a)
        hi.append(b + 1)
        if a != b:  # from here on, whole axes
            lo += [0] * (len(shape) - k - 1)
            hi += list(shape[k + 1 :])
            break
    return Box(tuple(lo), tuple(hi))


@dataclass
class AccessTable:
    """Every access to a writable storage, as a box of that storage, per owning rank."""

    base: list[int]  # gid of each rank's task 0
    buffer: list[np.ndarray]  # per rank: buffer id of each access
    task: list[np.ndarray]  # gid
    write: list[np.ndarray]  # bool
    exact: list[np.ndarray]  # bool: the box is not widened
    lo: list[list[tuple[int, ...]]]
    hi: list[list[tuple[int, ...]]]
    read_only_writes: list[tuple[int, int, int]]  # (gid, owner rank, buffer) of writes to read-only buffers


def build_access_table(plan: Plan) -> AccessTable:
    base = task_bases(plan)
    cols = [([], [], [], [], [], []) for _ in plan.ranks]  # buffer, task, write, exact, lo, hi
    bad: list[tuple[int, int, int]] = []
    info = [
        [
            (
                t.strides,
                t.offset,
                t.buffer,
                rp.buffers[t.buffer].shape,
                rp.buffers[t.buffer].kind in READ_ONLY_KINDS,
                t.offset == 0 and t.shape == rp.buffers[t.buffer].shape and t.strides == contiguous_strides(t.shape),
            )
            for t in rp.tensors
        ]
        for rp in plan.ranks
    ]
    for r, rp in enumerate(plan.ranks):
        for task in rp.tasks:
            gid = base[r] + task.id
            for accesses, is_write in ((task.reads, False), (task.writes, True)):
                for tensor, box, owner in accesses:
                    strides, offset, buf, shape, read_only, is_root = info[owner][tensor]
                    if read_only:
                        if is_write:
                            bad.append((gid, owner, buf))
                        continue
                    if is_root:
                        sbox, exact = box, True
                    else:
                        sbox, exact = storage_box(box, strides, offset, shape)
                    c = cols[owner]
                    c[0].append(buf)
                    c[1].append(gid)
                    c[2].append(is_write)
                    c[3].append(exact)
                    c[4].append(sbox.lo)
                    c[5].append(sbox.hi)
    return AccessTable(
        base,
        [np.array(c[0], np.int64) for c in cols],
        [np.array(c[1], np.int64) for c in cols],
        [np.array(c[2], bool) for c in cols],
        [np.array(c[3], bool) for c in cols],
        [c[4] for c in cols],
        [c[5] for c in cols],
        bad,
    )


@dataclass
class Orderings:
    """Required orderings ``before -> after`` (lag 0: same iteration; lag 1: ``before`` of one
    iteration ahead of ``after`` of the next), one row per distinct triple, each with a witness: the
    buffer (of ``owner``'s plan) and whether each side writes there."""

    before: np.ndarray
    after: np.ndarray
    lag: np.ndarray
    owner: np.ndarray
    buffer: np.ndarray
    before_writes: np.ndarray
    after_writes: np.ndarray
    witness: np.ndarray  # per row (str objects): where in the buffer (a box, or "the whole buffer"), or ""
    overlapping_writers: list[tuple[int, int, int, int]]  # (gid, gid, owner, buffer): one op's tiles overlap
    reuse: ReuseOrderings  # buffers sharing bytes, ordered as wholes


@dataclass
class ReuseOrderings:
    """Orderings between buffers that share bytes, as groups (all users of one buffer before all
    first writers of the other), each with its witness: the rank and buffer its writers write."""

    groups: Groups
    owner: np.ndarray
    buffer: np.ndarray
    witness: list[str]

    def count(self) -> int:
        """How many task-to-task orderings the groups stand for."""
        sizes = np.diff(self.groups.start)
        return int(np.sum(sizes[self.groups.before] * sizes[self.groups.after]))


@dataclass
class Hazards:
    """A plan's access table and the orderings found from it, for its tasks' current accesses."""

    table: AccessTable
    orderings: Orderings


def _pairs(
    left_start: np.ndarray, left_n: np.ndarray, right_start: np.ndarray, right_n: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """All (left index, right index) of the products of index ranges, and which product each is from."""
    sizes = left_n * right_n
    which = np.repeat(np.arange(len(sizes)), sizes)
    k = np.arange(int(sizes.sum())) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    rn = right_n[which]
    return left_start[which] + k // rn, right_start[which] + k % rn, which


def _cells(table: AccessTable, r: int) -> tuple[np.ndarray, np.ndarray]:
    """(access index, global cell id) incidences: every cell of its storage each access covers."""
    acc_parts, cell_parts = [], []
    buffers = table.buffer[r]
    cell_base = 0
    for buf in np.unique(buffers).tolist():
        idx = np.flatnonzero(buffers == buf)
        lo = np.array([table.lo[r][i] for i in idx], np.int64).reshape(len(idx), -1)
        hi = np.array([table.hi[r][i] for i in idx], np.int64).reshape(len(idx), -1)
        ndim = lo.shape[1]
        first = np.zeros_like(lo)
        count = np.ones_like(lo)
        radix = []
        for d in range(ndim):
            cuts = np.unique(np.concatenate([lo[:, d], hi[:, d]]))
            first[:, d] = np.searchsorted(cuts, lo[:, d])
            count[:, d] = np.searchsorted(cuts, hi[:, d]) - first[:, d]
            radix.append(len(cuts) - 1)
        cells = np.ones(len(idx), np.int64)
        for d in range(ndim):
            cells *= count[:, d]
        acc = np.repeat(idx, cells)
        k = np.arange(int(cells.sum())) - np.repeat(np.cumsum(cells) - cells, cells)  # position within its block
        flat = np.zeros(len(acc), np.int64)
        owner_row = np.repeat(np.arange(len(idx)), cells)
        for d in range(ndim - 1, -1, -1):  # mixed radix: position -> per-axis cell -> flat cell id
            c = count[owner_row, d]
            flat += (first[owner_row, d] + k % c) * int(np.prod(radix[d + 1 :], dtype=np.int64))
            k //= c
        acc_parts.append(acc)
        cell_parts.append(flat + cell_base)
        cell_base += int(np.prod(radix, dtype=np.int64)) if radix else 1
    if not acc_parts:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    return np.concatenate(acc_parts), np.concatenate(cell_parts)


def find_orderings(plan: Plan, table: AccessTable, seq_of: np.ndarray) -> Orderings:
    """``seq_of[gid]`` is the sequential position of each task's op."""
    cols: list[list[np.ndarray]] = [[] for _ in range(7)]
    witness: list[np.ndarray] = []
    overlapping: list[tuple[int, int, int, int]] = []
    reuse = _ReuseParts()
    for r in range(len(table.task)):
        if not len(table.task[r]):
            continue
        t, w, b, ex = table.task[r], table.write[r], table.buffer[r], table.exact[r]
        acc, cell = _cells(table, r)
        order = np.lexsort((t[acc], seq_of[t[acc]], cell))
        acc, cell = acc[order], cell[order]
        gid, seq, wr = t[acc], seq_of[t[acc]], w[acc]
        n = len(acc)
        new_group = np.ones(n, bool)  # groups: one op's accesses to one cell
        new_group[1:] = (cell[1:] != cell[:-1]) | (seq[1:] != seq[:-1])
        group = np.cumsum(new_group) - 1
        g_first = np.flatnonzero(new_group)
        g_write = np.zeros(len(g_first), bool)
        np.logical_or.at(g_write, group, wr)
        g_cell = cell[g_first]
        if not overlapping:
            clash = ex[acc] & ex[acc[g_first]][group] & g_write[group] & (gid != gid[g_first][group])
            if np.any(clash):
                i = int(np.argmax(clash))
                overlapping.append((int(gid[g_first][group][i]), int(gid[i]), r, int(b[acc[i]])))
        new_epoch = np.ones(len(g_first), bool)  # epochs: a run of read groups, or one write group
        new_epoch[1:] = (g_cell[1:] != g_cell[:-1]) | g_write[1:] | g_write[:-1]
        epoch_of_group = np.cumsum(new_epoch) - 1
        e_first = g_first[new_epoch]
        e_size = np.diff(np.append(e_first, n))
        e_cell = g_cell[new_epoch]
        e_write = np.zeros(len(e_first), bool)
        np.logical_or.at(e_write, epoch_of_group, g_write)
        nxt = np.flatnonzero(e_cell[1:] == e_cell[:-1])
        cell_first = np.flatnonzero(np.append(True, e_cell[1:] != e_cell[:-1]))
        cell_last = np.append(cell_first[1:] - 1, len(e_first) - 1)
        wrap = cell_last != cell_first
        for ea, eb, lag in ((nxt, nxt + 1, 0), (cell_last[wrap], cell_first[wrap], 1)):
            left, right, which = _pairs(e_first[ea], e_size[ea], e_first[eb], e_size[eb])
            keep = gid[left] != gid[right]
            left, right, which = left[keep], right[keep], which[keep]
            for i, v in enumerate(
                (
                    gid[left],
                    gid[right],
                    np.full(len(left), lag),
                    np.full(len(left), r),
                    b[acc[left]],
                    e_write[ea][which],
                    e_write[eb][which],
                )
            ):
                cols[i].append(v)
            witness.append(np.full(len(left), "", object))
        _reuse_orderings(plan, table, r, seq_of, reuse)
    if not cols[0] or not sum(len(c) for c in cols[0]):
        empty = np.empty(0, np.int64)
        return Orderings(
            *(empty,) * 5, empty.astype(bool), empty.astype(bool), np.empty(0, object), overlapping, reuse.done()
        )
    data = [np.concatenate(c) for c in cols]
    n_tasks = int(max(data[0].max(), data[1].max())) + 1
    key = (data[0] * n_tasks + data[1]) * 2 + data[2]
    _, keep = np.unique(key, return_index=True)
    keep.sort()
    return Orderings(*(d[keep] for d in data), np.concatenate(witness)[keep], overlapping, reuse.done())


def _reuse_orderings(plan: Plan, table: AccessTable, r: int, seq_of: np.ndarray, out: _ReuseParts) -> None:
    """Buffers sharing bytes (scratch reuse), ordered as wholes by their lifetimes, as groups."""
    rp = plan.ranks[r]
    scratch = [b for b in rp.buffers if b.kind == "scratch"]
    if len(scratch) < 2:
        return
    starts = np.array([b.offset for b in scratch], np.int64)
    ends = np.array([b.offset + b.nbytes for b in scratch], np.int64)
    i_idx, j_idx = overlapping_pairs(starts, ends)
    if not len(i_idx):
        return
    t, w, bufs = table.task[r], table.write[r], table.buffer[r]
    by = np.argsort(bufs, kind="stable")
    bounds = np.searchsorted(bufs[by], np.arange(len(rp.buffers) + 1))
    users: dict[int, int] = {}  # buffer -> set id of its last users
    writers: dict[int, int] = {}  # buffer -> set id of its first writers (absent: never written)
    last_seq: dict[int, int] = {}
    for x in {scratch[k].id for k in np.concatenate([i_idx, j_idx]).tolist()}:
        acc = by[bounds[x] : bounds[x + 1]]
        if not len(acc):
            continue
        tx, wx, sx = t[acc], w[acc], seq_of[t[acc]]
        last_seq[x] = int(sx.max())
        last_write = sx[wx].max() if wx.any() else -1
        readers_after = ~wx & (sx > last_write)
        users[x] = out.add_set(np.unique(tx[readers_after] if readers_after.any() else tx[wx & (sx == last_write)]))
        if wx.any():
            writers[x] = out.add_set(np.unique(tx[wx & (sx == sx[wx].min())]))
    for i, j in zip(i_idx.tolist(), j_idx.tolist()):
        a, b = scratch[i].id, scratch[j].id
        if a not in users or b not in users:
            continue
        if last_seq[a] > last_seq[b]:
            a, b = b, a
        # a's last epoch before b's first writers; b's last epoch before a's first writers next time
        for src, dst, lag in ((a, b, 0), (b, a, 1)):
            if dst in writers:
                out.add_group(users[src], writers[dst], lag, r, dst, f"bytes shared with buffer {rp.buffers[a].name!r}")


class _ReuseParts:
    """Sets and groups of ``ReuseOrderings`` as they are found."""

    def __init__(self) -> None:
        self.sets: list[np.ndarray] = []
        self.groups: list[tuple[int, int, int, int, int]] = []  # before set, after set, lag, owner, buffer
        self.witness: list[str] = []

    def add_set(self, tasks: np.ndarray) -> int:
        self.sets.append(tasks)
        return len(self.sets) - 1

    def add_group(self, before: int, after: int, lag: int, owner: int, buffer: int, witness: str) -> None:
        self.groups.append((before, after, lag, owner, buffer))
        self.witness.append(witness)

    def done(self) -> ReuseOrderings:
        sizes = np.fromiter(map(len, self.sets), np.int64, len(self.sets))
        members = np.concatenate(self.sets) if self.sets else np.empty(0, np.int64)
        cols = np.array(self.groups, np.int64).reshape(-1, 5).T
        groups = Groups(np.concatenate([[0], np.cumsum(sizes)]), members.astype(np.int64), cols[0], cols[1], cols[2])
        return ReuseOrderings(groups, cols[3], cols[4], self.witness)

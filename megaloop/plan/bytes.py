"""Which arena bytes a box of a (possibly strided) tensor covers, as sorted disjoint [start, end) runs
(the plan interpreter's byte versions), and which byte ranges overlap (buffers sharing memory)."""

from __future__ import annotations

import numpy as np

from megaloop.frontend.tiling import Box


def box_runs(box: Box, strides: tuple[int, ...], offset: int, itemsize: int, base: int) -> np.ndarray:
    """Byte runs [start, end) of the elements of ``box`` in a tensor with element ``strides`` and
    element ``offset``, whose buffer starts at byte ``base``. Shape (n, 2), sorted, merged."""
    single = single_run(box, strides, offset, itemsize, base)
    if single is not None:
        return np.array([single], dtype=np.int64)
    start = base + itemsize * (offset + sum(lo * s for lo, s in zip(box.lo, strides)))
    dims = [(n, s) for n, s in zip(box.shape, strides) if n > 1 and s != 0]  # broadcast axes repeat bytes
    for i, (n, s) in enumerate(dims):  # walk negative strides forwards
        if s < 0:
            start += itemsize * s * (n - 1)
            dims[i] = (n, -s)
    dims.sort(key=lambda d: -d[1])
    merged: list[tuple[int, int]] = []
    for n, s in dims:  # fold an axis into the one before when they are contiguous together
        if merged and merged[-1][1] == s * n:
            merged[-1] = (merged[-1][0] * n, s)
        else:
            merged.append((n, s))
    run = itemsize
    if merged and merged[-1][1] == 1:
        run = merged[-1][0] * itemsize
        merged.pop()
    starts = np.array([start], dtype=np.int64)
    for n, s in merged:
        starts = (starts[:, None] + np.arange(n, dtype=np.int64)[None, :] * (s * itemsize)).reshape(-1)
    starts.sort()
    return merge_runs(np.stack([starts, starts + run], axis=1))


def single_run(box: Box, strides: tuple[int, ...], offset: int, itemsize: int, base: int) -> tuple[int, int] | None:
    """The common case without numpy: from the innermost axis outwards, each axis the box spans
    more than one index of steps exactly over the axes inside it, so the box is one run of bytes."""
    expected = 1
    for lo, hi, s in zip(reversed(box.lo), reversed(box.hi), reversed(strides)):
        n = hi - lo
        if n == 1:
            continue
        if s != expected:
            return None
        expected = s * n
    start = base + itemsize * (offset + sum(lo * s for lo, s in zip(box.lo, strides)))
    return start, start + expected * itemsize


def merge_runs(runs: np.ndarray) -> np.ndarray:
    """Sort runs and merge the ones that touch or overlap."""
    if len(runs) <= 1:
        return runs
    runs = runs[np.argsort(runs[:, 0], kind="stable")]
    ends = np.maximum.accumulate(runs[:, 1])
    new = np.ones(len(runs), dtype=bool)
    new[1:] = runs[1:, 0] > ends[:-1]
    group = np.cumsum(new) - 1
    out = np.empty((int(group[-1]) + 1, 2), dtype=np.int64)
    out[:, 0] = runs[new, 0]
    out[:, 1] = np.maximum.reduceat(runs[:, 1], np.flatnonzero(new))
    return out


def overlapping_pairs(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """All index pairs (i, j), i != j, whose [start, end) ranges overlap, each unordered pair once.

    Every overlapping pair has one member starting inside the other, so for each range it is enough
    to find the ranges that start inside it (binary search over the sorted starts)."""
    order = np.argsort(starts, kind="stable")
    s_sorted = starts[order]
    lo = np.searchsorted(s_sorted, starts, side="left")
    hi = np.searchsorted(s_sorted, ends, side="left")
    counts = hi - lo
    if counts.sum() == 0:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    i = np.repeat(np.arange(len(starts)), counts)
    offs = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    j = order[np.repeat(lo, counts) + offs]
    keep = i != j
    i, j = i[keep], j[keep]
    # a pair with equal starts is found from both sides: keep one
    dup = (starts[i] == starts[j]) & (i > j)
    return i[~dup], j[~dup]

"""The planner's and verifier's per-task loops as they were before being vectorised by levels
(megaloop.plan.deps.derive_waits, megaloop.plan.verify._clocks): kept only here, as the
references the fast paths must equal exactly (tests/test_fast_planner.py)."""

from __future__ import annotations

import itertools

import numpy as np

from megaloop.plan.deps import Layout, program_predecessors


def derive_waits(
    layout: Layout, req0: list[list[int]], req1: list[list[int]], order: list[int]
) -> list[list[tuple[int, int]]]:
    """Waits per task as (producer task, lag); ``order`` must be consistent with program order and req0."""
    n, g = len(layout.proc), layout.processors
    proc, index = layout.proc, layout.index
    lengths = np.array([len(lst) for lst in layout.lists], np.int64)
    pred = program_predecessors(layout)
    last = {p: lst[-1] for p, lst in enumerate(layout.lists) if lst}
    rank_in_order = np.empty(n, np.int64)
    rank_in_order[np.asarray(order, np.int64)] = np.arange(n)
    vc0 = np.full((n, g), -1, np.int64)
    vc1 = np.full((n, g), -1, np.int64)
    waits: list[list[tuple[int, int]]] = [[] for _ in range(n)]

    def cover(base: np.ndarray, need: np.ndarray, clocks: np.ndarray) -> list[int]:
        """Waits for the producers in ``need`` not yet covered by ``base``: greedily, latest first,
        then only those no other chosen wait already happens after (an antichain: irredundant)."""
        chosen: list[int] = []
        cur = base.copy()
        for a in need[np.argsort(-rank_in_order[need], kind="stable")].tolist():
            if index[a] > cur[proc[a]]:
                chosen.append(a)
                np.maximum(cur, clocks[a], out=cur)
        if len(chosen) > 1:
            ch = np.asarray(chosen)
            seen = clocks[ch][:, proc[ch]]  # seen[x, j]: how far chosen x's clock reaches on chosen j's processor
            np.fill_diagonal(seen, -1)
            chosen = ch[~(seen.max(axis=0) >= index[ch])].tolist()
        return chosen

    req0_arr = [np.asarray(r, np.int64) for r in req0]
    req1_arr = [np.asarray(r, np.int64) for r in req1]
    no_clock = np.full(g, -1, np.int64)
    proc_l, index_l, pred_l = proc.tolist(), index.tolist(), pred.tolist()

    for c in order:  # iteration 0: same-iteration requirements
        row = vc0[c]  # filled in place
        row[:] = vc0[pred_l[c]] if pred_l[c] >= 0 else no_clock
        row[proc_l[c]] = index_l[c]
        need = req0_arr[c]
        if len(need):
            need = need[index[need] > row[proc[need]]]
            if len(need):
                chosen = cover(row, need, vc0)
                for a in chosen:
                    np.maximum(row, vc0[a], out=row)
                waits[c] = [(a, 0) for a in chosen]
    for c in order:  # iteration 1: clocks count positions of iteration 1 as length + index
        row = vc1[c]
        row[:] = vc1[pred_l[c]] if pred_l[c] >= 0 else vc0[last[proc_l[c]]]
        row[proc_l[c]] = lengths[proc_l[c]] + index_l[c]
        for a, _ in waits[c]:
            np.maximum(row, vc1[a], out=row)
        need = req1_arr[c]
        if len(need):
            need = need[index[need] > row[proc[need]]]
            if len(need):
                chosen = cover(row, need, vc0)
                for a in chosen:
                    np.maximum(row, vc0[a], out=row)
                waits[c] = waits[c] + [(a, 1) for a in chosen]
    return waits


def clocks(
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

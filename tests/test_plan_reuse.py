"""Buffers that share bytes (scratch reuse) are ordered as wholes: every last user of the earlier
buffer before every first writer of the later one. The planner keeps these orderings as groups, so
planning stays linear in the tiles on both sides; the verifier still checks every pair of the group."""

from __future__ import annotations

import numpy as np
import pytest

import megaloop as ml
from megaloop import errors
from megaloop.plan import make_plan, memory, verify_plan
from megaloop.plan.build import requirements
from megaloop.plan.hazards import build_access_table, find_orderings, task_bases

TILES = 512  # per op: a dense group would be TILES x TILES orderings


def two_chains(n: int) -> ml.Graph:
    """``y + 1`` after ``x * 2`` is dead: with sharing forced, ``y * 3`` reuses its bytes, and only that
    reuse orders the two chains."""
    g = ml.Graph("two_chains")
    x = g.input("x", (n,), ml.float32)
    y = g.input("y", (n,), ml.float32)
    g.output("a", (x * 2.0) + 1.0)
    g.output("b", (y * 3.0) + 1.0)
    return g


def plan_with_reuse(n: int, elements: int, processors: int) -> ml.plan.Plan:
    old = memory.REUSE_MIN_BYTES
    memory.REUSE_MIN_BYTES = 0
    try:
        plan = make_plan(
            two_chains(n),
            processors=processors,
            tiles={"mul": {"elements": elements}, "add": {"elements": elements}},
            scratch_budget=0,
        )
    finally:
        memory.REUSE_MIN_BYTES = old
    layout = plan.ranks[0].memory
    assert layout.scratch_bytes < layout.scratch_unshared, "expected the two products to share bytes"
    return plan


def _orderings(plan):
    base = task_bases(plan)
    seq = np.array([plan.ranks[0].ops[t.op].seq for t in plan.ranks[0].tasks], np.int64)
    return base, seq, find_orderings(plan, build_access_table(plan), seq)


def test_reuse_orderings_grow_with_the_tiles_not_their_product() -> None:
    plan = plan_with_reuse(TILES * 128, 64, processors=132)
    tasks = len(plan.ranks[0].tasks)
    _, _, orderings = _orderings(plan)
    reuse = orderings.reuse
    members = len(reuse.groups.members)
    print(f"{tasks} tasks; groups stand for {reuse.count()} orderings, held as {members} set members")
    assert tasks == 4 * TILES and reuse.count() >= TILES * TILES, "expected many tiles on both sides of the reuse"
    assert members <= 2 * tasks, f"{members} set members for {tasks} tasks: not linear"
    assert len(orderings.before) <= 4 * tasks, f"{len(orderings.before)} other orderings for {tasks} tasks"
    report = verify_plan(plan)
    assert report.orderings >= TILES * TILES


def test_the_verifier_refuses_a_plan_missing_a_reuse_ordering() -> None:
    plan = plan_with_reuse(64 * 64, 64, processors=5)
    rp = plan.ranks[0]
    base, _, orderings = _orderings(plan)
    groups = orderings.reuse.groups
    same = np.flatnonzero(groups.lag == 0)
    assert len(same), "expected a same-iteration reuse group"
    users = set(groups.tasks(int(groups.before[same[0]])).tolist())
    writers = groups.tasks(int(groups.after[same[0]])).tolist()
    dropped = 0
    for w in writers:  # the writers' waits on the users are the reuse's only ordering
        task = rp.tasks[w - base[0]]
        kept = [x for x in task.waits if not (x.lag == 0 and base[x.rank] + x.counter in users)]
        dropped += len(task.waits) - len(kept)
        task.waits = kept
    assert dropped, "expected the later buffer's writers to wait on the earlier one's users"
    with pytest.raises(errors.RaceError, match="bytes shared with buffer"):
        verify_plan(plan)


def test_requirements_keep_the_groups_whole() -> None:
    plan = plan_with_reuse(TILES * 128, 64, processors=132)
    base, seq, orderings = _orderings(plan)
    req0, req1, groups = requirements(plan, base, seq.tolist(), orderings)
    listed = sum(map(len, req0)) + sum(map(len, req1))
    assert listed <= 4 * len(seq), f"{listed} requirements listed for {len(seq)} tasks"
    assert len(groups.before) >= 2 and np.all(np.isin(groups.lag, (0, 1)))


def test_removing_any_wait_of_a_reuse_plan_is_a_race() -> None:
    """The waits derived from the groups are irredundant too: each one removed is reported."""
    plan = plan_with_reuse(32 * 64, 64, processors=3)
    total, shared = 0, 0
    for task in plan.ranks[0].tasks:
        saved = task.waits
        for i in range(len(saved)):
            task.waits = saved[:i] + saved[i + 1 :]
            with pytest.raises(errors.RaceError, match="race on buffer") as info:
                verify_plan(plan)
            total += 1
            shared += "bytes shared with buffer" in str(info.value)
        task.waits = saved
    assert total > 10 and shared, f"expected many waits, some for the reuse; got {total}, {shared} for the reuse"
    verify_plan(plan)

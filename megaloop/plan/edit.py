"""Hand-edited plans: detect tasks that no longer match their op's tile parameters, and re-derive a
plan after edits while keeping the user's processor orders."""

from __future__ import annotations

import itertools

from megaloop.errors import PlanFormatError
from megaloop.plan.build import link, requirements
from megaloop.plan.hazards import task_bases
from megaloop.plan.model import Plan, Task
from megaloop.plan.tasks import tasks_of_op


def _signature(t: Task) -> tuple:
    return (t.coords, [(a.tensor, a.rank, a.box) for a in t.reads], [(a.tensor, a.rank, a.box) for a in t.writes])


def check_tasks_match_tiles(plan: Plan) -> None:
    """Each op's tasks must be exactly what its tiling makes with its tile parameters."""
    for r, rp in enumerate(plan.ranks):
        by_op: dict[int, list[Task]] = {}
        for t in rp.tasks:
            by_op.setdefault(t.op, []).append(t)
        for op in rp.ops:
            try:
                expected = tasks_of_op(plan, r, op, 0)
            except Exception as e:
                raise PlanFormatError(
                    f"plan.ranks[{r}].ops[{op.id}] ({op.name}): tile {op.tile} is unusable: {e}"
                ) from e
            stored = by_op.get(op.id, [])
            if [_signature(t) for t in stored] != [_signature(t) for t in expected]:
                raise PlanFormatError(
                    f"plan.ranks[{r}].ops[{op.id}] ({op.name}): its {len(stored)} tasks are not what tile {op.tile} "
                    f"makes ({len(expected)} tasks); after editing tile parameters load with rederive=True"
                )


def rederive_plan(plan: Plan) -> Plan:
    """Tasks from the current tile parameters; counters and waits for the current processor lists.

    Tasks that still exist (same op, same tile coordinates) keep their processor and relative order;
    new ones (from ops whose tiles changed) go round-robin over the processors, each placed before
    the first task of a later op. Raises DeadlockError if the edited orders cannot run."""
    for r, rp in enumerate(plan.ranks):
        old = {(t.op, t.coords): t.id for t in rp.tasks}
        new_tasks: list[Task] = []
        for op in rp.ops:
            new_tasks.extend(tasks_of_op(plan, r, op, len(new_tasks)))
        new_id = {(t.op, t.coords): t.id for t in new_tasks}
        old_to_new = {tid: new_id[key] for key, tid in old.items() if key in new_id}
        lists = [[old_to_new[t] for t in lst if t in old_to_new] for lst in rp.processors]
        while len(lists) < plan.processors:
            lists.append([])
        seq = [rp.ops[t.op].seq for t in new_tasks]
        placed = {t for lst in lists for t in lst}
        spread = itertools.cycle(range(plan.processors))
        for t in new_tasks:
            if t.id in placed:
                continue
            lst = lists[next(spread)]
            at = next((i for i, other in enumerate(lst) if seq[other] > seq[t.id]), len(lst))
            lst.insert(at, t.id)
        rp.tasks = new_tasks
        rp.processors = lists
    base = task_bases(plan)
    seq_all = [rp.ops[t.op].seq for rp in plan.ranks for t in rp.tasks]
    req0, req1 = requirements(plan, base, seq_all)
    link(plan, req0, req1)
    return plan

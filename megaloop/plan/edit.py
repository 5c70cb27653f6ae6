"""Hand-edited plans: detect tasks that no longer match their op's tile parameters, and re-derive a
plan after edits while keeping the user's processor orders."""

from __future__ import annotations

import itertools

from megaloop.errors import MegaloopError, PlanFormatError
from megaloop.frontend.opdef import REGISTRY
from megaloop.plan import memory
from megaloop.plan.build import link, lower_rank, number_ops, place_buffers, requirements
from megaloop.plan.hazards import task_bases
from megaloop.plan.model import Plan, Task
from megaloop.plan.tasks import tasks_of_op


def _signature(t: Task) -> tuple:
    reads = [(a.tensor, a.rank, a.box) for a in t.reads]
    return (t.coords, reads, [(a.tensor, a.rank, a.box) for a in t.writes], t.flops, t.bytes)


def check_structure(plan: Plan) -> None:
    """What a loaded plan may not change: its ops, tensors and buffers must be what planning its graphs
    makes (only tile parameters, tasks, processor orders, waits and buffer offsets are the plan's own).
    Also gives the loaded ranks what is derived rather than saved (storage owners, output tensors)."""
    # a recv's push decides what exists (the send's op, peer buffers, state copies): plan with the file's
    pushed = {
        op.name: {"push": op.tile["push"]}
        for rp in plan.ranks
        for op in rp.ops
        if op.op == "recv" and "push" in op.tile
    }
    try:
        lowered = [lower_rank(rp.graph, r, plan.matching, plan.arch, pushed) for r, rp in enumerate(plan.ranks)]
        number_ops(lowered)
        shadow = Plan(plan.arch, plan.processors, plan.warps, plan.shared_memory, lowered, matching=plan.matching)
        place_buffers(shadow, False, memory.SCRATCH_BUDGET)
    except MegaloopError as e:
        raise PlanFormatError(f"plan.ranks[*].graph: the graphs cannot be planned: {e}") from None
    for r, (rp, want) in enumerate(zip(plan.ranks, lowered)):
        where = f"plan.ranks[{r}]"
        _same(f"{where}.ops", len(rp.ops), len(want.ops), "ops")
        for op, w in zip(rp.ops, want.ops):
            got = (op.name, op.op, op.node, op.inputs, op.outputs, op.seq)
            exp = (w.name, w.op, w.node, w.inputs, w.outputs, w.seq)
            _same(f"{where}.ops[{op.id}]", got, exp, "(name, op, node, inputs, outputs, seq)")
            tiling = REGISTRY[op.op].tiling
            try:
                resolved = tiling.resolve(op.name, plan.arch, {**tiling.saved_without, **op.tile})
            except MegaloopError as e:
                raise PlanFormatError(f"{where}.ops[{op.id}].tile: {e}") from None
            op.tile = resolved  # a parameter left out takes its default (plans saved before it existed)
        _same(f"{where}.tensors", len(rp.tensors), len(want.tensors), "tensors")
        for t, w in zip(rp.tensors, want.tensors):
            got = (t.name, t.dtype, t.shape, t.strides, t.offset, t.buffer)
            exp = (w.name, w.dtype, w.shape, w.strides, w.offset, w.buffer)
            _same(f"{where}.tensors[{t.id}]", got, exp, "(name, dtype, shape, strides, offset, buffer)")
        _same(f"{where}.buffers", len(rp.buffers), len(want.buffers), "buffers")
        for b, w in zip(rp.buffers, want.buffers):
            got = (b.kind, b.nbytes, b.shape, b.peer)
            _same(f"{where}.buffers[{b.id}]", got, (w.kind, w.nbytes, w.shape, w.peer), "(kind, nbytes, shape, peer)")
        rp.owner, rp.outputs = want.owner, want.outputs


def _same(where: str, got: object, expected: object, what: str) -> None:
    if got != expected:
        raise PlanFormatError(
            f"{where}: {what} is {got!r:.200}, but planning the plan's graphs gives {expected!r:.200}; these are "
            "not editable (edit tile parameters, processor orders or buffer offsets, then load with rederive=True)"
        )


def check_tasks_match_tiles(plan: Plan) -> None:
    """Each op's tasks must be exactly what its tiling makes with its tile parameters."""
    for r, rp in enumerate(plan.ranks):
        by_op: dict[int, list[Task]] = {}
        for t in rp.tasks:
            by_op.setdefault(t.op, []).append(t)
        for op in rp.ops:
            try:
                expected = tasks_of_op(plan, r, op, 0)
            except MegaloopError as e:
                raise PlanFormatError(
                    f"plan.ranks[{r}].ops[{op.id}] ({op.name}): tile {op.tile} is unusable: {e}"
                ) from e
            stored = by_op.get(op.id, [])
            if [_signature(t) for t in stored] != [_signature(t) for t in expected]:
                raise PlanFormatError(
                    f"plan.ranks[{r}].ops[{op.id}] ({op.name}): its {len(stored)} tasks are not what tile {op.tile} "
                    f"makes ({len(expected)} tasks; {_first_difference(stored, expected)}): tile parameters edited, "
                    "or the file made by a megaloop whose tilings differ; load with rederive=True to make them again"
                )


def _first_difference(stored: list[Task], expected: list[Task]) -> str:
    fields = ("coords", "reads", "writes", "flops", "bytes")
    for got, want in zip(stored, expected):
        for name, a, b in zip(fields, _signature(got), _signature(want)):
            if a != b:
                return f"task {got.id} has {name} {a!r:.80}, the tiling gives {b!r:.80}"
    return "a different number of them"


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
    link(plan, *requirements(plan, base, seq_all))
    return plan

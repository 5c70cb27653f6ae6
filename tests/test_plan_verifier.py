"""The verifier catches what would go wrong on a GPU: every single wait removed from a verified plan
is reported as a race; task orders that block each other are reported as a deadlock; structural
damage (counters, buffers, read-only writes) is named. The interpreter, which trusts nothing, also
catches a missing wait by reading the wrong version of some bytes."""

from __future__ import annotations

import copy

import numpy as np
import pytest

import megaloop as ml
from megaloop import errors
from megaloop.models import LlamaConfig, build_llama
from megaloop.plan import make_plan, verify_plan
from megaloop.reference.interpreter import run_plan
from tests.test_plan_interpreter import collective_program, small_tiles


def tiny_llama_plan(processors: int = 7):
    cfg = LlamaConfig(hidden=32, heads=4, kv_heads=2, intermediate=48, layers=2, max_seq=8, vocab=40)
    g = build_llama(cfg, 1, 2)
    return g, make_plan(g, processors=processors, tiles=small_tiles([g]))


def all_waits(plan):
    for r, rp in enumerate(plan.ranks):
        for task in rp.tasks:
            for i in range(len(task.waits)):
                yield r, task, i


def test_removing_any_wait_is_a_race() -> None:
    _, plan = tiny_llama_plan()
    total = 0
    for r, task, i in all_waits(plan):
        saved = task.waits
        task.waits = saved[:i] + saved[i + 1 :]
        try:
            with pytest.raises(errors.RaceError, match="race on buffer") as info:
                verify_plan(plan)
            assert plan.task_label(r, task.id) in str(info.value) or "nothing orders them" in str(info.value)
        finally:
            task.waits = saved
        total += 1
    assert total > 100, f"expected a plan with many waits, got {total}"
    verify_plan(plan)  # and the intact plan still verifies


def test_removing_any_cross_rank_wait_is_a_race() -> None:
    graphs = ml.spmd(collective_program, 3)
    plan = make_plan(graphs, processors=5, tiles=small_tiles(graphs))
    cross = [(r, task, i) for r, task, i in all_waits(plan) if task.waits[i].rank != r]
    assert len(cross) >= 6
    for _, task, i in cross:
        saved = task.waits
        task.waits = saved[:i] + saved[i + 1 :]
        try:
            with pytest.raises(errors.RaceError):
                verify_plan(plan)
        finally:
            task.waits = saved


def test_an_order_that_waits_on_itself_is_a_deadlock() -> None:
    _, plan = tiny_llama_plan()
    rp = plan.ranks[0]
    # a task c that waits on a producer a (same iteration) placed on another processor: put c
    # right before a on a's processor, so a's processor must run c first, and c waits for a
    where = {t: (p, i) for p, lst in enumerate(rp.processors) for i, t in enumerate(lst)}
    c, a = next(
        (t.id, w.counter) for t in rp.tasks for w in t.waits if w.lag == 0 and where[t.id][0] != where[w.counter][0]
    )
    broken = copy.deepcopy(rp.processors)
    pc, _ = where[c]
    pa, ia = where[a]
    broken[pc].remove(c)
    broken[pa].insert(ia, c)
    saved, rp.processors = rp.processors, broken
    try:
        with pytest.raises(errors.DeadlockError, match="cycle") as info:
            verify_plan(plan)
        assert rp.task_name(rp.tasks[c]) in str(info.value) and rp.task_name(rp.tasks[a]) in str(info.value)
    finally:
        rp.processors = saved


def test_structural_damage_is_named() -> None:
    _, plan = tiny_llama_plan()
    rp = plan.ranks[0]
    t0, t1 = rp.tasks[0], rp.tasks[1]
    where = {t: p for p, lst in enumerate(rp.processors) for t in lst}
    other = next(t for t in rp.tasks if where[t.id] != where[t0.id])
    damage = [
        (lambda: setattr(t0, "signal", other.signal), errors.PlanError, "different processors"),
        (
            lambda: setattr(
                t0,
                "waits",
                [*t0.waits, type(t0.waits[0])(0, 10**6, 0)] if t0.waits else [ml.plan.model.Wait(0, 10**6, 0)],
            ),
            errors.PlanError,
            "does not exist",
        ),
        (lambda: rp.processors[where[t1.id]].remove(t1.id), errors.PlanError, "is on no processor"),
        (lambda: rp.processors[0].append(t0.id), errors.PlanError, "listed twice"),
    ]
    for hurt, cls, message in damage:
        saved = copy.deepcopy((t0.signal, t0.waits, rp.processors))
        hurt()
        try:
            with pytest.raises(cls, match=message):
                verify_plan(plan)
        finally:
            t0.signal, t0.waits, rp.processors = saved


def test_writing_a_parameter_or_overlapping_live_buffers_is_refused() -> None:
    _, plan = tiny_llama_plan()
    rp = plan.ranks[0]
    param = next(t for t in rp.tensors if rp.buffers[t.buffer].kind == "parameter")
    task = next(t for t in rp.tasks if t.writes)
    saved = task.writes
    task.writes = [*saved, ml.plan.model.Access(param.id, ml.frontend.tiling.Box.full(param.shape), 0)]
    with pytest.raises(errors.PlanError, match="writes parameter buffer"):
        verify_plan(plan)
    task.writes = saved
    scratch = [b for b in rp.buffers if b.kind == "scratch"]
    saved_offset = scratch[1].offset
    scratch[1].offset = scratch[0].offset
    with pytest.raises(errors.PlanError, match="share bytes"):
        verify_plan(plan)
    scratch[1].offset = saved_offset
    verify_plan(plan)


def test_interpreter_catches_a_missing_wait() -> None:
    """With verification skipped, a plan missing a wait runs into the interpreter's version checks."""
    _, plan = tiny_llama_plan()
    rng = np.random.default_rng(0)
    params = {
        k: rng.standard_normal(v) * 0.2
        for k, v in LlamaConfig(hidden=32, heads=4, kv_heads=2, intermediate=48, layers=2, max_seq=8, vocab=40)
        .parameter_shapes()
        .items()
    }
    feeds = {"tokens": np.array([[3, 4]]), "positions": np.array([[0, 1]])}
    caught = 0
    candidates = [(r, t, i) for r, t, i in all_waits(plan) if t.waits[i].lag == 0][::7][:12]
    for _, task, i in candidates:
        saved = task.waits
        task.waits = saved[:i] + saved[i + 1 :]
        try:
            for seed in range(30):
                try:
                    run_plan(plan, feeds, params, iterations=2, seed=seed)
                except errors.InterpreterError as e:
                    assert "reads" in str(e) and "expected" in str(e)
                    caught += 1
                    break
        finally:
            task.waits = saved
    assert caught >= len(candidates) * 3 // 4, f"only {caught} of {len(candidates)} missing waits were caught"

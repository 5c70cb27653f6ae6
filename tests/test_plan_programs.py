"""Several programs in one plan (megaloop/plan/programs.py): states and parameters at one place for
all programs, the rest apart or shared only scratch with scratch; the verifier checks every program
and their layout; the JSON keeps them; the interpreter runs any of them, and a sequence of runs that
switches programs gives ml.evaluate's states of the same graphs run in that sequence, bit for bit."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import megaloop as ml
import megaloop.frontend.ops as ops
from megaloop.errors import GraphBuildError, PlanError
from megaloop.plan import Plan, make_plan
from megaloop.plan.cache import make_programs
from megaloop.plan.programs import check_programs
from megaloop.plan.verify import verify_plan
from megaloop.reference.interpreter import run_plan

SMALL = {"copy": {"elements": 2}, "add": {"elements": 2}, "mul": {"elements": 2}, "matmul": {"block_m": 16}}


def program(name: str, rows: int) -> ml.Graph:
    """A state ``acc`` [4, 8] that each iteration adds ``rows`` rows of x @ w to (rows cycling),
    a counter state ``steps``, and a parameter ``w`` [8, 8]: the same states and parameter in every
    program, intermediates of each program's own shape."""
    g = ml.Graph(name)
    acc = g.state("acc", (4, 8), ml.float32)
    steps = g.state("steps", (1,), ml.float32)
    w = g.parameter("w", (8, 8), ml.float32)
    scale = g.constant(np.full((rows, 8), 0.5 * rows, np.float32), name="scale")
    x = acc[:rows] * scale + 1.0
    y = ops.matmul(x, w)
    update = y if rows == 4 else ops.concat([y, acc[rows:]], 0)
    g.assign(acc, update)
    g.assign(steps, steps + float(rows))
    g.output("y", y * 1.0)
    return g


PARAMS = {"w": (np.arange(64, dtype=np.float32).reshape(8, 8) % 7 - 3) / 8}


def test_states_and_parameters_share_one_place_and_the_rest_stays_apart() -> None:
    plan = make_programs({"four": program("four", 4), "one": program("one", 1), "two": program("two", 2)},
                         processors=3, tiles=SMALL)  # fmt: skip
    assert [p.name for p in plan.programs] == ["four", "one", "two"]
    places = []
    for p in plan.programs:
        rp = p.ranks[0]
        by_name = {b.name: b for b in rp.buffers}
        places.append({k: (by_name[k].offset, by_name[k].nbytes) for k in ("acc", "steps", "w")})
        assert rp.arena_bytes == plan.ranks[0].arena_bytes
    assert places[0] == places[1] == places[2], places
    consts = [next(b for b in p.ranks[0].buffers if b.kind == "constant") for p in plan.programs]
    spans = sorted((b.offset, b.offset + b.nbytes) for b in consts)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), f"constants overlap: {spans}"
    verify_plan(plan)  # every program, and the layout


def test_the_layout_check_catches_a_state_out_of_place_and_a_constant_on_scratch() -> None:
    plan = make_programs({"four": program("four", 4), "one": program("one", 1)}, processors=2, tiles=SMALL)
    other = plan.others[0].ranks[0]
    acc = next(b for b in other.buffers if b.name == "acc")
    acc.offset += 256
    with pytest.raises(PlanError, match=r"state 'acc'.*share bytes"):
        check_programs(plan)
    acc.offset -= 256
    const = next(b for b in other.buffers if b.kind == "constant")
    scratch = next(b for b in plan.ranks[0].buffers if b.kind == "scratch")
    const.offset = scratch.offset
    with pytest.raises(PlanError, match=r"constant .* and scratch|scratch .* and constant"):
        check_programs(plan)


def test_programs_must_agree_on_settings_and_shapes() -> None:
    with pytest.raises(GraphBuildError, match="processors"):
        a, b = make_plan(program("a", 4), processors=2, tiles=SMALL), make_plan(program("b", 1), processors=3,
                                                                                 tiles=SMALL)  # fmt: skip
        b.name = "b"
        from megaloop.plan.programs import join_programs

        join_programs([a, b])
    g = ml.Graph("other")
    s = g.state("acc", (2, 8), ml.float32)
    g.assign(s, s + 1.0)
    with pytest.raises(GraphBuildError, match=r"state 'acc' has 64 bytes in program 'small' but 128"):
        make_programs({"four": program("four", 4), "small": g}, processors=2, tiles=SMALL)


def test_saved_and_loaded_with_every_program(tmp_path) -> None:
    plan = make_programs({"four": program("four", 4), "one": program("one", 1)}, processors=2, tiles=SMALL)
    plan.save(tmp_path / "p.json")
    back = Plan.load(tmp_path / "p.json")
    assert [p.name for p in back.programs] == ["four", "one"]
    for a, b in zip(plan.programs, back.programs):
        assert [(x.name, x.offset) for x in a.ranks[0].buffers] == [(x.name, x.offset) for x in b.ranks[0].buffers]
        assert a.ranks[0].processors == b.ranks[0].processors


def test_switching_programs_between_runs_gives_the_graphs_states() -> None:
    graphs = {"four": program("four", 4), "one": program("one", 1), "two": program("two", 2)}
    plan = make_programs(graphs, processors=3, tiles=SMALL)
    state_ref = state_plan = None
    for step, name in enumerate(["one", "four", "four", "two", "one", "two"]):
        ref = ml.evaluate(graphs[name], {}, PARAMS, state_ref)
        got = run_plan(plan, {}, PARAMS, state_plan, seed=step, program=name)
        for kind in ("outputs", "state"):
            for key, want in getattr(ref, kind).items():
                have = getattr(got, kind)[key]
                assert have.tobytes() == want.tobytes(), f"run {step} ({name}): {kind} {key} {have} != {want}"
        state_ref, state_plan = ref.state, got.state
    with pytest.raises(ml.errors.EvaluationError, match=r"no program 'three'.*\['four', 'one', 'two'\]"):
        run_plan(plan, {}, PARAMS, state_plan, program="three")

"""A loop kernel of several programs on the GPU (skipped without one; megaloop/plan/programs.py):
runs that switch programs (each program's own iteration count, counters and tables, one set of
states) give the states and outputs ml.evaluate gives the same graphs in the same sequence, bit for
bit (int64: exact on both sides); a program the plan lacks is refused naming those it has. The
CPU side: tests/test_plan_programs.py; the engine's switches: tests/test_gpu_serve.py."""

from __future__ import annotations

import numpy as np
import pytest

import megaloop as ml
import megaloop.frontend.ops as ops
from megaloop.errors import EvaluationError
from megaloop.plan.cache import make_programs
from megaloop.runtime.device import gpus

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpus()[0], reason="no GPU: " + gpus()[1])]


def program(name: str, rows: int) -> ml.Graph:
    """int64 state ``acc`` [4, 8]: its first ``rows`` rows times 3 plus ``steps``, the rest kept; ``steps``
    grows by ``rows``; output ``y``: the new rows. Every program: the same states, its own shapes."""
    g = ml.Graph(name)
    acc = g.state("acc", (4, 8), "int64", init=np.arange(32, dtype=np.int64).reshape(4, 8))
    steps = g.state("steps", (1, 1), "int64")
    rows_index = g.constant(np.arange(rows, dtype=np.int64).reshape(rows, 1), "int64", name="rows_index")
    y = acc[:rows] * 3 + steps + rows_index
    g.assign(acc, y if rows == 4 else ops.concat([y, acc[rows:]], 0))
    g.assign(steps, steps + rows)
    g.output("y", y * 1)
    return g


SEQUENCE = [("one", 2), ("four", 1), ("four", 3), ("two", 1), ("one", 1), ("two", 2), ("four", 1)]


def test_runs_that_switch_programs_give_the_graphs_results() -> None:
    from megaloop.runtime.loop import LoopKernel

    graphs = {"four": program("four", 4), "one": program("one", 1), "two": program("two", 2)}
    gpu = gpus()[0][0]
    plan = make_programs(graphs, processors=min(gpu.sm_count, 8), arch=gpu.plan_arch)
    state = None
    with LoopKernel(plan) as kernel:
        for step, (name, n) in enumerate(SEQUENCE):
            want = ml.evaluate(graphs[name], {}, {}, state, iterations=n)
            state = want.state
            out = kernel.run(iterations=n, program=name)
            assert np.array_equal(out["y"], want.outputs["y"]), f"run {step} ({name} x{n}): y {out['y']}"
            got = kernel.state()
            for key, value in want.state.items():
                assert np.array_equal(got[key], value), f"run {step} ({name} x{n}): state {key} {got[key]}"
        kernel.start(2, "one")  # started, then another program: the first run finishes first
        kernel.start(1, "two")
        kernel.wait()
        state = ml.evaluate(graphs["two"], {}, {}, ml.evaluate(graphs["one"], {}, {}, state, iterations=2).state).state
        assert np.array_equal(kernel.state()["acc"], state["acc"])
        with pytest.raises(EvaluationError, match=r"no program 'three'.*\['four', 'one', 'two'\]"):
            kernel.start(1, "three")

"""A loop kernel of several programs on the GPU (skipped without one; megaloop/plan/programs.py):
runs that switch programs (each program's own iteration count, counters and tables, one set of
states) give the states and outputs ml.evaluate gives the same graphs in the same sequence, bit for
bit (int64: exact on both sides); a program the plan lacks is refused naming those it has; and with
the weight ring's loader warp (megaloop/loader_runs.cuh) such switches give the bits of the kernel
without it. The CPU side: tests/test_plan_programs.py, tests/test_ring_loader.py; the engine's
switches: tests/test_gpu_serve.py."""

from __future__ import annotations

import numpy as np
import pytest

import megaloop as ml
import megaloop.frontend.ops as ops
from megaloop.errors import EvaluationError
from megaloop.plan import KernelOptions
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


# mixed and decode-only runs as the serving engine switches them: granted at once, one by one, and
# started back to back (each waits for the run before when it is another program's)
RING_SEQUENCE = [("mixed", 1), ("decode_1", 3), ("mixed", 2), ("decode_2", 1), ("decode_1", 1), ("decode_1", 2),
                 ("decode_2", 4), ("mixed", 1), ("decode_1", 5), ("decode_2", 2)]  # fmt: skip
RING_VARIANTS = {
    "off": KernelOptions(weight_ring_loader=0),
    "free_first": KernelOptions(),  # the loader, its default order
    "in_order_2_slots": KernelOptions(weight_ring_loader=1, weight_ring_slots=2),  # laps within a step
}


def test_runs_that_switch_programs_with_the_loader_give_the_bits_without_it() -> None:
    """Three programs with different weight-ring chunks a processor (tests/test_ring_loader.py:
    ring_programs; the mixed one none, some processors none of any) switched as the engine does: with
    the loader warp walking each run's program's chunks, every run's output and state are the bits of
    the kernel without the loader, and within bf16 tolerance of ml.evaluate run from the state before."""
    from megaloop.codegen import generate
    from megaloop.runtime.loop import LoopKernel
    from tests.test_ring_loader import RING_PROCESSORS, ring_programs

    graphs = ring_programs()
    gpu = gpus()[0][0]
    rng = np.random.default_rng(3)
    # (a gain about 1: the rows stay ~0.35 and a 1-ulp start grows to 3 % in a run of 5 steps, not 5 %)
    params = {w: (rng.standard_normal((512, 512)) / 20).astype(ml.bfloat16.np) for w in ("w1", "w2")}
    got: dict[str, list] = {}
    for variant, options in RING_VARIANTS.items():
        plan = make_programs(graphs, processors=min(gpu.sm_count, RING_PROCESSORS), arch=gpu.plan_arch,
                             options=options)  # fmt: skip
        loader = generate(plan).threads == 32 * plan.warps + 32
        assert loader == (variant != "off"), f"{variant}: loader warp {loader}"
        runs = got[variant] = []
        with LoopKernel(plan, params) as kernel:
            for step, (name, n) in enumerate(RING_SEQUENCE):
                before = kernel.state()
                out = kernel.run(iterations=n, program=name)
                runs.append((out["y"], kernel.state()["h"]))
                used = {w: params[w] for w in graphs[name].parameters}  # (decode_2 has w1 only)
                want = ml.evaluate(graphs[name], {}, used, before, iterations=n)
                _close(runs[-1][1], want.state["h"], f"{variant}, run {step} ({name} x{n})")
            for name, n in (("decode_1", 2), ("decode_2", 1), ("mixed", 1), ("decode_1", 3)):
                kernel.start(n, name)
            kernel.wait()
            runs.append((kernel.state()["h"],))
    base = got.pop("off")
    for variant, runs in got.items():
        for step, (mine, theirs) in enumerate(zip(runs, base)):
            for a, b in zip(mine, theirs):
                assert np.array_equal(a, b), f"{variant}: run {step} differs from the kernel without the loader"


def _close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    g, w = got.astype(np.float64), want.astype(np.float64)
    d = np.abs(g - w)
    tol = 0.05 * (np.abs(w) + np.sqrt(np.mean(w**2)) + 1e-3)
    assert np.all(d <= tol), f"{what}: max difference {d.max():.3e}"

"""step_batch (megaloop/frontend/ops/step_batch.py): a step's batch out of data uploaded once, picked by
the step counter, against numpy's data[c % n]: many iterations of one graph (the counter a state the
graph adds 1 to, past the end of the data so that it wraps), on the reference, the fast CPU path and
the plan interpreter (random legal orders); a negative counter is a data error; the loop kernel's code
compiles with NVRTC (no GPU needed). Exact: the op moves values."""

from __future__ import annotations

import numpy as np
import pytest

import megaloop as ml
from megaloop.codegen import generate
from megaloop.plan import make_plan
from megaloop.reference.fast import FastGraph
from megaloop.reference.interpreter import run_plan
from megaloop.runtime.compile import compile_cubin


def stepping_graph(n: int, batch: int, seq: int, dtype: str = "int64") -> ml.Graph:
    """Each iteration outputs its batch and counts one step."""
    g = ml.Graph("steps")
    data = g.state("data", (n, batch, seq), dtype)
    step = g.state("step", (), "int64")
    picked = ml.step_batch(data, step)
    g.output("batch", picked)
    g.assign(step, step + 1)
    return g


@pytest.mark.parametrize("dtype", ["int64", "int32", "bfloat16"])
def test_iterations_walk_the_data_and_wrap(dtype: str) -> None:
    n, batch, seq = 3, 2, 5
    rng = np.random.default_rng(0)
    data = ml.dtypes.round_to(rng.integers(0, 1000, (n, batch, seq)).astype(np.float64), ml.as_dtype(dtype))
    g = stepping_graph(n, batch, seq, dtype)
    plan = make_plan(g, processors=3)
    state = {"data": data, "step": np.array(0, np.int64)}
    for k in range(2 * n + 1):  # past the end: wraps around
        want = data[k % n]
        ref = ml.evaluate(g, {}, state=state)
        interpreted = run_plan(plan, {}, state=state, seed=k)
        for what, got in (("reference", ref), ("interpreter", interpreted)):
            assert np.array_equal(got.outputs["batch"], want), f"{what}, step {k}"
            assert int(got.state["step"]) == k + 1
        state = ref.state
    many = ml.evaluate(g, {}, state={"data": data, "step": np.array(0, np.int64)}, iterations=2 * n + 1)
    assert np.array_equal(many.outputs["batch"], data[(2 * n) % n]) and int(many.state["step"]) == 2 * n + 1


def test_fast_path_matches_and_counters_far_past_the_end() -> None:
    g = stepping_graph(4, 3, 7)
    data = np.arange(4 * 3 * 7, dtype=np.int64).reshape(4, 3, 7)
    fast = FastGraph(g, {})
    for c in (0, 3, 4, 10**12 + 1):
        state = {"data": data, "step": np.array(c, np.int64)}
        fast.reset(state)
        got = fast.run({})["batch"]
        assert np.array_equal(got, data[c % 4]), c
        assert np.array_equal(ml.evaluate(g, {}, state=state).outputs["batch"], data[c % 4])


def test_negative_counter_and_bad_operands_are_refused() -> None:
    g = stepping_graph(2, 1, 3)
    with pytest.raises(ml.errors.DataError, match=r"step_batch: the step counter is -1"):
        ml.evaluate(g, {}, state={"data": np.zeros((2, 1, 3), np.int64), "step": np.array(-1)})
    h = ml.Graph("bad")
    d = h.input("d", (4, 8), "int64")
    with pytest.raises(ml.errors.DtypeError, match="counter must be an int64 0-d step counter"):
        ml.step_batch(d, h.input("c", (1,), "int64"))
    with pytest.raises(ml.errors.ShapeError, match="leading axis"):
        ml.step_batch(h.input("s", (), "int64"), h.input("c0", (), "int64"))
    with pytest.raises(ml.errors.DtypeError, match="bool"):
        ml.step_batch(h.input("b", (2,), "bool"), h.input("c1", (), "int64"))


def test_loop_kernel_code_compiles() -> None:
    """Token ids [n, batch, seq + 1] and a float tensor with a transposed view (strided rows)."""
    g = stepping_graph(5, 4, 129)
    x = g.state("x", (6, 16, 8), "bfloat16")
    g.output("rows", ml.step_batch(x.transpose(1, 2), g.states["step"]) * 2.0)
    src = generate(make_plan(g, processors=8)).source
    assert "ml::step_batch<5, 516>" in src and "ml::step_batch<6, 128>" in src
    assert compile_cubin(src, "sm_90a", use_cache=False)[:4] == b"\x7fELF"

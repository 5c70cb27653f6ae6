"""Regression cases for how the planner lowers state updates, outputs and aliasing: each graph here
once planned into a wrong answer (or was accepted when it should have been refused). Each runs the
plan through the interpreter in several random legal orders and compares bytewise with
``ml.evaluate``, which runs the graph op by op without a plan."""

from __future__ import annotations

import numpy as np
import pytest

import megaloop as ml
from megaloop import errors
from megaloop.plan import make_plan
from megaloop.plan.build import link, requirements
from megaloop.plan.verify import verify_plan
from megaloop.reference.interpreter import run_plan


def same_as_evaluate(graphs, feeds=None, *, tiles=None, processors=(1, 3), seeds=3, iterations=(1, 3), **kw):
    """Plan ``graphs`` for each processor count and check every output and state bytewise."""
    single = isinstance(graphs, ml.Graph)
    for procs in processors:
        plan = make_plan(graphs, processors=procs, tiles=tiles, **kw)
        for its in iterations:
            ref = ml.evaluate(graphs, feeds, iterations=its)
            for seed in range(seeds):
                got = run_plan(plan, feeds, iterations=its, seed=seed)
                for r, (a, b) in enumerate(zip([got] if single else got, [ref] if single else ref)):
                    for kind in ("outputs", "state"):
                        for name, want in getattr(b, kind).items():
                            have = getattr(a, kind)[name]
                            assert have.tobytes() == want.tobytes(), (
                                f"{procs} processors, {its} iterations, seed {seed}, rank {r}: {kind} {name!r} "
                                f"is {have.ravel()}, evaluate gives {want.ravel()}"
                            )


def arange_state(g: ml.Graph, name: str, shape: tuple[int, ...], start: float = 0.0) -> ml.Tensor:
    n = int(np.prod(shape))
    return g.state(name, shape, ml.float32, init=(np.arange(n, dtype=np.float32) + start).reshape(shape))


SMALL = {"copy": {"elements": 2}, "add": {"elements": 2}, "mul": {"elements": 2}}


def test_swapping_two_states() -> None:
    g = ml.Graph("swap")
    a, b = arange_state(g, "a", (4,)), arange_state(g, "b", (4,), 10.0)
    g.assign(a, b)
    g.assign(b, a)  # both read the old values
    g.output("y", a + b)
    same_as_evaluate(g, tiles=SMALL)


@pytest.mark.parametrize("view", ["reversed", "transposed"])
def test_assigning_a_state_a_view_of_itself(view: str) -> None:
    g = ml.Graph(view)
    if view == "reversed":
        s = arange_state(g, "s", (6,))
        g.assign(s, s[::-1])
    else:
        s = arange_state(g, "s", (3, 3))
        g.assign(s, s.T)
    g.output("y", s * 1.0)
    same_as_evaluate(g, tiles=SMALL)


def test_delay_line_of_states() -> None:
    g = ml.Graph("chain")
    s, t = arange_state(g, "s", (4,)), g.state("t", (4,), ml.float32)
    x = g.input("x", (4,), ml.float32)
    g.assign(s, x * 2.0)  # may be computed straight into s ...
    g.assign(t, s)  # ... but only after t took the old s
    g.output("y", t + 0.0)
    same_as_evaluate(g, {"x": np.full(4, 7, np.float32)}, tiles=SMALL, iterations=(2, 3))


def test_outputs_that_are_inputs_views_or_old_state() -> None:
    x = np.arange(4, dtype=np.float32)
    g = ml.Graph("identity")
    g.output("y", g.input("x", (4,), ml.float32))
    same_as_evaluate(g, {"x": x}, processors=(1,))
    g = ml.Graph("reversed_input")
    g.output("y", g.input("x", (4,), ml.float32)[::-1])
    same_as_evaluate(g, {"x": x}, processors=(1,))
    g = ml.Graph("two_views")
    y = g.input("x", (4,), ml.float32) * 2.0
    g.output("a", y)
    g.output("b", y[::-1])
    same_as_evaluate(g, {"x": x}, processors=(1, 3))
    g = ml.Graph("old_state")
    s = g.state("s", (4,), ml.float32)
    y = g.input("x", (4,), ml.float32) * 2.0
    g.assign(s, y)  # y may live in s; the output of s must still be the old value
    g.output("y", y)
    g.output("s_old", s)
    same_as_evaluate(g, {"x": x}, processors=(1, 3))


@pytest.mark.parametrize("pad", [0, 10])
def test_send_of_a_state_before_it_is_updated(pad: int) -> None:
    """Rank 0 sends its cache, then updates it in place; padding rank 1 with inputs shifts the
    matching order, which once let the update run before the receiver had read the old cache."""

    def build(g: ml.Graph) -> None:
        if g.rank == 0:
            s = arange_state(g, "s", (1, 1, 4, 2))
            new, pos = g.input("new", (1, 1, 1, 2), ml.float32), g.input("pos", (1, 1), ml.int32)
            ml.send(s, 1)
            g.output("o", ml.kv_cache_update(s, new, pos) * 1.0)
            v = arange_state(g, "v", (4,))
            ml.send(v, 1)
            g.assign(v, g.input("x", (4,), ml.float32) * 2.0)
        else:
            for i in range(pad):
                g.input(f"d{i}", (1,), ml.float32)
            g.output("r", ml.recv(g, 0, (1, 1, 4, 2), ml.float32) * 1.0)
            g.output("rv", ml.recv(g, 0, (4,), ml.float32) * 1.0)

    graphs = ml.spmd(build, world_size=2)
    feeds = [
        {"new": np.full((1, 1, 1, 2), 100, np.float32), "pos": np.array([[1]], np.int32), "x": np.ones(4, np.float32)},
        {f"d{i}": np.zeros(1, np.float32) for i in range(pad)},
    ]
    same_as_evaluate(graphs, feeds, tiles={"recv": {"elements": 2}, "mul": {"elements": 4}}, seeds=4)


def test_collectives_views_and_state_with_scratch_reuse(monkeypatch) -> None:
    import megaloop.plan.memory as memory

    monkeypatch.setattr(memory, "REUSE_MIN_BYTES", 0)

    def build(g: ml.Graph) -> None:
        x = g.input("x", (4, 6), ml.float32)
        s = g.state("s", (2, 6), ml.float32, init=np.full((2, 6), g.rank + 1.0, np.float32))
        a = ml.all_reduce(x[::-2, ::-1] + s)
        b = ml.all_gather(a.T, axis=0)
        c = ml.reduce_scatter(b.reshape(2, 12)[:, ::-1], axis=1)
        h = ml.exp(c * 0.01)
        ml.send(h[:, 1:4], (g.rank + 1) % g.world_size)
        r = ml.recv(g, (g.rank - 1) % g.world_size, (2, 3), ml.float32)
        m = ml.matmul(r.T, h)
        g.assign(s, ml.sum(m, axis=0, keepdims=True) * 0.001 + s[::-1])
        g.output("m", m)
        g.output("b", b * 1.0)

    graphs = ml.spmd(build, world_size=2)
    feeds = [{"x": np.random.default_rng(r).standard_normal((4, 6)).astype(np.float32)} for r in range(2)]
    tiles = {
        "matmul": {"block_m": 2, "block_n": 2},
        "all_reduce": {"elements": 5},
        "all_gather": {"elements": 3},
        "reduce_scatter": {"elements": 4},
        "recv": {"elements": 2},
        "add": {"elements": 5},
        "exp": {"elements": 4},
        "mul": {"elements": 3},
        "sum": {"elements": 2},
        "copy": {"elements": 5},
    }
    same_as_evaluate(graphs, feeds, tiles=tiles, processors=(1, 3, 7), seeds=3, scratch_budget=0)


@pytest.mark.parametrize("view", ["slice", "reshape"])
def test_kv_cache_update_from_a_view_of_the_cache_is_refused(view: str) -> None:
    g = ml.Graph("kv_self")
    cache = g.state("cache", (2, 2, 3, 2), ml.float32)
    new = cache[:, :, :1, :] if view == "slice" else cache.reshape(2, 2, 6)[:, :, 2:4].reshape(2, 2, 1, 2)
    pos = g.input("pos", (2, 1), ml.int32)
    with pytest.raises(errors.GraphBuildError, match="view of the cache"):
        ml.kv_cache_update(cache, new, pos)


def test_interpreter_reports_a_stale_state_read() -> None:
    """A plan whose reader of a state in iteration k does not wait for the writer of iteration
    k-1 (a lag-1 wait removed by hand) must fail in the interpreter, not return old values."""
    g = ml.Graph("stale")
    s = g.state("s", (4,), ml.float32)
    x = g.input("x", (4,), ml.float32)
    g.output("y", s * 1.0)
    g.assign(s, x + 1.0)
    plan = make_plan(g, processors=2)
    rp = plan.ranks[0]
    rp.processors = [[0], [1]]
    link(plan, *requirements(plan, [0], [rp.ops[t.op].seq for t in rp.tasks]))
    verify_plan(plan)
    for t in rp.tasks:
        t.waits = [w for w in t.waits if w.lag == 0]
    with pytest.raises(errors.InterpreterError, match="stale"):
        for seed in range(10):
            run_plan(plan, {"x": np.full(4, 5, np.float32)}, iterations=3, seed=seed)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"tiles": {"matmul": {"bm": 2}}}, "unknown tile parameter 'bm'"),
        ({"warps": 0}, r"warps must be an int in \[1, 32\]"),
        ({"warps": 33}, r"warps must be an int in \[1, 32\]"),
        ({"shared_memory": -5}, "shared_memory must be an int"),
        ({"shared_memory": 1 << 30}, "shared_memory must be an int"),
        ({"scratch_budget": -1}, "scratch_budget must be an int >= 0"),
        ({"tiles": {"matmul": None}}, "tiles must map op or node names to parameter dicts"),
        ({"tiles": [("matmul", {})]}, "tiles must map op or node names to parameter dicts"),
        ({"processors": True}, "processors must be an int >= 1"),
        ({"processors": 0}, "processors must be an int >= 1"),
        ({"tiles": {"add": {"elements": 2.0}}}, "tile parameter elements must be an int >= 1"),
    ],
)
def test_bad_plan_settings_are_refused(settings: dict, message: str) -> None:
    g = ml.Graph("g")
    x = g.input("x", (4, 4), ml.float32)
    g.output("y", ml.matmul(x, x) + 1.0)
    with pytest.raises(errors.GraphBuildError, match=message):
        make_plan(g, **{"processors": 2, **settings})

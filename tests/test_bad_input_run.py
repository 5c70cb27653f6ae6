"""Bad input when a graph runs or is planned: evaluate's arguments and data, the plan interpreter's data
(the same DataError evaluate raises, naming the task), feeds that overflow their dtype, programs that
compute nothing, and make_plan's settings."""

from __future__ import annotations

import numpy as np
import pytest

import megaloop as ml
from megaloop.errors import DataError, DeadlockError, EvaluationError, GraphBuildError, RankError
from tests.bad_input import Case, case, check, graph, params

TILES = {"embedding": {"rows": 1}}


def _plan(g, **kw):
    from megaloop.plan import make_plan

    return make_plan(g, processors=kw.pop("processors", 3), **kw)


def _run(g, inputs=None, params_=None, state=None, **kw):
    from megaloop.reference.interpreter import run_plan

    return run_plan(_plan(g), inputs, params_, state, **kw)


def _exp_graph(dtype=ml.float32, shape=(2, 3)):
    g = graph()
    g.output("y", ml.exp(g.input("x", shape, dtype)))
    return g


def _embedding_graph():
    g = graph()
    g.output("y", ml.embedding(g.parameter("table", (10, 4), ml.float32), g.input("ids", (3,), ml.int64)))
    return g, {"table": np.arange(40.0).reshape(10, 4)}


def _cache_graph(tokens=2):
    g = graph()
    c = g.state("c", (1, 1, 4, 2), ml.float32)
    ml.kv_cache_update(c, g.input("n", (1, 1, tokens, 2), ml.float32), g.input("p", (1, tokens), ml.int64))
    return g


def _lengths_graph():
    g = graph()
    q, k = g.input("q", (1, 1, 1, 4), ml.float32), g.input("k", (1, 1, 4, 4), ml.float32)
    g.output("o", ml.attention(q, k, k, kv_lengths=g.input("n", (1,), ml.int32)))
    return g, {"q": np.ones((1, 1, 1, 4)), "k": np.ones((1, 1, 4, 4))}


def _no_results():
    g = graph()
    ml.exp(g.input("x", (2,), ml.float32))
    return g


def _embedding(run, ids):
    g, p = _embedding_graph()
    return run(g, {"ids": ids}, p)


def _cache(run, positions):
    return run(_cache_graph(len(positions)), {"n": np.ones((1, 1, len(positions), 2)), "p": [positions]})


def _lengths(run, n):
    g, feeds = _lengths_graph()
    return run(g, {**feeds, "n": [n]})


def _llama():
    from megaloop.models import LlamaConfig, random_parameters

    cfg = LlamaConfig(hidden=32, heads=4, kv_heads=2, intermediate=48, layers=1, vocab=20, max_seq=8)
    return cfg, random_parameters(cfg)


@case("run-plan-decode-past-max-seq", DataError, "task", "outside the cache of 8", found=True)
def _decode_past():
    from megaloop.models import build_llama

    cfg, p = _llama()
    _run(build_llama(cfg, 1, 1), {"tokens": [[3]], "positions": [[8]]}, p)


@case("run-plan-generator-stop-past-max-seq", DataError, "iteration 2", "position 8")
def _generator_past():
    # the default stop (max_seq) finishes a sequence in time; a stop the user set beyond it must not
    from megaloop.models import build_llama_generator

    cfg, p = _llama()
    state = {"token": [[1]], "position": [[6]], "stop": [[100]]}
    _run(build_llama_generator(cfg, 1), {}, p, state, iterations=3)


def _evaluate(g, inputs=None, params_=None, state=None, **kw):
    return ml.evaluate(g, inputs, params_, state, **kw)


def _evaluate_ranks(graphs, feeds):
    return ml.evaluate(graphs, feeds)


DATA = [
    Case("evaluate-embedding-id-12", lambda: _embedding(_evaluate, [3, 12, 0]), DataError, ("id 12", "10 rows")),
    Case("run-plan-embedding-id-12", lambda: _embedding(_run, [3, 12, 0]), DataError, ("task", "id 12"), found=True),
    Case("run-plan-embedding-id-minus-1", lambda: _embedding(_run, [3, 1, -1]), DataError, ("id -1",), found=True),
    Case("evaluate-cache-beyond", lambda: _cache(_evaluate, [1, 7]), DataError, ("position 7", "4 slots")),
    Case("run-plan-cache-beyond", lambda: _cache(_run, [1, 7]), DataError, ("task", "position 7"), found=True),
    Case("run-plan-cache-negative", lambda: _cache(_run, [-1, 2]), DataError, ("position -1",)),
    Case("evaluate-cache-repeat", lambda: _cache(_evaluate, [2, 2]), DataError, ("repeat",)),
    Case("run-plan-cache-repeat", lambda: _cache(_run, [1, 1]), DataError, ("task", "repeat", "lost"), found=True),
    Case("evaluate-kv-lengths-beyond", lambda: _lengths(_evaluate, 9), DataError, ("kv_lengths",)),
    Case("run-plan-kv-lengths-beyond", lambda: _lengths(_run, 9), DataError, ("task", "kv_lengths"), found=True),
    Case("run-plan-kv-lengths-negative", lambda: _lengths(_run, -1), DataError, ("kv_lengths", "[0, 4]")),
    _decode_past,
    _generator_past,
    Case(
        "evaluate-f16-input-1e6",
        lambda: _evaluate(_exp_graph(ml.float16, (2,)), {"x": [1e6, 1.0]}),
        EvaluationError,
        ("overflows float16",),
        found=True,
    ),
    Case(
        "run-plan-f16-input-1e6",
        lambda: _run(_exp_graph(ml.float16, (2,)), {"x": [1.0, -1e6]}),
        EvaluationError,
        ("overflows float16",),
        found=True,
    ),
    Case(
        "evaluate-f16-input-int-70000",
        lambda: _evaluate(_exp_graph(ml.float16, (1,)), {"x": np.array([70000])}),
        EvaluationError,
        ("overflows",),
    ),
    Case("evaluate-bf16-input-1e39", lambda: _evaluate(_exp_graph(ml.bfloat16, (1,)), {"x": [1e39]}), EvaluationError),
    Case("evaluate-f32-input-1e300", lambda: _evaluate(_exp_graph(ml.float32, (1,)), {"x": [1e300]}), EvaluationError),
    Case("evaluate-f16-state-1e5", lambda: _f16_state(1e5), EvaluationError, ("state 's'", "overflows float16")),
    Case(
        "evaluate-int32-input-2^40",
        lambda: _evaluate(_exp_graph(ml.int32) if False else _int_graph(), {"x": [2**40]}),
        EvaluationError,
        ("do not fit in int32",),
    ),
]


def _f16_state(value):
    g = graph()
    s = g.state("s", (2,), ml.float16)
    g.assign(s, s * 0.5)
    _evaluate(g, {}, None, {"s": [1.0, value]})


def _int_graph():
    g = graph()
    g.output("y", g.input("x", (1,), ml.int32) + 1)
    return g


def _params_overflow():
    g = graph()
    g.output("y", ml.exp(g.parameter("w", (2,), ml.float16)))
    _evaluate(g, {}, {"w": np.array([1.0, 1e9], np.float32)})


DATA.append(Case("evaluate-f16-parameter-1e9", _params_overflow, EvaluationError, ("parameter 'w'", "overflows")))

ARGUMENTS = [
    Case(
        "evaluate-no-outputs",
        lambda: _evaluate(_no_results(), {"x": [1, 2]}),
        GraphBuildError,
        ("no outputs",),
        found=True,
    ),
    Case("plan-no-outputs", lambda: _plan(_no_results()), GraphBuildError, ("no outputs", "graph.output"), found=True),
    Case("evaluate-missing-input", lambda: _evaluate(_exp_graph(), {}), EvaluationError, ("missing inputs",)),
    Case("evaluate-unknown-input", lambda: _evaluate(_exp_graph(), {"x": np.zeros((2, 3)), "z": 1}), EvaluationError),
    Case("evaluate-wrong-shape", lambda: _evaluate(_exp_graph(), {"x": np.zeros((3, 2))}), EvaluationError, ("[2,3]",)),
    Case("evaluate-bool-for-float", lambda: _evaluate(_exp_graph(), {"x": np.zeros((2, 3), bool)}), EvaluationError),
    Case("evaluate-floats-for-ints", lambda: _evaluate(_int_graph(), {"x": [1.5]}), EvaluationError, ("int32",)),
    Case("evaluate-strings", lambda: _evaluate(_exp_graph(), {"x": "abc"}), EvaluationError, ()),
    Case("evaluate-ragged", lambda: _evaluate(_exp_graph(), {"x": [[1, 2], [3]]}), EvaluationError, ("not an array",)),
    Case("evaluate-a-string-graph", lambda: ml.evaluate("abc"), EvaluationError, ("expected a Graph",)),
    Case("evaluate-inputs-a-number", lambda: _evaluate(_exp_graph(), 5), EvaluationError, ("mapping",)),
    Case(
        "evaluate-iterations-zero",
        lambda: _evaluate(_exp_graph(), {"x": np.zeros((2, 3))}, iterations=0),
        EvaluationError,
        ("iterations",),
    ),
    Case(
        "evaluate-iterations-a-string",
        lambda: _evaluate(_exp_graph(), {"x": np.zeros((2, 3))}, iterations="3"),
        EvaluationError,
        ("iterations",),
    ),
    Case(
        "evaluate-unknown-state",
        lambda: _evaluate(_exp_graph(), {"x": np.zeros((2, 3))}, None, {"s": 1}),
        EvaluationError,
        ("unknown state",),
    ),
    Case(
        "evaluate-missing-parameter",
        lambda: _evaluate(_embedding_graph()[0], {"ids": [1, 2, 3]}),
        EvaluationError,
        ("missing parameters",),
    ),
    Case(
        "evaluate-ranks-one-mapping",
        lambda: _evaluate_ranks(ml.spmd(_rank_graph, 2), {"x": 1}),
        EvaluationError,
        ("one mapping per rank",),
    ),
    Case(
        "run-plan-iterations-zero",
        lambda: _run(_exp_graph(), {"x": np.zeros((2, 3))}, iterations=0),
        EvaluationError,
        ("iterations",),
    ),
    Case("run-plan-missing-input", lambda: _run(_exp_graph(), {}), EvaluationError, ("missing",)),
    Case("run-plan-wrong-shape", lambda: _run(_exp_graph(), {"x": np.zeros(6)}), EvaluationError, ("shape",)),
    Case(
        "run-plan-unknown-state",
        lambda: _run(_exp_graph(), {"x": np.zeros((2, 3))}, None, {"q": 0}),
        EvaluationError,
        ("unknown state",),
    ),
]


def _rank_graph(g):
    g.output("y", ml.all_reduce(g.input("x", (2,), ml.float32)))


PLANNING = [
    Case(
        "plan-processors-10^10",
        lambda: _plan(_exp_graph(), processors=10**10),
        GraphBuildError,
        ("resident", "processors <="),
        found=True,
    ),
    Case(
        "plan-processors-10^8",
        lambda: _plan(_exp_graph(), processors=10**8),
        GraphBuildError,
        ("resident",),
        found=True,
    ),
    Case(
        "plan-processors-over-warps-bound",
        lambda: _plan(_exp_graph(), processors=600, warps=16),
        GraphBuildError,
        ("528",),
    ),
    Case("plan-processors-zero", lambda: _plan(_exp_graph(), processors=0), GraphBuildError, ("processors",)),
    Case("plan-processors-a-bool", lambda: _plan(_exp_graph(), processors=True), GraphBuildError, ("processors",)),
    Case("plan-processors-a-string", lambda: _plan(_exp_graph(), processors="132"), GraphBuildError, ("processors",)),
    Case("plan-processors-a-float", lambda: _plan(_exp_graph(), processors=4.0), GraphBuildError, ("processors",)),
    Case("plan-arch-unknown", lambda: _plan(_exp_graph(), arch="sm_70"), GraphBuildError, ("unknown architecture",)),
    Case("plan-arch-none", lambda: _plan(_exp_graph(), arch=None), GraphBuildError, ("architecture",)),
    Case("plan-warps-zero", lambda: _plan(_exp_graph(), warps=0), GraphBuildError, ("warps",)),
    Case("plan-warps-33", lambda: _plan(_exp_graph(), warps=33), GraphBuildError, ("warps",)),
    Case("plan-shared-negative", lambda: _plan(_exp_graph(), shared_memory=-5), GraphBuildError, ("shared_memory",)),
    Case("plan-shared-huge", lambda: _plan(_exp_graph(), shared_memory=1 << 30), GraphBuildError, ("shared_memory",)),
    Case("plan-scratch-negative", lambda: _plan(_exp_graph(), scratch_budget=-1), GraphBuildError, ("scratch_budget",)),
    Case("plan-tiles-a-list", lambda: _plan(_exp_graph(), tiles=[1]), GraphBuildError, ("tiles must map",)),
    Case(
        "plan-tiles-unknown-name",
        lambda: _plan(_exp_graph(), tiles={"nothing": {"a": 1}}),
        GraphBuildError,
        ("name neither",),
    ),
    Case(
        "plan-tiles-zero", lambda: _plan(_exp_graph(), tiles={"exp": {"elements": 0}}), GraphBuildError, ("elements",)
    ),
    Case(
        "plan-tiles-unknown-param", lambda: _plan(_exp_graph(), tiles={"exp": {"rows": 2}}), GraphBuildError, ("rows",)
    ),
    Case(
        "plan-tiles-a-float",
        lambda: _plan(_exp_graph(), tiles={"exp": {"elements": 2.0}}),
        GraphBuildError,
        ("elements",),
    ),
    Case("plan-not-a-graph", lambda: _plan("graph"), GraphBuildError, ("Graph",)),
    Case("plan-empty-list", lambda: _plan([]), GraphBuildError, ("Graph",)),
    Case("plan-ranks-out-of-order", lambda: _plan(list(reversed(ml.spmd(_rank_graph, 2)))), RankError, ("rank order",)),
]


def _deadlocked_plan():
    from megaloop.plan.format import plan_from_dict, plan_to_dict

    g = graph()
    g.output("z", ml.tanh(ml.exp(g.input("x", (64, 64), ml.float32))) + 1.0)
    d = plan_to_dict(_plan(g, processors=2, tiles={"exp": {"elements": 1024}, "tanh": {"elements": 1024}}))
    lists = d["ranks"][0]["processors"]
    d["ranks"][0]["processors"] = [[t for lst in lists for t in lst][::-1], []]
    plan_from_dict(d, rederive=True)


PLANNING.append(Case("rederive-consumers-first", _deadlocked_plan, DeadlockError, ("processor 0", "position")))

CASES = [*DATA, *ARGUMENTS, *PLANNING]


@pytest.mark.parametrize("c", params(CASES))
def test_bad_run_input(c: Case) -> None:
    check(c)

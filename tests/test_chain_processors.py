"""KernelOptions.chain_processors (docs/runtime.md, "Loop kernel v3"): the weight-streaming products
run on the first P - N processors, every other task on the last N, so that a decode step's chain
(attention, the adds, argmax's ranges) never waits behind its processor's bulk copies. The plan must
stay what it computes: the interpreter in random legal orders against the graph's reference."""

from __future__ import annotations

import numpy as np
import pytest

import megaloop as ml
from megaloop.models import LlamaConfig, build_llama_generator, random_parameters
from megaloop.plan import KernelOptions, Plan, make_plan
from megaloop.plan.tasks import streams_weights
from megaloop.reference.interpreter import run_plan

CFG = LlamaConfig(hidden=128, heads=4, kv_heads=2, intermediate=256, layers=2, max_seq=32, vocab=300)


def placement(plan: Plan) -> dict[str, set[int]]:
    """Op name -> the processors its tasks were placed on."""
    rp = plan.ranks[0]
    where: dict[str, set[int]] = {}
    for p, tasks in enumerate(rp.processors):
        for t in tasks:
            where.setdefault(rp.ops[rp.tasks[t].op].name, set()).add(p)
    return where


@pytest.mark.parametrize("chain", [2, 5])
def test_products_and_chain_keep_to_their_processors(chain: int) -> None:
    processors = 16
    options = KernelOptions(chain_processors=chain)
    plan = make_plan(build_llama_generator(CFG, 1), processors=processors, options=options)
    rp = plan.ranks[0]
    streaming = {op.name for op in rp.ops if streams_weights(rp, op)}
    where = placement(plan)
    assert streaming and len(streaming) < len(where)  # both kinds are there
    for name, procs in where.items():
        if name in streaming:
            assert max(procs) < processors - chain, (name, sorted(procs))
        else:
            assert min(procs) >= processors - chain, (name, sorted(procs))
    # the products' tiles are sized for the processors they have: no more tasks than those a round
    for op in rp.ops:
        if op.name in streaming:
            assert sum(t.op == op.id for t in rp.tasks) <= 2 * (processors - chain), op.name


def test_the_split_plan_computes_what_the_graph_does() -> None:
    g = build_llama_generator(CFG, 2)
    params = random_parameters(CFG, seed=3)
    state = {"token": np.array([[5], [7]]), "position": np.array([[3], [6]])}
    ref = ml.evaluate(g, {}, params, state, iterations=3)
    plan = make_plan(g, processors=12, options=KernelOptions(chain_processors=3))
    for seed in range(3):
        got = run_plan(plan, {}, params, state, iterations=3, seed=seed)
        for name in ("token", "position", "generated"):
            assert np.array_equal(got.state[name], ref.state[name]), (seed, name)
        np.testing.assert_array_equal(got.outputs["logits"], ref.outputs["logits"])


def test_the_option_travels_in_the_plan_file_and_a_bad_one_is_refused(tmp_path) -> None:
    options = KernelOptions(chain_processors=4)
    plan = make_plan(build_llama_generator(CFG, 1), processors=16, options=options)
    plan.save(tmp_path / "p.json")
    loaded = Plan.load(tmp_path / "p.json")
    assert loaded.options == options
    assert placement(loaded) == placement(plan)
    with pytest.raises(ml.errors.GraphBuildError, match="chain_processors 16 leaves none of the 16"):
        make_plan(build_llama_generator(CFG, 1), processors=16, options=KernelOptions(chain_processors=16))
    with pytest.raises(ml.errors.MegaloopError, match="chain_processors"):
        make_plan(build_llama_generator(CFG, 1), processors=16, options=KernelOptions(chain_processors=-1))

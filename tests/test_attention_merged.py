"""attention_merged (megaloop/frontend/ops/attention_merged.py, rule attention_merge): the key-range tiles
that merge themselves. Its reference is attention_combine(attention_partial) bit for bit (also in
tests/test_fuse.py's table); the plan orders one iteration's tiles of a block of rows before the next
one's and the verifier accepts it; the plan interpreter (random orders, several iterations with the
caches carried, lengths that are not multiples of the key range, GQA) equals the unfused graph; the
interpreter refuses a plan that lets a tile of the next iteration arrive early; the tiles compile with
NVRTC for sm_90a and sm_80 without spills. The loop kernel: tests/test_gpu_merged.py."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import megaloop as ml
from megaloop.cli import PRESETS
from megaloop.codegen import generate
from megaloop.errors import InterpreterError
from megaloop.models import LlamaConfig, random_parameters
from megaloop.models.llama import build_llama_generator
from megaloop.plan import make_plan
from megaloop.plan.hazards import build_access_table, find_orderings
from megaloop.reference.interpreter import run_plan
from tests.test_attention_append import _append_graph, rounded
from tests.test_plan_interpreter import same, small_tiles

MERGE = ml.FuseOptions(on=("attention_merge",))


def merged_nodes(g: ml.Graph) -> list:
    return [n for n in g.nodes if n.op.name == "attention_merged"]


def _feeds(g: ml.Graph, dt: ml.DType, positions: list[int], seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    feeds = {n: rounded(rng.standard_normal(t.shape), dt) for n, t in g.inputs.items() if n != "pos"}
    feeds["pos"] = np.array(positions, np.int64).reshape(-1, 1)
    return feeds


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_fused_graph_equals_partial_then_combine(dtype) -> None:
    """GQA (8 query heads over 2), 100 keys in 3 ranges of 34 (the last 32), positions at 0, at a
    range's boundary and at the last slot; the plan interpreter in random orders too."""
    dt = ml.as_dtype(dtype)
    g = _append_graph(dt, 3, 8, 2, 100, 3, 16, {}, None)
    feeds = _feeds(g, dt, [0, 34, 99])
    fused = ml.fuse(g, ml.FuseOptions(on=("attention_merge",)))
    assert len(merged_nodes(fused)) == 1 and not [n for n in fused.nodes if n.op.name == "attention_combine"]
    want = ml.evaluate(g, feeds).outputs["out"]
    assert ml.evaluate(fused, feeds).outputs["out"].tobytes() == want.tobytes()
    plan = make_plan(g, processors=5, tiles=small_tiles([fused]), fusion=MERGE)
    for seed in range(3):
        assert run_plan(plan, feeds, seed=seed).outputs["out"].tobytes() == want.tobytes(), f"seed {seed}"


def test_the_plan_orders_each_group_before_its_next_iteration() -> None:
    """Every pair of one block of rows' key-range tiles is ordered one iteration apart (lag 1), even
    where nothing reads the output in the iteration (a graph output only); the verifier accepts."""
    g = _append_graph(ml.float32, 1, 4, 2, 64, 4, 16, {}, None)
    plan = make_plan(g, processors=8, fusion=MERGE)
    plan.verify()
    rp = plan.ranks[0]
    (op,) = [o.id for o in rp.ops if o.op == "attention_merged"]
    tasks = [t for t in rp.tasks if t.op == op]
    groups: dict = {}
    for t in tasks:
        groups.setdefault(t.writes[1].box, []).append(t.id)
    assert len(groups) >= 2 and all(len(ids) == 4 for ids in groups.values()), groups
    seq = np.array([rp.ops[t.op].seq for t in rp.tasks], np.int64)
    o = find_orderings(plan, build_access_table(plan), seq)
    lag1 = {(int(a), int(b)) for a, b, lag in zip(o.before, o.after, o.lag) if lag == 1}
    for ids in groups.values():
        missing = [(a, b) for a in ids for b in ids if a != b and (a, b) not in lag1]
        assert not missing, f"unordered across iterations: {missing}"
    assert not o.overlapping_writers


def test_the_interpreter_refuses_an_early_arrival() -> None:
    """With the lag-1 waits taken off, some random order lets a tile of iteration 1 arrive before its
    group's tiles of iteration 0 have: the interpreter names it."""
    g = ml.Graph("loop")
    dt = ml.float32
    q, k, v = g.input("q", (1, 2, 1, 8), dt), g.input("k", (1, 1, 32, 8), dt), g.input("v", (1, 1, 32, 8), dt)
    g.output("out", ml.attention(q, k, v, kv_splits=4))
    plan = make_plan(g, processors=4, fusion=MERGE)
    rp = plan.ranks[0]
    for t in rp.tasks:
        t.waits = [w for w in t.waits if w.lag == 0]
    rng = np.random.default_rng(1)
    feeds = {n: rng.standard_normal(t.shape).astype(np.float32) for n, t in g.inputs.items()}
    with pytest.raises(InterpreterError, match="arrives while its group's tiles of iteration 0"):
        for seed in range(40):
            run_plan(plan, feeds, iterations=3, seed=seed)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_steps_through_the_plan_equal_the_unfused_generator(dtype) -> None:
    """A tiny GQA Llama generator (kv_splits 3 over 40 slots: ranges of 14, 14, 12), 4 steps carried
    in the caches, in random orders: tokens and caches bit for bit those of the unfused graph."""
    cfg = LlamaConfig(hidden=64, heads=4, kv_heads=2, intermediate=96, layers=2, max_seq=40, vocab=50, dtype=dtype)
    params = random_parameters(cfg, seed=4)
    g = build_llama_generator(cfg, 2, kv_splits=3)
    state = {"token": np.array([[3], [7]]), "position": np.array([[0], [13]])}
    want = ml.evaluate(g, {}, params, state, iterations=4)
    plan = make_plan(g, processors=6, tiles=small_tiles([ml.fuse(g, MERGE)]), fusion=MERGE)
    assert len(merged_nodes(plan.ranks[0].graph)) == cfg.layers
    for seed in range(2):
        same(run_plan(plan, {}, params, state, iterations=4, seed=seed), want, f"seed {seed}")


@pytest.mark.parametrize("arch, target", [("sm_90", "sm_90a"), ("sm_80", "sm_80")])
def test_the_merged_tiles_compile_without_spills(arch, target) -> None:
    """Llama-3.2-1B's decode step with the rule (split keys, bf16, the append form) and a float32
    op whose heads take the warp-a-row path."""
    from tests.test_attention_templates import assert_compiles_without_spills
    from tests.test_row_templates import tile_functions

    cfg = dataclasses.replace(PRESETS["llama3.2-1b"], max_seq=256, layers=1)
    g = _append_graph(ml.float32, 2, 8, 2, 96, 3, 12, {"layout": "interleaved"}, None)
    for graph in (g, build_llama_generator(cfg, 1, kv_splits="auto")):
        src = generate(make_plan(graph, processors=132, arch=arch, fusion=MERGE)).source
        sigs = {sig for sig, (op, body) in tile_functions(src).items() if "ml::attention_merged<" in body}
        assert sigs and "ml::attention_combine<" not in src, graph.name
        assert_compiles_without_spills(src, target, f"{graph.name} on {target}", sigs)

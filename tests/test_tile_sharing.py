"""Tile switches that size tiles for the processors an op really gets: matmuls of one input (q, k, v;
gate, up) share the processors (matmul ``share``), and elementwise ops smaller than one tile are cut
into several (``split_small``). What tiles they make, that results do not change, and that plan files
saved before the switches load as they were made."""

from __future__ import annotations

import numpy as np
import pytest

import megaloop as ml
from megaloop.models import LlamaConfig, build_llama, random_parameters
from megaloop.plan import make_plan
from megaloop.plan.format import plan_from_dict, plan_to_dict
from megaloop.reference.interpreter import run_plan
from tests.helpers import assert_close


def width(task) -> int:
    box = task.writes[0].box
    return box.hi[-1] - box.lo[-1]


def siblings_graph(outs: tuple[int, ...], k: int = 2048) -> ml.Graph:
    """Matmuls of one [1, 1, k] row against weights of ``outs`` rows each (a decode step's q, k, v)."""
    g = ml.Graph("siblings")
    x = g.input("x", (1, 1, k), ml.bfloat16)
    for i, n in enumerate(outs):
        g.output(f"y{i}", ml.matmul(x, g.parameter(f"w{i}", (n, k), ml.bfloat16), transpose_b=True))
    return g


def test_sibling_matmuls_make_one_round_between_them() -> None:
    g = siblings_graph((2048, 512, 512))
    shared = make_plan(g, processors=132)
    counts = [len([t for t in shared.ranks[0].tasks if t.op == op.id]) for op in shared.ranks[0].ops]
    assert counts == [86, 22, 22] and sum(counts) <= 132  # 24-column tiles: one round
    assert max(width(t) for t in shared.ranks[0].tasks) == 24
    alone = make_plan(g, processors=132, tiles={"matmul": {"share": 0}})
    counts = [len([t for t in alone.ranks[0].tasks if t.op == op.id]) for op in alone.ranks[0].ops]
    assert counts == [128, 64, 64]  # each sized for every processor: two rounds
    one = make_plan(siblings_graph((2048,)), processors=132)
    assert len(one.ranks[0].tasks) == 128  # no siblings: as before


def test_only_matmuls_of_one_input_share() -> None:
    """Two matmuls of different inputs (one after the other) each keep every processor."""
    g = ml.Graph("chain")
    x = g.input("x", (1, 1, 2048), ml.bfloat16)
    y = ml.matmul(x, g.parameter("w0", (2048, 2048), ml.bfloat16), transpose_b=True)
    g.output("z", ml.matmul(y, g.parameter("w1", (2048, 2048), ml.bfloat16), transpose_b=True))
    rp = make_plan(g, processors=132).ranks[0]
    assert [len([t for t in rp.tasks if t.op == op.id]) for op in rp.ops] == [128, 128]


def test_a_matrix_vector_product_of_many_tiles_fills_its_last_round() -> None:
    """An LM head (one row against 128256 x 2048 weights): 256-column tiles were 501, 3.8 rounds of 132
    processors; 248-column tiles are 518, 4 rounds, the busiest processor 992 columns, not 1024. Its
    results do not change."""
    rp = make_plan(siblings_graph((128256,)), processors=132).ranks[0]
    assert len(rp.tasks) == 518 and max(width(t) for t in rp.tasks) == 248
    assert sum(width(t) for t in rp.tasks) == 128256
    busiest = max(sum(width(rp.tasks[i]) for i in tasks) for tasks in rp.processors)
    assert busiest <= 4 * 248, busiest
    tall = ml.Graph("tall")  # tiles of 16 rows or more keep their width: they re-read A a column tile
    x = tall.input("x", (1, 64, 2048), ml.bfloat16)
    tall.output("y", ml.matmul(x, tall.parameter("w", (40000, 2048), ml.bfloat16), transpose_b=True))
    assert max(width(t) for t in make_plan(tall, processors=132).ranks[0].tasks) == 256
    g = siblings_graph((3000,), k=64)  # small enough for the interpreter: 3000 columns on 8 processors
    plan = make_plan(g, processors=8)
    assert max(width(t) for t in plan.ranks[0].tasks) < 256
    rng = np.random.default_rng(5)
    params = {"w0": ml.dtypes.round_to(rng.standard_normal((3000, 64)), ml.bfloat16)}
    feeds = {"x": ml.dtypes.round_to(rng.standard_normal((1, 1, 64)), ml.bfloat16)}
    want = ml.evaluate(g, feeds, params).outputs["y0"]
    assert np.array_equal(run_plan(plan, feeds, params, seed=1).outputs["y0"], want)


@pytest.mark.parametrize("dtype,tile", [("bfloat16", 2048), ("float32", 1024)])
def test_small_elementwise_ops_take_a_pack_a_thread(dtype: str, tile: int) -> None:
    g = ml.Graph("silu")
    x = g.input("x", (1, 1, 5504), dtype)
    g.output("y", ml.silu(x))
    split = make_plan(g, processors=132)
    sizes = [t.writes[0].box.size for t in split.ranks[0].tasks]
    pack = 16 // ml.as_dtype(dtype).itemsize
    assert len(sizes) == -(-5504 // tile) and max(sizes) <= tile and sum(sizes) == 5504, sizes
    assert len(set(sizes[:-1])) == 1 and all(n % pack == 0 for n in sizes), sizes  # equal pieces of whole packs
    whole = make_plan(g, processors=132, tiles={"silu": {"split_small": 0}})
    assert len(whole.ranks[0].tasks) == 1
    rng = np.random.default_rng(3)
    feeds = {"x": ml.dtypes.round_to(rng.standard_normal((1, 1, 5504)), ml.as_dtype(dtype))}
    want = ml.evaluate(g, feeds).outputs["y"]
    for seed in range(3):
        assert np.array_equal(run_plan(split, feeds, seed=seed).outputs["y"], want)


def test_big_and_one_pack_ops_are_unchanged() -> None:
    """An op of more than one tile keeps its tiling; one of at most a pack a thread stays one tile; one
    of exactly one tile (Llama-3.2-1B's silu_mul over 8192 values) is split into packs a thread."""
    for n, tasks in ((2048, 1), (8192, 4), (8200, 2), (16384, 2)):
        g = ml.Graph("add")
        x = g.input("x", (1, n), ml.bfloat16)
        g.output("y", x + x)
        assert len(make_plan(g, processors=132).ranks[0].tasks) == tasks, n


def test_decode_step_keeps_its_results() -> None:
    """A Llama decode step with the switches on (sibling tiles of 24 columns and the like) against the
    graph's reference evaluation, in random legal orders; its silu_mul in several tiles."""
    cfg = LlamaConfig(hidden=256, heads=4, kv_heads=2, intermediate=2752, layers=1, max_seq=32, vocab=None)
    g = build_llama(cfg, 1, 1)
    params = random_parameters(cfg, seed=2)
    rng = np.random.default_rng(4)
    feeds = {"hidden": rng.standard_normal((1, 1, 256)).astype(np.float32), "positions": np.array([[9]])}
    apart = ml.FuseOptions(off=("rmsnorm_linear", "swiglu_linear", "attention_append"))  # (silu_mul an op of its own)
    plan = make_plan(g, processors=16, fusion=apart)
    rp = plan.ranks[0]
    (silu_mul,) = [op.id for op in rp.ops if op.op == "silu_mul"]
    assert len([t for t in rp.tasks if t.op == silu_mul]) == 2  # 2752 values: 1376 + 1376
    want = ml.evaluate(g, feeds, params).outputs["hidden"]
    for seed in range(2):
        got = run_plan(plan, feeds, params, seed=seed).outputs["hidden"]
        assert np.array_equal(got, want), f"seed {seed}: worst {np.max(np.abs(got.astype(float) - want))}"


def test_files_saved_before_the_switches_load_as_they_were_made() -> None:
    g = ml.Graph("both")
    x = g.input("x", (1, 1, 2048), ml.bfloat16)
    ys = [
        ml.matmul(x, g.parameter(f"w{i}", (n, 2048), ml.bfloat16), transpose_b=True)
        for i, n in enumerate((512, 5504, 5504))
    ]
    g.output("y", ml.silu(ys[1]) * ys[2])
    g.output("k", ys[0])
    apart = ml.FuseOptions.none()  # (the plain ops whose tile switches these are)
    old = make_plan(
        g,
        processors=132,
        tiles={"matmul": {"share": 0}, "silu": {"split_small": 0}, "mul": {"split_small": 0}},
        fusion=apart,
    )
    data = plan_to_dict(old)
    for op in data["ranks"][0]["ops"]:
        op["tile"].pop("share", None)
        op["tile"].pop("split_small", None)
    loaded = plan_from_dict(data)
    assert len(loaded.ranks[0].tasks) == len(old.ranks[0].tasks)
    assert len(loaded.ranks[0].tasks) != len(make_plan(g, processors=132, fusion=apart).ranks[0].tasks)
    rng = np.random.default_rng(5)
    params = {
        f"w{i}": ml.dtypes.round_to(rng.standard_normal((n, 2048)), ml.bfloat16)
        for i, n in enumerate((512, 5504, 5504))
    }
    feeds = {"x": ml.dtypes.round_to(rng.standard_normal((1, 1, 2048)), ml.bfloat16)}
    got = run_plan(loaded, feeds, params).outputs["y"]
    assert np.array_equal(got, ml.evaluate(g, feeds, params).outputs["y"])
    # independently in float64, rounding to bf16 where the graph's ops store (the projections, silu)
    w1, w2 = (params[f"w{i}"].astype(np.float64) for i in (1, 2))
    a = feeds["x"].astype(np.float64)
    bf = lambda v: ml.dtypes.round_to(v, ml.bfloat16).astype(np.float64)
    gate, up = bf(a @ w1.T), bf(a @ w2.T)
    assert_close(got, bf(gate / (1 + np.exp(-gate))) * up, ml.bfloat16, ml.REGISTRY["mul"].accuracy, 1, "y")


def test_tall_sibling_tiles_only_get_wider() -> None:
    """Prefill-sized siblings (tensor-core tiles of 128 rows): sharing may make their tiles wider
    (fewer tasks: hidden 2048's q, 64 -> 128 columns) but never narrower (hidden 4096's q would have
    gone from 128 to 64 columns on its share, 256 tiles)."""
    for k, q_alone, q_shared in ((2048, 64, 128), (4096, 128, 128)):
        g = ml.Graph("prefill-siblings")
        x = g.input("x", (512, k), ml.bfloat16)
        for i, n in enumerate((k, k // 4, k // 4)):
            g.output(f"y{i}", ml.matmul(x, g.parameter(f"w{i}", (n, k), ml.bfloat16), transpose_b=True))
        for share, want in ((0, q_alone), (1, q_shared)):
            rp = make_plan(g, processors=132, tiles={"matmul": {"share": share}}, fusion=ml.FuseOptions.none()).ranks[0]
            q_tiles = [t for t in rp.tasks if t.op == rp.ops[0].id]
            assert max(width(t) for t in q_tiles) == want, (k, share)


def test_split_small_leaves_big_tiles_and_makes_even_pieces() -> None:
    """Past what the template keeps in flight (8 packs a thread) an op stays one tile even where
    ``elements`` was raised to hold it; 2049 values make two near-equal tiles, not 2048 + 1."""
    for n, elements, want in ((60000, 65536, [60000]), (2049, 8192, [1032, 1017]), (16384, 65536, [16384])):
        g = ml.Graph("silu")
        g.output("y", ml.silu(g.input("x", (1, n), ml.bfloat16)))
        plan = make_plan(g, processors=132, tiles={"silu": {"elements": elements}})
        assert [t.writes[0].box.size for t in plan.ranks[0].tasks] == want, n


def test_matmuls_of_one_input_against_computed_operands_do_not_share() -> None:
    """Only matmuls against weights share: one whose B is computed (here from a sibling's output)
    waits for it, so sizing both for half the processors would only lengthen the plan."""
    g = ml.Graph("dependent")
    x = g.input("x", (1, 1, 2048), ml.bfloat16)
    a = ml.matmul(x, g.parameter("w0", (2048, 2048), ml.bfloat16), transpose_b=True)  # [1, 1, 2048]
    b = ml.matmul(a, g.input("v", (1, 1, 2048), ml.bfloat16), transpose_a=True)  # [1, 2048, 2048]
    g.output("y", ml.matmul(x, b))  # a decode row: sharing would have narrowed a's and y's tiles
    shared = make_plan(g, processors=132)
    alone = make_plan(g, processors=132, tiles={"matmul": {"share": 0}})
    assert [t.writes[0].box for t in shared.ranks[0].tasks] == [t.writes[0].box for t in alone.ranks[0].tasks]


def test_attention_combine_takes_a_row_a_warp() -> None:
    """``warp_rows``: a combine tile holds at most a (batch, head, query) row a warp (32 heads: 4 tiles of
    8, not 31 + 1, which left one tile 4 rounds of its warps); the decode step's result does not change;
    plan files saved before the switch load with the tiles they were made with."""
    cfg = LlamaConfig(hidden=2048, heads=32, kv_heads=8, intermediate=256, layers=1, max_seq=64, vocab=None)
    g = build_llama(cfg, 1, 1, kv_splits=4)  # Llama-3.2-1B's attention: 32 heads of 64
    params = random_parameters(cfg, seed=6)
    rng = np.random.default_rng(7)
    feeds = {"hidden": rng.standard_normal((1, 1, 2048)).astype(np.float32), "positions": np.array([[40]])}

    def combine_rows(plan) -> list[int]:
        rp = plan.ranks[0]
        (op,) = [o.id for o in rp.ops if o.op == "attention_combine"]
        return [t.writes[0].box.size // 64 for t in rp.tasks if t.op == op]  # 64 values a head

    split = make_plan(g, processors=132)
    old = make_plan(g, processors=132, tiles={"attention_combine": {"warp_rows": 0}})
    assert combine_rows(split) == [8, 8, 8, 8] and combine_rows(old) == [31, 1]
    want = ml.evaluate(g, feeds, params).outputs["hidden"]
    for seed in range(2):
        assert np.array_equal(run_plan(split, feeds, params, seed=seed).outputs["hidden"], want), seed
    data = plan_to_dict(old)
    for op in data["ranks"][0]["ops"]:
        op["tile"].pop("warp_rows", None)
    assert combine_rows(plan_from_dict(data)) == [31, 1]


def test_files_saved_before_split_full_keep_one_tile_ops_whole() -> None:
    """``split_full`` (an op of exactly one tile, 8192 bf16 values, cut into 4) came after split_small:
    a file saved with split_small but without split_full loads with the one tile it was made with."""
    g = ml.Graph("full")
    x = g.input("x", (1, 8192), ml.bfloat16)
    g.output("y", ml.silu(x) * x)
    apart = ml.FuseOptions.none()  # (silu and mul, not silu_mul)
    assert {len(make_plan(g, processors=132, fusion=apart).ranks[0].tasks)} == {8}  # silu and mul: 4 tiles each
    old = make_plan(g, processors=132, tiles={op: {"split_full": 0} for op in ("silu", "mul")}, fusion=apart)
    assert len(old.ranks[0].tasks) == 2
    data = plan_to_dict(old)
    for op in data["ranks"][0]["ops"]:
        assert op["tile"].pop("split_full") == 0 and op["tile"]["split_small"] == 1
    loaded = plan_from_dict(data)
    assert len(loaded.ranks[0].tasks) == 2
    feeds = {"x": ml.dtypes.round_to(np.random.default_rng(8).standard_normal((1, 8192)), ml.bfloat16)}
    assert np.array_equal(run_plan(loaded, feeds).outputs["y"], ml.evaluate(g, feeds).outputs["y"])

"""The matmul tile switch fold_batch: batched decode (A [sequences, tokens, hidden] against weights
without batch axes) takes the rows of several batch indices a tile, so that a tile reads its block of
weights once for all of them. Tiling, the plan interpreter against float64 references, and the
generated skinny tensor-core path (compiled; the GPU check is in tests/test_gpu.py)."""

from __future__ import annotations

import re

import numpy as np
import pytest

import megaloop as ml
from megaloop.codegen import generate
from megaloop.models import LlamaConfig, build_llama, random_parameters
from megaloop.plan import make_plan
from megaloop.plan.format import plan_from_dict, plan_to_dict
from megaloop.reference.interpreter import run_plan
from megaloop.runtime.compile import compile_cubin, spills
from tests.helpers import assert_close

FOLD = {"matmul": {"fold_batch": 1}}  # the default; spelled out where a test is about the switch
UNFOLDED = {"matmul": {"fold_batch": 0}}


def batched_graph(a_shape: tuple[int, ...], b_shape: tuple[int, ...], dtype: str = "bfloat16") -> ml.Graph:
    g = ml.Graph("fold")
    x = g.input("x", a_shape, dtype)
    g.output("y", ml.matmul(x, g.parameter("w", b_shape, dtype), transpose_b=True))
    return g


def boxes(plan) -> list:
    return [t.writes[0].box for t in plan.ranks[0].tasks]


@pytest.mark.parametrize(
    "a_shape,b_shape,batches_a_tile",
    [
        ((4, 1, 256), (96, 256), [4]),  # 4 sequences of one token: one tile's rows
        ((12, 1, 256), (96, 256), [8, 4]),  # 8 rows a tile at most
        ((3, 2, 256), (96, 256), [3]),  # two tokens each: 6 rows
        ((1, 6, 1, 256), (96, 256), [6]),  # a leading batch axis of size 1
        ((3, 5, 256), (96, 256), [1]),  # 5 rows: two batch indices would pass 8
        ((4, 1, 256), (4, 96, 256), [1]),  # weights of their own per batch index: nothing to share
        ((2, 3, 1, 256), (96, 256), [1]),  # two batch axes vary: not folded
    ],
)
def test_tiles_take_several_batch_indices_only_where_asked_and_useful(a_shape, b_shape, batches_a_tile) -> None:
    g = batched_graph(a_shape, b_shape)
    folded = boxes(make_plan(g, processors=132, tiles=FOLD))
    counts = sorted({int(np.prod(b.shape[:-2])) for b in folded}, reverse=True)
    assert counts == batches_a_tile
    for b in folded:  # whole rows of consecutive batch indices
        assert b.lo[-2] == 0 and b.hi[-2] == a_shape[-2]
    assert boxes(make_plan(g, processors=132)) == folded  # on by default
    unfolded = boxes(make_plan(g, processors=132, tiles=UNFOLDED))
    assert {int(np.prod(b.shape[:-2])) for b in unfolded} == {1}
    covered = np.zeros(tuple(a_shape[:-1]) + (96,), int)
    for b in folded:
        covered[b.slices] += 1
    assert (covered == 1).all()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_folded_plans_match_float64(dtype: str) -> None:
    rng = np.random.default_rng(5)
    for a_shape, b_shape in (((4, 1, 256), (96, 256)), ((12, 1, 128), (40, 128)), ((3, 2, 64), (24, 64))):
        g = batched_graph(a_shape, b_shape, dtype)
        x, w = rng.standard_normal(a_shape), rng.standard_normal(b_shape)
        dt = ml.as_dtype(dtype)
        x, w = ml.dtypes.round_to(x, dt), ml.dtypes.round_to(w, dt)
        for seed in range(3):
            got = run_plan(make_plan(g, processors=16, tiles=FOLD), {"x": x}, {"w": w}, seed=seed).outputs["y"]
            want = x.astype(np.float64) @ w.astype(np.float64).T
            assert_close(got, want, dt, ml.REGISTRY["matmul"].accuracy, a_shape[-1], f"{a_shape} seed {seed}")


def test_folded_tiles_take_the_skinny_path_and_compile() -> None:
    """Every folded tile runs its rows of all its batch indices on the skinny tensor-core path, the
    weights streamed where each block is read once; no spills; Hopper and Ampere."""
    once = generate(make_plan(batched_graph((4, 1, 1024), (512, 1024)), processors=132, tiles=FOLD)).source
    assert "rows of its batch indices one after the other" in once
    assert ", true>(in0 + ab" in once  # one tile per block of weights: streamed
    twice = generate(make_plan(batched_graph((12, 1, 1024), (512, 1024)), processors=132, tiles=FOLD)).source
    assert "rows of its batch indices one after the other" in twice
    assert ", false>(in0 + ab" in twice  # two tiles (8 + 4 sequences) read each block: kept in L2
    assert spills(once) == {}
    for arch in ("sm_90a", "sm_80"):
        assert compile_cubin(once, arch, use_cache=False)[:4] == b"\x7fELF"


def skinny_row_strides(src: str) -> set[int]:
    """The A row strides the generated skinny calls pass (lda of ml::mma_skinny)."""
    return {int(v) for v in re.findall(r"mma_skinny<[^>]*>\(in0 \+ ab, (\d+), nr", src)}


def views_graph(kind: str) -> ml.Graph:
    """A folded matmul whose A is a view: its rows of consecutive sequences are 3 K apart (a slice of
    [4, 3, K]), or all the same row (one sequence broadcast to 4)."""
    g = ml.Graph(kind)
    if kind == "slice":
        x = g.input("x", (4, 3, 256), "bfloat16")
        a, _ = ml.split(x, [1, 2], axis=1)
    else:
        a = ml.broadcast_to(g.input("x", (1, 1, 256), "bfloat16"), (4, 1, 256))
    g.output("y", ml.matmul(a, g.parameter("w", (96, 256), "bfloat16"), transpose_b=True))
    return g


@pytest.mark.parametrize("kind,stride", [("slice", 3 * 256), ("broadcast", 0)])
def test_folded_views_step_their_rows_by_the_view_strides(kind: str, stride: int) -> None:
    """The generated code steps a folded box's rows by the view's own stride (a broadcast A: 0; its row
    axis's stride, the stride of a size-1 axis, once made rows 1..3 read past x into the output), and the
    plan matches float64."""
    g = views_graph(kind)
    plan = make_plan(g, processors=132, tiles=FOLD)
    assert {int(np.prod(b.shape[:-2])) for b in boxes(plan)} == {4}
    assert skinny_row_strides(generate(plan).source) == {stride}
    rng = np.random.default_rng(6)
    x = ml.dtypes.round_to(rng.standard_normal(g.inputs["x"].shape), ml.bfloat16)
    w = ml.dtypes.round_to(rng.standard_normal((96, 256)), ml.bfloat16)
    got = run_plan(plan, {"x": x}, {"w": w}, seed=1).outputs["y"]
    a = x[:, :1] if kind == "slice" else np.broadcast_to(x, (4, 1, 256))
    want = a.astype(np.float64) @ w.astype(np.float64).T
    assert_close(got, want, ml.bfloat16, ml.REGISTRY["matmul"].accuracy, 256, kind)


def test_batched_ops_the_tiling_does_not_fold_stay_off_the_skinny_path() -> None:
    """With fold_batch on, an op whose tiles still hold one batch index each (5 rows a sequence) keeps
    the per-element path, as with it off: a skinny tile per sequence would read the weights again."""
    src = generate(make_plan(batched_graph((3, 5, 256), (96, 256)), processors=132, tiles=FOLD)).source
    assert "mma_skinny<" not in src


def test_batched_llama_decode_with_folded_tiles_matches_the_reference() -> None:
    """A Llama decode step for 4 sequences with fold_batch on: the plan interpreter (random legal
    orders) against the graph's float64-reference evaluation, and every matmul on the folded path."""
    cfg = LlamaConfig(hidden=128, heads=4, kv_heads=2, intermediate=256, layers=2, max_seq=32, vocab=None)
    g = build_llama(cfg, 4, 1)
    params = random_parameters(cfg, seed=1)
    rng = np.random.default_rng(2)
    feeds = {"hidden": rng.standard_normal((4, 1, 128)).astype(np.float32), "positions": np.full((4, 1), 7)}
    plan = make_plan(g, processors=16, tiles=FOLD)
    src = generate(plan).source
    assert src.count("rows of its batch indices one after the other") >= 4
    # whole rows of consecutive sequences only, stepped by the sequences' stride: hidden (128) or
    # intermediate (256) elements, also where A's own row axis (size 1) has stride 1 (the attention
    # output, [4, 1, 128] as a view of [4, 4, 1, 32] heads)
    assert "(box_batches == 1 || (t.lo[1] == 0 && t.hi[1] == 1))" in src
    assert skinny_row_strides(src) == {128, 256}
    want = ml.evaluate(g, feeds, params).outputs
    for seed in range(2):
        got = run_plan(plan, feeds, params, seed=seed).outputs
        for name, value in want.items():
            np.testing.assert_array_equal(got[name], value, err_msg=f"{name}, seed {seed}")


def test_files_saved_before_the_switch_load_with_a_tile_per_sequence() -> None:
    """fold_batch changes the tasks; a plan file without it (saved before it existed, when each batch
    index had its own tiles) loads as it was made, and runs."""
    g = batched_graph((4, 1, 256), (96, 256))
    data = plan_to_dict(make_plan(g, processors=132, tiles=UNFOLDED))
    op = next(o for o in data["ranks"][0]["ops"] if o["op"] == "matmul")
    del op["tile"]["fold_batch"]
    loaded = plan_from_dict(data)
    assert loaded.ranks[0].ops[op["id"]].tile["fold_batch"] == 0
    assert {int(np.prod(b.shape[:-2])) for b in boxes(loaded)} == {1}
    rng = np.random.default_rng(8)
    x = ml.dtypes.round_to(rng.standard_normal((4, 1, 256)), ml.bfloat16)
    w = ml.dtypes.round_to(rng.standard_normal((96, 256)), ml.bfloat16)
    got = run_plan(loaded, {"x": x}, {"w": w}).outputs["y"]
    want = x.astype(np.float64) @ w.astype(np.float64).T
    assert_close(got, want, ml.bfloat16, ml.REGISTRY["matmul"].accuracy, 256, "loaded")

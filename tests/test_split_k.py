"""Split-K products (ops.split_k_linear, auto_k_splits, the split_k_linear rewrite of megaloop.fuse): the
choice of splits, the plan interpreter (random legal orders) against numpy float64, the Llama
prefill with and without it, the thread-per-element reduction its sum takes, and the kernel compiling."""

from __future__ import annotations

import numpy as np
import pytest

import megaloop as ml
from megaloop import errors
from megaloop.codegen import generate
from megaloop.frontend.ops.matmul import auto_k_splits
from megaloop.models import LlamaConfig, build_llama, random_parameters
from megaloop.plan import make_plan
from megaloop.reference.interpreter import run_plan
from megaloop.runtime.compile import compile_cubin
from tests.helpers import assert_close


@pytest.mark.parametrize(
    "rows,n,k,want",
    [
        (128, 2048, 2048, 4),  # a 1B prefill's q and o projections: 32 tiles -> 128
        (128, 2048, 8192, 4),  # its down projection
        (128, 8192, 2048, None),  # gate and up: 128 tiles already
        (1, 2048, 2048, None),  # decode: the matrix-vector tiles narrow their columns instead
        (128, 512, 1024, 2),  # ranges of at least 512
        (128, 64, 65536, 8),  # at most 8 partials
        (128, 2048, 2050, None),  # K with no even split
    ],
)
def test_auto_k_splits_fills_a_wave_of_processors(rows: int, n: int, k: int, want: int | None) -> None:
    assert auto_k_splits(rows, n, k) == want


def test_auto_k_splits_counts_every_sequence_s_tiles() -> None:
    assert auto_k_splits(128, 2048, 2048, batches=2) == 2  # 64 tiles already
    assert auto_k_splits(128, 2048, 2048, batches=4) is None
    assert auto_k_splits(8, 2048, 2048, batches=16) is None  # 8 rows a tile: the few-row paths


def split_graph(lead: tuple[int, ...], m: int, n: int, k: int, splits: int, dtype: str = "bfloat16") -> ml.Graph:
    g = ml.Graph("split_k")
    x = g.input("x", (*lead, m, k), dtype)
    w = g.parameter("w", (n, k), dtype)
    g.output("y", ml.linear(x, w, k_splits=splits))
    return g


@pytest.mark.parametrize("lead,splits", [((), 4), ((2,), 8), ((1, 3), 2)])
def test_split_k_linear_matches_float64_in_any_order(lead: tuple[int, ...], splits: int) -> None:
    m, n, k = 40, 96, 512
    g = split_graph(lead, m, n, k, splits)
    rng = np.random.default_rng(splits + len(lead))
    x = ml.dtypes.round_to(rng.standard_normal((*lead, m, k)), ml.bfloat16)
    w = ml.dtypes.round_to(rng.standard_normal((n, k)), ml.bfloat16)
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    want = x64 @ w64.T
    # each partial is rounded to bfloat16 before the sum: half an ulp of each, at most
    part = k // splits
    partials = np.stack(
        [x64[..., s * part : (s + 1) * part] @ w64[:, s * part : (s + 1) * part].T for s in range(splits)]
    )
    atol = np.abs(partials).max() * splits * 2.0**-8
    plan = make_plan(g, processors=16)
    assert sum(op.op == "sum" for op in plan.ranks[0].ops) == 1
    for seed in range(2):
        got = run_plan(plan, {"x": x}, {"w": w}, seed=seed).outputs["y"]
        assert_close(
            got, want, ml.bfloat16, ml.REGISTRY["matmul"].accuracy, k, f"split {splits}, seed {seed}", atol=atol
        )
    # not the single product's bits: a test of the split itself
    single = ml.dtypes.round_to(want, ml.bfloat16)
    assert not np.array_equal(got, single) or splits == 1


def test_split_k_linear_refuses_a_split_that_does_not_divide_k() -> None:
    g = ml.Graph("bad")
    x = g.input("x", (8, 100), "bfloat16")
    w = g.parameter("w", (16, 100), "bfloat16")
    with pytest.raises(errors.ShapeError, match=r"k_splits=3 .*in_features 100 \(x \[8,100\]"):
        ml.linear(x, w, k_splits=3)


def test_the_split_sum_takes_a_thread_an_element_and_compiles() -> None:
    """The sum over the partials (a strided leading axis) folds each output element on one thread;
    the tiles stay on the tensor cores (views with K contiguous)."""
    g = split_graph((1,), 128, 256, 2048, 4)
    src = generate(make_plan(g, processors=132)).source
    assert "ml::reduce_threads<ml::RED_SUM, 4," in src
    assert "ml::wgmma_tile<" in src
    compile_cubin(src, "sm_90a")
    compile_cubin(generate(make_plan(g, processors=108, arch="sm_80")).source, "sm_80")
    batched = split_graph((2,), 64, 256, 2048, 4)  # partials of two sequences: two batch axes walked
    compile_cubin(generate(make_plan(batched, processors=132)).source, "sm_90a")


def test_llama_prefill_with_split_projections_matches_the_single_products() -> None:
    """A small Llama prefill fused with split_k_linear (all seven projections over ranges of K: its rows
    are many and its projections narrow) against the same model without: the float64 reference of each,
    and the plan interpreter of the split one."""
    cfg = LlamaConfig(hidden=1024, heads=8, kv_heads=2, intermediate=2048, layers=1, max_seq=64, vocab=None)
    whole = build_llama(cfg, 1, 32)
    split = ml.fuse(whole)
    sums = [n for n in split.nodes if n.op.name == "sum"]
    assert len(sums) == 7, [n.name for n in sums]  # every projection: 16-32 output tiles each
    assert not any(n.op.name == "sum" for n in whole.nodes)
    params = random_parameters(cfg, seed=3)
    rng = np.random.default_rng(4)
    feeds = {"hidden": rng.standard_normal((1, 32, 1024)).astype(np.float32), "positions": np.arange(32)[None]}
    want = ml.evaluate(whole, feeds, params).outputs["hidden"].astype(np.float64)
    got = ml.evaluate(split, feeds, params).outputs["hidden"].astype(np.float64)
    scale = np.abs(want).max()
    worst = np.abs(got - want).max() / scale
    print(f"split against whole: worst {worst:.2e} of max |hidden| {scale:.2f}")
    assert worst < 2.0**-6, worst  # a few bfloat16 roundings of the largest values, no more
    plan = make_plan(split, processors=32)
    ran = run_plan(plan, feeds, params, seed=1).outputs["hidden"]
    np.testing.assert_array_equal(ran, got.astype(ran.dtype))

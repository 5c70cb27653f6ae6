"""The fast CPU path (megaloop.reference.fast, each op's ``OpDef.fast``) against ml.evaluate, its
definition: every row of the op table in every dtype it lists (the same bits where the op's fast
implementation says it is exact, else within the op's accuracy contract), states written in place
with ml.evaluate's values, and errors that name the op."""

from __future__ import annotations

import sys
import zlib

import numpy as np
import pytest

import megaloop as ml
from megaloop.errors import DataError, EvaluationError
from megaloop.frontend.opdef import REGISTRY
from megaloop.models import LlamaConfig, build_llama, random_parameters
from megaloop.reference.fast import ComputeWeights, FastGraph, evaluate_fast
from tests.helpers import assert_close, to_f64
from tests.op_table import ROWS, TESTED_ELSEWHERE, Row, build_row

DRAWS = 3


def same_bits(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Equal values and dtypes, NaN where NaN (the worst difference printed when not)."""
    assert (got.dtype, got.shape) == (want.dtype, want.shape), f"{what}: {got.dtype}{got.shape}, not {want.shape}"
    g, w = to_f64(got), to_f64(want)
    same = (g == w) | (np.isnan(g) & np.isnan(w))
    if not np.all(same):
        at = tuple(int(i) for i in np.argwhere(~same)[0])
        worst = float(np.nanmax(np.abs(g - w)))
        raise AssertionError(f"{what}: {np.count_nonzero(~same)} of {g.size} differ, first at {at}: {g[at]!r} vs "
                             f"{w[at]!r}; worst {worst:.3e}")  # fmt: skip


def check_row(row: Row, dtype: str, seed: int) -> None:
    g, feeds, state, _, outs, sample = build_row(row, dtype, seed)
    want = ml.evaluate(g, feeds, state=state)
    outputs, states = evaluate_fast(g, feeds, {}, state)
    exact = all(n.op.fast is None or n.op.fast.exact for n in g.nodes)  # (a row may build several ops)
    for k, t in enumerate(outs):
        what = f"{row.id} [{dtype}] seed {seed} shapes {sample.shapes} kw {sample.kw} output {k}"
        if exact:
            same_bits(outputs[f"y{k}"], want.outputs[f"y{k}"], what)
        else:  # both within the contract of the truth: within twice it of each other
            acc = REGISTRY[row.op].accuracy
            doubled = type(acc)(ulps=2 * acc.ulps, per_reduction=acc.per_reduction)
            ref = to_f64(want.outputs[f"y{k}"])
            assert_close(outputs[f"y{k}"], ref, t.dtype, doubled, row.reduce_len(sample), what)
    for name in want.state:
        same_bits(states[name], want.state[name], f"{row.id} [{dtype}] seed {seed} state {name}")


CASES = [(row, dt) for row in ROWS for dt in row.dtypes]


@pytest.mark.parametrize("row,dtype", CASES, ids=[f"{r.id}-{d}" for r, d in CASES])
def test_op_on_the_fast_path_equals_evaluate(row: Row, dtype: str) -> None:
    base = zlib.crc32(f"fast-{row.id}-{dtype}".encode())
    for draw in range(DRAWS):
        check_row(row, dtype, base + draw)


def test_every_computing_op_runs_on_the_fast_path_and_is_in_the_table() -> None:
    """Each op the fast path runs, by its own implementation or by its reference on storage dtypes (the
    training ops: grad, loss, optimizers), is tested above; the exchanges (one rank's graphs only) and
    sources (the executor's) are not run by it. The ops decoding runs have their own implementation."""
    tabled = {row.op for row in ROWS}
    computing = {n for n, op in REGISTRY.items() if op.kind not in ("source", "collective", "p2p")}
    untabled = sorted(n for n in computing if n not in tabled and n not in TESTED_ELSEWHERE)
    assert not untabled, f"ops the fast path runs with no op-table row: {untabled}"
    decoding = {"matmul", "rmsnorm", "rope", "attention", "attention_partial", "attention_combine", "embedding",
                "kv_cache_update", "silu_mul", "argmax", "sample", "paged_attention", "paged_kv_cache_update"}
    slow = sorted(n for n in decoding & set(REGISTRY) if REGISTRY[n].fast is None)
    assert not slow, f"decoding ops without a fast implementation: {slow}"


def _cache_graph(dtype: str = "bfloat16") -> ml.Graph:
    g = ml.Graph("cache")
    new = g.input("new", (1, 2, 1, 4), dtype)
    pos = g.input("pos", (1, 1), "int64")
    cache = g.state("cache", (1, 2, 8, 4), dtype)
    g.output("before", cache)  # the value the step starts from: read before the write
    g.output("first_row", ml.slice_(cache, (0, 0, 0, 0), (1, 2, 1, 4)))
    updated = ml.kv_cache_update(cache, new, pos)
    g.output("sum", ml.sum(updated, axis=2))
    return g


def test_a_cache_is_written_in_place_with_evaluate_values() -> None:
    g = _cache_graph()
    run = FastGraph(g, {}, verify=True)
    buffer = run.state["cache"]
    rng = np.random.default_rng(0)
    state = None
    for step in range(5):
        feeds = {"new": rng.standard_normal((1, 2, 1, 4)).astype(np.float32), "pos": np.array([[step]])}
        want = ml.evaluate(g, feeds, state=state)
        got = run.run(feeds)
        state = want.state
        assert run.state["cache"] is buffer, "the cache was copied, not written in place"
        for name in want.outputs:
            same_bits(got[name], want.outputs[name], f"step {step} output {name}")
        same_bits(run.read_state(["cache"])["cache"], want.state["cache"], f"step {step} cache")


def test_weights_are_converted_once_and_shared() -> None:
    cfg = LlamaConfig(hidden=32, heads=4, kv_heads=2, intermediate=64, layers=1, max_seq=16, vocab=40)
    params = random_parameters(cfg)
    weights = ComputeWeights(params)
    a = FastGraph(build_llama(cfg, 1, 4), weights)
    b = FastGraph(build_llama(cfg, 1, 1), weights)
    name = "model.layers.0.mlp.up_proj.weight"
    t = a.graph.parameters[name]
    assert weights.has(name, t) and weights.get(name, t) is weights.get(name, b.graph.parameters[name])
    assert weights.get(name, t).dtype == np.float32 and not weights.get(name, t).flags.writeable
    assert weights.nbytes == sum(4 * v.size for v in params.values())
    assert dict(weights) == params  # as a mapping: the arrays as given


def test_bad_data_is_refused_naming_the_op() -> None:
    cfg = LlamaConfig(hidden=32, heads=4, kv_heads=2, intermediate=64, layers=1, max_seq=8, vocab=40)
    run = FastGraph(build_llama(cfg, 1, 2), random_parameters(cfg))
    with pytest.raises(DataError, match=r"embedding .*id 45 .*outside the table of 40 rows"):
        run.run({"tokens": np.array([[1, 45]]), "positions": np.array([[0, 1]])})
    with pytest.raises(DataError, match=r"kv_cache_update .*position 9 .*outside the cache of 8 slots"):
        run.run({"tokens": np.array([[1, 2]]), "positions": np.array([[0, 9]])})
    with pytest.raises(DataError, match=r"repeat slot 1"):
        run.run({"tokens": np.array([[1, 2]]), "positions": np.array([[1, 1]])})
    with pytest.raises(EvaluationError, match=r"missing inputs \['positions'\]"):
        run.run({"tokens": np.array([[1, 2]])})


def test_a_rank_graph_is_refused() -> None:
    graphs = ml.spmd(lambda g: g.output("y", ml.all_reduce(g.input("x", (2,), "float32"))), 2)
    with pytest.raises(EvaluationError, match=r"rank 0 of 2.*ml\.evaluate"):
        FastGraph(graphs[0], {})


def test_torch_products_read_any_view_of_a_weight() -> None:
    """_fast.weight_product with a Weight's bfloat16 twin: the weight, its transpose and split-K's
    ranges of K (a view) give torch's products of the same values, within matmul's contract; numpy's
    where the rows are few."""
    torch = pytest.importorskip("torch")
    from megaloop.frontend.ops._fast import TORCH_ROWS, Weight, rounder, weight_product

    rng = np.random.default_rng(0)
    w16 = rng.standard_normal((48, 64)).astype(ml.bfloat16.np)
    weight = Weight(w16.shape, np.float32, w16.astype(np.float32))
    weight.bf16 = torch.from_numpy(w16.view(np.int16)).view(torch.bfloat16)
    x = rng.standard_normal((1, 16, 64)).astype(ml.bfloat16.np).astype(np.float32)
    ranges = np.swapaxes(weight.reshape(48, 2, 32), 0, 1).reshape(2, 1, 48, 32)  # split-K's view
    cases = [(x, weight), (x[:, :TORCH_ROWS - 1], weight), (np.moveaxis(x.reshape(1, 16, 2, 32), 2, 0), ranges)]
    for a, w in cases:
        want = np.matmul(a.astype(np.float64), np.swapaxes(np.asarray(w, np.float64), -1, -2))
        got = weight_product(a, w, rounder(ml.bfloat16))
        scale = np.abs(a).max() * np.abs(np.asarray(w)).max() * a.shape[-1]
        assert got.shape == want.shape and np.abs(got - want).max() <= 2 * ml.bfloat16.eps * scale, (a.shape, w.shape)
    def zeroed(p: np.ndarray) -> np.ndarray:  # (a finish that shows where numpy's product ran)
        return 0 * p

    assert np.abs(weight_product(x, weight, zeroed)).min() > 0  # (torch's: rounded to bf16 already)
    assert not weight_product(x[:, :TORCH_ROWS - 1], weight, zeroed).any()


def test_bfloat16_rounding_is_ml_dtypes_on_both_sides_of_the_small_path() -> None:
    """rounder(bfloat16) (ml_dtypes' round trip below SMALL_ROUNDING values, integer arithmetic above)
    against ml_dtypes itself, bit for bit: ties, overflow to inf, NaN, inf, signed zeros, subnormals."""
    from megaloop.frontend.ops._fast import SMALL_ROUNDING, rounder

    rng = np.random.default_rng(3)
    special = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 3.4e38, -3.39e38, 1e-40, 1.00390625, 1.01171875],
                       np.float32)  # fmt: skip
    for size in (SMALL_ROUNDING - 1, SMALL_ROUNDING, 4 * SMALL_ROUNDING):
        bits = rng.integers(0, 2**32, size, dtype=np.uint64).astype(np.uint32)
        a = np.concatenate([special, bits.view(np.float32)])[:size]
        with np.errstate(all="ignore"):  # (NaN casts: the fast path runs so)
            got = rounder(ml.bfloat16)(a)
            want = a.astype(ml.bfloat16.np).astype(np.float32)
        assert got.dtype == np.float32
        same_bits(got, want, f"{size} values")


def test_the_fast_path_pads_glibcs_heap() -> None:
    """FastGraph sets glibc's M_TOP_PAD once for the process (the arrays freed between ops are reused,
    not faulted in again): True on glibc, False elsewhere, the same on every call."""
    import platform

    from megaloop.reference.fast import pad_the_heap

    g = ml.Graph("small")
    g.output("y", ml.add(g.input("x", (4,), ml.float32), 1.0))
    FastGraph(g, {})
    glibc = sys.platform == "linux" and platform.libc_ver()[0] == "glibc"
    assert pad_the_heap() == glibc and pad_the_heap() == glibc


def test_a_long_causal_prompt_attends_by_blocks_as_the_reference() -> None:
    """attention's fast path over several QUERY_BLOCKs of a causal prompt (GQA, a KV prefix): within
    twice the op's contract of ml.evaluate, and a NaN key hides from the queries before it (the blocks
    that end before it never multiply it, the one that holds it masks it)."""
    from megaloop.frontend.ops.attention import QUERY_BLOCK

    tq, prefix = 3 * QUERY_BLOCK + 5, 7
    g = ml.Graph("long")
    q = g.input("q", (1, 4, tq, 16), ml.float32)
    k, v = (g.input(n, (1, 2, prefix + tq, 16), ml.float32) for n in "kv")
    g.output("y", ml.attention(q, k, v, causal=True))
    rng = np.random.default_rng(5)
    feeds = {n: rng.standard_normal(t.shape).astype(np.float32) for n, t in g.inputs.items()}
    nan_at = prefix + 2 * QUERY_BLOCK + 1
    feeds["k"][0, 1, nan_at] = np.nan
    got, want = evaluate_fast(g, feeds)[0]["y"], ml.evaluate(g, feeds).outputs["y"]
    seen = np.arange(tq) + prefix < nan_at  # (queries before the NaN key)
    assert np.isfinite(got[:, :, seen]).all() and np.isnan(got[:, 2:, ~seen]).all()
    acc = REGISTRY["attention"].accuracy
    doubled = type(acc)(ulps=2 * acc.ulps, per_reduction=acc.per_reduction)
    assert_close(got[:, :, seen], to_f64(want[:, :, seen]), ml.float32, doubled, prefix + tq + 16, "long causal")


def test_a_bfloat16_weight_is_read_once_into_its_float32_form() -> None:
    """coerce(copy=False) hands a weight of the tensor's dtype on as it is (ComputeWeights converts it
    to float32 itself); the default still copies; the float32 form holds the weight's exact values."""
    from megaloop.frontend.values import coerce

    g = ml.Graph("w")
    w = g.parameter("w", (64, 32), "bfloat16")
    stored = np.random.default_rng(0).standard_normal((64, 32)).astype(ml.bfloat16.np)
    assert coerce(stored, w, "w", copy=False) is stored
    copied = coerce(stored, w, "w")
    assert copied is not stored and not np.may_share_memory(copied, stored)
    weights = ComputeWeights({"w": stored})
    got = weights.get("w", w)
    assert got.dtype == np.float32 and not np.may_share_memory(got, stored)
    worst = float(np.max(np.abs(got - stored.astype(np.float64))))
    assert worst == 0.0, f"float32 form differs from the bfloat16 weight by {worst}"

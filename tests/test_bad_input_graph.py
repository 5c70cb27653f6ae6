"""Bad input while a graph is built: sources, shapes and integers, every family of op, views, ranks
and collectives, the Llama builders. Each row: the call, the error class, words of the message."""

from __future__ import annotations

import math

import numpy as np
import pytest

import megaloop as ml
from megaloop.errors import (
    AxisError,
    BroadcastError,
    DtypeError,
    GraphBuildError,
    NonFiniteError,
    RankError,
    ShapeError,
)
from tests.bad_input import Case, case, check, graph, params, ranks2, x32, xs


def _llama(**kw):
    from megaloop.models import LlamaConfig

    return LlamaConfig(hidden=64, heads=4, kv_heads=2, intermediate=128, layers=1, vocab=50, max_seq=16, **kw)


def _build(*args, **kw):
    from megaloop.models import build_llama

    return build_llama(*args, **kw)


def _generator(*args, **kw):
    from megaloop.models import build_llama_generator

    return build_llama_generator(*args, **kw)


def _update_float_positions():
    g = graph()
    cache, new = g.state("k", (1, 2, 8, 4), ml.float32), g.input("new", (1, 2, 1, 4), ml.float32)
    ml.kv_cache_update(cache, new, g.input("p", (1, 1), ml.float32))


@case("where-of-python-equality", DtypeError, "megaloop.equal", found=True)
def _where_eq():
    x = x32()
    ml.where(x == x, x, x)


@case("where-of-python-inequality", DtypeError, "megaloop.not_equal")
def _where_ne():
    x = x32()
    ml.where(x != x, x, 0.0)


@case("add-a-python-bool", DtypeError, "megaloop.equal")
def _add_bool():
    x = x32()
    ml.add(x, x == x)


SOURCES = [
    Case("shape-a-set", lambda: graph().input("x", {2, 3}, ml.float32), ShapeError, ("set", "order"), found=True),
    Case("shape-a-frozenset", lambda: graph().parameter("w", frozenset({4}), "f32"), ShapeError, ("order",)),
    Case("shape-a-dict", lambda: graph().input("x", {2: 3}, ml.float32), ShapeError, ("tuple or list",)),
    Case("shape-a-string", lambda: graph().input("x", "23", ml.float32), ShapeError, ("tuple or list",)),
    Case("shape-none", lambda: graph().input("x", None, ml.float32), ShapeError, ("tuple or list",)),
    Case("shape-a-float-dim", lambda: graph().input("x", (2, 1.5), ml.float32), ShapeError, ("every dimension",)),
    Case("shape-a-negative-dim", lambda: graph().input("x", (-3,), ml.float32), ShapeError, ("int >= 0",)),
    Case("shape-a-bool-dim", lambda: graph().input("x", (True, 2), ml.float32), ShapeError, ("every dimension",)),
    Case("shape-nested", lambda: graph().input("x", ((2, 3),), ml.float32), ShapeError, ("every dimension",)),
    Case(
        "shape-2^31-squared",
        lambda: graph().input("x", (2**31, 2**31), ml.float32),
        ShapeError,
        ("2^31 - 1", "int32"),
        found=True,
    ),
    Case("shape-2^31", lambda: graph().state("s", (2**31,), ml.int32), ShapeError, ("2147483647",)),
    Case("shape-2^100", lambda: graph().input("x", (2**100,), ml.float32), ShapeError, ("2^31 - 1",)),
    Case("bytes-over-2^47", lambda: graph().input("x", (2**30, 2**30), ml.float32), ShapeError, ("2^47",)),
    Case("name-empty", lambda: graph().input("", (2,), ml.float32), GraphBuildError, ("name",)),
    Case("name-with-space", lambda: graph().input("a b", (2,), ml.float32), GraphBuildError, ("without spaces",)),
    Case("name-not-a-string", lambda: graph().parameter(7, (2,), ml.float32), GraphBuildError, ("name",)),
    Case("dtype-unknown", lambda: graph().input("x", (2,), "float8"), DtypeError, ("float8",)),
    Case("dtype-a-number", lambda: graph().input("x", (2,), 3), DtypeError, ("dtype",)),
    Case("state-init-wrong-shape", lambda: graph().state("s", (2,), "f32", init=[1, 2, 3]), ShapeError, ("shape",)),
    Case("state-init-inf", lambda: graph().state("s", (2,), "f32", init=[1, math.inf]), NonFiniteError, ("init",)),
    Case("constant-nan", lambda: graph().constant([1.0, math.nan]), NonFiniteError, ("allow_nonfinite",)),
    Case("constant-overflows-f16", lambda: graph().constant([1e6], ml.float16), NonFiniteError, ("overflow",)),
    Case("constant-ragged", lambda: graph().constant([[1, 2], [3]]), ShapeError, ("rectangular",)),
    Case("constant-strings", lambda: graph().constant(["a"]), DtypeError, ("cannot become",)),
    Case("constant-float-as-int", lambda: graph().constant([1.5], "int32"), DtypeError, ("round them",)),
    Case("constant-int-overflow", lambda: graph().constant([2**40], "int32"), DtypeError, ("do not fit",)),
    Case("graph-rank-out-of-world", lambda: ml.Graph("g", rank=2, world_size=2), RankError, ("unknown",)),
    Case("graph-world-zero", lambda: ml.Graph("g", world_size=0), RankError, ("world_size",)),
    Case("graph-rank-a-float", lambda: ml.Graph("g", rank=0.0, world_size=1), RankError, ("rank",)),
    Case("output-not-a-tensor", lambda: graph().output("y", 3), GraphBuildError, ("not a Tensor",)),
    Case("assign-not-a-state", lambda: (lambda x: x.graph.assign(x, x))(x32()), GraphBuildError, ("not a state",)),
]


def _output_twice():
    x = x32()
    x.graph.output("y", x)
    x.graph.output("y", x)


def _assign_wrong_dtype():
    g = graph()
    s = g.state("s", (2,), ml.float32)
    g.assign(s, g.input("v", (2,), ml.float16))


def _scope_bad():
    with graph().scope("a b"):
        pass


SOURCES += [
    Case("output-name-twice", _output_twice, GraphBuildError, ("already used",)),
    Case("assign-wrong-dtype", _assign_wrong_dtype, DtypeError, ("cast",)),
    Case("scope-with-space", _scope_bad, GraphBuildError, ("scope",)),
    Case("input-name-twice", lambda: [graph().input("x", (1,), "f32").graph.input("x", (1,), "f32")], GraphBuildError),
]

OPS = [
    Case("concat-without-a-list", lambda: (lambda x: ml.concat(x, x))(x32()), GraphBuildError, ("list",), found=True),
    Case("concat-a-tensor-only", lambda: ml.concat(x32()), GraphBuildError, ("concat takes a list of tensors",)),
    Case("concat-empty", lambda: ml.concat([]), GraphBuildError, ("at least one",)),
    Case("concat-a-number", lambda: ml.concat(3), GraphBuildError, ("list of tensors",)),
    Case("concat-dtypes", lambda: (lambda x: ml.concat([x, x.astype("f16")]))(x32()), DtypeError, ("float16",)),
    Case("concat-shapes", lambda: (lambda x: ml.concat([x, x.reshape(4, 2)]))(x32()), ShapeError, ("every axis",)),
    Case("concat-bad-axis", lambda: (lambda x: ml.concat([x, x], axis=9))(x32()), AxisError, ("axis 9",)),
    Case("slice-starts-an-int", lambda: ml.slice_(x32(), 1, [2, 2]), GraphBuildError, ("starts", "list"), found=True),
    Case("slice-stops-a-string", lambda: ml.slice_(x32(), [0, 0], "ab"), GraphBuildError, ("stops", "list")),
    Case("slice-steps-floats", lambda: ml.slice_(x32(), [0, 0], [1, 1], [0.5, 1]), GraphBuildError, ("steps[0]",)),
    Case("slice-step-zero", lambda: ml.slice_(x32(), [0, 0], [1, 1], [0, 1]), GraphBuildError, ("step",)),
    Case("slice-wrong-count", lambda: ml.slice_(x32(), [0], [1]), ShapeError, ("one entry per axis",)),
    Case("index-a-list", lambda: x32()[[0, 1]], GraphBuildError, ("embedding",)),
    Case("index-a-float", lambda: x32()[0.5], GraphBuildError, ("not supported",)),
    Case("index-too-many", lambda: x32()[0, 0, 0], AxisError, ("only 2 axes",)),
    Case("index-out-of-range", lambda: x32()[5], AxisError, ("out of range",)),
    Case("index-two-ellipses", lambda: x32()[..., ...], GraphBuildError, ("only one ...",)),
    Case("reshape-count", lambda: x32().reshape(3), ShapeError, ("cannot reshape",)),
    Case("reshape-two-minus-ones", lambda: x32().reshape(-1, -1), ShapeError, ("only one",)),
    Case("reshape-a-set", lambda: ml.reshape(x32(), {8}), ShapeError, ("order",)),
    Case("reshape-none", lambda: ml.reshape(x32(), None), ShapeError, ("tuple or list",)),
    Case("reshape-zero", lambda: ml.reshape(x32(), (0, 8)), ShapeError, ("cannot reshape 8 elements into [0,8]",)),
    Case("permute-not-a-permutation", lambda: x32().permute(0, 0), AxisError, ("permutation",)),
    Case("permute-an-int", lambda: ml.permute(x32(), 1), GraphBuildError, ("axes", "list")),
    Case("permute-strings", lambda: ml.permute(x32(), ("a", "b")), GraphBuildError, ("axes[0]",)),
    Case("transpose-axis", lambda: x32().transpose(0, 5), AxisError, ("transpose",)),
    Case("squeeze-not-one", lambda: x32().squeeze(0), ShapeError, ("not 1",)),
    Case("unsqueeze-axis", lambda: x32().unsqueeze(7), AxisError, ("unsqueeze",)),
    Case("broadcast-to-smaller", lambda: ml.broadcast_to(x32(), (4,)), ShapeError, ("cannot broadcast",)),
    Case("broadcast-to-a-set", lambda: ml.broadcast_to(x32(), {2, 4}), ShapeError, ("order",)),
    Case("broadcast-to-none", lambda: ml.broadcast_to(x32(), None), ShapeError, ("tuple or list",)),
    Case("broadcast-to-floats", lambda: ml.broadcast_to(x32(), (2.7, 4)), ShapeError, ("every dimension",)),
    Case("split-unequal", lambda: ml.split(x32(), 3, axis=1), ShapeError, ("equally",)),
    Case("split-sizes-sum", lambda: ml.split(x32(), [1, 2], axis=1), ShapeError, ("add up",)),
    Case("split-zero", lambda: ml.split(x32(), 0), GraphBuildError, ("sections",)),
    Case("split-a-string", lambda: ml.split(x32(), "2"), GraphBuildError, ("sections must be an int",)),
    Case("add-broadcast", lambda: ml.add(*xs((2, 3), (4, 3))), BroadcastError, ("shapes",)),
    Case("add-dtypes", lambda: ml.add(*xs((2, 4), ((2, 4), ml.bfloat16))), DtypeError, ("cast",)),
    Case("add-a-list", lambda: x32() + [1, 2], DtypeError, ("Python int or float",)),
    Case("add-a-string", lambda: ml.add(x32(), "1"), DtypeError, ("Python int or float",)),
    Case("add-two-numbers", lambda: ml.add(1, 2), GraphBuildError, ("megaloop Tensor",)),
    Case("mul-inf", lambda: ml.scale(x32(), math.inf), NonFiniteError, ("inf",)),
    Case("mul-huge", lambda: x32() * 1e39, NonFiniteError, ("float32",)),
    Case("int-plus-half", lambda: x32(dtype=ml.int32) + 0.5, DtypeError, ("not an integer",)),
    Case("floordiv-of-bools", lambda: ml.logical_not(x32(dtype=ml.bool_)) // 2, DtypeError, ("floor_divide",)),
    Case("int-to-negative-power", lambda: x32(dtype=ml.int32) ** -1, GraphBuildError, ("negative power",)),
    Case("bool-of-tensor", lambda: bool(x32() > 0), GraphBuildError, ("truth value",)),
    Case("iterate-a-tensor", lambda: list(x32()), GraphBuildError, ("iterate",)),
    Case("exp-of-ints", lambda: ml.exp(x32(dtype=ml.int32)), DtypeError, ("floating",)),
    Case("logical-not-of-floats", lambda: ml.logical_not(x32()), DtypeError, ("bool",)),
    Case("gelu-approximate", lambda: ml.gelu(x32(), approximate="fast"), GraphBuildError, ("approximate",)),
    Case("cast-float-to-int", lambda: ml.cast(x32(), "int32"), DtypeError, ("not supported",)),
    Case("cast-to-nothing", lambda: ml.cast(x32(), None), DtypeError, ("dtype",)),
    Case("where-cond-floats", lambda: (lambda x: ml.where(x, x, x))(x32()), DtypeError, ("bool",)),
    Case("where-all-numbers", lambda: ml.where(x32() > 0, "a", 1.0), DtypeError, ("Python int or float",)),
    Case("matmul-inner", lambda: ml.matmul(*xs((4, 5), (6, 7))), ShapeError, ("inner dimensions",)),
    Case("matmul-1-d", lambda: ml.matmul(*xs((5,), (5, 2))), ShapeError, ("at least 2",)),
    Case("matmul-an-array", lambda: ml.matmul(x32(), np.ones((4, 2))), GraphBuildError, ("megaloop Tensor",)),
    Case("matmul-transpose-a-string", lambda: ml.matmul(x32(), x32((4, 2)), transpose_a="no"), GraphBuildError),
    Case("linear-bias-shape", lambda: ml.linear(*xs((2, 4), (3, 4), (5,))), ShapeError, ("bias",)),
    Case("sum-axis-twice", lambda: ml.sum(x32(), axis=(0, 0)), AxisError, ("twice",)),
    Case("sum-axis-a-string", lambda: ml.sum(x32(), axis="0"), AxisError, ("axis",)),
    Case("sum-keepdims-a-string", lambda: ml.sum(x32(), 0, keepdims="False"), GraphBuildError, ("keepdims",)),
    Case("mean-axis-3", lambda: ml.mean(x32(), axis=3), AxisError, ("out of range",)),
    Case("argmax-two-axes", lambda: ml.argmax(x32(), axis=(0, 1)), AxisError, ("argmax",)),
    Case("argmax-splits-zero", lambda: ml.argmax(x32(), axis=-1, splits=0), GraphBuildError, ("splits",)),
    Case("softmax-axis", lambda: ml.softmax(x32(), axis=2), AxisError, ("softmax",)),
    Case("softmax-of-ints", lambda: ml.softmax(x32(dtype=ml.int64)), DtypeError, ("softmax",)),
    Case("rmsnorm-weight-dtype", lambda: ml.rmsnorm(*xs(((2, 4), ml.bfloat16), (4,))), DtypeError, ("weight",)),
    Case("rmsnorm-eps-nan", lambda: ml.rmsnorm(x32(), eps=math.nan), NonFiniteError, ("eps",)),
    Case("layernorm-eps-a-string", lambda: ml.layernorm(x32(), eps="small"), DtypeError, ("eps",)),
    Case("rope-rotary-odd", lambda: ml.rope(*xs((2, 3, 8), ((2, 3), ml.int64)), rotary_dim=3), ShapeError, ("even",)),
    Case("rope-positions-float", lambda: ml.rope(*xs((2, 3, 8), (2, 3))), DtypeError, ("positions",)),
    Case("rope-theta-one", lambda: ml.rope(*xs((1, 4), ((1,), ml.int64)), theta=1.0), GraphBuildError, ("theta",)),
    Case(
        "rope-scaling-a-string",
        lambda: ml.rope(*xs((1, 4), ((1,), ml.int64)), scaling="linear"),
        GraphBuildError,
        ("scaling",),
    ),
    Case("embedding-float-ids", lambda: ml.embedding(*xs((10, 4), (3,))), DtypeError, ("ids",)),
    Case("embedding-1-d-table", lambda: ml.embedding(*xs((10,), ((3,), ml.int64))), ShapeError, ("2-D",)),
    Case("attention-3-d", lambda: (lambda q: ml.attention(q, q, q))(x32((2, 3, 4))), ShapeError, ("4-D",)),
    Case(
        "attention-causal-string",
        lambda: (lambda q: ml.attention(q, q, q, causal="no"))(x32((1, 1, 2, 4))),
        GraphBuildError,
    ),
    Case(
        "attention-window-zero", lambda: (lambda q: ml.attention(q, q, q, window=0))(x32((1, 1, 2, 4))), GraphBuildError
    ),
    Case(
        "attention-kv-splits-zero",
        lambda: (lambda q: ml.attention(q, q, q, kv_splits=0))(x32((1, 1, 2, 4))),
        GraphBuildError,
    ),
    Case("kv-update-not-a-state", lambda: (lambda x: ml.kv_cache_update(x, x, x))(x32((1, 1, 2, 2))), GraphBuildError),
    Case("kv-update-float-positions", _update_float_positions, DtypeError, ("positions",)),
    Case("builder-extra-argument", lambda: ml.exp(x32(), 3), GraphBuildError, ("exp",)),
    Case("builder-unknown-keyword", lambda: ml.softmax(x32(), dim=1), GraphBuildError, ("dim",)),
    Case("builder-missing-argument", lambda: ml.matmul(x32()), GraphBuildError, ("b",)),
]

RANKS = [
    Case(
        "all-reduce-group-an-int",
        lambda: ml.all_reduce(x32(g=ranks2()), group=5),
        RankError,
        ("group", "list"),
        found=True,
    ),
    Case(
        "all-reduce-group-floats", lambda: ml.all_reduce(x32(g=ranks2()), group=[0, 1.9]), RankError, ("integer ranks",)
    ),
    Case("all-reduce-group-a-string", lambda: ml.all_reduce(x32(g=ranks2()), group="01"), RankError, ("group",)),
    Case("all-reduce-group-outside", lambda: ml.all_reduce(x32(g=ranks2()), group=(0, 9)), RankError, ("outside",)),
    Case("all-reduce-not-a-member", lambda: ml.all_reduce(x32(g=ranks2()), group=(1,)), RankError, ("not in group",)),
    Case("all-reduce-op", lambda: ml.all_reduce(x32(g=ranks2()), "prod"), GraphBuildError, ("op must be one of",)),
    Case(
        "all-reduce-algorithm",
        lambda: ml.all_reduce(x32(g=ranks2()), algorithm="ring"),
        GraphBuildError,
        ("algorithm",),
    ),
    Case("all-gather-group-none-list", lambda: ml.all_gather(x32(g=ranks2()), group=3), RankError, ("group",)),
    Case("reduce-scatter-indivisible", lambda: ml.reduce_scatter(x32((3,), g=ranks2())), ShapeError, ("divisible",)),
    Case("send-to-itself", lambda: ml.send(x32(g=ranks2()), 0), RankError, ("itself",)),
    Case("send-to-unknown", lambda: ml.send(x32(g=ranks2()), 7), RankError, ("unknown",)),
    Case("send-dst-a-string", lambda: ml.send(x32(g=ranks2()), "1"), GraphBuildError, ("dst",)),
    Case(
        "recv-shape-none",
        lambda: ml.recv(ranks2(), 1, None, ml.float32),
        GraphBuildError,
        ("shape", "tuple or list"),
        found=True,
    ),
    Case("recv-shape-a-set", lambda: ml.recv(ranks2(), 1, {2, 3}, ml.float32), GraphBuildError, ("order",)),
    Case("recv-shape-floats", lambda: ml.recv(ranks2(), 1, (2.9,), "f32"), GraphBuildError, ("every dimension",)),
    Case("recv-not-a-graph", lambda: ml.recv(None, 1, (2,), "f32"), GraphBuildError, ("Graph",)),
    Case("recv-from-unknown", lambda: ml.recv(ranks2(), -1, (2,), "f32"), RankError, ("unknown",)),
    Case("cross-graph-operands", lambda: x32() + x32(), GraphBuildError, ("cannot cross graphs",)),
]


def _spmd_shapes():
    def build(g):
        g.output("y", ml.all_reduce(g.input("x", (4, 2 + g.rank), ml.float32)))

    ml.spmd(build, 2)


def _spmd_cycle():
    def build(g):
        peer = 1 - g.rank
        ml.send(ml.exp(ml.recv(g, peer, (4,), ml.float32)), peer)

    ml.spmd(build, 2)


RANKS += [
    Case("spmd-collective-shapes", _spmd_shapes, ml.errors.CollectiveMismatchError, ("differs",)),
    Case("spmd-cycle", _spmd_cycle, ml.errors.CycleError, ("cycle",)),
    Case("spmd-world-zero", lambda: ml.spmd(lambda g: None, 0), GraphBuildError, ()),
]

MODELS = [
    Case(
        "llama-batch-zero",
        lambda: _build(_llama(), batch=0, tokens=1),
        GraphBuildError,
        ("build_llama: batch",),
        found=True,
    ),
    Case("llama-batch-negative", lambda: _build(_llama(), -2, 1), GraphBuildError, ("batch", ">= 1")),
    Case("llama-batch-a-float", lambda: _build(_llama(), 1.5, 1), GraphBuildError, ("batch", "int")),
    Case("llama-tokens-zero", lambda: _build(_llama(), 1, 0), GraphBuildError, ("build_llama: tokens",)),
    Case("llama-tokens-over-max-seq", lambda: _build(_llama(), 1, 17), GraphBuildError, ("max_seq",)),
    Case("llama-cfg-a-dict", lambda: _build({"hidden": 64}, 1, 1), GraphBuildError, ("LlamaConfig",)),
    Case("llama-generator-batch-zero", lambda: _generator(_llama(), 0), GraphBuildError, ("batch",)),
    Case(
        "llama-config-heads-zero", lambda: _llama().__class__(heads=0), GraphBuildError, ("heads must be an int >= 1",)
    ),
    Case("llama-config-indivisible", lambda: _llama().__class__(hidden=30, heads=4), GraphBuildError, ("divisible",)),
    Case("llama-config-kv-heads", lambda: _llama().__class__(heads=8, kv_heads=3), GraphBuildError, ("multiple",)),
]

CASES = [*SOURCES, *OPS, *RANKS, *MODELS, _where_eq, _where_ne, _add_bool]


@pytest.mark.parametrize("c", params(CASES))
def test_bad_graph_input(c: Case) -> None:
    check(c)

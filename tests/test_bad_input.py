"""Each build-time rule has a test: the error class, and a message that names the op (and the operand,
shapes or ranks involved). Bad input never escapes as a bare IndexError/TypeError from numpy."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

import megaloop as ml
from megaloop import errors


@pytest.fixture
def g() -> ml.Graph:
    return ml.Graph("bad")


def test_incompatible_broadcast(g: ml.Graph) -> None:
    a, b = g.input("a", (2, 3), ml.float32), g.input("b", (4, 3), ml.float32)
    with pytest.raises(errors.BroadcastError, match=r"(?s)^mul: shapes \[2,3\] and \[4,3\].*axis -2.*a has 2.*b has 4"):
        ml.mul(a, b)


def test_matmul_inner_dimension_mismatch(g: ml.Graph) -> None:
    a, b = g.input("a", (4, 5), ml.bfloat16), g.input("b", (6, 7), ml.bfloat16)
    with pytest.raises(errors.ShapeError, match=r"(?s)^matmul: inner dimensions differ.*= 5.*= 6.*a: bf16\[4,5\]"):
        a @ b
    with pytest.raises(errors.ShapeError, match=re.escape("b.shape[-1] (b is transposed) = 7")):
        ml.matmul(a, b, transpose_b=True)
    with pytest.raises(errors.ShapeError, match="matmul: a must have at least 2 dimensions"):
        ml.matmul(g.input("v", (5,), ml.bfloat16), b)


@pytest.mark.parametrize(
    "build, op",
    [
        (lambda x: ml.softmax(x, axis=2), "softmax"),
        (lambda x: ml.sum(x, axis=(0, 0)), "sum"),
        (lambda x: ml.sum(x, axis=-3), "sum"),
        (lambda x: ml.argmax(x, axis=(0, 1)), "argmax"),
        (lambda x: x.permute(0, 0), "permute"),
        (lambda x: ml.concat([x, x], axis=5), "concat"),
        (lambda x: ml.all_gather(x, axis=2), "all_gather"),
        (lambda x: x.transpose(0, 2), "transpose"),
        (lambda x: x.unsqueeze(4), "unsqueeze"),
        (lambda x: x[0, 0, 0], "indexing"),
        (lambda x: x[5], "index 5"),
        (lambda x: ml.split(x, 2, axis=3), "split"),
    ],
)
def test_bad_axis(g: ml.Graph, build, op: str) -> None:
    x = g.input("x", (2, 3), ml.float32)
    with pytest.raises(errors.AxisError, match=op) as info:
        build(x)
    assert isinstance(info.value, IndexError)  # and still an IndexError for Python users


def test_dtype_mismatch_without_cast(g: ml.Graph) -> None:
    a, b = g.input("a", (2, 3), ml.bfloat16), g.input("b", (2, 3), ml.float32)
    with pytest.raises(errors.DtypeError, match=r"(?s)^add: operand a is bfloat16 but b is float32.*cast"):
        a + b
    with pytest.raises(errors.DtypeError, match="matmul"):
        ml.matmul(a, g.input("c", (3, 2), ml.float16))
    with pytest.raises(errors.DtypeError, match="rmsnorm: weight is float32 but x is bfloat16"):
        ml.rmsnorm(a, g.input("w", (3,), ml.float32))
    with pytest.raises(errors.DtypeError, match="exp takes floating tensors, not int32"):
        ml.exp(g.input("i", (2,), ml.int32))
    with pytest.raises(errors.DtypeError, match="not an integer"):
        g.input("j", (2,), ml.int32) + 0.5
    with pytest.raises(errors.DtypeError, match="cast: casting float32 to int32 is not supported"):
        ml.cast(b, "int32")
    assert ml.cast(a, ml.float32).dtype == ml.float32


def test_unknown_rank() -> None:
    with pytest.raises(errors.RankError, match="rank 4 is unknown in a world of 4"):
        ml.Graph("x", rank=4, world_size=4)
    g = ml.Graph("x", rank=1, world_size=4)
    x = g.input("x", (2,), ml.float32)
    with pytest.raises(errors.RankError, match=r"(?s)^send: dst rank 7 is unknown in a world of 4"):
        ml.send(x, 7)
    with pytest.raises(errors.RankError, match="recv: src rank -1 is unknown"):
        ml.recv(g, -1, (2,), ml.float32)
    with pytest.raises(errors.RankError, match=r"all_reduce: group \[0, 1, 9\] names rank\(s\) \[9\]"):
        ml.all_reduce(x, group=(0, 1, 9))
    with pytest.raises(errors.RankError, match="all_gather: this graph is rank 1, which is not in group"):
        ml.all_gather(x, group=(0, 2))
    with pytest.raises(errors.RankError, match="send: rank 1 cannot send to itself"):
        ml.send(x, 1)


def test_cycle_in_one_graph(g: ml.Graph) -> None:
    x = g.input("x", (3,), ml.float32)
    a = ml.exp(x)
    b = ml.tanh(a)
    g.output("b", b)
    with pytest.raises(errors.CycleError, match=r"cycle: (tanh|exp) .* <- .*(exp|tanh)"):
        g.replace_uses(x, b)  # exp would read tanh(exp(...)): a cycle
    assert a.node.inputs == (x,)  # the graph is left unchanged
    g.replace_uses(a, ml.sigmoid(x))  # a legal rewrite still works
    assert b.node.inputs[0].node.op.name == "sigmoid"
    assert g.validate() is g


def test_cycle_across_ranks() -> None:
    def build(g: ml.Graph) -> None:
        peer = 1 - g.rank
        got = ml.recv(g, peer, (4,), ml.float32)
        ml.send(ml.exp(got), peer)  # each rank sends only after it received: nobody goes first

    with pytest.raises(errors.CycleError, match=r"ranks wait on each other in a cycle: .*rank [01] recv"):
        ml.spmd(build, 2)


def test_non_finite_constants(g: ml.Graph) -> None:
    with pytest.raises(errors.NonFiniteError, match=r"constant 'mask'.*nan at index \(1,\).*allow_nonfinite"):
        g.constant([1.0, math.nan, 2.0], name="mask")
    with pytest.raises(errors.NonFiniteError, match="values overflow float16"):
        g.constant([1e6], ml.float16)
    m = g.constant([0.0, -math.inf], allow_nonfinite=True)
    assert m.dtype == ml.float32
    x = g.input("x", (2,), ml.float32)
    with pytest.raises(errors.NonFiniteError, match="mul: operand b is inf"):
        ml.scale(x, math.inf)
    with pytest.raises(errors.NonFiniteError, match="rmsnorm: eps is nan"):
        ml.rmsnorm(x, eps=math.nan)
    with pytest.raises(errors.NonFiniteError, match="state 's' init"):
        g.state("s", (2,), ml.float32, init=[1.0, math.inf])


def test_collective_shape_mismatch_across_ranks() -> None:
    def build(g: ml.Graph) -> None:
        x = g.input("x", (4, 2 + g.rank), ml.float32)  # rank 1 has a different shape
        g.output("y", ml.all_reduce(x))

    with pytest.raises(
        errors.CollectiveMismatchError,
        match=r"(?s)collective #0 of group \[0, 1\] differs"
        r".*rank 0: all_reduce .*f32\[4,2\].*rank 1: all_reduce .*f32\[4,3\]",
    ):
        ml.spmd(build, 2)


def test_collective_missing_on_one_rank() -> None:
    def build(g: ml.Graph) -> None:
        x = g.input("x", (4,), ml.float32)
        g.output("y", ml.all_reduce(x) if g.rank != 2 else x)

    with pytest.raises(errors.CollectiveMismatchError, match="rank 2 issues 0"):
        ml.spmd(build, 3)


def test_collective_attribute_mismatch() -> None:
    def build(g: ml.Graph) -> None:
        g.output("y", ml.all_reduce(g.input("x", (4,), ml.float32), "max" if g.rank else "sum"))

    with pytest.raises(errors.CollectiveMismatchError, match=r"op.: .max"):
        ml.spmd(build, 2)


def test_send_recv_mismatch() -> None:
    def unmatched(g: ml.Graph) -> None:
        if g.rank == 0:
            ml.send(g.input("x", (4,), ml.float32), 1)

    with pytest.raises(errors.CollectiveMismatchError, match=r"rank 0 sends 1 tensor.*rank 1 receives 0"):
        ml.spmd(unmatched, 2)

    def wrong_shape(g: ml.Graph) -> None:
        if g.rank == 0:
            ml.send(g.input("x", (4,), ml.float32), 1)
        else:
            g.output("y", ml.recv(g, 0, (5,), ml.float32))

    with pytest.raises(
        errors.CollectiveMismatchError, match=r"send .* holds f32\[4\] but the recv .* expects f32\[5\]"
    ):
        ml.spmd(wrong_shape, 2)


def test_rank_graphs_out_of_order() -> None:
    graphs = [ml.Graph("a", rank=1, world_size=2), ml.Graph("b", rank=0, world_size=2)]
    with pytest.raises(errors.RankError, match="rank order"):
        ml.match_ranks(graphs)
    with pytest.raises(errors.RankError, match="world_size is 3 but 2"):
        ml.match_ranks([ml.Graph("a", rank=0, world_size=3), ml.Graph("b", rank=1, world_size=3)])


def test_tensors_cannot_cross_graphs() -> None:
    a, b = ml.Graph("a"), ml.Graph("b")
    x, y = a.input("x", (2,), ml.float32), b.input("y", (2,), ml.float32)
    with pytest.raises(errors.GraphBuildError, match=r"add: operand b .* belongs to graph 'b'"):
        x + y


def test_non_tensor_operand(g: ml.Graph) -> None:
    x = g.input("x", (2,), ml.float32)
    with pytest.raises(errors.GraphBuildError, match="matmul: operand b must be a megaloop Tensor, got ndarray"):
        ml.matmul(x, np.ones((2, 2)))
    with pytest.raises(errors.DtypeError, match="add: operand b must be a Python int or float, got list"):
        x + [1, 2]
    with pytest.raises(errors.GraphBuildError, match="truth value"):
        bool(x > 0)


def test_bad_shapes_and_names(g: ml.Graph) -> None:
    with pytest.raises(errors.ShapeError, match="every dimension must be an int >= 0"):
        g.input("x", (2, -1), ml.float32)
    with pytest.raises(errors.ShapeError, match="every dimension"):
        g.input("x2", (2, 1.5), ml.float32)
    g.input("x", (2,), ml.float32)
    with pytest.raises(errors.GraphBuildError, match="already used"):
        g.input("x", (2,), ml.float32)
    with pytest.raises(errors.DtypeError, match="unknown dtype name 'float8'"):
        g.input("y", (2,), "float8")
    with pytest.raises(errors.ShapeError, match="cannot reshape 2 elements into"):
        g.inputs["x"].reshape(3)
    assert g.inputs["x"][2:].shape == (0,)  # an empty slice is an empty tensor (tests/test_zero_size.py)


def test_op_specific_rules(g: ml.Graph) -> None:
    q = g.input("q", (1, 6, 4, 8), ml.bfloat16)
    k = g.input("k", (1, 4, 4, 8), ml.bfloat16)
    with pytest.raises(errors.ShapeError, match="attention: heads \\(6\\) must be a multiple of kv_heads \\(4\\)"):
        ml.attention(q, k, k)
    x = g.input("x", (2, 3, 8), ml.float32)
    p = g.input("p", (2, 4), ml.int64)
    with pytest.raises(errors.ShapeError, match="rope: positions \\[2,4\\] must broadcast"):
        ml.rope(x, p)
    with pytest.raises(errors.ShapeError, match="rope: rotary_dim 3 must be even"):
        ml.rope(x, g.input("p2", (2, 3), ml.int64), rotary_dim=3)
    with pytest.raises(errors.GraphBuildError, match="kv_cache_update: cache must be a state tensor"):
        ml.kv_cache_update(q, q, g.input("pos", (1, 4), ml.int64))
    cache = g.state("cache", (1, 4, 16, 8), ml.bfloat16)
    pos = g.input("pos2", (1, 4), ml.int64)
    ml.kv_cache_update(cache, k, pos)
    with pytest.raises(errors.GraphBuildError, match="kv_cache_update: state 'cache' already receives"):
        ml.kv_cache_update(cache, k, pos)
    with pytest.raises(errors.ShapeError, match="reduce_scatter: axis 0 has size 3, not divisible by the group size 2"):
        ml.reduce_scatter(ml.Graph("r", rank=0, world_size=2).input("x", (3,), ml.float32))


def test_data_errors_name_the_op() -> None:
    g = ml.Graph("emb")
    table = g.parameter("table", (10, 4), ml.float32)
    g.output("y", ml.embedding(table, g.input("ids", (3,), ml.int64)))
    with pytest.raises(errors.DataError, match=r"embedding .*: id 12 at index \(1,\) is outside the table of 10 rows"):
        ml.evaluate(g, {"ids": [3, 12, 0]}, {"table": np.zeros((10, 4))})


def test_evaluate_checks_its_arguments() -> None:
    g = ml.Graph("ev")
    g.output("y", ml.exp(g.input("x", (2, 3), ml.bfloat16)))
    with pytest.raises(errors.EvaluationError, match=r"missing inputs \['x'\]"):
        ml.evaluate(g, {})
    with pytest.raises(errors.EvaluationError, match=r"unknown inputs \['z'\]"):
        ml.evaluate(g, {"x": np.zeros((2, 3)), "z": 1})
    with pytest.raises(errors.EvaluationError, match=r"input 'x': expected shape \[2,3\], got \[3,2\]"):
        ml.evaluate(g, {"x": np.zeros((3, 2))})
    with pytest.raises(errors.EvaluationError, match="expected bfloat16 values, got a bool array"):
        ml.evaluate(g, {"x": np.zeros((2, 3), bool)})


WEIRD = [None, "x", 3.5, [1, 2], (99,), -9, np.ones(3), float("nan")]


@pytest.mark.parametrize("weird", WEIRD, ids=[repr(w)[:12] for w in WEIRD])
def test_weird_arguments_raise_megaloop_errors(weird: object) -> None:
    """Whatever junk goes into a builder, the error is a MegaloopError (or the call succeeds)."""
    g = ml.Graph("weird")
    x = g.input("x", (2, 4), ml.float32)
    calls = [
        lambda: ml.sum(x, weird),
        lambda: ml.softmax(x, weird),
        lambda: ml.reshape(x, weird),
        lambda: x.permute(weird),
        lambda: ml.add(x, weird),
        lambda: ml.matmul(x, weird),
        lambda: ml.rmsnorm(x, weird),
        lambda: ml.rope(x, weird),
        lambda: ml.split(x, weird),
        lambda: ml.concat(weird),
        lambda: x[weird],
        lambda: ml.cast(x, weird),
        lambda: ml.all_gather(x, weird),
        lambda: ml.gelu(x, weird),
        lambda: ml.argmax(x, weird),
        lambda: ml.broadcast_to(x, weird),
        lambda: ml.attention(x, x, x, window=weird),
        lambda: ml.where(weird, x, x),
        lambda: ml.scale(x, weird),
        lambda: ml.layernorm(x, eps=weird),
        lambda: g.input(weird, (2,), ml.float32),
        lambda: g.constant(weird),
        lambda: ml.transpose(x, weird),
        lambda: x.squeeze(weird),
    ]
    for i, call in enumerate(calls):
        try:
            call()
        except ml.MegaloopError:
            pass
        except Exception as e:
            raise AssertionError(f"call #{i} with {weird!r} raised {type(e).__name__}: {e}") from e


def test_rope_into_the_cache_refuses_bad_input_in_its_own_name() -> None:
    """rope_kv_cache_update takes rope's attributes and kv_cache_update's operands: its errors name it."""
    g = ml.Graph("rope-cache")
    cache = g.state("k", (1, 2, 8, 4), ml.bfloat16)
    new = g.input("new", (1, 2, 1, 4), ml.bfloat16)
    pos = g.input("pos", (1, 1), ml.int64)
    with pytest.raises(errors.GraphBuildError, match=r"^rope_kv_cache_update: theta must be > 1"):
        ml.rope_kv_cache_update(cache, new, pos, theta=1.0)
    with pytest.raises(errors.GraphBuildError, match=r"^rope_kv_cache_update: llama3 scaling needs"):
        ml.rope_kv_cache_update(cache, new, pos, scaling={"type": "llama3", "factor": 8.0})
    with pytest.raises(errors.GraphBuildError, match=r"rope_kv_cache_update.*rotary_dim 3 must be even"):
        ml.rope_kv_cache_update(cache, new, pos, rotary_dim=3)
    with pytest.raises(errors.GraphBuildError, match=r"rope_kv_cache_update.*cache must be a state"):
        ml.rope_kv_cache_update(g.input("c", (1, 2, 8, 4), ml.bfloat16), new, pos)
    ml.rope_kv_cache_update(cache, new, pos)
    with pytest.raises(errors.GraphBuildError, match="already receives"):  # one new value a state an iteration
        ml.kv_cache_update(cache, new, pos)

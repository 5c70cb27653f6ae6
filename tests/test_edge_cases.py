"""Corner cases found in review: each once let bad input through, crashed with a non-megaloop
exception, or left a graph half-changed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import megaloop as ml
from megaloop import errors


def test_replace_uses_with_split_and_rollback() -> None:
    g = ml.Graph("rw")
    a, b = g.input("a", (4, 2), ml.float32), g.input("b", (4, 2), ml.float32)
    z = g.input("z", (4,), ml.float32)
    s0, _ = ml.split(z, 2)
    g.output("s0", s0)
    y = ml.exp(a)
    r = a.reshape(8)
    g.output("y", y)
    g.output("r", r)
    g.replace_uses(a, b)  # a split elsewhere in the graph must not get in the way
    assert y.node.inputs == (b,) and r.base is b
    before = [(n.id, n.inputs) for n in g.nodes]
    with pytest.raises(errors.ShapeError, match="cannot be reshaped without a copy"):
        g.replace_uses(b, g.input("c", (2, 4), ml.float32).T)  # the reshape view would need a copy
    assert [(n.id, n.inputs) for n in g.nodes[: len(before)]] == before and r.base is b
    out = ml.evaluate(
        g, {"a": np.ones((4, 2)), "b": np.arange(8).reshape(4, 2), "z": np.arange(4), "c": np.ones((2, 4))}
    )
    np.testing.assert_array_equal(out.outputs["r"], np.arange(8))


def test_constants_check_bfloat16_and_torch_and_ragged() -> None:
    g = ml.Graph("c")
    with pytest.raises(errors.DtypeError, match="float values cannot be stored as int32"):
        g.constant(np.array([1.7, -2.6], dtype=ml.bfloat16.np), "int32")
    with pytest.raises(errors.NonFiniteError, match="non-finite"):
        g.constant(np.array([np.nan], dtype=ml.bfloat16.np))
    t = g.constant(torch.tensor([1.5, 2.0], dtype=torch.bfloat16))
    assert t.dtype == ml.bfloat16
    with pytest.raises(errors.ShapeError, match="not a rectangular array"):
        g.constant([[1, 2], [3]])
    with pytest.raises(errors.NonFiniteError, match="state 's' init") as info:
        g.state("s", (2,), "f32", init=[1.0, np.inf])
    assert "allow_nonfinite" not in str(info.value)
    with pytest.raises(errors.ShapeError):
        g.state("s", (2,), "f32", init=[1, 2, 3])
    g.state("s", (2,), "f32")  # the failed calls left no state named "s" behind


def test_scalar_comparisons_round_to_the_tensor_dtype() -> None:
    g = ml.Graph("cmp")
    x = g.input("x", (3,), ml.bfloat16)
    g.output("eq", ml.equal(x, 0.1))
    g.output("le", x <= 0.1)
    out = ml.evaluate(g, {"x": [0.1, 0.2, 0.05]}).outputs
    xt = torch.tensor([0.1, 0.2, 0.05], dtype=torch.bfloat16)
    np.testing.assert_array_equal(out["eq"], (xt == 0.1).numpy())
    np.testing.assert_array_equal(out["le"], (xt <= 0.1).numpy())


def test_scalars_must_fit_float32() -> None:
    x = ml.Graph("s").input("x", (3,), ml.bfloat16)
    for big in (10**400, 1e39):
        with pytest.raises(errors.NonFiniteError, match="does not fit in float32"):
            x * big


def test_python_operators_are_numpys() -> None:
    x = ml.Graph("ops").input("x", (3,), ml.float32)
    assert (x // 2).node.op.name == "floor_divide" and (7 % x).node.op.name == "remainder"
    y = np.float32(2.0) * x  # numpy hands over to Tensor.__rmul__
    assert isinstance(y, ml.Tensor) and y.node.op.name == "mul"


def test_failed_calls_leave_no_nodes() -> None:
    g = ml.Graph("kv")
    c = g.state("c", (1, 1, 4, 2), ml.float32)
    n, p = g.input("n", (1, 1, 1, 2), ml.float32), g.input("p", (1, 1), ml.int64)
    ml.kv_cache_update(c, n, p)
    count = len(g.nodes)
    with pytest.raises(errors.GraphBuildError, match="already receives"):
        ml.kv_cache_update(c, n, p)
    assert len(g.nodes) == count


def test_integer_arguments_are_not_truncated() -> None:
    g = ml.Graph("ints", rank=0, world_size=2)
    x = g.input("x", (1, 5), ml.float32)
    with pytest.raises(errors.GraphBuildError, match="must be an int"):
        ml.broadcast_to(x, (2.7, 5))
    with pytest.raises(errors.GraphBuildError, match="must be an int"):
        ml.recv(g, 1, (2.9,), "f32")
    with pytest.raises(errors.RankError, match="integer ranks"):
        ml.all_reduce(x, group=[0, 1.9])
    with pytest.raises(errors.GraphBuildError, match="keepdims must be True or False"):
        ml.sum(x, 0, keepdims="False")
    with pytest.raises(errors.AxisError, match="name the same axis twice"):
        g.input("y", (1, 1), ml.float32).squeeze((0, 0))
    assert x.squeeze(np.int64(0)).shape == (5,)
    with pytest.raises(errors.AxisError, match="concat"):
        ml.concat([x], axis=99)


def test_op_specific_argument_rules() -> None:
    g = ml.Graph("args")
    x = g.input("x", (4, 8), ml.float32)
    w = g.input("w", (16, 8), ml.float32)
    with pytest.raises(errors.ShapeError, match=r"linear: bias must have shape \[16\]"):
        ml.linear(x, w, g.input("b", (3, 1, 16), ml.float32))
    xr, pos = g.input("xr", (1, 2, 3, 8), ml.float32), g.input("pos", (1, 1, 3), ml.int64)
    for bad in (
        {"type": "linear", "factor": 0},
        {
            "type": "llama3",
            "factor": 8,
            "low_freq_factor": 4,
            "high_freq_factor": 4,
            "original_max_position_embeddings": 8192,
        },
    ):
        with pytest.raises(errors.GraphBuildError, match="rope: "):
            ml.rope(xr, pos, scaling=bad)
    q = g.input("q", (1, 2, 3, 8), ml.float32)
    qp = g.input("qp", (1, 3), ml.int64)
    with pytest.raises(errors.GraphBuildError, match="q_positions only matter for a causal mask"):
        ml.attention(q, q, q, q_positions=qp)
    with pytest.raises(errors.GraphBuildError, match="causal must be True or False"):
        ml.attention(q, q, q, causal="false")
    with pytest.raises(errors.DtypeError, match="q_positions"):
        ml.attention(q, q, q, causal=True, q_positions=g.input("qf", (1, 3), ml.float32))
    with pytest.raises(errors.GraphBuildError, match="approximate must be"):
        ml.gelu(x, approximate="fast")


def test_old_cache_readers_are_ordered_before_the_in_place_update() -> None:
    g = ml.Graph("inplace")
    c = g.state("c", (1, 1, 4, 2), ml.float32)
    n, p = g.input("n", (1, 1, 1, 2), ml.float32), g.input("p", (1, 1), ml.int64)
    u = ml.kv_cache_update(c, n, p)
    g.output("new", u.sum())
    g.output("old", c.sum())  # built after the update, but must read the old value
    order = [node.name for _, node in ml.match_ranks([g]).order]
    assert order.index("sum_5") < order.index("kv_cache_update_3")
    bad = ml.Graph("bad")
    c = bad.state("c", (1, 1, 4, 2), ml.float32)
    u = ml.kv_cache_update(c, bad.input("n", (1, 1, 1, 2), ml.float32), bad.input("p", (1, 1), ml.int64))
    bad.output("mix", c + u)  # needs the old and the new value at once
    with pytest.raises(errors.CycleError, match="reads the old value of 'c'"):
        ml.evaluate(bad, {"n": np.zeros((1, 1, 1, 2)), "p": [[0]]})


def test_config_and_evaluate_arguments() -> None:
    from megaloop.models import LlamaConfig

    with pytest.raises(errors.GraphBuildError, match="heads must be an int >= 1"):
        LlamaConfig(heads=0)
    g = ml.Graph("e")
    g.output("y", g.input("x", (2,), ml.float32) * 2.0)
    with pytest.raises(errors.EvaluationError, match="expected a Graph"):
        ml.evaluate("abc")
    with pytest.raises(errors.EvaluationError, match="expected a mapping"):
        ml.evaluate(g, 5)
    with pytest.raises(errors.EvaluationError, match="not an array"):
        ml.evaluate(g, {"x": [[1, 2], [3]]})


def test_clip_and_hard_activations_follow_torch_at_the_edges() -> None:
    """clip with min > max gives max everywhere, one bound alone, NaN kept; hardswish / hardsigmoid keep
    NaN and are exact at their kinks; bounds of the wrong kind are refused naming the op."""
    g = ml.Graph("edges")
    x = g.input("x", (6,), "float32")
    g.output("swapped", ml.clip(x, 1.0, -1.0))
    g.output("low", ml.clip(x, min=0))
    g.output("high", ml.clip(x, max=0.5))
    g.output("swish", ml.hardswish(x))
    g.output("hsig", ml.hardsigmoid(x))
    xs = np.array([np.nan, -4.0, -3.0, 0.25, 3.0, 7.0], np.float32)
    got = ml.evaluate(g, {"x": xs}).outputs
    t = torch.tensor(xs)
    want = {
        "swapped": torch.clamp(t, 1.0, -1.0),
        "low": torch.clamp(t, min=0),
        "high": torch.clamp(t, max=0.5),
        "swish": torch.nn.functional.hardswish(t),
        "hsig": torch.nn.functional.hardsigmoid(t),
    }
    for name, w in want.items():
        np.testing.assert_array_equal(got[name], w.numpy(), err_msg=name)
    i = g.input("i", (3,), "int32")
    with pytest.raises(errors.DtypeError, match=r"clip.*min must be an int for int32 x, got 0.5"):
        ml.clip(i, 0.5)
    with pytest.raises(errors.GraphBuildError, match=r"clip.*give min, max or both"):
        ml.clip(x)
    with pytest.raises(errors.DtypeError, match=r"clip.*max 3000000000 does not fit in int32"):
        ml.clip(i, max=3_000_000_000)

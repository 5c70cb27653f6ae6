"""The graph builder: sources, state across iterations, views and their layouts, summaries, editing,
and how evaluate treats the arrays it is given."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import megaloop as ml
from megaloop import errors


def test_sources_and_summary() -> None:
    g = ml.Graph("demo")
    x = g.input("x", (2, 4), ml.bfloat16)
    w = g.parameter("layer.w", (4, 3), ml.bfloat16)
    c = g.constant(np.full((3,), 0.5), ml.bfloat16, name="half")
    with g.scope("block"):
        y = ml.relu(x @ w) + c
    g.output("y", y)
    assert y.name.startswith("block.add_") and w.name == "layer.w"
    text = g.summary()
    assert "Graph 'demo' (rank 0 of 1): 6 nodes, 1 inputs, 1 parameters (24.0 B)" in text
    assert "matmul" in text and "block.relu" in text and "output y = %5" in text
    assert repr(x) == "Tensor(%0 'x' bf16[2,4])"
    assert str(ml.bfloat16) == "bf16" and repr(ml.bfloat16) == "megaloop.bfloat16"
    xs = np.random.default_rng(0).standard_normal((2, 4))
    ws = np.random.default_rng(1).standard_normal((4, 3))
    got = ml.evaluate(g, {"x": xs}, {"layer.w": ws}).outputs["y"]
    xb, wb = (ml.dtypes.round_to(a, ml.bfloat16).astype(np.float64) for a in (xs, ws))
    relu = ml.dtypes.round_to(np.maximum(ml.dtypes.round_to(xb @ wb, ml.bfloat16).astype(np.float64), 0), ml.bfloat16)
    expected = ml.dtypes.round_to(relu.astype(np.float64) + 0.5, ml.bfloat16)
    np.testing.assert_array_equal(got, expected)


def test_state_carries_between_iterations() -> None:
    g = ml.Graph("counter")
    step = g.state("step", (), ml.int64)
    acc = g.state("acc", (3,), ml.float32, init=[1.0, 2.0, 3.0])
    inc = g.input("inc", (3,), ml.float32)
    g.assign(step, step + 1)
    g.assign(acc, acc + inc)
    g.output("seen", step)
    r = ml.evaluate(g, {"inc": [0.5, 0.5, 1.0]}, iterations=4)
    assert int(r.outputs["seen"]) == 3  # outputs are the last iteration's: it saw step 3
    assert int(r.state["step"]) == 4
    np.testing.assert_array_equal(r.state["acc"], [3.0, 4.0, 7.0])
    r2 = ml.evaluate(g, {"inc": [1.0, 1.0, 1.0]}, state=r.state)  # resume from a state
    np.testing.assert_array_equal(r2.state["acc"], [4.0, 5.0, 8.0])
    with pytest.raises(errors.ShapeError, match="assign to state 'acc'"):
        g.assign(acc, g.input("bad", (4,), ml.float32))


def test_decode_loop_with_state_feedback() -> None:
    """The loop-kernel use case: the argmax of one iteration is the next iteration's token."""
    g = ml.Graph("loop")
    tok = g.state("token", (1,), ml.int64, init=[2])
    table = g.parameter("next", (5, 5), ml.float32)  # row i peaks at column (i + 1) % 5
    logits = ml.embedding(table, tok)
    g.assign(tok, ml.argmax(logits, axis=-1))
    g.output("logits", logits)
    nxt = np.eye(5)[[1, 2, 3, 4, 0]]
    r = ml.evaluate(g, {}, {"next": nxt}, iterations=7)
    assert int(r.state["token"][0]) == (2 + 7) % 5


def test_view_layouts() -> None:
    g = ml.Graph("views")
    x = g.input("x", (4, 6), ml.float32)
    t = x.T
    assert t.is_view and t.base is x and t.strides == (1, 6) and t.offset == 0 and not t.is_contiguous
    s = x[1:, ::2]
    assert s.strides == (6, 2) and s.offset == 6 and s.shape == (3, 3)
    r = x.reshape(2, 12)
    assert r.is_view and r.strides == (12, 1) and r.is_contiguous
    flat = t.reshape(-1)  # a transposed matrix cannot be flattened in place: a copy goes first
    assert flat.base is not x and flat.base.node.op.name == "copy"
    rows = x[2]
    assert rows.offset == 12 and rows.is_contiguous
    b = ml.broadcast_to(x[:, :1], (3, 4, 5))
    assert b.strides == (0, 6, 0)
    parts = ml.split(x, [1, 5], axis=1)
    assert [p.offset for p in parts] == [0, 1] and parts[1].shape == (4, 5)
    rev = x[::-1]
    assert rev.strides == (-6, 1) and rev.offset == 18


def test_replace_uses_rewires_and_keeps_views_consistent() -> None:
    g = ml.Graph("edit")
    x = g.input("x", (3, 4), ml.float32)
    a = ml.exp(x)
    v = a.T[1:]
    g.output("v", v)
    y = g.input("y", (3, 4), ml.float32)
    flipped = y[::-1]
    g.replace_uses(a, flipped)  # now v is a view of y, reversed
    assert v.base is y and v.offset == 8 + 1 and v.strides == (1, -4)
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    out = ml.evaluate(g, {"x": arr, "y": arr}).outputs["v"]
    np.testing.assert_array_equal(out, arr[::-1].T[1:])


def test_inputs_from_torch_and_rounding() -> None:
    g = ml.Graph("torch")
    x = g.input("x", (3,), ml.bfloat16)
    i = g.input("i", (3,), ml.int32)
    g.output("y", x * 2.0)
    g.output("j", i + 1)
    t = torch.tensor([1.0, 2.5, 1.0078125], dtype=torch.bfloat16)
    r = ml.evaluate(g, {"x": t, "i": torch.tensor([1, 2, 3])})
    np.testing.assert_array_equal(r.outputs["y"].astype(np.float32), [2.0, 5.0, 2.015625])
    assert r.outputs["j"].dtype == np.int32
    r = ml.evaluate(g, {"x": np.array([1.00390625, 1 / 3, -7.0]), "i": [0, 0, 0]})  # float64 rounds to bf16
    assert r.outputs["y"].dtype == ml.bfloat16.np
    with pytest.raises(errors.EvaluationError, match="do not fit in int32"):
        ml.evaluate(g, {"x": t, "i": np.array([2**40, 0, 0])})


def test_outputs_are_copies_and_inputs_untouched() -> None:
    g = ml.Graph("copies")
    x = g.input("x", (4,), ml.float32)
    g.output("x_again", x)
    g.output("view", x[1:])
    arr = np.arange(4, dtype=np.float32)
    r = ml.evaluate(g, {"x": arr})
    r.outputs["x_again"][:] = -1
    np.testing.assert_array_equal(arr, [0, 1, 2, 3])
    np.testing.assert_array_equal(r.outputs["view"], [1, 2, 3])


def test_evaluation_is_deterministic_and_keeps_values() -> None:
    from megaloop.models import LlamaConfig, build_llama, random_parameters

    cfg = LlamaConfig(hidden=64, heads=4, kv_heads=2, intermediate=96, layers=1, max_seq=16, vocab=50)
    g = build_llama(cfg, 2, 5)
    feeds = {"tokens": np.arange(10).reshape(2, 5), "positions": np.tile(np.arange(5), (2, 1))}
    params = random_parameters(cfg, 3)
    a = ml.evaluate(g, feeds, params, keep_values=True)
    b = ml.evaluate(g, feeds, params)
    assert a.outputs["logits"].tobytes() == b.outputs["logits"].tobytes()
    assert len(a.values) == sum(len(n.outputs) for n in g.nodes) and not b.values


def test_dtype_names() -> None:
    assert ml.as_dtype("bf16") is ml.bfloat16
    assert ml.as_dtype(torch.float16) is ml.float16
    assert ml.as_dtype(np.int32) is ml.int32
    assert ml.as_dtype("torch.bool") is ml.bool_
    assert ml.bfloat16.eps == 2.0**-7 and ml.float16.eps == 2.0**-10
    with pytest.raises(errors.DtypeError, match="no machine epsilon"):
        _ = ml.int32.eps
    with pytest.raises(errors.DtypeError, match="megaloop has no dtype"):
        ml.as_dtype(np.complex64)

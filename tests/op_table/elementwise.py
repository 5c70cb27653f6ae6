"""Elementwise rows: arithmetic with broadcasts, integer semantics, unary functions, casts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import megaloop as ml
from tests.op_table._base import FLOATS, INTS, TD, Sample, many, one, rand_shape, rnd, row

for name, tfn, kinds in [
    ("add", torch.add, FLOATS + INTS),
    ("sub", torch.sub, FLOATS + INTS),
    ("mul", torch.mul, FLOATS + INTS),
    ("div", torch.div, FLOATS),
    ("maximum", torch.maximum, FLOATS + INTS),
    ("minimum", torch.minimum, FLOATS + INTS),
]:
    row(
        name,
        "broadcast",
        lambda g, a, b, _n=name: getattr(ml, _n)(a, b),
        lambda a, b, _f=tfn, **k: _f(a, b),
        many(2),
        kinds,
        domains=("ties", "ties")
        if name in ("maximum", "minimum")
        else ("normal", "positive" if name == "div" else "normal"),
    )

row(
    "silu_mul",
    "broadcast",
    lambda g, a, b: ml.silu_mul(a, b),
    lambda a, b, **k: F.silu(a) * b,
    many(2),
    FLOATS,
    domains=("normal", "normal"),
)
row("pow", "broadcast", lambda g, a, b: a**b, lambda a, b, **k: torch.pow(a, b), many(2), domains=("positive", "unit"))
row("pow", "scalar-exponent", lambda g, a: a**2.0, lambda a, **k: a**2.0, one())
# numpy's integer power, floor_divide and remainder (negative operands, zero divisors: 0 as numpy gives)
row("pow", "int", lambda g, a, b: a**b, lambda a, b, **k: torch.pow(a, b), many(2), INTS,
    domains=(("int", -9, 10), ("int", 0, 6)))  # fmt: skip
row("pow", "int-scalar-exponent", lambda g, a: a**3, lambda a, **k: a**3, one(), INTS)


def _numpy_division(fn: Callable[..., Any]) -> Callable[..., Any]:
    """torch's floor_divide or remainder with numpy's integer zero divisor (0; torch raises)."""

    def ref(a, b, **k):
        if a.dtype.is_floating_point:
            return fn(a, b)
        return torch.where(b == 0, 0, fn(a, torch.where(b == 0, 1, b)))

    return ref


for _name, _fn in (("floor_divide", torch.floor_divide), ("remainder", torch.remainder)):
    _build = getattr(ml, _name)
    row(_name, "broadcast", lambda g, a, b, _b=_build: _b(a, b), _numpy_division(_fn), many(2), FLOATS + INTS,
        domains=(("int", -20, 21), ("int", -4, 5)))  # fmt: skip
    row(_name, "float", lambda g, a, b, _b=_build: _b(a, b), _numpy_division(_fn), many(2), FLOATS,
        domains=("ties", ("choice", -2.5, -0.5, 0.25, 1.5, 4.0)))  # fmt: skip
    row(_name, "scalar", lambda g, a, _b=_build: _b(a, -3), lambda a, _f=_fn, **k: _f(a, -3), one(), FLOATS + INTS,
        domains=(("int", -20, 21),))  # fmt: skip
row("add", "scalar", lambda g, a: a + 0.3, lambda a, **k: a + 0.3, one())
row("add", "int-scalar", lambda g, a: 7 + a, lambda a, **k: 7 + a, one(), INTS)
row("sub", "scalar-left", lambda g, a: 2.0 - a, lambda a, **k: 2.0 - a, one())
row("mul", "scale", lambda g, a: ml.scale(a, 0.125), lambda a, **k: a * 0.125, one())
row("div", "scalar", lambda g, a: a / 3.0, lambda a, **k: a / 3.0, one())
row("div", "scalar-left", lambda g, a: 1.0 / a, lambda a, **k: 1.0 / a, one(), domains=("positive",))
row("maximum", "scalar", lambda g, a: ml.maximum(a, 0.0), lambda a, **k: torch.clamp_min(a, 0.0), one())

for name, tfn in [
    ("equal", torch.eq),
    ("not_equal", torch.ne),
    ("less", torch.lt),
    ("less_equal", torch.le),
    ("greater", torch.gt),
    ("greater_equal", torch.ge),
]:
    row(
        name,
        "broadcast",
        lambda g, a, b, _n=name: getattr(ml, _n)(a, b),
        lambda a, b, _f=tfn, **k: _f(a, b),
        many(2),
        FLOATS + INTS + (("bool",) if name in ("equal", "not_equal") else ()),
        domains=("ties", "ties"),
    )
row("less", "scalar", lambda g, a: a < 0.5, lambda a, **k: a < 0.5, one(), domains=("ties",))
row("equal", "bool", lambda g, a, b: ml.equal(a, b), lambda a, b, **k: a == b, many(2), ("bool",))
row("logical_and", "broadcast", lambda g, a, b: a & b, lambda a, b, **k: a & b, many(2), ("bool",))
row("logical_or", "broadcast", lambda g, a, b: a | b, lambda a, b, **k: a | b, many(2), ("bool",))
row("logical_not", "plain", lambda g, a: ~a, lambda a, **k: ~a, one(), ("bool",))
row(
    "where",
    "broadcast",
    lambda g, c, a, b: ml.where(c, a, b),
    lambda c, a, b, **k: torch.where(c, a, b),
    many(3),
    FLOATS + INTS + ("bool",),
    domains=("bool", "normal", "normal"),
    fixed={0: "bool"},
)
row(
    "where",
    "scalar",
    lambda g, c, a: ml.where(c, a, 0.0),
    lambda c, a, **k: torch.where(c, a, 0.0),
    many(2),
    domains=("bool", "normal"),
    fixed={0: "bool"},
)

for name, tfn, domain, kinds in [
    ("neg", torch.neg, "normal", FLOATS + INTS),
    ("abs", torch.abs, "normal", FLOATS + INTS),
    ("exp", torch.exp, "normal", FLOATS),
    ("log", torch.log, "positive", FLOATS),
    ("sqrt", torch.sqrt, "positive", FLOATS),
    ("rsqrt", torch.rsqrt, "positive", FLOATS),
    ("reciprocal", torch.reciprocal, "normal", FLOATS),
    ("tanh", torch.tanh, "normal", FLOATS),
    ("sigmoid", torch.sigmoid, "normal", FLOATS),
    ("relu", torch.relu, "normal", FLOATS + INTS),
    ("silu", F.silu, "normal", FLOATS),
    ("erf", torch.erf, "normal", FLOATS),
]:
    row(
        name,
        "plain",
        lambda g, a, _n=name: getattr(ml, _n)(a),
        lambda a, _f=tfn, **k: _f(a),
        one(),
        kinds,
        domains=(domain,),
    )
row("gelu", "erf", lambda g, a: ml.gelu(a), lambda a, **k: F.gelu(a), one())
row("gelu", "tanh", lambda g, a: ml.gelu(a, approximate="tanh"), lambda a, **k: F.gelu(a, approximate="tanh"), one())
row("sigmoid", "large", lambda g, a: ml.sigmoid(a * 40.0), lambda a, dtype: torch.sigmoid(rnd(a * 40.0, dtype)), one())
KINKS = ("choice", -5.0, -3.0, -2.75, -1.5, -0.25, 0.0, 0.5, 1.25, 2.75, 3.0, 4.5)  # both sides of -3 and 3
row("hardswish", "kinks", lambda g, a: ml.hardswish(a), lambda a, **k: F.hardswish(a), one(), domains=(KINKS,))
row("hardsigmoid", "kinks", lambda g, a: ml.hardsigmoid(a), lambda a, **k: F.hardsigmoid(a), one(), domains=(KINKS,))
row("clip", "both", lambda g, a: ml.clip(a, -1, 2), lambda a, **k: torch.clamp(a, -1, 2), one(), FLOATS + INTS)


def _cast_ref(a: torch.Tensor, dtype: str, to: str) -> torch.Tensor:
    return a.to(TD[dtype]).to(TD[to])


for to in ("float32", "float16", "bfloat16", "bool"):
    row(
        "cast",
        f"to-{to}",
        lambda g, a, _t=to: ml.cast(a, _t),
        lambda a, dtype, _t=to: _cast_ref(a, dtype, _t),
        lambda rng: Sample([rand_shape(rng)]),
        FLOATS + (("int32", "int64") if to != "bool" else ()) + ("bool",),
    )
row("cast", "int64-to-int32", lambda g, a: a.astype("int32"), lambda a, **k: a.to(torch.int32), one(), ("int64",))


# fused_elementwise (the fuse stage's elementwise_chain makes it): three steps over broadcast operands,
# each rounded to the dtype (the reference rounds them too), a number among the last step's operands
def _fused_steps(dtype: str) -> list[dict[str, Any]]:
    return [
        {"op": "div", "attrs": {}, "args": [["in", 0], ["in", 1]], "dtype": dtype},
        {"op": "add", "attrs": {}, "args": [["step", 0], ["in", 0]], "dtype": dtype},
        {"op": "maximum", "attrs": {"scalars": {1: 0.25}}, "args": [["step", 1]], "dtype": dtype},
    ]


row(
    "fused_elementwise",
    "div-add-maximum",
    lambda g, a, b: ml.fused_elementwise([a, b], _fused_steps(a.dtype.name)),
    lambda a, b, dtype, **k: torch.clamp_min(rnd(rnd(a / b, dtype) + a, dtype), 0.25),
    many(2),
    FLOATS,
    domains=("normal", "positive"),
)

"""The vector-Jacobian rules of the elementwise ops (their OpDefs in elementwise.py name them).

Each takes a ``VjpCall`` and gives one gradient per tensor operand. Formulas of more than one step run
in float32 and round once to the operand's dtype; gradients of broadcast operands are summed back.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from megaloop.frontend.opdef import VjpCall
from megaloop.frontend.ops._grad import by_tensor, f32, slots, zeros
from megaloop.frontend.tensor import BUILDERS as B
from megaloop.frontend.tensor import Tensor

Rule = Callable[[VjpCall], list[Any]]


def _binary(fn: Callable[[Tensor, Any, Any, Tensor], tuple[Any, Any]]) -> Rule:
    """A rule from fn(g, a, b, out) -> (da, db) in float32, a or b possibly a Python number."""

    def rule(call: VjpCall) -> list[Any]:
        a, b = (f32(x) if isinstance(x, Tensor) else x for x in slots(call, 2))
        return by_tensor(call, fn(f32(call.cotangent()), a, b, f32(call.outputs[0])), 2)

    return rule


def _unary(fn: Callable[[Tensor, Tensor, Tensor], Tensor]) -> Rule:
    """A rule from fn(g, x, out) -> dx in float32."""

    def rule(call: VjpCall) -> list[Any]:
        x = call.inputs[0]
        return [B.cast(fn(f32(call.cotangent()), f32(x), f32(call.outputs[0])), x.dtype)]

    return rule


add = _binary(lambda g, a, b, out: (g, g))
sub = _binary(lambda g, a, b, out: (g, B.neg(g)))
mul = _binary(lambda g, a, b, out: (g * b, g * a))
div = _binary(lambda g, a, b, out: (g / b, B.neg(g) * out / b))


def _power(g: Tensor, a: Any, b: Any, out: Tensor) -> tuple[Any, Any]:
    """a ** b: b a^(b - 1) and a^b log a (0 where a is 0, as PyTorch)."""
    da = g * b * a ** (b - 1.0) if isinstance(a, Tensor) else None
    if not isinstance(b, Tensor):
        return da, None
    if not isinstance(a, Tensor):
        return da, g * out * (math.log(a) if a > 0 else 0.0)
    return da, B.where(B.equal(a, 0.0), 0.0, g * out * B.log(a))


power = _binary(_power)


def _pick(first: bool) -> Rule:
    """maximum (first=True picks a where a > b) and minimum: the chosen operand takes the gradient,
    ties share it equally (as PyTorch)."""

    def fn(g: Tensor, a: Any, b: Any, out: Tensor) -> tuple[Any, Any]:
        wins = B.greater(a, b) if first else B.less(a, b)
        loses = B.less(a, b) if first else B.greater(a, b)
        tie = B.equal(a, b)
        half = g * 0.5
        return (
            B.where(wins, g, B.where(tie, half, 0.0)),
            B.where(loses, g, B.where(tie, half, 0.0)),
        )

    return _binary(fn)


maximum = _pick(True)
minimum = _pick(False)


def silu_mul(call: VjpCall) -> list[Any]:
    """silu(a) * b: da = g b s (1 + a (1 - s)), db = g silu(a), s = sigmoid(a)."""
    a, b = (f32(x) if isinstance(x, Tensor) else x for x in slots(call, 2))
    g = f32(call.cotangent())
    s = B.sigmoid(a)
    da = g * b * s * (1.0 + a * (1.0 - s))
    return by_tensor(call, (da, g * (a * s)), 2)


def where(call: VjpCall) -> list[Any]:
    """cond ? a : b: a takes the gradient where cond holds, b elsewhere; cond none."""
    cond = call.inputs[0]
    g = call.cotangent()
    zero = zeros(g)
    grads = [None, B.where(cond, g, zero), B.where(cond, zero, g)]
    return [None] + by_tensor(_values_only(call), grads[1:], 2)


class _values_only:
    """where's call seen from its value slots (1, 2) only, for by_tensor."""

    def __init__(self, call: VjpCall) -> None:
        self.inputs = call.inputs[1:]
        self.attrs = {"scalars": {k - 1: v for k, v in call.attrs.get("scalars", {}).items()}}


neg = _unary(lambda g, x, out: B.neg(g))
absolute = _unary(lambda g, x, out: B.where(B.greater(x, 0.0), g, B.where(B.less(x, 0.0), B.neg(g), 0.0)))
exp = _unary(lambda g, x, out: g * out)
log = _unary(lambda g, x, out: g / x)
sqrt = _unary(lambda g, x, out: g * 0.5 / out)
rsqrt = _unary(lambda g, x, out: g * -0.5 * out * out * out)
reciprocal = _unary(lambda g, x, out: B.neg(g) * out * out)
# (recomputed in float32 from x: 1 - out rounded to a 16-bit float loses the tails' gradient)
tanh = _unary(lambda g, x, out: g * (1.0 - B.tanh(x) * B.tanh(x)))
sigmoid = _unary(lambda g, x, out: g * B.sigmoid(x) * (1.0 - B.sigmoid(x)))
relu = _unary(lambda g, x, out: B.where(B.greater(x, 0.0), g, 0.0))
erf = _unary(lambda g, x, out: g * (2.0 / math.sqrt(math.pi)) * B.exp(B.neg(x * x)))
hardsigmoid = _unary(lambda g, x, out: B.where(B.greater(x, -3.0) & B.less(x, 3.0), g / 6.0, 0.0))
# PyTorch's: 0 up to -3 (inclusive), (2x + 3) / 6 below 3, 1 from 3 on
hardswish = _unary(
    lambda g, x, out: B.where(B.less_equal(x, -3.0), 0.0, B.where(B.less(x, 3.0), g * (x * 2.0 + 3.0) / 6.0, g))
)


def _silu(g: Tensor, x: Tensor, out: Tensor) -> Tensor:
    s = B.sigmoid(x)
    return g * s * (1.0 + x * (1.0 - s))


silu = _unary(_silu)

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def gelu(call: VjpCall) -> list[Any]:
    """erf form: Phi(x) + x phi(x); tanh form: the derivative of its tanh formula."""
    x = call.inputs[0]
    g, v = f32(call.cotangent()), f32(x)
    if call.attrs.get("approximate", "none") == "tanh":
        t = B.tanh((v + v * v * v * 0.044715) * _SQRT_2_OVER_PI)
        d = (1.0 + t) * 0.5 + v * 0.5 * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + v * v * (3 * 0.044715))
    else:
        d = (1.0 + B.erf(v * (1.0 / math.sqrt(2.0)))) * 0.5 + v * B.exp(v * v * -0.5) * _INV_SQRT_2PI
    return [B.cast(g * d, x.dtype)]


def clip(call: VjpCall) -> list[Any]:
    """The gradient passes where min <= x <= max (PyTorch's clamp)."""
    x = call.inputs[0]
    g = call.cotangent()
    keep = None
    for key, test in (("min", B.greater_equal), ("max", B.less_equal)):
        if call.attrs.get(key) is not None:
            inside = test(x, call.attrs[key])
            keep = inside if keep is None else keep & inside
    return [B.where(keep, g, zeros(g))]


def cast(call: VjpCall) -> list[Any]:
    """Between floats the gradient is cast back; from ints or bools none flows."""
    x = call.inputs[0]
    return [B.cast(call.cotangent(), x.dtype) if x.dtype.is_float else None]

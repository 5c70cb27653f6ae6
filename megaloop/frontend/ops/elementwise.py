"""Elementwise ops: binary arithmetic and comparisons with numpy broadcasting, ``where``, unary math,
and casts.

Dtype rule: operands must have the same dtype; megaloop never promotes implicitly (cast first).
A Python number may stand in for one operand ("weak" typing): the result has the tensor's dtype.
In arithmetic the number enters the float32 computation as a float32 (``x * 0.1`` on bf16 uses
0.1f, not 0.1 rounded to bf16 — as PyTorch's mul and div do); in comparisons it is first rounded to
the tensor's dtype (``x == 0.1`` compares with the bf16 nearest 0.1, as PyTorch and JAX do).
Arithmetic on float16/bfloat16 runs in float32 and rounds once to the output dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from megaloop import dtypes
from megaloop.errors import BroadcastError, DtypeError, GraphBuildError, NonFiniteError
from megaloop.frontend.opdef import Accuracy, Fast, Lowering, OpCall, OpDef, OutSpec, register
from megaloop.frontend.ops import _elementwise_vjp as _vjp
from megaloop.frontend.ops import _integer as _int
from megaloop.frontend.ops import _placements, _tilings, _torch
from megaloop.frontend.ops._build import apply, find_graph_tensor, require_scalar, require_tensor
from megaloop.frontend.ops._fast import VALUES_ONLY, Kernel, rounder
from megaloop.frontend.shapes import broadcast_shapes, format_shape
from megaloop.frontend.tensor import Tensor

# the builders (megaloop.frontend.ops exports them): an op added here is exported by adding it here
__all__ = [
    "abs",
    "add",
    "add_scalar",
    "cast",
    "clip",
    "div",
    "equal",
    "erf",
    "exp",
    "floor_divide",
    "gelu",
    "greater",
    "greater_equal",
    "hardsigmoid",
    "hardswish",
    "less",
    "less_equal",
    "log",
    "logical_and",
    "logical_not",
    "logical_or",
    "maximum",
    "minimum",
    "mul",
    "neg",
    "not_equal",
    "pow",
    "reciprocal",
    "relu",
    "remainder",
    "rsqrt",
    "scale",
    "sigmoid",
    "silu",
    "silu_mul",
    "sqrt",
    "sub",
    "tanh",
    "where",
]

# ---- shared rules ------------------------------------------------------------------------------


def broadcast_or_raise(call: OpCall) -> tuple[int, ...]:
    shapes = [t.shape for t in call.operands]
    out = broadcast_shapes(*shapes)
    if out is not None:
        return out
    ndim = max(len(s) for s in shapes)
    for axis in range(-1, -ndim - 1, -1):
        sizes = {i: s[axis] for i, s in enumerate(shapes) if len(s) >= -axis and s[axis] != 1}
        if len(set(sizes.values())) > 1:
            detail = ", ".join(f"{call.name(i)} has {d}" for i, d in sizes.items())
            break
    raise call.error(
        BroadcastError,
        "shapes " + " and ".join(format_shape(s) for s in shapes) + f" cannot be broadcast: at axis {axis}, {detail}",
        hint="sizes must match or be 1 at each trailing axis; reshape/unsqueeze an operand to line them up",
    )


def tensor_dtype(call: OpCall) -> dtypes.DType:
    """The common dtype of the tensor operands; DtypeError if they differ."""
    first = call.dtype(0)
    for i in range(1, len(call.operands)):
        if call.dtype(i) != first:
            raise call.error(
                DtypeError,
                f"operand {call.name(0)} is {first.name} but {call.name(i)} is {call.dtype(i).name}; "
                "megaloop does not promote dtypes implicitly",
                hint=f"cast one side, e.g. megaloop.cast({call.name(i)}, '{first.name}')",
            )
    return first


def check_kinds(call: OpCall, dtype: dtypes.DType, kinds: str) -> None:
    """``kinds`` is a string over f (float), i (int), b (bool)."""
    if dtype.kind[0] not in kinds:
        allowed = {"f": "floating", "i": "integer", "b": "bool"}
        raise call.error(
            DtypeError,
            f"{call.op.name} takes {' or '.join(allowed[k] for k in kinds)} tensors, not {dtype.name}",
            hint="cast the operand first" if "f" in kinds else "",
        )


def check_scalars(call: OpCall, dtype: dtypes.DType) -> None:
    for slot, value in call.attrs.get("scalars", {}).items():
        if dtype.is_int and not isinstance(value, int):
            raise call.error(
                DtypeError,
                f"scalar {value!r} in place of operand {call.op.operands[slot]} is not an "
                f"integer, but the tensor operand is {dtype.name}",
                hint="cast the tensor to a float dtype",
            )
        if dtype.is_int:
            info = np.iinfo(dtype.np)
            if not info.min <= value <= info.max:
                raise call.error(DtypeError, f"scalar {value} does not fit in {dtype.name}")
        if dtype.is_bool:
            raise call.error(DtypeError, f"a number cannot stand in for a bool operand ({value!r})")
        if dtype.is_float and not _fits_float32(value):
            raise call.error(NonFiniteError, f"scalar {value!r:.30} does not fit in float32, the compute type")


def _fits_float32(value: float | int) -> bool:
    try:
        return math.fabs(float(value)) <= float(np.finfo(np.float32).max)
    except OverflowError:  # an int beyond float64
        return False


def with_scalars(
    arrays: list[np.ndarray], attrs: dict[str, Any], n_slots: int, round_to: np.dtype | None = None
) -> list[np.ndarray]:
    """Put the scalar operands back in their slots, in the tensors' compute dtype (first rounded to
    ``round_to``, the tensors' storage dtype, when given)."""
    scalars = attrs.get("scalars", {})
    compute = next(a.dtype for a in arrays) if arrays else np.dtype(np.float32)
    it = iter(arrays)
    out = []
    for i in range(n_slots):
        if i in scalars:
            value = np.asarray(scalars[i])
            if round_to is not None:
                value = dtypes.round_to(
                    value.astype(np.float64) if round_to.kind != "i" else value, dtypes.as_dtype(round_to)
                )
            out.append(np.asarray(value, dtype=compute))
        else:
            out.append(next(it))
    return out


def to_compute(a: np.ndarray) -> np.ndarray:
    """Upcast 16-bit floats to float32 (the arithmetic type); leave other dtypes alone."""
    return a.astype(np.float32) if a.dtype.kind == "f" or a.dtype == dtypes.bfloat16.np else a


IDENTITY_HINT = (
    "On megaloop tensors, x == y and x != y are Python's identity tests (tensors stay hashable); "
    "compare values with megaloop.equal(x, y) or megaloop.not_equal(x, y)"
)


def _split_operands(
    op: OpDef, values: tuple[Any, ...], tensor_slots: tuple[int, ...] = ()
) -> tuple[list[Tensor], dict]:
    """Separate tensors from Python numbers; numbers are recorded by slot in attrs['scalars']."""
    find_graph_tensor(op, *(values[i] for i in (tensor_slots or range(len(values)))))
    tensors: list[Tensor] = []
    scalars: dict[int, float | int] = {}
    for slot, v in enumerate(values):
        if isinstance(v, Tensor):
            tensors.append(v)
        elif slot in tensor_slots:
            require_tensor(op, op.operands[slot], v)
        else:
            scalars[slot] = require_scalar(op, f"operand {op.operands[slot]}", v)
    return tensors, scalars


# ---- placements: any axis of the output can be cut; partial sums pass the linear ops -------------

ELEMENTWISE = _placements.rule(_placements.elementwise_dims)
SUMS = _placements.rule(_placements.elementwise_dims, _placements.partial_sums)
PRODUCT = _placements.rule(_placements.elementwise_dims, _placements.partial_each)
QUOTIENT = _placements.rule(_placements.elementwise_dims, _placements.partial_dividend)
LINEAR_UNARY = _placements.rule(_placements.elementwise_dims, _placements.partial_unary)

# ---- binary ops --------------------------------------------------------------------------------

_ARITH = Accuracy(ulps=1.0)


def _binary_op(
    name: str,
    doc: str,
    fn: Callable[[np.ndarray, np.ndarray], np.ndarray],
    kinds: str,
    result: str = "same",
    accuracy: Accuracy = _ARITH,
    cuda: str = "",
    placement: Any = ELEMENTWISE,
    vjp: Any = None,
    check: Callable[[OpCall, dtypes.DType], None] | None = None,
    check_data: Any = None,
    same_shapes: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None,
    on_torch: Callable[[Any, Any], Any] | None = None,
) -> OpDef:
    """``same_shapes``: fn's values for two float32 operands of one shape, faster (the fast path's);
    ``on_torch``: fn of two torch tensors of the op's dtype, rounded to it as the reference is."""

    def infer(call: OpCall) -> list[OutSpec]:
        shape = broadcast_or_raise(call)
        dtype = tensor_dtype(call)
        check_kinds(call, dtype, kinds)
        check_scalars(call, dtype)
        if check is not None:
            check(call, dtype)
        return [OutSpec(shape, dtypes.bool_ if result == "bool" else dtype)]

    def reference(arrays: list[np.ndarray], attrs: dict[str, Any]) -> np.ndarray:
        storage = arrays[0].dtype if result == "bool" else None
        a, b = with_scalars([to_compute(x) for x in arrays], attrs, 2, storage)
        return fn(a, b)

    def fast(node: Any) -> Kernel:  # a comparison's number rounded to the tensor's dtype, as above
        attrs, finish = node.attrs, rounder(node.outputs[0].dtype)
        a, b = node.inputs[:2] if len(node.inputs) == 2 else (None, None)
        if same_shapes is not None and a is not None and a.shape == b.shape and a.dtype.is_float:
            own = rounder(node.outputs[0].dtype, in_place=True)  # (a new array)
            return lambda arrays: [own(same_shapes(arrays[0], arrays[1]))]
        if not attrs.get("scalars"):
            own = rounder(node.outputs[0].dtype, in_place=isinstance(fn, np.ufunc))  # (a ufunc's result is new)
            return lambda arrays: [own(fn(arrays[0], arrays[1]))]
        storage = node.inputs[0].dtype.np if result == "bool" else None
        return lambda arrays: [finish(fn(*with_scalars(arrays, attrs, 2, storage)))]

    return register(
        OpDef(
            name=name,
            kind="compute",
            category="elementwise",
            doc=doc,
            operands=("a", "b"),
            attrs={"scalars": "scalars"},
            optional_attrs=frozenset({"scalars"}),
            infer=infer,
            reference=reference,
            fast=Fast(fast, torch=None if on_torch is None else _torch.binary(on_torch)),
            check_data=check_data,
            accuracy=accuracy,
            tiling=_tilings.ELEMENTWISE,
            lowering=Lowering("elementwise", cuda),
            placement=placement,
            vjp=vjp,
        )
    )


ADD = _binary_op(
    "add", "a + b, with broadcasting.", np.add, "fi", cuda="a + b", placement=SUMS, vjp=_vjp.add, on_torch=_torch.add
)
SUB = _binary_op("sub", "a - b, with broadcasting.", np.subtract, "fi", cuda="a - b", placement=SUMS, vjp=_vjp.sub)
MUL = _binary_op("mul", "a * b, with broadcasting.", np.multiply, "fi", cuda="a * b", placement=PRODUCT, vjp=_vjp.mul)
DIV = _binary_op(
    "div", "a / b (true division; floats only).", np.divide, "f", cuda="a / b", placement=QUOTIENT, vjp=_vjp.div
)
MAXIMUM = _binary_op(
    "maximum",
    "Elementwise max; NaN wins, as in numpy and torch.",
    np.maximum,
    "fi",
    cuda="ml::maximum(a, b)",
    vjp=_vjp.maximum,
)
MINIMUM = _binary_op(
    "minimum",
    "Elementwise min; NaN wins, as in numpy and torch.",
    np.minimum,
    "fi",
    cuda="ml::minimum(a, b)",
    vjp=_vjp.minimum,
)


POW = _binary_op(
    "pow",
    "a ** b; on integers numpy's power (wrapping on overflow; a negative exponent refused: at build "
    "time where it is a number, a data error where it is a tensor); a negative float base with a "
    "fractional power gives NaN.",
    _int.power,
    "fi",
    accuracy=Accuracy(ulps=2.0),
    cuda="ml::power(a, b)",
    vjp=_vjp.power,
    check=_int.check_power,
    check_data=_int.check_power_data,
)
FLOOR_DIVIDE = _binary_op(
    "floor_divide",
    "a // b, numpy's floor_divide: the quotient rounded toward -inf (ints: 0 for a zero divisor, as "
    "numpy; floats: numpy's divmod, a / b for a zero divisor).",
    _int.quietly(np.floor_divide),
    "fi",
    accuracy=Accuracy(ulps=0.0),
    cuda="ml::floor_divide(a, b)",
)
REMAINDER = _binary_op(
    "remainder",
    "a % b, numpy's remainder: the sign of the divisor, a - b * floor_divide(a, b) (ints: 0 for a zero "
    "divisor, as numpy; floats: numpy's divmod, NaN for a zero divisor).",
    _int.quietly(np.remainder),
    "fi",
    accuracy=Accuracy(ulps=0.0),
    cuda="ml::remainder(a, b)",
)
EQUAL = _binary_op("equal", "a == b elementwise, giving bool.", np.equal, "fib", result="bool", cuda="a == b")
NOT_EQUAL = _binary_op(
    "not_equal", "a != b elementwise, giving bool.", np.not_equal, "fib", result="bool", cuda="a != b"
)
LESS = _binary_op("less", "a < b elementwise, giving bool.", np.less, "fi", result="bool", cuda="a < b")
LESS_EQUAL = _binary_op(
    "less_equal", "a <= b elementwise, giving bool.", np.less_equal, "fi", result="bool", cuda="a <= b"
)
GREATER = _binary_op("greater", "a > b elementwise, giving bool.", np.greater, "fi", result="bool", cuda="a > b")
GREATER_EQUAL = _binary_op(
    "greater_equal", "a >= b elementwise, giving bool.", np.greater_equal, "fi", result="bool", cuda="a >= b"
)
# SwiGLU's gate: one task reads both projections, silu(gate) stays in float32 (no rounding between
# the two), and a dependent chain (decode) is one hop shorter than silu then mul
SILU_MUL = _binary_op(
    "silu_mul",
    "silu(a) * b in one pass: SwiGLU's silu(gate) times its up projection, silu(a) not rounded to the dtype.",
    lambda a, b: a * _sigmoid(a) * b,
    "f",
    accuracy=Accuracy(ulps=3.0),
    cuda="ml::silu(a) * b",
    vjp=_vjp.silu_mul,
    same_shapes=lambda a, b: silu_times(a, b),
    on_torch=_torch.silu_mul,
)
LOGICAL_AND = _binary_op("logical_and", "a and b for bool masks.", np.logical_and, "b", cuda="a && b")
LOGICAL_OR = _binary_op("logical_or", "a or b for bool masks.", np.logical_or, "b", cuda="a || b")


def _binary(op: OpDef, a: Any, b: Any) -> Tensor:
    tensors, scalars = _split_operands(op, (a, b))
    return apply(op, tensors, **({"scalars": scalars} if scalars else {}))


def _binary_builder(op: OpDef) -> Callable[[Any, Any], Tensor]:
    """The public function for a binary op; its docstring is the op's."""

    def build(a: Any, b: Any) -> Tensor:
        return _binary(op, a, b)

    build.__name__ = build.__qualname__ = op.name
    build.__doc__ = op.doc + " Either operand may be a Python number (it takes the other's dtype)."
    return build


add = _binary_builder(ADD)
sub = _binary_builder(SUB)
mul = _binary_builder(MUL)
div = _binary_builder(DIV)
maximum = _binary_builder(MAXIMUM)
minimum = _binary_builder(MINIMUM)
pow = _binary_builder(POW)
floor_divide = _binary_builder(FLOOR_DIVIDE)
remainder = _binary_builder(REMAINDER)
equal = _binary_builder(EQUAL)
not_equal = _binary_builder(NOT_EQUAL)
less = _binary_builder(LESS)
less_equal = _binary_builder(LESS_EQUAL)
greater = _binary_builder(GREATER)
greater_equal = _binary_builder(GREATER_EQUAL)
logical_and = _binary_builder(LOGICAL_AND)
silu_mul = _binary_builder(SILU_MUL)
logical_or = _binary_builder(LOGICAL_OR)


def scale(x: Tensor, factor: float) -> Tensor:
    """x * factor, the factor kept exact (float32 arithmetic for 16-bit floats)."""
    return _binary(MUL, x, factor)


def add_scalar(x: Tensor, value: float) -> Tensor:
    """x + value, the value kept exact (float32 arithmetic for 16-bit floats)."""
    return _binary(ADD, x, value)


# ---- where -------------------------------------------------------------------------------------


def _where_infer(call: OpCall) -> list[OutSpec]:
    shape = broadcast_or_raise(call)
    cond = call.operands[0]
    if not cond.dtype.is_bool:
        raise call.error(
            DtypeError,
            f"condition must be bool, got {cond.dtype.name}",
            hint="build it with a comparison such as x > 0, or cast to bool",
        )
    values = call.operands[1:]
    if not values:
        raise call.error(
            DtypeError,
            "a and b cannot both be Python numbers (their dtype would be unknown)",
            hint="make one of them a tensor, e.g. graph.constant(1.0, 'bf16')",
        )
    dtype = values[0].dtype
    for i, v in enumerate(values[1:], start=2):
        if v.dtype != dtype:
            raise call.error(
                DtypeError,
                f"{call.name(1)} is {dtype.name} but {call.name(i)} is {v.dtype.name}",
                hint="cast one of them",
            )
    check_scalars(call, dtype)
    return [OutSpec(shape, dtype)]


def _where_ref(arrays: list[np.ndarray], attrs: dict[str, Any]) -> np.ndarray:
    cond, values = arrays[0], [to_compute(a) for a in arrays[1:]]
    a, b = with_scalars(values, {"scalars": {k - 1: v for k, v in attrs.get("scalars", {}).items()}}, 2)
    return np.where(cond, a, b)


WHERE = register(
    OpDef(
        name="where",
        kind="compute",
        category="elementwise",
        doc="cond ? a : b elementwise, broadcasting all three; a or b may be a number.",
        operands=("cond", "a", "b"),
        attrs={"scalars": "scalars"},
        optional_attrs=frozenset({"scalars"}),
        infer=_where_infer,
        reference=_where_ref,
        fast=VALUES_ONLY,
        accuracy=Accuracy(ulps=0.0),
        tiling=_tilings.ELEMENTWISE,
        lowering=Lowering("elementwise", "a ? b : c"),
        placement=ELEMENTWISE,
        vjp=_vjp.where,
    )
)


def where(cond: Tensor, a: Any, b: Any) -> Tensor:
    if isinstance(cond, (bool, np.bool_)):
        raise DtypeError(f"where: cond is the Python bool {cond}, not a tensor. {IDENTITY_HINT}")
    tensors, scalars = _split_operands(WHERE, (cond, a, b), tensor_slots=(0,))
    return apply(WHERE, tensors, **({"scalars": scalars} if scalars else {}))


# ---- unary ops ---------------------------------------------------------------------------------

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_CUDA = lambda attrs: "ml::gelu_tanh(a)" if attrs.get("approximate") == "tanh" else "ml::gelu_erf(a)"
_TRANSCENDENTAL = Accuracy(ulps=2.0)
_erf64 = np.frompyfunc(math.erf, 1, 1)


def _erf(x: np.ndarray) -> np.ndarray:
    return np.asarray(_erf64(np.asarray(x, dtype=np.float64)), dtype=np.float64)


def _gelu(x: np.ndarray, approximate: str) -> np.ndarray:
    x64 = x.astype(np.float64)
    if approximate == "tanh":
        return 0.5 * x64 * (1.0 + np.tanh(_SQRT_2_OVER_PI * (x64 + 0.044715 * x64**3)))
    return 0.5 * x64 * (1.0 + _erf(x64 / math.sqrt(2.0)))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    # exp of a non-positive argument only, so large |x| cannot overflow
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def silu_times(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a * _sigmoid(a) * b for float32 a and b of one shape, bit for bit, in one new array: the select
    of sigmoid's numerator as a maximum (exp(-|a|) <= 1; NaN kept), every pass in place."""
    e, denominator = np.empty(a.shape, np.float32), np.empty(a.shape, np.float32)
    np.abs(a, out=e)
    np.negative(e, out=e)
    np.exp(e, out=e)
    np.add(e, np.float32(1), out=denominator)
    np.maximum(e, np.greater_equal(a, 0, out=np.empty(a.shape, np.float32)), out=e)
    np.divide(e, denominator, out=e)
    np.multiply(a, e, out=e)
    return np.multiply(e, b, out=e)


def _unary_op(
    name: str,
    doc: str,
    fn: Callable[..., np.ndarray],
    kinds: str = "f",
    accuracy: Accuracy = _TRANSCENDENTAL,
    cuda: str | Callable[[dict[str, Any]], str] = "",
    placement: Any = ELEMENTWISE,
    vjp: Any = None,
) -> OpDef:
    def infer(call: OpCall) -> list[OutSpec]:
        check_kinds(call, call.dtype(0), kinds)
        if name == "gelu" and call.attrs.get("approximate", "none") not in ("none", "tanh"):
            raise call.error(
                GraphBuildError, f"approximate must be 'none' or 'tanh', got {call.attrs['approximate']!r}"
            )
        return [OutSpec(call.shape(0), call.dtype(0))]

    def reference(arrays: list[np.ndarray], attrs: dict[str, Any]) -> np.ndarray:
        return fn(to_compute(arrays[0]), **attrs)

    def fast(node: Any) -> Kernel:
        attrs, finish = node.attrs, rounder(node.outputs[0].dtype)
        return lambda arrays: [finish(fn(arrays[0], **attrs))]

    return register(
        OpDef(
            name=name,
            kind="compute",
            category="elementwise",
            doc=doc,
            operands=("x",),
            attrs={"approximate": ("none", "tanh")} if name == "gelu" else {},
            optional_attrs=frozenset({"approximate"}) if name == "gelu" else frozenset(),
            infer=infer,
            reference=reference,
            fast=Fast(fast),
            accuracy=accuracy,
            tiling=_tilings.ELEMENTWISE,
            lowering=Lowering("elementwise", cuda),
            placement=placement,
            vjp=vjp,
        )
    )


NEG = _unary_op(
    "neg", "Negation, -x.", np.negative, "fi", Accuracy(ulps=0.0), cuda="-a", placement=LINEAR_UNARY, vjp=_vjp.neg
)
ABS = _unary_op("abs", "Absolute value |x|.", np.abs, "fi", Accuracy(ulps=0.0), cuda="ml::abs_(a)", vjp=_vjp.absolute)
EXP = _unary_op("exp", "Exponential e**x.", np.exp, cuda="expf(a)", vjp=_vjp.exp)
LOG = _unary_op("log", "Natural logarithm (NaN below 0, -inf at 0).", np.log, cuda="logf(a)", vjp=_vjp.log)
SQRT = _unary_op("sqrt", "Square root (NaN below 0).", np.sqrt, cuda="sqrtf(a)", vjp=_vjp.sqrt)
RSQRT = _unary_op(
    "rsqrt", "Reciprocal square root 1 / sqrt(x).", lambda x: 1.0 / np.sqrt(x), cuda="ml::rsqrt_(a)", vjp=_vjp.rsqrt
)
RECIPROCAL = _unary_op("reciprocal", "Reciprocal 1 / x.", lambda x: 1.0 / x, cuda="1.0f / a", vjp=_vjp.reciprocal)
TANH = _unary_op("tanh", "Hyperbolic tangent.", np.tanh, cuda="tanhf(a)", vjp=_vjp.tanh)
SIGMOID = _unary_op(
    "sigmoid", "1 / (1 + e**-x), computed without overflow.", _sigmoid, cuda="ml::sigmoid(a)", vjp=_vjp.sigmoid
)
RELU = _unary_op(
    "relu",
    "Rectifier max(x, 0).",
    lambda x: np.maximum(x, np.zeros((), x.dtype)),
    "fi",
    Accuracy(ulps=0.0),
    cuda="ml::relu(a)",
    vjp=_vjp.relu,
)
GELU = _unary_op(
    "gelu",
    "Gaussian error linear unit: approximate='none' (erf form) or 'tanh'.",
    _gelu,
    cuda=_GELU_CUDA,
    vjp=_vjp.gelu,
)
SILU = _unary_op("silu", "x * sigmoid(x) (a.k.a. swish).", lambda x: x * _sigmoid(x), cuda="ml::silu(a)", vjp=_vjp.silu)
ERF = _unary_op("erf", "The error function.", _erf, cuda="ml::erf_(a)", vjp=_vjp.erf)


def _unary_builder(op: OpDef) -> Callable[[Tensor], Tensor]:
    """The public function for a unary op; its docstring is the op's."""

    def build(x: Tensor) -> Tensor:
        return apply(op, [x])

    build.__name__ = build.__qualname__ = op.name
    build.__doc__ = op.doc
    return build


neg = _unary_builder(NEG)
abs = _unary_builder(ABS)
exp = _unary_builder(EXP)
log = _unary_builder(LOG)
sqrt = _unary_builder(SQRT)
rsqrt = _unary_builder(RSQRT)
reciprocal = _unary_builder(RECIPROCAL)
tanh = _unary_builder(TANH)
sigmoid = _unary_builder(SIGMOID)
relu = _unary_builder(RELU)
silu = _unary_builder(SILU)
erf = _unary_builder(ERF)


def gelu(x: Tensor, approximate: str = "none") -> Tensor:
    """Gaussian error linear unit: approximate='none' (erf form) or 'tanh'."""
    return apply(GELU, [x], approximate=approximate)


# PyTorch's hard activations: relu6(x + 3) / 6 and x times it, NaN kept (as torch's min/max keep it)
def _relu6_plus_3(x: np.ndarray) -> np.ndarray:
    return np.minimum(np.maximum(x + 3.0, 0.0), 6.0)


HARDSIGMOID = _unary_op(
    "hardsigmoid",
    "relu6(x + 3) / 6: 0 below -3, 1 above 3, linear between (PyTorch's hardsigmoid).",
    lambda x: _relu6_plus_3(x) / 6.0,
    accuracy=Accuracy(ulps=1.0),
    cuda="ml::hardsigmoid(a)",
    vjp=_vjp.hardsigmoid,
)
HARDSWISH = _unary_op(
    "hardswish",
    "x * relu6(x + 3) / 6 (PyTorch's hardswish).",
    lambda x: x * _relu6_plus_3(x) / 6.0,
    accuracy=Accuracy(ulps=1.0),
    cuda="ml::hardswish(a)",
    vjp=_vjp.hardswish,
)
hardsigmoid = _unary_builder(HARDSIGMOID)
hardswish = _unary_builder(HARDSWISH)


def _bound_literal(value: float | int) -> str:
    """A bound of clip in the compute type: ints as 64-bit, floats as their exact float32 value."""
    if isinstance(value, int):
        return f"(ml::i64){value}LL"
    return f"((float){float(np.float32(value)).hex()})"


def _clip_cuda(attrs: dict[str, Any]) -> str:
    expr = "a"
    if attrs.get("min") is not None:
        expr = f"ml::maximum({expr}, {_bound_literal(attrs['min'])})"
    if attrs.get("max") is not None:
        expr = f"ml::minimum({expr}, {_bound_literal(attrs['max'])})"
    return expr


def _clip_infer(call: OpCall) -> list[OutSpec]:
    dtype = call.dtype(0)
    check_kinds(call, dtype, "fi")
    bounds = {k: call.attrs.get(k) for k in ("min", "max")}
    if all(v is None for v in bounds.values()):
        raise call.error(GraphBuildError, "give min, max or both (as torch.clamp asks)")
    for key, value in bounds.items():
        if value is not None and isinstance(value, int) != dtype.is_int:
            want = "an int" if dtype.is_int else "a float"
            raise call.error(DtypeError, f"{key} must be {want} for {dtype.name} x, got {value!r}")
        if value is not None and dtype.is_int and not np.iinfo(dtype.np).min <= value <= np.iinfo(dtype.np).max:
            raise call.error(DtypeError, f"{key} {value} does not fit in {dtype.name}")
    return [OutSpec(call.shape(0), dtype)]


def _clip_ref(arrays: list[np.ndarray], attrs: dict[str, Any]) -> np.ndarray:
    x = to_compute(arrays[0])
    if attrs.get("min") is not None:
        x = np.maximum(x, np.asarray(attrs["min"], x.dtype))
    if attrs.get("max") is not None:
        x = np.minimum(x, np.asarray(attrs["max"], x.dtype))
    return x


CLIP = register(
    OpDef(
        name="clip",
        kind="compute",
        category="elementwise",
        doc="min(max(x, min), max) with scalar bounds, either left out (None); NaN kept; where min > max, "
        "every element is max (PyTorch's clamp).",
        operands=("x",),
        attrs={"min": "number?", "max": "number?"},
        optional_attrs=frozenset({"min", "max"}),
        infer=_clip_infer,
        reference=_clip_ref,
        fast=VALUES_ONLY,
        accuracy=Accuracy(ulps=0.0),
        tiling=_tilings.ELEMENTWISE,
        lowering=Lowering("elementwise", _clip_cuda),
        placement=ELEMENTWISE,
        vjp=_vjp.clip,
    )
)


def clip(x: Tensor, min: float | int | None = None, max: float | int | None = None) -> Tensor:
    """min(max(x, min), max) with Python numbers as bounds (torch.clamp); floats for float x, ints for
    int x (no promotion)."""
    x = require_tensor(CLIP, "x", x)
    bounds = {}
    for key, value in (("min", min), ("max", max)):
        if value is not None:
            value = require_scalar(CLIP, key, value)
            bounds[key] = float(value) if x.dtype.is_float and isinstance(value, int) else value
    return apply(CLIP, [x], **bounds)


def _logical_not_infer(call: OpCall) -> list[OutSpec]:
    check_kinds(call, call.dtype(0), "b")
    return [OutSpec(call.shape(0), dtypes.bool_)]


LOGICAL_NOT = register(
    OpDef(
        name="logical_not",
        kind="compute",
        category="elementwise",
        doc="not x for bool masks.",
        operands=("x",),
        infer=_logical_not_infer,
        reference=lambda arrays, attrs: np.logical_not(arrays[0]),
        fast=VALUES_ONLY,
        accuracy=Accuracy(0.0),
        tiling=_tilings.ELEMENTWISE,
        lowering=Lowering("elementwise", "!a"),
        placement=ELEMENTWISE,
    )
)


logical_not = _unary_builder(LOGICAL_NOT)


# ---- cast --------------------------------------------------------------------------------------


def _cast_infer(call: OpCall) -> list[OutSpec]:
    src, dst = call.dtype(0), call.attrs["dtype"]
    if src.is_float and dst.is_int:
        raise call.error(
            DtypeError,
            f"casting {src.name} to {dst.name} is not supported (rounding mode and "
            "out-of-range values would be ambiguous)",
            hint="compare or use argmax to produce integers",
        )
    return [OutSpec(call.shape(0), dst)]


def _cast_ref(arrays: list[np.ndarray], attrs: dict[str, Any]) -> np.ndarray:
    x = arrays[0]
    dst: dtypes.DType = attrs["dtype"]
    if dst.is_bool:
        return to_compute(x) != 0
    if dst.is_float:
        return x.astype(np.float32)  # exact from floats; ints round to float32 first, as torch and ml_dtypes do
    return x.astype(dst.np)  # int -> int wraps like C; bool -> 0/1


CAST = register(
    OpDef(
        name="cast",
        kind="compute",
        category="elementwise",
        doc="Convert to another dtype: between floats (round to nearest even), int->float, int<->int "
        "(wrapping), bool<->numbers (nonzero is True). float->int is refused.",
        operands=("x",),
        attrs={"dtype": "dtype"},
        infer=_cast_infer,
        reference=_cast_ref,
        fast=VALUES_ONLY,
        accuracy=Accuracy(ulps=0.5),
        tiling=_tilings.ELEMENTWISE,
        lowering=Lowering("elementwise", "a"),
        placement=ELEMENTWISE,
        vjp=_vjp.cast,
    )
)


def cast(x: Tensor, dtype: Any) -> Tensor:
    """Convert ``x`` to ``dtype``; returns ``x`` itself when it already has that dtype."""
    dt = dtypes.as_dtype(dtype)
    if isinstance(x, Tensor) and x.dtype == dt:
        return x
    return apply(CAST, [x], dtype=dt)

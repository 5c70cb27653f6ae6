"""Optimizer updates as in-place ops on state: a training step's last stage, run by the loop kernel
like any other op, so that N iterations of a training plan are N optimizer steps with no host work.

Every op takes ``counter``, an int64 0-d state: the micro-batches done before this iteration (the
optimizer helper, megaloop/optim, adds 1 to it every iteration). With ``accumulate`` = K micro-batches
an update, the iteration with counter c

- starts an accumulation cycle where c % K == 0 (``grad_accumulate`` restarts its sum there);
- ends one, and so updates, where (c + 1) % K == 0; the update's number is t = (c + 1) // K, from 1
  (Adam's bias correction, SGD's first momentum step). On other iterations the update ops leave their
  state as it is (the GPU tile returns before touching it).

The ops, each in place on operand 0 (a state, float32 unless said), computed in float64 on the
reference and float32 in the loop kernel, rounded once to the state's dtype:

- ``grad_accumulate(buffer, grad, counter)``: buffer = grad where a cycle starts, else buffer + grad.
- ``adam_moment(state, grad, scale, counter, beta, square)``: state = beta * state + (1 - beta) * x,
  x = grad * scale (square: its square). Adam's first (m) and second (v) moments; scale is the
  clipping coefficient times 1 / K.
- ``adamw_update(param, m, v, lr, counter, beta1, beta2, eps, weight_decay)``: param (any float dtype)
  = param * (1 - lr * weight_decay) - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps):
  torch.optim.AdamW's update (decoupled weight decay, bias correction).
- ``sgd_momentum(buf, grad, param, scale, counter, momentum, dampening, weight_decay)``: with
  d = grad * scale + weight_decay * param, buf = d on the first update (t == 1), else
  momentum * buf + (1 - dampening) * d: torch.optim.SGD's momentum buffer.
- ``sgd_update(param, grad, buf, lr, scale, counter, momentum, nesterov, weight_decay)``: param -=
  lr * u, u = d (momentum 0: buf unused), d + momentum * buf (nesterov) or buf; buf the new one.

lr and scale are float32 0-d tensors (``lr_schedule``'s output, a clipping coefficient) or Python
numbers. Why separate ops rather than one: an op writes one output in place (OpDef.inplace_operand),
so Adam's m, v and the parameter are three writes; the moments are read again by the parameter's
update (6 reads and 3 writes an element instead of 4 and 3). GPU tiles: megaloop/optim.cuh.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from megaloop import dtypes
from megaloop.errors import DataError, DtypeError, GraphBuildError, ShapeError
from megaloop.frontend import sources
from megaloop.frontend.opdef import Accuracy, Lowering, OpCall, OpDef, OutSpec, first_bad, register
from megaloop.frontend.ops import _placements, _tilings
from megaloop.frontend.ops._build import apply, require_bool, require_int, require_scalar, require_tensor
from megaloop.frontend.shapes import format_shape
from megaloop.frontend.tensor import Tensor

# ---- the counter ----------------------------------------------------------------------------------


def step_of(counter: Any, accumulate: int) -> tuple[bool, bool, int]:
    """(update, first, t) of the iteration with ``counter`` micro-batches done before it: it ends an
    accumulation cycle (and updates), it starts one, and the update's number from 1."""
    c = int(np.asarray(counter).reshape(()))
    k = int(accumulate)
    return (c + 1) % k == 0, c % k == 0, (c + 1) // k


def check_counter(op_name: str, slot: int) -> Callable[[list[np.ndarray], dict[str, Any], Any], None]:
    """check_data: the counter (operand ``slot``) counts micro-batches done, so it is >= 0."""

    def check(arrays: list[np.ndarray], attrs: dict[str, Any], known: Any) -> None:
        counter = np.asarray(arrays[slot])
        if first_bad(counter < 0, known[slot]) is not None:
            raise DataError(
                f"{op_name}: the step counter is {int(counter.reshape(()))}; it counts the micro-batches done and "
                "must be >= 0 (reset the optimizer's counter state to 0)"
            )

    return check


# ---- shape rules ------------------------------------------------------------------------------------


def _require(call: OpCall, i: int, kind: str, shape: tuple[int, ...] | None, dtype: dtypes.DType | None) -> None:
    """Operand i is a float tensor (kind "f") or int64 (kind "i") of ``shape`` (None: any) and ``dtype``."""
    t = call.operands[i]
    name = call.name(i)
    if kind == "i" and t.dtype != dtypes.int64:
        raise call.error(DtypeError, f"{name} must be an int64 step counter, got {t.dtype.name}")
    if kind == "f" and not t.dtype.is_float:
        raise call.error(DtypeError, f"{name} must be a floating tensor, got {t.dtype.name}", hint="cast it")
    if dtype is not None and t.dtype != dtype:
        raise call.error(
            DtypeError, f"{name} must be {dtype.name}, got {t.dtype.name}", hint=f"keep {name} in {dtype.name}"
        )
    if shape is not None and t.shape != shape:
        what = "a 0-d tensor (one value)" if not shape else f"of shape {format_shape(shape)}"
        raise call.error(ShapeError, f"{name} must be {what}, got {format_shape(t.shape)}")


def _rule(layout: str) -> Callable[[OpCall], list[OutSpec]]:
    """A shape rule from a layout string, a letter an operand: S the state written in place (float32),
    P a parameter (any float dtype, operand 0's shape), G a gradient (the same), s a float32 0-d
    scalar, c the int64 0-d counter. Output: operand 0's shape and dtype."""

    def infer(call: OpCall) -> list[OutSpec]:
        shape = call.shape(0)
        for i, letter in enumerate(layout):
            if letter == "S":
                _require(call, i, "f", shape, dtypes.float32)
            elif letter in "PG":
                _require(call, i, "f", shape, None)
            elif letter == "s":
                _require(call, i, "f", (), dtypes.float32)
            else:
                _require(call, i, "i", (), None)
        return [OutSpec(shape, call.dtype(0))]

    return infer


# ---- references (float64, rounded once to the state's dtype) ------------------------------------------


def _f64(a: np.ndarray) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def _grad_accumulate_ref(arrays: list[np.ndarray], attrs: dict[str, Any]) -> np.ndarray:
    buffer, grad, counter = arrays
    _, first, _ = step_of(counter, attrs["accumulate"])
    total = _f64(grad) if first else _f64(buffer) + _f64(grad)
    return total.astype(buffer.dtype)


def _adam_moment_ref(arrays: list[np.ndarray], attrs: dict[str, Any]) -> np.ndarray:
    state, grad, scale, counter = arrays
    update, _, _ = step_of(counter, attrs["accumulate"])
    if not update:
        return state.copy()
    beta = attrs["beta"]
    x = _f64(grad) * _f64(scale)
    x = x * x if attrs["square"] else x
    return (beta * _f64(state) + (1.0 - beta) * x).astype(state.dtype)


def adam_factors(lr: float, t: int, attrs: dict[str, Any]) -> tuple[float, float, float]:
    """(the parameter's decay factor, the step size, 1 / sqrt of the second bias correction) of update t."""
    bc1 = 1.0 - attrs["beta1"] ** t
    bc2 = 1.0 - attrs["beta2"] ** t
    return 1.0 - lr * attrs["weight_decay"], lr / bc1, 1.0 / np.sqrt(bc2)


def _adamw_update_ref(arrays: list[np.ndarray], attrs: dict[str, Any]) -> np.ndarray:
    param, m, v, lr, counter = arrays
    update, _, t = step_of(counter, attrs["accumulate"])
    if not update:
        return param.copy()
    decay, step, inv_bc2 = adam_factors(float(_f64(lr)), t, attrs)
    with np.errstate(all="ignore"):
        new = _f64(param) * decay - step * _f64(m) / (np.sqrt(_f64(v)) * inv_bc2 + attrs["eps"])
    return new.astype(param.dtype)


def _decayed_grad(grad: np.ndarray, scale: np.ndarray, param: np.ndarray, attrs: dict[str, Any]) -> np.ndarray:
    return _f64(grad) * _f64(scale) + attrs["weight_decay"] * _f64(param)


def _sgd_momentum_ref(arrays: list[np.ndarray], attrs: dict[str, Any]) -> np.ndarray:
    buf, grad, param, scale, counter = arrays
    update, _, t = step_of(counter, attrs["accumulate"])
    if not update:
        return buf.copy()
    d = _decayed_grad(grad, scale, param, attrs)
    new = d if t == 1 else attrs["momentum"] * _f64(buf) + (1.0 - attrs["dampening"]) * d
    return new.astype(buf.dtype)


def _sgd_update_ref(arrays: list[np.ndarray], attrs: dict[str, Any]) -> np.ndarray:
    param, grad, buf, lr, scale, counter = arrays
    update, _, _ = step_of(counter, attrs["accumulate"])
    if not update:
        return param.copy()
    d = _decayed_grad(grad, scale, param, attrs)
    mu = attrs["momentum"]
    u = d if mu == 0 else d + mu * _f64(buf) if attrs["nesterov"] else _f64(buf)
    return (_f64(param) - _f64(lr) * u).astype(param.dtype)


# ---- the ops --------------------------------------------------------------------------------------------

COUNTED = {"accumulate": "count"}


def _c(value: float) -> str:
    """A number as an exact C++ double literal."""
    return float(value).hex()


def _define(
    name: str,
    doc: str,
    operands: tuple[str, ...],
    layout: str,
    reference: Callable[..., np.ndarray],
    attrs: dict[str, Any],
    constants: Callable[[dict[str, Any]], str],
) -> OpDef:
    """An optimizer op: in place on operand 0, elementwise tiles, its GPU tile ``ml::opt::<name>``
    (megaloop/optim.cuh) taking ``constants(attrs)`` after its operands."""
    return register(
        OpDef(
            name=name,
            kind="compute",
            category="optimizer",
            doc=doc,
            operands=operands,
            infer=_rule(layout),
            reference=reference,
            check_data=check_counter(name, len(operands) - 1),
            attrs={**attrs, **COUNTED},
            accuracy=Accuracy(ulps=3.0),  # (float32 arithmetic, a few roundings, against the float64 truth)
            inplace_operand=0,
            tiling=_tilings.ELEMENTWISE,
            lowering=Lowering("optim_update", constants),
            placement=_placements.rule(_placements.elementwise_dims),
        )
    )


GRAD_ACCUMULATE = _define(
    "grad_accumulate",
    "Gradient accumulation in place: buffer (float32 state) = grad where the counter starts a cycle of "
    "`accumulate` micro-batches, else buffer + grad (megaloop.frontend.ops.optim).",
    ("buffer", "grad", "counter"),
    "SGc",
    _grad_accumulate_ref,
    {},
    lambda a: f"{int(a['accumulate'])}LL",
)
ADAM_MOMENT = _define(
    "adam_moment",
    "Adam's moment in place: state (float32) = beta * state + (1 - beta) * (grad * scale) (squared with "
    "square=True) on the iterations that update (megaloop.frontend.ops.optim).",
    ("state", "grad", "scale", "counter"),
    "SGsc",
    _adam_moment_ref,
    {"beta": "number", "square": "bool"},
    lambda a: f"{_c(a['beta'])}, {'true' if a['square'] else 'false'}, {int(a['accumulate'])}LL",
)
ADAMW_UPDATE = _define(
    "adamw_update",
    "AdamW's parameter update in place from the new moments m and v: decoupled weight decay, bias "
    "correction from the counter's update number (megaloop.frontend.ops.optim).",
    ("param", "m", "v", "lr", "counter"),
    "PSSsc",
    _adamw_update_ref,
    {"beta1": "number", "beta2": "number", "eps": "number", "weight_decay": "number"},
    lambda a: ", ".join(_c(a[k]) for k in ("beta1", "beta2", "eps", "weight_decay")) + f", {int(a['accumulate'])}LL",
)
SGD_MOMENTUM = _define(
    "sgd_momentum",
    "SGD's momentum buffer in place: buf = momentum * buf + (1 - dampening) * (grad * scale + weight_decay "
    "* param), grad * scale + weight_decay * param on the first update (megaloop.frontend.ops.optim).",
    ("buf", "grad", "param", "scale", "counter"),
    "SGPsc",
    _sgd_momentum_ref,
    {"momentum": "number", "dampening": "number", "weight_decay": "number"},
    lambda a: ", ".join(_c(a[k]) for k in ("momentum", "dampening", "weight_decay")) + f", {int(a['accumulate'])}LL",
)
SGD_UPDATE = _define(
    "sgd_update",
    "SGD's parameter update in place: param -= lr * (the new momentum buffer, Nesterov's look-ahead, or "
    "the weight-decayed gradient with momentum 0) (megaloop.frontend.ops.optim).",
    ("param", "grad", "buf", "lr", "scale", "counter"),
    "PGGssc",
    _sgd_update_ref,
    {"momentum": "number", "nesterov": "bool", "weight_decay": "number"},
    lambda a: (
        f"{_c(a['momentum'])}, {'true' if a['nesterov'] else 'false'}, {_c(a['weight_decay'])}, "
        f"{int(a['accumulate'])}LL"
    ),
)


# ---- builders -------------------------------------------------------------------------------------------


def scalar_operand(op: OpDef, like: Tensor, name: str, value: Any) -> Tensor:
    """A float32 0-d operand: a Tensor as it is (the shape rule checks it), a number as a constant."""
    if isinstance(value, Tensor):
        return value
    number = require_scalar(op, name, value)
    return like.graph.constant(float(number), "float32", name=f"{op.name}.{name}")


def _number(op: OpDef, name: str, value: Any, low: float, high: float, closed_high: bool = False) -> float:
    v = float(require_scalar(op, name, value))
    if not (low <= v < high or (closed_high and v == high)):
        bound = "]" if closed_high else ")"
        raise GraphBuildError(f"{op.name}: {name} is {v}; it must be in [{low}, {high}{bound}")
    return v


def _state_update(op: OpDef, operands: list[Any], **attrs: Any) -> Tensor:
    """``op`` on its operands, in place on operand 0, which must be a state: the result is its next value."""
    target = require_tensor(op, op.operands[0], operands[0])
    if target.node.op is not sources.STATE:
        raise GraphBuildError(
            f"{op.name}: {op.operands[0]} must be a graph state (graph.state(name, shape, dtype)), which the op "
            f"updates in place; got {target!r}"
        )
    name = target.node.attrs["name"]
    if name in target.graph.state_updates:
        raise GraphBuildError(
            f"{op.name}: state {name!r} already receives {target.graph.state_updates[name]!r} this iteration; a "
            "state takes one new value per iteration"
        )
    attrs["accumulate"] = require_int(op, "accumulate", attrs["accumulate"], minimum=1)
    out = apply(op, operands, **attrs)
    target.graph.assign(target, out)
    return out


def grad_accumulate(buffer: Tensor, grad: Tensor, counter: Tensor, *, accumulate: int) -> Tensor:
    """Add ``grad`` into the float32 state ``buffer`` in place, restarting the sum where ``counter``
    starts a cycle of ``accumulate`` micro-batches; the result is the buffer's next value."""
    return _state_update(GRAD_ACCUMULATE, [buffer, grad, counter], accumulate=accumulate)


def adam_moment(
    state: Tensor,
    grad: Tensor,
    counter: Tensor,
    *,
    beta: float,
    square: bool = False,
    scale: Tensor | float = 1.0,
    accumulate: int = 1,
) -> Tensor:
    """Adam's first (``square=False``) or second moment, in place on the float32 ``state``:
    beta * state + (1 - beta) * (grad * scale) (squared), on the iterations that update."""
    op = ADAM_MOMENT
    sq = require_bool(op, "square", square)
    beta = _number(op, "beta", beta, 0.0, 1.0)
    return _state_update(
        op,
        [state, grad, scalar_operand(op, grad, "scale", scale), counter],
        beta=beta,
        square=sq,
        accumulate=accumulate,
    )


def adamw_update(
    param: Tensor,
    m: Tensor,
    v: Tensor,
    counter: Tensor,
    *,
    lr: Tensor | float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    accumulate: int = 1,
) -> Tensor:
    """AdamW's update of the state ``param`` in place from the moments ``m`` and ``v`` (the new ones,
    adam_moment's results): torch.optim.AdamW's arithmetic, the update number from ``counter``."""
    op = ADAMW_UPDATE
    attrs = {
        "beta1": _number(op, "beta1", beta1, 0.0, 1.0),
        "beta2": _number(op, "beta2", beta2, 0.0, 1.0),
        "eps": _number(op, "eps", eps, 0.0, float("inf")),
        "weight_decay": _number(op, "weight_decay", weight_decay, 0.0, float("inf")),
    }
    lr_t = scalar_operand(op, param, "lr", lr)
    return _state_update(op, [param, m, v, lr_t, counter], **attrs, accumulate=accumulate)


def sgd_momentum(
    buf: Tensor,
    grad: Tensor,
    param: Tensor,
    counter: Tensor,
    *,
    momentum: float,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    scale: Tensor | float = 1.0,
    accumulate: int = 1,
) -> Tensor:
    """SGD's momentum buffer, in place on the float32 state ``buf`` (torch.optim.SGD's)."""
    op = SGD_MOMENTUM
    attrs = {
        "momentum": _number(op, "momentum", momentum, 0.0, float("inf")),
        "dampening": _number(op, "dampening", dampening, 0.0, 1.0, closed_high=True),
        "weight_decay": _number(op, "weight_decay", weight_decay, 0.0, float("inf")),
    }
    operands = [buf, grad, param, scalar_operand(op, grad, "scale", scale), counter]
    return _state_update(op, operands, **attrs, accumulate=accumulate)


def sgd_update(
    param: Tensor,
    grad: Tensor,
    counter: Tensor,
    *,
    lr: Tensor | float,
    buf: Tensor | None = None,
    momentum: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    scale: Tensor | float = 1.0,
    accumulate: int = 1,
) -> Tensor:
    """SGD's update of the state ``param`` in place; ``buf``: the new momentum buffer (sgd_momentum's
    result), needed where momentum > 0."""
    op = SGD_UPDATE
    mu = _number(op, "momentum", momentum, 0.0, float("inf"))
    nest = require_bool(op, "nesterov", nesterov)
    if mu > 0 and buf is None:
        raise GraphBuildError("sgd_update: momentum > 0 needs buf, the new momentum buffer (ml.sgd_momentum's result)")
    if nest and mu == 0:
        raise GraphBuildError("sgd_update: nesterov needs momentum > 0 (as torch.optim.SGD)")
    attrs = {
        "momentum": mu,
        "nesterov": nest,
        "weight_decay": _number(op, "weight_decay", weight_decay, 0.0, float("inf")),
    }
    operands = [param, grad, grad if buf is None else buf]
    operands += [scalar_operand(op, param, "lr", lr), scalar_operand(op, grad, "scale", scale), counter]
    return _state_update(op, operands, **attrs, accumulate=accumulate)

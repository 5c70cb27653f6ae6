"""Helpers the op builders share: find the graph, check operand types, add the node."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from megaloop.errors import AxisError, DtypeError, GraphBuildError, NonFiniteError
from megaloop.frontend.opdef import OpDef
from megaloop.frontend.shapes import normalize_axes, normalize_axis
from megaloop.frontend.tensor import Tensor
from megaloop.frontend.validate import as_int, as_ints, as_shape


def apply(op: OpDef, operands: list[Tensor], /, **attrs: Any) -> Tensor:
    """Add one node of ``op`` to the operands' graph and return its single output."""
    (out,) = apply_multi(op, operands, **attrs)
    return out


def apply_multi(op: OpDef, operands: list[Tensor], /, **attrs: Any) -> tuple[Tensor, ...]:
    for i, t in enumerate(operands):
        require_tensor(op, op.operand_name(i), t)
    if not operands:
        raise GraphBuildError(f"{op.name}: needs at least one megaloop Tensor operand")
    return operands[0].graph.apply(op, operands, attrs)


def require_tensor(op: OpDef, name: str, value: Any) -> Tensor:
    if not isinstance(value, Tensor):
        raise GraphBuildError(
            f"{op.name}: operand {name} must be a megaloop Tensor, got {type(value).__name__} {value!r:.80}; "
            "turn arrays into tensors with graph.input/parameter/constant"
        )
    return value


def require_scalar(op: OpDef, name: str, value: Any, *, allow_nonfinite: bool = False) -> float | int:
    """A Python (or numpy scalar) int or float argument; bools refused; finite unless allowed."""
    if isinstance(value, np.generic) and value.dtype.kind in "iuf":
        value = value.item()
    if isinstance(value, (bool, np.bool_)):
        raise DtypeError(
            f"{op.name}: {name} must be a Python int or float, got the bool {value}. On megaloop tensors, x == y "
            "is Python's identity test: compare values with megaloop.equal(x, y)"
        )
    if not isinstance(value, (int, float)):
        raise DtypeError(f"{op.name}: {name} must be a Python int or float, got {type(value).__name__} {value!r:.80}")
    if isinstance(value, float) and not allow_nonfinite and not math.isfinite(value):
        raise NonFiniteError(f"{op.name}: {name} is {value}, but it must be finite")
    return value


def require_int(op: OpDef, name: str, value: Any, *, minimum: int | None = None) -> int:
    return as_int(value, f"{op.name}: {name}", minimum=minimum)


def require_ints(op: OpDef, name: str, value: Any, *, minimum: int | None = None, allow_none: bool = False) -> tuple:
    """A tuple or list of ints (None allowed where ``allow_none``): slice bounds, ranks, axes."""
    return as_ints(value, f"{op.name}: {name}", minimum=minimum, allow_none=allow_none)


def require_shape(op: OpDef, name: str, value: Any) -> tuple[int, ...]:
    """A shape argument (``name`` is "shape" in every builder that takes one)."""
    return as_shape(value, op.name)


def require_bool(op: OpDef, name: str, value: Any) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise GraphBuildError(f"{op.name}: {name} must be True or False, got {type(value).__name__} {value!r:.40}")


def axis_arg(who: str, x: Tensor, axis: Any, ndim: int | None = None) -> int:
    """A builder's axis argument normalised for ``x`` (or ``ndim`` axes); AxisError naming ``who``."""
    try:
        return normalize_axis(axis, x.ndim if ndim is None else ndim)
    except ValueError as e:
        raise AxisError(f"{who}: {e} (x is {x!r})") from None


def axes_arg(who: str, x: Tensor, axes: Any) -> tuple[int, ...]:
    try:
        return normalize_axes(axes, x.ndim)
    except ValueError as e:
        raise AxisError(f"{who}: {e} (x is {x!r})") from None


def find_graph_tensor(op: OpDef, *values: Any) -> Tensor:
    for v in values:
        if isinstance(v, Tensor):
            return v
    raise GraphBuildError(
        f"{op.name}: at least one operand must be a megaloop Tensor, got " + ", ".join(type(v).__name__ for v in values)
    )

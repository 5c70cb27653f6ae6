"""The integers and shapes users hand to megaloop, checked in one place.

Every builder, graph source, model constructor and planner setting that takes an integer or a shape
goes through ``as_int``, ``as_ints`` or ``as_shape``: the same rules (Python or numpy integers, never
bools or floats; a shape is an ordered sequence, never a set) and the same sentences, naming what was
passed and what was expected. Shapes are bounded by what a plan can address: a task's box bounds are
int32 in the loop kernel's task table, and byte offsets are int64 sums over a rank's arena.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from megaloop.errors import GraphBuildError, ShapeError

Shape = tuple[int, ...]

MAX_DIM = 2**31 - 1  # a task's box bounds (lo, hi) are int32 in the loop kernel
MAX_TENSOR_BYTES = 2**47  # 128 TiB, far beyond any GPU: byte offsets and arena sums stay exact in int64
MAX_ARENA_BYTES = 2**48  # one rank's arena (all its buffers): the same reason


def _show(value: Any) -> str:
    return f"{type(value).__name__} {value!r:.60}"


def is_int(value: Any) -> bool:
    """A Python or numpy integer (bools are not integers here)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def as_int(
    value: Any,
    what: str,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    error: type[Exception] = GraphBuildError,
    why: str = "",
) -> int:
    """``value`` as an int in [minimum, maximum]; ``error`` naming ``what`` otherwise (``why``: the
    reason for the bound, appended to the message)."""
    if not is_int(value):
        raise error(f"{what} must be an int, got {_show(value)}")
    value = int(value)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        if maximum is None:
            bound = f">= {minimum}"
        elif minimum is None:
            bound = f"<= {maximum}"
        else:
            bound = f"in [{minimum}, {maximum}]"
        raise error(f"{what} must be {bound}, got {value}{why}")
    return value


def _sequence(value: Any, what: str, kind: str, error: type[Exception]) -> list[Any]:
    if isinstance(value, np.ndarray) and value.ndim == 1:
        return list(value)
    if isinstance(value, (set, frozenset, dict)):
        unordered = type(value).__name__
        raise error(f"{what} must be a tuple or list of {kind}, got {_show(value)}: a {unordered} has no order")
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise error(f"{what} must be a tuple or list of {kind}, got {_show(value)}")
    return list(value)


def as_ints(
    value: Any,
    what: str,
    *,
    minimum: int | None = None,
    allow_none: bool = False,
    error: type[Exception] = GraphBuildError,
) -> tuple[Any, ...]:
    """A tuple or list of ints (or None where ``allow_none``), each >= ``minimum``."""
    kind = "ints or None" if allow_none else "ints"
    items = _sequence(value, what, kind, error)
    return tuple(
        None if (v is None and allow_none) else as_int(v, f"{what}[{i}]", minimum=minimum, error=error)
        for i, v in enumerate(items)
    )


def as_shape(value: Any, what: str, *, itemsize: int | None = None, error: type[Exception] = ShapeError) -> Shape:
    """A static shape: an int (one axis) or an ordered sequence of ints in [0, MAX_DIM] (0: an empty
    axis, docs/ops.md); with ``itemsize``, a tensor of at most MAX_TENSOR_BYTES."""
    dims = [value] if is_int(value) else _sequence(value, f"{what}: shape", "ints", error)
    for i, d in enumerate(dims):
        if not is_int(d) or d < 0:
            raise error(
                f"{what}: shape {_shape_text(value)} is invalid; every dimension must be an int >= 0 "
                f"(dimension {i} is {_show(d)}; megaloop plans static shapes)"
            )
        if d > MAX_DIM:
            raise error(
                f"{what}: dimension {i} of shape {_shape_text(value)} is {int(d)}; a megaloop tensor has at most "
                f"2^31 - 1 = {MAX_DIM} elements along an axis (tile bounds are int32 in the loop kernel)"
            )
    shape = tuple(int(d) for d in dims)
    if itemsize is not None and math.prod(shape) * itemsize > MAX_TENSOR_BYTES:
        raise error(
            f"{what}: shape {list(shape)} of {itemsize}-byte elements takes {math.prod(shape) * itemsize} bytes; a "
            f"megaloop tensor holds at most 2^47 bytes (128 TiB), far more than any GPU: is a dimension wrong?"
        )
    return shape


def _shape_text(value: Any) -> str:
    return f"{value!r:.80}"

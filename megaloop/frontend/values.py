"""Arrays handed in for graph tensors (inputs, parameters, state): checked and converted once, for
the reference backend and the GPU runtime alike."""

from __future__ import annotations

from typing import Any

import numpy as np

from megaloop.dtypes import DType, bfloat16, round_to, to_numpy
from megaloop.errors import EvaluationError
from megaloop.frontend.shapes import format_shape
from megaloop.frontend.tensor import Tensor


def coerce(value: Any, t: Tensor, what: str) -> np.ndarray:
    """Check an array handed in for tensor ``t`` and convert it to ``t``'s dtype (a copy)."""
    try:
        arr = to_numpy(value)
    except ValueError as e:
        raise EvaluationError(f"{what}: not an array ({e})") from None
    if arr.shape != t.shape:
        raise EvaluationError(f"{what}: expected shape {format_shape(t.shape)}, got {format_shape(arr.shape)}")
    kind = "f" if arr.dtype == bfloat16.np else arr.dtype.kind
    dt: DType = t.dtype
    if dt.is_float and kind == "f":
        return np.array(round_to(arr, dt), copy=True)
    if dt.is_float and kind in "iu":
        return np.array(round_to(arr.astype(np.float64), dt), copy=True)
    if dt.is_int and kind in "iu":
        info = np.iinfo(dt.np)
        if arr.size and (arr.min() < info.min or arr.max() > info.max):
            raise EvaluationError(f"{what}: values {arr.min()}..{arr.max()} do not fit in {dt.name}")
        return arr.astype(dt.np)
    if dt.is_bool and kind == "b":
        return arr.copy()
    raise EvaluationError(f"{what}: expected {dt.name} values, got a {arr.dtype} array")

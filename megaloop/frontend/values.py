"""Arrays handed in for graph tensors (inputs, parameters, state): checked and converted once, for
the reference backend and the GPU runtime alike."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from megaloop.dtypes import DType, bfloat16, round_to, to_numpy
from megaloop.errors import EvaluationError
from megaloop.frontend.shapes import format_shape
from megaloop.frontend.tensor import Tensor


def coerce(value: Any, t: Tensor, what: str, copy: bool = True) -> np.ndarray:
    """Check an array handed in for tensor ``t`` and convert it to ``t``'s dtype (a copy; ``copy=False``:
    the array itself where it has that dtype already, for a caller that converts it further)."""
    try:
        arr = to_numpy(value)
    except ValueError as e:
        raise EvaluationError(f"{what}: not an array ({e})") from None
    if arr.shape != t.shape:
        raise EvaluationError(f"{what}: expected shape {format_shape(t.shape)}, got {format_shape(arr.shape)}")
    kind = "f" if arr.dtype == bfloat16.np else arr.dtype.kind
    dt: DType = t.dtype
    if dt.is_float and kind in "fiu":
        return _rounded(arr if kind == "f" else arr.astype(np.float64), dt, what, copy)
    if dt.is_int and kind in "iu":
        info = np.iinfo(dt.np)
        if arr.size and (arr.min() < info.min or arr.max() > info.max):
            raise EvaluationError(f"{what}: values {arr.min()}..{arr.max()} do not fit in {dt.name}")
        return arr.astype(dt.np)
    if dt.is_bool and kind == "b":
        return arr.copy()
    raise EvaluationError(f"{what}: expected {dt.name} values, got a {arr.dtype} array")


def _rounded(arr: np.ndarray, dt: DType, what: str, copy: bool = True) -> np.ndarray:
    """``arr`` rounded to float dtype ``dt`` (a copy); finite values that would become inf are refused,
    as they are in a constant (non-finite values handed in stay what they are)."""
    with np.errstate(over="ignore", invalid="ignore"):
        out = round_to(arr, dt)
    if copy and np.may_share_memory(out, arr):
        out = out.copy()
    # no wider temporaries: an upload converts a memory-mapped checkpoint piece by piece; a wider
    # dtype's range holds every value (bfloat16 to float32: no pass over the result)
    inf = np.isinf(out) if arr.dtype != dt.np and arr.size and not _widens(arr.dtype, dt) else None
    if inf is not None and inf.any():
        overflow = inf & np.isfinite(arr)
        if np.any(overflow):
            at = tuple(int(i) for i in np.argwhere(overflow)[0])
            largest = float(ml_dtypes.finfo(dt.np).max)
            raise EvaluationError(
                f"{what}: value {arr[at]} at index {at} overflows {dt.name} (largest finite value {largest:g}; "
                f"{np.count_nonzero(overflow)} values in all); scale it, or give the tensor a wider dtype"
            )
    return out


def _widens(stored: np.dtype, dt: DType) -> bool:
    """Whether every finite value of float dtype ``stored`` is finite in ``dt``."""
    if stored.kind != "f" and stored != bfloat16.np:
        return False
    return float(ml_dtypes.finfo(stored).max) <= float(ml_dtypes.finfo(dt.np).max)

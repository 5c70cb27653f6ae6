"""Pieces the ops' fast CPU implementations share (``OpDef.fast``, megaloop.reference.fast).

A tensor's *compute form* is what the arithmetic reads: float32 for every float dtype (a bfloat16 or
float16 tensor as float32 values it can hold exactly), the storage dtype for ints and bools. Keeping
values in that form between ops (and the weights converted once) is what makes the fast path fast;
rounding each output to its dtype keeps the reference's rounding points.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from megaloop.dtypes import DType
from megaloop.frontend.opdef import Fast

Kernel = Callable[[list[np.ndarray]], list[np.ndarray]]
F32 = np.dtype(np.float32)


def compute_np(dtype: DType) -> np.dtype:
    """The numpy dtype of ``dtype``'s compute form."""
    return F32 if dtype.is_float else dtype.np


def to_compute_form(array: np.ndarray, dtype: DType) -> np.ndarray:
    """A stored value (numpy, of ``dtype``) in its compute form; ints and bools as they are."""
    return array.astype(np.float32) if dtype.is_float and array.dtype != F32 else array


def dense(a: np.ndarray) -> np.ndarray:
    """``a``, or where it is a view with gaps, the copy the reference's upcast makes of it (numpy's
    "K" order): a reduction or product over it then runs in the reference's order."""
    return a if a.flags.c_contiguous or a.flags.f_contiguous else a.copy(order="K")


def rounder(dtype: DType) -> Callable[[np.ndarray], np.ndarray]:
    """The function that rounds a result to ``dtype`` and returns it in compute form: what the
    reference's store does (megaloop.dtypes.round_to: a float64 goes through float32 first)."""
    if dtype.is_float and dtype.itemsize == 2:
        storage = dtype.np

        def rounded(a: np.ndarray) -> np.ndarray:
            a = np.asarray(a)
            if a.dtype != F32:
                a = a.astype(np.float32)
            return a.astype(storage).astype(np.float32)

        return rounded
    target = compute_np(dtype)
    return lambda a: np.asarray(a).astype(target, copy=False)


def _reference_kernel(node: Any, rounds: bool) -> Kernel:
    reference, attrs = node.op.reference, node.attrs
    if not rounds:
        return lambda arrays: _as_list(reference(arrays, attrs))
    rounds_out = [rounder(t.dtype) for t in node.outputs]
    if len(rounds_out) == 1:
        only = rounds_out[0]
        return lambda arrays: [only(_single(reference(arrays, attrs)))]
    return lambda arrays: [r(v) for r, v in zip(rounds_out, reference(arrays, attrs))]


def _as_list(result: Any) -> list[np.ndarray]:
    return result if isinstance(result, list) else [result]


def _single(result: Any) -> np.ndarray:
    return result[0] if isinstance(result, list) else result


def values_only(rounds: bool = True) -> Fast:
    """The op's own reference on compute-form operands: for a reference that reads its operands'
    values only (every float operand upcast to float32 first, no operand dtype looked at), so it
    computes the same values from float32 copies. ``rounds=False``: its outputs are operand values
    (views, gathers, copies), already of their dtype."""
    return Fast(lambda node: _reference_kernel(node, rounds))


VALUES_ONLY = values_only()
MOVES_VALUES = values_only(rounds=False)

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

from megaloop.dtypes import DType, bfloat16
from megaloop.frontend.opdef import Fast
from megaloop.frontend.ops._torch import from_numpy, viewed

Kernel = Callable[[list[np.ndarray]], list[np.ndarray]]
F32 = np.dtype(np.float32)


def compute_np(dtype: DType) -> np.dtype:
    """The numpy dtype of ``dtype``'s compute form."""
    return F32 if dtype.is_float else dtype.np


def to_compute_form(array: np.ndarray, dtype: DType) -> np.ndarray:
    """A stored value (numpy, of ``dtype``) in its compute form; ints and bools as they are."""
    return array.astype(np.float32) if dtype.is_float and array.dtype != F32 else array


def blas_ready(a: np.ndarray) -> np.ndarray:
    """``a`` where numpy's matmul hands its matrices to BLAS as they are (unit stride along one of the
    last two axes; the reference's upcast copy goes to BLAS too, and BLAS sums in the same order
    whatever the leading dimension), else that copy (numpy's own loop would sum in another order)."""
    if a.ndim < 2:
        return a
    (r, c), (rs, cs), size = a.shape[-2:], a.strides[-2:], a.itemsize
    if (cs == size and rs % size == 0 and rs // size >= c) or (rs == size and cs % size == 0 and cs // size >= r):
        return a
    return a.copy(order="K")


def dense(a: np.ndarray) -> np.ndarray:
    """``a``, or where it is a view with gaps, the copy the reference's upcast makes of it (numpy's
    "K" order): a reduction or product over it then runs in the reference's order."""
    return a if a.flags.c_contiguous or a.flags.f_contiguous else a.copy(order="K")


# Products of at least this many rows (a prefill's) go to torch where a weight has a bfloat16 twin
# (Weight): its bfloat16 kernels (AVX512-BF16, AMX) ran 1.3-4x numpy's float32 ones from 8 rows on the
# development machine, not faster at a decode step's one row (docs/generate.md).
TORCH_ROWS = 8
# products="auto" twins a bfloat16 matrix of at least this many values: from a 256 x 512 weight up
# torch's were faster at 8 rows and more there; a tiny model's stay numpy's (faster below)
TORCH_MIN_WEIGHT = 1 << 17


class Weight(np.ndarray):
    """A parameter's compute form (float32, owning its memory) that also carries its bfloat16 storage as
    a torch tensor (``bf16``), for the products of many rows (``weight_product``): a view of it reads
    the same view of that tensor."""

    bf16: Any = None

    def __array_finalize__(self, obj: Any) -> None:
        self.bf16 = None


def _bfloat16_twin(w: np.ndarray) -> Any:
    """The torch bfloat16 tensor laid out as ``w`` over its Weight's twin, or None."""
    twin = getattr(w, "bf16", None)
    if twin is not None:
        return twin
    owner = w.base  # (numpy makes a view of a view of a Weight a view of the Weight)
    twin = getattr(owner, "bf16", None)
    if twin is None:
        return None
    offset = (w.__array_interface__["data"][0] - owner.__array_interface__["data"][0]) // w.itemsize
    return twin.as_strided(w.shape, tuple(st // w.itemsize for st in w.strides), offset)


def weight_product(a: np.ndarray, w: np.ndarray, finish: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """finish(a @ swapaxes(w, -1, -2)) for compute-form ``a`` [..., rows, K] and ``w`` [..., N, K] (a
    weight or a view of one), ``finish`` the rounder of the product's dtype: numpy's product (the
    reference's call, its bits), or for many rows and a weight with a bfloat16 twin, torch's bfloat16
    product (float32 sums rounded once to bfloat16: the same contract, another order of sums)."""
    if a.size >= TORCH_ROWS * a.shape[-1] and (twin := _bfloat16_twin(w)) is not None:
        import torch  # (only where a Weight has a twin: ComputeWeights made it, torch was there)

        usable = a.flags.writeable and min(a.strides, default=0) >= 0  # (what torch.from_numpy takes)
        rows = torch.from_numpy(a if usable else a.copy()).to(torch.bfloat16)
        if twin.dim() == 2:
            return torch.matmul(rows, twin.T).float().numpy()  # (bfloat16 values: rounded)
        # one 2-D product a matrix (split-K's ranges of K are strided views): no copy of the weight
        lead = torch.broadcast_shapes(rows.shape[:-2], twin.shape[:-2])
        rows, twin = rows.expand(*lead, *rows.shape[-2:]), twin.expand(*lead, *twin.shape[-2:])
        out = torch.empty(*lead, rows.shape[-2], twin.shape[-2], dtype=torch.bfloat16)
        for i in np.ndindex(*lead):
            torch.matmul(rows[i], twin[i].T, out=out[i])
        return out.float().numpy()
    return finish(np.matmul(blas_ready(a), np.swapaxes(blas_ready(np.asarray(w)), -1, -2)))


def rounder(dtype: DType, in_place: bool = False) -> Callable[[np.ndarray], np.ndarray]:
    """The function that rounds a result to ``dtype`` and returns it in compute form: what the
    reference's store does (megaloop.dtypes.round_to: a float64 goes through float32 first).
    ``in_place``: a float32 result may be rounded in its own memory (a new array nothing else reads)."""
    if dtype == bfloat16:
        return _bfloat16_in_place if in_place else _to_bfloat16
    if dtype.is_float and dtype.itemsize == 2:
        storage = dtype.np
        return lambda a: _float32(a).astype(storage).astype(np.float32)
    target = compute_np(dtype)
    return lambda a: np.asarray(a).astype(target, copy=False)


def _float32(a: Any) -> np.ndarray:
    a = np.asarray(a)
    return a if a.dtype == F32 else a.astype(np.float32)


# Below this many values ml_dtypes' own round trip is faster (2 calls against 8: 1.5 against 6 us
# at 576 values); above it the integer arithmetic is (26 against 64 us at 49152)
SMALL_ROUNDING = 4096


def _to_bfloat16(a: Any) -> np.ndarray:
    """Float32 values rounded to the nearest bfloat16 (ties to even) as float32: ml_dtypes' rounding
    (overflow to inf included); for large arrays by integer arithmetic on a copy, 2.5x faster (NaNs
    through ml_dtypes)."""
    a = _float32(a)
    if a.size < SMALL_ROUNDING:
        return a.astype(bfloat16.np).astype(np.float32)
    bits = (a.view(np.uint32) >> 16) & 1
    bits += 0x7FFF
    bits += a.view(np.uint32)
    bits &= 0xFFFF0000
    out = bits.view(np.float32)
    nan = np.isnan(a)
    if nan.any():
        out[nan] = a[nan].astype(bfloat16.np).astype(np.float32)
    return out


def _bfloat16_in_place(a: Any) -> np.ndarray:
    """_to_bfloat16 of a new float32 array in its own memory (one pass and one array fewer)."""
    if not isinstance(a, np.ndarray) or a.dtype != F32 or a.size < SMALL_ROUNDING or not a.flags.writeable:
        return _to_bfloat16(a)
    if np.isnan(np.max(a)):  # (NaNs keep ml_dtypes' payloads: the general path)
        return _to_bfloat16(a)
    bits = a.view(np.uint32)
    carry = bits >> 16
    carry &= 1
    carry += 0x7FFF
    bits += carry
    bits &= 0xFFFF0000
    return a


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


def _moving_on_torch(node: Any) -> Any:
    """The reference of an op that moves values (views, gathers, copies) on numpy arrays over the torch
    operands' memory (bfloat16 as ml_dtypes'), its results back as torch tensors: no conversion."""
    reference, attrs = node.op.reference, node.attrs
    return lambda arrays: [from_numpy(r) for r in _as_list(reference([viewed(a) for a in arrays], attrs))]


def values_only(rounds: bool = True) -> Fast:
    """The op's own reference on compute-form operands: for a reference that reads its operands'
    values only (every float operand upcast to float32 first, no operand dtype looked at), so it
    computes the same values from float32 copies. ``rounds=False``: its outputs are operand values
    (views, gathers, copies), already of their dtype (on torch-form operands too)."""
    return Fast(lambda node: _reference_kernel(node, rounds), torch=None if rounds else _moving_on_torch)


VALUES_ONLY = values_only()
MOVES_VALUES = values_only(rounds=False)

"""Pieces the ops' torch kernels share (``Fast.torch``; megaloop.reference.fast with activations="torch").

A tensor's *torch form*: a torch tensor of its dtype (bfloat16 activations stay bfloat16 between
torch's bfloat16 products, as transformers keeps them), ints and bools as torch's; a float state (a
KV cache) is the float32 tensor over its compute-form buffer, holding values of its dtype, so that
in-place writes reach the state. Kernels take either form of a float (``of``) and return their own
dtype, rounded as the reference rounds the op's result (within the op's accuracy contract).
torch is imported only where a graph runs in torch form (it is an optional dependency).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from megaloop.dtypes import DType, bfloat16

TorchKernel = Callable[[list[Any]], list[Any]]


def torch() -> Any:
    import torch as _torch  # (only where a graph runs in torch form)

    return _torch


def onednn_linear() -> Any:
    """torch's oneDNN linear layer, ``(x, w [out, in], bias, "none", [], "")``, or None where this torch
    has none (a build without mkldnn, or a version that renamed it)."""
    t = torch()
    try:
        return t.ops.mkldnn._linear_pointwise if t.backends.mkldnn.is_available() else None
    except (AttributeError, RuntimeError):
        return None


def torch_dtype(dtype: DType) -> Any:
    """torch's dtype for ``dtype`` (bfloat16 included)."""
    t = torch()
    if dtype == bfloat16:
        return t.bfloat16
    return t.from_numpy(np.zeros(0, dtype.np)).dtype


def of(x: Any, dtype: DType) -> Any:
    """``x`` (a torch tensor in either float form) as ``dtype``'s torch tensor (no copy where it is one)."""
    return x.to(torch_dtype(dtype))


def from_numpy(array: np.ndarray) -> Any:
    """A torch tensor over ``array``'s memory (a copy where torch cannot take its strides); a
    read-only array (a weight) is taken as it is: nothing writes a kernel's operands."""
    if array.dtype == bfloat16.np:
        return from_numpy(array.view(np.int16)).view(torch().bfloat16)
    if min(array.strides, default=0) < 0 or (array.strides and array.strides[-1] % array.itemsize):
        array = array.copy(order="C")  # (ascontiguousarray keeps a size-1 axis's negative stride)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch().from_numpy(array)


def to_torch(array: np.ndarray, dtype: DType, keep_float32: bool = False) -> Any:
    """A compute-form value as its torch form (``keep_float32``: a float as the float32 tensor over
    its memory, as a state's)."""
    t = from_numpy(np.asarray(array))
    return t if keep_float32 or not dtype.is_float else t.to(torch_dtype(dtype))


def to_numpy(x: Any, dtype: DType) -> np.ndarray:
    """A torch-form value in compute form (float32 for a float: values of ``dtype``; no copy where it
    is float32 already, or an int or bool)."""
    if dtype.is_float and x.dtype != torch().float32:
        x = x.float()
    return x.numpy()


def viewed(x: Any) -> np.ndarray:
    """A torch-form value as a numpy array over its memory (bfloat16 as ml_dtypes'): what a data check
    reads, no copy."""
    if x.dtype == torch().bfloat16:
        return x.view(torch().int16).numpy().view(bfloat16.np)
    return x.numpy()


def as_float(x: Any) -> Any:
    """A float torch tensor as float32 (its values, exactly)."""
    return x.float()


def in_numpy(node: Any, kernel: Callable[[list[np.ndarray]], list[np.ndarray]]) -> TorchKernel:
    """A compute-form kernel of ``node`` run on torch-form operands: each converted to compute form
    (no copy where it is float32, an int or a bool), each output back (an in-place op's result stays
    the float32 tensor over the state it wrote)."""
    ins = [t.dtype for t in node.inputs]
    outs = [(t.dtype, i == 0 and node.op.inplace_operand is not None) for i, t in enumerate(node.outputs)]

    def run(arrays: list[Any]) -> list[Any]:
        results = kernel([to_numpy(a, d) for a, d in zip(arrays, ins)])
        return [to_torch(r, d, keep) for r, (d, keep) in zip(results, outs)]

    return run


def binary(fn: Callable[[Any, Any], Any]) -> Callable[[Any], TorchKernel | None]:
    """A float binary op's torch kernel: ``fn`` of its two operands in its dtype, rounded to it (None
    where an operand is a number, or the op is not a float one)."""

    def make(node: Any) -> TorchKernel | None:
        dtype = node.outputs[0].dtype
        if len(node.inputs) != 2 or not dtype.is_float:
            return None
        return lambda arrays: [of(fn(of(arrays[0], dtype), of(arrays[1], dtype)), dtype)]

    return make


def add(a: Any, b: Any) -> Any:
    """a + b: torch's bfloat16 sum is the float32 sum rounded once, the reference's."""
    return a + b


def silu_mul(a: Any, b: Any) -> Any:
    """silu(a) * b in the dtype: silu(a) rounded too (within silu_mul's 3 ulps), twice as fast as a
    float32 pass on the development machine."""
    return torch().nn.functional.silu(a) * b


def copied(x: Any) -> Any:
    """A new contiguous tensor of ``x``'s values (copy's: never ``x`` itself, which may be a state)."""
    return x.clone(memory_format=torch().contiguous_format)

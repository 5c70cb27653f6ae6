"""Helpers the ops' vector-Jacobian rules share (megaloop/frontend/autodiff.py runs the rules).

Rules are written with the public builders (``tensor.BUILDERS``), so a backward graph is an ordinary
graph: the planner, the reference, the interpreter and the GPU code generator run it as they run any.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from megaloop.dtypes import DType
from megaloop.frontend.opdef import VjpCall
from megaloop.frontend.tensor import BUILDERS as B
from megaloop.frontend.tensor import Tensor


def zeros(like: Tensor, shape: Sequence[int] | None = None, dtype: DType | None = None) -> Tensor:
    """Zeros of ``like``'s shape and dtype (or the given ones): one constant element, broadcast."""
    dtype = dtype or like.dtype
    shape = tuple(like.shape if shape is None else shape)
    one = like.graph.constant(np.zeros((1,) * max(1, len(shape))), dtype)
    if not shape:
        return one.reshape(())
    return B.broadcast_to(one, shape)


def unbroadcast(g: Tensor, shape: Sequence[int]) -> Tensor:
    """``g`` (a gradient of a broadcast result) summed back to an operand of ``shape``."""
    shape = tuple(shape)
    if g.shape == shape:
        return g
    lead = g.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(
        lead + i for i, (s, d) in enumerate(zip(shape, g.shape[lead:])) if s == 1 and d != 1
    )
    if axes:
        g = B.sum(g, axes, keepdims=True)
    return B.reshape(g, shape) if g.shape != shape else g


def f32(t: Tensor) -> Tensor:
    """``t`` in float32 (16-bit floats widened; a rule's arithmetic then rounds once at its end)."""
    return B.cast(t, "float32")


def slots(call: VjpCall, n: int) -> list[Any]:
    """An elementwise node's operands by slot: its tensors, with the Python numbers that stood in for
    the others (attrs["scalars"]) back in their slots."""
    scalars = call.attrs.get("scalars", {})
    it = iter(call.inputs)
    return [scalars[s] if s in scalars else next(it) for s in range(n)]


def by_tensor(call: VjpCall, grads: Sequence[Tensor | None], n: int) -> list[Tensor | None]:
    """Gradients given per slot, kept for the slots that hold tensors (the order of node.inputs), each
    summed back to its operand's shape and cast to its dtype."""
    scalars = call.attrs.get("scalars", {})
    out = []
    it = iter(call.inputs)
    for s in range(n):
        if s in scalars:
            continue
        x = next(it)
        g = grads[s]
        out.append(None if g is None else B.cast(unbroadcast(g, x.shape), x.dtype))
    return out


def sum_to_rows(g: Tensor, width: int) -> Tensor:
    """``g`` [..., width] summed over every leading axis: a per-feature weight's gradient."""
    return B.sum(B.reshape(g, (-1, width)), 0) if g.ndim > 1 else g

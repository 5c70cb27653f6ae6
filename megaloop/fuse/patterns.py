"""What several rules look for: the node that made a value, a linear layer's product, the same values
under another shape, a decode step's few rows."""

from __future__ import annotations

import math
from typing import NamedTuple

from megaloop.frontend.graph import Node
from megaloop.frontend.ops.norm_linear import NORMED_ROWS
from megaloop.frontend.tensor import Tensor


def made_by(t: Tensor, *ops: str) -> Node | None:
    """The node that made ``t`` when it is one of ``ops`` and ``t`` its (only) first output."""
    return t.node if t.node.op.name in ops and t.index == 0 else None


class Linear(NamedTuple):
    """x @ w.T of a matmul node (what ``ops.linear`` makes): x [..., rows, K], w [N, K]."""

    x: Tensor
    w: Tensor


def linear(node: Node | None) -> Linear | None:
    """``node`` as x @ w.T, when it is a matmul of that form (w a 2-D operand, transposed)."""
    if node is None or node.op.name != "matmul" or node.attrs["transpose_a"] or not node.attrs["transpose_b"]:
        return None
    x, w = node.inputs
    return Linear(x, w) if w.ndim == 2 and x is not w else None


def unreshaped(t: Tensor) -> Tensor:
    """``t`` before the reshapes that made it (a reshape keeps the elements' row-major order)."""
    while t.node.op.name == "reshape":
        t = t.node.inputs[0]
    return t


def same_values(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` hold the same elements in the same order (one is a reshape of the other)."""
    return a.size == b.size and unreshaped(a) is unreshaped(b)


def same_where_used(a: Tensor, positions: Tensor) -> bool:
    """Whether ``a`` holds ``positions`` wherever they are not negative: the same values, or maximum(positions,
    0) (the rotary positions of a paged write, whose rows at negative positions write nothing)."""
    if same_values(a, positions):
        return True
    clamp = made_by(unreshaped(a), "maximum")
    return (
        clamp is not None
        and len(clamp.inputs) == 1
        and list(clamp.attrs.get("scalars", {}).values()) == [0]
        and same_values(clamp.inputs[0], positions)
    )


def few_rows(x: Tensor) -> bool:
    """One sequence of at most NORMED_ROWS rows (a decode step): the rows a product's tile norms itself."""
    return x.ndim >= 2 and math.prod(x.shape[:-2]) == 1 and x.shape[-2] <= NORMED_ROWS


def rope_attrs(node: Node) -> dict:
    """rope's keywords (theta, layout, rotary_dim, scaling) as ``node`` (rope or an op taking them) has them."""
    return {k: node.attrs[k] for k in ("theta", "layout", "rotary_dim", "scaling")}

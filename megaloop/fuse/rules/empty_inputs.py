"""Results of empty operands (docs/ops.md, zero-size axes): a node that reads a tensor with no element
and still gives elements (a sum or mean over an empty axis, a product over K = 0, attention over no
key) gives values that no data decides: its reference on the empty operands with any values in the
others. The rule computes them once (the reference run with two different fillings of the other
operands must agree) and makes them a constant, so that no tile ever reduces over nothing. Nodes whose
result does depend on their other operands (a concat with an empty piece) are left to the planner."""

from __future__ import annotations

import numpy as np

from megaloop import dtypes
from megaloop.frontend.graph import Node
from megaloop.frontend.opdef import REGISTRY
from megaloop.fuse.rewrite import Rewriter
from megaloop.fuse.rule import Rule, register_rule


def _filled(node: Node, fill: float) -> list[np.ndarray] | None:
    """The node's results with every non-empty operand filled with ``fill`` (None: the reference
    refused such values)."""
    arrays = [
        np.full(t.shape, fill, t.dtype.np) if t.dtype.is_float else np.zeros(t.shape, t.dtype.np) for t in node.inputs
    ]
    try:
        with np.errstate(all="ignore"):
            out = node.op.reference(arrays, dict(node.attrs))
    except Exception:  # (a value the op's data rules refuse: left to the planner and the run's checks)
        return None
    values = out if isinstance(out, (list, tuple)) else [out]
    return [dtypes.round_to(np.asarray(v), t.dtype) for v, t in zip(values, node.outputs)]


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return all(x.shape == y.shape and np.array_equal(x, y, equal_nan=x.dtype.kind == "f") for x, y in zip(a, b))


def _fire(node: Node, rw: Rewriter) -> bool:
    if node.op.kind != "compute" or node.op.inplace_operand is not None or node.op.reference is None:
        return False
    if not any(t.size == 0 for t in node.inputs) or not all(t.size for t in node.outputs):
        return False
    first, second = _filled(node, 0.5), _filled(node, -1.25)
    if first is None or second is None or not _same(first, second):
        return False
    with rw.build(node):
        made = [
            node.graph.constant(v, t.dtype, name=f"{node.name}.empty", allow_nonfinite=True)
            for v, t in zip(first, node.outputs)
        ]
    for old, new in zip(node.outputs, made):
        rw.replace(old, new)
    rw.discard(node)
    return True


def _roots() -> tuple[str, ...]:
    return tuple(name for name, op in REGISTRY.items() if op.kind == "compute")


register_rule(
    Rule(
        name="empty_inputs",
        makes="constant",
        roots=_roots(),
        doc="a node reading an empty tensor whose result no data decides (a reduction over an empty "
        "axis, a product over K = 0): its values as a constant",
        fire=_fire,
    )
)

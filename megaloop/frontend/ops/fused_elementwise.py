"""fused_elementwise: a tree of elementwise ops as one op. Each output element is computed by the ops
in turn, every intermediate rounded to its dtype as storing it would round it, so the values are the
plain ops' bit for bit; the loop kernel runs one task (and one handoff) where the plain ops had one
each. The fuse stage makes it (megaloop/fuse/rules/elementwise_chain.py); models do not build it.

``steps``: the ops in order, each {"op": registry name, "attrs": its attributes, "args": its tensor
operands as ["in", i] (the fused op's operand i) or ["step", j] (an earlier step's result), "dtype":
its result's dtype}; the last step's result is the op's output, every step's result has its shape.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from megaloop.dtypes import as_dtype, round_to
from megaloop.errors import GraphBuildError
from megaloop.frontend.opdef import REGISTRY, Accuracy, Lowering, OpCall, OpDef, OutSpec, register
from megaloop.frontend.ops import _placements, _tilings
from megaloop.frontend.ops._build import apply
from megaloop.frontend.shapes import broadcast_shapes
from megaloop.frontend.tensor import Tensor

MAX_INPUTS = 8  # (the emitted lambda names its operands a .. h)


def _infer(call: OpCall) -> list[OutSpec]:
    steps = call.attrs["steps"]
    n = len(call.operands)
    if not steps or n > MAX_INPUTS:
        raise call.error(GraphBuildError, f"needs 1 or more steps and at most {MAX_INPUTS} operands, got "
                                          f"{len(steps)} and {n}")  # fmt: skip
    shape = broadcast_shapes(*[call.shape(i) for i in range(n)]) if n else ()
    for k, step in enumerate(steps):
        opdef = REGISTRY.get(step["op"])
        if opdef is None or opdef.lowering is None or opdef.lowering.template != "elementwise":
            raise call.error(GraphBuildError, f"step {k}: {step['op']!r} is not an elementwise op")
        for kind, i in step["args"]:
            if not (kind == "in" and 0 <= i < n) and not (kind == "step" and 0 <= i < k):
                raise call.error(GraphBuildError, f"step {k}: operand {[kind, i]} names no operand or earlier step")
    return [OutSpec(tuple(shape), as_dtype(steps[-1]["dtype"]))]


def _reference(arrays: list[np.ndarray], attrs: dict[str, Any]) -> np.ndarray:
    """Each step's reference on its operands, rounded to its dtype as the evaluator stores it."""
    shape = np.broadcast_shapes(*[a.shape for a in arrays]) if arrays else ()
    values: list[np.ndarray] = []
    for step in attrs["steps"]:
        operands = [arrays[i] if kind == "in" else values[i] for kind, i in step["args"]]
        out = round_to(np.asarray(REGISTRY[step["op"]].reference(operands, step["attrs"])), as_dtype(step["dtype"]))
        values.append(out)
    return np.broadcast_to(values[-1], shape).copy() if values[-1].shape != shape else values[-1]


FUSED_ELEMENTWISE = register(
    OpDef(
        name="fused_elementwise",
        kind="compute",
        category="elementwise",
        doc="Elementwise ops as one: each element computed by the steps in turn, intermediates rounded to their "
        "dtypes (the plain ops' values bit for bit). Made by the fuse stage.",
        operands=("*operands",),
        attrs={"steps": "steps"},
        infer=_infer,
        reference=_reference,
        accuracy=Accuracy(ulps=0.0),
        tiling=_tilings.ELEMENTWISE,
        lowering=Lowering("fused_elementwise"),
        placement=_placements.rule(_placements.elementwise_dims),
    )
)


def fused_elementwise(operands: list[Tensor], steps: list[dict[str, Any]]) -> Tensor:
    """The steps (module docstring) over ``operands``, as one op."""
    return apply(FUSED_ELEMENTWISE, list(operands), steps=steps)

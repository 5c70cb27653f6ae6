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
from megaloop.errors import DtypeError, GraphBuildError, MegaloopError, ShapeError
from megaloop.frontend.graph import Graph
from megaloop.frontend.opdef import REGISTRY, Accuracy, Lowering, OpCall, OpDef, OutSpec, register
from megaloop.frontend.ops import _placements, _tilings
from megaloop.frontend.ops._build import apply
from megaloop.frontend.shapes import broadcast_shapes
from megaloop.frontend.tensor import Tensor

MAX_INPUTS = 8  # (the emitted lambda names its operands a .. h)


def _infer(call: OpCall) -> list[OutSpec]:
    """Each step's own shape and dtype rules (the step built on a scratch graph of the operands' kinds),
    its result's dtype as the step says, the last one spanning the operands' broadcast shape."""
    steps = call.attrs["steps"]
    n = len(call.operands)
    if not steps or n > MAX_INPUTS:
        raise call.error(GraphBuildError, f"needs 1 or more steps and at most {MAX_INPUTS} operands, got "
                                          f"{len(steps)} and {n}")  # fmt: skip
    scratch = Graph("fused_elementwise-steps")
    values = [scratch.input(f"in{i}", call.shape(i), t.dtype) for i, t in enumerate(call.operands)]
    made: list[Tensor] = []
    for k, step in enumerate(steps):
        opdef = REGISTRY.get(step["op"])
        if opdef is None or opdef.lowering is None or opdef.lowering.template != "elementwise":
            raise call.error(GraphBuildError, f"step {k}: {step['op']!r} is not an elementwise op")
        args = []
        for kind, i in step["args"]:
            if not (kind == "in" and 0 <= i < n) and not (kind == "step" and 0 <= i < k):
                raise call.error(GraphBuildError, f"step {k}: operand {[kind, i]} names no operand or earlier step")
            args.append(values[i] if kind == "in" else made[i])
        try:
            out = apply(opdef, args, **step["attrs"])
        except MegaloopError as e:
            raise call.error(type(e), f"step {k} ({step['op']}): {e}") from None
        if out.dtype.name != step["dtype"]:
            what = f"step {k} ({step['op']}) gives {out.dtype.name}, the step says {step['dtype']}"
            raise call.error(DtypeError, what)
        made.append(out)
    shape = tuple(broadcast_shapes(*[call.shape(i) for i in range(n)])) if n else ()
    if made[-1].shape != shape:
        raise call.error(ShapeError, f"the last step's result is {made[-1].shape}, the operands span {shape}")
    return [OutSpec(shape, made[-1].dtype)]


def _reference(arrays: list[np.ndarray], attrs: dict[str, Any]) -> np.ndarray:
    """Each step's reference on its operands, rounded to its dtype as the evaluator stores it."""
    values: list[np.ndarray] = []
    for step in attrs["steps"]:
        operands = [arrays[i] if kind == "in" else values[i] for kind, i in step["args"]]
        out = round_to(np.asarray(REGISTRY[step["op"]].reference(operands, step["attrs"])), as_dtype(step["dtype"]))
        values.append(out)
    return values[-1]  # (of the operands' broadcast shape: the shape rule checked it)


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
        accuracy=Accuracy(ulps=1.0),  # (its steps' roundings: the plain ops' values against float64)
        tiling=_tilings.ELEMENTWISE,
        lowering=Lowering("fused_elementwise"),
        placement=_placements.rule(_placements.elementwise_dims),
    )
)


def fused_elementwise(operands: list[Tensor], steps: list[dict[str, Any]]) -> Tensor:
    """The steps (module docstring) over ``operands``, as one op."""
    return apply(FUSED_ELEMENTWISE, list(operands), steps=steps)

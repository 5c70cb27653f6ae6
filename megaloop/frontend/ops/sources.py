"""Sources: the ops through which values enter a graph (built with Graph.input/parameter/...)."""

from __future__ import annotations

from megaloop.frontend.opdef import OpCall, OpDef, OutSpec, register


def _declared(call: OpCall) -> list[OutSpec]:
    return [OutSpec(tuple(call.attrs["shape"]), call.attrs["dtype"])]


def _source(name: str, doc: str, **extra: str) -> OpDef:
    # Sources have no reference function: the evaluator reads their values from the caller
    # (inputs, parameters, state) or from the node itself (constants, state init).
    return register(
        OpDef(
            name=name,
            kind="source",
            category="source",
            doc=doc,
            operands=(),
            attrs={"name": "name", "shape": "shape", "dtype": "dtype", **extra},
            infer=_declared,
            reference=None,
        )
    )


INPUT = _source("input", "A value handed in for every run (activations, token ids, positions).")
PARAMETER = _source("parameter", "A named weight, loaded once; its name is its checkpoint key.")
CONSTANT = _source("constant", "A value baked into the graph (attribute 'value').", value="array")
STATE = _source("state", "A buffer that persists between loop iterations (KV cache, last token).", init="array")

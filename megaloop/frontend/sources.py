"""Sources: the ops through which values enter a graph (built with Graph.input/parameter/...)."""

from __future__ import annotations

from typing import Any

from megaloop.frontend.opdef import OpCall, OpDef, OutSpec, register
from megaloop.frontend.placement import REPLICATE, Shard, Strategy, even_sizes


def _anywhere(node: Any, members: int, given: Any) -> list[Strategy]:
    """A source can be whole on every member or cut along any axis: the host (or the checkpoint) hands
    each member its piece; the partitioner picks the pieces its consumers want."""
    shape = node.outputs[0].shape
    found = [Strategy((), (REPLICATE,), "replicated")]
    for a, size in enumerate(shape):
        if size >= members:
            found.append(Strategy((), (Shard(a, even_sizes(size, members)),), f"axis {a}"))
    return found


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
            optional_attrs=frozenset({"init"}) & set(extra),
            infer=_declared,
            reference=None,
            placement=_anywhere,
        )
    )


INPUT = _source("input", "A value handed in for every run (activations, token ids, positions).")
PARAMETER = _source("parameter", "A named weight, loaded once; its name is its checkpoint key.")
CONSTANT = _source("constant", "A value baked into the graph (attribute 'value').", value="array")
STATE = _source("state", "A buffer that persists between loop iterations (KV cache, last token).", init="array")

"""A graph's structure in a form two graphs can be compared by: its ops in order with their scopes,
attributes, output shapes and which earlier values they read (sources by name), without node ids or
labels. The two operands of an add, and a norm's rows and residual, are listed as a set: their
order changes no value (a float add commutes) and no tile (each reads both whole)."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from typing import Any

import numpy as np

import megaloop as ml

# op -> the operand slots whose order does not matter (a norm's x and its residual, an add's operands)
SWAPPABLE = {"add": (0, 1), "rmsnorm": (0, 2), "rmsnorm_linear": (0, 3), "swiglu_linear": (0, 4)}


def _attr(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return {"array": list(value.shape), "sha": hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest()}
    if isinstance(value, ml.DType):
        return value.name
    if isinstance(value, tuple | list):
        return [_attr(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _attr(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, np.generic):
        return value.item()
    return value


def _swappable(node: Any) -> tuple[int, int] | None:
    slots = SWAPPABLE.get(node.op.name)
    if slots is None or "scalars" in node.attrs:
        return None
    if node.op.name == "rmsnorm":  # x, then weight and residual unless absent
        present = [s for s in (1, 2) if s not in node.attrs.get("absent", ())][: len(node.inputs) - 1]
        return (0, 1 + present.index(2)) if 2 in present else None
    return slots if len(node.inputs) > slots[1] else None


def signature(graph: ml.Graph) -> dict[str, Any]:
    """The graph's structure (module docstring), JSON-ready; a view nothing reads is left out (no work)."""
    ref: dict[Any, Any] = {}
    nodes = []
    read = {t for n in graph.nodes for t in n.inputs} | set(graph.outputs.values()) | set(graph.state_updates.values())
    for node in graph.topological_order():
        if node.op.kind == "view" and not read & set(node.outputs):
            continue
        if node.op.kind == "source":
            ref[node.outputs[0]] = f"{node.op.name}:{node.attrs['name']}"
            continue
        inputs = [ref[t] for t in node.inputs]
        slots = _swappable(node)
        if slots is not None:
            pair = sorted(json.dumps(inputs[s]) for s in slots)
            for s, text in zip(slots, pair):
                inputs[s] = json.loads(text)
        for i, t in enumerate(node.outputs):
            ref[t] = [len(nodes), i]
        attrs = {k: _attr(v) for k, v in sorted(node.attrs.items())}
        outs = [[t.dtype.name, list(t.shape)] for t in node.outputs]
        nodes.append({"op": node.op.name, "scope": node.scope, "in": inputs, "attrs": attrs, "out": outs})
    return {
        "nodes": nodes,
        "outputs": {k: ref[t] for k, t in sorted(graph.outputs.items())},
        "state_updates": {k: ref[t] for k, t in sorted(graph.state_updates.items())},
    }


def op_counts(graph: ml.Graph) -> dict[str, int]:
    """How many nodes of each op the graph has (sources and views nothing reads left out)."""
    read = {t for n in graph.nodes for t in n.inputs} | set(graph.outputs.values()) | set(graph.state_updates.values())
    kept = [n for n in graph.nodes if n.op.kind != "source" and (n.op.kind != "view" or read & set(n.outputs))]
    return dict(sorted(Counter(n.op.name for n in kept).items()))


def digest(sig: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(sig, sort_keys=True).encode()).hexdigest()


def first_difference(a: dict[str, Any], b: dict[str, Any]) -> str:
    """Where two signatures first differ, in words (for an assertion message)."""
    for i, (x, y) in enumerate(zip(a["nodes"], b["nodes"])):
        if x != y:
            return f"node {i}: {json.dumps(x)}\n  against {json.dumps(y)}"
    if len(a["nodes"]) != len(b["nodes"]):
        return f"{len(a['nodes'])} against {len(b['nodes'])} nodes"
    for key in ("outputs", "state_updates"):
        if a[key] != b[key]:
            return f"{key}: {a[key]} against {b[key]}"
    return "no difference"

"""Graphs as JSON-ready dicts and back (plan files embed the graph they were planned from).

Loading re-applies every op through ``Graph.apply``, so a loaded graph passes the same shape rules as
one built by hand and cannot smuggle in an inconsistent node.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from megaloop.dtypes import DType, as_dtype, bfloat16
from megaloop.errors import GraphBuildError
from megaloop.frontend.graph import Graph
from megaloop.frontend.opdef import REGISTRY
from megaloop.frontend.tensor import Tensor


def encode(value: Any) -> Any:
    """An attribute value as JSON data; tagged dicts keep types JSON lacks (tuples, dtypes, arrays)."""
    if isinstance(value, DType):
        return {"dtype": value.name}
    if isinstance(value, np.ndarray):
        dt = as_dtype(value.dtype)
        data = value.astype(np.float32) if value.dtype == bfloat16.np else value
        return {"array": data.tolist(), "dtype": dt.name, "shape": list(value.shape)}
    if isinstance(value, tuple):
        return {"tuple": [encode(v) for v in value]}
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        return {"dict": [[encode(k), encode(v)] for k, v in value.items()]}
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise GraphBuildError(f"cannot serialise attribute value {value!r} of type {type(value).__name__}")


def decode(data: Any) -> Any:
    if isinstance(data, list):
        return [decode(v) for v in data]
    if not isinstance(data, dict):
        return data
    if "dtype" in data and "array" not in data:
        return as_dtype(data["dtype"])
    if "array" in data:
        dt = as_dtype(data["dtype"])
        arr = np.array(data["array"], dtype=np.float32 if dt == bfloat16 else dt.np).reshape(data["shape"])
        arr = arr.astype(dt.np)
        arr.setflags(write=False)
        return arr
    if "tuple" in data:
        return tuple(decode(v) for v in data["tuple"])
    if "dict" in data:
        return {decode(k): decode(v) for k, v in data["dict"]}
    raise GraphBuildError(f"unrecognised attribute encoding {data!r:.80}")


def graph_to_dict(graph: Graph) -> dict[str, Any]:
    graph.validate()
    order = graph.topological_order()
    ref = {t: [n.id, t.index] for n in order for t in n.outputs}
    return {
        "name": graph.name,
        "rank": graph.rank,
        "world_size": graph.world_size,
        "nodes": [
            {
                "id": n.id,
                "op": n.op.name,
                "scope": n.scope,
                "label": n.label,
                "inputs": [ref[t] for t in n.inputs],
                "attrs": {k: encode(v) for k, v in n.attrs.items()},
            }
            for n in order
        ],
        "outputs": {name: ref[t] for name, t in graph.outputs.items()},
        "state_updates": {name: ref[t] for name, t in graph.state_updates.items()},
    }


def graph_from_dict(data: dict[str, Any]) -> Graph:
    graph = Graph(data["name"], rank=data["rank"], world_size=data["world_size"])
    tensors: dict[tuple[int, int], Tensor] = {}
    tables = {"input": graph.inputs, "parameter": graph.parameters, "state": graph.states}
    for entry in data["nodes"]:
        op = REGISTRY.get(entry["op"])
        if op is None:
            raise GraphBuildError(f"node {entry['id']}: unknown op {entry['op']!r}")
        operands = [tensors[(i, k)] for i, k in entry["inputs"]]
        attrs = {k: decode(v) for k, v in entry["attrs"].items()}
        outputs = graph.apply(op, operands, attrs)
        node = outputs[0].node if outputs else graph.nodes[-1]
        node.scope, node.label = entry["scope"], entry["label"]
        for k, t in enumerate(outputs):
            tensors[(entry["id"], k)] = t
        if op.name in tables:
            tables[op.name][attrs["name"]] = outputs[0]
        elif op.name == "constant":
            graph.constants.append(outputs[0])
    for name, (i, k) in data["outputs"].items():
        graph.output(name, tensors[(i, k)])
    for name, (i, k) in data["state_updates"].items():
        graph.state_updates[name] = tensors[(i, k)]
    return graph.validate()

"""Graphs as JSON-ready dicts and back (plan files embed the graph they were planned from).

Loading re-applies every op through ``Graph.apply``, so a loaded graph passes the same shape rules as
one built by hand and cannot smuggle in an inconsistent node.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from megaloop.dtypes import DType, as_dtype, bfloat16
from megaloop.errors import GraphBuildError, MegaloopError
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


def decode(data: Any, where: str = "attrs") -> Any:
    """An attribute value from its JSON form; GraphBuildError naming ``where`` for anything else."""
    if isinstance(data, list):
        return [decode(v, f"{where}[{i}]") for i, v in enumerate(data)]
    if not isinstance(data, dict):
        if data is None or isinstance(data, (bool, int, float, str)):
            return data
        raise GraphBuildError(f"{where}: {type(data).__name__} is not an attribute value")
    keys = set(data)
    if keys == {"dtype"}:
        return _dtype(data["dtype"], f"{where}.dtype")
    if keys == {"array", "dtype", "shape"}:
        return _array(data, where)
    if keys == {"tuple"} and isinstance(data["tuple"], list):
        return tuple(decode(v, f"{where}.tuple[{i}]") for i, v in enumerate(data["tuple"]))
    if keys == {"dict"} and isinstance(data["dict"], list):
        out = {}
        for i, pair in enumerate(data["dict"]):
            if not (isinstance(pair, list) and len(pair) == 2):
                raise GraphBuildError(f"{where}.dict[{i}]: expected a [key, value] pair, got {pair!r:.60}")
            key = decode(pair[0], f"{where}.dict[{i}][0]")
            if isinstance(key, (list, dict, np.ndarray)):
                raise GraphBuildError(f"{where}.dict[{i}][0]: a key must be a number, string or tuple, got {key!r:.60}")
            out[key] = decode(pair[1], f"{where}.dict[{i}][1]")
        return out
    raise GraphBuildError(f"{where}: unrecognised attribute encoding {data!r:.80}")


def _dtype(name: Any, where: str) -> DType:
    if not isinstance(name, str):
        raise GraphBuildError(f"{where}: expected a dtype name, got {type(name).__name__} {name!r:.40}")
    try:
        return as_dtype(name)
    except MegaloopError as e:
        raise GraphBuildError(f"{where}: {e}") from None


def _array(data: dict[str, Any], where: str) -> np.ndarray:
    dt = _dtype(data["dtype"], f"{where}.dtype")
    shape = data["shape"]
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise GraphBuildError(f"{where}.shape: expected a list of ints >= 0, got {shape!r:.60}")
    try:
        raw = np.array(data["array"])
    except (ValueError, TypeError, OverflowError, RecursionError) as e:
        raise GraphBuildError(f"{where}.array: not a rectangular array of numbers ({e})") from None
    kinds = "b" if dt.is_bool else "biuf" if dt.is_float else "biu"
    if raw.size and raw.dtype.kind not in kinds:
        raise GraphBuildError(f"{where}.array: {raw.dtype} values cannot be {dt.name} values")
    if raw.size != math.prod(shape):
        raise GraphBuildError(f"{where}.array: {raw.size} values for shape {shape}")
    if dt.is_int and raw.size and (raw.min() < np.iinfo(dt.np).min or raw.max() > np.iinfo(dt.np).max):
        raise GraphBuildError(f"{where}.array: values do not fit {dt.name}")
    with np.errstate(over="ignore", invalid="ignore"):
        arr = raw.astype(np.float32 if dt == bfloat16 else dt.np).reshape(shape).astype(dt.np)
    arr.setflags(write=False)
    return arr


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


def graph_from_dict(data: Any) -> Graph:
    """The graph ``graph_to_dict`` wrote; every field is checked and each node passes its op's attribute
    kinds and shape rules again (GraphBuildError naming the field: ``nodes[3].attrs.causal: ...``)."""
    if not isinstance(data, dict):
        raise GraphBuildError(f"expected an object, got {type(data).__name__}")
    for key, kind in (("name", str), ("rank", int), ("world_size", int), ("nodes", list)):
        _field(data, key, kind, key)
    graph = Graph(data["name"], rank=data["rank"], world_size=data["world_size"])
    tensors: dict[tuple[int, int], Tensor] = {}
    ids: set[int] = set()
    for i, entry in enumerate(data["nodes"]):
        _add_node(graph, entry, f"nodes[{i}]", tensors, ids)
    for key in ("outputs", "state_updates"):
        for name, ref in _field(data, key, dict, key).items():
            t = _tensor(ref, tensors, f"{key}.{name}")
            if key == "outputs":
                graph.output(name, t)
            elif name not in graph.states:
                raise GraphBuildError(f"state_updates.{name}: the graph has no state {name!r}")
            else:
                graph.assign(graph.states[name], t)
    return graph.validate()


def _field(obj: dict[str, Any], key: str, kind: type, where: str) -> Any:
    if key not in obj:
        raise GraphBuildError(f"{where}: missing")
    value = obj[key]
    if (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind):
        raise GraphBuildError(f"{where}: expected {kind.__name__}, got {type(value).__name__} {value!r:.60}")
    return value


def _tensor(ref: Any, tensors: dict[tuple[int, int], Tensor], where: str) -> Tensor:
    if not (isinstance(ref, list) and len(ref) == 2 and all(isinstance(v, int) for v in ref)):
        raise GraphBuildError(f"{where}: expected [node id, output index], got {ref!r:.60}")
    t = tensors.get((ref[0], ref[1]))
    if t is None:
        raise GraphBuildError(f"{where}: no earlier node {ref[0]} with an output {ref[1]}")
    return t


def _add_node(graph: Graph, entry: Any, where: str, tensors: dict[tuple[int, int], Tensor], ids: set[int]) -> None:
    if not isinstance(entry, dict):
        raise GraphBuildError(f"{where}: expected an object, got {type(entry).__name__}")
    node_id = _field(entry, "id", int, f"{where}.id")
    op = REGISTRY.get(_field(entry, "op", str, f"{where}.op"))
    if op is None:
        raise GraphBuildError(f"{where}.op: unknown op {entry['op']!r}")
    scope, label = _field(entry, "scope", str, f"{where}.scope"), _field(entry, "label", str, f"{where}.label")
    inputs = _field(entry, "inputs", list, f"{where}.inputs")
    operands = [_tensor(ref, tensors, f"{where}.inputs[{k}]") for k, ref in enumerate(inputs)]
    raw = _field(entry, "attrs", dict, f"{where}.attrs")
    attrs = {k: decode(v, f"{where}.attrs.{k}") for k, v in raw.items()}
    problem = op.attr_problem(attrs)
    if problem is not None:
        raise GraphBuildError(f"{where}.attrs.{problem}")
    what = f"{where} ({op.name} {label!r})"
    if op.kind == "source":
        _check_source(graph, op.name, attrs, what)
    if node_id in ids:
        raise GraphBuildError(f"{where}.id: node id {node_id} is used twice")
    ids.add(node_id)
    try:
        outputs = graph.apply(op, operands, attrs)
    except MegaloopError as e:
        raise GraphBuildError(f"{what}: {e}") from None
    except Exception as e:  # a shape rule tripped by values its builder would have refused
        raise GraphBuildError(f"{what}: its attributes do not fit the op ({type(e).__name__}: {e})") from e
    node = outputs[0].node if outputs else graph.nodes[-1]
    node.scope, node.label = scope, label or node.label
    for k, t in enumerate(outputs):
        tensors[(node_id, k)] = t
    tables = {"input": graph.inputs, "parameter": graph.parameters, "state": graph.states}
    if op.name in tables:
        tables[op.name][attrs["name"]] = outputs[0]
    elif op.name == "constant":
        graph.constants.append(outputs[0])


def _check_source(graph: Graph, kind: str, attrs: dict[str, Any], what: str) -> None:
    for key in ("name", "shape", "dtype"):
        if key not in attrs:
            raise GraphBuildError(f"{what}: attribute {key!r} missing")
    tables = {"input": graph.inputs, "parameter": graph.parameters, "state": graph.states}
    if kind in tables and attrs["name"] in tables[kind]:
        raise GraphBuildError(f"{what}: a second {kind} named {attrs['name']!r}")
    value = attrs.get("value" if kind == "constant" else "init")
    if kind == "constant" and value is None:
        raise GraphBuildError(f"{what}: attribute 'value' missing")
    if value is not None and (value.shape != attrs["shape"] or value.dtype != attrs["dtype"].np):
        raise GraphBuildError(
            f"{what}: its value is {value.dtype}{list(value.shape)}, but it is declared "
            f"{attrs['dtype'].name}{list(attrs['shape'])}"
        )

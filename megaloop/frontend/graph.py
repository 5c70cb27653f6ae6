"""``Graph``: an explicit builder for one rank's program (no hidden global model).

A graph is a list of nodes in a topological order. Values enter through four kinds of source:

- ``input``: data handed in for each run (activations, token ids, positions);
- ``parameter``: named weights, loaded once (the names match checkpoint keys);
- ``constant``: values baked into the graph;
- ``state``: buffers that persist between loop iterations (KV caches, the last token); ``assign``
  says which value a state holds at the start of the next iteration.

and leave through named ``output``\\ s. A graph knows its ``rank`` and ``world_size`` so that
collectives can be checked when they are built.
"""

from __future__ import annotations

import contextlib
import heapq
import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from megaloop.dtypes import DType, as_dtype, bfloat16, round_to, to_numpy
from megaloop.errors import (
    CycleError,
    DtypeError,
    GraphBuildError,
    MegaloopError,
    NonFiniteError,
    RankError,
    ShapeError,
)
from megaloop.frontend import sources
from megaloop.frontend.opdef import OpCall, OpDef, OutSpec, attrs_repr
from megaloop.frontend.shapes import Shape, format_shape
from megaloop.frontend.tensor import Tensor
from megaloop.frontend.validate import as_shape


class Node:
    """One op application: ``outputs = op(*inputs, **attrs)``."""

    __slots__ = ("attrs", "graph", "id", "inputs", "label", "op", "outputs", "scope")

    def __init__(
        self,
        graph: Graph,
        id: int,
        op: OpDef,
        inputs: tuple[Tensor, ...],
        attrs: dict[str, Any],
        scope: str,
        label: str,
    ) -> None:
        self.graph = graph
        self.id = id
        self.op = op
        self.inputs = inputs
        self.attrs = attrs
        self.scope = scope
        self.label = label
        self.outputs: tuple[Tensor, ...] = ()

    @property
    def name(self) -> str:
        """Scope-qualified name, e.g. ``layers.0.attn.matmul_12`` or an input's own name."""
        return f"{self.scope}.{self.label}" if self.scope else self.label

    def __repr__(self) -> str:
        return f"Node(%{self.id} {self.op.name} {self.name!r})"


def _check_shape(shape: Any, what: str, dtype: DType | None = None) -> Shape:
    return as_shape(shape, what, itemsize=None if dtype is None else dtype.itemsize)


def _check_name(name: Any, what: str) -> str:
    if not isinstance(name, str) or not name or any(c.isspace() for c in name):
        raise GraphBuildError(f"{what}: name must be a non-empty string without spaces, got {name!r}")
    return name


def _as_array(value: Any, what: str) -> np.ndarray:
    try:
        return to_numpy(value)
    except ValueError as e:  # ragged nested lists
        raise ShapeError(f"{what}: value is not a rectangular array ({e})") from None


def _constant_array(
    value: Any, dtype: DType, what: str, allow_nonfinite: bool, shape: Shape | None, hint: str
) -> np.ndarray:
    """``value`` checked (shape, finiteness, range) and rounded to ``dtype``, read-only."""
    arr = _as_array(value, what)
    if shape is not None and arr.shape != shape:
        raise ShapeError(f"{what}: value has shape {format_shape(arr.shape)}, expected {format_shape(shape)}")
    kind = "f" if arr.dtype == bfloat16.np else arr.dtype.kind
    if kind not in "biuf":
        raise DtypeError(f"{what}: values of numpy dtype {arr.dtype} cannot become a {dtype.name} tensor")
    if kind == "f" and not allow_nonfinite and not np.all(np.isfinite(arr.astype(np.float64))):
        bad = np.argwhere(~np.isfinite(arr.astype(np.float64)))[0]
        raise NonFiniteError(
            f"{what}: holds a non-finite value {arr[tuple(bad)]} at index {tuple(int(i) for i in bad)}{hint}"
        )
    if dtype.is_int:
        if kind == "f":
            raise DtypeError(f"{what}: float values cannot be stored as {dtype.name}; round them first")
        info = np.iinfo(dtype.np)
        if arr.size and (arr.min() < info.min or arr.max() > info.max):
            raise DtypeError(f"{what}: values {arr.min()}..{arr.max()} do not fit in {dtype.name}")
    if dtype.is_bool and kind != "b":
        raise DtypeError(f"{what}: {arr.dtype} values cannot become a bool tensor; compare them first")
    with np.errstate(over="ignore"):
        out = round_to(arr, dtype) if dtype.is_float else arr.astype(dtype.np)
    if dtype.is_float and not allow_nonfinite and not np.all(np.isfinite(out.astype(np.float32))):
        raise NonFiniteError(f"{what}: values overflow {dtype.name} (largest magnitude {np.max(np.abs(arr))})")
    out = np.array(out, copy=True)
    out.setflags(write=False)
    return out


class Graph:
    def __init__(self, name: str = "graph", *, rank: int = 0, world_size: int = 1) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise RankError(f"Graph {name!r}: world_size must be an int >= 1, got {world_size!r}")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise RankError(
                f"Graph {name!r}: rank {rank!r} is unknown in a world of {world_size} rank(s) "
                f"(valid ranks: 0..{world_size - 1})"
            )
        self.name = name
        self.rank = rank
        self.world_size = world_size
        self.nodes: list[Node] = []
        self.inputs: dict[str, Tensor] = {}
        self.parameters: dict[str, Tensor] = {}
        self.constants: list[Tensor] = []
        self.states: dict[str, Tensor] = {}
        self.state_updates: dict[str, Tensor] = {}  # state name -> value it takes for the next iteration
        self.outputs: dict[str, Tensor] = {}
        self._scope: list[str] = []

    # ---- building --------------------------------------------------------------------------------
    def apply(self, op: OpDef, operands: Sequence[Tensor], attrs: dict[str, Any]) -> tuple[Tensor, ...]:
        """Add a node; its shape rule runs now, so a bad call fails here, naming the op."""
        scope = "" if op.kind == "source" else ".".join(self._scope)  # a source keeps its given name
        for i, t in enumerate(operands):
            if t.graph is not self:
                same = " (another Graph object of the same name)" if t.graph.name == self.name else ""
                raise GraphBuildError(
                    f"{op.name}: operand {op.operand_name(i)} ({t!r}) belongs to graph {t.graph.name!r} "
                    f"(rank {t.graph.rank}){same}, not to {self.name!r} (rank {self.rank}); "
                    "tensors cannot cross graphs: use send/recv or a collective"
                )
        call = OpCall(op, operands, attrs, scope, self)
        specs = list(op.infer(call))
        node = Node(self, len(self.nodes), op, tuple(operands), attrs, scope, "")
        node.label = attrs["name"] if op.kind == "source" and "name" in attrs else f"{op.name}_{node.id}"
        node.outputs = tuple(self._make_tensor(node, i, spec, call) for i, spec in enumerate(specs))
        self.nodes.append(node)
        return node.outputs

    def _make_tensor(self, node: Node, index: int, spec: OutSpec, call: OpCall) -> Tensor:
        _check_shape(spec.shape, f"{node.op.name} output {index}", spec.dtype)
        if spec.view is None:
            return Tensor(self, node, index, spec.shape, spec.dtype)
        owner = call.operands[0].base
        return Tensor(
            self, node, index, spec.shape, spec.dtype, base=owner, strides=spec.view.strides, offset=spec.view.offset
        )

    def input(self, name: str, shape: Sequence[int], dtype: Any) -> Tensor:
        """A value handed in for every run, e.g. activations or token ids."""
        return self._source(sources.INPUT, self.inputs, name, shape, dtype)

    def parameter(self, name: str, shape: Sequence[int], dtype: Any) -> Tensor:
        """A named weight; ``name`` is the key it is loaded under (e.g. a checkpoint key)."""
        return self._source(sources.PARAMETER, self.parameters, name, shape, dtype)

    def state(self, name: str, shape: Sequence[int], dtype: Any, init: Any = None) -> Tensor:
        """A buffer that persists between iterations (zeros at first unless ``init`` is given).
        Give its next value with ``assign`` or an in-place op such as ``kv_cache_update``."""
        attrs = {}
        if init is not None:  # checked before the state exists, so a bad init leaves no trace
            dims = _check_shape(shape, f"state {name!r}", as_dtype(dtype))
            attrs["init"] = _constant_array(init, as_dtype(dtype), f"state {name!r} init", False, dims, "")
        return self._source(sources.STATE, self.states, name, shape, dtype, attrs)

    def constant(
        self, value: Any, dtype: Any = None, *, name: str | None = None, allow_nonfinite: bool = False
    ) -> Tensor:
        """A value baked into the graph. NaN/inf are refused unless ``allow_nonfinite=True``."""
        if dtype is None:
            arr = _as_array(value, "constant")
            if arr.dtype.kind not in "biuf" and arr.dtype != bfloat16.np:
                raise DtypeError(f"constant: values of numpy dtype {arr.dtype} cannot become a megaloop tensor")
            if arr.dtype == np.float64:
                dtype = "float32"  # like torch, Python floats and float64 arrays become float32
            else:
                dtype = arr.dtype
        dt = as_dtype(dtype)
        label = name or f"const_{len(self.nodes)}"
        arr = _constant_array(
            value,
            dt,
            f"constant {label!r}",
            allow_nonfinite,
            None,
            "; pass allow_nonfinite=True if that is intended (e.g. a -inf mask)",
        )
        _check_shape(arr.shape or (1,), f"constant {label!r}")
        (t,) = self.apply(sources.CONSTANT, [], {"name": label, "shape": arr.shape, "dtype": dt, "value": arr})
        self.constants.append(t)
        return t

    def _source(
        self,
        op: OpDef,
        table: dict[str, Tensor],
        name: str,
        shape: Sequence[int],
        dtype: Any,
        extra: dict[str, Any] | None = None,
    ) -> Tensor:
        what = f"{op.name} {name!r}"
        _check_name(name, op.name)
        dt = as_dtype(dtype)
        shape = _check_shape(shape, what, dt)
        if name in table:
            raise GraphBuildError(f"{what}: the name is already used by another {op.name} of graph {self.name!r}")
        (t,) = self.apply(op, [], {"name": name, "shape": shape, "dtype": dt, **(extra or {})})
        table[name] = t
        return t

    def assign(self, state: Tensor, value: Tensor) -> None:
        """Make ``value`` the content of ``state`` at the start of the next iteration."""
        if not isinstance(state, Tensor) or state.graph is not self or state.node.op is not sources.STATE:
            raise GraphBuildError(
                f"assign: target {state!r} is not a state of graph {self.name!r}; "
                "declare it with graph.state(name, shape, dtype)"
            )
        name = state.node.attrs["name"]
        if not isinstance(value, Tensor) or value.graph is not self:
            raise GraphBuildError(f"assign to state {name!r}: value must be a Tensor of graph {self.name!r}")
        if value.shape != state.shape or value.dtype != state.dtype:
            raise (DtypeError if value.shape == state.shape else ShapeError)(
                f"assign to state {name!r}: value is {value.dtype.short}{format_shape(value.shape)} but the state "
                f"is {state.dtype.short}{format_shape(state.shape)}; reshape or cast the value first"
            )
        if name in self.state_updates:
            raise GraphBuildError(
                f"assign to state {name!r}: it already receives {self.state_updates[name]!r} this iteration; "
                "a state takes one new value per iteration"
            )
        self.state_updates[name] = value

    def output(self, name: str, tensor: Tensor) -> Tensor:
        """Name a tensor as a result of the graph."""
        _check_name(name, "output")
        if not isinstance(tensor, Tensor) or tensor.graph is not self:
            raise GraphBuildError(f"output {name!r}: {tensor!r} is not a Tensor of graph {self.name!r}")
        if name in self.outputs:
            raise GraphBuildError(f"output {name!r}: the name is already used by {self.outputs[name]!r}")
        self.outputs[name] = tensor
        return tensor

    @contextlib.contextmanager
    def scope(self, name: str) -> Iterator[None]:
        """Prefix the names of nodes built inside, e.g. ``with g.scope("layers.0.attn"):``."""
        self._scope.append(_check_name(name, "scope"))
        try:
            yield
        finally:
            self._scope.pop()

    # ---- looking at the graph -----------------------------------------------------------------
    def users(self) -> dict[Tensor, list[Node]]:
        out: dict[Tensor, list[Node]] = {}
        for node in self.nodes:
            for t in node.inputs:
                out.setdefault(t, []).append(node)
        return out

    def topological_order(self) -> list[Node]:
        """Nodes so that each comes after the producers of its inputs (creation order where that
        already holds); CycleError naming the loop if there is none."""
        order = _kahn_by_id(self.nodes)
        if len(order) != len(self.nodes):
            done = set(order)
            stuck = [n for n in self.nodes if n not in done]
            raise CycleError(f"graph {self.name!r} has a cycle: {_cycle_text(stuck)}")
        return order

    def replace_uses(self, old: Tensor, new: Tensor) -> None:
        """Make every user of ``old`` (nodes, outputs, state updates) use ``new`` instead.

        ``new`` must have the same shape and dtype. Every node is checked again by its op's rules (a
        view of ``new`` gets new strides); if anything fails (a cycle, a rule), the graph is left exactly
        as it was and the error is raised."""
        if old.graph is not self or new.graph is not self:
            raise GraphBuildError("replace_uses: both tensors must belong to this graph")
        if old.shape != new.shape:
            raise ShapeError(f"replace_uses: {new!r} cannot stand in for {old!r}: shapes differ")
        if old.dtype != new.dtype:
            raise DtypeError(f"replace_uses: {new!r} cannot stand in for {old!r}: dtypes differ")
        saved_nodes = list(self.nodes)
        saved = [(n, n.id, n.inputs, dict(n.attrs)) for n in self.nodes]
        layouts = [(t, t._base, t.strides, t.offset) for n in self.nodes for t in n.outputs]
        tables = (dict(self.outputs), dict(self.state_updates))
        try:
            for n in self.nodes:
                if any(t is old for t in n.inputs):
                    n.inputs = tuple(new if t is old else t for t in n.inputs)
            self.nodes = self.topological_order()
            for i, n in enumerate(self.nodes):  # ids follow the new order
                n.id = i
            for table in (self.outputs, self.state_updates):
                for k, v in table.items():
                    if v is old:
                        table[k] = new
            for n in self.nodes:
                self._reinfer(n)
        except MegaloopError:
            self.nodes = saved_nodes
            for n, nid, inputs, attrs in saved:
                n.id, n.inputs, n.attrs = nid, inputs, attrs
            for t, base, strides, offset in layouts:
                t._base, t.strides, t.offset = base, strides, offset
            self.outputs, self.state_updates = tables
            raise

    def reorder(self, nodes: Sequence[Node]) -> None:
        """Make ``nodes`` the graph's nodes, in that order: after a rewrite (megaloop.fuse) rewired some
        operands and left some nodes out. Each node must come after the producers of its operands and
        every output and state's next value be among them; ids follow the order, every node is checked
        again by its op's rules (a view takes its operand's new layout). On an error nothing changes."""
        position = {n: i for i, n in enumerate(nodes)}
        for i, n in enumerate(nodes):
            if n.graph is not self:
                raise GraphBuildError(f"reorder: {n!r} is not a node of graph {self.name!r}")
            late = [t for t in n.inputs if position.get(t.node, i) >= i]
            if late:
                raise GraphBuildError(f"reorder: {n.op.name} {n.name} reads {late[0]!r}, which is not made before it")
        for what, table in (("output", self.outputs), ("state", self.state_updates)):
            for name, t in table.items():
                if t.node not in position:
                    raise GraphBuildError(f"reorder: {what} {name!r} is {t!r}, whose node is left out")
        saved = (list(self.nodes), [n.id for n in nodes])
        layouts = [(t, t._base, t.strides, t.offset) for n in nodes for t in n.outputs]
        try:
            self.nodes = list(nodes)
            for i, n in enumerate(self.nodes):
                n.id = i
            for n in self.nodes:
                self._reinfer(n)
        except MegaloopError:
            self.nodes = saved[0]
            for n, nid in zip(nodes, saved[1]):
                n.id = nid
            for t, base, strides, offset in layouts:
                t._base, t.strides, t.offset = base, strides, offset
            raise

    def _reinfer(self, n: Node) -> None:
        """Run a node's shape rule again on its (possibly rewired) operands and update view layouts."""
        call = OpCall(n.op, n.inputs, n.attrs, n.scope, self)
        specs = list(n.op.infer(call))
        for t, spec in zip(n.outputs, specs, strict=True):
            if spec.shape != t.shape or spec.dtype != t.dtype:
                raise ShapeError(
                    f"{n.op.name} {n.name}: after rewiring its output would be "
                    f"{spec.dtype.short}{format_shape(spec.shape)} instead of {t.dtype.short}"
                    f"{format_shape(t.shape)}"
                )
            if spec.view is not None:
                t._base, t.strides, t.offset = call.operands[0].base, spec.view.strides, spec.view.offset

    def validate(self) -> Graph:
        """Check the graph's invariants (acyclic, consistent operands, state updates); returns self."""
        self.topological_order()
        for n in self.nodes:
            for i, t in enumerate(n.inputs):
                if t.graph is not self:
                    raise GraphBuildError(f"{n.op.name} {n.name}: operand {n.op.operand_name(i)} is from another graph")
        for name, value in self.state_updates.items():
            state = self.states[name]
            if value.shape != state.shape or value.dtype != state.dtype:
                raise ShapeError(f"state {name!r}: update {value!r} does not match the state's shape/dtype")
        return self

    def parameter_bytes(self) -> int:
        return sum(t.nbytes for t in self.parameters.values())

    def summary(self) -> str:
        """A readable table of the graph, one line per node."""
        head = (
            f"Graph {self.name!r} (rank {self.rank} of {self.world_size}): {len(self.nodes)} nodes, "
            f"{len(self.inputs)} inputs, {len(self.parameters)} parameters "
            f"({_human_bytes(self.parameter_bytes())}), {len(self.states)} states, {len(self.outputs)} outputs"
        )
        lines = [head]
        width = max([len(n.name) for n in self.nodes] + [4])
        for n in self.nodes:
            out = ", ".join(f"{t.dtype.short}{format_shape(t.shape)}" for t in n.outputs) or "-"
            args = ", ".join(t.ref for t in n.inputs)
            attrs = {k: v for k, v in n.attrs.items() if k not in ("name", "shape", "dtype")}
            text = f"  %{n.id:<4} {n.op.name:<16} {n.name:<{width}}  {out:<20}"
            if args:
                text += f" <- {args}"
            if attrs:
                text += f"  {attrs_repr(attrs)}"
            if n.outputs and n.outputs[0].is_view:
                text += "  (view)"
            lines.append(text.rstrip())
        for name, t in self.state_updates.items():
            lines.append(f"  state {name} <- {t.ref}")
        for name, t in self.outputs.items():
            lines.append(f"  output {name} = {t.ref}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"Graph({self.name!r}, rank={self.rank}, world_size={self.world_size}, nodes={len(self.nodes)})"

    def __str__(self) -> str:
        return self.summary()


def require_results(graphs: Sequence[Graph], who: str) -> None:
    """Refuse a program whose ranks name no output and update no state: it would run and give nothing."""
    if any(g.outputs or g.state_updates for g in graphs):
        return
    names = ", ".join(repr(g.name) for g in graphs[:4])
    raise GraphBuildError(
        f"{who}: graph {names} has no outputs and updates no state, so it would compute nothing anyone can "
        "read; name its results with graph.output(name, tensor) (or give a state its next value with "
        "graph.assign)"
    )


def _kahn_by_id(nodes: list[Node]) -> list[Node]:
    """Kahn's algorithm, always taking the ready node created first; stops early on a cycle."""
    indeg = {n: len({t.node for t in n.inputs}) for n in nodes}
    consumers: dict[Node, set[Node]] = {n: set() for n in nodes}
    for n in nodes:
        for t in n.inputs:
            consumers[t.node].add(n)
    heap = [(n.id, n) for n in nodes if indeg[n] == 0]
    heapq.heapify(heap)
    order = []
    while heap:
        _, n = heapq.heappop(heap)
        order.append(n)
        for c in consumers[n]:
            indeg[c] -= 1
            if indeg[c] == 0:
                heapq.heappush(heap, (c.id, c))
    return order


def _cycle_text(stuck: list[Node]) -> str:
    """Follow operand edges among the stuck nodes until one repeats, and print that loop."""
    stuck_set = set(stuck)
    node = stuck[0]
    path: list[Node] = []
    seen: dict[Node, int] = {}
    while node not in seen:
        seen[node] = len(path)
        path.append(node)
        node = next(t.node for t in node.inputs if t.node in stuck_set)
    loop = path[seen[node] :]
    return " <- ".join(f"{n.op.name} {n.name}" for n in [*loop, loop[0]])


def _human_bytes(n: int) -> str:
    if n == 0:
        return "0 B"
    k = min(int(math.log(n, 1024)), 4)
    return f"{n / 1024**k:.1f} {['B', 'KiB', 'MiB', 'GiB', 'TiB'][k]}"

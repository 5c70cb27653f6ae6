"""Graph-level numpy evaluation: the executable spec of every op, for one rank or N ranks at once.

Each node runs its op's numpy reference (float32 arithmetic for all float dtypes) and the result is
rounded once to the node's output dtype, exactly as the spec says. Views are checked as they are
made: the values a view op computes must equal what its declared strides and offset read from the
storage of its base tensor, so the layout the planner will rely on is tested on every run.

N ranks are simulated in one process by dataflow: any node whose operands are ready runs, a recv
runs once its send did, and a collective runs once every member of its group reached it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from megaloop.dtypes import round_to
from megaloop.errors import DataError, EvaluationError, InternalError
from megaloop.frontend.graph import Graph, Node, require_results
from megaloop.frontend.tensor import Tensor
from megaloop.frontend.values import coerce
from megaloop.parallel.ranks import RankMatching, match_ranks


@dataclass
class Evaluation:
    """What one rank computed: named outputs, the state for the next iteration, and (when asked for)
    the value of every tensor of the last iteration."""

    outputs: dict[str, np.ndarray]
    state: dict[str, np.ndarray]
    values: dict[Tensor, np.ndarray] = field(default_factory=dict)

    def __getitem__(self, name: str) -> np.ndarray:
        return self.outputs[name]


def _check_names(
    given: Mapping[str, Any], wanted: Mapping[str, Tensor], what: str, graph: Graph, required: bool
) -> None:
    missing = [n for n in wanted if n not in given]
    extra = [n for n in given if n not in wanted]
    where = f"graph {graph.name!r} rank {graph.rank}"
    if required and missing:
        raise EvaluationError(f"{where}: missing {what} {missing}; expected {list(wanted)}")
    if extra:
        raise EvaluationError(f"{where}: unknown {what} {extra}; the graph's {what} are {list(wanted)}")


class _Rank:
    """One rank's evaluation in progress."""

    def __init__(
        self,
        graph: Graph,
        inputs: Mapping[str, Any],
        params: Mapping[str, Any],
        state: dict[str, np.ndarray],
        keep: bool,
    ) -> None:
        self.graph = graph
        self.order = graph.topological_order()
        self.inputs = inputs
        self.params = params
        self.state = state
        self.keep = keep
        self.values: dict[Tensor, np.ndarray] = {}
        self.storage: dict[Tensor, np.ndarray] = {}
        self.done: set[Node] = set()

    def ready(self, node: Node) -> bool:
        return all(t in self.values for t in node.inputs)

    def operands(self, node: Node) -> list[np.ndarray]:
        return [self.values[t] for t in node.inputs]

    def store(self, node: Node, results: Sequence[np.ndarray]) -> None:
        if len(results) != len(node.outputs):
            raise InternalError(f"{node!r}: reference returned {len(results)} values for {len(node.outputs)} outputs")
        for t, r in zip(node.outputs, results):
            arr = round_to(np.asarray(r), t.dtype)
            if arr.shape != t.shape:
                raise InternalError(f"{node!r}: reference gave shape {arr.shape}, the shape rule says {t.shape}")
            if t.is_view:
                self._check_view(node, t, arr)
            self.values[t] = arr
        self.done.add(node)

    def _check_view(self, node: Node, t: Tensor, arr: np.ndarray) -> None:
        if arr.size == 0:
            return  # (an empty view reaches no element)
        base = t.base
        flat = self.storage.get(base)
        if flat is None:
            flat = self.storage[base] = np.ascontiguousarray(self.values[base]).reshape(-1)
        extent = [s * (d - 1) for d, s in zip(t.shape, t.strides)]
        lo = t.offset + sum(e for e in extent if e < 0)
        hi = t.offset + sum(e for e in extent if e > 0)
        if lo < 0 or hi >= flat.size:
            raise InternalError(f"{node!r}: view layout reaches elements {lo}..{hi} of a storage of {flat.size}")
        item = flat.itemsize
        view = np.lib.stride_tricks.as_strided(
            flat[t.offset :] if t.offset < flat.size else flat,
            shape=t.shape,
            strides=tuple(s * item for s in t.strides),
            writeable=False,
        )
        if not np.array_equal(np.ascontiguousarray(view).view(np.uint8), np.ascontiguousarray(arr).view(np.uint8)):
            raise InternalError(
                f"{node!r}: the declared layout (strides {t.strides}, offset {t.offset}) does not "
                "read the values the op defines"
            )

    def run_local(self, node: Node) -> None:
        """Run a source, compute or view node."""
        op = node.op
        if op.kind == "source":
            self.store(node, [self._source_value(node)])
            return
        operands = self.operands(node)
        try:
            if op.check_data is not None:
                op.check_data(operands, node.attrs, [None] * len(operands))
            result = op.reference(operands, node.attrs)
        except DataError as e:
            raise DataError(f"{op.name} {node.name} (graph {self.graph.name!r} rank {self.graph.rank}): {e}") from None
        self.store(node, result if isinstance(result, list) else [result])

    def _source_value(self, node: Node) -> np.ndarray:
        name, t = node.attrs["name"], node.outputs[0]
        kind = node.op.name
        if kind == "input":
            return coerce(self.inputs[name], t, f"input {name!r}")
        if kind == "parameter":
            return coerce(self.params[name], t, f"parameter {name!r}")
        if kind == "state":
            return self.state[name]
        return node.attrs["value"]


def _initial_state(graph: Graph, given: Mapping[str, Any] | None) -> dict[str, np.ndarray]:
    given = dict(given or {})
    _check_names(given, graph.states, "state", graph, required=False)
    out = {}
    for name, t in graph.states.items():
        if name in given:
            out[name] = coerce(given[name], t, f"state {name!r}")
        elif "init" in t.node.attrs:
            out[name] = np.array(t.node.attrs["init"], copy=True)
        else:
            out[name] = np.zeros(t.shape, t.dtype.np)
    return out


def _run_iteration(ranks: list[_Rank], matching: RankMatching) -> None:
    """Run every node of every rank once, in dataflow order across ranks."""
    mailbox: dict[Node, np.ndarray] = {}  # recv node -> value its send delivered
    pending = [list(r.order) for r in ranks]
    while any(pending):
        progressed = False
        for rank, rs in enumerate(ranks):
            still = []
            for node in pending[rank]:
                if node in rs.done:
                    continue
                if not rs.ready(node):
                    still.append(node)
                    continue
                kind = node.op.kind
                if kind == "p2p" and node.op.name == "send":
                    tr = matching.transfer_of[node]
                    mailbox[tr.recv] = rs.values[node.inputs[0]].copy()
                    rs.done.add(node)
                elif kind == "p2p":
                    if node not in mailbox:
                        still.append(node)
                        continue
                    rs.store(node, [mailbox.pop(node)])
                elif kind == "collective":
                    c = matching.collective_of[node]
                    members = [ranks[r] for r in c.group]
                    if not all(m.ready(n) for m, n in zip(members, c.nodes)):
                        still.append(node)
                        continue
                    results = node.op.reference([m.operands(n)[0] for m, n in zip(members, c.nodes)], node.attrs)
                    for m, n, value in zip(members, c.nodes, results):
                        m.store(n, [value])
                else:
                    rs.run_local(node)
                progressed = True
            pending[rank] = still
        if not progressed and any(pending):
            stuck = [f"rank {r}: {n.op.name} {n.name}" for r, p in enumerate(pending) for n in p[:1]]
            raise InternalError(
                "reference evaluation made no progress (match_ranks should have refused this "
                "program): " + "; ".join(stuck)
            )


def evaluate(
    graphs: Graph | Sequence[Graph],
    inputs: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
    params: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
    state: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
    *,
    iterations: int = 1,
    keep_values: bool = False,
) -> Any:
    """Evaluate one graph, or one graph per rank, on numpy.

    ``inputs``/``params``/``state`` map names to arrays (numpy, numbers or torch tensors); for several
    ranks, pass one mapping per rank. ``iterations`` runs the graph that many times, each iteration
    starting from the state the previous one assigned (the inputs stay the same). Returns an
    ``Evaluation`` (a list of them, rank order, for several ranks) with the last iteration's outputs.
    """
    single = isinstance(graphs, Graph)
    if not single and not (isinstance(graphs, (list, tuple)) and all(isinstance(g, Graph) for g in graphs)):
        raise EvaluationError(f"evaluate: expected a Graph or a list of rank Graphs, got {type(graphs).__name__}")
    glist = [graphs] if single else list(graphs)
    n = len(glist)

    def per_rank(arg: Any, what: str) -> list[Mapping[str, Any]]:
        if arg is None:
            return [{} for _ in range(n)]
        if single:
            if not isinstance(arg, Mapping):
                raise EvaluationError(f"{what}: expected a mapping from names to arrays, got {type(arg).__name__}")
            return [arg]
        if isinstance(arg, Mapping) or len(arg) != n:
            raise EvaluationError(f"{what}: pass a list with one mapping per rank ({n} ranks)")
        return list(arg)

    ins, prs, sts = per_rank(inputs, "inputs"), per_rank(params, "params"), per_rank(state, "state")
    if not isinstance(iterations, int) or iterations < 1:
        raise EvaluationError(f"iterations must be an int >= 1, got {iterations!r}")
    require_results(glist, "evaluate")
    matching = match_ranks(glist)
    states = []
    for g, i, p, s in zip(glist, ins, prs, sts):
        _check_names(i, g.inputs, "inputs", g, required=True)
        _check_names(p, g.parameters, "parameters", g, required=True)
        states.append(_initial_state(g, s))
    with np.errstate(all="ignore"):  # NaN/inf follow IEEE rules, as on the GPU
        for _ in range(iterations):
            ranks = [_Rank(g, i, p, s, keep_values) for g, i, p, s in zip(glist, ins, prs, states)]
            _run_iteration(ranks, matching)
            states = [
                {
                    name: rs.state[name]
                    if name not in rs.graph.state_updates
                    else rs.values[rs.graph.state_updates[name]].copy()
                    for name in rs.graph.states
                }
                for rs in ranks
            ]
    results = [
        Evaluation(
            outputs={name: np.array(rs.values[t], copy=True) for name, t in rs.graph.outputs.items()},
            state=st,
            values=rs.values if keep_values else {},
        )
        for rs, st in zip(ranks, states)
    ]
    return results[0] if single else results

"""``Partition``: a single-device graph split over ranks, with what the user needs to run it as if it
were still one graph: each rank's parameters, inputs and state cut from the single-device ones
(views, no copies), the ranks' outputs and state put back together, and an account of where
everything went (``describe``) and what the cost model expects (``predicted``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from megaloop.errors import EvaluationError, GraphBuildError
from megaloop.frontend.graph import Graph
from megaloop.parallel.shard import Box, Part


@dataclass
class Prediction:
    """What the cost model expects of a partition: one step's time, the bytes the ranks exchange in a
    step, and the memory each rank holds (parameters, state, and the largest intermediates)."""

    step_us: float
    exchanged_bytes: int
    memory_bytes: list[int]
    detail: dict[str, Any] = field(default_factory=dict)


class Partition:
    def __init__(self, original: Graph, parts: Sequence[Part], *, mesh: Any = None, notes: Sequence[str] = ()) -> None:
        self.original = original
        self.parts = list(parts)
        self.graphs = [p.graph for p in self.parts]
        self.mesh = mesh
        self.notes = list(notes)
        self.predicted: Prediction | None = None
        self.plan: Any = None  # the candidate it is (megaloop.parallel.parallelize.Plan)
        self.candidates: list[Any] = []  # what parallelize compared
        self.decisions: dict[str, dict[Any, Any]] = {}  # pass kind -> original node -> its strategy
        self.exchanges: dict[str, list] = {}  # pass kind -> the conversions it inserted
        self.stage_of: dict[Any, int] = {}  # original node -> pipeline stage or device
        self.one_device: Prediction | None = None  # the program unsplit, by the same cost model

    def describe(self) -> str:
        """Where every parameter and op went and why, in words (megaloop.parallel.describe)."""
        from megaloop.parallel.describe import describe

        return describe(self)

    def summary(self) -> str:
        """One line: the split, what it divides (by sequences, weights, positions, layers), and the
        predicted step against one device's."""
        from megaloop.parallel.describe import summary

        return summary(self)

    @property
    def world_size(self) -> int:
        return len(self.graphs)

    # ---- handing values to the ranks ----------------------------------------------------------------
    def shard_parameters(self, params: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Each rank's parameters, cut from the single-device graph's (numpy views of them, memory
        maps included: no copy)."""
        return self._cut(params, "parameter", "parameters", required=True)

    def shard_inputs(self, inputs: Mapping[str, Any]) -> list[dict[str, Any]]:
        return self._cut(inputs, "input", "inputs", required=True)

    def shard_state(self, state: Mapping[str, Any] | None) -> list[dict[str, Any]]:
        """Each rank's pieces of the given state values (states not given start as the graph says)."""
        return self._cut(state or {}, "state", "state", required=False)

    def _cut(self, values: Mapping[str, Any], kind: str, what: str, required: bool) -> list[dict[str, Any]]:
        if not isinstance(values, Mapping):
            raise EvaluationError(f"partition: {what} must map names to arrays, got {type(values).__name__}")
        known = {n.attrs["name"] for n in self.original.nodes if n.op.name == kind}
        unknown = sorted(set(values) - known)
        if unknown:
            raise EvaluationError(f"partition: unknown {what} {unknown}; the graph's {what} are {sorted(known)}")
        out = []
        for part in self.parts:
            mine: dict[str, Any] = {}
            for node, info in part.sources.items():
                if info.kind != kind:
                    continue
                if info.name not in values:
                    if required:
                        raise EvaluationError(f"partition: missing {kind} {info.name!r}")
                    continue
                mine[node.attrs["name"]] = _piece(values[info.name], info.box, f"{kind} {info.name!r}")
            out.append(mine)
        return out

    # ---- putting results back together --------------------------------------------------------------
    def gather_outputs(self, results: Sequence[Any]) -> dict[str, np.ndarray]:
        """The single-device graph's outputs from the ranks' (``Evaluation``\\ s or dicts of outputs)."""
        if hasattr(results, "outputs") or isinstance(results, Mapping):  # (one rank's, unlisted)
            results = [results]
        per_rank = [r.outputs if hasattr(r, "outputs") else r for r in results]
        if len(per_rank) != len(self.parts):
            raise EvaluationError(f"partition: {len(per_rank)} results for {len(self.parts)} ranks")
        out: dict[str, np.ndarray] = {}
        for name, t in self.original.outputs.items():
            pieces = [
                (box, outs[local])
                for part, outs in zip(self.parts, per_rank)
                for local, (orig, box) in part.outputs.items()
                if orig == name
            ]
            out[name] = self._assemble(t, pieces, f"output {name!r}")
        return out

    def gather_state(self, states: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """The single-device graph's state from the ranks' (e.g. ``Evaluation.state``)."""
        if isinstance(states, Mapping):  # (one rank's, unlisted)
            states = [states]
        out = {}
        for name, t in self.original.states.items():
            found = []
            for part, st in zip(self.parts, states):
                for node, info in part.sources.items():
                    if info.kind == "state" and info.name == name and node.attrs["name"] in st:
                        found.append((info.box, st[node.attrs["name"]]))
            if found:
                out[name] = self._assemble(t, found, f"state {name!r}")
        return out

    @staticmethod
    def _assemble(t: Any, pieces: list[tuple[Box, np.ndarray]], what: str) -> np.ndarray:
        if not pieces:
            raise EvaluationError(f"partition: no rank holds {what}")
        first = np.asarray(pieces[0][1])
        whole = np.empty(t.shape, dtype=first.dtype)
        covered = np.zeros(t.shape, dtype=bool)
        for box, value in pieces:
            sl = tuple(slice(lo, hi) for lo, hi in box)
            whole[sl] = np.asarray(value)
            covered[sl] = True
        if not covered.all():
            raise EvaluationError(f"partition: the ranks' pieces do not cover {what}")
        return whole

    def __repr__(self) -> str:
        return f"Partition({self.original.name!r}, {self.world_size} ranks)"


def _piece(value: Any, box: Box, what: str) -> Any:
    arr = value if isinstance(value, np.ndarray) else np.asarray(value)
    if arr.ndim != len(box) or any(hi > s for (lo, hi), s in zip(box, arr.shape)):
        raise GraphBuildError(
            f"partition: {what} has shape {arr.shape}; the graph expects {tuple(hi for _, hi in box)}"
        )
    return arr[tuple(slice(lo, hi) for lo, hi in box)]

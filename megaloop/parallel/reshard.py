"""How a tensor already placed one way on a group gets another placement: the collectives (or, for
members that share one graph, the plain ops) that do it. One description, ``conversion``, is what the
partitioner's builder emits and what its cost model prices.

    Replicate -> Shard      each member slices its piece (a view: free)
    Shard     -> Replicate  all_gather (uneven pieces padded to the largest, then trimmed)
    Partial   -> Replicate  all_reduce
    Partial   -> Shard      reduce_scatter (even pieces of an axis that divides), else all_reduce + slice
    Shard     -> Shard'     through Replicate

Nothing becomes Partial by conversion: only ops make partial results.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from megaloop.errors import GraphBuildError
from megaloop.frontend.placement import REPLICATE, Partial, Placement, Replicate, Shard, bounds


@dataclass(frozen=True)
class Step:
    kind: str  # "slice", "all_gather", "all_reduce", "reduce_scatter"
    source: Placement  # what it starts from
    target: Placement  # what it makes


def conversion(have: Iterable[Placement], target: Placement, shape: Sequence[int]) -> list[Step] | None:
    """The cheapest steps from one of the placements in ``have`` to ``target``; [] if already there,
    None if there is no way (a partial result cannot be made by conversion)."""
    have = list(have)
    if target in have:
        return []
    if isinstance(target, Partial):
        return None
    if isinstance(target, Replicate):
        for p in have:
            if isinstance(p, Partial):
                return [Step("all_reduce", p, REPLICATE)]
        for p in have:
            if isinstance(p, Shard):
                return [Step("all_gather", p, REPLICATE)]
        return None
    if REPLICATE in have:
        return [Step("slice", REPLICATE, target)]
    for p in have:
        if isinstance(p, Partial) and _scatters(target, shape):
            return [Step("reduce_scatter", p, target)]
    whole = conversion(have, REPLICATE, shape)
    return None if whole is None else [*whole, Step("slice", REPLICATE, target)]


def _scatters(target: Shard, shape: Sequence[int]) -> bool:
    return len(set(target.sizes)) == 1


class Combine:
    """The ops of a conversion, for the members of one group: real ranks (collectives over their
    ranks) or members that share one graph (micro-batches: concat and adds)."""

    def __init__(self, graphs: Sequence[Any], ranks: Sequence[int] | None) -> None:
        self.graphs, self.ranks = list(graphs), None if ranks is None else tuple(ranks)

    @property
    def shared(self) -> bool:
        return self.ranks is None

    def run(self, steps: list[Step], pieces: list[Any]) -> list[Any]:
        for step in steps:
            pieces = getattr(self, "_" + step.kind)(step, pieces)
        return pieces

    def _slice(self, step: Step, pieces: list[Any]) -> list[Any]:
        p = step.target
        return [_piece(x, p.axis, *bounds(p.sizes)[i]) for i, x in enumerate(pieces)]

    def _all_reduce(self, step: Step, pieces: list[Any]) -> list[Any]:
        ops = _ops()
        if self.shared:
            total = pieces[0]
            for x in pieces[1:]:
                total = ops.add(total, x) if step.source.op == "sum" else ops.maximum(total, x)
            return [total] * len(pieces)
        return [ops.all_reduce(x, step.source.op, group=self.ranks) for x in pieces]

    def _reduce_scatter(self, step: Step, pieces: list[Any]) -> list[Any]:
        ops = _ops()
        if self.shared:
            return self._slice(step, self._all_reduce(step, pieces))
        return [ops.reduce_scatter(x, step.target.axis, step.source.op, group=self.ranks) for x in pieces]

    def _all_gather(self, step: Step, pieces: list[Any]) -> list[Any]:
        ops = _ops()
        p = step.source
        if self.shared:
            return [ops.concat(pieces, axis=p.axis)] * len(pieces)
        widest = max(p.sizes)
        if len(set(p.sizes)) == 1:
            return [ops.all_gather(x, p.axis, group=self.ranks) for x in pieces]
        padded = [_pad(x, p.axis, widest) for x in pieces]
        out = []
        for x in padded:
            full = ops.all_gather(x, p.axis, group=self.ranks)
            parts = [_piece(full, p.axis, k * widest, k * widest + s) for k, s in enumerate(p.sizes)]
            out.append(ops.concat(parts, axis=p.axis))
        return out


def _piece(x: Any, axis: int, lo: int, hi: int) -> Any:
    if lo == 0 and hi == x.shape[axis]:
        return x
    starts = [None] * x.ndim
    stops = [None] * x.ndim
    starts[axis], stops[axis] = lo, hi
    return _ops().slice_(x, starts, stops)


def _pad(x: Any, axis: int, size: int) -> Any:
    """x grown to ``size`` along ``axis`` with zeros (a broadcast constant: no memory)."""
    ops = _ops()
    if x.shape[axis] == size:
        return x
    shape = list(x.shape)
    shape[axis] = size - x.shape[axis]
    zero = x.graph.constant(False if x.dtype.is_bool else 0 if x.dtype.is_int else 0.0, x.dtype)
    return ops.concat([x, ops.broadcast_to(ops.reshape(zero, (1,) * x.ndim), tuple(shape))], axis=axis)


def _ops() -> Any:
    from megaloop.frontend import ops

    return ops


def check_placement(p: Any, what: str) -> Placement:
    if not isinstance(p, (Replicate, Shard, Partial)):
        raise GraphBuildError(
            f"{what}: {p!r} is not a placement; use megaloop.Replicate(), megaloop.Shard(axis) or megaloop.Partial()"
        )
    return p

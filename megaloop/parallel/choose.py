"""Which strategy each node of a part runs with: the placements each tensor is available in as nodes
are placed in order (``Placed``), which strategies are possible there, and two ways to choose: at
random (tests) and by the cost model (``megaloop.parallel.search``).

A source is free in any placement (its pieces are handed in by the host), unless it has a home: a
state keeps the first placement it is made in (its storage), a pinned source its pin. Any other
tensor is available in the placement its producer made and in those conversions made from it; a
partial result can only come from an op.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from megaloop.errors import GraphBuildError
from megaloop.frontend.graph import Node
from megaloop.frontend.placement import Partial, Placement, Strategy, resolve
from megaloop.frontend.tensor import Tensor
from megaloop.parallel.reshard import conversion
from megaloop.parallel.shard import Choice, Part

Pins = Mapping[Tensor, Placement]


def strategies_for(node: Node, members: int, given: Sequence[Placement | None], shared: bool) -> list[Strategy]:
    """The node's strategies on ``members``, every placement resolved; those that need real ranks
    dropped when the members share one graph."""
    rule = node.op.placement
    if rule is None:
        raise GraphBuildError(
            f"partition: {node.op.name} {node.name} has no placement rule, so the partitioner cannot split it"
        )
    out = []
    for s in rule(node, members, tuple(given)):
        if shared and (s.collective or node.op.kind in ("collective", "p2p")):
            continue
        ins = tuple(resolve(p, t.shape, members) for p, t in zip(s.inputs, node.inputs))
        outs = tuple(resolve(p, t.shape, members) for p, t in zip(s.outputs, node.outputs))
        if None in ins or None in outs:
            continue
        out.append(Strategy(ins, outs, s.label, s.build, s.collective))
    return out


class Placed:
    """The placements each tensor of a part has so far (a state also has its home)."""

    def __init__(self) -> None:
        self.have: dict[Tensor, tuple[Placement, ...]] = {}
        self.home: dict[Tensor, Placement] = {}

    def copy(self) -> Placed:
        other = Placed()
        other.have, other.home = dict(self.have), dict(self.home)
        return other

    def given(self, t: Tensor) -> Placement | None:
        have = self.have.get(t)
        return have[0] if have else None

    def steps(self, t: Tensor, p: Placement) -> list | None:
        """The conversion steps that give ``t`` in ``p`` ([] when free), None if impossible. A source
        without a home (a state before its first use, a source nobody pinned) is free in any piece."""
        have = self.have.get(t, ())
        if p in have:
            return []
        if t.node.op.kind == "source" and t not in self.home:
            return None if isinstance(p, Partial) else []
        return conversion(have, p, t.shape)

    def feasible(self, node: Node, s: Strategy) -> bool:
        for i, (t, p) in enumerate(zip(node.inputs, s.inputs)):
            if self.steps(t, p) is None:
                return False
            if i == node.op.inplace_operand and t.node.op.name == "state":
                home = self.home.get(t)
                if home is not None and home != p:
                    return False
        return True

    def apply(self, node: Node, s: Strategy) -> None:
        for t, p in zip(node.inputs, s.inputs):
            if t.node.op.name in ("input", "constant") and t not in self.home:
                continue  # free in any piece: nothing to remember
            have = self.have.get(t, ())
            if p not in have:
                self.have[t] = (*have, p)
            if t.node.op.name in ("state", "parameter") and t not in self.home:
                self.home[t] = p
        for t, p in zip(node.outputs, s.outputs):
            self.have[t] = (p,)


def pinned(node: Node, s: Strategy, pins: Pins) -> bool:
    """Whether ``s`` agrees with the pinned placements of the node's operands and outputs."""
    for t, p in (*zip(node.inputs, s.inputs), *zip(node.outputs, s.outputs)):
        want = pins.get(t)
        if want is not None and want != p:
            return False
    return True


def random_choice(
    part: Part,
    members: int,
    rng: np.random.Generator,
    *,
    shared: bool = False,
    prefer: Any = None,
    fixed: Mapping[Tensor, Placement] | None = None,
) -> Choice:
    """Any feasible strategy for every node, at random (``prefer(node, strategies)`` may narrow the
    candidates first): the partitioned program must compute the same values whatever is chosen.
    ``fixed``: sources made in the placement given (a Partial one: tests of partial-sum strategies)."""
    placed = Placed()
    for t, p in (fixed or {}).items():
        placed.have[t], placed.home[t] = (p,), p
    chosen: dict[Node, Strategy] = {}
    for node in part.graph.nodes:
        if node.op.kind == "source":
            continue
        given = [placed.given(t) for t in node.inputs]
        options = [s for s in strategies_for(node, members, given, shared) if placed.feasible(node, s)]
        if prefer is not None:
            options = prefer(node, options) or options
        if not options:
            raise GraphBuildError(f"partition: no strategy of {node.op.name} {node.name} fits its operands")
        s = options[int(rng.integers(len(options)))]
        placed.apply(node, s)
        chosen[node] = s
    return Choice(chosen, dict(fixed or {}))

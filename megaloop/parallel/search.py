"""The search for a part's strategies: the cheapest choice by the cost model, found by dynamic
programming over the nodes in program order with a beam.

A search state is what the program has made so far: the placements each live tensor is available in
(and each state's home), its cost (the nodes' times on a member plus the exchanges), and the memory
each member holds for parameters and state. Each node extends every state by each strategy its
operands allow (conversions priced in); states that leave the live tensors in the same placements
merge, keeping the cheaper; the ``beam`` cheapest go on. At the end, state updates and outputs are
converted where they must be (a state to its home, an output out of partial sums) and the cheapest
complete state wins. Why a beam and not an exact search: the live tensors of a layer's program are
few, so few states differ in more than cost, and the beam keeps the search linear in the nodes (a
32-layer model's thousands of nodes in seconds).

A source with no placement yet is offered to its reader in the pieces its axis class allows
(``megaloop.parallel.axes.cut_hints``: 3 kv heads over 2 ranks as 2 + 1, not 1.5 + 1.5).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from megaloop.errors import GraphBuildError, PartitionMemoryError
from megaloop.frontend.graph import Node
from megaloop.frontend.placement import Partial, Placement, Replicate, Shard, Strategy
from megaloop.frontend.tensor import Tensor
from megaloop.parallel.axes import Allow, cut_hints
from megaloop.parallel.choose import strategies_for
from megaloop.parallel.cost import Pricer, attrs_key
from megaloop.parallel.reshard import conversion
from megaloop.parallel.shard import Choice, Part

# Sources stored once a rank, in the placement their first reader takes (their home); a reader that
# wants another converts from it (a slice of a whole one is a view). Inputs and constants are handed
# in as each reader wants them.
HELD = ("state", "parameter")
MEMORY_US_PER_BYTE = 1.0 / 2**28  # 1 us per 256 MiB a device holds: between equal times, less memory


@dataclass
class _State:
    cost: float
    have: dict[int, tuple[int, ...]]  # live tensor -> the placements (ids) it is available in, made first
    home: dict[int, int]  # states and pinned sources -> the placement of their storage
    memory: int
    parent: _State | None = None
    node: Node | None = None
    strategy: Strategy | None = None


@dataclass
class Searched:
    choice: Choice
    cost_us: float  # the search's estimate of a member's step (nodes + exchanges)
    memory_bytes: int  # parameters and state a member holds


class _Search:
    """The DP's tables: tensors and placements as small ints, options and conversions cached by what
    they depend on (the operands' placements), so that a model's repeated layers cost little."""

    def __init__(self, part: Part, members: int, pricer: Pricer, pins, allow, shared: bool) -> None:
        self.part, self.members, self.pricer = part, members, pricer
        self.pins, self.allow, self.shared = pins, allow, shared
        self.tensor_id: dict[Tensor, int] = {}
        self.tensors: list[Tensor] = []
        self.placement_id: dict[Placement, int] = {}
        self.placements: list[Placement] = []
        self.strategies: dict[Any, list[tuple[Strategy, tuple[int, ...], tuple[int, ...]]]] = {}
        self.raw: dict[Any, list] = {}
        self.options: dict[Any, list] = {}
        self.conversions: dict[Any, tuple[float, tuple[int, ...]] | None] = {}
        self.hints = {self.tid(t): self.pid(p) for t, p in cut_hints(part, members).items()}

    def tid(self, t: Tensor) -> int:
        i = self.tensor_id.get(t)
        if i is None:
            i = self.tensor_id[t] = len(self.tensors)
            self.tensors.append(t)
        return i

    def pid(self, p: Placement) -> int:
        i = self.placement_id.get(p)
        if i is None:
            i = self.placement_id[p] = len(self.placements)
            self.placements.append(p)
        return i

    def node_strategies(self, node: Node, given: tuple) -> list:
        key = (node, given)
        found = self.strategies.get(key)
        if found is None:
            sig = (node.op.name, _layouts(node), attrs_key(node.attrs), given)  # (a model's layers share it)
            raw = self.raw.get(sig)
            if raw is None:
                gp = tuple(None if g is None else self.placements[g] for g in given)
                raw = self.raw[sig] = [
                    (s, tuple(self.pid(p) for p in s.inputs), tuple(self.pid(p) for p in s.outputs))
                    for s in strategies_for(node, self.members, gp, self.shared)
                ]
            found = self.strategies[key] = [
                x for x in raw if (self.allow is None or self.allow(node, x[0])) and _agrees(node, x[0], self.pins)
            ]
        return found

    def convert(self, t: int, have: tuple[int, ...] | None, home: int | None, target: int):
        """(cost, placements available after) for tensor t to be had in ``target``; None if it cannot."""
        key = (t, have, home, target)
        if key in self.conversions:
            return self.conversions[key]
        tensor, p = self.tensors[t], self.placements[target]
        if have is not None and target in have:
            out = (0.0, have)
        elif tensor.node.op.kind == "source" and home is None:
            out = None if isinstance(p, Partial) else (0.0, have)  # free: handed in as this piece
        else:
            steps = conversion([self.placements[i] for i in have or ()], p, tensor.shape)
            out = None if steps is None else (self.pricer.steps(tensor, steps), (*(have or ()), target))
        self.conversions[key] = out
        return out

    def node_options(self, node: Node, st: _State) -> list:
        ins = [self.tid(t) for t in node.inputs]
        have = tuple(st.have.get(i) for i in ins)
        home = tuple(st.home.get(i) for i in ins)
        key = (node, have, home)
        found = self.options.get(key)
        if found is not None:
            return found
        given = tuple(h[0] if h else self.hints.get(t) for t, h in zip(ins, have))
        found = []
        for s, sin, sout in self.node_strategies(node, given):
            compute, exchange = self.pricer.node(node, s)
            cost, memory, updates, ok = compute + exchange, 0, [], True
            for k, (t, target) in enumerate(zip(ins, sin)):
                tensor = node.inputs[k]
                if k == node.op.inplace_operand and tensor.node.op.name == "state":
                    if home[k] is not None and home[k] != target:
                        ok = False
                        break
                conv = self.convert(t, have[k], home[k], target)
                if conv is None:
                    ok = False
                    break
                cost += conv[0]
                kind = tensor.node.op.name
                if tensor.node.op.kind == "source" and home[k] is None:
                    made = have[k] or ()
                    if kind != "input" and target not in made:  # (a piece held once, however many read it)
                        memory += _piece_bytes(tensor, self.placements[target], self.members)
                    if kind in HELD:  # stored once a rank: other readers convert from this piece
                        updates.append((t, (target,), target))
                    elif kind != "input" and target not in made:
                        updates.append((t, (*made, target), None))
                elif conv[1] != have[k]:
                    updates.append((t, conv[1], None))
            if ok:  # (memory as a tie-break: equal times, the fewer bytes a device)
                found.append((s, cost + memory * MEMORY_US_PER_BYTE, memory, tuple(updates), sout))
        self.options[key] = found
        return found


def search(
    part: Part,
    members: int,
    pricer: Pricer,
    *,
    pins: Mapping[Tensor, Placement] | None = None,
    allow: Allow | None = None,
    shared: bool = False,
    memory_limit: int | None = None,
    beam: int = 64,
) -> Searched:
    pins = dict(pins or {})
    g = part.graph
    dp = _Search(part, members, pricer, pins, allow, shared)
    last = {dp.tid(t): i for t, i in _last_uses(g, pins).items()}
    home_until = {dp.tid(t): i for t, i in _homes_needed(g, pins).items()}
    start = _State(0.0, {}, {}, _pinned_memory(pins, members))
    for t, p in pins.items():
        if t.node.op.kind == "source":
            start.have[dp.tid(t)] = (dp.pid(p),)
            start.home[dp.tid(t)] = dp.pid(p)
    states = [start]
    for index, node in enumerate(g.nodes):
        if node.op.kind == "source":
            continue
        outs = [dp.tid(t) for t in node.outputs]
        merged: dict[Any, _State] = {}
        for st in states:
            for s, cost, memory, updates, sout in dp.node_options(node, st):
                if memory_limit is not None and st.memory + memory > memory_limit:
                    continue
                have, home = dict(st.have), st.home
                for t, placed, new_home in updates:
                    have[t] = placed
                    if new_home is not None:
                        home = {**home, t: new_home}
                for t, p in zip(outs, sout):
                    have[t] = (p,)
                for t in [t for t in have if last.get(t, -1) <= index]:
                    del have[t]
                if any(home_until.get(t, -1) <= index for t in home):
                    home = {t: p for t, p in home.items() if home_until.get(t, -1) > index}
                key = (tuple(sorted((t, v[0]) for t, v in have.items())), tuple(sorted(home.items())))
                total = st.cost + cost
                old = merged.get(key)
                if old is None or old.cost > total:
                    merged[key] = _State(total, have, home, st.memory + memory, st, node, s)
        if not merged:
            raise _no_strategy(node, states[0], dp, members, pins, memory_limit, shared)
        states = sorted(merged.values(), key=lambda s: s.cost)[:beam]
    best, best_cost = None, None
    for st in states:
        total = st.cost + _finish_cost(g, st, dp)
        if best_cost is None or total < best_cost:
            best, best_cost = st, total
    chosen: dict[Node, Strategy] = {}
    st = best
    while st is not None and st.node is not None:
        chosen[st.node] = st.strategy
        st = st.parent
    fixed = {t: p for t, p in pins.items() if t.node.op.kind == "source"}
    return Searched(Choice(chosen, fixed), float(best_cost), best.memory)


def _layouts(node: Node) -> tuple:
    return tuple((t.shape, t.dtype.name, t.strides) for t in (*node.inputs, *node.outputs))


def _agrees(node: Node, s: Strategy, pins: Mapping[Tensor, Placement]) -> bool:
    """A pinned tensor is made in its pin (its consumers convert it as usual)."""
    for t, p in zip(node.outputs, s.outputs):
        want = pins.get(t)
        if want is not None and want != p:
            return False
    return True


def _piece_bytes(t: Tensor, p: Placement, members: int) -> int:
    if isinstance(p, Shard):
        return t.nbytes // t.shape[p.axis] * p.sizes[0]
    return t.nbytes


def _pinned_memory(pins: Mapping[Tensor, Placement], members: int) -> int:
    return sum(_piece_bytes(t, p, members) for t, p in pins.items() if t.node.op.kind == "source")


def _homes_needed(g: Any, pins: Mapping[Tensor, Placement]) -> dict[Tensor, int]:
    """Until which node a source's home placement matters: a parameter's or a pinned source's, its
    last read; a state's, its last read when an in-place op makes its next value (that op's result
    carries it from there), else the end (its update converts to it)."""
    last: dict[Tensor, int] = {}
    for i, node in enumerate(g.nodes):
        for t in node.inputs:
            if t.node.op.name in HELD or t in pins:
                last[t] = i
    end = len(g.nodes)
    for name, state in g.states.items():
        value = g.state_updates.get(name)
        if value is not None and not _in_place(value, state):
            last[state] = end
    return last


def _last_uses(g: Any, pins: Mapping[Tensor, Placement]) -> dict[Tensor, int]:
    """Index of the last node reading each tensor (state updates and outputs: past the end)."""
    last: dict[Tensor, int] = {}
    for i, node in enumerate(g.nodes):
        for t in node.inputs:
            last[t] = i
    end = len(g.nodes)
    for name, value in g.state_updates.items():
        if not _in_place(value, g.states[name]):  # (an in-place result is in its state's storage already)
            last[value] = end
    for t in g.outputs.values():
        last[t] = end
    last.update(_homes_needed(g, pins))  # a held source's own tensor: as long as its home matters
    return last


def _in_place(value: Tensor, state: Tensor) -> bool:
    op = value.node.op
    return op.inplace_operand is not None and value.node.inputs[op.inplace_operand] is state


def _finish_cost(g: Any, st: _State, dp: _Search) -> float:
    """State updates converted to their state's home; outputs out of partial sums."""
    cost = 0.0
    for name, value in g.state_updates.items():
        if _in_place(value, g.states[name]):
            continue
        v, state = dp.tid(value), dp.tid(g.states[name])
        home = st.home.get(state, dp.pid(Replicate()))
        conv = dp.convert(v, st.have.get(v), st.home.get(v), home)
        cost += float("inf") if conv is None else conv[0]
    for t in g.outputs.values():
        have = st.have.get(dp.tid(t))
        if have and all(isinstance(dp.placements[p], Partial) for p in have):
            cost += dp.convert(dp.tid(t), have, None, dp.pid(Replicate()))[0]
    return cost


def _no_strategy(node, st, dp, members, pins, memory_limit, shared) -> GraphBuildError:
    pinned = [f"{t.name} pinned to {p}" for t in (*node.inputs, *node.outputs) if (p := pins.get(t)) is not None]
    given = ", ".join(str(dp.placements[h[0]]) if (h := st.have.get(dp.tid(t))) else "free" for t in node.inputs)
    if pinned:
        every = strategies_for(node, members, [None] * len(node.inputs), shared)
        allowed = [s for s in every if dp.allow is None or dp.allow(node, s)]
        made = sorted({str(s.outputs[0]) for s in allowed}) or ["nothing"]
        why = getattr(dp.allow, "why", "")
        return GraphBuildError(
            f"partition: {node.op.name} {node.name} cannot satisfy the layout: {'; '.join(pinned)}, but on "
            f"{members} devices it can make its output only {' or '.join(made)}"
            + (f" ({why})" if why and len(allowed) < len(every) else "")
            + "; change or drop the pin"
        )
    if memory_limit is not None:
        return PartitionMemoryError(
            f"partition: no way to run {node.op.name} {node.name} within {_size(memory_limit)} a device "
            "(memory_per_device) for what comes before it; give more devices or more memory"
        )
    return GraphBuildError(
        f"partition: no strategy of {node.op.name} {node.name} on {members} devices fits its operands ({given})"
    )


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"

"""Axes that go together through a program: which (tensor, axis) pairs the ops' strategies cut
together (``classes``), which of them is the batch (``batch_class``: data parallelism cuts only it,
tensor parallelism never), and where a class can be cut so that every op of it lines up
(``cut_hints``)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

from megaloop.frontend.graph import Node
from megaloop.frontend.placement import Placement, Shard, Strategy, even_sizes
from megaloop.frontend.tensor import Tensor
from megaloop.parallel.choose import strategies_for
from megaloop.parallel.shard import Part

Allow = Callable[[Node, Strategy], bool]


def _union(part: Part, members: int) -> tuple[Callable[[Any], Any], set[tuple[Tensor, int]]]:
    """Union-find over (tensor, axis): axes that one strategy of a node cuts together are joined."""
    parent: dict[Any, Any] = {}

    def find(x: Any) -> Any:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for node in part.graph.nodes:
        if node.op.kind == "source":
            continue
        for s in strategies_for(node, members, [None] * len(node.inputs), shared=False):
            pairs = (*zip(node.inputs, s.inputs), *zip(node.outputs, s.outputs))
            cut = [(t, p.axis) for t, p in pairs if isinstance(p, Shard)]
            for a, b in itertools.pairwise(cut):
                parent[find(a)] = find(b)
            for a in cut:
                find(a)
    return find, set(parent)


def classes(part: Part, members: int) -> Callable[[Tensor, int], int]:
    """A function naming the class of (tensor, axis): axes that strategies cut together share one."""
    find, _ = _union(part, members)
    ids: dict[Any, int] = {}
    return lambda t, axis: ids.setdefault(find((t, axis)), len(ids))


def cut_hints(part: Part, members: int) -> dict[Tensor, Placement]:
    """For sources, the pieces their axis class can be cut in where even pieces would not line up.

    Strategies cut the axes of a class at the same fractions of their lengths, and each axis only at
    whole elements, so every cut lies at a multiple of 1/g of the way, g the gcd of the lengths: q's
    9 heads (576 features) and k's 3 kv heads give thirds, 2 + 1 kv heads over 2 ranks. Ops propose
    even pieces of their own (4.5 heads: a gather follows); a source offered as these pieces (as if it
    were already so cut) lets its reader propose them, and the rest follow."""
    find, keys = _union(part, members)
    gcd: dict[Any, int] = {}
    for t, axis in keys:
        root = find((t, axis))
        gcd[root] = math.gcd(gcd.get(root, 0), t.shape[axis])
    out: dict[Tensor, Placement] = {}
    for node in part.graph.nodes:
        if node.op.kind != "source":
            continue
        t = node.outputs[0]
        for axis, size in enumerate(t.shape):
            if (t, axis) not in keys:
                continue
            g = gcd[find((t, axis))]
            sizes = tuple(k * (size // g) for k in even_sizes(g, members))
            if members <= g < size and sizes != even_sizes(size, members):
                out[t] = Shard(axis, sizes)
                break
    return out


def batch_class(part: Part, members: int) -> tuple[Callable[[Tensor, int], int], int | None]:
    """The classes and the batch's: of the axes 0 of the inputs and states, the class the outputs' axes 0
    are in most (by bytes; then the inputs' and states' own bytes): results come per sequence, and an
    input declared first (a temperature) or a large one read whole (keys) does not decide it."""
    cls = classes(part, members)
    g = part.graph
    weight: dict[int, list[int]] = {}
    for t in [*g.inputs.values(), *g.states.values()]:
        if t.ndim:
            weight.setdefault(cls(t, 0), [0, 0])[1] += t.nbytes
    for t in g.outputs.values():
        if t.ndim and cls(t, 0) in weight:
            weight[cls(t, 0)][0] += t.nbytes
    return cls, (max(weight, key=lambda c: tuple(weight[c])) if weight else None)


def batch_tensors(part: Part) -> list[Tensor]:
    """The inputs and states whose axis 0 is the batch's, largest first."""
    cls, batch = batch_class(part, 2)
    g = part.graph
    found = [t for t in [*g.inputs.values(), *g.states.values()] if t.ndim and cls(t, 0) == batch]
    return sorted(found, key=lambda t: -t.nbytes)


def only_batch(part: Part, members: int) -> Allow:
    """Data parallel: strategies that cut nothing but the batch."""
    cls, batch = batch_class(part, members)

    def allow(node: Node, s: Strategy) -> bool:
        pairs = (*zip(node.inputs, s.inputs), *zip(node.outputs, s.outputs))
        return all(not isinstance(p, Shard) or cls(t, p.axis) == batch for t, p in pairs)

    allow.why = "data parallelism cuts only the batch, axis 0 of " + _batch_names(part, cls, batch)  # type: ignore
    return allow


def never_batch(part: Part, members: int) -> Allow:
    """Tensor parallel: strategies that never cut the batch."""
    cls, batch = batch_class(part, members)

    def allow(node: Node, s: Strategy) -> bool:
        pairs = (*zip(node.inputs, s.inputs), *zip(node.outputs, s.outputs))
        return all(not isinstance(p, Shard) or cls(t, p.axis) != batch for t, p in pairs)

    allow.why = (  # type: ignore[attr-defined]
        "tensor parallelism never cuts the batch, axis 0 of " + _batch_names(part, cls, batch)
        + ": pin it under data parallelism"
    )  # fmt: skip
    return allow


def _batch_names(part: Part, cls: Callable[[Tensor, int], int], batch: int | None) -> str:
    g = part.graph
    names = [t.name for t in [*g.inputs.values(), *g.states.values()] if t.ndim and cls(t, 0) == batch]
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "") or "nothing"

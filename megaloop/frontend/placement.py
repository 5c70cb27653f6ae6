"""Where a tensor's values live on a group of devices, and how an op's placements flow: one vocabulary
for the partitioner (``megaloop.parallel``) and the op definitions (``OpDef.placement``).

A tensor on a group of ``n`` members is

- ``Replicate()``: every member holds all of it;
- ``Shard(axis, sizes)``: member i holds the i-th consecutive piece of ``axis`` (``sizes`` per member,
  each >= 1; None: as even as possible, the first members one larger, like ``numpy.array_split``);
- ``Partial(op)``: every member holds a tensor of the full shape and the value is their sum (or max),
  combined in member order;

and ``OnDevice(d)`` pins a tensor or op to one device of the mesh (pipeline and device parallelism).

An op's placement rule (``OpDef.placement``) lists its ``Strategy``\\ s for a node on ``n`` members: the
placement each operand must have, the placements of the outputs, and how one member builds its part
(by default the same op on the members' pieces with shape attributes made local). Rules see the
placements the operands already have (``given``), so that an op can follow an uneven split.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from megaloop.errors import GraphBuildError

if TYPE_CHECKING:
    from megaloop.frontend.graph import Graph, Node
    from megaloop.frontend.tensor import Tensor

REDUCE_OPS = ("sum", "max")


@dataclass(frozen=True)
class Replicate:
    def __str__(self) -> str:
        return "replicated"


@dataclass(frozen=True)
class Shard:
    axis: int
    sizes: tuple[int, ...] | None = None

    def __str__(self) -> str:
        if self.sizes is None or len(set(self.sizes)) == 1:
            return f"sharded on axis {self.axis}"
        return f"sharded on axis {self.axis} as {list(self.sizes)}"


@dataclass(frozen=True)
class Partial:
    op: str = "sum"

    def __post_init__(self) -> None:
        if self.op not in REDUCE_OPS:
            raise GraphBuildError(f"Partial: op must be one of {REDUCE_OPS}, got {self.op!r}")

    def __str__(self) -> str:
        return f"partial {self.op}s"


@dataclass(frozen=True)
class OnDevice:
    device: int

    def __str__(self) -> str:
        return f"on device {self.device}"


Placement = Replicate | Shard | Partial
REPLICATE = Replicate()


def even_sizes(size: int, n: int) -> tuple[int, ...]:
    """``size`` cut into ``n`` consecutive pieces as evenly as possible, the first ones larger."""
    q, r = divmod(size, n)
    return tuple(q + (1 if i < r else 0) for i in range(n))


def bounds(sizes: Sequence[int]) -> list[tuple[int, int]]:
    out, lo = [], 0
    for s in sizes:
        out.append((lo, lo + s))
        lo += s
    return out


def resolve(p: Placement, shape: Sequence[int], n: int) -> Placement | None:
    """``p`` for a tensor of ``shape`` on ``n`` members with explicit sizes, or None if it cannot hold
    (an axis out of range, a piece smaller than one element, sizes that do not add up)."""
    if not isinstance(p, Shard):
        return p
    axis = p.axis + len(shape) if p.axis < 0 else p.axis
    if not 0 <= axis < len(shape):
        return None
    sizes = even_sizes(shape[axis], n) if p.sizes is None else tuple(p.sizes)
    if len(sizes) != n or sum(sizes) != shape[axis] or min(sizes) < 1:
        return None
    return Shard(axis, sizes)


def local_shape(shape: Sequence[int], p: Placement, member: int) -> tuple[int, ...]:
    """The shape member ``member`` holds of a tensor of ``shape`` (``p`` resolved)."""
    if not isinstance(p, Shard):
        return tuple(shape)
    out = list(shape)
    out[p.axis] = p.sizes[member]
    return tuple(out)


def local_range(p: Placement, member: int) -> tuple[int, int, int] | None:
    """(axis, lo, hi) of the piece member ``member`` holds, or None when it holds the whole extent."""
    if not isinstance(p, Shard):
        return None
    lo, hi = bounds(p.sizes)[member]
    return p.axis, lo, hi


@dataclass
class LocalCall:
    """What a strategy's builder sees when one member builds its part of a node: the member's graph,
    the node of the graph being partitioned, the member's operands (in their strategy placements),
    the member index and group size, and ``collectives`` to combine values across the group."""

    graph: Graph
    node: Node
    operands: list[Tensor]
    member: int
    members: int
    strategy: Strategy
    collectives: Any  # megaloop.parallel's group backend: all_gather(x, axis), all_reduce(x, op)

    def out_shape(self, k: int = 0) -> tuple[int, ...]:
        """The shape of this member's part of output ``k``."""
        return local_shape(self.node.outputs[k].shape, self.strategy.outputs[k], self.member)

    def attrs(self) -> dict[str, Any]:
        """The node's attributes for this member's part: ``shape`` attributes become local."""
        attrs = dict(self.node.attrs)
        if "shape" in attrs and self.node.outputs:
            attrs["shape"] = self.out_shape(0)
        return attrs

    def default(self) -> tuple[Tensor, ...]:
        """The node's own op on the member's operands."""
        return self.graph.apply(self.node.op, self.operands, self.attrs())


LocalBuilder = Callable[[LocalCall], "tuple[Tensor, ...]"]


@dataclass(frozen=True)
class Strategy:
    """One way to run a node on a group: operand placements (one per tensor operand, in order),
    output placements, a label for ``Partition.describe`` and, where the op's own op on the pieces is
    not the answer, the builder of one member's part. ``collective``: the builder combines values
    across members itself (not possible when the members share one graph)."""

    inputs: tuple[Placement, ...]
    outputs: tuple[Placement, ...]
    label: str = ""
    build: LocalBuilder | None = field(default=None, compare=False)
    collective: bool = False


# (node, members, given placements of the operands or None) -> strategies
PlacementRule = Callable[["Node", int, "tuple[Placement | None, ...]"], list[Strategy]]


def replicated(node: Node) -> Strategy:
    return Strategy(tuple(REPLICATE for _ in node.inputs), tuple(REPLICATE for _ in node.outputs), "replicated")

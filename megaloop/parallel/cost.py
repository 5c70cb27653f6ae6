"""The partitioner's cost model: how long a node takes on a rank (from its op's own tiling and the
per-tile cost, megaloop.frontend.tiling.task_cost_ns), how long an exchange takes over a link,
and what a step of a partitioned program takes (``predict``).

An op's time on a rank: its tiles spread over the rank's processors (at least its longest tile, at
least its total over the processors), times ``Machine.tile_scale``, plus ``Machine.stage_us`` for
handing over to the next op. A step: the longest chain of ops through every rank (transfers and
collectives between them), but no rank finishing before it did all its work. The constants are fitted
to the committed H200 measurements (bench/results); docs/partition.md has the table of how far off the
model is on each.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from megaloop.frontend.graph import Graph, Node
from megaloop.frontend.placement import LocalCall, Strategy, local_shape
from megaloop.frontend.tiling import PEER_SEND, RATES, Rates, TileContext, task_cost_ns
from megaloop.parallel.reshard import Step


@dataclass(frozen=True)
class Link:
    """An interconnect as the loop kernels use it: bus bandwidth of an all-reduce (bytes/s) and the
    fixed cost of one exchange (us: a store, a flag, a wait)."""

    bandwidth: float
    latency_us: float


# Measured on 2 x H200 (ARCHITECTURE.md, bench/results/collectives.json): in-kernel all-reduce 3.15 us
# at 4 KB when each depends on the previous, 341 GB/s bus bandwidth at 256 MB. Between nodes: a
# configurable guess (400 Gb/s InfiniBand through a proxy), not measured here.
NVLINK = Link(341e9, 3.2)
NETWORK = Link(45e9, 12.0)
SAME_GPU = Link(1.8e12, 2.0)  # ranks sharing one GPU: stores into its own memory


@dataclass(frozen=True)
class Machine:
    """What the partitioner assumes about each device and the links between them."""

    arch: str = "sm_90"
    processors: int = 132
    warps: int = 8
    memory_bytes: int = 139 * 2**30
    devices_per_node: int = 8
    nvlink: Link = NVLINK
    network: Link = NETWORK
    same_gpu: Link | None = None  # set: every rank is a share of one GPU (split processors)
    # fitted to bench/results (docs/partition.md): the plan's tile estimates run this much longer,
    # and each op hands over to the next after this long
    # and the matmul tiles' operand blocks come from L2 this much faster than the plan's rate says
    tile_scale: float = 1.10
    stage_us: float = 0.7
    l2_scale: float = 1.12

    @property
    def rates(self) -> Rates:
        """The plan's per-tile rates for this device, with the fitted L2 feed."""
        base = RATES[self.arch]
        return replace(base, l2=base.l2 * self.l2_scale)

    def link(self, ranks: Sequence[int]) -> Link:
        """The link a group of ranks exchanges over: the slowest between any two of them."""
        if self.same_gpu is not None:
            return self.same_gpu
        nodes = {r // self.devices_per_node for r in ranks}
        return self.network if len(nodes) > 1 else self.nvlink


H200 = Machine()


def exchange_us(kind: str, nbytes: int, members: int, link: Link) -> float:
    """One collective (or transfer) of a tensor of ``nbytes`` over ``members`` ranks."""
    if members <= 1 and kind != "send":
        return 0.0
    n = members
    if kind == "all_reduce":
        moved = 2 * (n - 1) / n * nbytes
    elif kind in ("all_gather", "reduce_scatter"):
        moved = (n - 1) / n * nbytes  # nbytes: the whole (gathered / scattered) tensor
    else:  # send / recv
        moved = nbytes
    return link.latency_us + moved / link.bandwidth * 1e6


def steps_us(steps: Sequence[Step], shape: Sequence[int], itemsize: int, members: int, link: Link) -> float:
    nbytes = math.prod(shape) * itemsize
    return sum(exchange_us(s.kind, nbytes, members, link) for s in steps if s.kind != "slice")


# ---- ops ---------------------------------------------------------------------------------------------


def tiles_us(node: Any, machine: Machine, world: int = 1) -> tuple[float, float]:
    """(work, span) of a node's tiles in us: their total over the processors, and the longest one."""
    op = node.op
    if op.tiling is None or op.kind in ("collective", "p2p"):
        return 0.0, 0.0
    params = op.tiling.defaults(machine.arch)
    ctx = TileContext(0, max(world, 1), machine.processors, machine.warps, 1.0)
    total = longest = 0.0
    rates = machine.rates
    for tile in op.tiling.make(node, params, ctx):
        local = 0
        for rd in tile.reads:
            if rd.operand == PEER_SEND or rd.rank not in (None, 0):
                continue
            local += rd.box.size * node.inputs[rd.operand].dtype.itemsize
        for w in tile.writes:
            if w.output >= 0:
                local += w.box.size * node.outputs[w.output].dtype.itemsize
        if tile.moved is not None:
            local = tile.moved
        hbm = local - tile.streamed + tile.streamed_once
        ns = task_cost_ns(machine.arch, machine.processors, hbm, 0, tile.flops, tile.streamed, rates)
        total += ns
        longest = max(longest, ns)
    scale = machine.tile_scale / 1e3
    return total / machine.processors * scale, longest * scale


def op_us(node: Any, machine: Machine, world: int = 1) -> float:
    """A node's time on its rank: its tiles over the processors, and the handover to the next op."""
    work, span = tiles_us(node, machine, world)
    if work == 0.0 and span == 0.0:
        return 0.0
    return max(work, span) + machine.stage_us


class _CostCollectives:
    """Stands in for a group's collectives while a strategy's part is built only to be priced: it
    records what would be exchanged and hands back a tensor of the right shape."""

    def __init__(self, graph: Graph, members: int) -> None:
        self.graph, self.members, self.exchanged = graph, members, []

    def all_gather(self, x: Any, axis: int) -> Any:
        shape = list(x.shape)
        shape[axis] *= self.members
        self.exchanged.append(("all_gather", math.prod(shape) * x.dtype.itemsize))
        return self.graph.input(f"gathered{len(self.exchanged)}", tuple(shape), x.dtype)

    def all_reduce(self, x: Any, op: str = "sum") -> Any:
        self.exchanged.append(("all_reduce", x.nbytes))
        return self.graph.input(f"reduced{len(self.exchanged)}", x.shape, x.dtype)

    def outer(self, call: LocalCall) -> Any:
        node = call.node
        nbytes = sum(t.nbytes for t in node.outputs) or sum(t.nbytes for t in node.inputs)
        self.exchanged.append(("send" if node.op.kind == "p2p" else node.op.name, nbytes))
        return tuple(
            self.graph.input(f"outer{len(self.exchanged)}_{k}", t.shape, t.dtype)
            for k, t in enumerate(
                [_Shape(local_shape(o.shape, p, 0), o.dtype) for o, p in zip(node.outputs, call.strategy.outputs)]
            )
        )


@dataclass(frozen=True)
class _Shape:
    shape: tuple[int, ...]
    dtype: Any


@dataclass
class Pricer:
    """Prices a node under a strategy on ``members`` ranks (member 0's part: the largest), cached by
    what the price depends on, so that the layers of a model are priced once."""

    machine: Machine
    members: int
    ranks: tuple[int, ...] = ()
    cache: dict[Any, tuple[float, float]] = field(default_factory=dict)

    @property
    def link(self) -> Link:
        return self.machine.link(self.ranks or tuple(range(self.members)))

    def node(self, node: Node, s: Strategy) -> tuple[float, float]:
        """(compute us, exchange us) of member 0's part of ``node``."""
        key = (
            node.op.name,
            tuple((t.shape, t.dtype.name) for t in node.inputs),
            attrs_key(node.attrs),
            s.inputs,
            s.outputs,
            s.label,
        )
        found = self.cache.get(key)
        if found is None:
            found = self.cache[key] = self._price(node, s)
        return found

    def _price(self, node: Node, s: Strategy) -> tuple[float, float]:
        if node.op.kind == "view" and s.build is None:
            return 0.0, 0.0
        g = Graph("price", rank=0, world_size=max(self.members, 2))
        operands = []
        for i, (t, p) in enumerate(zip(node.inputs, s.inputs)):
            shape = local_shape(t.shape, p, 0)
            if i == node.op.inplace_operand:
                operands.append(g.state(f"s{i}", shape, t.dtype))
            else:
                operands.append(g.input(f"x{i}", shape, t.dtype))
        collectives = _CostCollectives(g, self.members)
        call = LocalCall(g, node, operands, 0, self.members, s, collectives)
        if node.op.kind in ("collective", "p2p"):
            collectives.outer(call)
        elif s.build is not None:
            s.build(call)
        else:
            call.default()
        compute = sum(op_us(n, self.machine, self.members) for n in g.nodes if n.op.kind != "source")
        exchange = sum(exchange_us(kind, nbytes, self.members, self.link) for kind, nbytes in collectives.exchanged)
        return compute, exchange

    def steps(self, t: Any, steps: Sequence[Step]) -> float:
        return steps_us(steps, t.shape, t.dtype.itemsize, self.members, self.link)


def attrs_key(attrs: dict[str, Any]) -> Any:
    out = []
    for k, v in sorted(attrs.items()):
        if hasattr(v, "shape") and not isinstance(v, tuple):
            v = ("array", tuple(v.shape), hash(v.tobytes()) if v.size < 4096 else id(v))
        elif isinstance(v, dict):
            v = attrs_key(v)
        elif isinstance(v, list):
            v = tuple(v)
        out.append((k, v))
    return tuple(out)


def with_calibration(machine: Machine, **constants: float) -> Machine:
    return replace(machine, **constants)

"""Collectives and point-to-point transfers between ranks.

Each rank builds its own graph (``Graph(rank=r, world_size=n)``); a collective appears in the graph
of every member of its ``group`` (default: all ranks), and the k-th collective a rank issues on a
group matches the k-th collective every other member issues on that group. ``megaloop.parallel``
checks that the members agree (kind, shape, dtype, attributes) and that no wait can form a cycle.

Reductions have a fixed order: members are combined in increasing rank order in float32 (int64
for integers), then rounded once, so every rank gets bitwise the same result on every run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from megaloop.dtypes import DType, as_dtype
from megaloop.errors import GraphBuildError, RankError, ShapeError
from megaloop.frontend.graph import Graph
from megaloop.frontend.opdef import Accuracy, Lowering, OpCall, OpDef, OutSpec, VjpCall, register
from megaloop.frontend.ops import _placements, _tilings
from megaloop.frontend.ops._build import apply, apply_multi, require_int, require_shape, require_tensor
from megaloop.frontend.ops.elementwise import check_kinds, to_compute
from megaloop.frontend.placement import REPLICATE, LocalCall, Strategy
from megaloop.frontend.shapes import format_shape
from megaloop.frontend.tensor import Tensor
from megaloop.frontend.validate import as_ints

REDUCE_OPS = ("sum", "max")


# A collective of a program already split over some ranks, split again (each rank's part over a group
# of its own): every member takes part with its piece, with the same member of every other rank.
def _again(call: LocalCall) -> Any:
    return call.collectives.outer(call)


def _collective_rule(dims: Any, linear: bool = False) -> Any:
    def extra(node: Any, members: int, given: Any) -> list[Strategy]:
        if linear and node.attrs.get("op") == "sum":
            return _placements.partial_through(node, given, (0,))
        return []

    return _placements.rule(dims, extra, build=_again)


def _p2p_rule(node: Any, members: int, given: Any) -> list[Strategy]:
    """A transfer of a split program splits whole: every member sends (receives) the whole tensor."""
    return [Strategy(tuple(REPLICATE for _ in node.inputs), tuple(REPLICATE for _ in node.outputs), "whole", _again)]


def _group(call: OpCall) -> tuple[int, ...]:
    """Validate and canonicalise attrs['group'] (sorted ranks, including this one)."""
    graph = call.graph
    group = call.attrs["group"]
    if group is None:
        group = tuple(range(graph.world_size))
    if not all(isinstance(r, (int, np.integer)) and not isinstance(r, bool) for r in group):
        raise call.error(RankError, f"group {group!r} must list integer ranks")
    group = tuple(sorted(set(int(r) for r in group)))
    bad = [r for r in group if not 0 <= r < graph.world_size]
    if bad:
        raise call.error(
            RankError, f"group {list(group)} names rank(s) {bad} outside the world of {graph.world_size} rank(s)"
        )
    if graph.rank not in group:
        raise call.error(
            RankError,
            f"this graph is rank {graph.rank}, which is not in group {list(group)}",
            hint="only members of a group take part in its collectives",
        )
    call.attrs["group"] = group
    return group


def group_arg(op: OpDef, group: Any) -> tuple[int, ...] | None:
    """A builder's ``group`` argument: None (every rank) or a tuple or list of integer ranks."""
    if group is None:
        return None
    try:
        return as_ints(group, f"{op.name}: group", error=RankError)
    except RankError as e:
        raise RankError(f"{e}; group must list integer ranks, e.g. group=(0, 1)") from None


def _reduce_order(values: list[np.ndarray], op: str) -> np.ndarray:
    acc = values[0].astype(np.int64) if values[0].dtype.kind in "iu" else to_compute(values[0]).copy()
    for v in values[1:]:
        v = v.astype(np.int64) if v.dtype.kind in "iu" else to_compute(v)
        acc = acc + v if op == "sum" else np.maximum(acc, v)
    return acc


def _check_reduce_op(call: OpCall) -> None:
    if call.attrs["op"] not in REDUCE_OPS:
        raise call.error(GraphBuildError, f"op must be one of {REDUCE_OPS}, got {call.attrs['op']!r}")
    check_kinds(call, call.dtype(0), "fi")


# ---- vector-Jacobian rules: each collective's is its adjoint, run by every member alike ----------


def _all_reduce_vjp(call: VjpCall) -> list[Tensor]:
    if call.attrs["op"] != "sum":
        raise GraphBuildError(
            f"grad: all_reduce {call.node.name} takes the max over ranks, which has no gradient rule "
            "(only op='sum' does)"
        )
    return [apply(ALL_REDUCE, [call.cotangent()], op="sum", group=call.attrs["group"])]


def _all_gather_vjp(call: VjpCall) -> list[Tensor]:
    attrs = call.attrs
    return [apply(REDUCE_SCATTER, [call.cotangent()], axis=attrs["axis"], op="sum", group=attrs["group"])]


def _reduce_scatter_vjp(call: VjpCall) -> list[Tensor]:
    attrs = call.attrs
    if attrs["op"] != "sum":
        raise GraphBuildError(f"grad: reduce_scatter {call.node.name} takes a max, which has no gradient rule")
    return [apply(ALL_GATHER, [call.cotangent()], axis=attrs["axis"], group=attrs["group"])]


def _send_vjp(call: VjpCall) -> list[Tensor]:
    """The gradient of what was sent comes back from the receiver, under the same tag."""
    x = call.inputs[0]
    return [recv(call.graph, call.attrs["dst"], x.shape, x.dtype, tag=call.attrs["tag"])]


def _recv_vjp(call: VjpCall) -> list[Tensor]:
    send(call.cotangent(), call.attrs["src"], tag=call.attrs["tag"])
    return []


# ---- all_reduce ---------------------------------------------------------------------------------


def _all_reduce_infer(call: OpCall) -> list[OutSpec]:
    _group(call)
    _check_reduce_op(call)
    return [OutSpec(call.shape(0), call.dtype(0))]


def _all_reduce_ref(members: list[np.ndarray], attrs: dict[str, Any]) -> list[np.ndarray]:
    total = _reduce_order(members, attrs["op"])
    return [total for _ in members]


ALL_REDUCE = register(
    OpDef(
        name="all_reduce",
        kind="collective",
        category="collective",
        doc="Every member gets the elementwise sum (or max) of all members' x, combined in rank order.",
        operands=("x",),
        attrs={"op": REDUCE_OPS, "group": "ranks?"},
        infer=_all_reduce_infer,
        reference=_all_reduce_ref,
        accuracy=Accuracy(ulps=1.0, per_reduction=True),
        tiling=_tilings.ALL_REDUCE,
        lowering=Lowering("all_reduce"),
        placement=_collective_rule(_placements.aligned_dims, linear=True),
        vjp=lambda call: _all_reduce_vjp(call),
    )
)


# Above this size, with more than two members, an all-reduce runs as reduce-scatter then all-gather:
# each rank then moves 2 (n - 1) / n of the tensor instead of (n - 1) times it. With two members both
# move the same bytes and the one-shot form has one step fewer.
TWO_STEP_MIN_BYTES = 1 << 20
ALGORITHMS = ("auto", "one_shot", "two_step")


def all_reduce(x: Tensor, op: str = "sum", *, group: Sequence[int] | None = None, algorithm: str = "auto") -> Tensor:
    """``algorithm``: "one_shot" (every rank reads every member's x), "two_step" (reduce_scatter of the
    flattened x, then all_gather; its size must divide by the group size), or "auto" (two_step for
    more than two members and at least TWO_STEP_MIN_BYTES). All give bitwise the same result: each
    element is combined in rank order and rounded once."""
    require_tensor(ALL_REDUCE, "x", x)
    group = group_arg(ALL_REDUCE, group)
    if algorithm not in ALGORITHMS:
        raise GraphBuildError(f"all_reduce: algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    members = len(group) if group is not None else x.graph.world_size
    fits = x.size % members == 0
    if algorithm == "two_step" and not fits:
        raise ShapeError(
            f"all_reduce: algorithm='two_step' cuts x (shape {format_shape(x.shape)}, {x.size} elements) into "
            f"{members} equal parts; {x.size} does not divide by {members}. Use algorithm='one_shot'"
        )
    two_step = algorithm == "two_step" or (
        algorithm == "auto" and members > 2 and fits and x.size * x.dtype.itemsize >= TWO_STEP_MIN_BYTES
    )
    if not two_step:
        return apply(ALL_REDUCE, [x], op=op, group=group)
    part = reduce_scatter(x.reshape(-1), axis=0, op=op, group=group)
    return all_gather(part, axis=0, group=group).reshape(x.shape)


# ---- all_gather ----------------------------------------------------------------------------------


def _all_gather_infer(call: OpCall) -> list[OutSpec]:
    group = _group(call)
    x = call.operands[0]
    axis = call.attrs["axis"] = call.axis(call.attrs["axis"], x.ndim)
    shape = x.shape[:axis] + (x.shape[axis] * len(group),) + x.shape[axis + 1 :]
    return [OutSpec(shape, x.dtype)]


ALL_GATHER = register(
    OpDef(
        name="all_gather",
        kind="collective",
        category="collective",
        doc="Every member gets all members' x concatenated along axis, in rank order.",
        operands=("x",),
        attrs={"axis": "int", "group": "ranks?"},
        infer=_all_gather_infer,
        reference=lambda members, attrs: [np.concatenate(members, axis=attrs["axis"])] * len(members),
        accuracy=Accuracy(ulps=0.0),
        tiling=_tilings.ALL_GATHER,
        lowering=Lowering("all_gather"),
        placement=_collective_rule(lambda node: _placements.along_dims(node, node.attrs["axis"])),
        vjp=lambda call: _all_gather_vjp(call),
    )
)


def all_gather(x: Tensor, axis: int = 0, *, group: Sequence[int] | None = None) -> Tensor:
    return apply(ALL_GATHER, [x], axis=axis, group=group_arg(ALL_GATHER, group))


# ---- reduce_scatter ------------------------------------------------------------------------------


def _reduce_scatter_infer(call: OpCall) -> list[OutSpec]:
    group = _group(call)
    _check_reduce_op(call)
    x = call.operands[0]
    axis = call.attrs["axis"] = call.axis(call.attrs["axis"], x.ndim)
    if x.shape[axis] % len(group):
        raise call.error(
            ShapeError,
            f"axis {axis} has size {x.shape[axis]}, not divisible by the group size {len(group)}",
            hint="pad or pick another axis",
        )
    shape = x.shape[:axis] + (x.shape[axis] // len(group),) + x.shape[axis + 1 :]
    return [OutSpec(shape, x.dtype)]


def _reduce_scatter_ref(members: list[np.ndarray], attrs: dict[str, Any]) -> list[np.ndarray]:
    total = _reduce_order(members, attrs["op"])
    return np.split(total, len(members), axis=attrs["axis"])


REDUCE_SCATTER = register(
    OpDef(
        name="reduce_scatter",
        kind="collective",
        category="collective",
        doc="Sum (or max) all members' x in rank order, cut it along axis into group-size "
        "pieces; the i-th member of the group gets piece i.",
        operands=("x",),
        attrs={"axis": "int", "op": REDUCE_OPS, "group": "ranks?"},
        infer=_reduce_scatter_infer,
        reference=_reduce_scatter_ref,
        accuracy=Accuracy(ulps=1.0, per_reduction=True),
        tiling=_tilings.REDUCE_SCATTER,
        lowering=Lowering("reduce_scatter"),
        placement=_collective_rule(lambda node: _placements.along_dims(node, node.attrs["axis"]), linear=True),
        vjp=lambda call: _reduce_scatter_vjp(call),
    )
)


def reduce_scatter(x: Tensor, axis: int = 0, op: str = "sum", *, group: Sequence[int] | None = None) -> Tensor:
    return apply(REDUCE_SCATTER, [x], axis=axis, op=op, group=group_arg(REDUCE_SCATTER, group))


# ---- send / recv ---------------------------------------------------------------------------------


def _peer(call: OpCall, key: str) -> int:
    graph = call.graph
    peer = call.attrs[key]
    if not 0 <= peer < graph.world_size:
        raise call.error(RankError, f"{key} rank {peer} is unknown in a world of {graph.world_size} rank(s)")
    if peer == graph.rank:
        raise call.error(
            RankError, f"rank {graph.rank} cannot {call.op.name} to itself", hint="use the tensor directly"
        )
    return peer


def _send_infer(call: OpCall) -> list[OutSpec]:
    _peer(call, "dst")
    return []


def _recv_infer(call: OpCall) -> list[OutSpec]:
    _peer(call, "src")
    return [OutSpec(call.attrs["shape"], call.attrs["dtype"])]


SEND = register(
    OpDef(
        name="send",
        kind="p2p",
        category="collective",
        doc="Hand x to rank dst; matches the recv on dst with the same source and tag, in order.",
        operands=("x",),
        attrs={"dst": "rank", "tag": "int"},
        infer=_send_infer,
        reference=None,
        accuracy=Accuracy(ulps=0.0),
        tiling=_tilings.SEND,  # planned only when the recv pushes (its tile parameter push)
        lowering=Lowering("send"),
        placement=_p2p_rule,
        vjp=lambda call: _send_vjp(call),
    )
)
RECV = register(
    OpDef(
        name="recv",
        kind="p2p",
        category="collective",
        doc="Receive the tensor that rank src sends with the same tag (shape and dtype declared "
        "here must match the send).",
        operands=(),
        attrs={"src": "rank", "tag": "int", "shape": "shape", "dtype": "dtype"},
        infer=_recv_infer,
        reference=None,
        accuracy=Accuracy(ulps=0.0),
        tiling=_tilings.RECV,
        lowering=Lowering("recv"),
        placement=_p2p_rule,
        vjp=lambda call: _recv_vjp(call),
    )
)


def send(x: Tensor, dst: int, *, tag: int = 0) -> None:
    require_tensor(SEND, "x", x)
    apply_multi(SEND, [x], dst=require_int(SEND, "dst", dst), tag=require_int(SEND, "tag", tag))


def recv(graph: Any, src: int, shape: Sequence[int], dtype: DType | str, *, tag: int = 0) -> Tensor:
    """Receive from rank ``src`` into a new tensor of this ``graph``."""
    if not isinstance(graph, Graph):
        raise GraphBuildError(f"recv: first argument must be the receiving Graph, got {type(graph).__name__}")
    attrs = {
        "src": require_int(RECV, "src", src),
        "tag": require_int(RECV, "tag", tag),
        "shape": require_shape(RECV, "shape", shape),
        "dtype": as_dtype(dtype),
    }
    (out,) = graph.apply(RECV, [], attrs)
    return out

"""The tile templates: what each ``Lowering.template`` name of an OpDef (megaloop/frontend/opdef.py)
becomes in the loop kernel. A template takes one plan op (``TileCall``) and gives its tile function's
body, the dynamic shared memory it needs and, for ops that read other ranks' memory, whose tensors
its operand slots hold (``Lowered``). megaloop/codegen/kernel.py looks the template up by the name
the OpDef gives and names no op itself; adding an op with an existing template touches no codegen.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megaloop.codegen import emit_collective, emit_optim, emit_sample
from megaloop.codegen.abi import MAX_OPERANDS
from megaloop.codegen.emit import (
    Operand,
    concat,
    elementwise,
    embedding,
    fused_elementwise,
    kv_update,
    rope,
    rope_kv_update,
    rope_table,
    scatter_add,
    step_batch,
)
from megaloop.codegen.emit_attention import attention, attention_combine, attention_partial, attention_shared_bytes
from megaloop.codegen.emit_attention_grad import attention_grad
from megaloop.codegen.emit_loss import cross_entropy
from megaloop.codegen.emit_matmul import matmul, matmul_shared_bytes, ring_stream
from megaloop.codegen.emit_norm_linear import rmsnorm_linear
from megaloop.codegen.emit_paged import (
    paged_attention,
    paged_attention_shared_bytes,
    paged_kv_update,
    rope_paged_kv_update,
)
from megaloop.codegen.emit_reduce import argmax_combine, argmax_partial, reduction
from megaloop.codegen.emit_rows import rows, rows_shared_bytes
from megaloop.codegen.emit_swiglu import swiglu_linear
from megaloop.codegen.exchange import all_reduce_push
from megaloop.errors import GraphBuildError
from megaloop.frontend.opdef import REGISTRY, OpDef
from megaloop.frontend.tiling import PEER_SEND
from megaloop.plan.model import Plan, PlanOp
from megaloop.plan.tasks import peer_operand, peer_output


@dataclass(frozen=True)
class TileCall:
    """One plan op as its template sees it: the plan and rank, the op and its OpDef, its operands'
    layouts, and what its tasks' boxes say about its tiles."""

    plan: Plan
    rank: int
    op: PlanOp
    opdef: OpDef
    ins: list[Operand]
    outs: list[Operand]
    largest: int  # elements of its largest tile (the box a task writes)
    extent: tuple[int, int]  # its largest tile's rows (all its batch indices) and columns
    inbox: Any  # the pushing all_reduce's inboxes (megaloop/plan/rendezvous.py), or None
    ring_slot_bytes: int = 0  # the weight ring's slot (megaloop/ring.cuh); 0: no ring in this kernel

    @property
    def attrs(self) -> dict[str, Any]:
        return self.op.attrs

    def block_hints(self) -> dict[str, Any]:
        """The block the tiles run on and their size: for templates that size their paths to them."""
        plan = self.plan
        return {"shared_memory": plan.shared_memory, "threads": 32 * plan.warps, "elements": self.largest}


@dataclass(frozen=True)
class Lowered:
    """A template's result: the tile function's body, its dynamic shared memory, and (for ops reading
    other ranks) the (rank, tensor id) of each operand slot, in slot order (None: the op's inputs, then
    its outputs, all on this rank)."""

    body: list[str]
    shared_bytes: int = 0
    slots: list[tuple[int, int]] | None = None
    ring: tuple[RingStream, ...] = ()  # the weight rows its tiles stream, in the order they read them


@dataclass(frozen=True)
class RingStream:
    """What a weight-ring tile streams: operand ``operand``'s rows for the columns of its box (the
    output's last axis), ``row_bytes`` each, ``stride`` bytes apart, ``per_chunk`` rows a slot."""

    operand: int
    row_bytes: int
    stride: int
    per_chunk: int


Template = Callable[[TileCall], Lowered]


def _with(call: TileCall, hints: dict[str, Any]) -> dict[str, Any]:
    return {**call.attrs, "codegen": hints}


def _fused_elementwise(call: TileCall) -> Lowered:
    def expression_of(step: dict[str, Any]) -> str:
        return REGISTRY[step["op"]].lowering.expression(step["attrs"])  # type: ignore[union-attr]

    attrs = _with(call, call.block_hints())
    return Lowered(fused_elementwise(call.op.op, attrs, call.ins, call.outs[0], expression_of))


def _elementwise(call: TileCall) -> Lowered:
    expr = call.opdef.lowering.expression(call.attrs)  # type: ignore[union-attr]
    return Lowered(elementwise(call.op.op, _with(call, call.block_hints()), expr, call.ins, call.outs[0]))


def _rows(call: TileCall) -> Lowered:
    attrs = _with(call, call.block_hints())
    body = rows(call.op.op, attrs, call.ins, call.outs[0])
    return Lowered(body, rows_shared_bytes(call.op.op, attrs, call.ins, call.outs[0]))


def _matmul_hints(call: TileCall, operands: int = 2) -> dict[str, Any]:
    """What a matmul-like op's emitter needs beyond its operands: tile switches, the widest tile, the
    block and the weight ring, whether B (operand 1) is a parameter and its first operands aligned."""
    plan, op = call.plan, call.op
    return {
        "tensor_cores": op.tile.get("tensor_cores", 0),
        "skinny_mma": op.tile.get("skinny_mma", 0),
        "fold_batch": op.tile.get("fold_batch", 0),
        "wgmma": op.tile.get("wgmma", 0),
        "tile": call.extent,
        "arch": plan.arch,
        "shared_memory": plan.shared_memory or 0,
        # B a parameter: weights, read once a step (streamed past L2's other contents)
        "b_parameter": plan.ranks[call.rank].is_parameter(op.inputs[1]),
        "warps": plan.warps,
        "ring_slot_bytes": call.ring_slot_bytes,
        "aligned": all(_arena_offset(plan, call.rank, t) % 16 == 0 for t in op.inputs[:operands]),
    }


def _matmul(call: TileCall) -> Lowered:
    attrs = _with(call, _matmul_hints(call))
    body = matmul(call.op.op, attrs, call.ins[0], call.ins[1], call.outs[0])
    ring = ring_stream(attrs, call.ins[0], call.ins[1], call.outs[0])
    stream = (RingStream(1, *ring),) if ring else ()
    return Lowered(body, 0 if ring else matmul_shared_bytes(attrs, call.ins, call.outs[0]), ring=stream)


def _rmsnorm_linear(call: TileCall) -> Lowered:
    body, shared, ring = rmsnorm_linear(_with(call, _matmul_hints(call, len(call.ins))), call.ins, call.outs[0])
    return Lowered(body, shared, ring=(RingStream(1, *ring),) if ring else ())


def _swiglu_linear(call: TileCall) -> Lowered:
    hints = _matmul_hints(call, len(call.ins))
    rp = call.plan.ranks[call.rank]
    hints["b_parameter"] = all(rp.is_parameter(t) for t in call.op.inputs[1:3])  # gate and up
    body, shared, rings = swiglu_linear(_with(call, hints), call.ins, call.outs[0])
    return Lowered(body, shared, ring=tuple(RingStream(slot, *r) for slot, r in zip((1, 2), rings)))


def _arena_offset(plan: Plan, rank: int, tid: int) -> int:
    """Where tensor ``tid`` of rank ``rank`` starts in its arena, in bytes."""
    owner = plan.ranks[rank]
    t = owner.tensors[tid]
    return owner.buffers[t.buffer].offset + t.offset * t.dtype.itemsize


def _attention_hints(call: TileCall) -> dict[str, Any]:
    """The block, its shared memory, the decode tile the options ask for and the tiles' most rows."""
    plan = call.plan
    return {
        "warps": plan.warps,
        "shared_memory": plan.shared_memory or 0,
        "decode_attention": plan.options.decode_attention,
        "rows": call.extent[0],  # (heads x queries of a tile)
    }


def _attention_with(emitter: Callable[..., list[str]], limits: bool) -> Template:
    def template(call: TileCall) -> Lowered:
        if not limits:
            return Lowered(emitter(call.op.op, call.attrs, call.ins, call.outs[0]))
        attrs = _with(call, _attention_hints(call))
        body = emitter(call.op.op, attrs, call.ins, call.outs[0])
        return Lowered(body, attention_shared_bytes(attrs, call.ins, call.plan.warps))

    return template


def _paged_attention(call: TileCall) -> Lowered:
    attrs = _with(call, _attention_hints(call))
    body = paged_attention(call.op.op, attrs, call.ins, call.outs[0])
    return Lowered(body, paged_attention_shared_bytes(attrs, call.ins))


def _sample(name: str) -> Template:
    def template(call: TileCall) -> Lowered:
        body = emit_sample.tile(name, call.attrs, call.ins, call.outs[0])
        return Lowered(body, emit_sample.shared_bytes(name, call.attrs))

    return template


def _constants(call: TileCall) -> str:
    """The C++ constants an optimizer op's Lowering gives for its attributes."""
    return call.opdef.lowering.expression(call.attrs)  # type: ignore[union-attr]


def _optim_update(call: TileCall) -> Lowered:
    attrs = _with(call, call.block_hints())
    return Lowered(emit_optim.update(call.op.op, attrs, _constants(call), call.ins, call.outs[0]))


def _group(call: TileCall) -> list[tuple[int, int]]:
    """(rank, tensor id on that rank) of every member's operand a collective reads, in group order."""
    plan, rank, op = call.plan, call.rank, call.op
    node = plan.ranks[rank].graph.nodes[op.node]  # type: ignore[index]
    return [(m, peer_operand(plan, rank, node, 0, m)) for m in op.attrs["group"]]


def _source(call: TileCall) -> list[tuple[int, int]]:
    """(rank, tensor id there) of what a recv reads: the matched send's input."""
    plan, rank, src = call.plan, call.rank, call.op.attrs["src"]
    node = plan.ranks[rank].graph.nodes[call.op.node]  # type: ignore[index]
    return [(src, peer_operand(plan, rank, node, PEER_SEND, src))]


Members = Callable[[TileCall], list[tuple[int, int]]]
Exchange = Callable[[TileCall, list[tuple[int, Operand]], Operand], list[str]]


def _exchange(emitter: Exchange, members_of: Members = _group) -> Template:
    """A tile that reads the members' tensors in their own arenas (slots: the members', then out)."""

    def template(call: TileCall) -> Lowered:
        op = call.op
        members = members_of(call)
        if len(members) + 1 > MAX_OPERANDS:
            raise GraphBuildError(
                f"codegen: {op.op} {op.name} reads {len(members)} ranks; the loop kernel takes at most "
                f"{MAX_OPERANDS - 1} members per collective"
            )
        operands = [(m, _operand(call.plan, m, tid)) for m, tid in members]
        slots = members + [(call.rank, t) for t in op.outputs]
        return Lowered(emitter(call, operands, call.outs[0]), slots=slots)

    return template


def _operand(plan: Plan, rank: int, tid: int) -> Operand:
    t = plan.ranks[rank].tensors[tid]
    return Operand(t.dtype, t.shape, t.strides)


def _all_reduce(call: TileCall) -> Lowered:
    if call.inbox is None:  # pulled: every member's tensor read over the peer link
        return _exchange(lambda c, ms, out: emit_collective.all_reduce(c.attrs, ms, out))(call)
    op, group = call.op, tuple(call.attrs["group"])
    if len(group) + 2 > MAX_OPERANDS:
        raise GraphBuildError(
            f"codegen: all_reduce {op.name} pushes to {len(group)} ranks; the loop kernel takes at most "
            f"{MAX_OPERANDS - 2} members per pushing all_reduce (set its tile parameter push to 0)"
        )
    body = all_reduce_push(call.attrs, group, call.rank, call.ins[0], call.outs[0], call.inbox)
    return Lowered(body)  # (slots: x, out, then the members' inboxes: kernel.py)


def _send(call: TileCall) -> Lowered:
    """A pushing recv's send: stores its tiles into the recv's output on dst (slots: x, that output)."""
    op = call.op
    dst, out_tid = peer_output(call.plan, call.plan.ranks[call.rank].graph.nodes[op.node])  # type: ignore[index]
    body = emit_collective.send(op.attrs, call.ins[0], _operand(call.plan, dst, out_tid), dst)
    return Lowered(body, slots=[(call.rank, op.inputs[0]), (dst, out_tid)])


def _plain(emitter: Callable[..., list[str]], hints: bool = False) -> Template:
    """Templates whose emitter takes (op, attrs, *operands, out)."""

    def template(call: TileCall) -> Lowered:
        attrs = _with(call, call.block_hints()) if hints else call.attrs
        return Lowered(emitter(call.op.op, attrs, *call.ins, call.outs[0]))

    return template


TEMPLATES: dict[str, Template] = {
    "elementwise": _elementwise,
    "fused_elementwise": _fused_elementwise,
    "reduction": lambda c: Lowered(reduction(c.op.op, c.attrs, c.ins[0], c.outs[0])),
    "argmax_partial": lambda c: Lowered(argmax_partial(c.attrs, c.ins[0], c.outs[0])),
    "argmax_combine": lambda c: Lowered(argmax_combine(c.attrs, c.ins[0], c.ins[1], c.outs[0])),
    "rows": _rows,
    "matmul": _matmul,
    "rmsnorm_linear": _rmsnorm_linear,
    "swiglu_linear": _swiglu_linear,
    "embedding": _plain(embedding),
    "scatter_add": _plain(scatter_add),
    "step_batch": _plain(step_batch),
    "cross_entropy": lambda c: Lowered(cross_entropy(c.op.op, c.attrs, c.ins, c.outs[0])),
    "rope": _plain(rope, hints=True),
    "rope_table": _plain(rope_table),
    "kv_update": _plain(kv_update, hints=True),
    "rope_kv_update": _plain(rope_kv_update),
    "concat": lambda c: Lowered(concat(c.op.op, c.attrs, c.ins, c.outs[0])),
    "attention": _attention_with(attention, limits=True),
    "attention_partial": _attention_with(attention_partial, limits=True),
    "attention_combine": _attention_with(attention_combine, limits=False),
    "attention_grad": lambda c: Lowered(attention_grad(c.op.op, c.attrs, c.ins, c.outs[0])),
    "paged_attention": _paged_attention,
    "paged_kv_update": lambda c: Lowered(paged_kv_update(c.op.op, c.attrs, c.ins, c.outs[0])),
    "rope_paged_kv_update": lambda c: Lowered(rope_paged_kv_update(c.op.op, c.attrs, c.ins, c.outs[0])),
    "sample": _sample("sample"),
    "sample_partial": _sample("sample_partial"),
    "sample_combine": _sample("sample_combine"),
    "penalize": _sample("penalize"),
    "optim_update": _optim_update,
    "square_sum": lambda c: Lowered(emit_optim.square_sum(c.attrs, c.ins[0], c.outs[0]), emit_optim.SQUARE_SUM_SHARED),
    "lr_schedule": lambda c: Lowered(emit_optim.lr_schedule(_constants(c), c.ins[0], c.outs[0])),
    "all_reduce": _all_reduce,
    "all_gather": _exchange(lambda c, ms, out: emit_collective.all_gather(c.attrs, ms, out)),
    "reduce_scatter": _exchange(lambda c, ms, out: emit_collective.reduce_scatter(c.attrs, ms, out, c.rank)),
    "recv": _exchange(lambda c, ms, out: emit_collective.recv(c.attrs, ms, out), _source),
    "send": _send,
}

"""Tile tasks: each plan op's tiling, turned into tasks whose reads and writes name plan tensors
(on this rank or, for collectives and recv, on the peer that holds the data), with cost estimates."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

from megaloop.errors import InternalError
from megaloop.frontend.graph import Node
from megaloop.frontend.opdef import REGISTRY
from megaloop.frontend.tiling import PEER_RECV, PEER_SEND, TileContext
from megaloop.plan.model import Access, Plan, PlanOp, RankPlan, Task
from megaloop.plan.schedule import task_cost_ns


def peer_operand(plan: Plan, rank: int, node: Node, operand: int, member: int) -> int:
    """Tensor id, in rank ``member``'s plan, of what ``node`` (on ``rank``) reads there: operand
    ``operand`` of the member's copy of a collective, or the matched send's input for a recv."""
    m = plan.matching
    if operand == PEER_SEND:
        transfer = m.transfer_of[node]
        return plan.ranks[transfer.src].tensor_of[transfer.send.inputs[0]]
    c = m.collective_of[node]
    peer_node = c.nodes[c.group.index(member)]
    return plan.ranks[member].tensor_of[peer_node.inputs[operand]]


def peer_output(plan: Plan, node: Node) -> tuple[int, int]:
    """(rank, tensor id there) that a pushing send's tiles write: the matched recv's output."""
    transfer = plan.matching.transfer_of[node]
    return transfer.dst, plan.ranks[transfer.dst].tensor_of[transfer.recv.outputs[0]]


def op_node(rp: RankPlan, op: PlanOp) -> Any:
    """The graph node an op came from; for a plan-made copy, a stand-in with its plan tensors as input
    and output (shapes and dtypes: all a tiling function looks at)."""
    if op.node is not None:
        return rp.graph.nodes[op.node]
    return SimpleNamespace(
        inputs=[rp.tensors[t] for t in op.inputs], outputs=[rp.tensors[t] for t in op.outputs], attrs={}
    )


def tiles_of(plan: Plan, rank: int, op: PlanOp) -> list[Any]:
    rp = plan.ranks[rank]
    ctx = TileContext(rank, plan.world_size, plan.processors, plan.warps, processor_share(rp, op))
    return REGISTRY[op.op].tiling.make(op_node(rp, op), op.tile, ctx)


def processor_share(rp: RankPlan, op: PlanOp) -> float:
    """The part of the processors a matmul against weights can count on when it sizes its tiles: its
    share, by output elements, among the matmuls of the same input against weights (the q, k and v
    projections; gate and up). They become ready together, so tiles each sized to fill every processor
    would make two rounds of tasks between them (a decode step's q, k, v: 128 + 64 + 64 tiles on 132
    processors) where one would do. The matmul tile switch ``share`` (1 by default) decides whether its
    tiling uses it."""
    if not _shares(op) or len(op.inputs) < 2 or not rp.is_parameter(op.inputs[1]):
        return 1.0
    # against weights, reading the same activations (a norm's residual too): none can wait for another
    # (a B, or a residual, computed from a sibling's output would)
    rows = _activations(rp, op)
    siblings = [
        o
        for o in rp.ops
        if _shares(o)
        and len(o.inputs) > 1
        and o.inputs[0] == op.inputs[0]
        and rp.is_parameter(o.inputs[1])
        and _activations(rp, o) == rows
    ]
    if len(siblings) < 2:
        return 1.0
    size = {o.id: math.prod(rp.tensors[o.outputs[0]].shape) for o in siblings}
    return size[op.id] / sum(size.values())


def _activations(rp: RankPlan, op: PlanOp) -> list[int]:
    """The op's operands that are no parameters (a product's rows, and a norm's residual), in order."""
    return [t for t in op.inputs if not rp.is_parameter(t)]


def _shares(op: PlanOp) -> bool:
    """Whether the op's tiling sizes its tiles by a share of the processors (it has the switch ``share``)."""
    return "share" in REGISTRY[op.op].tiling.params


def make_tasks(plan: Plan) -> None:
    for rank, rp in enumerate(plan.ranks):
        rp.tasks = []
        for op in rp.ops:
            rp.tasks.extend(tasks_of_op(plan, rank, op, first_id=len(rp.tasks)))


def tasks_of_op(plan: Plan, rank: int, op: PlanOp, first_id: int) -> list[Task]:
    rp = plan.ranks[rank]
    node = op_node(rp, op)
    out = []
    for k, tile in enumerate(tiles_of(plan, rank, op)):
        reads = []
        local = remote = 0
        for rd in tile.reads:
            owner = rank if rd.rank is None else rd.rank
            if owner == rank and rd.operand != PEER_SEND:
                tid = op.inputs[rd.operand]
            elif op.node is not None:
                tid = peer_operand(plan, rank, node, rd.operand, owner)
            else:
                raise InternalError(f"{op.name}: a plan-made op cannot read another rank")
            reads.append(Access(tid, rd.box, owner))
            nbytes = rd.box.size * plan.ranks[owner].tensors[tid].dtype.itemsize
            if owner == rank:
                local += nbytes
            else:
                remote += nbytes
        writes = []
        for w in tile.writes:
            if w.output == PEER_RECV:  # a pushing send: into the recv's output on its rank
                dst, tid = peer_output(plan, node)
                writes.append(Access(tid, w.box, dst))
            else:
                writes.append(Access(op.outputs[w.output], w.box, rank))
                local += w.box.size * rp.tensors[op.outputs[w.output]].dtype.itemsize
        if tile.moved is not None:  # the declared boxes over-approximate what a gather touches
            local = tile.moved
        remote += tile.pushed
        hbm = local - tile.streamed + tile.streamed_once  # blocks other tiles share: this tile's share of HBM
        cost = task_cost_ns(plan.arch, plan.processors, hbm, remote, tile.flops, tile.streamed)
        out.append(Task(first_id + k, op.id, tile.coords, reads, writes, tile.flops, local + remote, cost))
    return out

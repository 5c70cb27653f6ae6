"""A split training step's per-rank work after the forward is split (megaloop.parallel.training):
weights become states, ``grad`` adds each rank's backward, the gradients of pieces that several
ranks hold are summed over those ranks (bucketed all-reduces, or ZeRO's reduce-scatter), and the
optimizer updates each rank's pieces (or, under ZeRO, its shard of them, then gathers them back).

Why one rule for every kind of split: rank r's loss is a function of its own copy of each weight
piece, and the ranks' losses (each seeded with 1 / the number of ranks holding the loss) sum to one
device's. So the gradient of a piece is the sum, over the ranks holding that same piece, of their
local gradients: the data-parallel group for a replicated weight, the tensor-parallel group for a
norm weight every tensor-parallel rank holds whole, nothing for a column of a cut matrix, the stages
of a pipeline that read one tied table.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import megaloop.frontend.ops as ops
from megaloop.errors import GraphBuildError
from megaloop.frontend.autodiff import grad
from megaloop.frontend.graph import Graph
from megaloop.frontend.tensor import Tensor
from megaloop.optim import NormOver, OptimizerSpec
from megaloop.parallel.shard import Box, Part

CONCAT_MAX = 15  # operands of one concat (the loop kernel's ops take at most 16)


@dataclass(frozen=True)
class Piece:
    """A weight piece a rank holds: the original parameter's name and the box it covers."""

    name: str
    box: Box

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(hi - lo for lo, hi in self.box)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


@dataclass
class Bucket:
    """Gradients exchanged together: the pieces (in order), their group, where each sits in the flat
    buffer; under ZeRO, the padded length and the name of the float32 shard state each member keeps."""

    index: int
    group: tuple[int, ...]
    pieces: list[Piece]
    dtype: Any
    offsets: list[int]
    length: int  # elements, padded to a multiple of the group under ZeRO
    shard_state: str = ""

    @property
    def nbytes(self) -> int:
        return self.length * self.dtype.itemsize


@dataclass
class RankStep:
    """What one rank's training step holds besides its forward."""

    weights: dict[str, Piece] = field(default_factory=dict)  # local state name -> piece
    optimizer: Any = None
    grad_bytes: int = 0  # the gradients the optimizer reads (after the exchange)
    shards: dict[str, tuple[Bucket, int]] = field(default_factory=dict)  # shard state -> (bucket, member)


def weights_to_states(part: Part) -> dict[str, Piece]:
    """Each parameter of the rank's graph becomes a state of the same name (the optimizer updates it
    in place); returns local name -> piece."""
    g = part.graph
    swap: dict[Tensor, Tensor] = {}
    table: dict[str, Piece] = {}
    for node, info in list(part.sources.items()):
        if info.kind != "parameter":
            continue
        name, t = node.attrs["name"], node.outputs[0]
        if name in g.states:
            raise GraphBuildError(f"parallelize_training: parameter {name!r} has the name of a state of {g.name!r}")
        swap[t] = g.state(name, t.shape, t.dtype)
        table[name] = Piece(info.name, info.box)
        del part.sources[node]
        part.origin[swap[t].node] = part.origin.get(node, node)
    if not swap:
        return table
    for n in g.nodes:
        if any(x in swap for x in n.inputs):
            n.inputs = tuple(swap.get(x, x) for x in n.inputs)
    for tbl in (g.outputs, g.state_updates):
        for k, v in tbl.items():
            tbl[k] = swap.get(v, v)
    new = [s.node for s in swap.values()]
    gone = {t.node for t in swap}
    g.reorder(new + [n for n in g.nodes if n not in gone and n not in set(new)])
    for t in swap:
        del g.parameters[t.node.attrs["name"]]
    return table


def backward(part: Part, loss_name: str, loss_holders: int, weights: Mapping[str, Piece]) -> dict[str, Tensor]:
    """The rank's backward: its loss (if it holds one) seeded with 1 / ``loss_holders``; gradients of
    its float weight states by local name."""
    g = part.graph
    losses = {t for local, t in g.outputs.items() if part.outputs.get(local, ("",))[0] == loss_name}
    if len(losses) > 1:
        raise GraphBuildError(f"parallelize_training: rank {g.rank} holds {len(losses)} different loss tensors")
    loss = next(iter(losses), None)
    names = [n for n in weights if g.states[n].dtype.is_float]
    found = grad(g, loss, [g.states[n] for n in names], seed=None if loss is None else 1.0 / loss_holders)
    return dict(zip(names, found))


def make_buckets(
    holders: Mapping[Piece, tuple[int, ...]],
    order: Mapping[str, int],
    dtypes: Mapping[Piece, Any],
    bucket_bytes: int,
    zero: int,
    decay: Mapping[str, float],
) -> list[Bucket]:
    """Buckets of the pieces held by more than one rank: each group's pieces in reverse program
    order (the backward makes the last layer's gradients first), cut at ``bucket_bytes``; under ZeRO
    a bucket's pieces share a weight decay (its shard is one optimizer parameter)."""
    by_group: dict[tuple, list[Piece]] = {}
    for piece, group in holders.items():
        if len(group) > 1:
            key = (group, dtypes[piece].name, decay.get(piece.name, 0.0) if zero else 0.0)
            by_group.setdefault(key, []).append(piece)
    out: list[Bucket] = []
    for (group, _, _), pieces in sorted(by_group.items(), key=lambda kv: -max(order[p.name] for p in kv[1])):
        pieces.sort(key=lambda p: (-order[p.name], p.box))
        dtype = dtypes[pieces[0]]
        current: list[Piece] = []
        for piece in pieces:
            if current and (sum(p.size for p in current) + piece.size) * dtype.itemsize > bucket_bytes:
                out.append(_bucket(len(out), group, current, dtype, zero))
                current = []
            current.append(piece)
        if current:
            out.append(_bucket(len(out), group, current, dtype, zero))
    return out


def _bucket(index: int, group: tuple[int, ...], pieces: list[Piece], dtype: Any, zero: int) -> Bucket:
    offsets = list(np.cumsum([0] + [p.size for p in pieces[:-1]]).astype(int))
    total = sum(p.size for p in pieces)
    n = len(group)
    length = -(-total // n) * n if zero else total
    return Bucket(
        index, group, list(pieces), dtype, [int(o) for o in offsets], length, f"zero.shard{index}" if zero else ""
    )


def _flat(g: Graph, grads: list[Tensor], pad: int, dtype: Any) -> Tensor:
    parts = [_flatten(x) for x in grads]
    if pad:
        parts.append(g.constant(np.zeros(pad), dtype, name=f"zero_pad_{len(g.nodes)}"))
    while len(parts) > 1:
        parts = [
            parts[i] if len(parts[i : i + CONCAT_MAX]) == 1 else ops.concat(parts[i : i + CONCAT_MAX], 0)
            for i in range(0, len(parts), CONCAT_MAX)
        ]
    return parts[0]


def _flatten(x: Tensor) -> Tensor:
    try:
        return ops.reshape(x, (-1,))
    except GraphBuildError:  # (a view that cannot be flattened in place)
        return ops.reshape(ops.copy(x), (-1,))


def _unflat(flat: Tensor, bucket: Bucket) -> list[Tensor]:
    out = []
    for piece, off in zip(bucket.pieces, bucket.offsets):
        out.append(ops.reshape(ops.slice_(flat, [off], [off + piece.size]), piece.shape))
    return out


def exchange(
    g: Graph, step: RankStep, grads: dict[str, Tensor], buckets: Sequence[Bucket], zero: int
) -> tuple[dict[str, Tensor], dict[str, Tensor], dict[str, float]]:
    """The rank's gradient exchange: (the optimizer's parameters, their gradients, their weight-decay
    keys' pieces' names) by optimizer name. Pieces no other rank holds keep their own gradients."""
    local = {piece: name for name, piece in step.weights.items()}
    params: dict[str, Tensor] = {}
    pgrads: dict[str, Tensor] = {}
    decay_of: dict[str, str] = {}
    done: set[str] = set()
    for b in buckets:
        if g.rank not in b.group:
            continue
        names = [local[p] for p in b.pieces]
        member = b.group.index(g.rank)
        with g.scope(f"grad_exchange.bucket{b.index}"):
            total = sum(p.size for p in b.pieces)
            flat = _flat(g, [grads[n] for n in names], b.length - total, b.dtype)
            if not zero:
                reduced = ops.all_reduce(flat, group=b.group)
                for n, x in zip(names, _unflat(reduced, b)):
                    params[n], pgrads[n], decay_of[n] = g.states[n], x, step.weights[n].name
                    step.grad_bytes += x.nbytes
            else:
                span = b.length // len(b.group)
                if zero == 1:
                    reduced = ops.all_reduce(flat, group=b.group)
                    shard_grad = ops.slice_(reduced, [member * span], [(member + 1) * span])
                    step.grad_bytes += reduced.nbytes
                else:
                    shard_grad = ops.reduce_scatter(flat, 0, group=b.group)
                    step.grad_bytes += shard_grad.nbytes
                shard = g.state(b.shard_state, (span,), "float32")
                step.shards[b.shard_state] = (b, member)
                params[b.shard_state], pgrads[b.shard_state] = shard, shard_grad
                decay_of[b.shard_state] = b.pieces[0].name
        done.update(names)
    for n, piece in step.weights.items():
        if n not in done and n in grads:
            params[n], pgrads[n], decay_of[n] = g.states[n], grads[n], piece.name
            step.grad_bytes += grads[n].nbytes
    return params, pgrads, decay_of


def attach_optimizer(
    g: Graph,
    step: RankStep,
    spec: OptimizerSpec,
    params: dict[str, Tensor],
    pgrads: dict[str, Tensor],
    decay_of: dict[str, str],
    holders: Mapping[Piece, tuple[int, ...]],
    world: int,
) -> None:
    """The optimizer on the rank's parameters (or shards); under ZeRO each shard's update is gathered
    back over its group into the weights it stands for."""
    decay = spec.get("weight_decay", 0.01 if spec.kind == "adamw" else 0.0)
    per = {n: (decay[decay_of[n]] if isinstance(decay, Mapping) else decay) for n in params}
    norm_over = None
    if spec.get("max_norm") is not None and world > 1:
        shares = tuple(1.0 if n in step.shards else 1.0 / len(holders[step.weights[n]]) for n in params)
        norm_over = NormOver(tuple(range(world)), shares)
    step.optimizer = spec.attach(g, params, pgrads, weight_decay=per, norm_over=norm_over)
    local = {piece: name for name, piece in step.weights.items()}
    for shard_name, (b, _) in step.shards.items():
        new = step.optimizer.updated[shard_name]
        with g.scope(f"grad_exchange.bucket{b.index}"):
            mine = new if new.dtype == b.dtype else ops.cast(new, b.dtype)  # (gather the weights' dtype: fewer bytes)
            whole = ops.all_gather(mine, 0, group=b.group)
            for piece, x in zip(b.pieces, _unflat(whole, b)):
                g.assign(g.states[local[piece]], x)


def shard_value(bucket: Bucket, member: int, weights: Mapping[str, Any]) -> np.ndarray:
    """A member's float32 shard of a ZeRO bucket, cut from the whole weights."""
    flat = np.zeros(bucket.length, np.float32)
    for piece, off in zip(bucket.pieces, bucket.offsets):
        sl = tuple(slice(lo, hi) for lo, hi in piece.box)
        flat[off : off + piece.size] = (
            np.asarray(weights[piece.name], dtype=np.float64)[sl].astype(np.float32).reshape(-1)
        )
    span = bucket.length // len(bucket.group)
    return flat[member * span : (member + 1) * span]

"""The placement rules the op families share (``OpDef.placement``; vocabulary in
megaloop/frontend/placement.py).

Most rules are lists of ``Dim``\\ s: an index space of the node (an output axis, a matmul's K, a group
of attention heads) and the tensor axes that walk it, each ``scale`` elements of the axis to a unit.
Sharding a dim cuts every one of those axes at the same units, leaves the other tensors whole, and
makes the outputs partial sums when the dim is reduced away (``reduce``). A node with dims has a
strategy for each dim it can cut into ``members`` pieces (evenly, and as unevenly as a given operand
already is), one with everything replicated, and those its op adds (partial sums passed through
linear ops, a vocabulary split with its own builder, ...).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from megaloop.frontend.placement import (
    REPLICATE,
    LocalCall,
    Partial,
    Placement,
    PlacementRule,
    Shard,
    Strategy,
    bounds,
    even_sizes,
    replicated,
)

OUT = -1  # slot of output 0 in a Dim's axes; output k is OUT - k


@dataclass(frozen=True)
class Dim:
    units: int
    axes: tuple[tuple[int, int, int], ...]  # (slot: operand index, or OUT - k for output k; axis; scale)
    reduce: str | None = None  # cutting it leaves partial sums (or maxima) in the outputs
    label: str = ""
    build: Callable[[LocalCall], Any] | None = None  # a member's part, when not the op on its pieces


def _slot_placement(dim: Dim, slot: int, sizes: tuple[int, ...], absent: Placement) -> Placement:
    for s, axis, scale in dim.axes:
        if s == slot:
            return Shard(axis, tuple(u * scale for u in sizes))
    return absent


def _follow_sizes(dim: Dim, given: Sequence[Placement | None], members: int) -> list[tuple[int, ...]]:
    """Unit sizes of the dim: even, and those of operands that are already cut along one of its axes."""
    out = [even_sizes(dim.units, members)]
    for slot, axis, scale in dim.axes:
        g = given[slot] if 0 <= slot < len(given) else None
        if isinstance(g, Shard) and g.axis == axis and g.sizes and all(s % scale == 0 for s in g.sizes):
            units = tuple(s // scale for s in g.sizes)
            if sum(units) == dim.units and min(units) >= 1 and units not in out:
                out.append(units)
    return out


def dim_strategies(node: Any, members: int, given: Sequence[Placement | None], dims: Sequence[Dim]) -> list[Strategy]:
    out = []
    n_in, n_out = len(node.inputs), len(node.outputs)
    for dim in dims:
        if dim.units < members:
            continue
        for sizes in _follow_sizes(dim, given, members):
            partial = Partial(dim.reduce) if dim.reduce else REPLICATE
            ins = tuple(_slot_placement(dim, i, sizes, REPLICATE) for i in range(n_in))
            outs = tuple(_slot_placement(dim, OUT - k, sizes, partial) for k in range(n_out))
            out.append(Strategy(ins, outs, dim.label, dim.build))
    return out


def rule(
    dims: Callable[[Any], Sequence[Dim]],
    extra: Callable[[Any, int, Sequence[Placement | None]], list[Strategy]] | None = None,
    build: Callable[[LocalCall], Any] | None = None,
) -> PlacementRule:
    """A rule from the node's dims (plus ``extra`` strategies); ``build`` replaces the default builder
    of the strategies that have none (e.g. a reshape that may need a copy)."""

    def strategies(node: Any, members: int, given: Sequence[Placement | None]) -> list[Strategy]:
        found = [replicated(node), *dim_strategies(node, members, given, dims(node))]
        if extra is not None:
            found += extra(node, members, given)
        if build is not None:
            found = [s if s.build else Strategy(s.inputs, s.outputs, s.label, build, s.collective) for s in found]
        return _unique(found)

    return strategies


def _unique(strategies: list[Strategy]) -> list[Strategy]:
    seen, out = set(), []
    for s in strategies:
        key = (s.inputs, s.outputs)
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out


# ---- dims of the op families ------------------------------------------------------------------------


def aligned_dims(node: Any, skip: Sequence[int] = (), label: str = "") -> list[Dim]:
    """One dim per axis of output 0 (every output has its shape), walked by each operand's axis that
    broadcasting aligns with it when that axis is not broadcast (size 1 against a larger one)."""
    shape = node.outputs[0].shape
    rank = len(shape)
    dims = []
    for a, size in enumerate(shape):
        if a in skip:
            continue
        axes = []
        for i, t in enumerate(node.inputs):
            b = a - (rank - t.ndim)
            if b >= 0 and t.shape[b] == size:
                axes.append((i, b, 1))
        axes += [(OUT - k, a, 1) for k in range(len(node.outputs))]
        dims.append(Dim(size, tuple(axes), label=label or f"axis {a}"))
    return dims


def elementwise_dims(node: Any) -> list[Dim]:
    return aligned_dims(node)


def reduction_dims(node: Any, reduce: str | None) -> list[Dim]:
    """Axes a reduction keeps walk its output too; the axes it reduces give partial results (``reduce``)
    or cannot be cut (None)."""
    x = node.inputs[0]
    axis = node.attrs["axis"]
    axes = tuple(range(x.ndim)) if axis is None else ((axis,) if isinstance(axis, int) else tuple(axis))
    keep = node.attrs.get("keepdims", False)
    dims, j = [], 0
    for a in range(x.ndim):
        if a in axes:
            if reduce is not None:
                dims.append(Dim(x.shape[a], ((0, a, 1),), reduce=reduce, label=f"reduced axis {a}"))
            j += 1 if keep else 0
            continue
        dims.append(Dim(x.shape[a], ((0, a, 1), (OUT, j, 1)), label=f"axis {a}"))
        j += 1
    return dims


def rows_dims(node: Any, normalized: Sequence[int]) -> list[Dim]:
    """Ops normalising along ``normalized`` axes of operand 0 (softmax, norms): every other axis of
    output 0 can be cut; operands of output 0's shape (a residual) are cut with it, others (weights)
    stay whole."""
    shape = node.outputs[0].shape
    dims = []
    for a, size in enumerate(shape):
        if a in normalized:
            continue
        axes = [(i, a, 1) for i, t in enumerate(node.inputs) if t.shape == shape]
        dims.append(Dim(size, (*axes, (OUT, a, 1)), label=f"rows (axis {a})"))
    return dims


def matmul_dims(node: Any, a_slots: Sequence[int] = (0,), b_slot: int = 1, k: bool = True) -> list[Dim]:
    """Batch axes, M (rows of A), N (columns of B: column-parallel) and K (row-parallel: partial sums);
    ``a_slots``: the operands shaped like A (a fused op's gate and up, a residual)."""
    a, b, out = node.inputs[a_slots[0]], node.inputs[b_slot], node.outputs[0]
    ta, tb = node.attrs.get("transpose_a", False), node.attrs.get("transpose_b", False)
    ra, rb = a.ndim, b.ndim
    m_axis, k_axis_a = (ra - 1, ra - 2) if ta else (ra - 2, ra - 1)
    k_axis_b, n_axis = (rb - 1, rb - 2) if tb else (rb - 2, rb - 1)
    dims = []
    batch = out.ndim - 2
    for j in range(batch):
        axes = []
        for slot in (*a_slots, b_slot):
            t = node.inputs[slot]
            i = j - (batch - (t.ndim - 2))
            if i >= 0 and t.shape[i] == out.shape[j]:
                axes.append((slot, i, 1))
        dims.append(Dim(out.shape[j], (*axes, (OUT, j, 1)), label=f"batch axis {j}"))
    dims.append(Dim(out.shape[-2], (*[(s, m_axis, 1) for s in a_slots], (OUT, out.ndim - 2, 1)), label="rows"))
    dims.append(Dim(out.shape[-1], ((b_slot, n_axis, 1), (OUT, out.ndim - 1, 1)), label="column-parallel"))
    if k:
        axes = (*[(s, k_axis_a, 1) for s in a_slots], (b_slot, k_axis_b, 1))
        dims.append(Dim(a.shape[k_axis_a], axes, reduce="sum", label="row-parallel"))
    return dims


def reshape_dims(node: Any) -> list[Dim]:
    """Axes merged or split by a reshape, grouped where their products agree; a group can be cut along
    its leading axes on both sides in units of the larger of their inner products."""
    src, dst = node.inputs[0].shape, node.outputs[0].shape
    dims = []
    for ins, outs in reshape_groups(src, dst):
        if not ins or not outs:
            continue
        i0, o0 = ins[0], outs[0]
        inner_in = math.prod(src[i] for i in ins[1:])
        inner_out = math.prod(dst[o] for o in outs[1:])
        unit = math.lcm(inner_in, inner_out)
        units = src[i0] * inner_in // unit
        dims.append(Dim(units, ((0, i0, unit // inner_in), (OUT, o0, unit // inner_out)), label=f"axis {o0}"))
    return dims


def reshape_groups(src: Sequence[int], dst: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Groups of axes (size-1 axes left out) whose sizes multiply to the same number, in order."""
    a = [i for i, s in enumerate(src) if s != 1]
    b = [i for i, s in enumerate(dst) if s != 1]
    groups, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        gi, gj = [a[i]], [b[j]]
        pi, pj = src[a[i]], dst[b[j]]
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj:
                gi.append(a[i])
                pi *= src[a[i]]
                i += 1
            else:
                gj.append(b[j])
                pj *= dst[b[j]]
                j += 1
        groups.append((gi, gj))
    return groups


# ---- partial sums through linear ops ------------------------------------------------------------


def partial_through(
    node: Any, given: Sequence[Placement | None], slots: Sequence[int], op: str = "sum", label: str = "partial"
) -> list[Strategy]:
    """The strategy where ``slots`` come in as partial results (the other operands whole) and every
    output is partial too: for ops linear in those operands (views, concat, matmul in one operand)."""
    ins = tuple(Partial(op) if i in slots else REPLICATE for i in range(len(node.inputs)))
    return [Strategy(ins, tuple(Partial(op) for _ in node.outputs), label)]


def partial_unary(node: Any, members: int, given: Sequence[Placement | None]) -> list[Strategy]:
    """A view or copy of partial sums (or maxima) is partial."""
    found = partial_through(node, given, (0,))
    if node.op.kind == "view" or node.op.name == "copy":
        found += partial_through(node, given, (0,), "max", "partial maxima")
    return found


def partial_each(node: Any, members: int, given: Sequence[Placement | None]) -> list[Strategy]:
    """Partial in one operand, whole in the others (matmul, mul, div by a whole divisor)."""
    return [s for i in range(len(node.inputs)) for s in partial_through(node, given, (i,))]


def on_first(call: LocalCall) -> Any:
    """Members after the first drop the whole operand's (or number's) contribution: ``a + b`` with a
    partial and b whole is a + b on member 0 and a elsewhere (-a for b - a)."""
    if call.member == 0:
        return call.default()
    node = call.node
    slot = next(i for i, p in enumerate(call.strategy.inputs) if isinstance(p, Partial))
    x = call.operands[slot]
    if node.op.name == "sub" and _operand_slot(node, slot) == 1:
        x = -x
    shape = call.out_shape(0)
    return (x if x.shape == shape else x.broadcast_to(shape),)


def _operand_slot(node: Any, index: int) -> int:
    """Position (0 = a, 1 = b) of the index-th tensor operand among a binary op's slots."""
    scalars = node.attrs.get("scalars", {})
    return [s for s in range(2) if s not in scalars][index]


def partial_dividend(node: Any, members: int, given: Sequence[Placement | None]) -> list[Strategy]:
    """a / b is partial in a (b whole or a number)."""
    return [s for i, s in enumerate(partial_each(node, members, given)) if _operand_slot(node, i) == 0]


def partial_sums(node: Any, members: int, given: Sequence[Placement | None]) -> list[Strategy]:
    """add / sub: partial + partial is partial; partial + whole (or a number) too, the whole part counted
    once (``on_first``)."""
    found = []
    tensors = len(node.inputs)
    if tensors == 2:
        found += partial_through(node, given, (0, 1), label="partial sums")
    for i in range(tensors):
        s = partial_through(node, given, (i,), label="partial sums")[0]
        found.append(Strategy(s.inputs, s.outputs, s.label, on_first))
    return found


def local_range_of(call: LocalCall, slot: int) -> tuple[int, int]:
    """[lo, hi) of the operand's sharded axis this member holds."""
    p = call.strategy.inputs[slot]
    return bounds(p.sizes)[call.member]


def permute_dims(node: Any) -> list[Dim]:
    axes, shape = node.attrs["axes"], node.outputs[0].shape
    return [Dim(shape[j], ((0, a, 1), (OUT, j, 1)), label=f"axis {j}") for j, a in enumerate(axes)]


def slice_dims(node: Any) -> list[Dim]:
    """Axes a slice keeps whole, in order, can be cut."""
    x = node.inputs[0]
    dims = []
    for a, (start, stop, step) in enumerate(zip(node.attrs["starts"], node.attrs["stops"], node.attrs["steps"])):
        if slice(start, stop, step).indices(x.shape[a]) == (0, x.shape[a], 1):
            dims.append(Dim(x.shape[a], ((0, a, 1), (OUT, a, 1)), label=f"axis {a}"))
    return dims


def broadcast_dims(node: Any) -> list[Dim]:
    """An axis x has walks both; a broadcast one is cut in the output only (x whole on every member)."""
    x, shape = node.inputs[0], node.outputs[0].shape
    lead = len(shape) - x.ndim
    dims = []
    for j, size in enumerate(shape):
        i = j - lead
        axes = ((0, i, 1),) if i >= 0 and x.shape[i] == size else ()
        dims.append(Dim(size, (*axes, (OUT, j, 1)), label=f"axis {j}"))
    return dims


def along_dims(node: Any, axis: int) -> list[Dim]:
    """Every axis but ``axis`` of operands and outputs of one rank (concat, split)."""
    shape = node.outputs[0].shape
    dims = []
    for a in range(len(shape)):
        if a == axis:
            continue
        axes = [(i, a, 1) for i in range(len(node.inputs))] + [(OUT - k, a, 1) for k in range(len(node.outputs))]
        dims.append(Dim(shape[a], tuple(axes), label=f"axis {a}"))
    return dims


def partial_all(node: Any, members: int, given: Sequence[Placement | None]) -> list[Strategy]:
    """Every operand partial, the outputs partial (concat of partial sums)."""
    return partial_through(node, given, tuple(range(len(node.inputs))))

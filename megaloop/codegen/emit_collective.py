"""Tiles of exchanges between ranks: all_reduce, all_gather, reduce_scatter, recv and send, each one call
of a megaloop/codegen/include/megaloop/exchange.cuh template. A tile pulls its box of every member's
operand straight from that rank's arena (``a.arenas[rank]``, peer memory over NVLink) after its waits on
the members' counters, and combines in group order, so every rank computes bitwise the same values (the
numpy reference's rule: float32 or int64 accumulation, one rounding to the output dtype). A pushing
recv's send stores instead (``send``). Python writes the layouts and the 16-byte pack width, where the
layouts allow packs (peer loads cross NVLink at microseconds of latency: a 2-byte load a thread at a
time leaves the link mostly idle)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from megaloop.codegen.emit import Operand

GATHER_UNROLL = 4  # packs a thread of all_gather has in flight
COPY_UNROLL = 8  # packs a thread of recv and send has in flight


def member_pointers(members: list[tuple[int, Operand]], out: Operand, shifts: Sequence[int] = ()) -> list[str]:
    """in{k}: member k's operand in rank m's arena (``shifts[k]`` elements on); out0: this rank's output."""
    lines = []
    for k, (m, o) in enumerate(members):
        shift = f" + {shifts[k]}" if k < len(shifts) and shifts[k] else ""
        lines.append(f"const {o.ctype}* in{k} = (const {o.ctype}*)(a.arenas[{m}] + off[{k}]){shift};  // rank {m}")
    lines.append(f"{out.ctype}* out0 = ({out.ctype}*)(a.arena + off[{len(members)}]);")
    return lines


def _at(o: Operand, pointer: str) -> str:
    """``ml::at<strides...>(pointer)`` (megaloop/at.cuh)."""
    return f"ml::at<{', '.join(str(s) for s in o.strides)}>({pointer})"


def _operands(ops: list[Operand], out: Operand) -> str:
    return ", ".join([_at(out, "out0")] + [_at(o, f"in{k}") for k, o in enumerate(ops)])


def _packed(width: int, unroll: int) -> list[str]:
    return [f"// packed path: {width} elements a load, {unroll} per operand in flight"] if width else []


def all_reduce(attrs: dict[str, Any], members: list[tuple[int, Operand]], out: Operand) -> list[str]:
    return _reduce(attrs, members, out)


def reduce_scatter(attrs: dict[str, Any], members: list[tuple[int, Operand]], out: Operand, rank: int) -> list[str]:
    """This rank's slice (its position in the group) of the members' sum along ``axis``."""
    nd = len(out.shape)
    axis = attrs["axis"] % nd
    shift = [m for m, _ in members].index(rank) * out.shape[axis]
    return _reduce(attrs, members, out, axis, shift)


def _reduce(
    attrs: dict[str, Any], members: list[tuple[int, Operand]], out: Operand, axis: int | None = None, shift: int = 0
) -> list[str]:
    """out[i] = the members' x[i + shift along axis] combined in group order (one rounding at the store):
    ``ml::reduce_members``, each member's pointer moved on to this rank's slice."""
    nd = len(out.shape)
    ops = [o for _, o in members]
    width = _pack_width(ops, out, shift if axis == nd - 1 else 0)
    unroll = max(1, 8 // len(members)) if width else 1
    shifts = [shift * o.strides[axis] if axis is not None else 0 for o in ops]
    sums = str(attrs["op"] == "sum").lower()
    return [
        *member_pointers(members, out, shifts),
        *_packed(width, unroll),
        f"ml::reduce_members<{sums}, {width}, {unroll}>(t, {_operands(ops, out)});",
    ]


def _pack_width(ops: list[Operand], out: Operand, last_shift: int = 0) -> int:
    """Elements per 16-byte pack when every operand and the output are contiguous along the last axis
    and every other stride (and a shift along the last axis) is a whole number of packs; else 0."""
    if not out.shape or any(o.strides[-1] != 1 for o in ops + [out]):
        return 0
    width = 16 // max(o.dtype.itemsize for o in ops + [out])
    if width < 2 or any(st % width for o in ops + [out] for st in o.strides[:-1]) or last_shift % width:
        return 0
    return width


def all_gather(attrs: dict[str, Any], members: list[tuple[int, Operand]], out: Operand) -> list[str]:
    """Member j's x fills slice j along ``axis`` (a copy: no arithmetic, bit for bit): ``ml::gather_members``."""
    nd = len(out.shape)
    axis = attrs["axis"] % nd
    piece = members[0][1].shape[axis]
    ops = [o for _, o in members]
    width = _pack_width(ops, out, piece if axis == nd - 1 else 0)
    unroll = GATHER_UNROLL if width else 1
    return [
        *member_pointers(members, out),
        *_packed(width, unroll),
        f"ml::gather_members<{axis}, {piece}, {width}, {unroll}>(t, {_operands(ops, out)});",
    ]


def recv(attrs: dict[str, Any], members: list[tuple[int, Operand]], out: Operand) -> list[str]:
    """The matched send's tensor on the source rank, element for element (bit for bit)."""
    ((_, src),) = members
    return member_pointers(members, out) + _copy(src, out)


def send(attrs: dict[str, Any], x: Operand, out: Operand, dst: int) -> list[str]:
    """A pushing send's tile: its box of x stored into the recv's output in rank dst's arena (peer memory),
    element for element; the task's release at system scope then tells the recv's consumers there."""
    return [
        f"const {x.ctype}* in0 = (const {x.ctype}*)(a.arena + off[0]);",
        f"{out.ctype}* out0 = ({out.ctype}*)(a.arenas[{dst}] + off[1]);  // rank {dst}'s recv output",
    ] + _copy(x, out)


def _copy(src: Operand, out: Operand) -> list[str]:
    """out0[box] = in0[box] (``ml::copy_box``: 16-byte packs where both layouts allow, else element by element)."""
    width = _pack_width([src], out)
    unroll = COPY_UNROLL if width else 1
    return [*_packed(width, unroll), f"ml::copy_box<{width}, {unroll}>(t, {_operands([src], out)});"]

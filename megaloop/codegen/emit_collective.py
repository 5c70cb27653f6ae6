"""Tile templates of exchanges between ranks: all_reduce, all_gather, reduce_scatter and recv. A tile
pulls its box of every member's operand straight from that rank's arena (``a.arenas[rank]``, peer
memory over NVLink) after its waits on the members' counters, and combines in group order, so every
rank computes bitwise the same values (the numpy reference's rule: float32 or int64 accumulation,
one rounding to the output dtype)."""

from __future__ import annotations

from typing import Any

from megaloop.codegen.emit import Operand, box_var, compute_type, index_expr


def member_pointers(members: list[tuple[int, Operand]], out: Operand) -> list[str]:
    """in{k}: member k's operand in rank m's arena; out0: this rank's output."""
    lines = [
        f"[[maybe_unused]] const {o.ctype}* in{k} = (const {o.ctype}*)(a.arenas[{m}] + off[{k}]);  // rank {m}"
        for k, (m, o) in enumerate(members)
    ]
    lines.append(f"{out.ctype}* out0 = ({out.ctype}*)(a.arena + off[{len(members)}]);")
    return lines


def _combine(op: str, dtype_is_float: bool) -> str:
    if op == "sum":
        return "acc = acc + v;"
    return "acc = ml::maximum(acc, v);" if dtype_is_float else "acc = acc > v ? acc : v;"


def all_reduce(attrs: dict[str, Any], members: list[tuple[int, Operand]], out: Operand) -> list[str]:
    return _reduce(attrs, members, out, [f"i[{d}]" for d in range(len(out.shape))])


def reduce_scatter(attrs: dict[str, Any], members: list[tuple[int, Operand]], out: Operand, rank: int) -> list[str]:
    """This rank's slice (its position in the group) of the members' sum along ``axis``."""
    nd = len(out.shape)
    axis = attrs["axis"] % nd
    shift = [m for m, _ in members].index(rank) * out.shape[axis]
    return _reduce(attrs, members, out, [f"i[{d}]" if d != axis else f"(i[{d}] + {shift})" for d in range(nd)])


def _reduce(attrs: dict[str, Any], members: list[tuple[int, Operand]], out: Operand, src: list[str]) -> list[str]:
    """out[i] = the members' x[src(i)] combined in group order (one rounding at the store)."""
    nd = len(out.shape)
    ct = compute_type(out.dtype)
    body = member_pointers(members, out)
    body.append(f"ml::for_box<{box_var(nd)}>(t, [&](const int* i) {{")
    body.append(f"    {ct} acc = ml::load(in0 + {index_expr(members[0][1].strides, src)});")
    for k, (_, o) in enumerate(members[1:], start=1):
        body.append(
            f"    {{ const {ct} v = ml::load(in{k} + {index_expr(o.strides, src)}); "
            f"{_combine(attrs['op'], out.dtype.is_float)} }}"
        )
    body.append(f"    ml::store(out0 + {index_expr(out.strides, [f'i[{d}]' for d in range(nd)])}, acc);")
    body.append("});")
    return body


def all_gather(attrs: dict[str, Any], members: list[tuple[int, Operand]], out: Operand) -> list[str]:
    """Member j's x fills slice j along ``axis`` (a copy: no arithmetic, bit for bit)."""
    nd = len(out.shape)
    axis = attrs["axis"] % nd
    piece = members[0][1].shape[axis]
    dims = [f"i[{d}]" for d in range(nd)]
    src = [f"i[{d}]" if d != axis else f"(i[{d}] - j * {piece})" for d in range(nd)]
    body = member_pointers(members, out)
    body.append(f"ml::for_box<{box_var(nd)}>(t, [&](const int* i) {{")
    body.append(f"    const int j = i[{axis}] / {piece};")
    body.append(f"    {out.ctype} v;")
    body.append("    switch (j) {")
    for k, (_, o) in enumerate(members):
        body.append(f"        case {k}: v = in{k}[{index_expr(o.strides, src)}]; break;")
    body.append("        default: return;")
    body.append("    }")
    body.append(f"    out0[{index_expr(out.strides, dims)}] = v;")
    body.append("});")
    return body


def recv(attrs: dict[str, Any], members: list[tuple[int, Operand]], out: Operand) -> list[str]:
    """The matched send's tensor on the source rank, element for element (bit for bit)."""
    nd = len(out.shape)
    dims = [f"i[{d}]" for d in range(nd)]
    ((_, src),) = members
    body = member_pointers(members, out)
    body.append(f"ml::for_box<{box_var(nd)}>(t, [&](const int* i) {{")
    body.append(f"    out0[{index_expr(out.strides, dims)}] = in0[{index_expr(src.strides, dims)}];")
    body.append("});")
    return body

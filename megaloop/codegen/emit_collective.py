"""Tile templates of exchanges between ranks: all_reduce, all_gather, reduce_scatter and recv. A tile
pulls its box of every member's operand straight from that rank's arena (``a.arenas[rank]``, peer
memory over NVLink) after its waits on the members' counters, and combines in group order, so every
rank computes bitwise the same values (the numpy reference's rule: float32 or int64 accumulation,
one rounding to the output dtype). A pushing recv's send stores instead (``send``)."""

from __future__ import annotations

from typing import Any

from megaloop.codegen.emit import Operand, box_var, compute_type, index_expr, packed_loop


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
    """out[i] = the members' x[i + shift along axis] combined in group order (one rounding at the store)."""
    nd = len(out.shape)
    src = [f"(i[{d}] + {shift})" if d == axis else f"i[{d}]" for d in range(nd)]
    ct = compute_type(out.dtype)
    body = member_pointers(members, out)
    body += _reduce_packed(attrs, members, out, src, shift if axis == nd - 1 else 0)
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


def _reduce_packed(
    attrs: dict[str, Any], members: list[tuple[int, Operand]], out: Operand, src: list[str], last_shift: int
) -> list[str]:
    """The same reduction 16 bytes at a time (peer loads cross NVLink at microseconds of latency: a
    2-byte load a thread at a time leaves the link mostly idle). Same values, order and rounding as
    the per-element path below it, which runs where the layout rules packs out."""
    ops = [o for _, o in members]
    width = _pack_width(ops, out, last_shift)
    if not width:
        return []
    unroll = max(1, 8 // len(members))
    ct = compute_type(out.dtype)
    loads = [
        f"p{k}[u] = ml::load_pack<{o.ctype}, {width}>(in{k} + {index_expr(o.strides, src)});" for k, o in enumerate(ops)
    ]
    combine = [f"{ct} acc = ml::get(p0[u], j);"] + [
        f"{{ const {ct} v = ml::get(p{k}[u], j); {_combine(attrs['op'], out.dtype.is_float)} }}"
        for k in range(1, len(ops))
    ]
    return packed_loop(
        out,
        width,
        unroll,
        _members_in(ops),
        [f"ml::Pack<{o.ctype}, {width}> p{k}[{unroll}];" for k, o in enumerate(ops)],
        loads,
        [
            f"ml::Pack<{out.ctype}, {width}> po;",
            "#pragma unroll",
            f"for (int j = 0; j < {width}; ++j) {{",
            *["    " + line for line in combine],
            "    ml::set(po, j, acc);",
            "}",
            f"ml::store_pack<{out.ctype}, {width}>(out0 + at[u], po);",
        ],
    )


def _members_in(ops: list[Operand]) -> list[tuple[str, Operand]]:
    return [(f"in{k}", o) for k, o in enumerate(ops)]


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
    """Member j's x fills slice j along ``axis`` (a copy: no arithmetic, bit for bit)."""
    nd = len(out.shape)
    axis = attrs["axis"] % nd
    piece = members[0][1].shape[axis]
    dims = [f"i[{d}]" for d in range(nd)]
    src = [f"i[{d}]" if d != axis else f"(i[{d}] - j * {piece})" for d in range(nd)]
    body = member_pointers(members, out)
    ops = [o for _, o in members]
    width = _pack_width(ops, out, piece if axis == nd - 1 else 0)

    def load(k: int, o: Operand) -> str:  # member k's pack at output element i
        at = [f"i[{d}]" if d != axis else f"(i[{d}] - {k * piece})" for d in range(nd)]
        return f"ml::load_pack<{o.ctype}, {width}>(in{k} + {index_expr(o.strides, at)})"

    if width:  # a pack never straddles two members' pieces: piece is whole packs along the last axis
        body += packed_loop(
            out,
            width,
            4,
            _members_in(ops),
            [f"ml::Pack<{out.ctype}, {width}> p[4];"],
            [
                f"switch (i[{axis}] / {piece}) {{",
                *[f"    case {k}: p[u] = {load(k, o)}; break;" for k, o in enumerate(ops[:-1])],
                f"    default: p[u] = {load(len(ops) - 1, ops[-1])}; break;  // member {len(ops) - 1}",
                "}",
            ],
            [f"ml::store_pack<{out.ctype}, {width}>(out0 + at[u], p[u]);"],
        )
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
    """out0[box] = in0[box] (16-byte packs where both layouts allow, else element by element)."""
    nd = len(out.shape)
    dims = [f"i[{d}]" for d in range(nd)]
    body: list[str] = []
    width = _pack_width([src], out)
    if width:
        body += packed_loop(
            out,
            width,
            8,
            _members_in([src]),
            [f"ml::Pack<{out.ctype}, {width}> p[8];"],
            [f"p[u] = ml::load_pack<{src.ctype}, {width}>(in0 + {index_expr(src.strides, dims)});"],
            [f"ml::store_pack<{out.ctype}, {width}>(out0 + at[u], p[u]);"],
        )
    body.append(f"ml::for_box<{box_var(nd)}>(t, [&](const int* i) {{")
    body.append(f"    out0[{index_expr(out.strides, dims)}] = in0[{index_expr(src.strides, dims)}];")
    body.append("});")
    return body

"""C++ for the paged KV cache's tiles (megaloop/paged.cuh): ``ml::paged_kv_update`` and
``ml::paged_attention``, with the pool's and the table's sizes and every operand's strides as
template arguments (megaloop/frontend/ops/paged.py defines the ops)."""

from __future__ import annotations

from typing import Any

from megaloop.codegen.emit import Operand, float_literal, pointers, rope_frequencies
from megaloop.codegen.emit_attention import Lanes, lanes_applies, lanes_arg, lanes_for, lanes_shared_bytes


def _at(o: Operand, pointer: str) -> str:
    return f"ml::at<{', '.join(str(st) for st in o.strides)}>({pointer})"


def _table_sizes(pool: Operand, table: Operand) -> str:
    """Pages, page size, slots and pages a slot: the template arguments both tiles share."""
    return f"{pool.shape[0]}, {pool.shape[2]}, {table.shape[0]}, {table.shape[1]}"


def paged_kv_update(op: str, attrs: dict[str, Any], ins: list[Operand], out: Operand) -> list[str]:
    """A kv head of the pool a task: every used row's vector of that head copied to its page and offset."""
    pool, new, table, slots, pos = ins
    b, _, tokens, dim = new.shape
    return [
        *pointers([*ins, out], len(ins)),
        f"// {b * tokens} row(s) of {dim} into pages of {pool.shape[2]} positions (a page table of "
        f"{table.shape[0]} slots x {table.shape[1]} pages)",
        f"ml::paged_kv_update<{b}, {tokens}, {dim}, {_table_sizes(pool, table)}>(a, t, tid, {_at(out, 'out0')}, "
        f"{_at(new, 'in1')}, {_at(table, 'in2')}, {_at(slots, 'in3')}, {_at(pos, 'in4')});",
    ]


def _packs(k_pool: Operand, v_pool: Operand) -> bool:
    """Whether each lane's dims of a key (and of a value) are whole, consecutive 16-byte packs at every
    page, head and position (megaloop/paged.cuh's split of a head over G lanes a key)."""
    width = 16 // k_pool.dtype.itemsize
    d, dv = k_pool.shape[3], v_pool.shape[3]
    lanes = 1 if d <= 64 else 2 if d <= 128 else 4
    per_lane = [-(-n // lanes) for n in (d, dv)]
    return (
        k_pool.dtype == v_pool.dtype
        and 16 % k_pool.dtype.itemsize == 0
        and all(n == lanes * m and m % width == 0 for n, m in zip((d, dv), per_lane))
        and all(o.strides[3] == 1 for o in (k_pool, v_pool))
        and all(st % width == 0 for o in (k_pool, v_pool) for st, n in zip(o.strides[:3], o.shape[:3]) if n > 1)
    )


def paged_lanes(attrs: dict[str, Any], ins: list[Operand]) -> Lanes | None:
    """The lanes-over-keys tile (KernelOptions.decode_attention 1, ``attrs["codegen"]``) where it applies:
    a row's query heads of one kv head, the slot's visible keys staged through the page table."""
    hints = attrs.get("codegen", {})
    q, k_pool, _, table = ins[:4]
    group = q.shape[1] // k_pool.shape[1]
    if hints.get("decode_attention", 0) != 1 or not hints.get("warps") or not lanes_applies(ins):
        return None
    return lanes_for(group, hints["warps"], table.shape[1] * k_pool.shape[2], ins)


def paged_attention_shared_bytes(attrs: dict[str, Any], ins: list[Operand]) -> int:
    lanes = paged_lanes(attrs, ins)
    return lanes_shared_bytes(ins, lanes) if lanes else 0


def rope_paged_kv_update(op: str, attrs: dict[str, Any], ins: list[Operand], out: Operand) -> list[str]:
    """paged_kv_update's write with each row's rotary dims turned at its position (rope's bits)."""
    pool, new, table, slots, pos = ins
    b, _, tokens, dim = new.shape
    neox = "true" if attrs["layout"] == "neox" else "false"
    return [
        rope_frequencies(attrs),
        *pointers([*ins, out], len(ins)),
        f"// {b * tokens} row(s) of {dim}, rotated ({attrs['rotary_dim']} dims, {attrs['layout']}), into pages of "
        f"{pool.shape[2]} positions (a page table of {table.shape[0]} slots x {table.shape[1]} pages)",
        f"ml::paged_write<{b}, {tokens}, {dim}, {_table_sizes(pool, table)}, {attrs['rotary_dim']}, {neox}>(a, t, tid, "
        f"inv_freq, {_at(out, 'out0')}, {_at(new, 'in1')}, {_at(table, 'in2')}, {_at(slots, 'in3')}, "
        f"{_at(pos, 'in4')});",
    ]


def paged_attention(op: str, attrs: dict[str, Any], ins: list[Operand], out: Operand) -> list[str]:
    """Lanes over keys where ``paged_lanes`` (and the pools are aligned), else a warp per (head, row), its
    lanes on different keys of the row's slot (read through the page table; in 16-byte packs where
    ``_packs``), each lane's online softmax merged at the end."""
    q, k_pool, v_pool, table = ins[:4]
    group, d, dv = q.shape[1] // k_pool.shape[1], q.shape[3], v_pool.shape[3]
    window = attrs.get("window") or 0
    packs, lanes = _packs(k_pool, v_pool), paged_lanes(attrs, ins)
    operands = ", ".join([_at(out, "out0"), *(_at(o, f"in{n}") for n, o in enumerate(ins))])
    path = "a warp per (head, row), its lanes on different keys of the row's slot, their softmax states merged"
    if lanes:
        path = f"lanes over keys ({lanes.blocks} block(s) of 32 keys staged through the page table), then " + path
    return [
        *pointers([*ins, out], len(ins)),
        f"// {path}" + (" (keys and values in 16-byte packs)" if packs else ""),
        f"ml::paged_attention<{group}, {d}, {dv}, {_table_sizes(k_pool, table)}, {window}, "
        f"{'true' if packs else 'false'}{lanes_arg(lanes) or ', ml::NoLanes'}>(a, t, tid, "
        f"{float_literal(attrs['scale'])}, {operands});",
    ]

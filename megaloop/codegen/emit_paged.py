"""C++ for the paged KV cache's tiles (megaloop/paged.cuh): ``ml::paged_kv_update`` and
``ml::paged_attention``, with the pool's and the table's sizes and every operand's strides as
template arguments (megaloop/frontend/ops/paged.py defines the ops)."""

from __future__ import annotations

from typing import Any

from megaloop.codegen.emit import Operand, float_literal, pointers


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


def paged_attention(op: str, attrs: dict[str, Any], ins: list[Operand], out: Operand) -> list[str]:
    """A warp per (head, row), its lanes on different keys of the row's slot (read through the page
    table), each lane's online softmax merged at the end."""
    q, k_pool, v_pool, table = ins[:4]
    group, d, dv = q.shape[1] // k_pool.shape[1], q.shape[3], v_pool.shape[3]
    window = attrs.get("window") or 0
    operands = ", ".join([_at(out, "out0"), *(_at(o, f"in{n}") for n, o in enumerate(ins))])
    return [
        *pointers([*ins, out], len(ins)),
        "// a warp per (head, row), its lanes on different keys of the row's slot, their softmax states merged",
        f"ml::paged_attention<{group}, {d}, {dv}, {_table_sizes(k_pool, table)}, {window}>(a, t, tid, "
        f"{float_literal(attrs['scale'])}, {operands});",
    ]

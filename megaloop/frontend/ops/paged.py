"""Attention over a paged KV cache, and the cache's update: the ops of a serving step (docs/serving.md).

A paged cache is one pool of pages per layer, ``pool`` [pages, kv_heads, page_size, head_dim], shared
by every sequence slot; ``page_table`` [slots, pages_per_slot] names the page that holds positions
[j * page_size, (j + 1) * page_size) of each slot. A step's rows are tokens of any slots: row (b, t)
belongs to slot ``slots[b, t]`` and sits at position ``positions[b, t]`` of it (a negative position:
an unused row, which writes nothing and sees no key).

- ``paged_kv_cache_update(pool, new, page_table, slots, positions)``: new [batch, kv_heads, tokens,
  head_dim] written at ``pool[page_table[slot, p // page_size], :, p % page_size]``, in place; the
  result is the pool's next value. Two rows writing one place is a data error (one write would be lost).
- ``paged_attention(q, k_pool, v_pool, page_table, slots, positions, window=, scale=)``: q [batch,
  heads, tokens, head_dim]; row (b, t) attends causally to the keys of its slot at positions [0, p]
  (the last ``window`` of them with a sliding window), read through the page table. Grouped-query
  heads as attention's (query head h reads kv head h // (heads / kv_heads)). Its values are exactly
  attention's on that slot's keys gathered into one cache of pages_per_slot * page_size positions, a
  query at a time (the reference calls attention's): zeros for a row that sees no key.

A page a row needs that is not in [0, pages) (a table entry the host left at -1), a slot outside the
table, a position past the table's reach: data errors naming the row and the value, on the reference,
the plan interpreter and the GPU alike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from megaloop.errors import DataError, DtypeError, GraphBuildError, ShapeError
from megaloop.frontend import sources
from megaloop.frontend.opdef import Accuracy, Fast, Lowering, OpCall, OpDef, OutSpec, first_bad, register
from megaloop.frontend.ops import _placements
from megaloop.frontend.ops._build import apply, require_int, require_scalar
from megaloop.frontend.ops._fast import Kernel, rounder
from megaloop.frontend.ops.attention import ATTENTION
from megaloop.frontend.ops.attention import _attend as _attend_blas
from megaloop.frontend.ops.attention import _reference as _attention_reference
from megaloop.frontend.ops.elementwise import check_kinds, to_compute
from megaloop.frontend.shapes import format_shape
from megaloop.frontend.tensor import Tensor
from megaloop.frontend.tiling import Box, Read, Tile, TileContext, Tiling, Write, same

# ---- shape rules -------------------------------------------------------------------------------------


def _check_pool(call: OpCall, i: int) -> tuple[int, int, int, int]:
    pool = call.operands[i]
    if pool.ndim != 4:
        raise call.error(
            ShapeError,
            f"{call.name(i)} must be 4-D [pages, kv_heads, page_size, head_dim], got {format_shape(pool.shape)}",
        )
    return pool.shape  # type: ignore[return-value]


def _check_rows(call: OpCall, first: int, batch: int, tokens: int) -> None:
    """page_table [slots, pages_per_slot], then slots and positions [batch, tokens], all ints."""
    table = call.operands[first]
    if not table.dtype.is_int or table.ndim != 2:
        raise call.error(
            ShapeError if table.dtype.is_int else DtypeError,
            f"page_table must be an int tensor [slots, pages_per_slot], got {table.dtype.name}"
            f"{format_shape(table.shape)}",
        )
    for k in (first + 1, first + 2):
        t = call.operands[k]
        if not t.dtype.is_int or t.shape != (batch, tokens):
            raise call.error(
                ShapeError if t.dtype.is_int else DtypeError,
                f"{call.name(k)} must be an int tensor [batch, tokens] = [{batch}, {tokens}], got "
                f"{t.dtype.name}{format_shape(t.shape)}",
            )


def _attention_infer(call: OpCall) -> list[OutSpec]:
    q, k, v = call.operands[:3]
    check_kinds(call, q.dtype, "f")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise call.error(DtypeError, f"q, k_pool and v_pool must share a dtype: {q.dtype.name}, {k.dtype.name}, "
                         f"{v.dtype.name}")  # fmt: skip
    if q.ndim != 4:
        raise call.error(ShapeError, f"q must be 4-D [batch, heads, tokens, head_dim], got {format_shape(q.shape)}")
    b, hq, t, d = q.shape
    n, hkv, page, dk = _check_pool(call, 1)
    vn, vh, vp, _ = _check_pool(call, 2)
    if (vn, vh, vp) != (n, hkv, page):
        raise call.error(ShapeError, "k_pool and v_pool must have the same pages, kv_heads and page_size")
    if dk != d:
        raise call.error(ShapeError, f"q's head_dim {d} differs from k_pool's {dk}")
    if hq % hkv:
        raise call.error(ShapeError, f"heads ({hq}) must be a multiple of kv_heads ({hkv}) for grouped-query attention")
    _check_rows(call, 3, b, t)
    if call.attrs["scale"] is None:
        call.attrs["scale"] = 1.0 / math.sqrt(d)
    return [OutSpec((b, hq, t, v.shape[3]), q.dtype)]


def _update_infer(call: OpCall) -> list[OutSpec]:
    pool, new = call.operands[:2]
    if pool.node.op is not sources.STATE or pool.is_view:
        raise call.error(
            GraphBuildError,
            f"pool must be a state tensor (graph.state(...)), got {pool!r}",
            hint="the pages persist between iterations, so declare the pool with graph.state",
        )
    check_kinds(call, pool.dtype, "f")
    if new.dtype != pool.dtype:
        raise call.error(DtypeError, f"new is {new.dtype.name} but the pool is {pool.dtype.name}",
                         hint=f"cast new to {pool.dtype.name}")  # fmt: skip
    _, hkv, _, d = _check_pool(call, 0)
    if new.ndim != 4 or new.shape[1] != hkv or new.shape[3] != d:
        raise call.error(
            ShapeError,
            f"new must be [batch, kv_heads, tokens, head_dim] with kv_heads {hkv} and head_dim {d} (the pool's), "
            f"got {format_shape(new.shape)}",
        )
    _check_rows(call, 2, new.shape[0], new.shape[2])
    return [OutSpec(pool.shape, pool.dtype)]


# ---- data rules ----------------------------------------------------------------------------------------


def _rows_data(table: np.ndarray, slots: np.ndarray, pos: np.ndarray, known_slots: np.ndarray | None,
               known_pos: np.ndarray | None, reach: int) -> np.ndarray:  # fmt: skip
    """The used rows (position >= 0) whose slot and position are real, after checking both."""
    used = pos >= 0 if known_pos is None else (pos >= 0) & known_pos
    if known_slots is not None:
        used &= known_slots
    where = first_bad(pos >= reach, used)
    if where is not None:
        raise DataError(
            f"position {int(pos[where])} of row {where} is past the page table's reach: {table.shape[1]} pages of "
            f"{reach // table.shape[1]} positions a slot hold positions below {reach}"
        )
    where = first_bad((slots < 0) | (slots >= table.shape[0]), used)
    if where is not None:
        raise DataError(f"slot {int(slots[where])} of row {where} is outside the page table's {table.shape[0]} slots")
    return used


def _page_problem(table: np.ndarray, known: np.ndarray | None, slot: int, entries: np.ndarray, pages: int,
                  row: tuple[int, ...], what: str) -> str | None:  # fmt: skip
    ids = table[slot, entries]
    real = np.ones(ids.shape, bool) if known is None else known[slot, entries]
    bad = real & ((ids < 0) | (ids >= pages))
    if not bad.any():
        return None
    j = int(entries[np.argmax(bad)])
    return (
        f"row {row} {what} slot {slot}'s page table entry {j}, which is {int(table[slot, j])}: not a page of the "
        f"pool's {pages} (the host assigns a page before a position in it is used)"
    )


def _indices(mask: np.ndarray) -> list[tuple[int, ...]]:
    return [tuple(int(i) for i in at) for at in zip(*np.nonzero(mask))]


def _check_attention_data(arrays: list[np.ndarray], attrs: dict[str, Any], known: Sequence[np.ndarray | None]) -> None:
    k_pool, table, slots, pos = arrays[1], arrays[3], arrays[4], arrays[5]
    page = k_pool.shape[2]
    used = _rows_data(table, slots, pos, known[4], known[5], table.shape[1] * page)
    window = attrs["window"]
    for row in _indices(used):
        p = int(pos[row])
        first = 0 if window is None else max(0, p - window + 1)
        entries = np.arange(first // page, p // page + 1)
        problem = _page_problem(table, known[3], int(slots[row]), entries, k_pool.shape[0], row, "reads through")
        if problem:
            raise DataError(problem)


def _check_update_data(arrays: list[np.ndarray], attrs: dict[str, Any], known: Sequence[np.ndarray | None]) -> None:
    pool, table, slots, pos = arrays[0], arrays[2], arrays[3], arrays[4]
    page = pool.shape[2]
    used = _rows_data(table, slots, pos, known[3], known[4], table.shape[1] * page)
    seen: dict[tuple[int, int], tuple[int, ...]] = {}
    for row in _indices(used):
        s, p = int(slots[row]), int(pos[row])
        problem = _page_problem(table, known[2], s, np.array([p // page]), pool.shape[0], row, "writes through")
        if problem:
            raise DataError(problem)
        place = (int(table[s, p // page]), p % page)
        if place in seen:
            raise DataError(
                f"rows {seen[place]} and {row} both write page {place[0]} offset {place[1]} (slot {s}, position "
                f"{p}): one of the writes would be lost"
            )
        seen[place] = row


# ---- references ----------------------------------------------------------------------------------------


def _gather(pool: np.ndarray, table_row: np.ndarray) -> np.ndarray:
    """A slot's keys (or values) as one cache [kv_heads, pages_per_slot * page_size, dim]."""
    pages = pool[np.clip(table_row, 0, pool.shape[0] - 1)]  # [M, H, P, D]; check_data refused real ids outside
    return pages.transpose(1, 0, 2, 3).reshape(pool.shape[1], -1, pool.shape[3])


def _attention_ref(arrays: list[np.ndarray], attrs: dict[str, Any]) -> np.ndarray:
    q, k_pool, v_pool, table, slots, pos = arrays
    b, hq, t, _ = q.shape
    reach = table.shape[1] * k_pool.shape[2]
    out = np.zeros((b, hq, t, v_pool.shape[3]), np.float32)
    dense = {"causal": True, "window": attrs["window"], "scale": attrs["scale"]}
    for bi, ti in zip(*np.nonzero((pos >= 0) & (pos < reach))):
        row = table[int(np.clip(slots[bi, ti], 0, table.shape[0] - 1))]
        p = np.full((1, 1), pos[bi, ti], np.int64)
        k, v = _gather(k_pool, row)[None], _gather(v_pool, row)[None]
        visible = (np.arange(reach) <= p[0, 0])[None, None, :, None]
        k, v = np.where(visible, to_compute(k), 0.0), np.where(visible, to_compute(v), 0.0)  # (no stale NaN)
        out[bi, :, ti] = _attention_reference([q[bi : bi + 1, :, ti : ti + 1], k, v, p], dense)[0, :, 0]
    return out


def _update_ref(arrays: list[np.ndarray], attrs: dict[str, Any]) -> np.ndarray:
    pool, new, table, slots, pos = arrays
    page = pool.shape[2]
    out = pool.copy()
    reach = table.shape[1] * page
    for bi, ti in zip(*np.nonzero((pos >= 0) & (pos < reach))):
        p = int(pos[bi, ti])
        s = int(np.clip(slots[bi, ti], 0, table.shape[0] - 1))
        pg = int(np.clip(table[s, p // page], 0, pool.shape[0] - 1))  # (check_data refused real ones outside)
        out[pg, :, p % page] = new[bi, :, ti]
    return out


# ---- the fast CPU path (OpDef.fast): a slot's rows at once, BLAS products over the pages they read ----


def _fast_rows(table: np.ndarray, slots: np.ndarray, pos: np.ndarray, pages: int, page: int,
               window: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:  # fmt: skip
    """The used rows (batch, token indices) and each one's first page read, or None where check_data
    would refuse something (a slot, position or page out of range): the caller lets it say what."""
    bi, ti = np.nonzero(pos >= 0)
    p, s = pos[bi, ti], slots[bi, ti]
    if np.any(p >= table.shape[1] * page) or np.any((s < 0) | (s >= table.shape[0])):
        return None
    first = np.zeros_like(p) if window is None else np.maximum(0, p - window + 1) // page
    cols = np.arange(table.shape[1])
    read = (cols >= first[:, None]) & (cols <= (p // page)[:, None])
    ids = table[s]
    if np.any(read & ((ids < 0) | (ids >= pages))):
        return None
    return bi, ti, first


def _gather_range(pool: np.ndarray, table_row: np.ndarray) -> np.ndarray:
    """The pages ``table_row`` names as one run of positions [1, kv_heads, len * page_size, dim]."""
    pages = pool[table_row]
    return pages.transpose(1, 0, 2, 3).reshape(1, pool.shape[1], -1, pool.shape[3])


def _attention_fast(node: Any) -> Kernel:
    window = node.attrs["window"]
    finish = rounder(node.outputs[0].dtype)

    def run(arrays: list[np.ndarray]) -> list[np.ndarray]:
        q, k_pool, v_pool, table, slots, pos = arrays
        page = k_pool.shape[2]
        rows = _fast_rows(table, slots, pos, k_pool.shape[0], page, window)
        if rows is None:
            _check_attention_data(arrays, node.attrs, [None] * 6)  # (names the row and value)
            return [finish(_attention_ref(arrays, node.attrs))]
        bi, ti, first = rows
        out = np.zeros((q.shape[0], q.shape[1], q.shape[2], v_pool.shape[3]), np.float32)
        for s in np.unique(slots[bi, ti]):
            mine = slots[bi, ti] == s
            b, t, p = bi[mine], ti[mine], pos[bi[mine], ti[mine]]
            lo, hi = int(first[mine].min()), int(p.max()) // page + 1
            k, v = (_gather_range(pool, table[s, lo:hi]) for pool in (k_pool, v_pool))
            if not (np.isfinite(k).all() and np.isfinite(v).all()):  # (the reference zeroes keys a row cannot see)
                return [finish(_attention_ref(arrays, node.attrs))]
            keys = np.arange(lo * page, hi * page)
            visible = keys <= p[:, None]
            if window is not None:
                visible &= keys > (p - window)[:, None]
            o = _attend_blas(np.swapaxes(q[b, :, t], 0, 1)[None], k, v, visible[None], node.attrs)
            out[b, :, t] = np.swapaxes(o[0], 0, 1)
        return [finish(out)]

    return run


def _update_fast(node: Any) -> Kernel:
    def run(arrays: list[np.ndarray]) -> list[np.ndarray]:
        pool, new, table, slots, pos = arrays
        page = pool.shape[2]
        rows = _fast_rows(table, slots, pos, pool.shape[0], page, 1)  # (window 1: a row's own page)
        if rows is not None:
            bi, ti, _ = rows
            p = pos[bi, ti]
            pages = table[slots[bi, ti], p // page]
            places = pages * page + p % page
            if np.unique(places).size < places.size:
                rows = None
        if rows is None:
            _check_update_data(arrays, node.attrs, [None] * 5)  # (names the rows and values)
            return [_update_ref(arrays, node.attrs)]
        pool[pages, :, p % page] = new[bi, :, ti]  # in place: the pool is the state's buffer
        return [pool]

    return run


# ---- tilings --------------------------------------------------------------------------------------------


def _attention_tiles(node: Any, params: dict[str, int], ctx: TileContext) -> list[Tile]:
    """A tile: a block of rows of the query heads of one kv head, a warp a (head, row), about
    ``rounds`` rounds of the block's warps; the pools' kv head and the table whole (pages are data)."""
    q, k_pool, v_pool, table = node.inputs[:4]
    b, hq, t, d = q.shape
    hkv, dv = k_pool.shape[1], v_pool.shape[3]
    group = hq // hkv
    rows = max(1, params["rounds"] * ctx.warps // group)
    keys = table.shape[1] * k_pool.shape[2]
    tiles = []
    for bi in range(b):
        for h in range(hkv):
            for r in range(0, t, rows):
                e = min(t, r + rows)
                reads = (
                    Read(0, Box((bi, h * group, r, 0), (bi + 1, (h + 1) * group, e, d))),
                    Read(1, Box((0, h, 0, 0), (k_pool.shape[0], h + 1, k_pool.shape[2], d))),
                    Read(2, Box((0, h, 0, 0), (v_pool.shape[0], h + 1, v_pool.shape[2], dv))),
                    Read(3, Box.full(table.shape)),
                    Read(4, Box((bi, r), (bi + 1, e))),
                    Read(5, Box((bi, r), (bi + 1, e))),
                )
                # the keys a row really reads are data: count half the reach, each key of each head once
                moved = group * (e - r) * (d + dv) * q.dtype.itemsize + (e - r) * keys // 2 * (d + dv) * 2
                flops = 2 * group * (e - r) * keys // 2 * (d + dv)
                obox = Box((bi, h * group, r, 0), (bi + 1, (h + 1) * group, e, dv))
                tiles.append(Tile((bi, h, r // rows), reads, (Write(0, obox),), flops, moved))
    return tiles


PAGED_ATTENTION_TILING = Tiling(
    {"rounds": same(1)},
    _attention_tiles,
    "a block of rows of the query heads of one kv head, a warp a (head, row): about rounds rounds of the warps",
)


def _update_tiles(node: Any, params: dict[str, int], ctx: TileContext) -> list[Tile]:
    """A tile a kv head: every row's key (value) of that head, into the pool's pages of that head."""
    pool, new, table, slots, pos = node.inputs
    n, hkv, page, d = pool.shape
    b, _, t, _ = new.shape
    tiles = []
    for h in range(hkv):
        part = Box((0, h, 0, 0), (n, h + 1, page, d))
        reads = (
            Read(0, part),
            Read(1, Box((0, h, 0, 0), (b, h + 1, t, d))),
            Read(2, Box.full(table.shape)),
            Read(3, Box.full(slots.shape)),
            Read(4, Box.full(pos.shape)),
        )
        moved = 2 * b * t * d * pool.dtype.itemsize + b * t * (slots.dtype.itemsize + pos.dtype.itemsize + 8)
        tiles.append(Tile((h,), reads, (Write(0, part),), 0, moved))
    return tiles


PAGED_UPDATE_TILING = Tiling({}, _update_tiles, "one kv head of the pool: every row's vector of that head")


# ---- placements: by kv heads (the table, slots and positions whole on every member) ----------------------


def _attention_dims(node: Any) -> list[_placements.Dim]:
    q, k_pool = node.inputs[:2]
    group = q.shape[1] // k_pool.shape[1]
    axes = ((0, 1, group), (1, 1, 1), (2, 1, 1), (_placements.OUT, 1, group))
    return [_placements.Dim(k_pool.shape[1], axes, label="by heads")]


def _update_dims(node: Any) -> list[_placements.Dim]:
    axes = ((0, 1, 1), (1, 1, 1), (_placements.OUT, 1, 1))
    return [_placements.Dim(node.inputs[0].shape[1], axes, label="by heads")]


# ---- the ops ----------------------------------------------------------------------------------------------

PAGED_ATTENTION = register(
    OpDef(
        name="paged_attention",
        kind="compute",
        category="attention",
        doc="Causal attention of each row (slot, position) over its slot's keys at positions <= its own, read "
        "through a page table from pools [pages, kv_heads, page_size, dim]; megaloop/frontend/ops/paged.py.",
        operands=("q", "k_pool", "v_pool", "page_table", "slots", "positions"),
        attrs={"window": "count?", "scale": "number?"},
        infer=_attention_infer,
        reference=_attention_ref,
        check_data=_check_attention_data,
        fast=Fast(_attention_fast, exact=False, checks_data=True),
        accuracy=ATTENTION.accuracy,
        tiling=PAGED_ATTENTION_TILING,
        lowering=Lowering("paged_attention"),
        placement=_placements.rule(_attention_dims),
    )
)

PAGED_KV_CACHE_UPDATE = register(
    OpDef(
        name="paged_kv_cache_update",
        kind="compute",
        category="attention",
        doc="Write new [batch, kv_heads, tokens, dim] into the pool state [pages, kv_heads, page_size, dim] at each "
        "row's (slot, position), through the page table, in place; negative positions write nothing.",
        operands=("pool", "new", "page_table", "slots", "positions"),
        infer=_update_infer,
        reference=_update_ref,
        check_data=_check_update_data,
        fast=Fast(_update_fast, checks_data=True),
        accuracy=Accuracy(ulps=0.0),
        inplace_operand=0,
        tiling=PAGED_UPDATE_TILING,
        lowering=Lowering("paged_kv_update"),
        placement=_placements.rule(_update_dims),
    )
)


def paged_attention(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    page_table: Tensor,
    slots: Tensor,
    positions: Tensor,
    *,
    window: int | None = None,
    scale: float | None = None,
) -> Tensor:
    """Row (b, t) of q attends to the keys of slot ``slots[b, t]`` at positions <= ``positions[b, t]``
    (the last ``window`` of them), read through ``page_table`` (module docstring)."""
    if window is not None:
        window = require_int(PAGED_ATTENTION, "window", window, minimum=1)
    if scale is not None:
        scale = float(require_scalar(PAGED_ATTENTION, "scale", scale))
    return apply(PAGED_ATTENTION, [q, k_pool, v_pool, page_table, slots, positions], window=window, scale=scale)


def paged_kv_cache_update(pool: Tensor, new: Tensor, page_table: Tensor, slots: Tensor, positions: Tensor) -> Tensor:
    """Write ``new`` into the pool's pages at each row's slot and position; the result is the pool's next
    value (module docstring)."""
    return assign_pool(PAGED_KV_CACHE_UPDATE, pool, [pool, new, page_table, slots, positions], {})


def assign_pool(op: OpDef, pool: Tensor, operands: list[Tensor], attrs: dict[str, Any]) -> Tensor:
    """``op`` (a write into ``pool``) applied, its result assigned to the pool state."""
    if isinstance(pool, Tensor) and pool.node.op is sources.STATE:
        name = pool.node.attrs["name"]
        if name in pool.graph.state_updates:  # checked first, so a refused call adds no node
            raise GraphBuildError(
                f"{op.name}: state {name!r} already receives {pool.graph.state_updates[name]!r} this "
                "iteration; a state takes one new value per iteration"
            )
    out = apply(op, operands, **attrs)
    pool.graph.assign(pool, out)
    return out

"""A key rotated and written into its paged pool in one op: ``rope_paged_kv_cache_update(pool, new,
page_table, slots, positions)`` is ``paged_kv_cache_update(pool, rope(new, positions), page_table,
slots, positions)``: rope's values, rounded to the pool's dtype, written at each row's page and offset,
without a rope op between the key projection and the pool (one dependent stage fewer before a decode
step's attention in every layer). A row at a negative position writes nothing, so its rotation does
not matter (rope at max(position, 0), as a serving step builds it, is the same op).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from megaloop.frontend.opdef import Accuracy, Fast, Lowering, OpCall, OpDef, OutSpec, register
from megaloop.frontend.ops import _placements
from megaloop.frontend.ops._fast import Kernel, rounder
from megaloop.frontend.ops.paged import (
    PAGED_UPDATE_TILING,
    _check_update_data,
    _update_dims,
    _update_fast,
    _update_infer,
    _update_ref,
    assign_pool,
)
from megaloop.frontend.ops.rope import ROPE_ATTRS, check_rotary, frequencies, rope_attrs, rotated
from megaloop.frontend.ops.rope import _reference as _rope_reference
from megaloop.frontend.tensor import Tensor


def _infer(call: OpCall) -> list[OutSpec]:
    out = _update_infer(call)  # paged_kv_cache_update's rules for the pool, new, table, slots, positions
    check_rotary(call, call.shape(1)[-1])  # and rope's for rotary_dim and layout
    return out


def _at(pos: np.ndarray) -> np.ndarray:
    """The rows' rotary positions [batch, 1, tokens] (unused rows at 0: they write nothing)."""
    b, t = pos.shape
    return np.maximum(pos, 0).reshape(b, 1, t)


def _reference(arrays: list[np.ndarray], attrs: dict[str, Any]) -> np.ndarray:
    pool, new, *rest = arrays
    turned = _rope_reference([new, _at(rest[2])], attrs).astype(new.dtype)  # rope's output, stored
    return _update_ref([pool, turned, *rest], attrs)


def _fast(node: Any) -> Kernel:
    """new rotated (rounded to its dtype, as rope stores it), then paged_kv_cache_update's fast path."""
    attrs, inv, stored = node.attrs, frequencies(node.attrs), rounder(node.inputs[1].dtype)
    write = _update_fast(node)

    def run(arrays: list[np.ndarray]) -> list[np.ndarray]:
        pool, new, *rest = arrays
        return write([pool, stored(rotated(new, _at(rest[2]), attrs, inv)), *rest])

    return run


ROPE_PAGED_KV_CACHE_UPDATE = register(
    OpDef(
        name="rope_paged_kv_cache_update",
        kind="compute",
        category="attention",
        doc="paged_kv_cache_update(pool, rope(new, positions), page_table, slots, positions) in one op: each "
        "row of new [batch, kv_heads, tokens, dim] rotated at its position (rope's layout, rotary_dim, theta "
        "and scaling) and written into the pool state through the page table, in place.",
        operands=("pool", "new", "page_table", "slots", "positions"),
        attrs=ROPE_ATTRS,
        infer=_infer,
        reference=_reference,
        check_data=_check_update_data,
        fast=Fast(_fast, checks_data=True),
        accuracy=Accuracy(ulps=2.0),
        inplace_operand=0,
        tiling=PAGED_UPDATE_TILING,
        lowering=Lowering("rope_paged_kv_update"),
        placement=_placements.rule(_update_dims),
    )
)


def rope_paged_kv_cache_update(
    pool: Tensor,
    new: Tensor,
    page_table: Tensor,
    slots: Tensor,
    positions: Tensor,
    *,
    theta: float = 10000.0,
    layout: str = "neox",
    rotary_dim: int | None = None,
    scaling: dict[str, Any] | None = None,
) -> Tensor:
    """Rotate ``new`` at each row's position (rope) and write it into the pool's pages there; the result
    is the pool's next value (module docstring)."""
    attrs = rope_attrs(theta, layout, rotary_dim, scaling, ROPE_PAGED_KV_CACHE_UPDATE)
    return assign_pool(ROPE_PAGED_KV_CACHE_UPDATE, pool, [pool, new, page_table, slots, positions], attrs)

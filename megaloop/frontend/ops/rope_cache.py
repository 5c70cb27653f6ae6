"""A key rotated and written into its cache in one op: ``rope_kv_cache_update(cache, new, positions)``
is ``kv_cache_update(cache, rope(new, positions), positions)`` (each token's rotary position is its
slot, as in Llama / Hugging Face): the same values (rope's, rounded to the cache's dtype, then copied)
without a rope op between the key projection and the cache, so that on a decode step attention waits
one dependent stage fewer in every layer (and no handoff between rope and the cache update). Where
the rotary positions are not the slots (a ring cache), use rope and kv_cache_update. A task writes one
(batch, head) slab, as kv_cache_update's: for many tokens (a prefill), rope's tiles over every token
and then the cache's copy run wider.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from megaloop.frontend.opdef import Accuracy, Fast, Lowering, OpCall, OpDef, OutSpec, register
from megaloop.frontend.ops import _tilings
from megaloop.frontend.ops._fast import Kernel, rounder
from megaloop.frontend.ops.attention import (
    CACHE_PLACEMENT,
    _update_infer,
    _update_ref,
    cache_update,
    check_update_data,
    write_slots,
)
from megaloop.frontend.ops.rope import ROPE_ATTRS, check_rotary, frequencies, rope_attrs, rotated
from megaloop.frontend.ops.rope import _reference as _rope_reference
from megaloop.frontend.tensor import Tensor


def _infer(call: OpCall) -> list[OutSpec]:
    out = _update_infer(call)  # kv_cache_update's rules for the cache, new and positions
    check_rotary(call, call.shape(1)[-1])  # and rope's for rotary_dim and layout
    return out


def _reference(arrays: list[np.ndarray], attrs: dict[str, Any]) -> np.ndarray:
    cache, new, pos = arrays
    b, t = pos.shape
    rotated = _rope_reference([new, pos.reshape(b, 1, t)], attrs).astype(new.dtype)  # rope's output, stored
    return _update_ref([cache, rotated, pos], attrs)


def _fast(node: Any) -> Kernel:
    """new rotated (rounded to its dtype, as rope stores it), then written into the cache in place."""
    attrs, inv, stored = node.attrs, frequencies(node.attrs), rounder(node.inputs[1].dtype)

    def run(arrays: list[np.ndarray]) -> list[np.ndarray]:
        cache, new, pos = arrays
        b, t = pos.shape
        return [write_slots(cache, stored(rotated(new, pos.reshape(b, 1, t), attrs, inv)), pos, attrs)]

    return run


ROPE_KV_CACHE_UPDATE = register(
    OpDef(
        name="rope_kv_cache_update",
        kind="compute",
        category="attention",
        doc="kv_cache_update(cache, rope(new, positions), positions) in one op: new [batch, kv_heads, tokens, "
        "dim] rotated at its positions [batch, tokens] (rope's layout, rotary_dim, theta and scaling) and "
        "written into the cache state there, in place.",
        operands=("cache", "new", "positions"),
        attrs=ROPE_ATTRS,
        infer=_infer,
        reference=_reference,
        fast=Fast(_fast, checks_data=True),
        check_data=check_update_data,
        accuracy=Accuracy(ulps=2.0),
        inplace_operand=0,
        tiling=_tilings.KV_UPDATE,
        lowering=Lowering("rope_kv_update"),
        placement=CACHE_PLACEMENT,
    )
)


def rope_kv_cache_update(
    cache: Tensor,
    new: Tensor,
    positions: Tensor,
    *,
    theta: float = 10000.0,
    layout: str = "neox",
    rotary_dim: int | None = None,
    scaling: dict[str, Any] | None = None,
) -> Tensor:
    """Rotate ``new`` at ``positions`` (rope) and write it into ``cache`` there; the result is the
    cache's next value."""
    attrs = rope_attrs(theta, layout, rotary_dim, scaling, ROPE_KV_CACHE_UPDATE)
    return cache_update(ROPE_KV_CACHE_UPDATE, cache, new, positions, **attrs)

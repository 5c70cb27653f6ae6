"""Rotary position embedding from given cos and sin tables (``rope_table``), as transformers'
``apply_rotary_pos_emb(q, k, cos, sin)`` takes them: out = x * cos + rotate(x) * sin over the first
rotary_dim dims of each head, the dims past it passed through.

x [..., head_dim] (any float dtype); cos and sin of one shape [..., n] (any float dtypes), their
leading axes broadcasting to x's leading axes (right-aligned: for x [batch, heads, tokens, head_dim],
tables [tokens, n] or [batch, 1, tokens, n], transformers' ``cos.unsqueeze(1)``). The table width n is
either rotary_dim (one value a dim, transformers' form; the default, rotary_dim = n) or rotary_dim / 2
(one value a rotary pair; pass rotary_dim = 2 n). With layout "neox", dim i < h = rotary_dim / 2 pairs
with i + h; "interleaved" pairs 2f with 2f + 1. For a pair (a, b) (a the first) and the tables' values
at a and b (per pair: both the pair's):

    out[a] = x[a] cos[a] - x[b] sin[a]        out[b] = x[b] cos[b] + x[a] sin[b]

computed in float64 and rounded once to x's dtype (the products of two float32 values are exact
there, so the GPU's float64 arithmetic gives the same bits).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from megaloop.errors import DtypeError, ShapeError
from megaloop.frontend.opdef import Accuracy, Lowering, OpCall, OpDef, OutSpec, VjpCall, register
from megaloop.frontend.ops import _placements, _tilings
from megaloop.frontend.ops._build import apply, require_int
from megaloop.frontend.ops._fast import VALUES_ONLY
from megaloop.frontend.ops._grad import f32, unbroadcast
from megaloop.frontend.ops.elementwise import check_kinds
from megaloop.frontend.ops.rope import LAYOUTS
from megaloop.frontend.shapes import broadcast_shapes, format_shape
from megaloop.frontend.tensor import BUILDERS as B
from megaloop.frontend.tensor import Tensor
from megaloop.frontend.tiling import Box, Read, Tile, Tiling, Write, chunks, project


def _infer(call: OpCall) -> list[OutSpec]:
    x, cos, sin = call.operands
    check_kinds(call, x.dtype, "f")
    for name, t in (("cos", cos), ("sin", sin)):
        if not t.dtype.is_float:
            raise call.error(DtypeError, f"{name} must be a float tensor, got {t.dtype.name}")
    if x.ndim < 1 or cos.ndim < 1:
        raise call.error(ShapeError, "x must be [..., head_dim] and the tables [..., n]")
    if cos.shape != sin.shape:
        raise call.error(ShapeError, f"cos {format_shape(cos.shape)} and sin {format_shape(sin.shape)} differ")
    lead = x.shape[:-1]
    if cos.ndim - 1 > len(lead) or broadcast_shapes(cos.shape[:-1], lead) != lead:
        raise call.error(
            ShapeError,
            f"the tables' leading axes {format_shape(cos.shape[:-1])} must broadcast to x's "
            f"{format_shape(lead)} (right-aligned)",
            hint="for x [batch, heads, tokens, dim] and tables [batch, tokens, n], pass them as "
            "[batch, 1, tokens, n] (transformers' cos.unsqueeze(1))",
        )
    n, hd = cos.shape[-1], x.shape[-1]
    rd = call.attrs["rotary_dim"]
    if rd is None:
        rd = call.attrs["rotary_dim"] = n
    if rd % 2 or not 2 <= rd <= hd:
        raise call.error(ShapeError, f"rotary_dim {rd} must be even and between 2 and head_dim {hd}")
    if n not in (rd, rd // 2):
        raise call.error(
            ShapeError,
            f"the tables' width {n} must be rotary_dim {rd} (a value a dim) or {rd // 2} (a value a pair)",
        )
    if call.attrs["layout"] not in LAYOUTS:
        raise call.error(ShapeError, f"layout must be one of {LAYOUTS}, got {call.attrs['layout']!r}")
    return [OutSpec(x.shape, x.dtype)]


def _per_dim(table: np.ndarray, rd: int, neox: bool) -> np.ndarray:
    """A table of one value a pair widened to one a dim (each pair's value at both its dims)."""
    if table.shape[-1] == rd:
        return table
    return np.concatenate([table, table], axis=-1) if neox else np.repeat(table, 2, axis=-1)


def _rotated_half(x: np.ndarray, neox: bool) -> np.ndarray:
    """rotate(x) of the rotary dims: (-x[b], x[a]) at (a, b) for each pair."""
    h = x.shape[-1] // 2
    if neox:
        return np.concatenate([-x[..., h:], x[..., :h]], axis=-1)
    return np.stack([-x[..., 1::2], x[..., 0::2]], axis=-1).reshape(x.shape)


def _reference(arrays: list[np.ndarray], attrs: dict[str, Any]) -> np.ndarray:
    x, cos, sin = (a.astype(np.float64) for a in arrays)
    rd, neox = attrs["rotary_dim"], attrs["layout"] == "neox"
    rot = x[..., :rd]
    out = rot * _per_dim(cos, rd, neox) + _rotated_half(rot, neox) * _per_dim(sin, rd, neox)
    return np.concatenate([out, x[..., rd:]], axis=-1).astype(np.float32)


def _table_dims(node: Any) -> list[_placements.Dim]:
    """Every axis of x but the rotated one; the tables are cut along the axes they do not broadcast."""
    x, table = node.inputs[0], node.inputs[1]
    lead = x.ndim - table.ndim
    dims = []
    for a in range(x.ndim - 1):
        b = a - lead
        cut = ((1, b, 1), (2, b, 1)) if b >= 0 and table.shape[b] == x.shape[a] else ()
        dims.append(_placements.Dim(x.shape[a], ((0, a, 1), *cut, (_placements.OUT, a, 1)), label=f"axis {a}"))
    return dims


def _tiles(node: Any, params: dict[str, int], ctx: Any) -> list[Tile]:
    x, table = node.inputs[0], node.inputs[1]
    n = table.shape[-1]
    tiles = []
    for i, box in enumerate(chunks(x.shape[:-1], max(1, params["elements"] // x.shape[-1]))):
        xbox = Box(box.lo + (0,), box.hi + (x.shape[-1],))
        rows = project(box, x.shape[:-1], table.shape[:-1])
        tbox = Box(rows.lo + (0,), rows.hi + (n,))
        reads = (Read(0, xbox), Read(1, tbox), Read(2, tbox))
        tiles.append(Tile((i,), reads, (Write(0, xbox),), 3 * xbox.size))
    return tiles


TILING = Tiling({"elements": _tilings.ELEMENTS}, _tiles, "blocks of whole head vectors with their table rows")


def _vjp(call: VjpCall) -> list[Tensor | None]:
    """x's gradient: the transposed rotation, rope_table of the cotangent with sin' = -(sin with the
    values of each pair's two dims swapped) (per pair: -sin); the tables': g x and g rotate(x) over
    the rotary dims (per pair: a pair's two dims added), summed back to their shapes."""
    x, cos, sin = call.inputs
    rd, neox = call.attrs["rotary_dim"], call.attrs["layout"] == "neox"
    g = call.cotangent()
    grads: list[Tensor | None] = [None, None, None]
    per_pair = cos.shape[-1] != rd
    if call.needs[0]:
        turned = B.neg(sin if per_pair else _swapped(sin, neox))
        grads[0] = apply(ROPE_TABLE, [g, cos, turned], layout=call.attrs["layout"], rotary_dim=rd)
    if call.needs[1] or call.needs[2]:
        gr, xr = f32(g[..., :rd]), f32(x[..., :rd])
        for k, other in ((1, xr), (2, _rotate(xr, neox))):
            if call.needs[k]:
                d = gr * other
                d = _pairs_summed(d, neox) if per_pair else d
                grads[k] = B.cast(unbroadcast(d, call.inputs[k].shape), call.inputs[k].dtype)
    return grads


def _swapped(t: Tensor, neox: bool) -> Tensor:
    """``t``'s last axis with the two dims of each pair swapped."""
    h = t.shape[-1] // 2
    if neox:
        return B.concat([t[..., h:], t[..., :h]], -1)
    pairs = B.reshape(t, (*t.shape[:-1], h, 2))
    return B.reshape(B.concat([pairs[..., 1:], pairs[..., :1]], -1), t.shape)


def _rotate(t: Tensor, neox: bool) -> Tensor:
    """rotate(t): (-t[b], t[a]) at each pair (a, b)."""
    swapped = _swapped(t, neox)
    h = t.shape[-1] // 2
    if neox:
        return B.concat([B.neg(swapped[..., :h]), swapped[..., h:]], -1)
    pairs = B.reshape(swapped, (*t.shape[:-1], h, 2))
    return B.reshape(B.concat([B.neg(pairs[..., :1]), pairs[..., 1:]], -1), t.shape)


def _pairs_summed(t: Tensor, neox: bool) -> Tensor:
    """The two dims of each pair added: [..., rd] -> [..., rd / 2]."""
    h = t.shape[-1] // 2
    if neox:
        return t[..., :h] + t[..., h:]
    return B.sum(B.reshape(t, (*t.shape[:-1], h, 2)), -1)


ROPE_TABLE = register(
    OpDef(
        name="rope_table",
        kind="compute",
        category="position",
        doc="Rope from given cos and sin tables (a value a rotary dim, or a pair): x * cos + rotate(x) * sin "
        "over the first rotary_dim dims, in float64, rounded once; see megaloop.frontend.ops.rope_table.",
        operands=("x", "cos", "sin"),
        attrs={"layout": LAYOUTS, "rotary_dim": "count?"},
        infer=_infer,
        reference=_reference,
        fast=VALUES_ONLY,
        accuracy=Accuracy(ulps=1.0),
        tiling=TILING,
        lowering=Lowering("rope_table"),
        placement=_placements.rule(_table_dims),
        vjp=lambda call: _vjp(call),
    )
)


def rope_table(x: Tensor, cos: Tensor, sin: Tensor, *, layout: str = "neox", rotary_dim: int | None = None) -> Tensor:
    """Rope of ``x`` [..., head_dim] with the given ``cos`` and ``sin`` tables [..., n] (module docstring):
    n = rotary_dim (transformers' tables; the default rotary_dim is n) or rotary_dim / 2 (a value a pair)."""
    if rotary_dim is not None:
        rotary_dim = require_int(ROPE_TABLE, "rotary_dim", rotary_dim, minimum=2)
    return apply(ROPE_TABLE, [x, cos, sin], layout=layout, rotary_dim=rotary_dim)

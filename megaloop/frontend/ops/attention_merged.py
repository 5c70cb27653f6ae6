"""attention_partial and attention_combine as one op whose key-range tiles merge themselves: each tile
writes its range's partial sums (output ``parts``, attention_partial's [batch, heads, q_len, splits,
v_dim + 2] float32), then bumps an arrival word of its rows (output ``arrivals``, int64 [batch, heads,
q_len]); the tile that completes the count merges every range as attention_combine does and writes the
normalised output (output ``out``, in q's dtype). The readers of attention's output then wait for the
attention tiles themselves: no combine stage, one handoff less (docs/runtime.md, "The decode attention
chain shortened"). Values: attention_combine(attention_partial(...)) bit for bit.

On the GPU the arrival word holds the iteration's stamp (high 32 bits) and the count (low 32), so it
needs no zeroing and no reset: a tile that finds another iteration's stamp starts the count at 1.
``arrivals`` is that word, read by no op (its values in the references are zeros).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from megaloop.dtypes import int64
from megaloop.frontend.opdef import Accuracy, Lowering, Merge, OpCall, OpDef, OutSpec, register
from megaloop.frontend.ops import _placements, _tilings
from megaloop.frontend.ops._build import apply_multi
from megaloop.frontend.ops.attention import attention_dims
from megaloop.frontend.ops.attention_split import (
    APPEND_ATTRS,
    ATTENTION_PARTIAL,
    _check_partial_data,
    _combine_reference,
    _partial_infer,
    _partial_reference,
)
from megaloop.frontend.tensor import Tensor
from megaloop.frontend.tiling import Tiling, Write

PARTS, OUT, ARRIVALS = 0, 1, 2  # its outputs


def _infer(call: OpCall) -> list[OutSpec]:
    (parts,) = _partial_infer(call)
    b, hq, tq = parts.shape[:3]
    return [parts, OutSpec((b, hq, tq, parts.shape[4] - 2), call.operands[0].dtype), OutSpec((b, hq, tq), int64)]


def _merge(parts: np.ndarray, attrs: dict[str, Any]) -> list[np.ndarray]:
    """The outputs the last tile writes: attention_combine's of the parts, and the arrival words."""
    return [_combine_reference([parts], attrs), np.zeros(parts.shape[:3], np.int64)]


def _reference(arrays: list[np.ndarray], attrs: dict[str, Any]) -> list[np.ndarray]:
    parts = _partial_reference(arrays, attrs)
    return [parts, *_merge(parts, attrs)]


def _tiles(node: Any, params: dict[str, int], ctx: Any) -> list[_tilings.Tile]:
    """attention_partial's tiles (one key range of a block of rows each), each also writing its rows of
    the output and of the arrival words: shared with the other ranges' tiles of those rows, of which
    the last to arrive writes them (Merge)."""
    tiles = []
    for tile in _tilings._attention_tiles(node, params, ctx, node.attrs["splits"]):
        own = tile.writes[0].box
        rows = _tilings.Box(own.lo[:3], own.hi[:3])
        out = _tilings.Box(rows.lo + (0,), rows.hi + (node.outputs[OUT].shape[3],))
        writes = (tile.writes[0], Write(OUT, out), Write(ARRIVALS, rows))
        tiles.append(tile._replace(writes=writes, flops=tile.flops + 3 * own.size))
    return tiles


def _dims(node: Any) -> list[_placements.Dim]:
    """attention_partial's, the output and the arrival words split along the same rows."""
    dims = []
    for dim in attention_dims(node):
        extra = tuple((_placements.OUT - k, a, s) for slot, a, s in dim.axes if slot == _placements.OUT for k in (1, 2))
        dims.append(dataclasses.replace(dim, axes=dim.axes + extra))
    return dims


ATTENTION_MERGED = register(
    OpDef(
        name="attention_merged",
        kind="compute",
        category="attention",
        doc="attention_partial whose key-range tiles merge themselves: the last tile of a block of rows to "
        "arrive writes attention_combine's output; outputs (parts, out, arrivals); see "
        "megaloop.frontend.ops.attention_merged.",
        operands=ATTENTION_PARTIAL.operands,
        attrs=ATTENTION_PARTIAL.attrs,
        optional_attrs=frozenset({"absent", "softcap", "masked", *APPEND_ATTRS}),
        infer=_infer,
        reference=_reference,
        check_data=_check_partial_data,
        accuracy=Accuracy(ulps=2.0, per_reduction=True),
        tiling=Tiling(
            {"q_block": {"sm_80": 64, "sm_86": 64, "sm_89": 64, "sm_90": 64}},
            _tiles,
            "attention_partial's tiles; the last key range of a block of rows to arrive merges them",
        ),
        lowering=Lowering("attention_merged"),
        placement=_placements.rule(_dims),
        merge=Merge(PARTS, _merge),
    )
)


def attention_merged(partial: Tensor) -> Tensor:
    """attention_combine(``partial``) where ``partial`` is attention_partial's result: the same
    attention as one op (the fuse rule attention_merge builds it); returns the output."""
    node = partial.node
    outs = apply_multi(ATTENTION_MERGED, list(node.inputs), **node.attrs)
    return outs[OUT]

"""Embedding lookup: gather rows of a table by integer ids."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from megaloop.errors import DataError, DtypeError, ShapeError
from megaloop.frontend.opdef import Accuracy, Lowering, OpCall, OpDef, OutSpec, VjpCall, first_bad, register
from megaloop.frontend.ops import _placements, _tilings
from megaloop.frontend.ops import elementwise as ew
from megaloop.frontend.ops._build import apply
from megaloop.frontend.ops._fast import MOVES_VALUES
from megaloop.frontend.ops.layout import reshape
from megaloop.frontend.placement import REPLICATE, LocalCall, Partial, Shard, Strategy, bounds, even_sizes
from megaloop.frontend.shapes import format_shape
from megaloop.frontend.tensor import Tensor
from megaloop.frontend.validate import as_int


def _infer(call: OpCall) -> list[OutSpec]:
    table, ids = call.operands
    if table.ndim != 2:
        raise call.error(ShapeError, f"table must be 2-D [vocab, dim], got {format_shape(table.shape)}")
    if not ids.dtype.is_int:
        raise call.error(DtypeError, f"ids must be int32 or int64, got {ids.dtype.name}")
    if table.dtype.is_bool:
        raise call.error(DtypeError, "table must hold numbers (floats or ints), got bool")
    return [OutSpec((*ids.shape, table.shape[1]), table.dtype)]


def _check_data(arrays: list[np.ndarray], attrs: dict[str, Any], known: Sequence[np.ndarray | None]) -> None:
    table, ids = arrays
    bad = (ids < 0) | (ids >= table.shape[0])
    where = first_bad(bad, known[1])
    if where is not None:
        count = np.count_nonzero(bad if known[1] is None else bad & known[1])
        raise DataError(
            f"id {int(ids[where])} at index {where} is outside the table of {table.shape[0]} rows "
            f"({count} bad ids in all)"
        )


def _reference(arrays: list[np.ndarray], attrs: dict[str, Any]) -> np.ndarray:
    table, ids = arrays
    return table[np.clip(ids, 0, table.shape[0] - 1)]  # check_data refused real ids outside


def _vjp(call: VjpCall) -> list[Tensor | None]:
    """The table's gradient: each id's row of the cotangent summed into that id's row (scatter_add,
    the lookup's transpose); the ids take none."""
    table, ids = call.inputs
    n = ids.size
    rows = reshape(call.cotangent(), (n, table.shape[1]))
    return [scatter_add(rows, reshape(ids, (n,)), table.shape[0]), None]


EMBEDDING = register(
    OpDef(
        name="embedding",
        kind="compute",
        category="gather",
        doc="table[ids]: rows of a [vocab, dim] table (floats or ints) for integer ids of any shape; "
        "an id outside [0, vocab) is an error.",
        operands=("table", "ids"),
        infer=_infer,
        reference=_reference,
        fast=MOVES_VALUES,
        check_data=_check_data,
        accuracy=Accuracy(ulps=0.0),
        tiling=_tilings.EMBEDDING,
        lowering=Lowering("embedding"),
        placement=_placements.rule(lambda node: _dims(node), lambda node, n, given: _by_vocabulary(node, n, given)),
        vjp=lambda call: _vjp(call),
    )
)


def _dims(node: Any) -> list[_placements.Dim]:
    """The ids' axes (the table whole), or the table's columns (the ids whole)."""
    table, ids = node.inputs
    dims = [
        _placements.Dim(s, ((1, a, 1), (_placements.OUT, a, 1)), label=f"ids axis {a}") for a, s in enumerate(ids.shape)
    ]
    dims.append(_placements.Dim(table.shape[1], ((0, 1, 1), (_placements.OUT, ids.ndim, 1)), label="by columns"))
    return dims


def _by_vocabulary(node: Any, members: int, given: Any) -> list[Strategy]:
    """The table's rows cut over the members: each looks up the ids in its rows, zeros elsewhere, and
    the output is their sum."""
    vocab = node.inputs[0].shape[0]
    options = [even_sizes(vocab, members)]
    if isinstance(given[0], Shard) and given[0].axis == 0 and given[0].sizes:
        options.append(given[0].sizes)
    return [
        Strategy((Shard(0, sizes), REPLICATE), (Partial(),), "by vocabulary", _vocabulary_part)
        for sizes in dict.fromkeys(options)
        if min(sizes) >= 1
    ]


def _vocabulary_part(call: LocalCall) -> tuple[Tensor, ...]:
    """Ids in this member's rows are looked up (shifted), other valid ids read row 0 and are zeroed;
    an id outside the whole table stays out of range, so the lookup still reports it."""
    table, ids = call.operands
    lo, hi = bounds(call.strategy.inputs[0].sizes)[call.member]
    vocab = call.node.inputs[0].shape[0]
    mine = ew.logical_and(ew.greater_equal(ids, lo), ew.less(ids, hi))
    valid = ew.logical_and(ew.greater_equal(ids, 0), ew.less(ids, vocab))
    local = ew.where(ew.logical_and(valid, ew.logical_not(mine)), 0, ew.sub(ids, lo))
    rows = embedding(table, local)
    return (ew.where(reshape(mine, (*mine.shape, 1)), rows, 0.0 if table.dtype.is_float else 0),)


def embedding(table: Tensor, ids: Tensor) -> Tensor:
    return apply(EMBEDDING, [table, ids])


# ---- scatter_add: the lookup's transpose ----------------------------------------------------------


def _scatter_infer(call: OpCall) -> list[OutSpec]:
    values, ids = call.operands
    if not values.dtype.is_float:
        raise call.error(DtypeError, f"values must be floats (a gradient's rows), got {values.dtype.name}")
    if values.ndim != 2:
        raise call.error(ShapeError, f"values must be 2-D [n, dim], got {format_shape(values.shape)}")
    if not ids.dtype.is_int or ids.shape != values.shape[:1]:
        raise call.error(
            ShapeError if ids.dtype.is_int else DtypeError,
            f"ids must be int32 or int64 [{values.shape[0]}] (one a row of values), got "
            f"{ids.dtype.name}{format_shape(ids.shape)}",
        )
    return [OutSpec((call.attrs["rows"], values.shape[1]), values.dtype)]


def _check_scatter_data(arrays: list[np.ndarray], attrs: dict[str, Any], known: Sequence[np.ndarray | None]) -> None:
    _check_data([np.empty((attrs["rows"], 0)), arrays[1]], attrs, [None, known[1]])


def _scatter_reference(arrays: list[np.ndarray], attrs: dict[str, Any]) -> np.ndarray:
    values, ids = arrays
    out = np.zeros((attrs["rows"], values.shape[1]), np.float32)
    np.add.at(out, np.clip(ids, 0, attrs["rows"] - 1), ew.to_compute(values))  # (in order: reproducible)
    return out


def _scatter_dims(node: Any) -> list[_placements.Dim]:
    """By columns (the ids whole), or by rows of values with their ids (partial sums)."""
    values = node.inputs[0]
    out = _placements.OUT
    return [
        _placements.Dim(values.shape[1], ((0, 1, 1), (out, 1, 1)), label="by columns"),
        _placements.Dim(values.shape[0], ((0, 0, 1), (1, 0, 1)), reduce="sum", label="by ids"),
    ]


SCATTER_ADD = register(
    OpDef(
        name="scatter_add",
        kind="compute",
        category="gather",
        doc="out[r] = the sum of the rows values[i] whose ids[i] == r (float32, in the order of i, one "
        "rounding), zeros for a row no id names: embedding's transpose (its gradient). An id outside "
        "[0, rows) is an error.",
        operands=("values", "ids"),
        attrs={"rows": "count"},
        infer=_scatter_infer,
        reference=_scatter_reference,
        check_data=_check_scatter_data,
        accuracy=Accuracy(ulps=1.0, per_reduction=True),
        tiling=_tilings.SCATTER_ADD,
        lowering=Lowering("scatter_add"),
        placement=_placements.rule(_scatter_dims),
        vjp=lambda call: [embedding(call.cotangent(), call.inputs[1]), None],
    )
)


def scatter_add(values: Tensor, ids: Tensor, rows: int) -> Tensor:
    """A [rows, dim] tensor whose row r sums the rows of ``values`` [n, dim] whose ``ids`` [n] are r."""
    return apply(SCATTER_ADD, [values, ids], rows=as_int(rows, "scatter_add: rows", minimum=1))

"""Embedding lookup: gather rows of a table by integer ids."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from megaloop.errors import DataError, DtypeError, ShapeError
from megaloop.frontend.opdef import Accuracy, CudaTile, OpCall, OpDef, OutSpec, first_bad, register
from megaloop.frontend.ops import _tilings
from megaloop.frontend.ops._build import apply
from megaloop.frontend.shapes import format_shape
from megaloop.frontend.tensor import Tensor


def _infer(call: OpCall) -> list[OutSpec]:
    table, ids = call.operands
    if table.ndim != 2:
        raise call.error(ShapeError, f"table must be 2-D [vocab, dim], got {format_shape(table.shape)}")
    if not ids.dtype.is_int:
        raise call.error(DtypeError, f"ids must be int32 or int64, got {ids.dtype.name}")
    if not table.dtype.is_float:
        raise call.error(DtypeError, f"table must hold floats, got {table.dtype.name}")
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


EMBEDDING = register(
    OpDef(
        name="embedding",
        kind="compute",
        category="gather",
        doc="table[ids]: rows of a [vocab, dim] table for integer ids of any shape; "
        "an id outside [0, vocab) is an error.",
        operands=("table", "ids"),
        infer=_infer,
        reference=_reference,
        check_data=_check_data,
        accuracy=Accuracy(ulps=0.0),
        tiling=_tilings.EMBEDDING,
        cuda=CudaTile("embedding"),
    )
)


def embedding(table: Tensor, ids: Tensor) -> Tensor:
    return apply(EMBEDDING, [table, ids])

"""``step_batch(data, counter)``: the step's batch out of data uploaded once (a training loop's token
windows), picked by the step counter: ``data[counter mod n]`` for data [n, ...] and an int64 0-d
counter, wrapping around at the end of the data. One loop iteration is then one training step with no
host work between steps: the data is a state (or input) written once, the counter a state the graph
adds 1 to (megaloop/training). A counter below 0 is a data error.

On the GPU (megaloop/gather.cuh's ``step_batch``) a tile copies a block of the output from the
counter's row; the tile declares the whole of data's first axis as read (the row is known at run
time only), and moves only the row's values (the cost model is told so).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from megaloop import dtypes
from megaloop.errors import DataError, DtypeError, ShapeError
from megaloop.frontend.opdef import Accuracy, Lowering, OpCall, OpDef, OutSpec, first_bad, register
from megaloop.frontend.ops import _placements
from megaloop.frontend.ops._build import apply
from megaloop.frontend.ops._fast import MOVES_VALUES
from megaloop.frontend.ops._tilings import ELEMENTS, _elements
from megaloop.frontend.shapes import format_shape
from megaloop.frontend.tensor import Tensor
from megaloop.frontend.tiling import Box, Read, Tile, Tiling, Write, chunks, same


def _infer(call: OpCall) -> list[OutSpec]:
    data, counter = call.operands
    if data.ndim < 1:
        raise call.error(ShapeError, "data must have a leading axis of batches [n, ...], got a 0-d tensor")
    if data.dtype.is_bool:
        raise call.error(DtypeError, "data must hold numbers (token ids, floats), got bool")
    if counter.dtype != dtypes.int64 or counter.shape != ():
        raise call.error(
            DtypeError,
            f"counter must be an int64 0-d step counter, got {counter.dtype.short}{format_shape(counter.shape)}",
            hint="make it with graph.state(name, (), 'int64') and assign it counter + 1 each iteration",
        )
    return [OutSpec(data.shape[1:], data.dtype)]


def _check_data(arrays: list[np.ndarray], attrs: dict[str, Any], known: Sequence[np.ndarray | None]) -> None:
    counter = np.asarray(arrays[1])
    if first_bad(counter < 0, known[1]) is not None:
        raise DataError(
            f"step_batch: the step counter is {int(counter.reshape(()))}; it counts the steps done and must be "
            ">= 0 (reset the counter state to 0)"
        )


def _reference(arrays: list[np.ndarray], attrs: dict[str, Any]) -> np.ndarray:
    data, counter = arrays
    row = max(0, int(np.asarray(counter).reshape(()))) % data.shape[0]  # (check_data refused a negative one)
    return np.array(data[row])


def _tiles(node: Any, params: dict[str, int], ctx: Any) -> list[Tile]:
    data, _ = node.inputs
    out = node.outputs[0]
    size = out.dtype.itemsize
    tiles = []
    boxes = chunks(out.shape, _elements(params, math.prod(out.shape), ctx)) if out.shape else [Box((), ())]
    for i, box in enumerate(boxes):
        whole = Box((0, *box.lo), (data.shape[0], *box.hi))  # the row is the counter's: any of them
        moved = 2 * box.size * size + 8
        tiles.append(Tile((i,), (Read(0, whole), Read(1, Box((), ()))), (Write(0, box),), 0, moved))
    return tiles


def _dims(node: Any) -> list[_placements.Dim]:
    """Any axis of the batch (data's axis a + 1) cut with the output's axis a; the counter whole."""
    out = node.outputs[0]
    return [
        _placements.Dim(s, ((0, a + 1, 1), (_placements.OUT, a, 1)), label=f"batch axis {a}")
        for a, s in enumerate(out.shape)
    ]


STEP_BATCH = register(
    OpDef(
        name="step_batch",
        kind="compute",
        category="gather",
        doc="data[counter mod n]: the step's batch out of data [n, ...] uploaded once, picked by an int64 0-d "
        "step counter (wrapping around at the end of the data; a negative counter is an error).",
        operands=("data", "counter"),
        infer=_infer,
        reference=_reference,
        fast=MOVES_VALUES,
        check_data=_check_data,
        accuracy=Accuracy(ulps=0.0),
        tiling=Tiling({"elements": ELEMENTS, "waves": same(8)}, _tiles, "row-major chunks of the step's batch"),
        lowering=Lowering("step_batch"),
        placement=_placements.rule(_dims),
    )
)


def step_batch(data: Tensor, counter: Tensor) -> Tensor:
    """``data[counter mod n]`` for ``data`` [n, ...] and ``counter`` an int64 0-d step counter: the batch
    of the step the counter says, the data read from the start again after its n batches."""
    return apply(STEP_BATCH, [data, counter])

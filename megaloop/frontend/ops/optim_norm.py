"""The scalars an optimizer step needs, computed in the loop kernel: gradients' squared norms (for
global-norm clipping) and the learning rate of the step counter's update (a schedule).

- ``square_sum(x, splits=S)``: float32 [S], element i the sum of squares of x's rows (axis 0) in
  range i, the rows cut into S equal ranges (the last shorter; a 0-d x is one row). A tile a range,
  the whole block on it, so a large gradient's norm is spread over the processors; the ranges' sums
  are then added by ``sum`` (the optimizer helper: megaloop/optim). Cutting x on any axis but 0
  over ranks leaves partial sums (the partitioner's all_reduce adds them).
- ``lr_schedule(counter, lr=, warmup=, total=, min_lr=, kind=, accumulate=)``: float32 0-d, the
  learning rate of update s = counter // accumulate (from 0: the update this micro-batch belongs
  to): s < warmup: lr * s / warmup (Hugging Face's warmup, which starts at 0); then with progress
  p = min(1, (s - warmup) / max(1, total - warmup)) it decays from lr to min_lr: cosine:
  min_lr + (lr - min_lr) * (1 + cos(pi p)) / 2, linear: min_lr + (lr - min_lr) * (1 - p), constant:
  lr. In float64, rounded once to float32 (the GPU too: its tile computes in double).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from megaloop import dtypes
from megaloop.errors import DtypeError, GraphBuildError, ShapeError
from megaloop.frontend.opdef import Accuracy, Lowering, OpCall, OpDef, OutSpec, register
from megaloop.frontend.ops import _placements, _tilings
from megaloop.frontend.ops._build import apply, require_int, require_scalar, require_tensor
from megaloop.frontend.ops.optim import check_counter
from megaloop.frontend.shapes import format_shape
from megaloop.frontend.tensor import Tensor
from megaloop.frontend.tiling import Box, Read, Tile, Tiling, Write

# a range of square_sum's is at least this many elements where the tensor has rows enough: a task then
# streams 64-256 KB (a few microseconds on one SM), which hides its wait and signal
RANGE_ELEMENTS = 32768

# ---- square_sum ---------------------------------------------------------------------------------------


def range_rows(rows: int, splits: int) -> int:
    """Rows of each of square_sum's ranges (the last may be shorter)."""
    return -(-rows // splits)


def auto_splits(shape: tuple[int, ...]) -> int:
    """Ranges of at least RANGE_ELEMENTS elements, whole rows, none empty."""
    rows = shape[0] if shape else 1
    total = math.prod(shape)
    wanted = max(1, min(rows, total // RANGE_ELEMENTS))
    return -(-rows // range_rows(rows, wanted))


def _square_sum_infer(call: OpCall) -> list[OutSpec]:
    x = call.operands[0]
    if not x.dtype.is_float:
        raise call.error(DtypeError, f"x must be a floating tensor, got {x.dtype.name}", hint="cast it")
    rows = x.shape[0] if x.shape else 1
    splits = call.attrs["splits"]
    if splits > rows or -(-rows // range_rows(rows, splits)) != splits:
        raise call.error(
            ShapeError,
            f"splits={splits} does not cut the {rows} rows (axis 0) of x {format_shape(x.shape)} into that many "
            "non-empty equal ranges",
            hint=f"use splits=None (chooses {auto_splits(x.shape)}) or a count of ranges of whole rows",
        )
    return [OutSpec((splits,), dtypes.float32)]


def _square_sum_ref(arrays: list[np.ndarray], attrs: dict[str, Any]) -> np.ndarray:
    x = np.asarray(arrays[0]).astype(np.float64)
    x = x.reshape(1) if x.ndim == 0 else x
    per = range_rows(x.shape[0], attrs["splits"])
    sums = [np.sum(np.square(x[i * per : (i + 1) * per])) for i in range(attrs["splits"])]
    return np.asarray(sums).astype(np.float32)


def _square_sum_tiles(node: Any, params: dict[str, int], ctx: Any) -> list[Tile]:
    x = node.inputs[0]
    rows = x.shape[0] if x.shape else 1
    per = range_rows(rows, node.attrs["splits"])
    tiles = []
    for i in range(node.attrs["splits"]):
        lo, hi = i * per, min(rows, (i + 1) * per)
        box = Box((lo, *(0 for _ in x.shape[1:])), (hi, *x.shape[1:])) if x.shape else Box((), ())
        tiles.append(Tile((i,), (Read(0, box),), (Write(0, Box((i,), (i + 1,))),), flops=2 * box.size))
    return tiles


def _square_sum_dims(node: Any) -> list[_placements.Dim]:
    """x cut on any axis but the rows' (each member's ranges then cover the same rows of its part):
    the output holds partial sums."""
    x = node.inputs[0]
    return [_placements.Dim(x.shape[a], ((0, a, 1),), reduce="sum", label=f"x's axis {a}") for a in range(1, x.ndim)]


SQUARE_SUM = register(
    OpDef(
        name="square_sum",
        kind="compute",
        category="optimizer",
        doc="Sums of squares of x's rows (axis 0) in `splits` equal ranges: float32 [splits], a tile a range "
        "(a gradient's squared norm, spread over the processors; megaloop.frontend.ops.optim_norm).",
        operands=("x",),
        infer=_square_sum_infer,
        reference=_square_sum_ref,
        attrs={"splits": "count"},
        accuracy=Accuracy(ulps=2.0, per_reduction=True),
        tiling=Tiling({}, _square_sum_tiles, "a range of rows a tile, the whole block on it"),
        lowering=Lowering("square_sum"),
        placement=_placements.rule(_square_sum_dims),
    )
)


def square_sum(x: Tensor, splits: int | None = None) -> Tensor:
    """float32 [splits]: the sums of squares of ``x``'s rows (axis 0) in ``splits`` equal ranges
    (None: ranges of about 32K elements or more); ``sum`` of it is x's squared norm."""
    require_tensor(SQUARE_SUM, "x", x)
    n = auto_splits(x.shape) if splits is None else require_int(SQUARE_SUM, "splits", splits, minimum=1)
    return apply(SQUARE_SUM, [x], splits=n)


# ---- lr_schedule --------------------------------------------------------------------------------------

SCHEDULES = ("constant", "linear", "cosine")


def schedule_lr(s: int, attrs: dict[str, Any]) -> float:
    """The learning rate of update ``s`` (from 0), in float64."""
    lr, warmup = attrs["lr"], attrs["warmup"]
    if s < warmup:
        return lr * s / warmup
    if attrs["kind"] == "constant":
        return lr
    p = min(1.0, (s - warmup) / max(1, attrs["total"] - warmup))
    decay = 0.5 * (1.0 + math.cos(math.pi * p)) if attrs["kind"] == "cosine" else 1.0 - p
    return attrs["min_lr"] + (lr - attrs["min_lr"]) * decay


def _lr_infer(call: OpCall) -> list[OutSpec]:
    c = call.operands[0]
    if c.dtype != dtypes.int64 or c.shape != ():
        raise call.error(
            DtypeError, f"counter must be an int64 0-d step counter, got {c.dtype.short}{format_shape(c.shape)}"
        )
    return [OutSpec((), dtypes.float32)]


def _lr_ref(arrays: list[np.ndarray], attrs: dict[str, Any]) -> np.ndarray:
    s = max(0, int(np.asarray(arrays[0]).reshape(()))) // attrs["accumulate"]
    return np.asarray(schedule_lr(s, attrs), np.float32)


LR_SCHEDULE = register(
    OpDef(
        name="lr_schedule",
        kind="compute",
        category="optimizer",
        doc="The learning rate (float32 0-d) of the step counter's update: linear warmup from 0, then a "
        "constant, linear or cosine decay to min_lr at `total` updates (megaloop.frontend.ops.optim_norm).",
        operands=("counter",),
        infer=_lr_infer,
        reference=_lr_ref,
        check_data=check_counter("lr_schedule", 0),
        attrs={
            "lr": "number",
            "min_lr": "number",
            "warmup": "rank",
            "total": "count",
            "kind": SCHEDULES,
            "accumulate": "count",
        },
        accuracy=Accuracy(ulps=1.0),
        tiling=_tilings.ELEMENTWISE,
        lowering=Lowering(
            "lr_schedule",
            lambda a: (
                f"{float(a['lr']).hex()}, {float(a['min_lr']).hex()}, {int(a['warmup'])}LL, {int(a['total'])}LL, "
                f"{SCHEDULES.index(a['kind'])}, {int(a['accumulate'])}LL"
            ),
        ),
        placement=_placements.rule(_placements.elementwise_dims),
    )
)


def lr_schedule(
    counter: Tensor,
    *,
    lr: float,
    total: int,
    warmup: int = 0,
    min_lr: float = 0.0,
    kind: str = "cosine",
    accumulate: int = 1,
) -> Tensor:
    """float32 0-d: the learning rate of the update ``counter`` (micro-batches done, int64 0-d) belongs to:
    ``warmup`` updates rising linearly from 0, then ``kind`` ("cosine", "linear", "constant") decay to
    ``min_lr`` at ``total`` updates (and min_lr after)."""
    op = LR_SCHEDULE
    require_tensor(op, "counter", counter)
    if kind not in SCHEDULES:
        raise GraphBuildError(f"lr_schedule: kind must be one of {list(SCHEDULES)}, got {kind!r}")
    peak = float(require_scalar(op, "lr", lr))
    floor = float(require_scalar(op, "min_lr", min_lr))
    if not 0 <= floor <= peak:
        raise GraphBuildError(f"lr_schedule: need 0 <= min_lr <= lr, got min_lr={floor}, lr={peak}")
    attrs = {
        "lr": peak,
        "min_lr": floor,
        "warmup": require_int(op, "warmup", warmup, minimum=0),
        "total": require_int(op, "total", total, minimum=1),
        "kind": kind,
        "accumulate": require_int(op, "accumulate", accumulate, minimum=1),
    }
    return apply(op, [counter], **attrs)

"""Reductions: sums, means, max/min, argmax (whole and split over tiles)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

import megaloop as ml
from tests.op_table._base import FLOATS, INTS, Sample, rand_shape, row


def _reduce_sample(rng: np.random.Generator, single_axis: bool = False) -> Sample:
    shape = rand_shape(rng, 1, 4)
    choice = rng.integers(0, 3)
    if single_axis or choice == 0:
        axis: Any = int(rng.integers(-len(shape), len(shape)))
    elif choice == 1:
        axis = None
    else:
        k = int(rng.integers(1, len(shape) + 1))
        axis = tuple(int(a) for a in rng.choice(len(shape), k, replace=False))
    return Sample([shape], {"axis": axis, "keepdims": bool(rng.random() < 0.5)})


def _reduced_len(s: Sample) -> int:
    shape, axis = s.shapes[0], s.kw["axis"]
    axes = range(len(shape)) if axis is None else [axis] if isinstance(axis, int) else axis
    return math.prod(shape[a] for a in axes)


def _torch_axes(axis: Any, ndim: int) -> tuple[int, ...]:
    return tuple(range(ndim)) if axis is None else (axis,) if isinstance(axis, int) else tuple(axis)


row(
    "sum",
    "axes",
    lambda g, a, axis, keepdims: ml.sum(a, axis, keepdims=keepdims),
    lambda a, axis, keepdims, **k: torch.sum(a, _torch_axes(axis, a.ndim), keepdim=keepdims),
    _reduce_sample,
    FLOATS + INTS,
    reduce_len=_reduced_len,
    cancels=True,
)
row(
    "mean",
    "axes",
    lambda g, a, axis, keepdims: ml.mean(a, axis, keepdims=keepdims),
    lambda a, axis, keepdims, **k: torch.mean(a, _torch_axes(axis, a.ndim), keepdim=keepdims),
    _reduce_sample,
    reduce_len=_reduced_len,
    cancels=True,
)
row(
    "max",
    "axes",
    lambda g, a, axis, keepdims: a.max(axis, keepdims=keepdims),
    lambda a, axis, keepdims, **k: torch.amax(a, _torch_axes(axis, a.ndim), keepdim=keepdims),
    _reduce_sample,
    FLOATS + INTS,
    domains=("ties",),
)
row(
    "min",
    "axes",
    lambda g, a, axis, keepdims: a.min(axis, keepdims=keepdims),
    lambda a, axis, keepdims, **k: torch.amin(a, _torch_axes(axis, a.ndim), keepdim=keepdims),
    _reduce_sample,
    FLOATS + INTS,
    domains=("ties",),
)


def _argmax_ref(a: torch.Tensor, axis: Any, keepdims: bool, **k: Any) -> torch.Tensor:
    if axis is None:
        out = torch.argmax(a.reshape(-1))
        return out.reshape((1,) * a.ndim) if keepdims else out
    return torch.argmax(a, axis, keepdim=keepdims)


row(
    "argmax",
    "axis",
    lambda g, a, axis, keepdims: ml.argmax(a, axis, keepdims=keepdims),
    _argmax_ref,
    lambda rng: _reduce_sample(rng, single_axis=True),
    FLOATS + INTS,
    domains=("ties",),
)
row(
    "argmax",
    "flat",
    lambda g, a, axis, keepdims: ml.argmax(a, axis, keepdims=keepdims),
    _argmax_ref,
    lambda rng: Sample([rand_shape(rng, 1)], {"axis": None, "keepdims": bool(rng.random() < 0.5)}),
    FLOATS,
    domains=("ties",),
)


# argmax split over tiles (argmax_partial's ranges, argmax_combine): an axis of 17+ elements (at least
# two ranges of whole packs), long ones on the partial's packed block path, short last ranges
def _split_sample(rng: np.random.Generator) -> Sample:
    shape = list(rand_shape(rng, 0, 2)) + [int(rng.choice([17, 100, 1000, 4100]))]
    axis = int(rng.integers(0, len(shape))) if rng.random() < 0.3 else len(shape) - 1
    shape[axis] = max(shape[axis], 17)
    keepdims = bool(rng.random() < 0.5)
    return Sample([tuple(shape)], {"axis": axis, "keepdims": keepdims, "splits": int(rng.integers(2, 9))})


def _argmax_partial_ref(a: torch.Tensor, axis: int, splits: int, **k: Any) -> torch.Tensor:
    from megaloop.frontend.ops.argmax_split import split_ranges

    n = a.shape[axis]
    _, chunk = split_ranges(n, splits)
    parts = [torch.argmax(a.narrow(axis, lo, min(chunk, n - lo)), axis) + lo for lo in range(0, n, chunk)]
    return torch.stack(parts, axis)


row(
    "argmax_partial",
    "ranges",
    lambda g, a, axis, keepdims, splits: ml.argmax_partial(a, axis, splits=splits),
    _argmax_partial_ref,
    _split_sample,
    FLOATS + INTS,
    domains=("ties",),
)
row(
    "argmax_combine",
    "split",
    lambda g, a, axis, keepdims, splits: ml.argmax(a, axis, keepdims=keepdims, splits=splits),
    lambda a, axis, keepdims, **k: _argmax_ref(a, axis, keepdims),
    _split_sample,
    FLOATS + INTS,
    domains=("ties",),
)

"""Layout views and copies: reshape, index, broadcast, split, concat."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

import megaloop as ml
from tests.op_table._base import FLOATS, INTS, Sample, one, rand_shape, row


def _factor_shape(rng: np.random.Generator, n: int) -> tuple[int, ...]:
    dims, left = [], n
    for p in (2, 3, 5, 7):
        while left % p == 0 and rng.random() < 0.7:
            dims.append(p)
            left //= p
    dims.append(left)
    rng.shuffle(dims)
    if rng.random() < 0.3:
        dims.insert(int(rng.integers(0, len(dims) + 1)), 1)
    if rng.random() < 0.3 and len(dims) > 1:
        dims[0] = -1 if dims[0] != 1 else 1
    return tuple(int(d) for d in dims)


def _reshape_sample(rng: np.random.Generator) -> Sample:
    shape = rand_shape(rng, 1, 4)
    return Sample(
        [shape],
        {"new": _factor_shape(rng, math.prod(shape)), "perm": tuple(int(a) for a in rng.permutation(len(shape)))},
    )


row(
    "reshape",
    "contiguous",
    lambda g, a, new, perm: a.reshape(new),
    lambda a, new, perm, **k: a.reshape(new),
    _reshape_sample,
    FLOATS + INTS + ("bool",),
)
row(
    "reshape",
    "after-permute",
    lambda g, a, new, perm: a.permute(perm).reshape(new),
    lambda a, new, perm, **k: a.permute(perm).reshape(new),
    _reshape_sample,
)
row(
    "permute",
    "random",
    lambda g, a, new, perm: a.permute(perm),
    lambda a, new, perm, **k: a.permute(perm),
    _reshape_sample,
    FLOATS + INTS + ("bool",),
)
row(
    "permute",
    "transpose-of-slice",
    lambda g, a: a[1:, ::2].transpose(0, 1),
    lambda a, **k: a[1:, ::2].transpose(0, 1),
    lambda rng: Sample([(int(rng.integers(2, 7)), int(rng.integers(1, 9)))]),
)


def _index_sample(rng: np.random.Generator) -> Sample:
    shape = rand_shape(rng, 1, 4, dmax=7)
    index: list[Any] = []
    for d in shape:
        r = rng.random()
        if r < 0.25:
            index.append(int(rng.integers(-d, d)))
        elif r < 0.9:
            step = int(rng.choice([1, 1, 2, 3, -1, -2]))
            lo = int(rng.integers(-d, d))
            hi = int(rng.integers(-d, d + 1)) if rng.random() < 0.7 else None
            s = slice(lo, hi, step)
            if len(range(*s.indices(d))) == 0:
                s = slice(None, None, step)
            index.append(s)
        else:
            index.append(slice(None))
    if rng.random() < 0.3:
        index.insert(int(rng.integers(0, len(index) + 1)), None)
    if rng.random() < 0.3 and len(index) > 1:
        k = int(rng.integers(0, len(index)))
        if index[k] is not None:
            index[k:] = [Ellipsis] + [it for it in index[k + 1 :]]
    return Sample([shape], {"index": tuple(index)})


def _torch_index(a: torch.Tensor, index: tuple) -> torch.Tensor:
    """numpy's basic indexing is the behaviour megaloop promises (torch has no negative steps)."""
    return torch.from_numpy(np.array(a.numpy()[index], order="C", copy=True))


row(
    "slice",
    "getitem",
    lambda g, a, index: a[index],
    lambda a, index, **k: _torch_index(a, index),
    _index_sample,
    FLOATS + INTS + ("bool",),
)
row(
    "slice",
    "of-permuted",
    lambda g, a: a.T[::-1, 1:],
    lambda a, **k: torch.flip(a.permute(2, 1, 0), [0])[:, 1:],
    lambda rng: Sample([(int(rng.integers(2, 6)), int(rng.integers(2, 6)), int(rng.integers(1, 4)))]),
)


def _bcast_sample(rng: np.random.Generator) -> Sample:
    target = rand_shape(rng, 1, 4)
    drop = int(rng.integers(0, len(target)))
    src = tuple(1 if rng.random() < 0.4 else d for d in target[drop:])
    return Sample([src], {"target": target})


row(
    "broadcast_to",
    "random",
    lambda g, a, target: ml.broadcast_to(a, target),
    lambda a, target, **k: a.broadcast_to(target),
    _bcast_sample,
    FLOATS + INTS + ("bool",),
)
row(
    "broadcast_to",
    "then-reshape",
    lambda g, a: ml.broadcast_to(a, (4, 3, 2)).reshape(12, 2),
    lambda a, **k: a.broadcast_to((4, 3, 2)).reshape(12, 2),
    lambda rng: Sample([(3, 1)]),
)


def _split_sample(rng: np.random.Generator) -> Sample:
    shape = rand_shape(rng, 1, 4)
    axis = int(rng.integers(0, len(shape)))
    cuts = sorted(set(int(c) for c in rng.integers(1, shape[axis], 2))) if shape[axis] > 1 else []
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, shape[axis]])]
    return Sample([shape], {"axis": axis, "sizes": sizes})


row(
    "split",
    "sizes",
    lambda g, a, axis, sizes: ml.split(a, sizes, axis),
    lambda a, axis, sizes, **k: torch.split(a, sizes, axis),
    _split_sample,
    FLOATS + INTS + ("bool",),
)
row(
    "split",
    "equal-then-view",
    lambda g, a: tuple(p.T for p in ml.split(a, 3, axis=1)),
    lambda a, **k: tuple(p.T for p in torch.split(a, 2, 1)),
    lambda rng: Sample([(4, 6)]),
)


def _concat_sample(rng: np.random.Generator) -> Sample:
    base = rand_shape(rng, 1, 4)
    axis = int(rng.integers(0, len(base)))
    n = int(rng.integers(2, 4))
    shapes = [base[:axis] + (int(rng.integers(1, 5)),) + base[axis + 1 :] for _ in range(n)]
    return Sample(shapes, {"axis": axis})


row(
    "concat",
    "axis",
    lambda g, *ts, axis: ml.concat(ts, axis),
    lambda *ts, axis, **k: torch.cat(ts, axis),
    _concat_sample,
    FLOATS + INTS + ("bool",),
)
row(
    "copy",
    "of-transposed",
    lambda g, a: a.mT.copy(),
    lambda a, **k: a.mT.contiguous(),
    lambda rng: Sample([rand_shape(rng, 2, 4)]),
    FLOATS + INTS + ("bool",),
)
row(
    "reshape",
    "squeeze-unsqueeze",
    lambda g, a: a.unsqueeze(1).unsqueeze(-1).squeeze(1),
    lambda a, **k: a.unsqueeze(1).unsqueeze(-1).squeeze(1),
    one(1, 3),
)

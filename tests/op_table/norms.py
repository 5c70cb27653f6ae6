"""Normalisations: rmsnorm, layernorm, softmax, their residual forms."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

import megaloop as ml
from tests.op_table._base import Sample, rand_shape, rnd, row


def _axis_sample(rng: np.random.Generator) -> Sample:
    shape = rand_shape(rng, 1, 4, dmax=9)
    return Sample([shape], {"axis": int(rng.integers(-len(shape), len(shape)))})


row(
    "softmax",
    "axis",
    lambda g, a, axis: ml.softmax(a, axis),
    lambda a, axis, **k: torch.softmax(a, axis),
    _axis_sample,
    reduce_len=lambda s: s.shapes[0][s.kw["axis"]],
)
row(
    "log_softmax",
    "axis",
    lambda g, a, axis: ml.log_softmax(a, axis),
    lambda a, axis, **k: torch.log_softmax(a, axis),
    _axis_sample,
    reduce_len=lambda s: s.shapes[0][s.kw["axis"]],
)
row(
    "softmax",
    "wide-rows",
    lambda g, a: ml.softmax(a * 30.0),
    lambda a, dtype: torch.softmax(rnd(a * 30.0, dtype), -1),
    lambda rng: Sample([(3, 257)]),
    reduce_len=lambda s: 257,
)


def _norm_sample(nparams: int) -> Callable[[np.random.Generator], Sample]:
    def sample(rng: np.random.Generator) -> Sample:
        x = rand_shape(rng, 0, 3) + (int(rng.integers(1, 70)),)
        return Sample([x] + [(x[-1],)] * nparams)

    return sample


row(
    "layernorm",
    "plain",
    lambda g, x: ml.layernorm(x),
    lambda x, **k: F.layer_norm(x, x.shape[-1:], eps=1e-5),
    _norm_sample(0),
    reduce_len=lambda s: s.shapes[0][-1],
)
row(
    "layernorm",
    "affine",
    lambda g, x, w, b: ml.layernorm(x, w, b, eps=1e-3),
    lambda x, w, b, **k: F.layer_norm(x, x.shape[-1:], w, b, eps=1e-3),
    _norm_sample(2),
    reduce_len=lambda s: s.shapes[0][-1],
)
row(
    "layernorm",
    "bias-only",
    lambda g, x, b: ml.layernorm(x, bias=b),
    lambda x, b, **k: F.layer_norm(x, x.shape[-1:], None, b, eps=1e-5),
    _norm_sample(1),
    reduce_len=lambda s: s.shapes[0][-1],
)
row(
    "rmsnorm",
    "weight",
    lambda g, x, w: ml.rmsnorm(x, w, eps=1e-6),
    lambda x, w, **k: F.rms_norm(x, x.shape[-1:], w, eps=1e-6),
    _norm_sample(1),
    reduce_len=lambda s: s.shapes[0][-1],
)
row(
    "rmsnorm",
    "plain",
    lambda g, x: ml.rmsnorm(x, eps=1e-5),
    lambda x, **k: F.rms_norm(x, x.shape[-1:], eps=1e-5),
    _norm_sample(0),
    reduce_len=lambda s: s.shapes[0][-1],
)


# With a residual: the norm of x + residual as an add would have stored it (rounded to the dtype);
# short rows (warp paths), long ones (block path, the residual streaming through its own ring), odd
# lengths (the element-by-element path)
def _residual_sample(lengths: tuple[int, ...], nparams: int) -> Callable[[np.random.Generator], Sample]:
    def sample(rng: np.random.Generator) -> Sample:
        x = rand_shape(rng, 1, 3) + (int(rng.choice(lengths)),)
        return Sample([x, x] + [(x[-1],)] * nparams)

    return sample


row(
    "rmsnorm",
    "residual",
    lambda g, x, r, w: ml.rmsnorm(x, w, eps=1e-6, residual=r),
    lambda x, r, w, dtype, **k: F.rms_norm(rnd(x + r, dtype), x.shape[-1:], w, eps=1e-6),
    _residual_sample((5, 64, 2048, 3080), 1),
    reduce_len=lambda s: s.shapes[0][-1],
)
row(
    "layernorm",
    "residual",
    lambda g, x, r, w, b: ml.layernorm(x, w, b, eps=1e-5, residual=r),
    lambda x, r, w, b, dtype, **k: F.layer_norm(rnd(x + r, dtype), x.shape[-1:], w, b, eps=1e-5),
    _residual_sample((7, 96, 2048), 2),
    reduce_len=lambda s: s.shapes[0][-1],
)

# Rows of 128 packs (16 bytes) or more take the block-per-row path (codegen/emit.py BLOCK_ROW_PACKS);
# lengths not a multiple of the block's threads leave some threads with fewer packs.
row(
    "softmax",
    "long-rows",
    lambda g, a: ml.softmax(a, -1),
    lambda a, **k: torch.softmax(a, -1),
    lambda rng: Sample([(2, 4104)]),
    reduce_len=lambda s: 4104,
)
row(
    "log_softmax",
    "long-rows",
    lambda g, a: ml.log_softmax(a, -1),
    lambda a, **k: torch.log_softmax(a, -1),
    lambda rng: Sample([(3, 2048)]),
    reduce_len=lambda s: 2048,
)
row(
    "layernorm",
    "long-rows",
    lambda g, x, w, b: ml.layernorm(x, w, b, eps=1e-3),
    lambda x, w, b, **k: F.layer_norm(x, x.shape[-1:], w, b, eps=1e-3),
    lambda rng: Sample([(2, 3080), (3080,), (3080,)]),
    reduce_len=lambda s: 3080,
)
row(
    "rmsnorm",
    "long-rows",
    lambda g, x, w: ml.rmsnorm(x, w, eps=1e-6),
    lambda x, w, **k: F.rms_norm(x, x.shape[-1:], w, eps=1e-6),
    lambda rng: Sample([(1, 3, 2048), (2048,)]),
    reduce_len=lambda s: 2048,
)

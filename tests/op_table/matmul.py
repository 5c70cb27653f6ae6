"""Products: matmul, linear and the fused norm / SwiGLU products."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

import megaloop as ml
from tests.op_table._base import Sample, broadcastable, rand_shape, rnd, row


def _matmul_sample(ta: bool, tb: bool, batch: str) -> Callable[[np.random.Generator], Sample]:
    def sample(rng: np.random.Generator) -> Sample:
        m, k, n = (int(d) for d in rng.integers(1, 40, 3))
        if batch == "none":
            ba, bb = (), ()
        elif batch == "same":
            ba = bb = rand_shape(rng, 1, 2, dmax=3)
        else:  # broadcast batch dims
            ba, bb = broadcastable(rng, 2, lo=1)
        a = ba + ((k, m) if ta else (m, k))
        b = bb + ((n, k) if tb else (k, n))
        return Sample([a, b], {"k": k})

    return sample


def _matmul_ref(a: torch.Tensor, b: torch.Tensor, ta: bool, tb: bool) -> torch.Tensor:
    return torch.matmul(a.transpose(-1, -2) if ta else a, b.transpose(-1, -2) if tb else b)


for ta, tb, batch in [
    (False, False, "none"),
    (True, False, "none"),
    (False, True, "none"),
    (True, True, "none"),
    (False, False, "same"),
    (False, True, "broadcast"),
    (True, False, "broadcast"),
]:
    row(
        "matmul",
        f"ta{int(ta)}-tb{int(tb)}-{batch}",
        lambda g, a, b, k, _ta=ta, _tb=tb: ml.matmul(a, b, transpose_a=_ta, transpose_b=_tb),
        lambda a, b, k, _ta=ta, _tb=tb, **kw: _matmul_ref(a, b, _ta, _tb),
        _matmul_sample(ta, tb, batch),
        reduce_len=lambda s: s.kw["k"],
        cancels=True,
    )
row(
    "matmul",
    "linear",
    lambda g, x, w: ml.linear(x, w),
    lambda x, w, **k: F.linear(x, w),
    lambda rng: Sample([(2, 5, 33), (17, 33)]),
    reduce_len=lambda s: 33,
    cancels=True,
)


# rmsnorm_linear: the rows rmsnorm stores (rounded to the dtype), times w.T. Decode-shaped rows (the
# tiles' packed path: K a multiple of 16 bytes, few rows) and any other shape (the per-element path).
def _norm_linear_sample(residual: bool) -> Callable[[np.random.Generator], Sample]:
    def sample(rng: np.random.Generator) -> Sample:
        if rng.random() < 0.5:
            x, k = (1, int(rng.integers(1, 5))), 8 * int(rng.integers(1, 40))
        else:
            x, k = rand_shape(rng, 1, 3), int(rng.integers(1, 70))
        n = int(rng.integers(1, 40))
        shapes = [x + (k,), (n, k), (k,)] + ([x + (k,)] if residual else [])
        return Sample(shapes, {"k": k})

    return sample


row(
    "rmsnorm_linear",
    "plain",
    lambda g, x, w, nw, k: ml.rmsnorm_linear(x, w, nw, eps=1e-6),
    lambda x, w, nw, dtype, k, **kw: F.linear(rnd(F.rms_norm(x, x.shape[-1:], nw, eps=1e-6), dtype), w),
    _norm_linear_sample(False),
    reduce_len=lambda s: s.kw["k"],
    cancels=True,
)
row(
    "rmsnorm_linear",
    "residual",
    lambda g, x, w, nw, r, k: ml.rmsnorm_linear(x, w, nw, eps=1e-5, residual=r),
    lambda x, w, nw, r, dtype, k, **kw: F.linear(
        rnd(F.rms_norm(rnd(x + r, dtype), x.shape[-1:], nw, eps=1e-5), dtype), w
    ),
    _norm_linear_sample(True),
    reduce_len=lambda s: s.kw["k"],
    cancels=True,
)


# swiglu_linear: silu(h @ gate.T) * (h @ up.T), each product rounded to the dtype, h = x or its
# rmsnorm (with a residual); the same decode-shaped and any-shape samples as rmsnorm_linear.
def _swiglu_sample(norm: bool) -> Callable[[np.random.Generator], Sample]:
    def sample(rng: np.random.Generator) -> Sample:
        s = _norm_linear_sample(norm)(rng)
        x, w = s.shapes[:2]
        return Sample([x, w, w] + ([(x[-1],), x] if norm else []), s.kw)

    return sample


def _swiglu_ref(h: Any, gw: Any, uw: Any, dtype: str) -> Any:
    return F.silu(rnd(F.linear(h, gw), dtype)) * rnd(F.linear(h, uw), dtype)


row(
    "swiglu_linear",
    "plain",
    lambda g, x, gw, uw, k: ml.swiglu_linear(x, gw, uw),
    lambda x, gw, uw, dtype, k, **kw: _swiglu_ref(x, gw, uw, dtype),
    _swiglu_sample(False),
    reduce_len=lambda s: s.kw["k"],
    cancels=True,
)
row(
    "swiglu_linear",
    "normed",
    lambda g, x, gw, uw, nw, r, k: ml.swiglu_linear(x, gw, uw, norm_weight=nw, eps=1e-5, residual=r),
    lambda x, gw, uw, nw, r, dtype, k, **kw: _swiglu_ref(
        rnd(F.rms_norm(rnd(x + r, dtype), x.shape[-1:], nw, eps=1e-5), dtype), gw, uw, dtype
    ),
    _swiglu_sample(True),
    reduce_len=lambda s: s.kw["k"],
    cancels=True,
)

"""Sampling rows: sample, its split form, penalties."""

from __future__ import annotations

import numpy as np
import torch

import megaloop as ml
from tests.op_table._base import Sample, rand_shape, row
from tests.sample_ref import sample_partial_ref, sample_ref


def _sample_sample(rng: np.random.Generator) -> Sample:
    """Rows of logits (ties often: top-k/top-p boundaries inside tie groups) and per-row parameters, some
    broadcast; one of seed and offset always per row (the builder refuses rows sharing both)."""
    rows = rand_shape(rng, 0, 2)
    n = int(rng.choice([1, 2, 7, 33, 300]))
    full, per_row = rows, tuple(1 if rng.random() < 0.5 else d for d in rows)
    seed_shape, offset_shape = (per_row, full) if rng.random() < 0.5 else (full, per_row)
    shapes = [rows + (n,), seed_shape, offset_shape] + [per_row if rng.random() < 0.3 else full for _ in range(4)]
    domains = (
        "ties" if rng.random() < 0.5 else "normal",
        ("int", -(2**62), 2**62),
        ("int", 0, 10**6),
        ("choice", 0.0, 0.25, 1.0, 3.0),
        ("int", 0, n + 2),
        ("choice", 1.0, 0.95, 0.5, 0.1, 1e-9),
        ("choice", 0.0, 0.0, 0.05, 0.3, 1.0),
    )
    return Sample(shapes, domains=domains)


row(
    "sample",
    "temperature-top-k-top-p-min-p",
    lambda g, x, s, o, t, k, p, q: ml.sample(x, s, o, t, k, p, q),
    sample_ref,
    _sample_sample,
    fixed={1: "int64", 2: "int64", 3: "float32", 4: "int64", 5: "float32", 6: "float32"},
)


def _split_sample_sample(rng: np.random.Generator) -> Sample:
    """Rows long enough to split (ranges of 8 up to 4000 logits, some of more than their 32 candidates)."""
    s = _sample_sample(rng)
    n = int(rng.choice([20, 333, 4000]))
    s.shapes[0] = s.shapes[0][:-1] + (n,)
    s.domains = (*s.domains[:4], ("int", 0, n + 2), *s.domains[5:])
    s.kw["splits"] = int(rng.integers(2, 9))
    return s


row(
    "sample_combine",
    "split",
    lambda g, x, s, o, t, k, p, q, splits: ml.sample(x, s, o, t, k, p, q, splits=splits),
    lambda *a, splits, **kw: sample_ref(*a, **kw),
    _split_sample_sample,
    fixed={1: "int64", 2: "int64", 3: "float32", 4: "int64", 5: "float32", 6: "float32"},
)
row(
    "sample_partial",
    "ranges",
    lambda g, x, s, o, t, k, p, q, splits: ml.sample_partial(x, t, splits=splits),
    lambda x, s, o, t, k, p, q, splits, **kw: sample_partial_ref(x, t, splits=splits),
    _split_sample_sample,
    fixed={1: "int64", 2: "int64", 3: "float32", 4: "int64", 5: "float32", 6: "float32"},
)


def _penalty_sample(rng: np.random.Generator) -> Sample:
    """Rows of logits with counts and a prompt mask of their shape (or broadcast: one row's for all),
    per-row penalties (or one for all)."""
    rows = rand_shape(rng, 1, 3)
    n = int(rng.choice([1, 7, 300]))
    full = rows + (n,)
    shared = (1,) * len(rows) + (n,) if rng.random() < 0.3 else full
    per_row = [rows if rng.random() < 0.7 else () for _ in range(3)]
    domains = ("normal", ("int", 0, 4), "bool", ("choice", 1.0, 1.3, 0.7, 2.0), ("choice", 0.0, 0.5, -1.5),
               ("choice", 0.0, 0.25, -0.1))  # fmt: skip
    return Sample([full, shared, shared, *per_row], domains=domains)


def _penalty_ref(x, counts, mask, rep, pres, freq, **kw):
    rep, pres, freq = (v.unsqueeze(-1) for v in (rep, pres, freq))
    seen = mask.bool() | (counts > 0)
    x = torch.where(seen, torch.where(x < 0, x * rep, x / rep), x)
    return x - freq * counts - pres * (counts > 0)


row(
    "penalize",
    "repetition-presence-frequency",
    lambda g, x, c, m, r, p, f: ml.penalize(x, c, m, r, p, f),
    _penalty_ref,
    _penalty_sample,
    fixed={1: "int32", 2: "bool", 3: "float32", 4: "float32", 5: "float32"},
)

"""Embedding, scatter-add and rope (its scalings, tables and layouts)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

import megaloop as ml
from megaloop.frontend.ops.rope import LAYOUTS
from tests.op_table._base import INTS, Sample, rand_shape, row


def _embedding_sample(rng: np.random.Generator) -> Sample:
    v, d = int(rng.integers(1, 50)), int(rng.integers(1, 20))
    return Sample([(v, d), rand_shape(rng, 0, 3)], domains=("normal", ("int", 0, v)))


row(
    "embedding",
    "int64",
    lambda g, t, i: ml.embedding(t, i),
    lambda t, i, **k: F.embedding(i, t),
    _embedding_sample,
    fixed={1: "int64"},
)
row(
    "embedding",
    "int32",
    lambda g, t, i: ml.embedding(t, i),
    lambda t, i, **k: F.embedding(i, t),
    _embedding_sample,
    fixed={1: "int32"},
)


def _scatter_sample(rng: np.random.Generator) -> Sample:
    rows, n, d = int(rng.integers(1, 30)), int(rng.integers(1, 40)), int(rng.integers(1, 300))
    return Sample([(n, d), (n,)], {"rows": rows}, domains=("normal", ("int", 0, rows)))


row(
    "scatter_add",
    "rows",
    lambda g, v, i, rows: ml.scatter_add(v, i, rows),
    lambda v, i, rows, **k: torch.zeros(rows, v.shape[1], dtype=v.dtype).index_add(0, i, v),
    _scatter_sample,
    fixed={1: "int64"},
    reduce_len=lambda s: s.shapes[0][0],
)
row(  # a table of ints (the serving step's token ids by slot and position)
    "embedding",
    "int-table",
    lambda g, t, i: ml.embedding(t, i),
    lambda t, i, **k: t[i],
    _embedding_sample,
    INTS,
    fixed={1: "int64"},
)


def llama3_inv_freq(dim: int, theta: float, factor: float, low: float, high: float, old: int) -> torch.Tensor:
    """Written from the Llama 3.1 release notes' description, independently of megaloop's version."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    out = []
    for f in inv.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(f)
        elif wavelen > old / low:
            out.append(f / factor)
        else:
            s = (old / wavelen - low) / (high - low)
            out.append((1 - s) * f / factor + s * f)
    return torch.tensor(out, dtype=torch.float64)


def rope_ref(
    x: torch.Tensor,
    pos: torch.Tensor,
    theta: float = 10000.0,
    layout: str = "neox",
    rotary_dim: int | None = None,
    scaling: dict | None = None,
    **k: Any,
) -> torch.Tensor:
    d = x.shape[-1]
    rd = rotary_dim or d
    if scaling is None:
        inv = 1.0 / (theta ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd))
    elif scaling["type"] == "linear":
        inv = 1.0 / (theta ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd)) / scaling["factor"]
    elif scaling["type"] == "longrope":  # transformers' form: 1 / (factor * theta^(2i/rd))
        factors = torch.tensor(scaling["factors"], dtype=torch.float64)
        inv = 1.0 / (factors * theta ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd))
    else:
        inv = llama3_inv_freq(
            rd,
            theta,
            scaling["factor"],
            scaling["low_freq_factor"],
            scaling["high_freq_factor"],
            scaling["original_max_position_embeddings"],
        )
    ang = pos.to(torch.float64).broadcast_to(x.shape[:-1]).unsqueeze(-1) * inv
    xr, rest = x[..., :rd], x[..., rd:]
    if layout == "neox":  # Hugging Face's rotate_half formulation
        emb = torch.cat([ang, ang], -1)
        half1, half2 = xr[..., : rd // 2], xr[..., rd // 2 :]
        rotated = torch.cat([-half2, half1], -1)
        out = xr * emb.cos() + rotated * emb.sin()
    else:  # complex multiplication of (even, odd) pairs, as in the original Llama code
        z = torch.view_as_complex(xr.reshape(*xr.shape[:-1], rd // 2, 2).contiguous())
        out = torch.view_as_real(z * torch.polar(torch.ones_like(ang), ang)).reshape(xr.shape)
    return torch.cat([out, rest], -1)


def _rope_sample(rotary: bool = False, three_d: bool = False) -> Callable[[np.random.Generator], Sample]:
    def sample(rng: np.random.Generator) -> Sample:
        b, h, t = (int(v) for v in rng.integers(1, 5, 3))
        d = 2 * int(rng.integers(1, 17))
        kw = {}
        if rotary:
            kw["rotary_dim"] = 2 * int(rng.integers(1, d // 2 + 1))
        if three_d:
            return Sample([(b, t, d), (b, t)], kw)
        return Sample([(b, h, t, d), (b, 1, t)], kw)

    return sample


def _rope_fixed(d: int, rotary: int) -> Callable[[np.random.Generator], Sample]:
    """[b, h, t, d] with ``rotary`` dims turned: a head width longrope's factors are written for."""

    def sample(rng: np.random.Generator) -> Sample:
        b, h, t = (int(v) for v in rng.integers(1, 5, 3))
        return Sample([(b, h, t, d), (b, 1, t)], {"rotary_dim": rotary})

    return sample


def _longrope(pairs: int) -> dict:
    return {"type": "longrope", "factors": tuple(float(f) for f in np.geomspace(1.0, 40.0, pairs))}


_LLAMA3 = {
    "type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
for label, extra, sampler in [
    ("neox", {"layout": "neox"}, _rope_sample()),
    ("interleaved", {"layout": "interleaved"}, _rope_sample()),
    ("partial-neox", {"layout": "neox"}, _rope_sample(rotary=True)),
    ("partial-interleaved", {"layout": "interleaved"}, _rope_sample(rotary=True)),
    ("llama3-scaling", {"theta": 500000.0, "scaling": _LLAMA3}, _rope_sample()),
    ("linear-scaling", {"scaling": {"type": "linear", "factor": 4.0}}, _rope_sample()),
    ("3d", {"theta": 1e6}, _rope_sample(three_d=True)),
    ("longrope-partial", {"scaling": _longrope(6)}, _rope_fixed(16, 12)),
]:
    row(
        "rope",
        label,
        lambda g, x, p, _e=extra, **kw: ml.rope(x, p, **_e, **kw),
        lambda x, p, _e=extra, **kw: rope_ref(x, p, **_e, **{k: v for k, v in kw.items() if k != "dtype"}),
        sampler,
        domains=("normal", ("int", 0, 20000)),
        fixed={1: "int64"},
    )


def _rope_wide(d: int, rotary: int | None = None, tokens: int = 160) -> Callable[[np.random.Generator], Sample]:
    """[2, 4, tokens, d]: rope's per-pair path with 16-byte packs, several items a thread, several tasks
    (and now and then 4 tokens: the plan interpreter's tests take draws of few tasks)."""

    def sample(rng: np.random.Generator) -> Sample:
        n = 4 if rng.random() < 0.3 else tokens
        return Sample([(2, 4, n, d), (2, 1, n)], {} if rotary is None else {"rotary_dim": rotary})

    return sample


for label, extra, sampler in [
    ("wide-neox", {"layout": "neox"}, _rope_wide(64)),
    ("wide-interleaved", {"layout": "interleaved"}, _rope_wide(64)),
    ("wide-partial-neox", {"layout": "neox"}, _rope_wide(128, rotary=48)),
    ("wide-partial-interleaved", {"layout": "interleaved"}, _rope_wide(128, rotary=80)),
    ("wide-llama3", {"theta": 500000.0, "scaling": _LLAMA3}, _rope_wide(128)),
    ("wide-longrope", {"scaling": _longrope(32)}, _rope_wide(64)),
]:
    row(
        "rope",
        label,
        lambda g, x, p, _e=extra, **kw: ml.rope(x, p, **_e, **kw),
        lambda x, p, _e=extra, **kw: rope_ref(x, p, **_e, **{k: v for k, v in kw.items() if k != "dtype"}),
        sampler,
        domains=("normal", ("int", 0, 1_000_000)),  # far positions: the float64 angle and its reduction
        fixed={1: "int64"},
    )


def rope_table_ref(x, cos, sin, *, layout="neox", rotary_dim=None, per_pair=False, **kw):
    """x * cos + rotate(x) * sin over the first rotary_dim dims (transformers' apply_rotary_pos_emb for
    neox tables of a value a dim), a pair's value at both its dims where ``per_pair``."""
    rd = rotary_dim or cos.shape[-1]
    neox = layout == "neox"
    if per_pair:
        cos, sin = ((torch.cat([t, t], -1) if neox else t.repeat_interleave(2, -1)) for t in (cos, sin))
    rot = x[..., :rd]
    if neox:
        turned = torch.cat([-rot[..., rd // 2 :], rot[..., : rd // 2]], -1)
    else:
        turned = torch.stack([-rot[..., 1::2], rot[..., 0::2]], -1).flatten(-2)
    return torch.cat([rot * cos + turned * sin, x[..., rd:]], -1)


def _rope_table_sample(per_pair: bool, partial: bool) -> Callable[[np.random.Generator], Sample]:
    def sample(rng: np.random.Generator) -> Sample:
        b, h, t = int(rng.integers(1, 3)), int(rng.integers(1, 4)), int(rng.integers(1, 9))
        hd = 2 * int(rng.integers(1, 33))
        rd = 2 * int(rng.integers(1, hd // 2 + 1)) if partial else hd
        n = rd // 2 if per_pair else rd
        tables = [(t, n), (b, 1, t, n), (1, n), (b, h, t, n)][int(rng.integers(4))]
        kw = {"rotary_dim": rd} if per_pair or partial else {}
        return Sample([(b, h, t, hd), tables, tables], kw, ("normal", "unit", "unit"))

    return sample


for _layout in LAYOUTS:
    for _pairs, _partial in ((False, False), (True, False), (False, True), (True, True)):
        row(
            "rope_table",
            f"{_layout}{'-pairs' if _pairs else ''}{'-partial' if _partial else ''}",
            lambda g, x, c, s, _l=_layout, **kw: ml.rope_table(x, c, s, layout=_l, **kw),
            lambda x, c, s, _l=_layout, _p=_pairs, **kw: rope_table_ref(x, c, s, layout=_l, per_pair=_p, **kw),
            _rope_table_sample(_pairs, _partial),
            reduce_len=lambda s: 2,
        )

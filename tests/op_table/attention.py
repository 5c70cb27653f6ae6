"""Attention: every tile path, masks, softcapping, split keys, the append form."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

import megaloop as ml
from tests.op_table._base import Sample, row
from tests.op_table.rope import rope_ref


def attention_ref(
    q, k, v, qpos=None, lens=None, *, causal=False, window=None, scale=None, softcap=None, mask=None, **kw
):
    """Dense float64 attention with an explicit mask, via torch's SDPA (written out with a softcap,
    which SDPA lacks: c * tanh(s / c) of the scaled scores); ``mask``: the op's mask operand, bool or
    additive (-inf hides a key); rows that see no key are 0."""
    b, hq, tq, _ = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    lens = torch.full((b,), tk) if lens is None else lens
    if qpos is None:
        qpos = lens[:, None] - tq + torch.arange(tq)[None, :]
    j = torch.arange(tk)
    seen = j[None, None, :] < lens[:, None, None]
    if causal:
        seen = seen & (j[None, None, :] <= qpos[:, :, None])
        if window is not None:
            seen = seen & (j[None, None, :] > qpos[:, :, None] - window)
    seen = seen[:, None]  # [b, 1, tq, tk]
    bias = None
    if mask is not None:
        seen = seen & (mask if mask.dtype == torch.bool else mask != -math.inf)
        bias = None if mask.dtype == torch.bool else mask
    anything = seen.any(-1, keepdim=True)
    # SDPA's mask: a row that sees no key attends to every key (no NaN, in the gradient too), then is 0
    attn = seen | ~anything if bias is None else torch.where(anything, torch.where(seen, bias, -math.inf), 0.0)
    rep = hq // hkv
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    if softcap is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn, scale=scale)
    else:
        scores = q @ k.transpose(-1, -2) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
        scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~attn, -math.inf) if attn.dtype == torch.bool else scores + attn
        out = torch.softmax(scores, -1) @ v
    return torch.where(anything, out, torch.zeros(()))


def _attn_sample(
    gqa: bool,
    tq1: bool = False,
    positions: bool = False,
    lengths: bool = False,
    dv: bool = False,
    blocks: bool = False,
    mask: str | None = None,
) -> Callable[[np.random.Generator], Sample]:
    """``blocks``: shapes of the tensor-core path (16-bit heads of 16..128 in steps of 16, blocks of 16
    queries or more, several key blocks of 64, query counts and key counts that are not whole blocks).
    ``mask`` "bool" or "additive": a mask operand last, of one of the shapes that broadcast to the scores."""

    def sample(rng: np.random.Generator) -> Sample:
        b = int(rng.integers(1, 4))
        hkv = int(rng.integers(1, 3))
        hq = hkv * (int(rng.integers(1, 4)) if gqa else 1)
        tk = int(rng.integers(1, 24))
        tq = 1 if tq1 else int(rng.integers(1, tk + 1))
        d = int(rng.integers(1, 33))
        if blocks:
            b, tq = int(rng.integers(1, 3)), int(rng.integers(16, 90))
            tk, d = int(rng.integers(tq, 200)), int(rng.choice([16, 64, 128]))
        shapes = [(b, hq, tq, d), (b, hkv, tk, d), (b, hkv, tk, int(rng.integers(1, 20)) if dv else d)]
        domains: list[Any] = ["normal"] * 3
        if positions:
            shapes.append((b, tq))
            domains.append(("int", 0, tk))
        if lengths:
            shapes.append((b,))
            domains.append(("int", 1, tk + 1))
        if mask is not None:
            options = [(b, hq, tq, tk), (b, 1, 1, tk), (tq, tk), (hq, 1, tk), (tk,)]
            # (a bool mask broadcast over the keys hides whole rows; an additive one there adds a constant
            # to a row, which changes nothing: its gradient is 0 in exact arithmetic, float32 noise here)
            options += [(1, 1, 1, 1), (b, 1, tq, 1)] if mask == "bool" else []
            shapes.append(options[int(rng.integers(len(options)))])
            domains.append("bool" if mask == "bool" else ("choice", 0.0, -1.5, 0.75, 2.0, -math.inf))
        return Sample(shapes, {"tk": tk, "d": d}, tuple(domains))

    return sample


def _attn_row(
    label: str,
    sampler: Callable[[np.random.Generator], Sample],
    positions: bool = False,
    lengths: bool = False,
    kv_splits: int | None = None,
    mask: str | None = None,
    **opts: Any,
) -> None:
    """A row of attention, or with ``kv_splits`` of its split form (attention_partial, then the
    attention_combine this row is filed under), against the same dense reference. ``mask``: the
    sampler's mask operand ("bool" or "additive", of the row's dtype), last."""

    def build(g, q, k, v, *extra, tk, d):
        qp = extra[0] if positions else None
        ln = extra[positions] if lengths else None
        m = extra[-1] if mask else None
        return ml.attention(q, k, v, q_positions=qp, kv_lengths=ln, kv_splits=kv_splits, mask=m, **opts)

    def ref(q, k, v, *extra, tk, d, dtype):
        qp = extra[0] if positions else None
        ln = extra[positions] if lengths else None
        return attention_ref(q, k, v, qp, ln, mask=extra[-1] if mask else None, **opts)

    fixed = {i: "int64" for i in range(3, 3 + positions + lengths)}
    if mask == "bool":
        fixed[3 + positions + lengths] = "bool"
    op = "attention" if kv_splits is None else "attention_combine"
    row(op, label, build, ref, sampler, fixed=fixed, reduce_len=lambda s: s.kw["tk"] + s.kw["d"])


_attn_row("mha", _attn_sample(gqa=False))


def _attn_grad_sample(rng: np.random.Generator) -> Sample:
    """attention's shapes and the cotangent (q's shape); ``n``: the longest sum (keys, or a key's queries)."""
    s = _attn_sample(gqa=True)(rng)
    _, hq, tq, _ = s.shapes[0]
    hkv = s.shapes[1][1]
    return Sample([*s.shapes, s.shapes[0]], {"n": s.kw["tk"] + s.kw["d"] + tq * hq // hkv}, (*s.domains, "normal"))


def _attn_grad_ref(q, k, v, do, *, n, dtype):
    with torch.enable_grad():  # (the table's references run under no_grad)
        q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        return torch.autograd.grad(attention_ref(q, k, v, causal=True), (q, k, v), do)


row("attention_grad", "causal-gqa", lambda g, q, k, v, do, *, n: ml.attention_grad(q, k, v, do, causal=True),
    _attn_grad_ref, _attn_grad_sample, reduce_len=lambda s: s.kw["n"])  # fmt: skip
_attn_row("causal-gqa", _attn_sample(gqa=True), causal=True)
_attn_row(
    "causal-positions-lengths",
    _attn_sample(gqa=True, positions=True, lengths=True),
    positions=True,
    lengths=True,
    causal=True,
)
_attn_row("decode-lengths", _attn_sample(gqa=True, tq1=True, lengths=True), lengths=True, causal=True)
_attn_row("sliding-window", _attn_sample(gqa=True, positions=True), positions=True, causal=True, window=5)
_attn_row("scale-vdim", _attn_sample(gqa=False, dv=True), scale=0.3)
# blocks of queries on tensor cores (16-bit; float32 takes the other paths)
_attn_row("blocks-causal-gqa", _attn_sample(gqa=True, blocks=True), causal=True)
_attn_row(
    "blocks-positions-lengths",
    _attn_sample(gqa=True, positions=True, lengths=True, blocks=True),
    positions=True,
    lengths=True,
    causal=True,
)
_attn_row("blocks-window", _attn_sample(gqa=True, positions=True, blocks=True), positions=True, causal=True, window=37)
_attn_row("blocks-full-scale", _attn_sample(gqa=False, blocks=True), scale=0.3)
_attn_row("split-decode", _attn_sample(gqa=True, tq1=True, lengths=True), lengths=True, causal=True, kv_splits=3)
_attn_row("split-window", _attn_sample(gqa=True, positions=True), positions=True, causal=True, window=5, kv_splits=4)
# the combine keeps up to 16 ranges' weights in registers (emit_attention.COMBINE_HELD_SPLITS), more take
# the loop that recomputes them; a value width that is not whole warps leaves lanes without a value
_attn_row("split-many", _attn_sample(gqa=True, tq1=True, lengths=True), lengths=True, causal=True, kv_splits=20)
_attn_row("split-vdim", _attn_sample(gqa=False, dv=True), scale=0.3, kv_splits=3)
# logit softcapping (Gemma 2) on each path: a warp a row, tensor cores, split keys, key ranges
_attn_row("softcap-causal-gqa", _attn_sample(gqa=True), causal=True, softcap=1.5)
_attn_row("blocks-softcap-window", _attn_sample(gqa=True, positions=True, blocks=True), positions=True, causal=True,
          window=37, softcap=2.0)  # fmt: skip
_attn_row("split-softcap", _attn_sample(gqa=True, tq1=True, lengths=True), lengths=True, causal=True, kv_splits=3,
          softcap=1.5, scale=0.7)  # fmt: skip
# a mask operand (bool or additive, of shapes that broadcast) with each mask rule, on each path
_attn_row("mask-bool", _attn_sample(gqa=True, mask="bool"), mask="bool")
_attn_row("mask-additive-causal", _attn_sample(gqa=True, mask="additive"), mask="additive", causal=True)
_attn_row("mask-additive-softcap-window", _attn_sample(gqa=True, positions=True, mask="additive"), positions=True,
          mask="additive", causal=True, window=5, softcap=1.5)  # fmt: skip
_attn_row("blocks-mask-bool-causal", _attn_sample(gqa=True, blocks=True, mask="bool"), mask="bool", causal=True)
_attn_row("blocks-mask-additive-softcap",
          _attn_sample(gqa=True, positions=True, lengths=True, blocks=True, mask="additive"), positions=True,
          lengths=True, mask="additive", causal=True, window=37, softcap=2.0)  # fmt: skip
_attn_row("split-mask-additive", _attn_sample(gqa=True, tq1=True, lengths=True, mask="additive"), lengths=True,
          mask="additive", causal=True, kv_splits=3)  # fmt: skip
_attn_row("split-mask-bool-window", _attn_sample(gqa=True, positions=True, mask="bool"), positions=True, mask="bool",
          causal=True, window=5, kv_splits=4)  # fmt: skip


def _partial_sample(rng: np.random.Generator) -> Sample:
    b, hkv = int(rng.integers(1, 3)), int(rng.integers(1, 3))
    hq, splits = hkv * int(rng.integers(1, 4)), int(rng.integers(2, 5))
    tk, tq, d = splits * int(rng.integers(1, 6)), int(rng.integers(1, 4)), int(rng.integers(1, 33))
    return Sample([(b, hq, tq, d), (b, hkv, tk, d), (b, hkv, tk, d)], {"tk": tk, "d": d, "splits": splits})


def _partial_ref(q, k, v, *, tk, d, splits, dtype):
    """Per key range: unnormalised output, max score, exp-sum (every key visible: no -inf)."""
    rep = q.shape[1] // k.shape[1]
    scores = q @ k.repeat_interleave(rep, 1).transpose(-1, -2) / math.sqrt(d)
    values = v.repeat_interleave(rep, 1)
    chunk = -(-tk // splits)
    parts = []
    for s in range(splits):
        sc = scores[..., s * chunk : (s + 1) * chunk]
        m = sc.max(-1).values
        p = torch.exp(sc - m[..., None])
        parts.append(torch.cat([p @ values[:, :, s * chunk : (s + 1) * chunk], m[..., None], p.sum(-1)[..., None]], -1))
    return torch.stack(parts, 3)


row(
    "attention_partial",
    "all-visible",
    lambda g, q, k, v, tk, d, splits: ml.attention_partial(q, k, v, splits=splits),
    _partial_ref,
    _partial_sample,
    reduce_len=lambda s: s.kw["tk"] + s.kw["d"],
)


# attention_partial's append form (a decode step): q [b, 1, hq, d] and the new key and value [b, 1, hkv, d]
# as the projections give them (taken as transposed views), the caches' old values, one position a
# sequence; head widths for both the split-key path and the warp-a-row one
_ROUNDED = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _append_sample(rng: np.random.Generator) -> Sample:
    b, hkv = int(rng.integers(1, 3)), int(rng.integers(1, 3))
    hq, splits = hkv * int(rng.integers(1, 4)), int(rng.integers(2, 5))
    tk, d = splits * int(rng.integers(1, 6)), int(rng.choice([6, 16, 32, 64]))
    shapes = [(b, 1, hq, d), (b, hkv, tk, d), (b, hkv, tk, d), (b, 1), (b, 1, hkv, d), (b, 1, hkv, d)]
    domains = ("normal", "normal", "normal", ("int", 0, tk), "normal", "normal")
    return Sample(shapes, {"tk": tk, "d": d, "splits": splits}, domains)


def _append_masked_sample(rng: np.random.Generator) -> Sample:
    """_append_sample's, and a bool mask over the keys of each sequence (the new key's slot included)."""
    sample = _append_sample(rng)
    b, tk = sample.shapes[0][0], sample.kw["tk"]
    return Sample([*sample.shapes, (b, 1, 1, tk)], sample.kw, (*sample.domains, "bool"))


def _append_build(q, k, v, pos, k_new, v_new, splits, softcap=None, mask=None):
    new = {"k_new": k_new.transpose(1, 2), "v_new": v_new.transpose(1, 2)}
    return ml.attention(
        q.transpose(1, 2), k, v, causal=True, q_positions=pos, kv_splits=splits, **new, rope={}, softcap=softcap,
        mask=mask,
    )  # fmt: skip


def _append_ref(q, k, v, pos, k_new, v_new, mask=None, *, tk, d, splits, dtype, softcap=None):
    """rope (its output rounded to the dtype, as stored), the caches written at pos, then attention."""
    rounded = _ROUNDED[dtype]
    q = rope_ref(q.transpose(1, 2), pos[:, None, :]).to(rounded).double()
    k_new = rope_ref(k_new.transpose(1, 2), pos[:, None, :]).to(rounded).double()
    k, v = k.clone(), v.clone()
    for bi in range(k.shape[0]):
        k[bi, :, pos[bi, 0]] = k_new[bi, :, 0]
        v[bi, :, pos[bi, 0]] = v_new[bi, 0]
    return attention_ref(q, k, v, pos, causal=True, softcap=softcap, mask=mask)


row(
    "attention_combine",
    "append-decode-mask",
    lambda g, q, k, v, pos, kn, vn, m, tk, d, splits: _append_build(q, k, v, pos, kn, vn, splits, mask=m),
    _append_ref,
    _append_masked_sample,
    fixed={3: "int64", 6: "bool"},
    reduce_len=lambda s: s.kw["tk"] + s.kw["d"],
)

for _label, _cap in (("append-decode", None), ("append-decode-softcap", 1.5)):
    row(
        "attention_combine",
        _label,
        lambda g, q, k, v, pos, kn, vn, tk, d, splits, _c=_cap: _append_build(q, k, v, pos, kn, vn, splits, _c),
        lambda *a, _c=_cap, **kw: _append_ref(*a, **kw, softcap=_c),
        _append_sample,
        fixed={3: "int64"},
        reduce_len=lambda s: s.kw["tk"] + s.kw["d"],
    )

"""Attention with its keys split over tiles (flash-decoding), for when the queries are few and the
keys many (decode over a long cache): one tile per key range would otherwise be the only worker.

``attention_partial`` gives, for each of ``splits`` consecutive key ranges, the unnormalised output
sum_j exp(s_j - m) v_j over the visible keys of that range, its running maximum m (-inf when the
range has no visible key) and its sum l = sum_j exp(s_j - m), all float32, in one tensor
[batch, heads, q_len, splits, v_dim + 2] (output, then m, then l). ``attention_combine`` merges the
ranges: with M = max m, out = sum exp(m - M) output / sum exp(m - M) l (zeros when no key is
visible), rounded once to the output dtype. ``ml.attention(..., kv_splits=S)`` builds the pair; the
result is attention's up to float32 rounding. The mask rules are attention's
(megaloop/frontend/ops/attention.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from megaloop.dtypes import as_dtype, float32
from megaloop.errors import DataError, DtypeError, GraphBuildError, ShapeError
from megaloop.frontend.opdef import Accuracy, Fast, Lowering, OpCall, OpDef, OutSpec, first_bad, register
from megaloop.frontend.ops import _placements, _tilings
from megaloop.frontend.ops._build import apply, require_bool, require_int, require_scalar
from megaloop.frontend.ops._fast import VALUES_ONLY, Kernel, rounder
from megaloop.frontend.ops.attention import (
    ATTENTION,
    attention_dims,
    check_attention_data,
    grouped_mask,
    key_range,
    mask_block,
    masked,
    masked_scores,
    softcapped,
    visible_keys,
)
from megaloop.frontend.ops.attention import _infer as _attention_infer
from megaloop.frontend.ops.elementwise import to_compute
from megaloop.frontend.ops.rope import ROPE_ATTRS, check_rotary, frequencies, rope_attrs, rotated
from megaloop.frontend.ops.rope import _reference as _rope_reference
from megaloop.frontend.shapes import format_shape
from megaloop.frontend.tensor import Tensor


def split_bounds(tk: int, splits: int, s: int) -> tuple[int, int]:
    """Keys [lo, hi) of split ``s``: ceil(tk / splits) keys each, the last ones possibly fewer."""
    chunk = -(-tk // splits)
    return min(tk, s * chunk), min(tk, (s + 1) * chunk)


def _partial_infer(call: OpCall) -> list[OutSpec]:
    b, hq, tq, dv = _attention_infer(call)[0].shape
    if "theta" in call.attrs:
        _check_append(call)
    return [OutSpec((b, hq, tq, call.attrs["splits"], dv + 2), float32)]


def _check_append(call: OpCall) -> None:
    """The append form's rules: one query a sequence at its q_positions (causal), k_new and v_new
    [batch, kv_heads, 1, dim] of the caches' dtypes, rope's attributes for the head."""
    slot = _tilings.attention_slots(call.attrs)
    q, k, v = call.operands[:3]
    b, hkv = k.shape[:2]
    if 3 not in slot or not call.attrs["causal"] or q.shape[2] != 1:
        raise call.error(
            GraphBuildError,
            f"the append form takes one query a sequence (q_len 1, got {q.shape[2]}) at its q_positions, causal",
            hint="pass causal=True and q_positions (the new token's position) with a decode step's q",
        )
    for n, cache, name in ((5, k, "k"), (6, v, "v")):
        new = call.operands[slot[n]]
        want = (b, hkv, 1, cache.shape[3])
        if new.shape != want:
            raise call.error(
                ShapeError,
                f"{name}_new must be [batch, kv_heads, 1, dim] = {format_shape(want)}, got {format_shape(new.shape)}",
            )
        if new.dtype != cache.dtype:
            raise call.error(DtypeError, f"{name}_new is {new.dtype.name} but the {name} cache is {cache.dtype.name}")
    check_rotary(call, q.shape[3])


def _check_partial_data(arrays: list[np.ndarray], attrs: dict[str, Any], known: Sequence[np.ndarray | None]) -> None:
    """attention's rules, and in the append form a position that names a slot of the caches (where the
    new key goes)."""
    check_attention_data(arrays, attrs, known)
    if "theta" in attrs:
        i, tk = _tilings.attention_slots(attrs)[3], arrays[1].shape[2]
        where = first_bad((arrays[i] < 0) | (arrays[i] >= tk), known[i])
        if where is not None:
            raise DataError(
                f"q_positions{list(where)} is {int(arrays[i][where])}: the new key goes to a slot of the "
                f"caches, in [0, {tk})"
            )


def _appended(arrays: list[np.ndarray], attrs: dict[str, Any]) -> list[np.ndarray]:
    """q, k and v as rope and the cache updates would have made them (the append form): q rotated at
    its position, and at that position of each sequence the rotated k_new and v_new, each rounded to
    its tensor's dtype."""
    slot = _tilings.attention_slots(attrs)
    q, k, v = arrays[:3]
    pos = arrays[slot[3]].astype(np.int64)  # [b, 1]
    b = q.shape[0]
    at = pos.reshape(b, 1, 1)
    q = _rope_reference([q, at], attrs).astype(q.dtype)
    k_new = _rope_reference([arrays[slot[5]], at], attrs).astype(k.dtype)
    k, v = k.copy(), v.copy()
    slots = np.clip(pos[:, 0], 0, k.shape[2] - 1)  # (_check_partial_data refused real ones outside)
    for bi in range(b):
        k[bi, :, slots[bi]] = k_new[bi, :, 0]
        v[bi, :, slots[bi]] = arrays[slot[6]][bi, :, 0]
    return [q, k, v, *arrays[3:]]


def _partial_reference(arrays: list[np.ndarray], attrs: dict[str, Any]) -> np.ndarray:
    if "theta" in attrs:
        arrays = _appended(arrays, attrs)
    absent = attrs.get("absent", ())
    q, k, v = (to_compute(a) for a in arrays[:3])
    extra = dict(zip([s for s in (3, 4) if s not in absent], arrays[3:]))
    b, hq, tq, _ = q.shape
    hkv, tk, dv = k.shape[1], k.shape[2], v.shape[3]
    splits = attrs["splits"]
    mask = visible_keys(b, tq, tk, attrs, extra.get(3), extra.get(4))
    qg = q.reshape(b, hkv, hq // hkv, tq, q.shape[3])
    scores = softcapped(np.einsum("bhgqd,bhkd->bhgqk", qg, k) * np.float32(attrs["scale"]), attrs)
    scores = masked(np.where(mask[:, None, None], scores, -np.inf), grouped_mask(arrays, attrs, hkv))
    scores = scores.astype(np.float32)
    out = np.zeros((b, hkv, hq // hkv, tq, splits, dv + 2), np.float32)
    out[..., dv] = -np.inf
    for s in range(splits):
        lo, hi = split_bounds(tk, splits, s)
        if lo >= hi:
            continue
        part = scores[..., lo:hi]
        m = np.max(part, axis=-1)
        p = np.exp(part - np.where(np.isfinite(m), m, 0.0)[..., None]).astype(np.float32)
        out[..., s, :dv] = np.einsum("bhgqk,bhkd->bhgqd", p, v[:, :, lo:hi])
        out[..., s, dv] = m
        out[..., s, dv + 1] = np.sum(p, axis=-1)
    return out.reshape(b, hq, tq, splits, dv + 2)


def _partials(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray, attrs: dict[str, Any], extra: np.ndarray | None
) -> np.ndarray:
    """The reference's key ranges from compute-form q, k, v with BLAS products over the keys that
    some query sees (``extra``: the mask operand, grouped_mask's)."""
    b, hq, tq, _ = q.shape
    hkv, tk, dv = k.shape[1], k.shape[2], v.shape[3]
    splits = attrs["splits"]
    out = np.zeros((b, hkv, hq // hkv, tq, splits, dv + 2), np.float32)
    out[..., dv] = -np.inf
    lo, hi = key_range(mask)
    part = mask_block(extra, slice(None), slice(lo, hi))
    scores = masked_scores(q, k[:, :, lo:hi], mask[:, :, lo:hi], attrs, part) if lo < hi else None
    for s in range(splits):
        a, c = split_bounds(tk, splits, s)
        a, c = max(a, lo), min(c, hi)
        if scores is None or a >= c:
            continue  # (no key visible: output 0, max -inf, sum 0, as the reference)
        part = scores[..., a - lo : c - lo]
        m = np.max(part, axis=-1)
        p = np.exp(part - np.where(np.isfinite(m), m, np.float32(0))[..., None])
        acc = np.matmul(p.reshape(b, hkv, -1, c - a), v[:, :, a:c])
        out[..., s, :dv] = acc.reshape(b, hkv, hq // hkv, tq, dv)
        out[..., s, dv] = m
        out[..., s, dv + 1] = np.sum(p, axis=-1)
    return out.reshape(b, hq, tq, splits, dv + 2)


def _partial_fast(node: Any) -> Kernel:
    """BLAS products (_partials); the append form writes the rotated new key and value into the caches
    for the product and puts the old rows back after it (the reference's copies of the caches, minus
    the copying)."""
    attrs, slot = node.attrs, _tilings.attention_slots(node.attrs)
    append = "theta" in attrs
    inv = frequencies(attrs) if append else None
    q_stored, k_stored = rounder(node.inputs[0].dtype), rounder(node.inputs[1].dtype)

    def run(arrays: list[np.ndarray]) -> list[np.ndarray]:
        q, k, v = arrays[:3]
        qpos, lengths = (arrays[slot[s]] if s in slot else None for s in (3, 4))
        mask = visible_keys(q.shape[0], q.shape[2], k.shape[2], attrs, qpos, lengths)
        extra = grouped_mask(arrays, attrs, k.shape[1])
        if not append:
            return [_partials(q, k, v, mask, attrs, extra)]
        b = q.shape[0]
        at = qpos.reshape(b, 1, 1)
        q = q_stored(rotated(q, at, attrs, inv))
        rows, slots = np.arange(b), np.clip(qpos[:, 0], 0, k.shape[2] - 1)
        k_new, v_new = k_stored(rotated(arrays[slot[5]], at, attrs, inv))[:, :, 0], arrays[slot[6]][:, :, 0]
        if not (k.flags.writeable and v.flags.writeable) or np.may_share_memory(k, v):
            k, v = k.copy(), v.copy()
        kept = k[rows, :, slots].copy(), v[rows, :, slots].copy()
        k[rows, :, slots], v[rows, :, slots] = k_new, v_new
        try:
            return [_partials(q, k, v, mask, attrs, extra)]
        finally:
            k[rows, :, slots], v[rows, :, slots] = kept

    return run


APPEND_ATTRS = ROPE_ATTRS  # the append form's: rope's (a node with them is the append form)

ATTENTION_PARTIAL = register(
    OpDef(
        name="attention_partial",
        kind="compute",
        category="attention",
        doc="attention over each of `splits` key ranges: unnormalised output, max score and exp-sum per "
        "range (float32); with k_new, v_new and rope's attributes, the append form of a decode step (q "
        "un-roped, the new key and value not yet in the caches); see megaloop.frontend.ops.attention_split.",
        operands=("q", "k", "v", "q_positions", "kv_lengths", "k_new", "v_new", "mask"),
        attrs={
            "splits": "count",
            "causal": "bool",
            "window": "count?",
            "scale": "number?",
            "absent": "ints",
            "softcap": "number?",
            "masked": "bool",
            **APPEND_ATTRS,
        },
        optional_attrs=frozenset({"absent", "softcap", "masked", *APPEND_ATTRS}),
        infer=_partial_infer,
        reference=_partial_reference,
        fast=Fast(_partial_fast, exact=False),
        check_data=_check_partial_data,
        accuracy=Accuracy(ulps=2.0, per_reduction=True),
        tiling=_tilings.ATTENTION_PARTIAL,
        lowering=Lowering("attention_partial"),
        placement=_placements.rule(attention_dims),  # (its output's first three axes are attention's)
    )
)


def _combine_infer(call: OpCall) -> list[OutSpec]:
    x = call.operands[0]
    if x.dtype != float32 or x.ndim != 5 or x.shape[4] < 3:
        raise call.error(
            ShapeError,
            "partial must be attention_partial's float32 [batch, heads, q_len, splits, v_dim + 2], got "
            f"{x.dtype.name}{format_shape(x.shape)}",
        )
    b, hq, tq, _, width = x.shape
    return [OutSpec((b, hq, tq, width - 2), call.attrs["dtype"])]


def _combine_reference(arrays: list[np.ndarray], attrs: dict[str, Any]) -> np.ndarray:
    x = arrays[0].astype(np.float32)
    dv = x.shape[-1] - 2
    m, sums, acc = x[..., dv], x[..., dv + 1], x[..., :dv]
    top = np.max(m, axis=-1, keepdims=True)
    w = np.exp(m - np.where(np.isfinite(top), top, 0.0)).astype(np.float32)  # -inf ranges weigh 0
    total = np.sum(sums * w, axis=-1)
    out = np.sum(acc * w[..., None], axis=-2)
    return out / np.where(total > 0, total, 1.0)[..., None]


ATTENTION_COMBINE = register(
    OpDef(
        name="attention_combine",
        kind="compute",
        category="attention",
        doc="merge attention_partial's key ranges into attention's output, rounded once to `dtype`.",
        operands=("partial",),
        attrs={"dtype": "dtype"},
        infer=_combine_infer,
        reference=_combine_reference,
        fast=VALUES_ONLY,
        accuracy=Accuracy(ulps=2.0, per_reduction=True),
        tiling=_tilings.ATTENTION_COMBINE,
        lowering=Lowering("attention_combine"),
        placement=_placements.rule(
            lambda node: [
                _placements.Dim(node.outputs[0].shape[a], ((0, a, 1), (_placements.OUT, a, 1)), label=f"axis {a}")
                for a in range(3)
            ]
        ),
    )
)


def attention_partial(
    q: Tensor, k: Tensor, v: Tensor, *, splits: int, causal: bool = False, scale: float | None = None
) -> Tensor:
    """The first half on its own (tests, and graphs that merge ranges themselves)."""
    return apply(ATTENTION_PARTIAL, [q, k, v], splits=splits, causal=causal, window=None, scale=scale, absent=(3, 4))


def attention_combine(partial: Tensor, dtype: Any) -> Tensor:
    return apply(ATTENTION_COMBINE, [partial], dtype=as_dtype(dtype))


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    q_positions: Tensor | None = None,
    kv_lengths: Tensor | None = None,
    window: int | None = None,
    scale: float | None = None,
    kv_splits: int | None = None,
    k_new: Tensor | None = None,
    v_new: Tensor | None = None,
    rope: dict[str, Any] | None = None,
    softcap: float | None = None,
    mask: Tensor | None = None,
) -> Tensor:
    """Attention (megaloop/frontend/ops/attention.py). ``kv_splits``: split the keys into that many ranges
    computed by separate tiles and merged after (this module's two ops): for few queries over many keys
    (decode). ``k_new``, ``v_new`` and ``rope`` (rope's keywords: theta, layout, rotary_dim, scaling):
    the append form of a decode step (module docstring), k and v the caches' old values, q un-roped.
    ``softcap`` c: each scaled score s becomes c * tanh(s / c) before the mask (Gemma 2). ``mask``: bool
    (True: attend) or float (added to the scores), broadcasting to [batch, heads, q_len, kv_len], as
    torch's scaled_dot_product_attention's attn_mask; it hides keys on top of causal and window."""
    optional = {3: q_positions, 4: kv_lengths}
    operands = [q, k, v] + [t for t in optional.values() if t is not None]
    absent = tuple(s for s, t in optional.items() if t is None)
    if window is not None:
        window = require_int(ATTENTION, "window", window, minimum=1)
    if scale is not None:
        scale = float(require_scalar(ATTENTION, "scale", scale))
    causal = require_bool(ATTENTION, "causal", causal)
    attrs = {"causal": causal, "window": window, "scale": scale, **({"absent": absent} if absent else {})}
    if softcap is not None:
        attrs["softcap"] = float(require_scalar(ATTENTION, "softcap", softcap))
    append = (k_new, v_new, rope) != (None, None, None)
    if append:
        attrs.update(_append_attrs(k_new, v_new, rope, kv_splits, q_positions))
        operands += [k_new, v_new]
    if mask is not None:
        attrs["masked"] = True
        operands.append(mask)
    if kv_splits is not None:
        kv_splits = require_int(ATTENTION, "kv_splits", kv_splits, minimum=1)
        tk = k.shape[2] if isinstance(k, Tensor) and k.ndim == 4 else 1
        chunk = -(-tk // kv_splits)
        splits = -(-tk // chunk)  # no empty range: tk = 9 in 4 splits is 3 ranges of 3
        if splits > 1 or append:  # attention_partial then attention_combine
            if mask is not None and not append:  # (its inputs named by the partial's operands)
                attrs["absent"] = (*absent, 5, 6)
            partial = apply(ATTENTION_PARTIAL, operands, splits=splits, **attrs)
            return apply(ATTENTION_COMBINE, [partial], dtype=operands[0].dtype)
    return apply(ATTENTION, operands, **attrs)


def _append_attrs(k_new: Any, v_new: Any, rope: Any, kv_splits: Any, q_positions: Any) -> dict[str, Any]:
    """rope's attributes for the append form, once its arguments are all there."""
    missing = [n for n, x in (("k_new", k_new), ("v_new", v_new), ("rope", rope)) if x is None]
    if missing:
        raise GraphBuildError(
            f"attention: the append form takes k_new, v_new and rope together; {', '.join(missing)} missing",
        )
    if kv_splits is None or q_positions is None:
        raise GraphBuildError(
            "attention: the append form is attention_partial's: pass kv_splits (1 or more) and q_positions "
            "(where the new key goes)"
        )
    unknown = set(rope) - {"theta", "layout", "rotary_dim", "scaling"} if isinstance(rope, dict) else None
    if unknown is None or unknown:
        raise GraphBuildError(
            f"attention: rope must be a dict of rope's keywords (theta, layout, rotary_dim, scaling), got {rope!r:.80}"
        )
    return rope_attrs(
        rope.get("theta", 10000.0),
        rope.get("layout", "neox"),
        rope.get("rotary_dim"),
        rope.get("scaling"),
        ATTENTION_PARTIAL,
    )

"""Scaled dot-product attention (causal, grouped-query, sliding window) and the KV-cache update.

Layout is PyTorch's: q [batch, heads, q_len, head_dim], k [batch, kv_heads, kv_len, head_dim],
v [batch, kv_heads, kv_len, v_dim]. With grouped-query attention (kv_heads < heads), query head h
reads kv head h // (heads / kv_heads).

Which keys a query sees: key j is visible to query i of batch b when
  j < kv_lengths[b]                       (only the valid prefix of a cache; default: all kv_len keys)
  and j <= q_positions[b, i]              (if causal)
  and j > q_positions[b, i] - window      (if a sliding window is set; needs causal)
With ``softcap`` c, each scaled score s becomes c * tanh(s / c) before the mask (Gemma 2's attention
logit softcapping). An optional ``mask`` operand, broadcasting to [batch, heads, q_len, kv_len]
(right-aligned; its heads axis 1 or heads), hides more keys: bool (True: attend, as torch's
scaled_dot_product_attention) or float (added to the softcapped scores; -inf hides the key).
q_positions defaults to the last q_len places of the valid prefix, kv_lengths[b] - q_len + i (the
"bottom-right" alignment of FlashAttention; for q_len == kv_len it is the usual causal mask). A
query that sees no key returns zeros, not NaN.

The KV cache is a ``state`` [batch, kv_heads, max_len, head_dim]; ``kv_cache_update`` writes the new
keys/values at their positions and its result is the state's value for later iterations.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from megaloop.errors import DataError, DtypeError, GraphBuildError, ShapeError
from megaloop.frontend import sources
from megaloop.frontend.opdef import Accuracy, Fast, Lowering, OpCall, OpDef, OutSpec, VjpCall, first_bad, register
from megaloop.frontend.ops import _placements, _tilings, _torch
from megaloop.frontend.ops._build import apply, require_bool
from megaloop.frontend.ops._fast import Kernel, rounder
from megaloop.frontend.ops._grad import f32, unbroadcast
from megaloop.frontend.ops._tilings import MASK
from megaloop.frontend.ops.elementwise import check_kinds, tensor_dtype, to_compute
from megaloop.frontend.shapes import format_shape
from megaloop.frontend.tensor import BUILDERS as B
from megaloop.frontend.tensor import Tensor


def _infer(call: OpCall) -> list[OutSpec]:
    absent = call.attrs.get("absent", ())
    q, k, v = call.operands[:3]
    extra = dict(zip([s for s in (3, 4) if s not in absent], call.operands[3:]))
    dtype = tensor_dtype(OpCall(call.op, (q, k, v), {}, call.where))
    check_kinds(call, dtype, "f")
    for i, t in enumerate((q, k, v)):
        if t.ndim != 4:
            raise call.error(
                ShapeError, f"{call.name(i)} must be 4-D [batch, heads, tokens, dim], got {format_shape(t.shape)}"
            )
    b, hq, tq, d = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise call.error(ShapeError, f"batch sizes differ: q {b}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise call.error(ShapeError, "k and v must have the same kv_heads and kv_len")
    if k.shape[3] != d:
        raise call.error(ShapeError, f"q head_dim {d} differs from k head_dim {k.shape[3]}")
    hkv = k.shape[1]
    if hq % hkv:
        raise call.error(ShapeError, f"heads ({hq}) must be a multiple of kv_heads ({hkv}) for grouped-query attention")
    if 3 in extra:
        p = extra[3]
        if not p.dtype.is_int or p.shape != (b, tq):
            raise call.error(
                ShapeError if p.dtype.is_int else DtypeError,
                f"q_positions must be an int tensor [batch, q_len] = [{b}, {tq}], got "
                f"{p.dtype.name}{format_shape(p.shape)}",
            )
    if 4 in extra:
        n = extra[4]
        if not n.dtype.is_int or n.shape != (b,):
            raise call.error(
                ShapeError if n.dtype.is_int else DtypeError,
                f"kv_lengths must be an int tensor [batch] = [{b}], got {n.dtype.name}{format_shape(n.shape)}",
            )
    if call.attrs["window"] is not None and not call.attrs["causal"]:
        raise call.error(GraphBuildError, "a sliding window needs causal=True")
    if 3 in extra and not call.attrs["causal"]:
        raise call.error(
            GraphBuildError,
            "q_positions only matter for a causal mask; pass causal=True",
            hint="to limit the keys of a non-causal attention, use kv_lengths",
        )
    if call.attrs.get("masked"):
        check_mask(call, call.operands[_tilings.attention_slots(call.attrs)[MASK]], (b, hq, tq, k.shape[2]))
    if call.attrs["scale"] is None:
        call.attrs["scale"] = 1.0 / math.sqrt(d)
    cap = call.attrs.get("softcap")
    if cap is not None and not cap > 0:
        raise call.error(GraphBuildError, f"softcap must be None or a number > 0, got {cap!r}")
    return [OutSpec((b, hq, tq, v.shape[3]), dtype)]


def check_mask(call: OpCall, mask: Tensor, scores: tuple[int, int, int, int]) -> None:
    """The mask operand: bool or float, broadcasting to the scores [batch, heads, q_len, kv_len]."""
    if not (mask.dtype.is_bool or mask.dtype.is_float):
        raise call.error(
            DtypeError,
            f"mask must be bool (True: attend) or a float dtype (added to the scores), got {mask.dtype.name}",
        )
    fits = mask.ndim <= 4 and all(n in (1, want) for n, want in zip(mask.shape[::-1], scores[::-1]))
    if not fits:
        raise call.error(
            ShapeError,
            f"mask {format_shape(mask.shape)} must broadcast to the scores [batch, heads, q_len, kv_len] = "
            f"{format_shape(scores)} (each axis 1 or the scores' size, right-aligned)",
            hint="for a [batch, kv_len] padding mask, pass mask.reshape(batch, 1, 1, kv_len)",
        )


def attention_dims(node: Any) -> list[_placements.Dim]:
    """By sequences; by groups of heads (a kv head with its query heads: grouped-query attention keeps
    each group on one member); by queries when their positions are given (or there is no mask). The
    append form's k_new and v_new [batch, kv_heads, 1, dim] go with the sequences and kv heads."""
    out = _placements.OUT
    slot = _tilings.attention_slots(node.attrs)
    q, k = node.inputs[0], node.inputs[1]
    b, hq, tq, _ = q.shape
    group = hq // k.shape[1]
    extras = [(slot[s], 0, 1) for s in (3, 4, 5, 6) if s in slot]
    new = [(slot[s], 1, 1) for s in (5, 6) if s in slot]
    cut = {0: [], 1: [], 2: []}  # the mask's axes that are not broadcast, by the scores' axis they walk
    if MASK in slot:
        mask = node.inputs[slot[MASK]]
        for a, n in enumerate(mask.shape):
            axis = a + 4 - mask.ndim
            if n > 1 and axis < 3:
                cut[axis].append((slot[MASK], a, group if axis == 1 else 1))
    extras += cut[0]
    new += cut[1]
    dims = [
        _placements.Dim(b, ((0, 0, 1), (1, 0, 1), (2, 0, 1), *extras, (out, 0, 1)), label="by sequences"),
        _placements.Dim(k.shape[1], ((0, 1, group), (1, 1, 1), (2, 1, 1), *new, (out, 1, group)), label="by heads"),
    ]
    if 3 in slot or not node.attrs["causal"]:
        qpos = ((slot[3], 1, 1),) if 3 in slot else ()
        dims.append(_placements.Dim(tq, ((0, 2, 1), *qpos, *cut[2], (out, 2, 1)), label="by queries"))
    return dims


def _cache_dims(node: Any) -> list[_placements.Dim]:
    """cache [batch, kv_heads, slots, dim], new [batch, kv_heads, tokens, dim], positions [batch, tokens]:
    by sequences or by heads."""
    out = _placements.OUT
    b, h = node.inputs[0].shape[:2]
    return [
        _placements.Dim(b, ((0, 0, 1), (1, 0, 1), (2, 0, 1), (out, 0, 1)), label="by sequences"),
        _placements.Dim(h, ((0, 1, 1), (1, 1, 1), (out, 1, 1)), label="by heads"),
    ]


CACHE_PLACEMENT = _placements.rule(_cache_dims)


def visible_keys(
    b: int, tq: int, tk: int, attrs: dict[str, Any], q_positions: np.ndarray | None, kv_lengths: np.ndarray | None
) -> np.ndarray:
    """The [batch, q_len, kv_len] bool mask of which key each query sees (module docstring)."""
    lengths = np.full((b,), tk, np.int64) if kv_lengths is None else kv_lengths.astype(np.int64)
    lengths = np.clip(lengths, 0, tk)  # check_attention_data refused real lengths outside
    if q_positions is None:
        qpos = lengths[:, None] - tq + np.arange(tq)[None, :]
    else:
        qpos = q_positions.astype(np.int64)
    j = np.arange(tk)[None, None, :]
    mask = np.broadcast_to(j < lengths[:, None, None], (b, tq, tk)).copy()
    if attrs["causal"]:
        mask &= j <= qpos[:, :, None]
        if attrs["window"] is not None:
            mask &= j > qpos[:, :, None] - attrs["window"]
    return mask


def softcapped(scores: np.ndarray, attrs: dict[str, Any]) -> np.ndarray:
    """The scaled scores after the op's logit softcapping, c * tanh(s / c) (as they are without one)."""
    cap = attrs.get("softcap")
    if cap is None:
        return scores
    return (np.float32(cap) * np.tanh(scores / np.float32(cap))).astype(np.float32)


def check_attention_data(arrays: list[np.ndarray], attrs: dict[str, Any], known: Sequence[np.ndarray | None]) -> None:
    """kv_lengths (when given) must lie in [0, kv_len]."""
    absent = attrs.get("absent", ())
    if 4 in absent:
        return
    i = 3 if 3 in absent else 4
    lengths, tk = arrays[i], arrays[1].shape[2]
    where = first_bad((lengths < 0) | (lengths > tk), known[i])
    if where is not None:
        raise DataError(f"kv_lengths[{where[0]}] is {int(lengths[where])}; kv_lengths must lie in [0, {tk}]")


def grouped_mask(arrays: list[np.ndarray], attrs: dict[str, Any], hkv: int) -> np.ndarray | None:
    """The node's mask operand (None: none) as [batch | 1, hkv | 1, group | 1, q_len | 1, kv_len | 1],
    to broadcast against scores whose query heads are grouped by kv head."""
    slot = _tilings.attention_slots(attrs)
    if MASK not in slot:
        return None
    return group_heads(arrays[slot[MASK]], hkv)


def group_heads(mask: np.ndarray, hkv: int) -> np.ndarray:
    """A mask operand broadcasting to [batch, heads, q_len, kv_len] as grouped_mask gives it."""
    mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    b, h, q, k = mask.shape
    mask = mask.reshape(b, hkv, h // hkv, q, k) if h > 1 else mask.reshape(b, 1, 1, q, k)
    return mask if mask.dtype == np.bool_ else to_compute(mask).astype(np.float32, copy=False)


def mask_block(mask: np.ndarray | None, queries: slice, keys: slice) -> np.ndarray | None:
    """A grouped mask's part for those queries and keys (its broadcast axes as they are)."""
    if mask is None:
        return None
    return mask[..., queries if mask.shape[-2] > 1 else slice(None), keys if mask.shape[-1] > 1 else slice(None)]


def masked(scores: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    """Scores with a grouped mask (part) applied: -inf where a bool mask is False, else the float mask
    added."""
    if mask is None:
        return scores
    if mask.dtype == np.bool_:
        return np.where(mask, scores, np.float32(-np.inf))
    return scores + mask


def _reference(arrays: list[np.ndarray], attrs: dict[str, Any]) -> np.ndarray:
    absent = attrs.get("absent", ())
    q, k, v = (to_compute(a) for a in arrays[:3])
    extra = dict(zip([s for s in (3, 4) if s not in absent], arrays[3:]))
    b, hq, tq, _ = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    mask = visible_keys(b, tq, tk, attrs, extra.get(3), extra.get(4))  # [b, tq, tk]
    qg = q.reshape(b, hkv, hq // hkv, tq, q.shape[3])  # query heads grouped by the kv head they read
    scores = softcapped(np.einsum("bhgqd,bhkd->bhgqk", qg, k) * np.float32(attrs["scale"]), attrs)
    scores = masked(np.where(mask[:, None, None], scores, -np.inf), grouped_mask(arrays, attrs, hkv))
    row_max = np.max(scores, axis=-1, keepdims=True, initial=-np.inf)  # (no key: -inf, then zeros)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    p = np.exp(scores - row_max)
    denom = np.sum(p, axis=-1, keepdims=True)
    p = p / np.where(denom > 0, denom, 1.0)
    out = np.einsum("bhgqk,bhkd->bhgqd", p.astype(np.float32), v)
    return out.reshape(b, hq, tq, v.shape[3])


def visible_keys_tensor(call: VjpCall) -> Tensor | None:
    """``visible_keys`` built with the graph API: bool [batch, 1, q_len, kv_len] (None: every key)."""
    absent, attrs = call.attrs.get("absent", ()), call.attrs
    q, k = call.inputs[:2]
    extra = dict(zip([s for s in (3, 4) if s not in absent], call.inputs[3:]))
    b, tq, tk = q.shape[0], q.shape[2], k.shape[2]
    if 4 not in extra and not attrs["causal"]:
        return None
    graph = call.graph
    j = graph.constant(np.arange(tk, dtype=np.int64).reshape(1, 1, tk), "int64")
    lengths = B.reshape(B.cast(extra[4], "int64"), (b, 1, 1)) if 4 in extra else None
    mask = B.less(j, lengths) if lengths is not None else None
    if attrs["causal"]:
        if 3 in extra:
            qpos = B.reshape(B.cast(extra[3], "int64"), (b, tq, 1))
        else:
            rows = graph.constant(np.arange(tq, dtype=np.int64).reshape(1, tq, 1) - tq, "int64")
            qpos = rows + (lengths if lengths is not None else tk)
        seen = B.less_equal(j, qpos)
        if attrs["window"] is not None:
            seen = seen & B.greater(j, qpos - attrs["window"])
        mask = seen if mask is None else mask & seen
    return B.reshape(B.broadcast_to(mask, (b, tq, tk)), (b, 1, tq, tk))


def _vjp(call: VjpCall) -> list[Tensor | None]:
    """``attention_grad`` (the scores recomputed a block of keys at a time, megaloop/frontend/ops/
    attention_grad.py), or plain_vjp where a float mask operand needs its own gradient."""
    slot = _tilings.attention_slots(call.attrs)
    if MASK in slot and call.needs[slot[MASK]]:
        return plain_vjp(call)
    attrs = call.attrs
    opts = {"causal": attrs["causal"], "window": attrs["window"], "scale": attrs["scale"]}
    opts.update({"softcap": attrs["softcap"]} if attrs.get("softcap") is not None else {})
    for s, name in ((3, "q_positions"), (4, "kv_lengths"), (MASK, "mask")):
        if s in slot:
            opts[name] = call.inputs[slot[s]]
    q, k, v = call.inputs[:3]
    wrt = "".join(n for n, need in zip("qkv", call.needs) if need)
    grads: list[Tensor | None] = [None] * len(call.inputs)
    if wrt:
        grads[:3] = B.attention_grad(q, k, v, call.cotangent(), wrt=wrt, **opts)
    return grads


def plain_vjp(call: VjpCall) -> list[Tensor | None]:
    """The scores recomputed (float32) from q and k, then, with P their masked softmax and dO the
    cotangent: dV = P^T dO, dP = dO V^T, dS = P (dP - rowsum(P dP)) scale, dQ = dS K, dK = dS^T Q;
    a kv head's query heads are one block of rows, so GQA's sums over the group fall out of the products.
    With a softcap, dS is taken through c tanh(s / c)."""
    q, k, v = call.inputs[:3]
    b, hq, tq, d = q.shape
    hkv, tk, dv = k.shape[1], k.shape[2], v.shape[3]
    group, scale = hq // hkv, call.attrs["scale"]
    qg = B.reshape(f32(q), (b, hkv, group * tq, d))
    k32, v32 = f32(k), f32(v)
    scores = B.reshape(B.matmul(qg, k32, transpose_b=True) * scale, (b, hkv, group, tq, tk))
    cap = call.attrs.get("softcap")
    turned = None  # softcap c: scores c tanh(s / c), whose derivative is 1 - tanh^2
    if cap is not None:
        turned = B.tanh(scores * (1.0 / cap))
        scores = turned * cap
    mask = visible_keys_tensor(call)
    mask = mask if mask is None else B.reshape(mask, (b, 1, 1, tq, tk))
    scores, mask = _with_mask_operand(call, scores, mask)
    if mask is not None:
        scores = B.where(mask, scores, -1e30)  # a row with no visible key: uniform, then zeroed
    p = B.softmax(scores, -1)
    if mask is not None:
        p = B.where(mask, p, 0.0)
    p = B.reshape(p, (b, hkv, group * tq, tk))
    do = B.reshape(f32(call.cotangent()), (b, hkv, group * tq, dv))
    dp = B.matmul(do, v32, transpose_b=True)
    ds = p * (dp - B.sum(p * dp, -1, keepdims=True))
    grads: list[Tensor | None] = [None] * len(call.inputs)
    slot = _tilings.attention_slots(call.attrs)
    if MASK in slot and call.needs[slot[MASK]]:  # a float mask: the scores' own gradient, summed back
        m = call.inputs[slot[MASK]]
        grads[slot[MASK]] = B.cast(unbroadcast(B.reshape(ds, (b, hq, tq, tk)), m.shape), m.dtype)
    if turned is not None:
        ds = ds * B.reshape(1.0 - turned * turned, (b, hkv, group * tq, tk))
    ds = ds * scale
    if call.needs[0]:
        grads[0] = B.cast(B.reshape(B.matmul(ds, k32), (b, hq, tq, d)), q.dtype)
    if call.needs[1]:
        grads[1] = B.cast(B.matmul(ds, qg, transpose_a=True), k.dtype)
    if call.needs[2]:
        grads[2] = B.cast(B.matmul(p, do, transpose_a=True), v.dtype)
    return grads


def _with_mask_operand(call: VjpCall, scores: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """The grouped scores [b, hkv, group, tq, tk] with the mask operand applied (a float one added),
    and the bool mask of the keys seen (None: all): visible_keys' and the operand's (False where it
    is False, or -inf)."""
    slot = _tilings.attention_slots(call.attrs)
    if MASK not in slot:
        return scores, mask
    b, hkv, group, tq, tk = scores.shape
    m = call.inputs[slot[MASK]]
    m4 = B.reshape(m, (1,) * (4 - m.ndim) + m.shape)
    n = m4.shape
    grouped = (n[0], hkv, group, n[2], n[3]) if n[1] > 1 else (n[0], 1, 1, n[2], n[3])
    m5 = B.reshape(m4, grouped)
    if m.dtype.is_bool:
        seen = m5
    else:
        hidden = call.graph.constant(np.array(-np.inf, m.dtype.np), m.dtype, allow_nonfinite=True)
        seen = B.not_equal(m5, hidden)
        scores = scores + f32(m5)
    seen = B.broadcast_to(seen, (b, hkv, group, tq, tk))
    return scores, seen if mask is None else B.logical_and(seen, mask)


# ---- the fast CPU path: BLAS products over the visible keys (OpDef.fast) ------------------------------

SCORES_PER_BLOCK = 1 << 22  # float32 scores a block of queries holds at most (16 MiB)
# queries a block takes at most: a causal prompt's blocks skip the keys after their last query (the
# masked half, less a block's triangle), and a block's scores stay in the caches
QUERY_BLOCK = 64


def key_range(mask: np.ndarray) -> tuple[int, int]:
    """The keys [lo, hi) that some query of ``mask`` [..., tk] sees (lo == hi: none)."""
    if mask.size == 0:
        return (0, 0)
    seen = np.flatnonzero(mask.reshape(-1, mask.shape[-1]).any(axis=0))
    return (int(seen[0]), int(seen[-1]) + 1) if seen.size else (0, 0)


def masked_scores(
    q: np.ndarray, k: np.ndarray, mask: np.ndarray, attrs: dict[str, Any], extra: np.ndarray | None = None
) -> np.ndarray:
    """q k^T * scale (softcapped as the op's attributes say) for compute-form q [b, hq, tq, d] and k
    [b, hkv, n, d] as a BLAS product, -inf where ``mask`` [b, tq, n] hides a key, then the mask
    operand's part ``extra`` (grouped_mask's) applied: [b, hkv, hq / hkv, tq, n], query heads grouped
    by kv head. A new array, each pass in place; only the keys some query does not see are masked."""
    b, hq, tq, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    scores = np.matmul(q.reshape(b, hkv, (hq // hkv) * tq, d), np.swapaxes(k, -1, -2))
    scores = scores.reshape(b, hkv, hq // hkv, tq, n)
    scores *= np.float32(attrs["scale"])
    scores = softcapped(scores, attrs)
    hidden = np.flatnonzero(~mask.all(axis=(0, 1)))
    if hidden.size:
        lo, hi = int(hidden[0]), int(hidden[-1]) + 1
        np.copyto(scores[..., lo:hi], np.float32(-np.inf), where=~mask[:, None, None, :, lo:hi])
    return masked(scores, extra)


def _attend(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    mask: np.ndarray,
    attrs: dict[str, Any],
    extra: np.ndarray | None = None,
) -> np.ndarray:
    """The reference's softmax(q k^T * scale + mask) v with BLAS products, in blocks of queries, each
    over the keys its queries see (``extra``: the mask operand, grouped_mask's)."""
    b, hq, tq, _ = q.shape
    hkv, tk, dv = k.shape[1], k.shape[2], v.shape[3]
    out = np.zeros((b, hkv, hq // hkv, tq, dv), np.float32)
    block = max(1, min(tq, QUERY_BLOCK, SCORES_PER_BLOCK // max(1, b * hq * tk)))
    for q0 in range(0, tq, block):
        rows = mask[:, q0 : q0 + block]
        lo, hi = key_range(rows)
        if lo == hi:
            continue  # (no key visible: zeros, as the reference)
        part = mask_block(extra, slice(q0, q0 + block), slice(lo, hi))
        p = masked_scores(q[:, :, q0 : q0 + block], k[:, :, lo:hi], rows[:, :, lo:hi], attrs, part)
        row_max = np.max(p, axis=-1, keepdims=True)
        p -= np.where(np.isfinite(row_max), row_max, np.float32(0))
        np.exp(p, out=p)
        denom = np.sum(p, axis=-1, keepdims=True)
        p /= np.where(denom > 0, denom, np.float32(1))
        n = p.shape[3]
        o = np.matmul(p.reshape(b, hkv, -1, hi - lo), v[:, :, lo:hi])
        out[:, :, :, q0 : q0 + n] = o.reshape(b, hkv, hq // hkv, n, dv)
    return out.reshape(b, hq, tq, dv)


def _fast(node: Any) -> Kernel:
    attrs, finish = node.attrs, rounder(node.outputs[0].dtype, in_place=True)
    slot = _tilings.attention_slots(attrs)

    def run(arrays: list[np.ndarray]) -> list[np.ndarray]:
        q, k, v = arrays[:3]
        qpos, lengths = (arrays[slot[s]] if s in slot else None for s in (3, 4))
        mask = visible_keys(q.shape[0], q.shape[2], k.shape[2], attrs, qpos, lengths)
        return [finish(_attend(q, k, v, mask, attrs, grouped_mask(arrays, attrs, k.shape[1])))]

    return run


# the last few runs' key ranges and masks for torch's kernel: a prefill's layers see the same keys
_SEEN: dict[tuple[Any, ...], tuple[int, int, bool, Any]] = {}
SEEN_KEPT = 8
_SEEN_LOCK = threading.Lock()


def _seen_keys(b: int, tq: int, tk: int, attrs: dict[str, Any], qpos: Any, lengths: Any) -> tuple[int, int, bool, Any]:
    """(lo, hi, causal, mask): the keys [lo, hi) some query sees, whether the mask over them is the plain
    causal triangle, else the bool mask [b, 1, tq, hi - lo] as a torch tensor (None: every key); lo == hi
    where some query sees no key. Computed once for the layers that share the positions."""
    key = (b, tq, tk, attrs["causal"], attrs["window"], *(None if a is None else a.tobytes() for a in (qpos, lengths)))
    found = _SEEN.get(key)
    if found is None:
        mask = visible_keys(b, tq, tk, attrs, qpos, lengths)
        lo, hi = key_range(mask)
        mask = mask[:, :, lo:hi]
        if lo == hi or not mask.any(axis=-1).all():
            found = (0, 0, False, None)
        else:
            causal = tq == hi - lo and np.array_equal(mask, np.broadcast_to(np.tri(tq, dtype=np.bool_), mask.shape))
            every = causal or mask.all()
            found = (lo, hi, causal, None if every else _torch.from_numpy(np.ascontiguousarray(mask[:, None])))
        with _SEEN_LOCK:  # (graphs may run in threads)
            if len(_SEEN) >= SEEN_KEPT:
                _SEEN.pop(next(iter(_SEEN)), None)
            _SEEN[key] = found
    return found


def _on_torch(node: Any) -> Any:
    """torch's scaled_dot_product_attention (its fused CPU kernel) in float32 (bfloat16's own rounds
    the probabilities: past the contract) over the keys some query sees, causal where the mask is the
    plain triangle; the numpy kernel where a query sees no key (torch's NaN, the reference's zeros).
    Without softcapping or a mask operand."""
    attrs, dtype, slot = node.attrs, node.outputs[0].dtype, _tilings.attention_slots(node.attrs)
    if attrs.get("softcap") is not None or MASK in slot:
        return None
    numpy_kernel = _torch.in_numpy(node, _fast(node))

    def run(arrays: list[Any]) -> list[Any]:
        q, k, v = arrays[:3]
        qpos, lengths = (arrays[slot[s]].numpy() if s in slot else None for s in (3, 4))
        (b, hq, tq, _), hkv = q.shape, k.shape[1]
        lo, hi, causal, seen = _seen_keys(b, tq, k.shape[2], attrs, qpos, lengths)
        if lo == hi:
            return numpy_kernel(arrays)
        out = _torch.torch().nn.functional.scaled_dot_product_attention(
            q.float(), k[:, :, lo:hi].float(), v[:, :, lo:hi].float(), attn_mask=seen, is_causal=causal,
            scale=float(attrs["scale"]), enable_gqa=hq != hkv,
        )  # fmt: skip
        return [_torch.of(out, dtype)]

    return run


ATTENTION = register(
    OpDef(
        name="attention",
        kind="compute",
        category="attention",
        doc="softmax(softcap(q k^T * scale) + mask) v with causal/GQA/sliding-window/KV-prefix masking and an "
        "optional bool or additive mask operand; see megaloop.frontend.ops.attention for the exact mask.",
        operands=("q", "k", "v", "q_positions", "kv_lengths", "mask"),
        attrs={
            "causal": "bool",
            "window": "count?",
            "scale": "number?",
            "absent": "ints",
            "softcap": "number?",
            "masked": "bool",
        },
        optional_attrs=frozenset({"absent", "softcap", "masked"}),
        infer=_infer,
        reference=_reference,
        fast=Fast(_fast, exact=False, torch=_on_torch),
        check_data=check_attention_data,
        accuracy=Accuracy(ulps=2.0, per_reduction=True),
        tiling=_tilings.ATTENTION,
        lowering=Lowering("attention"),
        placement=_placements.rule(lambda node: attention_dims(node)),
        vjp=lambda call: _vjp(call),
    )
)


# ``ml.attention``, the builder, is in attention_split.py: with kv_splits it builds that module's two ops.


# ---- KV cache ----------------------------------------------------------------------------------


def _update_infer(call: OpCall) -> list[OutSpec]:
    cache, new, pos = call.operands
    if cache.node.op is not sources.STATE or cache.is_view:
        raise call.error(
            GraphBuildError,
            f"cache must be a state tensor (graph.state(...)), got {cache!r}",
            hint="the cache persists between iterations, so declare it with graph.state",
        )
    check_kinds(call, cache.dtype, "f")
    if new.base is cache:
        raise call.error(
            GraphBuildError,
            f"new ({new!r}) is a view of the cache it is written into; tiles would read slots that others overwrite",
            hint="copy it first (e.g. new * 1.0)",
        )
    if new.dtype != cache.dtype:
        raise call.error(
            DtypeError,
            f"new is {new.dtype.name} but the cache is {cache.dtype.name}",
            hint=f"cast new to {cache.dtype.name}",
        )
    if cache.ndim != 4 or new.ndim != 4:
        raise call.error(ShapeError, "cache and new must be 4-D [batch, kv_heads, tokens, head_dim]")
    b, h, s, d = cache.shape
    if new.shape[0] != b or new.shape[1] != h or new.shape[3] != d or new.shape[2] > s:
        raise call.error(
            ShapeError,
            f"new {format_shape(new.shape)} does not fit the cache {format_shape(cache.shape)}: "
            "batch, kv_heads and head_dim must match and tokens <= max_len",
        )
    if not pos.dtype.is_int or pos.shape != (b, new.shape[2]):
        raise call.error(
            ShapeError if pos.dtype.is_int else DtypeError,
            f"positions must be an int tensor [batch, tokens] = [{b}, {new.shape[2]}], "
            f"got {pos.dtype.name}{format_shape(pos.shape)}",
        )
    return [OutSpec(cache.shape, cache.dtype)]


def check_update_data(arrays: list[np.ndarray], attrs: dict[str, Any], known: Sequence[np.ndarray | None]) -> None:
    """Positions must name slots of the cache, each at most once in a batch row (one write each)."""
    cache, pos, real = arrays[0], arrays[2], known[2]
    s = cache.shape[2]
    if attrs.get("ignore_negative"):  # a negative position writes nothing: not a slot to check
        real = (pos >= 0) if real is None else (real & (pos >= 0))
    where = first_bad((pos < 0) | (pos >= s), real)
    if where is not None:
        raise DataError(f"position {int(pos[where])} at index {where} is outside the cache of {s} slots")
    for bi, row in enumerate(pos):
        slots = row if real is None else row[real[bi]]
        values, counts = np.unique(slots, return_counts=True)
        if np.any(counts > 1):
            raise DataError(
                f"positions {row.tolist()} of batch row {bi} repeat slot {int(values[counts > 1][0])}: "
                "one of the writes would be lost"
            )


def _update_ref(arrays: list[np.ndarray], attrs: dict[str, Any]) -> np.ndarray:
    cache, new, pos = arrays
    write = pos >= 0 if attrs.get("ignore_negative") else np.ones(pos.shape, bool)  # -1: a finished sequence
    pos = np.clip(pos, 0, cache.shape[2] - 1)  # check_update_data refused real positions outside
    out = cache.copy()
    for bi in range(cache.shape[0]):
        out[bi][:, pos[bi][write[bi]], :] = new[bi][:, write[bi]]
    return out


def _update_vjp(call: VjpCall) -> list[Tensor | None]:
    """new's gradient: the cotangent's rows at the positions written (a gather, one row a token); the
    cache state's old value takes none (the training graphs differentiate parameters, not caches)."""
    cache, new, positions = call.inputs
    if call.needs[0]:
        raise GraphBuildError(
            f"grad: {call.node.op.name} {call.node.name}: the gradient with respect to the cache state "
            f"{cache!r} has no rule; differentiate with respect to the parameters and inputs"
        )
    b, h, slots, d = cache.shape
    t = new.shape[2]
    rows = B.reshape(B.permute(call.cotangent(), (0, 2, 1, 3)), (b * slots, h * d))
    pos = B.cast(positions, "int64")
    written = B.greater_equal(pos, 0)
    first = call.graph.constant((np.arange(b, dtype=np.int64) * slots).reshape(b, 1), "int64")
    picked = B.embedding(rows, B.where(written, pos, 0) + first)  # [b, t, h * d]
    picked = B.permute(B.reshape(picked, (b, t, h, d)), (0, 2, 1, 3))
    if call.attrs.get("ignore_negative"):
        picked = B.where(B.reshape(written, (b, 1, t, 1)), picked, 0.0)
    return [None, picked, None]


def write_slots(cache: np.ndarray, new: np.ndarray, pos: np.ndarray, attrs: dict[str, Any]) -> np.ndarray:
    """The fast path's kv_cache_update: ``new`` written into ``cache`` (a state's buffer) in place,
    once check_update_data's rules hold (checked here at numpy speed; it names what is wrong)."""
    write = pos >= 0 if attrs.get("ignore_negative") else None
    bad = pos >= cache.shape[2] if write is not None else (pos < 0) | (pos >= cache.shape[2])
    slots = pos if write is None else np.where(write, pos, -1 - np.arange(pos.shape[1]))  # (distinct skips)
    repeats = pos.shape[1] > 1 and np.any(np.diff(np.sort(slots, axis=1), axis=1) == 0)
    if np.any(bad) or repeats:
        check_update_data([cache, new, pos], attrs, [None] * 3)
    if write is None:
        rows, tokens = np.divmod(np.arange(pos.size), pos.shape[1])
    else:
        rows, tokens = np.nonzero(write)
    cache[rows, :, pos[rows, tokens]] = new[rows, :, tokens]
    return cache


def _update_on_torch(node: Any) -> Any:
    """Each row's new keys copied into its state's float32 buffer where its positions are one run
    inside the cache (a prefill's); else write_slots, which checks and names what is wrong."""
    numpy_kernel = _torch.in_numpy(node, lambda arrays: [write_slots(*arrays, node.attrs)])

    def run(arrays: list[Any]) -> list[Any]:
        cache, new, pos = arrays[0], arrays[1], arrays[2].numpy()
        start, t = pos[:, :1], pos.shape[1]
        if cache.dtype != _torch.torch().float32 or not t or not (pos == start + np.arange(t)).all():
            return numpy_kernel(arrays)
        if start.min() < 0 or start.max() + t > cache.shape[2]:
            return numpy_kernel(arrays)
        for row, first in enumerate(start[:, 0].tolist()):
            cache[row, :, first : first + t].copy_(new[row])
        return [cache]

    return run


KV_CACHE_UPDATE = register(
    OpDef(
        name="kv_cache_update",
        kind="compute",
        category="attention",
        doc="Write new [batch, kv_heads, tokens, dim] into the cache state at positions "
        "[batch, tokens] along axis 2, in place; the result is the cache's next value.",
        operands=("cache", "new", "positions"),
        infer=_update_infer,
        reference=_update_ref,
        fast=Fast(
            lambda node: lambda arrays: [write_slots(*arrays, node.attrs)], checks_data=True, torch=_update_on_torch
        ),
        check_data=check_update_data,
        attrs={"ignore_negative": "bool"},
        optional_attrs=frozenset({"ignore_negative"}),
        accuracy=Accuracy(ulps=0.0),
        inplace_operand=0,
        tiling=_tilings.KV_UPDATE,
        lowering=Lowering("kv_update"),
        placement=CACHE_PLACEMENT,
        vjp=lambda call: _update_vjp(call),
    )
)


def kv_cache_update(cache: Tensor, new: Tensor, positions: Tensor, *, ignore_negative: bool = False) -> Tensor:
    """Write ``new`` into ``cache`` at ``positions`` and make the result the cache's next value.
    ``ignore_negative``: a negative position writes nothing (a finished sequence's token, say); other
    positions outside the cache are data errors all the same."""
    if require_bool(KV_CACHE_UPDATE, "ignore_negative", ignore_negative):
        return cache_update(KV_CACHE_UPDATE, cache, new, positions, ignore_negative=True)
    return cache_update(KV_CACHE_UPDATE, cache, new, positions)


def cache_update(op: OpDef, cache: Tensor, new: Tensor, positions: Tensor, **attrs: Any) -> Tensor:
    """``op`` (kv_cache_update or a variant of it) on the cache state, its result the state's next value."""
    if isinstance(cache, Tensor) and cache.node.op is sources.STATE:
        name = cache.node.attrs["name"]
        if name in cache.graph.state_updates:  # checked first, so a refused call adds no node
            raise GraphBuildError(
                f"{op.name}: state {name!r} already receives "
                f"{cache.graph.state_updates[name]!r} this iteration; a state takes one new value "
                "per iteration"
            )
    out = apply(op, [cache, new, positions], **attrs)
    cache.graph.assign(cache, out)
    return out

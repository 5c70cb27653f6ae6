"""Attention's backward, FlashAttention style: the scores are recomputed from q and k a block of keys
at a time (float32), so the [heads, queries, keys] probabilities are never stored.

``attention_grad`` is one op in three parts (attribute ``part``), each node one float32 result:

- ``rows``: each query row's log-sum-exp of its masked scores and delta = rowsum(P dP), [b, hq, tq, 2],
  one online pass over the keys (delta is dO . O, but from the float32 P, not the output rounded to
  its dtype; a row that sees no key: log-sum-exp +inf, so its probabilities are 0, delta 0);
- ``dq``: dQ = dS K [b, hq, tq, d], one pass over the keys, reading ``rows``;
- ``dkv``: dK = dS^T Q and dV = P^T dO side by side, [b, hkv, tk, d + dv], a pass over the queries of
  each block of keys (a kv head's query heads summed there: grouped-query attention), reading ``rows``.

With P = exp(S - lse) and dP = dO V^T, dS = P (dP - delta) scale (through the softcap's 1 - tanh^2).
Operands: q, k, v, the cotangent do of attention's output, then ``rows`` (the dq and dkv parts), then
attention's optional q_positions, kv_lengths and mask (``absent`` and ``masked`` as attention's).
``ml.attention_grad`` builds the three and gives dq, dk, dv rounded once to q's, k's and v's dtypes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from megaloop.dtypes import float32
from megaloop.errors import DataError, GraphBuildError, ShapeError
from megaloop.frontend.opdef import Accuracy, Fast, Lowering, OpCall, OpDef, OutSpec, first_bad, register
from megaloop.frontend.ops import _placements
from megaloop.frontend.ops._build import apply, require_bool, require_int, require_scalar
from megaloop.frontend.ops._tilings import mask_box
from megaloop.frontend.ops.attention import ATTENTION, group_heads, mask_block, masked, visible_keys
from megaloop.frontend.ops.elementwise import to_compute
from megaloop.frontend.shapes import format_shape
from megaloop.frontend.tensor import BUILDERS as B
from megaloop.frontend.tensor import Tensor
from megaloop.frontend.tiling import Box, Read, Tile, TileContext, Tiling, Write, same

PARTS = ("rows", "dq", "dkv")
ROWS, QPOS, KVLEN, MASK = 4, 5, 6, 7  # the optional operands' slots
SCORES_PER_BLOCK = 1 << 22  # float32 scores a block of keys holds at most (16 MiB)


def grad_slots(attrs: dict[str, Any]) -> dict[int, int]:
    """Where the optional operands are among a node's inputs (slot -> input index)."""
    present = [ROWS] if attrs["part"] != "rows" else []
    present += [s for s in (QPOS, KVLEN) if s not in attrs.get("absent", ())]
    present += [MASK] if attrs.get("masked") else []
    return {s: 4 + n for n, s in enumerate(present)}


def _infer(call: OpCall) -> list[OutSpec]:
    attrs, slot = call.attrs, grad_slots(call.attrs)
    q, k, v, do = call.operands[:4]
    forward = [q, k, v] + [call.operands[slot[s]] for s in (QPOS, KVLEN, MASK) if s in slot]
    fattrs = {key: attrs[key] for key in ("causal", "window", "scale", "softcap", "masked") if key in attrs}
    fattrs["absent"] = tuple(s - 2 for s in attrs.get("absent", ()))  # attention's slots 3 and 4
    spec = ATTENTION.infer(OpCall(ATTENTION, tuple(forward), fattrs, call.where))[0]
    attrs["scale"] = fattrs["scale"]
    if do.shape != spec.shape or not do.dtype.is_float:
        raise call.error(
            ShapeError, f"do must be a float cotangent of attention's {format_shape(spec.shape)}, got {do!r}"
        )
    b, hq, tq, d = q.shape
    if ROWS in slot:
        rows = call.operands[slot[ROWS]]
        if rows.shape != (b, hq, tq, 2) or rows.dtype != float32:
            raise call.error(
                ShapeError, f"rows must be the rows part's float32{format_shape((b, hq, tq, 2))}, got {rows!r}"
            )
    if attrs["part"] == "rows":
        return [OutSpec((b, hq, tq, 2), float32)]
    if attrs["part"] == "dq":
        return [OutSpec(q.shape, float32)]
    return [OutSpec((b, k.shape[1], k.shape[2], d + v.shape[3]), float32)]


def _check_data(arrays: list[np.ndarray], attrs: dict[str, Any], known: Sequence[np.ndarray | None]) -> None:
    slot = grad_slots(attrs)
    if KVLEN not in slot:
        return
    i, tk = slot[KVLEN], arrays[1].shape[2]
    where = first_bad((arrays[i] < 0) | (arrays[i] > tk), known[i])
    if where is not None:
        raise DataError(f"kv_lengths[{where[0]}] is {int(arrays[i][where])}; kv_lengths must lie in [0, {tk}]")


def _block_scores(
    qg: np.ndarray, k: np.ndarray, seen: np.ndarray, attrs: dict[str, Any], extra: np.ndarray | None, group: int
) -> tuple[np.ndarray, np.ndarray | None]:
    """The masked scores [b, hkv, group, tq, n] of query rows qg [b, hkv, group * tq, d] against keys k
    [b, hkv, n, d], and the softcap's derivative 1 - tanh^2 (None: no softcap)."""
    b, hkv, rows, _ = qg.shape
    s = np.matmul(qg, np.swapaxes(k, -1, -2)).reshape(b, hkv, group, rows // group, -1) * np.float32(attrs["scale"])
    slope = None
    cap = attrs.get("softcap")
    if cap is not None:
        turned = np.tanh(s / np.float32(cap))
        s, slope = np.float32(cap) * turned, np.float32(1) - turned * turned
    return masked(np.where(seen[:, None, None], s, np.float32(-np.inf)), extra), slope


def backward(arrays: list[np.ndarray], attrs: dict[str, Any]) -> np.ndarray:
    """The node's result from its operands (any float dtype), in float32 blocks of keys."""
    slot = grad_slots(attrs)
    q, k, v, do = (to_compute(a).astype(np.float32, copy=False) for a in arrays[:4])
    b, hq, tq, d = q.shape
    hkv, tk, dv = k.shape[1], k.shape[2], v.shape[3]
    group = hq // hkv
    qpos, lengths = (arrays[slot[s]] if s in slot else None for s in (QPOS, KVLEN))
    seen = visible_keys(b, tq, tk, attrs, qpos, lengths)
    extra = group_heads(arrays[slot[MASK]], hkv) if MASK in slot else None
    qg, dog = q.reshape(b, hkv, group * tq, d), do.reshape(b, hkv, group * tq, dv)
    step = max(1, min(tk, SCORES_PER_BLOCK // max(1, b * hq * tq)))
    blocks = [(lo, min(tk, lo + step)) for lo in range(0, tk, step) if seen[:, :, lo : lo + step].any()]

    def scores(lo: int, hi: int) -> tuple[np.ndarray, np.ndarray | None]:
        part = mask_block(extra, slice(None), slice(lo, hi))
        return _block_scores(qg, k[:, :, lo:hi], seen[:, :, lo:hi], attrs, part, group)

    if attrs["part"] == "rows":
        top = np.full((b, hkv, group, tq, 1), -np.inf, np.float32)
        total, dots = np.zeros_like(top), np.zeros_like(top)
        for lo, hi in blocks:  # the online softmax's max, sum and sum of p dP over the blocks
            s = scores(lo, hi)[0]
            new = np.maximum(top, np.max(s, axis=-1, keepdims=True))
            base = np.where(np.isfinite(new), new, np.float32(0))
            p, shrink = np.exp(s - base), np.exp(top - base)
            dp = np.matmul(dog, np.swapaxes(v[:, :, lo:hi], -1, -2)).reshape(p.shape)
            total = total * shrink + np.sum(p, axis=-1, keepdims=True)
            dots = dots * shrink + np.sum(p * dp, axis=-1, keepdims=True)
            top = new
        some = total > 0
        lse = np.where(some, top + np.log(np.where(some, total, 1)), np.float32(np.inf))
        delta = np.where(some, dots / np.where(some, total, 1), np.float32(0))
        return np.concatenate([lse, delta], axis=-1).reshape(b, hq, tq, 2).astype(np.float32)
    rows = arrays[slot[ROWS]].astype(np.float32, copy=False).reshape(b, hkv, group, tq, 2)
    lse, delta = rows[..., :1], rows[..., 1:]
    out = np.zeros((b, hkv, group * tq, d) if attrs["part"] == "dq" else (b, hkv, tk, d + dv), np.float32)
    for lo, hi in blocks:
        s, slope = scores(lo, hi)
        p = np.exp(s - lse)
        dp = np.matmul(dog, np.swapaxes(v[:, :, lo:hi], -1, -2)).reshape(p.shape)
        ds = p * (dp - delta) * (slope if slope is not None else np.float32(1)) * np.float32(attrs["scale"])
        ds = ds.reshape(b, hkv, group * tq, hi - lo)
        if attrs["part"] == "dq":
            out += np.matmul(ds, k[:, :, lo:hi])
        else:
            out[:, :, lo:hi, :d] = np.matmul(np.swapaxes(ds, -1, -2), qg)
            out[:, :, lo:hi, d:] = np.matmul(np.swapaxes(p.reshape(ds.shape), -1, -2), dog)
    return out.reshape(b, hq, tq, d) if attrs["part"] == "dq" else out


def _tiles(node: Any, params: dict[str, int], ctx: TileContext) -> list[Tile]:
    """rows and dq: a block of queries of the query heads of one kv head, over every key; dkv: a block
    of keys of one kv head, over every query of its query heads."""
    attrs, slot = node.attrs, grad_slots(node.attrs)
    q, k, v = node.inputs[:3]
    b, hq, tq, d = q.shape
    hkv, tk, dv = k.shape[1], k.shape[2], v.shape[3]
    group, width = hq // hkv, node.outputs[0].shape[3]
    by_keys = attrs["part"] == "dkv"
    n, block = (tk, params["block"]) if by_keys else (tq, params["block"])
    tiles = []
    for bi in range(b):
        for h in range(hkv):
            h0, h1 = h * group, (h + 1) * group
            for s in range(0, n, block):
                e = min(n, s + block)
                q0, q1, k0, k1 = (0, tq, s, e) if by_keys else (s, e, 0, tk)
                qbox = Box((bi, h0, q0, 0), (bi + 1, h1, q1, d))
                reads = [Read(0, qbox), Read(1, Box((bi, h, k0, 0), (bi + 1, h + 1, k1, d)))]
                reads.append(Read(2, Box((bi, h, k0, 0), (bi + 1, h + 1, k1, dv))))
                reads.append(Read(3, Box((bi, h0, q0, 0), (bi + 1, h1, q1, dv))))
                if ROWS in slot:
                    reads.append(Read(slot[ROWS], Box((bi, h0, q0, 0), (bi + 1, h1, q1, 2))))
                if QPOS in slot:
                    reads.append(Read(slot[QPOS], Box((bi, q0), (bi + 1, q1))))
                if KVLEN in slot:
                    reads.append(Read(slot[KVLEN], Box((bi,), (bi + 1,))))
                if MASK in slot:
                    reads.append(Read(slot[MASK], mask_box(node.inputs[slot[MASK]], bi, h0, h1, q0, q1, k0, k1)))
                out = (
                    Box((bi, h, s, 0), (bi + 1, h + 1, e, width))
                    if by_keys
                    else Box((bi, h0, s, 0), (bi + 1, h1, e, width))
                )
                passes = {"rows": d + dv, "dq": 2 * d + dv, "dkv": 2 * d + 2 * dv}[attrs["part"]]
                tiles.append(
                    Tile(
                        (bi, h, s // block), tuple(reads), (Write(0, out),), 2 * group * (q1 - q0) * (k1 - k0) * passes
                    )
                )
    return tiles


TILING = Tiling(
    {"block": same(64)},
    _tiles,
    "rows, dq: a block of queries of a kv head's query heads; dkv: a block of keys of a kv head",
)


def _dims(node: Any) -> list[_placements.Dim]:
    """By sequences, or by kv heads (with their query heads): every operand and the result alike."""
    slot, out = grad_slots(node.attrs), _placements.OUT
    q, k = node.inputs[:2]
    group = q.shape[1] // k.shape[1]
    per_query = [(i, 1, group) for i in (0, 3)] + ([(slot[ROWS], 1, group)] if ROWS in slot else [])
    seqs = [(i, 0, 1) for i in range(4)] + [(slot[s], 0, 1) for s in (ROWS, QPOS, KVLEN) if s in slot]
    heads = per_query + [(1, 1, 1), (2, 1, 1)]
    if MASK in slot:
        mask = node.inputs[slot[MASK]]
        lead = 4 - mask.ndim
        for a, size in enumerate(mask.shape):
            if size > 1 and a + lead == 0:
                seqs.append((slot[MASK], a, 1))
            if size > 1 and a + lead == 1:
                heads.append((slot[MASK], a, group))
    ours = group if node.attrs["part"] != "dkv" else 1
    return [
        _placements.Dim(q.shape[0], (*seqs, (out, 0, 1)), label="by sequences"),
        _placements.Dim(k.shape[1], (*heads, (out, 1, ours)), label="by heads"),
    ]


ATTENTION_GRAD = register(
    OpDef(
        name="attention_grad",
        kind="compute",
        category="attention",
        doc="attention's backward in three parts (rows: log-sum-exp and rowsum(dO O); dq; dk and dv), the "
        "scores recomputed a block of keys at a time in float32; see megaloop.frontend.ops.attention_grad.",
        operands=("q", "k", "v", "do", "rows", "q_positions", "kv_lengths", "mask"),
        attrs={
            "part": PARTS,
            "causal": "bool",
            "window": "count?",
            "scale": "number?",
            "absent": "ints",
            "softcap": "number?",
            "masked": "bool",
        },
        optional_attrs=frozenset({"absent", "softcap", "masked"}),
        infer=_infer,
        reference=backward,
        fast=Fast(lambda node: lambda arrays: [backward(arrays, node.attrs)]),
        check_data=_check_data,
        accuracy=Accuracy(ulps=4.0, per_reduction=True),
        tiling=TILING,
        lowering=Lowering("attention_grad"),
        placement=_placements.rule(_dims),
    )
)


def attention_grad(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    do: Tensor,
    *,
    causal: bool = False,
    q_positions: Tensor | None = None,
    kv_lengths: Tensor | None = None,
    window: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    mask: Tensor | None = None,
    wrt: str = "qkv",
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """dq, dk, dv of ``attention(q, k, v, ...)`` (the same keywords) for the cotangent ``do`` of its
    output: float32 sums rounded once to q's, k's and v's dtypes. A float mask's own gradient
    is not given (attention's rule then takes its plain-op form). ``wrt``: which of "q", "k", "v" to
    build (the others None; dq and the dk/dv pair are separate parts)."""
    op = ATTENTION_GRAD
    if not isinstance(wrt, str) or not wrt or set(wrt) - set("qkv"):
        raise GraphBuildError(f"attention_grad: wrt must name some of q, k and v (as 'qkv' or 'kv'), got {wrt!r}")
    attrs: dict[str, Any] = {"causal": require_bool(op, "causal", causal), "window": None, "scale": None}
    if window is not None:
        attrs["window"] = require_int(op, "window", window, minimum=1)
    if scale is not None:
        attrs["scale"] = float(require_scalar(op, "scale", scale))
    if softcap is not None:
        attrs["softcap"] = float(require_scalar(op, "softcap", softcap))
    extra = [t for t in (q_positions, kv_lengths) if t is not None]
    absent = tuple(s for s, t in ((QPOS, q_positions), (KVLEN, kv_lengths)) if t is None)
    if absent:
        attrs["absent"] = absent
    if mask is not None:
        attrs["masked"] = True
        extra.append(mask)
    rows = apply(op, [q, k, v, do, *extra], part="rows", **attrs)
    dq = B.cast(apply(op, [q, k, v, do, rows, *extra], part="dq", **attrs), q.dtype) if "q" in wrt else None
    if not set(wrt) & {"k", "v"}:
        return dq, None, None
    dkv = apply(op, [q, k, v, do, rows, *extra], part="dkv", **attrs)
    d = q.shape[3]
    dk = B.cast(B.slice_(dkv, (None, None, None, 0), (None, None, None, d)), k.dtype) if "k" in wrt else None
    dv = B.cast(B.slice_(dkv, (None, None, None, d), (None, None, None, None)), v.dtype) if "v" in wrt else None
    return dq, dk, dv

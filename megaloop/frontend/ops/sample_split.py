"""``sample`` split over tiles, for rows of few tokens over a long vocabulary (a language model's next
token): the same tokens, bit for bit, with the per-logit work (weights, the first selection) spread over
one tile per range of the vocabulary instead of one tile per row. ``ml.sample(..., splits=S)`` builds
three ops:

1. ``argmax_partial`` (megaloop.frontend.ops.argmax_split) over S ranges of ``chunk`` logits: each
   range's first largest. From those, every later tile knows the row's largest logit (and argmax).
2. ``sample_partial``: per range, from x, those indices and the temperature: the range's total weight
   W_r, and its *candidates*: the elements whose key exceeds the (L+1)-th largest key of the range
   (L = ``candidates``), at most L of them, in index order, with their keys and weights; B_r, that
   (L+1)-th largest key (0 where the range has at most L elements: all are candidates). int64
   [..., S, 2 + 2L]: W_r, B_r + 2^32 * count, then (key * 2^32 + index, weight) per slot, zeros after
   the last (and everywhere in a greedy row: nothing to draw).
3. ``sample_combine``: per row, every element with a key above B = max_r B_r is a candidate, so a
   threshold above B is exact from the candidates alone: top-k's k-th largest key among them when at
   least k exceed B, top-p's boundary when the candidates above top-k's reach the target and the
   boundary exceeds B; min-p's where the bound's own weight (every element at or below B weighs at
   most that: weights grow with the logits) is below min-p's. The draw then runs over the kept
   candidates in index order (or, with no threshold, over the ranges' totals, then within the range it
   lands in). Where a threshold is not above B, the tile computes the row whole, as ``sample``'s own
   tile does.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from megaloop import dtypes
from megaloop.errors import DtypeError, GraphBuildError, ShapeError
from megaloop.frontend.opdef import Accuracy, Lowering, OpCall, OpDef, OutSpec, register
from megaloop.frontend.ops import _placements
from megaloop.frontend.ops._build import apply, require_tensor
from megaloop.frontend.ops._fast import VALUES_ONLY
from megaloop.frontend.ops._sampling import (
    FLT_MIN,
    LOG2E,
    TOP_P_BITS,
    key_values,
    min_p_weight,
    mulhi64,
    order_keys,
    sample_rows,
    top_p_target,
    top_p_units,
    uniform64,
    weights,
)
from megaloop.frontend.ops.argmax_split import ARGMAX_PARTIAL, split_ranges
from megaloop.frontend.ops.elementwise import to_compute
from megaloop.frontend.ops.sample import (
    FLOPS_PER_LOGIT,
    PARAMS,
    SAMPLE,
    check_params,
    param_tensor,
    params_data,
    row_dims,
    row_params,
    rows_of,
)
from megaloop.frontend.shapes import format_shape
from megaloop.frontend.tensor import Tensor
from megaloop.frontend.tiling import Box, Read, Tile, TileContext, Tiling, Write, chunks, project

CANDIDATES = 32  # L: candidates a range keeps, at most
MAX_CANDIDATES = 4096  # in the combine's shared memory (64 KB), all ranges together


def candidates_for(ranges: int) -> int:
    """L for ``ranges`` ranges: CANDIDATES, fewer where they would not fit the combine together."""
    return max(1, min(CANDIDATES, MAX_CANDIDATES // ranges))


U32 = np.uint64(0xFFFFFFFF)


def _check_split(call: OpCall, n: int) -> tuple[int, int, int]:
    splits, chunk, cand = call.attrs["splits"], call.attrs["chunk"], call.attrs["candidates"]
    if not (chunk >= 1 and splits >= 2 and (splits - 1) * chunk < n <= splits * chunk and 1 <= cand <= 64):
        raise call.error(
            ShapeError,
            f"{splits} ranges of {chunk} logits (with {cand} candidates each) do not split the {n} logits of a row "
            "with every range non-empty",
            hint="build the ops with ml.sample(..., splits=...)",
        )
    return splits, chunk, cand


def _check_partial(call: OpCall, index: int, rows: tuple[int, ...], splits: int) -> None:
    partial = call.operands[index]
    if partial.dtype != dtypes.int64 or partial.shape != (*rows, splits):
        raise call.error(
            DtypeError if partial.dtype != dtypes.int64 else ShapeError,
            f"partial must be argmax_partial's int64 [{', '.join(map(str, (*rows, splits)))}] over the same ranges, "
            f"got {partial.dtype.name}{format_shape(partial.shape)}",
        )


def _partial_infer(call: OpCall) -> list[OutSpec]:
    rows = rows_of(call)
    splits, _, cand = _check_split(call, call.shape(0)[-1])
    _check_partial(call, 1, rows, splits)
    t = call.operands[2]
    if t.dtype != dtypes.float32 or np.broadcast_shapes(t.shape, rows) != rows:
        raise call.error(ShapeError, f"temperature must be float32 broadcasting to the rows {format_shape(rows)}")
    return [OutSpec((*rows, splits, 2 + 2 * cand), dtypes.int64)]


def row_maxima(x: np.ndarray, partial: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's largest logit and argmax from argmax_partial's indices (argmax_combine's rule: the first
    largest range, NaN first), for float32 x [rows, n] and indices [rows, splits]."""
    at = np.clip(partial.astype(np.int64), 0, x.shape[1] - 1)  # (poison, in the plan interpreter)
    values = np.take_along_axis(x, at, axis=1)
    best = np.argmax(values, axis=1)
    first = at[np.arange(x.shape[0]), best]
    return x[np.arange(x.shape[0]), first], first


def _drawing(m: np.ndarray, temperature: np.ndarray) -> np.ndarray:
    """Rows that draw (not greedy; parameters valid or, without data checks, made so)."""
    t = temperature.astype(np.float32)
    return np.isfinite(m) & (t >= FLT_MIN) & np.isfinite(t)


def _partial_reference(arrays: list[np.ndarray], attrs: dict[str, Any]) -> np.ndarray:
    logits, partial, temperature = arrays
    rows, n = logits.shape[:-1], logits.shape[-1]
    splits, chunk, cand = attrs["splits"], attrs["chunk"], attrs["candidates"]
    x = to_compute(logits).astype(np.float32).reshape(-1, n)
    t = np.broadcast_to(temperature, rows).reshape(-1).astype(np.float32)
    m, _ = row_maxima(x, partial.reshape(-1, splits))
    out = np.zeros((x.shape[0], splits, 2 + 2 * cand), np.int64)
    for row in np.flatnonzero(_drawing(m, t)):
        pad = splits * chunk - n
        keys = np.pad(order_keys(x[row]), (0, pad)).reshape(splits, chunk).astype(np.uint64)
        one = slice(row, row + 1)
        w = np.pad(weights(x[one], m[one], LOG2E / t[one])[0], (0, pad)).reshape(splits, chunk)
        count = np.minimum(chunk, n - np.arange(splits) * chunk)
        kth = np.sort(keys, axis=-1)[:, chunk - cand - 1] if chunk > cand else np.zeros(splits, np.uint64)
        bound = np.where(count > cand, kth, np.uint64(0))
        picked = keys > bound[:, None]  # at most cand of them; the padding's key 0 never
        slots = np.argsort(~picked, axis=-1, kind="stable")[:, :cand]  # the candidates first, in index order
        taken = np.take_along_axis(picked, slots, -1)
        index = (slots + (np.arange(splits) * chunk)[:, None]).astype(np.uint64)
        pairs = np.where(taken, (np.take_along_axis(keys, slots, -1) << np.uint64(32)) | index, np.uint64(0))
        out[row, :, 0] = w.sum(-1, dtype=np.uint64).view(np.int64)
        out[row, :, 1] = (bound | (picked.sum(-1).astype(np.uint64) << np.uint64(32))).view(np.int64)
        held = slots.shape[1]  # (ranges shorter than cand hold fewer slots; the rest stay 0)
        out[row, :, 2 : 2 + 2 * held : 2] = pairs.view(np.int64)
        kept = np.where(taken, np.take_along_axis(w, slots, -1), np.uint64(0))
        out[row, :, 3 : 3 + 2 * held : 2] = kept.view(np.int64)
    return out.reshape(*rows, splits, 2 + 2 * cand)


def _partial_tiles(node: Any, params: dict[str, int], ctx: TileContext) -> list[Tile]:
    """argmax_partial's: the ranges spread over one round of the processors, each tile a few of them."""
    x, partial, temperature = node.inputs
    rows, n = x.shape[:-1], x.shape[-1]
    out = node.outputs[0]
    chunk = node.attrs["chunk"]
    ranges = out.shape[:-1]
    tiles = []
    for i, box in enumerate(chunks(ranges, max(1, -(-math.prod(ranges) // ctx.processors)))):
        row_lo, row_hi = box.lo[:-1], box.hi[:-1]
        mine = math.prod(h - lo for lo, h in zip(row_lo, row_hi)) * (min(n, box.hi[-1] * chunk) - box.lo[-1] * chunk)
        # x's whole rows are declared (the rows' largest logits are read where argmax_partial found them;
        # they wait for every range's argmax anyway), its ranges' logits are what it moves
        xbox = Box((*row_lo, 0), (*row_hi, n))
        pbox = Box((*row_lo, 0), (*row_hi, partial.shape[-1]))
        tbox = project(Box(row_lo, row_hi), rows, temperature.shape)
        obox = Box((*box.lo, 0), (*box.hi, out.shape[-1]))
        reads = (Read(0, xbox), Read(1, pbox), Read(2, tbox))
        moved = mine * x.dtype.itemsize + pbox.size * 16 + obox.size * 8
        tiles.append(Tile((i,), reads, (Write(0, obox),), flops=FLOPS_PER_LOGIT * mine, moved=moved))
    return tiles


SAMPLE_PARTIAL = register(
    OpDef(
        name="sample_partial",
        kind="compute",
        category="sampling",
        doc="per range of a row of logits: its total weight and its candidates for sample's thresholds; see "
        "megaloop.frontend.ops.sample_split.",
        operands=("logits", "partial", "temperature"),
        infer=_partial_infer,
        reference=_partial_reference,
        fast=VALUES_ONLY,
        attrs={"splits": "int", "chunk": "int", "candidates": "int"},
        accuracy=Accuracy(ulps=0.0),
        placement=_placements.rule(lambda node: row_dims(node, (0, 1), (2,))),
        tiling=Tiling({}, _partial_tiles, "one round of tasks over the processors, each a few ranges"),
        lowering=Lowering("sample_partial"),
    )
)


def _combine_infer(call: OpCall) -> list[OutSpec]:
    rows = rows_of(call)
    splits, _, cand = _check_split(call, call.shape(0)[-1])
    _check_partial(call, 1, rows, splits)
    summary = call.operands[2]
    if summary.dtype != dtypes.int64 or summary.shape != (*rows, splits, 2 + 2 * cand):
        got = f"{summary.dtype.name}{format_shape(summary.shape)}"
        raise call.error(ShapeError, f"summary must be sample_partial's int64 output for these ranges, got {got}")
    check_params(call, rows, first=3)
    return [OutSpec(rows, dtypes.int64)]


def _draw(seed: int, offset: int, total: int) -> int:
    """The definition's r for a kept weight of ``total``."""
    return int(mulhi64(uniform64(np.array([seed]), np.array([offset])), np.uint64(total))[0])


def combine_row(
    x: np.ndarray,
    m: float,
    summary: np.ndarray,
    chunk: int,
    seed: int,
    offset: int,
    t: float,
    top_k: int,
    top_p: float,
    min_p: float,
) -> int | None:
    """One drawing row's token from its summary [splits, 2 + 2L], or None where a threshold is not
    above every range's bound (the caller computes the row whole)."""
    n = x.shape[0]
    u = summary.view(np.uint64)
    totals, bound = u[:, 0], int((u[:, 1] & U32).max())
    count = (u[:, 1] >> np.uint64(32)).astype(np.int64)
    slot = np.arange(u.shape[1] // 2 - 1)[None, :] < count[:, None]
    keys, index = (u[:, 2::2] >> np.uint64(32))[slot], (u[:, 2::2] & U32)[slot].astype(np.int64)
    w = u[:, 3::2][slot]  # candidates in index order (ranges in order, each in index order)
    floor = 0  # kept: keys >= floor
    if 1 <= top_k < n:
        if keys.size < top_k:
            return None
        floor = int(np.sort(keys)[keys.size - top_k])
        if floor <= bound:
            return None
    p24 = int(top_p_units(np.float32(top_p)))
    if p24 < 1 << TOP_P_BITS:
        in_k = keys >= floor
        mass_k = int(w[in_k].sum(dtype=np.uint64)) if floor else int(totals.sum(dtype=np.uint64))
        target = int(top_p_target(np.uint64(mass_k), np.uint64(p24)))
        order = np.argsort(keys, kind="stable")[::-1]
        cum = np.cumsum(np.where(in_k, w, np.uint64(0))[order], dtype=np.uint64)
        if not cum.size or int(cum[-1]) < target:
            return None
        floor = max(floor, int(keys[order][int(np.argmax(cum >= np.uint64(target)))]))
        if floor <= bound:
            return None
    c = LOG2E / np.float32(t)
    min_w = int(min_p_weight(np.float32(min_p)))
    if not floor and min_w and bound:  # min-p alone: settled if nothing at or below the bound weighs enough
        at_bound = weights(key_values(np.array([[bound]], np.uint32)), np.array([m], np.float32), np.array([c]))
        if int(at_bound[0, 0]) >= min_w:
            return None
    if not floor and not min_w:  # no threshold: the ranges' totals, then the range the draw lands in, whole
        r = _draw(seed, offset, int(totals.sum(dtype=np.uint64)))
        running = np.cumsum(totals, dtype=np.uint64)
        rng = int(np.argmax(running > np.uint64(r)))
        lo, hi = rng * chunk, min(n, (rng + 1) * chunk)
        wr = weights(x[None, lo:hi], np.array([m], np.float32), np.array([c], np.float32))[0]
        before = int(running[rng] - totals[rng])
        return lo + int(np.argmax(np.cumsum(wr, dtype=np.uint64) > np.uint64(r - before)))
    kept = np.where((keys >= floor) & (w >= np.uint64(min_w)), w, np.uint64(0))
    r = _draw(seed, offset, int(kept.sum(dtype=np.uint64)))
    return int(index[int(np.argmax(np.cumsum(kept, dtype=np.uint64) > np.uint64(r)))])


def _combine_reference(arrays: list[np.ndarray], attrs: dict[str, Any]) -> np.ndarray:
    logits, partial, summary = arrays[:3]
    rows, n = logits.shape[:-1], logits.shape[-1]
    splits = attrs["splits"]
    x = to_compute(logits).astype(np.float32).reshape(-1, n)
    seed, offset, t, k, p, q = row_params(arrays[3:], rows)
    m, first = row_maxima(x, partial.reshape(-1, splits))
    out = first.astype(np.int64)
    summary = summary.reshape(x.shape[0], splits, -1)
    for row in np.flatnonzero(_drawing(m, t)):
        one = slice(row, row + 1)
        args = (seed[row], offset[row], t[row], k[row], p[row], q[row])
        token = combine_row(x[row], m[row], summary[row], attrs["chunk"], *args)
        if token is None:  # a threshold not above the candidates' bound: the row whole
            token = int(sample_rows(x[one], seed[one], offset[one], t[one], k[one], p[one], q[one])[0])
        out[row] = token
    return out.reshape(rows)


def _combine_tiles(node: Any, params: dict[str, int], ctx: TileContext) -> list[Tile]:
    """A row a tile (a few where rows outnumber the processors), reading its row of everything."""
    x, partial, summary = node.inputs[:3]
    rows, n = x.shape[:-1], x.shape[-1]
    per = max(1, -(-math.prod(rows) // ctx.processors))
    tiles = []
    for i, box in enumerate(chunks(rows, per)):
        reads = [
            Read(0, Box((*box.lo, 0), (*box.hi, n))),
            Read(1, Box((*box.lo, 0), (*box.hi, partial.shape[-1]))),
            Read(2, Box((*box.lo, 0, 0), (*box.hi, *summary.shape[-2:]))),
        ]
        reads += [Read(k, project(box, rows, t.shape)) for k, t in enumerate(node.inputs) if k >= 3]
        flops = box.size * summary.shape[-2] * summary.shape[-1] * 8
        tiles.append(Tile((i,), tuple(reads), (Write(0, box),), flops=flops))
    return tiles


SAMPLE_COMBINE = register(
    OpDef(
        name="sample_combine",
        kind="compute",
        category="sampling",
        doc="sample's token from argmax_partial's indices and sample_partial's candidates (the row whole where "
        "they do not settle a threshold); see megaloop.frontend.ops.sample_split.",
        operands=("logits", "partial", "summary", *(name for name, _ in PARAMS)),
        infer=_combine_infer,
        reference=_combine_reference,
        fast=VALUES_ONLY,
        check_data=params_data(3, "sample_combine"),
        attrs={"splits": "int", "chunk": "int", "candidates": "int"},
        accuracy=Accuracy(ulps=0.0),
        placement=_placements.rule(lambda node: row_dims(node, (0, 1, 2), tuple(range(3, 3 + len(PARAMS))))),
        tiling=Tiling({}, _combine_tiles, "a row a tile, reading the row's candidates (and logits, when needed)"),
        lowering=Lowering("sample_combine"),
    )
)


def split_sample(logits: Tensor, params: list[Tensor], splits: int) -> Tensor:
    """argmax_partial, sample_partial and sample_combine for ``ml.sample(..., splits=)``, or the plain op
    where the row is one range."""
    n = logits.shape[-1] if logits.ndim else 1
    ranges, chunk = split_ranges(n, splits)
    if ranges < 2 or logits.ndim < 1:
        return apply(SAMPLE, [logits, *params])
    if ranges > MAX_CANDIDATES:
        raise GraphBuildError(
            f"sample: {ranges} ranges of {chunk} logits; the combine takes at most {MAX_CANDIDATES} (fewer splits)"
        )
    axis = logits.ndim - 1
    partial = apply(ARGMAX_PARTIAL, [logits], axis=axis, splits=ranges, chunk=chunk)
    attrs = {"splits": ranges, "chunk": chunk, "candidates": candidates_for(ranges)}
    summary = apply(SAMPLE_PARTIAL, [logits, partial, params[2]], **attrs)
    return apply(SAMPLE_COMBINE, [logits, partial, summary, *params], **attrs)


def check_splits(splits: Any) -> int | None:
    if splits is None:
        return None
    if isinstance(splits, bool) or not isinstance(splits, (int, np.integer)) or splits < 1:
        raise GraphBuildError(f"sample: splits must be an int >= 1 or None, got {splits!r}")
    return int(splits)


def sample_partial(logits: Tensor, temperature: Tensor, *, splits: int) -> Tensor:
    """argmax_partial then sample_partial of ``logits``: the ranges' summaries on their own (tests, and
    graphs that combine them themselves)."""
    n = logits.shape[-1] if logits.ndim else 1
    ranges, chunk = split_ranges(n, splits)
    partial = apply(ARGMAX_PARTIAL, [logits], axis=logits.ndim - 1, splits=ranges, chunk=chunk)
    attrs = {"splits": ranges, "chunk": chunk, "candidates": candidates_for(ranges)}
    return apply(SAMPLE_PARTIAL, [logits, partial, temperature], **attrs)


def sample_combine(
    logits: Tensor,
    summary: Tensor,
    seed: Tensor,
    offset: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    min_p: Tensor | float = 0.0,
) -> Tensor:
    """The tokens of ``logits`` from ``summary``, sample_partial's output for the same logits (the second
    half on its own: tests, and graphs that make the summaries themselves)."""
    node = summary.node
    if node.op is not SAMPLE_PARTIAL or node.inputs[0] is not logits:
        raise GraphBuildError(f"sample_combine: summary must be sample_partial's output for {logits!r}")
    attrs = {k: node.attrs[k] for k in ("splits", "chunk", "candidates")}
    min_p = param_tensor(SAMPLE_COMBINE, logits, "min_p", "float32", min_p)
    params = [seed, offset, temperature, top_k, top_p, min_p]
    return apply(SAMPLE_COMBINE, [logits, node.inputs[1], summary, *params], **attrs)


def sample(
    logits: Tensor,
    seed: Tensor | int,
    offset: Tensor | int,
    temperature: Tensor | float = 1.0,
    top_k: Tensor | int = 0,
    top_p: Tensor | float = 1.0,
    min_p: Tensor | float = 0.0,
    *,
    splits: int | None = None,
) -> Tensor:
    """A token id drawn from each row of ``logits`` [..., n]: int64 [...]. Each parameter is a tensor of
    the rows' shape (or broadcastable to it) or a Python number: seed, offset (int64; the same seed,
    offset and logits give the same token), temperature (float32; 0: the argmax), top_k (int64; 0:
    off), top_p (float32; 1: off), min_p (float32; 0: off: tokens less likely than min_p times the
    likeliest are dropped). The exact definition: megaloop.frontend.ops.sample. ``splits``: the
    rows' logits in that many ranges (at most; whole 16-byte packs each), a tile each, then a tile a
    row (this module's ops): the same tokens, for few rows of a long vocabulary."""
    require_tensor(SAMPLE, "logits", logits)
    splits = check_splits(splits)
    values = (seed, offset, temperature, top_k, top_p, min_p)
    params = [param_tensor(SAMPLE, logits, name, dt, v) for (name, dt), v in zip(PARAMS, values)]
    if splits is None or splits == 1:
        return apply(SAMPLE, [logits, *params])
    return split_sample(logits, params, splits)

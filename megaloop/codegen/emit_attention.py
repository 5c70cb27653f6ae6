"""C++ for the attention tiles (megaloop/attention.cuh): one call of ``ml::attention``,
``ml::attention_partial`` or ``ml::attention_combine`` a tile function, with the op's shapes and mask
(``ml::AttnShape``), the operands' strides and the paths chosen here as template arguments: tensor
cores (FlashAttention-2 style) for blocks of 16 queries or more of 16-bit heads, split keys
(flash-decoding inside one tile) for packed, aligned heads (decode), and a warp per (head, query) with
an online softmax for the rest. Part of megaloop/codegen/emit.py."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from megaloop.codegen.emit import Operand, float_literal, pointers, rope_frequencies
from megaloop.frontend.ops._tilings import MASK, attention_slots


def at(o: Operand | None, pointer: str) -> str:
    """``ml::at<strides...>(pointer)`` (megaloop/elementwise.cuh), ``ml::Absent{}`` for no operand."""
    return f"ml::at<{', '.join(str(st) for st in o.strides)}>({pointer})" if o is not None else "ml::Absent{}"


def _mask(attrs: dict[str, Any], ins: list[Operand]) -> str:
    """The mask operand (or Absent) with its strides in the scores' [batch, heads, queries, keys] index
    space: 0 along the axes it broadcasts."""
    slot = attention_slots(attrs)
    if MASK not in slot:
        return at(None, "")
    return mask_at(ins[slot[MASK]], f"in{slot[MASK]}")


def mask_at(mask: Operand, pointer: str) -> str:
    """A mask operand's ``ml::at`` in the scores' [batch, heads, queries, keys] index space."""
    lead = 4 - len(mask.shape)
    strides = (0,) * lead + tuple(0 if n == 1 else st for n, st in zip(mask.shape, mask.strides))
    return at(Operand(mask.dtype, (1,) * lead + mask.shape, strides), pointer)


def _operands(attrs: dict[str, Any], ins: list[Operand], out: Operand) -> str:
    """The call's operands: out, q, k, v, then the query positions and key lengths (or Absent), the
    mask (or Absent), then for attention_partial's append form ``ml::attn_append<rotary_dim,
    neox>(inv_freq, k_new, v_new)``."""
    slot = attention_slots(attrs)
    extra = [at(ins[slot[s]], f"in{slot[s]}") if s in slot else at(None, "") for s in (3, 4)]
    extra.append(_mask(attrs, ins))
    if 5 in slot:
        new = ", ".join(at(ins[slot[s]], f"in{slot[s]}") for s in (5, 6))
        neox = "true" if attrs["layout"] == "neox" else "false"
        extra.append(f"ml::attn_append<{attrs['rotary_dim']}, {neox}>(inv_freq, {new})")
    return ", ".join([at(out, "out0")] + [at(ins[n], f"in{n}") for n in range(3)] + extra)


def attn_shape(attrs: dict[str, Any], ins: list[Operand]) -> str:
    """``ml::AttnShape<group, tq, tk, d, dv, causal, window[, softcap]>`` (window 0: none; the softcap
    as the bits of its float32, after a comment giving its value)."""
    q, k, v = ins[:3]
    causal = bool(attrs["causal"])
    window = attrs.get("window") if causal else None
    dims = (q.shape[1] // k.shape[1], q.shape[2], k.shape[2], q.shape[3], v.shape[3])
    cap = attrs.get("softcap")
    bits = f", /* softcap {cap:g} */ {float32_bits(cap)}u" if cap is not None else ""
    return f"ml::AttnShape<{', '.join(map(str, dims))}, {'true' if causal else 'false'}, {window or 0}{bits}>"


def float32_bits(value: float) -> int:
    """The bits of ``value`` rounded to float32, as an unsigned int."""
    return int(np.array(value, np.float32).view(np.uint32))


def attention(op: str, attrs: dict[str, Any], ins: list[Operand], out: Operand) -> list[str]:
    """A tile of (query head, query) rows: on tensor cores where ``_mma_applies`` (attention_mma's
    SPLIT from ``attention_mma_split``), else split keys where ``_split_applies``, else (and where the
    pointers are not 16-byte aligned) a warp a row (see megaloop/frontend/ops/attention.py for the mask)."""
    mma = attention_mma_split(attrs, ins) if _mma_applies(attrs, ins) else 0
    split = _split_applies(ins)
    lanes = decode_lanes(attrs, ins) if not mma else None
    scale, scale_log2 = float_literal(attrs["scale"]), float_literal(attrs["scale"] * math.log2(math.e))
    paths = ([f"tensor cores ({mma} warp(s) a unit of 16 queries)"] if mma else []) + (["split keys"] if split else [])
    return [
        *pointers(ins + [out], len(ins)),
        f"// {', then '.join(_lanes_path(lanes) + paths + ['a warp per (head, query)'])}",
        f"ml::attention<{attn_shape(attrs, ins)}, {mma}, {'true' if split else 'false'}{lanes_arg(lanes)}>(a, t, tid, "
        f"{scale}, {scale_log2}, {_operands(attrs, ins, out)});",
    ]


def attention_partial(op: str, attrs: dict[str, Any], ins: list[Operand], out: Operand) -> list[str]:
    """The same rows over one key range (the tile's split, ceil(tk / splits) keys): the unnormalised
    output, then m and l, as float32 (megaloop/frontend/ops/attention_split.py)."""
    chunk = -(-ins[1].shape[2] // attrs["splits"])
    split = _split_applies(ins) and _append_packs(attrs, ins)
    lanes = decode_lanes(attrs, ins)
    paths = _lanes_path(lanes) + (["split keys"] if split else []) + ["a warp per (head, query)"]
    append = "theta" in attrs
    return [
        *([rope_frequencies(attrs)] if append else []),
        *pointers(ins + [out], len(ins)),
        *(
            ["// append form: q rotated on load, the key at its position rope(k_new), its value v_new"]
            if append
            else []
        ),
        f"// key ranges of {chunk}: {', then '.join(paths)}",
        f"ml::attention_partial<{attn_shape(attrs, ins)}, {chunk}, {'true' if split else 'false'}{lanes_arg(lanes)}>("
        f"a, t, tid, {float_literal(attrs['scale'])}, {_operands(attrs, ins, out)});",
    ]


COMBINE_HELD_SPLITS = 16  # key ranges whose m, l and weight attention_combine keeps in registers


def attention_combine(op: str, attrs: dict[str, Any], ins: list[Operand], out: Operand) -> list[str]:
    """A warp per (batch, head, query): the largest m over the key ranges, then the weighted sums of
    the outputs (lanes over the value vector) and of l; zeros when no range saw a key. Up to
    COMBINE_HELD_SPLITS ranges keep their weights in registers, more recompute them where used."""
    x = ins[0]
    splits, dv = x.shape[3], x.shape[4] - 2
    held = "true" if splits <= COMBINE_HELD_SPLITS else "false"
    return [
        *pointers(ins + [out], len(ins)),
        f"ml::attention_combine<{splits}, {dv}, {held}>(t, {at(out, 'out0')}, {at(x, 'in0')});",
    ]


def attention_shared_bytes(attrs: dict[str, Any], ins: list[Operand], warps: int) -> int:
    """Dynamic shared memory the tensor-core, lanes-over-keys and split-key attention paths need (0 when
    none applies)."""
    split = warps * (ins[0].shape[3] + 2) * 4 if _split_applies(ins) and _append_packs(attrs, ins) else 0
    if not _mma_applies(attrs, ins):
        lanes = decode_lanes(attrs, ins)
        return max(split, lanes_shared_bytes(ins, lanes) if lanes else 0)
    return max(split, attention_mma_bytes(ins[0].shape[3], attention_mma_split(attrs, ins)))


# ---- lanes over keys (megaloop/attention_lanes.cuh) -------------------------------------------------------

LANES_MAX_ROWS = 8  # (head, query) rows a tile: a warp's scores and sums of its rows live in registers
LANES_MAX_BYTES = 40 * 1024  # its staged keys and values and the rest: beside most of a 12-slot weight ring


@dataclass(frozen=True)
class Lanes:
    """attention_lanes.cuh's Lanes<Rows, Blocks, RowSplit>: at most ``rows`` rows a tile, ``blocks``
    blocks of 32 keys staged at once, each block's rows over ``row_split`` warps."""

    rows: int
    blocks: int
    row_split: int

    @property
    def per_warp(self) -> int:
        return -(-self.rows // self.row_split)

    @property
    def warps(self) -> int:
        return self.blocks * self.row_split


def decode_lanes(attrs: dict[str, Any], ins: list[Operand]) -> Lanes | None:
    """The one place that reads KernelOptions.decode_attention (``attrs["codegen"]``): the lanes-over-keys
    tile where it is 1 and it applies (``lanes_applies``), sized to the block's warps: as many blocks of
    32 keys staged at once as the tile's key range needs and the warps and LANES_MAX_BYTES allow (the
    stages as even as they go: each is a memory round trip), then the rows split over the warps left
    (a lane then computes fewer rows' dot products: a shorter chain)."""
    hints = attrs.get("codegen", {})
    rows, warps = hints.get("rows", 0), hints.get("warps", 0)
    if hints.get("decode_attention", 0) != 1 or not 0 < rows <= LANES_MAX_ROWS or not warps:
        return None
    if not lanes_applies(ins):
        return None
    keys = -(-ins[1].shape[2] // attrs["splits"]) if "splits" in attrs else ins[1].shape[2]
    return lanes_for(rows, warps, keys, ins)


def lanes_for(rows: int, warps: int, keys: int, ins: list[Operand]) -> Lanes | None:
    """The Lanes of a tile of ``rows`` rows over up to ``keys`` keys on ``warps`` warps (decode_lanes),
    or None where not even one block of 32 keys fits LANES_MAX_BYTES."""
    needed = -(-keys // 32)
    for blocks in range(min(needed, warps), 0, -1):
        stages = -(-needed // blocks)
        lanes = Lanes(rows, -(-needed // stages), max(1, min(rows, warps // -(-needed // stages))))
        if lanes_shared_bytes(ins, lanes) <= LANES_MAX_BYTES:  # (the stages as even as they go)
            return lanes
    return None


def lanes_applies(ins: list[Operand]) -> bool:
    """Lanes over keys: q, k, v of one type; heads of whole 16-byte packs, keys and values contiguous
    with pack-aligned rows (copied to shared memory 16 bytes at a time); values of 32 .. 128 dims (up
    to 16 bytes a lane). q is read element by element (any strides)."""
    q, k, v = ins[:3]
    d, dv, size = q.shape[3], v.shape[3], q.dtype.itemsize
    width = 16 // size
    return (
        q.dtype == k.dtype == v.dtype
        and d % width == 0
        and d <= 256
        and dv % 32 == 0
        and dv // 32 in (1, 2, 4, 8)
        and dv // 32 * size <= 16
        and k.strides[3] == v.strides[3] == 1
        and all(st % width == 0 for o in (k, v) for st, n in zip(o.strides[:3], o.shape[:3]) if n > 1)
    )


def lanes_shared_bytes(ins: list[Operand], lanes: Lanes) -> int:
    """attention_lanes.cuh's LanesSmem<T, D, DV, Lanes>::BYTES: staged keys and values (rows padded by 16
    bytes), the rows' q (float32), the new key and value, the warps' weights and partial sums."""
    d, dv, size = ins[0].shape[3], ins[2].shape[3], ins[0].dtype.itemsize
    pad, keys = 16 // size, 32 * lanes.blocks
    staged = keys * (d + pad) * size + keys * (dv + pad) * size
    new = -(-d * size // 16) * 16 + -(-dv * size // 16) * 16
    per_row = lanes.warps * lanes.per_warp
    return staged + lanes.rows * d * 4 + new + per_row * 32 * 4 + per_row * (dv + 2) * 4


def lanes_arg(lanes: Lanes | None) -> str:
    return f", ml::Lanes<{lanes.rows}, {lanes.blocks}, {lanes.row_split}>" if lanes else ""


def _lanes_path(lanes: Lanes | None) -> list[str]:
    if lanes is None:
        return []
    return [f"lanes over keys ({lanes.blocks} block(s) of 32 keys, rows over {lanes.row_split} warp(s) a block)"]


ATT_BK = 64  # keys staged a block (attention.cuh)
MMA_MIN_QUERIES = 16  # a warp's unit of queries: fewer (decode) take the split-key path


def attention_mma_bytes(d: int, split: int = 1) -> int:
    """attention.cuh's attention_mma_shared_bytes: two stages of ``split`` K and V blocks each, rows
    padded by 8."""
    return 2 * 2 * split * ATT_BK * (d + 8) * 2 + 256


def attention_mma_split(attrs: dict[str, Any], ins: list[Operand]) -> int:
    """Warps a unit of 16 queries may take (attention.cuh's SPLIT): 2 where the plan's shared memory
    holds stages of two key blocks, so a tile of fewer units than half its warps keeps them all busy,
    each warp of a pair on every other key block (else a prefill tile of 64 queries, 4 units, leaves 4
    of 8 warps idle)."""
    hints = attrs.get("codegen", {})
    fits = attention_mma_bytes(ins[0].shape[3], 2) + MMA_STATIC_RESERVE <= hints.get("shared_memory", 227 * 1024)
    return 2 if fits and hints.get("warps", MMA_MAX_WARPS) >= 2 else 1


MMA_MAX_WARPS = 8  # above, __launch_bounds__ leaves a thread too few registers: 16 warps spilled 0.5 KB a thread
MMA_STATIC_RESERVE = 8 * 1024  # the kernel's static shared memory, out of the plan's budget (as for wgmma)


def _mma_applies(attrs: dict[str, Any], ins: list[Operand]) -> bool:
    """The tensor-core path: 16-bit q, k, v of one type, head dimensions equal, 16..128 in steps of 16,
    contiguous, 16-byte aligned rows, blocks of at least 16 queries (not a split form: attention_partial
    keeps its own path), at most MMA_MAX_WARPS warps, and the stages within the plan's shared memory."""
    q, k, v = ins[:3]
    d = q.shape[3]
    hints = attrs.get("codegen", {})
    return (
        "splits" not in attrs
        and hints.get("warps", MMA_MAX_WARPS) <= MMA_MAX_WARPS
        and attention_mma_bytes(d) + MMA_STATIC_RESERVE <= hints.get("shared_memory", 227 * 1024)
        and q.dtype == k.dtype == v.dtype
        and q.dtype.name in ("bfloat16", "float16")
        and v.shape[3] == d
        and d % 16 == 0
        and 16 <= d <= 128
        and q.shape[2] >= MMA_MIN_QUERIES
        and q.strides[3] == k.strides[3] == v.strides[3] == 1
        and all(st % 8 == 0 for st in q.strides[:3] + k.strides[:3] + v.strides[:3])
    )


def _split_applies(ins: list[Operand]) -> bool:
    """The split-key path: q, k, v of one type, heads of whole 16-byte packs over a power-of-two count
    of lanes that divides the warp, values as wide as the heads, contiguous, pack-aligned rows (axes of
    one index never move: a decode step's q, a view of its projection, has any stride there)."""
    q, k, v = ins[:3]
    d = q.shape[3]
    width = 16 // q.dtype.itemsize
    lanes = d // width if d % width == 0 else 0
    return (
        lanes > 0
        and 32 % lanes == 0
        and v.shape[3] == d
        and q.dtype == k.dtype == v.dtype
        and q.strides[3] == k.strides[3] == v.strides[3] == 1
        and all(st % width == 0 for o in (q, k, v) for st, n in zip(o.strides[:3], o.shape[:3]) if n > 1)
    )


def _append_packs(attrs: dict[str, Any], ins: list[Operand]) -> bool:
    """The append form on the split-key path (true where it is no append form): k_new and v_new of q's
    type, packs along a contiguous last axis, pack-aligned strides along the axes that move (their key
    axis has one index), and rope's pairs within whole packs (megaloop/rope.cuh's rope_head_pack)."""
    slot = attention_slots(attrs)
    if 5 not in slot:
        return True
    q = ins[0]
    width = 16 // q.dtype.itemsize
    rd = attrs["rotary_dim"]
    pairs = (rd // 2) % width == 0 if attrs["layout"] == "neox" else rd % width == 0 and width % 2 == 0
    news = [ins[slot[s]] for s in (5, 6)]
    return pairs and all(
        o.dtype == q.dtype
        and o.strides[3] == 1
        and all(st % width == 0 for st, n in zip(o.strides[:2], o.shape[:2]) if n > 1)
        for o in news
    )

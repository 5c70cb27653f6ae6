"""Matmul tiles: tensor cores for 16-bit operands with K contiguous on both sides when the op's
``tensor_cores`` tile switch is on (Hopper's wgmma through megaloop/wgmma.cuh for tiles of 64 rows or
more on sm_90, mma.sync through megaloop/mma.cuh otherwise), otherwise (and for thin tiles, where a
matrix-vector product is memory-bound anyway) a warp per output element."""

from __future__ import annotations

import math
from typing import Any

from megaloop.codegen.emit import Operand, broadcast_dims, index_expr, pointers

MMA_DTYPES = ("bfloat16", "float16")
MMA_MIN_ROWS = 16  # thinner tiles (decode) stay on the warp-per-element path
MMA_MAX_BLOCK = 128  # larger tiles run as several 128 x 128 sub-tiles
MMA_BK, MMA_LD, MMA_STAGES, MMA_MAX_FRAGMENTS = 32, 40, 3, 32  # as in mma.cuh (tests/test_codegen.py checks)
WGMMA_MIN_ROWS, WGMMA_MIN_COLS = 64, 64  # a warpgroup's 64 rows; narrower tiles stay on mma.sync
# K slices of 64 in shared memory, at most (wgmma.cuh prefetches S - 2 ahead); deeper measured no faster
# (docs/experiments.md: operand traffic from L2 bounds these tiles, not the prefetch depth)
WGMMA_STAGES = 4
# The loop kernel's static shared memory (its Args copy, the row ops' reduction scratch) comes out of
# the same per-block budget as the dynamic shared memory sized for the stages.
WGMMA_STATIC_RESERVE = 8 * 1024
GEMV_PACKS = 8  # 16-byte loads of each operand in flight per lane on the warp-per-element path
# Tiles of 2..SKINNY_MAX_ROWS rows (batched decode, a few tokens) take a warp per output column for all
# the tile's rows, so each weight is read once: a warp per element re-read a 64-column weight slab
# (512 KB at K = 4096, more than L1) from L2 for every row; 8 tokens through a 4096 x 8192 MLP took
# 300 us on an H200 where its weights stream in 40.
SKINNY_MAX_ROWS = 16  # (the next block of weight packs is loaded before this block's products)


RING_MAX_ROWS = 4  # weight-ring tiles: one warp's sums a column, so each row of A costs its FMAs again
RUN_COLUMNS = 2  # direct matrix-vector tiles (megaloop/matvec.cuh): columns a warp takes at a time


def matmul(op: str, attrs: dict[str, Any], a_: Operand, b_: Operand, out: Operand) -> list[str]:
    config = mma_config(attrs, a_, b_)
    body = pointers([a_, b_, out], 2)
    ring = ring_stream(attrs, a_, b_, out)
    if ring is not None:
        return body + _ring(attrs, a_, b_, out, ring)
    if config:  # picked by the plan (its offsets, its block): no other path in the tile
        return body + _tensor_cores(attrs, a_, b_, out, config)
    return body + _simt(attrs, a_, b_, out)


def matmul_shared_bytes(attrs: dict[str, Any], ins: list[Operand], out: Operand) -> int:
    """Dynamic shared memory the op's tiles need: the tensor-core path's stages, or the skinny
    tensor-core path's partial sums (4 bytes, 2 a lane, for groups of 8 columns + warps - 1 runs)."""
    warps = skinny_mma_warps(attrs, ins[0], ins[1])
    config = mma_config(attrs, ins[0], ins[1])
    wg = wgmma_config(attrs, ins[0], ins[1])
    if wg is not None:
        bn, groups, stages = wg
        return stages * (64 * groups + bn) * 64 * 2 + 1024  # wgmma.cuh's wgmma_shared_bytes
    if config is None:
        return _partial_bytes(attrs, warps) if warps else 0
    bm, bn, _, _ = config
    return MMA_STAGES * (bm + bn) * MMA_LD * 2


def skinny_mma_groups(attrs: dict[str, Any]) -> int:
    """Groups of 8 columns in the op's widest tile (the skinny path's partial sums are sized for it)."""
    return max(1, -(-attrs.get("codegen", {}).get("tile", (0, 0))[1] // 8))


def merged_row_stride(sizes: tuple[int, ...], strides: tuple[int, ...], one_row: int) -> int | None:
    """The one stride that walks the (batch..., row) index space in row-major order (axes of size 1
    skipped; 0 where every row is the same, a broadcast A), ``one_row`` where it holds a single row,
    None where its axes are not evenly spaced."""
    live = [(n, st) for n, st in zip(sizes, strides) if n > 1]
    if not live:
        return one_row
    step, span = live[-1][1], 1
    for n, st in reversed(live):
        if st != step * span:
            return None
        span *= n
    return step


def _a_rows(a_: Operand, attrs: dict[str, Any]) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """A's (batch..., row) sizes and strides, and its row stride (merged_row_stride's arguments)."""
    axis = -1 if attrs["transpose_a"] else -2
    return a_.shape[:-2] + (a_.shape[axis],), a_.strides[:-2] + (a_.strides[axis],), a_.strides[axis]


def _folded_rows(a_: Operand, attrs: dict[str, Any]) -> bool:
    """The op's tiles hold several batch indices (more rows than one index has), their rows of A evenly
    spaced."""
    sizes, strides, row = _a_rows(a_, attrs)
    return attrs["codegen"].get("tile", (0, 0))[0] > sizes[-1] and merged_row_stride(sizes, strides, row) is not None


def skinny_mma_warps(attrs: dict[str, Any], a_: Operand, b_: Operand) -> int:
    """The block's warps when the op's tiles of at most 8 rows take the skinny tensor-core path
    (ml::mma_skinny; the tile switch ``skinny_mma``), else 0: 16-bit operands, both K-contiguous, K a
    multiple of 32, walked strides whole 16-byte packs, batch axes (if any) of size 1 (a Llama decode
    step's [1, 1, hidden] rows) or, where the tiles fold several batch indices (tile switch fold_batch),
    A's batch and row axes evenly spaced (the tile's rows of all its batch indices one after the other)
    and no batch axes on B. (Unfolded over a batch of several, each batch index's tile reads the whole
    weight block again: those stay on the per-element path, not measured against this one.)"""
    hints = attrs.get("codegen", {})
    ta, tb = attrs["transpose_a"], attrs["transpose_b"]
    a_k = a_.strides[-2] if ta else a_.strides[-1]
    b_k = b_.strides[-1] if tb else b_.strides[-2]
    k = a_.shape[-2] if ta else a_.shape[-1]
    ok = (
        hints.get("skinny_mma")
        and hints.get("warps")
        and 1 <= hints.get("tile", (0, 0))[0] <= 8
        and a_.dtype == b_.dtype
        and math.prod(b_.shape[:-2]) == 1
        and (math.prod(a_.shape[:-2]) == 1 or (hints.get("fold_batch") and _folded_rows(a_, attrs)))
        and a_.dtype.name in MMA_DTYPES
        and a_k == 1
        and b_k == 1
        and k % 32 == 0
        and all(st % 8 == 0 for st in (*_batch_strides(a_), *_batch_strides(b_), *_walked(a_, b_, attrs)))
    )
    return hints["warps"] if ok else 0


def mma_config(attrs: dict[str, Any], a_: Operand, b_: Operand) -> tuple[int, int, int, int] | None:
    """(BM, BN, WM, WN) for the tensor-core path, or None when it does not apply. ``attrs["codegen"]``
    carries what the generator knows beyond the op: the tile switch, the largest tile and the warps."""
    hints = attrs.get("codegen", {})
    if not hints.get("tensor_cores") or not hints.get("aligned"):  # (both operands on 16 bytes in the arena)
        return None
    ta, tb = attrs["transpose_a"], attrs["transpose_b"]
    a_k = a_.strides[-2] if ta else a_.strides[-1]
    b_k = b_.strides[-1] if tb else b_.strides[-2]
    k = a_.shape[-2] if ta else a_.shape[-1]
    rows, cols = hints["tile"]
    if (
        a_.dtype != b_.dtype
        or a_.dtype.name not in MMA_DTYPES
        or a_k != 1
        or b_k != 1
        or k % 8
        or any(s % 8 for s in (*_walked(a_, b_, attrs), *_batch_strides(a_), *_batch_strides(b_)))
        or rows < MMA_MIN_ROWS
    ):
        return None
    warps = hints["warps"]
    bm = min(MMA_MAX_BLOCK, 1 << (rows - 1).bit_length())
    bn = min(MMA_MAX_BLOCK, max(8, 1 << (cols - 1).bit_length()))
    for _ in range(32):  # bounded: each step halves or doubles a side within [8, 128]
        grids = [
            (wm, warps // wm)
            for wm in range(1, warps + 1)
            if warps % wm == 0 and (bm // 16) % wm == 0 and (bn // 8) % (warps // wm) == 0
        ]
        if grids:  # the most nearly square warp tiles
            wm, wn = min(grids, key=lambda g: abs(bm // g[0] - bn // g[1]))
            if (bm // 16 // wm) * (bn // 8 // wn) <= MMA_MAX_FRAGMENTS:
                return bm, bn, wm, wn
            if bm >= bn and bm > 16:  # few warps: a smaller block keeps the accumulators in registers
                bm //= 2
            elif bn > 8:
                bn //= 2
            else:
                return None
            continue
        if bn < MMA_MAX_BLOCK:
            bn *= 2
        elif bm < MMA_MAX_BLOCK:
            bm *= 2
        else:
            return None
    return None


def wgmma_config(attrs: dict[str, Any], a_: Operand, b_: Operand) -> tuple[int, int, int] | None:
    """(BN, warpgroups, stages) for Hopper's warpgroup tensor cores (ml::wgmma_tile), or None: the
    tile switch ``wgmma`` and the tensor-core path's conditions on an sm_90 plan, 4 or 8 warps (a warpgroup per 64 rows of a block of
    64 or 128), tiles of at least 64 x 64, and room in the plan's shared memory for 3 stages or more
    (fewer stages, then narrower blocks, where it is short)."""
    hints = attrs.get("codegen", {})
    if not hints.get("wgmma") or hints.get("arch") != "sm_90" or mma_config(attrs, a_, b_) is None:
        return None
    rows, cols = hints["tile"]
    groups = hints["warps"] // 4
    if hints["warps"] not in (4, 8) or rows < WGMMA_MIN_ROWS or cols < WGMMA_MIN_COLS:
        return None
    room = hints.get("shared_memory", 0) - WGMMA_STATIC_RESERVE
    bn = min(256, 1 << (cols - 1).bit_length())
    while bn >= 64:
        for stages in range(WGMMA_STAGES, 2, -1):
            if stages * (64 * groups + bn) * 64 * 2 + 1024 <= room:
                return bn, groups, stages
        bn //= 2
    return None


def ring_stream(attrs: dict[str, Any], a_: Operand, b_: Operand, out: Operand) -> tuple[int, int, int] | None:
    """(row bytes, stride bytes, rows a chunk) of the weight rows a ring tile streams (megaloop/ring.cuh),
    or None where the op's tiles stay as they are: the ring on (its slot bytes in the hints), the skinny
    path's layout, B a parameter, both operands 16-byte aligned in the arena (a ring tile has no other
    path to fall back on), no batch axes, at most RING_MAX_ROWS rows, and a weight row fitting a slot."""
    hints = attrs.get("codegen", {})
    slot = hints.get("ring_slot_bytes", 0)
    k = a_.shape[-2] if attrs["transpose_a"] else a_.shape[-1]
    row_bytes = k * b_.dtype.itemsize
    if not (
        slot
        and skinny_mma_warps(attrs, a_, b_)
        and hints.get("b_parameter")
        and hints.get("aligned")
        and math.prod(out.shape[:-2]) == 1
        and math.prod(a_.shape[:-2]) == 1
        and 1 <= hints.get("tile", (0, 0))[0] <= RING_MAX_ROWS
        and row_bytes <= slot
    ):
        return None
    b_col = b_.strides[-2] if attrs["transpose_b"] else b_.strides[-1]
    stride = b_col * b_.dtype.itemsize if b_.shape[-2 if attrs["transpose_b"] else -1] > 1 else row_bytes
    return row_bytes, stride, slot // row_bytes


def _ring(attrs: dict[str, Any], a_: Operand, b_: Operand, out: Operand, ring: tuple[int, int, int]) -> list[str]:
    """A tile whose weight rows come from the ring (ml::ring_matvec), every chunk of it consumed."""
    return matvec_call(attrs, a_, b_, out, ring, f"ml::PlainRows<{a_.ctype}>{{in0 + ab, {{a_step}}}}")


def matvec_rows(hints: dict[str, Any]) -> int:
    """The rows a matrix-vector tile of the op holds at most: its widest tile's, up to RING_MAX_ROWS."""
    return max(1, min(RING_MAX_ROWS, hints.get("tile", (1, 1))[0]))


def matvec_call(
    attrs: dict[str, Any], a_: Operand, b_: Operand, out: Operand, ring: tuple[int, int, int] | None, rows: str
) -> list[str]:
    """A matrix-vector tile of megaloop/matvec.cuh over whole weight rows, its rows of A given by the
    ``rows`` policy (``{a_step}``: their stride); from the weight ring where ``ring`` is (row bytes,
    stride, rows a chunk), else straight from B in runs of RUN_COLUMNS columns a warp."""
    nd = len(out.shape)
    r_, c_ = nd - 2, nd - 1
    f = _skinny_frame(a_, b_, out, attrs["codegen"]["warps"], attrs)
    o_row, o_col = out.strides[-2:]
    pieces = (ring[0] if ring else a_.shape[-1] * a_.dtype.itemsize) // 16
    w_step = f["b_col"] * b_.dtype.itemsize
    rows_max = matvec_rows(attrs["codegen"])
    store = f"[&](int r, int c, float v) {{ ml::store(out0 + ob + (ml::i64)r * {f['o_step']} + (ml::i64)c * {o_col}, v); }}"
    lines = [
        f"const ml::i64 ab = {f['ab']};",
        f"const ml::i64 ob = (ml::i64)t.lo[{r_}] * {o_row} + (ml::i64)t.lo[{c_}] * {o_col};",
        f"const unsigned char* w = reinterpret_cast<const unsigned char*>(in1 + {f['bb']});",
        f"const int cols = t.hi[{c_}] - t.lo[{c_}], nr = t.hi[{r_}] - t.lo[{r_}];",
    ]
    policy = rows.replace("{a_step}", str(f["a_step"]))
    if ring is not None:
        call = f"ml::ring_matvec<{a_.ctype}, {pieces}, {rows_max}>"
        lines.insert(0, f"// the weight ring: {ring[2]} weight row(s) a chunk, each read by one warp")
        lines.append(f"{call}(a, t, tid, k, proc, cols, {ring[2]}, w, {w_step}, {policy}, nr, {store});")
    else:
        call = f"ml::direct_matvec<{a_.ctype}, {pieces}, {rows_max}>"
        lines.insert(0, f"// whole weight rows from global memory, {RUN_COLUMNS} a warp at a time")
        lines.append(f"{call}(cols, {RUN_COLUMNS}, w, {w_step}, {policy}, nr, {store});")
    return lines


def _walked(a_: Operand, b_: Operand, attrs: dict[str, Any]) -> tuple[int, int]:
    """A's row stride and B's column stride, as 0 where the product has only one row or column to
    walk (a size-1 axis's stride is never used, and may be anything)."""
    ta, tb = attrs["transpose_a"], attrs["transpose_b"]
    m, a_row = (a_.shape[-1], a_.strides[-1]) if ta else (a_.shape[-2], a_.strides[-2])
    n, b_col = (b_.shape[-2], b_.strides[-2]) if tb else (b_.shape[-1], b_.strides[-1])
    return (a_row if m > 1 else 0), (b_col if n > 1 else 0)


def _batch_strides(x: Operand) -> list[int]:
    """Strides of the batch axes that are walked (a size-1 axis's stride is never used)."""
    return [s for s, n in zip(x.strides[:-2], x.shape[:-2]) if n > 1]


def _tensor_cores(
    attrs: dict[str, Any], a_: Operand, b_: Operand, out: Operand, config: tuple[int, int, int, int]
) -> list[str]:
    bm, bn, wm, wn = config
    wg = wgmma_config(attrs, a_, b_)
    ct = a_.ctype
    if wg is not None:
        wbn, groups, stages = wg
        threads, what = 128 * groups, f"wgmma: {64 * groups}x{wbn} blocks, {groups} warpgroup(s), {stages} stages"
        call = f"ml::wgmma_tile<{ct}, {wbn}, {groups}, {stages}>"
    else:
        threads, what = 32 * wm * wn, f"tensor cores: {bm}x{bn} blocks, {wm}x{wn} warps"
        call = f"ml::mma_tile<{ct}, {bm}, {bn}, {wm}, {wn}>"
    ta, tb = attrs["transpose_a"], attrs["transpose_b"]
    nd = len(out.shape)
    k = a_.shape[-2] if ta else a_.shape[-1]
    a_row = a_.strides[-1] if ta else a_.strides[-2]
    b_col = b_.strides[-2] if tb else b_.strides[-1]
    batch = nd - 2
    abatch = broadcast_dims(batch, Operand(a_.dtype, a_.shape[:-2], a_.strides[:-2]), "o")
    bbatch = broadcast_dims(batch, Operand(b_.dtype, b_.shape[:-2], b_.strides[:-2]), "o")
    assert threads == 32 * attrs["codegen"]["warps"], (threads, attrs["codegen"]["warps"])  # the whole block
    return [
        f"{{  // {what}",
        "    extern __shared__ float4 ml_smem4[];",
        f"    const int rows = t.hi[{nd - 2}] - t.lo[{nd - 2}], cols = t.hi[{nd - 1}] - t.lo[{nd - 1}];",
        f"    int o[{nd}];",
        f"    for (int d = 0; d < {nd}; ++d) o[d] = t.lo[d];",
        "    for (;;) {  // every batch index of the box (one, as the matmul tiling makes them)",
        f"        const ml::i64 ab = {index_expr(a_.strides[:-2], abatch)} + (ml::i64)t.lo[{nd - 2}] * {a_row};",
        f"        const ml::i64 bb = {index_expr(b_.strides[:-2], bbatch)} + (ml::i64)t.lo[{nd - 1}] * {b_col};",
        f"        {call}(in0 + ab, {a_row}, in1 + bb, {b_col}, rows, cols, {k}, "
        "ml_smem4, [&](int i, int j, float v) {",
        "            o[{0}] = t.lo[{0}] + i; o[{1}] = t.lo[{1}] + j;".format(nd - 2, nd - 1),
        f"            ml::store(out0 + {index_expr(out.strides, [f'o[{d}]' for d in range(nd)])}, v);",
        "        });",
        f"        int d = {batch - 1};",
        "        for (; d >= 0; --d) { if (++o[d] < t.hi[d]) break; o[d] = t.lo[d]; }",
        "        if (d < 0) break;",
        "    }",
        "}",
    ]


def _simt(attrs: dict[str, Any], a_: Operand, b_: Operand, out: Operand) -> list[str]:
    """A warp per output element, lanes splitting K (coalesced for row-major A and for weights stored
    [out, in] as in checkpoints); float32 accumulation: decode's matrix-vector products, and any
    layout or dtype the tensor-core path does not take."""
    ta, tb = attrs["transpose_a"], attrs["transpose_b"]
    nd = len(out.shape)
    k = a_.shape[-2] if ta else a_.shape[-1]
    a_row, a_k = (a_.strides[-1], a_.strides[-2]) if ta else (a_.strides[-2], a_.strides[-1])
    b_k, b_col = (b_.strides[-1], b_.strides[-2]) if tb else (b_.strides[-2], b_.strides[-1])
    batch = nd - 2
    body: list[str] = []
    abatch = broadcast_dims(batch, Operand(a_.dtype, a_.shape[:-2], a_.strides[:-2]), "o")
    bbatch = broadcast_dims(batch, Operand(b_.dtype, b_.shape[:-2], b_.strides[:-2]), "o")
    width = 16 // a_.dtype.itemsize
    if (
        a_k == 1
        and b_k == 1
        and k % width == 0
        and a_.dtype == b_.dtype
        and all(st % width == 0 for st in (*_batch_strides(a_), *_batch_strides(b_), *_walked(a_, b_, attrs)))
    ):
        step = 32 * width
        rows = attrs.get("codegen", {}).get("tile", (0, 0))[0]
        skinny_warps = skinny_mma_warps(attrs, a_, b_)
        if skinny_warps:
            # weights read once a step: a parameter, and a single row block (every tile of the op reads
            # a block of B of its own)
            once = rows >= math.prod(out.shape[:-1])  # (rows: the largest tile's, batch indices folded in)
            stream = attrs["codegen"].get("b_parameter", False) and once
            body += _skinny_mma(a_, b_, out, k, skinny_warps, stream, attrs)
        if 2 <= rows <= SKINNY_MAX_ROWS:
            body += _skinny(a_, b_, out, k, width, rows, abatch, bbatch, a_row, b_col)
        # packed dot products: each lane GEMV_PACKS packs of A and of B in flight per step (Little's law:
        # a streaming SM needs ~30 KB in flight on an H200; 8 warps x 32 lanes x 8 x 16 B = 32 KB)
        body += [
            f"if (ml::aligned(in0, 16) && ml::aligned(in1, 16)) {{  // packed path: {width} elements per load",
            f"    ml::for_box_warps<{nd}>(t, [&](const int* o, int lane) {{",
            f"        const ml::i64 ab = {index_expr(a_.strides[:-2], abatch)} + (ml::i64)o[{nd - 2}] * {a_row};",
            f"        const ml::i64 bb = {index_expr(b_.strides[:-2], bbatch)} + (ml::i64)o[{nd - 1}] * {b_col};",
            "        float acc = 0.0f;",
            f"        for (int k0 = lane * {width}; k0 < {k}; k0 += {GEMV_PACKS} * {step}) {{",
            f"            ml::Pack<{a_.ctype}, {width}> pa[{GEMV_PACKS}], pb[{GEMV_PACKS}];",
            "#pragma unroll",
            f"            for (int u = 0; u < {GEMV_PACKS}; ++u) {{ const int kk = min(k0 + u * {step}, {k - width}); "
            f"pa[u] = ml::load_pack<{a_.ctype}, {width}>(in0 + ab + kk); pb[u] = ml::load_pack<{b_.ctype}, {width}>(in1 + bb + kk); }}"
            "  // past K: its last pack (unused): no branch, every pack defined",
            "#pragma unroll",
            f"            for (int u = 0; u < {GEMV_PACKS}; ++u) if (k0 + u * {step} < {k}) acc += ml::dot(pa[u], pb[u]);",
            "        }",
            "        acc = ml::warp_sum(acc);",
            f"        if (lane == 0) ml::store(out0 + {index_expr(out.strides, [f'o[{d}]' for d in range(nd)])}, acc);",
            "    });",
            "    return;",
            "}",
        ]
    body.append(f"ml::for_box_warps<{nd}>(t, [&](const int* o, int lane) {{")
    body.append(f"    const ml::i64 ab = {index_expr(a_.strides[:-2], abatch)} + (ml::i64)o[{nd - 2}] * {a_row};")
    body.append(f"    const ml::i64 bb = {index_expr(b_.strides[:-2], bbatch)} + (ml::i64)o[{nd - 1}] * {b_col};")
    body.append("    float acc = 0.0f;")
    body.append(
        f"    for (int k = lane; k < {k}; k += 32) "
        f"acc += ml::load(in0 + ab + (ml::i64)k * {a_k}) * ml::load(in1 + bb + (ml::i64)k * {b_k});"
    )
    body.append("    acc = ml::warp_sum(acc);")
    body.append(f"    if (lane == 0) ml::store(out0 + {index_expr(out.strides, [f'o[{d}]' for d in range(nd)])}, acc);")
    body.append("});")
    return body


SKINNY_MMA_SLICES = 8  # 32-element K slices of each operand a lane has in flight (twice: double-buffered)
# Weights read once a step (B a parameter, one row block) are loaded under L2's evict_first policy
# (without it the decode step took 99 us instead of 76 on an H200: docs/experiments.md).


def _skinny_frame(a_: Operand, b_: Operand, out: Operand, warps: int, attrs: dict[str, Any]) -> dict[str, Any]:
    """The skinny tile's frame: the guard under which it takes the skinny path, its B block's offset,
    and how its rows are walked."""
    ta, tb = attrs["transpose_a"], attrs["transpose_b"]
    nd = len(out.shape)
    batch = nd - 2
    abatch = broadcast_dims(batch, Operand(a_.dtype, a_.shape[:-2], a_.strides[:-2]), "o")
    bbatch = broadcast_dims(batch, Operand(b_.dtype, b_.shape[:-2], b_.strides[:-2]), "o")
    a_row = a_.strides[-1] if ta else a_.strides[-2]
    b_col = b_.strides[-2] if tb else b_.strides[-1]
    r_, c_ = nd - 2, nd - 1  # the box's row and column axes
    m = out.shape[-2]
    a_base = index_expr(a_.strides[:-2], [x and x.replace("o[", "t.lo[") for x in abatch])
    b_base = index_expr(b_.strides[:-2], [x and x.replace("o[", "t.lo[") for x in bbatch])
    # a box of several batch indices (fold_batch) is taken as their rows one after the other, where A's
    # and out's (batch..., row) axes are evenly spaced and one batch axis varies (the box then holds
    # whole rows of consecutive batch indices); any other box: one batch index
    a_rs = merged_row_stride(*_a_rows(a_, attrs))
    o_rs = merged_row_stride(out.shape[:-1], out.strides[:-1], out.strides[-2])
    batches = " * ".join(f"(t.hi[{d}] - t.lo[{d}])" for d in range(nd - 2)) or "1"
    if a_rs is not None and o_rs is not None and sum(1 for n in out.shape[:-2] if n > 1) <= 1:
        a_step, o_step = a_rs, o_rs
        boxes = f" && (box_batches == 1 || (t.lo[{r_}] == 0 && t.hi[{r_}] == {m}))"
        what = "rows of its batch indices one after the other"
    else:
        a_step, o_step = a_row, out.strides[-2]
        boxes = " && box_batches == 1"
        what = "one batch index"
    guard = (
        f"ml::aligned(in0, 16) && ml::aligned(in1, 16) && box_batches * (t.hi[{r_}] - t.lo[{r_}]) <= 8{boxes} "
        f"&& t.hi[{c_}] - t.lo[{c_}] <= {8 * skinny_mma_groups(attrs)} && ml::block_threads() == {32 * warps}"
    )
    return {
        "batches": f"const int box_batches = {batches};  // batch indices in the box",
        "guard": guard,
        "bb": f"{b_base} + (ml::i64)t.lo[{c_}] * {b_col}",
        "ab": f"{a_base} + (ml::i64)t.lo[{r_}] * {a_row}",
        "b_col": b_col,
        "a_step": a_step,
        "o_step": o_step,
        "what": what,
    }


def _partial_bytes(attrs: dict[str, Any], warps: int) -> int:
    """The skinny path's partial sums: 4 bytes, 2 a lane, for groups of 8 columns + warps - 1 runs."""
    return 4 * 64 * (skinny_mma_groups(attrs) + warps - 1)


def _skinny_mma(
    a_: Operand,
    b_: Operand,
    out: Operand,
    k: int,
    warps: int,
    stream: bool,
    attrs: dict[str, Any],
) -> list[str]:
    """Tiles of at most 8 rows on tensor cores (ml::mma_skinny): A's rows and B's columns loaded straight
    into mma fragments, the tile's groups of 8 columns x K slices shared evenly by the warps, their
    partial sums added in warp order through shared memory (the same bits every run). The SIMT path
    spends two instructions a multiply-add at 8 rows (unpacking A, the FMA), at or above what 4.8 TB/s
    of weights leaves an SM; an mma does 16 x 8 x 16 of them (half of them on zero rows)."""
    ct = a_.ctype
    slices = k // 32
    # 16 U registers of packs a lane (A and B, double-buffered): at 12 warps (168 registers a thread)
    # U = 8 made the loop spill; the block's slices in flight stay about the same
    slices_in_flight = SKINNY_MMA_SLICES if warps <= 8 else max(2, SKINNY_MMA_SLICES * 4 // warps)
    nd = len(out.shape)
    r_, c_ = nd - 2, nd - 1
    o_row, o_col = out.strides[-2:]
    at_lo = [f"t.lo[{d}]" for d in range(nd)]
    o_base = index_expr(out.strides[:-2], at_lo[:-2])
    f = _skinny_frame(a_, b_, out, warps, attrs)
    policy = "true" if stream else "false"
    call = f"ml::mma_skinny<{ct}, {slices}, {slices_in_flight}, {policy}>"
    return [
        f["batches"],
        f"if ({f['guard']}) {{"
        f"  // at most 8 rows: tensor cores, the warps sharing groups of 8 columns x K; {f['what']}",
        f"    const int nr = box_batches * (t.hi[{r_}] - t.lo[{r_}]), ncols = t.hi[{c_}] - t.lo[{c_}], groups = (ncols + 7) / 8;",
        f"    const ml::i64 ab = {f['ab']}, bb = {f['bb']};",
        f"    const ml::i64 ob = {o_base} + (ml::i64)t.lo[{r_}] * {o_row};",
        f"    const int units = groups * {slices}, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;",
        "    extern __shared__ float4 ml_smem4[];",
        "    float* partial = reinterpret_cast<float*>(ml_smem4);  // (group + warp, lane, 2)",
        f"    {call}(in0 + ab, {f['a_step']}, nr, in1 + bb, {f['b_col']}, ncols, warp * units / {warps}, "
        f"(warp + 1) * units / {warps}, partial, warp, {warps});",
        "    ml::block_sync();",
        f"    for (int group = warp; group < groups; group += {warps}) {{",
        "        float c0, c1;",
        f"        ml::skinny_sums(partial, group, {slices}, units, {warps}, c0, c1);",
        "        const int g = lane >> 2, col = 8 * group + 2 * (lane & 3);",
        "        if (g < nr) {",
        f"            const ml::i64 ro = ob + (ml::i64)g * {f['o_step']}, co = (ml::i64)(t.lo[{c_}] + col) * {o_col};",
        "            if (col < ncols) ml::store(out0 + ro + co, c0);",
        f"            if (col + 1 < ncols) ml::store(out0 + ro + co + {o_col}, c1);",
        "        }",
        "    }",
        "    return;",
        "}",
    ]


def _skinny(
    a_: Operand,
    b_: Operand,
    out: Operand,
    k: int,
    width: int,
    rows: int,
    abatch: list[str | None],
    bbatch: list[str | None],
    a_row: int,
    b_col: int,
) -> list[str]:
    """A warp per output column (and batch index) computing all of the tile's rows (at most ``rows``):
    the column's weights are loaded once, in packs, and dotted with every row of A (small: L1/L2).
    Per element, the lanes add in the same order as the warp-per-element path (same bits)."""
    nd = len(out.shape)
    step = 32 * width
    packs = GEMV_PACKS if rows <= 8 else GEMV_PACKS // 2  # registers: rows accumulators + packs of B
    out_at = index_expr(out.strides, [f"o[{d}]" for d in range(nd)])
    return [
        f"if (ml::aligned(in0, 16) && ml::aligned(in1, 16) && t.hi[{nd - 2}] - t.lo[{nd - 2}] <= {rows}) {{  "
        f"// at most {rows} rows: a warp per column, each weight read once",
        "    ml::Task colt = t;",
        f"    colt.hi[{nd - 2}] = colt.lo[{nd - 2}] + 1;  // walk the columns (and batch); the rows inside",
        f"    const int nr = t.hi[{nd - 2}] - t.lo[{nd - 2}];",
        f"    ml::for_box_warps<{nd}>(colt, [&](const int* o, int lane) {{",
        f"        const ml::i64 ab = {index_expr(a_.strides[:-2], abatch)} + (ml::i64)o[{nd - 2}] * {a_row};",
        f"        const ml::i64 bb = {index_expr(b_.strides[:-2], bbatch)} + (ml::i64)o[{nd - 1}] * {b_col};",
        f"        float acc[{rows}];",
        "#pragma unroll",
        f"        for (int r = 0; r < {rows}; ++r) acc[r] = 0.0f;",
        f"        ml::Pack<{b_.ctype}, {width}> pb[{packs}];  // this block's weights",
        "#pragma unroll",
        f"        for (int u = 0; u < {packs}; ++u) pb[u] = ml::load_pack<{b_.ctype}, {width}>"
        f"(in1 + bb + min(lane * {width} + u * {step}, {k - width}));  // past K: its last pack (never used)",
        f"        for (int k0 = lane * {width}; k0 < {k}; k0 += {packs} * {step}) {{",
        f"            ml::Pack<{b_.ctype}, {width}> nb[{packs}];  // the next block's, in flight meanwhile",
        "#pragma unroll",
        f"            for (int u = 0; u < {packs}; ++u) nb[u] = ml::load_pack<{b_.ctype}, {width}>"
        f"(in1 + bb + min(k0 + ({packs} + u) * {step}, {k - width}));",
        "#pragma unroll",
        f"            for (int r = 0; r < {rows}; ++r) {{",
        "                if (r >= nr) break;",
        "#pragma unroll",
        f"                for (int u = 0; u < {packs}; ++u) {{ const int kk = k0 + u * {step}; "
        f"const ml::Pack<{a_.ctype}, {width}> pa = ml::load_pack<{a_.ctype}, {width}>(in0 + ab + (ml::i64)r * {a_row} "
        f"+ min(kk, {k - width})); if (kk < {k}) acc[r] += ml::dot(pa, pb[u]); }}",
        "                // (A loaded unguarded, from K's last pack past its end: the loads go out together;"
        " a guarded load per pack waited for each in turn when K is not whole blocks)",
        "            }",
        "#pragma unroll",
        f"            for (int u = 0; u < {packs}; ++u) pb[u] = nb[u];",
        "        }",
        "#pragma unroll",
        f"        for (int r = 0; r < {rows}; ++r) {{",
        "            if (r >= nr) break;  // nr is the same on every lane: the shuffles stay convergent",
        "            const float s = ml::warp_sum(acc[r]);",
        f"            if (lane == 0) ml::store(out0 + {out_at} + (ml::i64)r * {out.strides[nd - 2]}, s);",
        "        }",
        "    });",
        "    return;",
        "}",
    ]

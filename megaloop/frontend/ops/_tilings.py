"""The tilings op definitions choose from (``OpDef.tiling``). Each is a function
``(node, params, ctx) -> [Tile]`` plus its parameters' per-architecture defaults; see
``megaloop.frontend.tiling`` for what a tile declares."""

from __future__ import annotations

import math
from typing import Any

from megaloop.frontend.shapes import contiguous_strides
from megaloop.frontend.tiling import (
    PEER_RECV,
    PEER_SEND,
    Box,
    Read,
    Tile,
    TileContext,
    Tiling,
    Write,
    balanced,
    balanced_blocks,
    blocks,
    chunks,
    project,
    same,
)

# Elements per task for memory-bound ops: 8K elements is 16-32 KB, enough to hide a task's
# dependency check on the big parts, small enough to spread a decode-sized tensor.
ELEMENTS = {"sm_80": 8192, "sm_86": 4096, "sm_89": 4096, "sm_90": 8192}
# ... but at most about this many tasks per processor for one op: a tensor of a gigabyte would
# otherwise be 10^5 tasks, each paying its wait, barrier and signal. Larger ops get larger tiles.
WAVES = same(8)


def _elements(params: dict[str, int], total: int, ctx: TileContext) -> int:
    """Elements per task: the ``elements`` parameter, raised so that the op makes no more than
    ``waves`` tasks per processor."""
    return max(params["elements"], -(-total // (ctx.processors * params["waves"])))


def _chunk_elements(params: dict[str, int], shape: tuple[int, ...], ctx: TileContext, unit: int = 1) -> int:
    """``chunks(shape, ·)``'s size for an op whose every element of ``shape`` stands for ``unit``
    elements of work (a row op's rows): ``_elements``, made ``balanced`` so the last round of tasks over
    the processors is as full as it can be (a task costs about ``elements`` elements' time on top of its
    own: its wait, barrier, signal and pipeline fill). Ops of fewer tasks than processors keep it."""
    elements = _elements(params, math.prod(shape) * unit, ctx)
    if not params["balance"]:
        return max(1, elements // unit)
    return balanced(shape, max(1, elements // unit), ctx.processors, max(1, params["elements"] // unit))


def _elementwise(node: Any, params: dict[str, int], ctx: TileContext) -> list[Tile]:
    out = node.outputs[0]
    total = math.prod(out.shape)
    elements = _elements(params, total, ctx)
    width = 16 // max([t.dtype.itemsize for t in node.inputs] + [out.dtype.itemsize])
    small = ctx.warps * 32 * width  # a 16-byte pack a thread
    # blocks line up with matmul tiles; a tile enlarged for a huge op takes whole rows instead (long
    # contiguous runs stream from memory better than many 256-byte pieces of 128 columns)
    one_tile = total <= params["elements"] if params["split_full"] else total < params["elements"]
    if params["split_small"] and small < total < SMALL_OP_PACKS * small and one_tile:
        pieces = -(-total // small)  # equal pieces of whole packs: 5504 values are 1840 + 1840 + 1824
        boxes = chunks(out.shape, -(-total // (pieces * width)) * width)
    elif elements == params["elements"]:
        size = balanced_blocks(out.shape, elements, ctx.processors, elements) if params["balance"] else elements
        boxes = blocks(out.shape, size)
    else:
        boxes = chunks(out.shape, _chunk_elements(params, out.shape, ctx))
    tiles = []
    for i, box in enumerate(boxes):
        reads = tuple(Read(k, project(box, out.shape, t.shape)) for k, t in enumerate(node.inputs))
        tiles.append(Tile((i,), reads, (Write(0, box),), flops=box.size))
    return tiles


def _streaming(make: Any, doc: str, waves: dict[str, int] = WAVES, switches: tuple[str, ...] = ()) -> Tiling:
    """The tilings of memory-bound ops: ``elements`` a task, at most ``waves`` tasks a processor, and the
    switch ``balance``: tiles grown (up to twice) so that the last round over the processors is full
    (tiling.balanced); 0 keeps exactly that size, as plan files saved before the switch were made.
    ``switches``: more switches, on by default, off in files saved before them."""
    flags = ("balance", *switches)
    return Tiling(
        {"elements": ELEMENTS, "waves": waves, **{f: same(1) for f in flags}},
        make,
        doc,
        flags=flags,
        saved_without={f: 0 for f in flags},
    )


# split_small: an op smaller than one tile (``elements``) and than SMALL_OP_PACKS packs a thread is cut
# into equal tiles of at most a 16-byte pack a thread: a decode step's small elementwise ops (a silu's
# expf and division on one processor) sit on its critical path. 0: one tile (docs/experiments.md).
# split_full: with split_small, an op of exactly one tile is cut too (Llama-3.2-1B's silu_mul). Its own
# switch so that files saved with split_small before it (0 there) keep their tasks.
SMALL_OP_PACKS = 8
ELEMENTWISE = _streaming(
    _elementwise,
    "row-major chunks of the output (2-D blocks when it has many wide rows); broadcast operands read their "
    "projection; split_small, split_full: 0 or 1",
    switches=("split_small", "split_full"),
)


def _reduction(node: Any, params: dict[str, int], ctx: TileContext) -> list[Tile]:
    x, out = node.inputs[0], node.outputs[0]
    axis = node.attrs["axis"]
    axes = tuple(range(x.ndim)) if axis is None else (axis,) if isinstance(axis, int) else tuple(axis)
    keepdims = node.attrs["keepdims"]
    reduced = math.prod(x.shape[a] for a in axes)
    tiles = []
    for i, box in enumerate(chunks(out.shape, _chunk_elements(params, out.shape, ctx, reduced))):
        lo, hi, j = [], [], 0
        for d in range(x.ndim):
            if d in axes:
                lo.append(0)
                hi.append(x.shape[d])
                j += keepdims
            else:
                lo.append(box.lo[j])
                hi.append(box.hi[j])
                j += 1
        xbox = Box(tuple(lo), tuple(hi))
        tiles.append(Tile((i,), (Read(0, xbox),), (Write(0, box),), flops=xbox.size))
    return tiles


REDUCTION = _streaming(_reduction, "chunks of the output, each reading whole reduced axes")


def _argmax_partial(node: Any, params: dict[str, int], ctx: TileContext) -> list[Tile]:
    """Ranges of the axis spread over one round of the processors (the op exists for latency: a range
    a task where there are no more ranges than processors), each tile reading its ranges of x."""
    x, out = node.inputs[0], node.outputs[0]
    a, chunk = node.attrs["axis"], node.attrs["chunk"]
    tiles = []
    for i, box in enumerate(chunks(out.shape, max(1, -(-math.prod(out.shape) // ctx.processors)))):
        lo = box.lo[:a] + (box.lo[a] * chunk,) + box.lo[a + 1 :]
        hi = box.hi[:a] + (min(x.shape[a], box.hi[a] * chunk),) + box.hi[a + 1 :]
        xbox = Box(lo, hi)
        tiles.append(Tile((i,), (Read(0, xbox),), (Write(0, box),), flops=xbox.size))
    return tiles


ARGMAX_PARTIAL = Tiling({}, _argmax_partial, "one round of tasks over the processors, each a few ranges")


def _argmax_combine(node: Any, params: dict[str, int], ctx: TileContext) -> list[Tile]:
    """Output elements a warp each, a block's warps a tile; each reads its ranges' indices and (at
    them) x: x's whole axis is declared, the values are picked by data."""
    x, partial = node.inputs
    out = node.outputs[0]
    a, keep = node.attrs["axis"], node.attrs["keepdims"]
    tiles = []
    for i, box in enumerate(chunks(out.shape, ctx.warps)):
        lo, hi = (box.lo, box.hi) if keep else (box.lo[:a] + (0,) + box.lo[a:], box.hi[:a] + (1,) + box.hi[a:])
        xbox = Box(lo[:a] + (0,) + lo[a + 1 :], hi[:a] + (x.shape[a],) + hi[a + 1 :])
        pbox = Box(xbox.lo, xbox.hi[:a] + (partial.shape[a],) + xbox.hi[a + 1 :])
        tiles.append(Tile((i,), (Read(0, xbox), Read(1, pbox)), (Write(0, box),), flops=2 * pbox.size))
    return tiles


ARGMAX_COMBINE = Tiling({}, _argmax_combine, "a warp an output element, a block's warps a tile")


def _rows(node: Any, params: dict[str, int], ctx: TileContext) -> list[Tile]:
    x = node.inputs[0]
    axis = node.attrs.get("axis", x.ndim - 1)
    outer = x.shape[:axis] + x.shape[axis + 1 :]
    tiles = []
    for i, box in enumerate(chunks(outer, _chunk_elements(params, outer, ctx, x.shape[axis]))):
        xbox = Box(box.lo[:axis] + (0,) + box.lo[axis:], box.hi[:axis] + (x.shape[axis],) + box.hi[axis:])
        # a norm's residual (x's shape) is read in x's box, its weight and bias (the row's length) whole
        reads = (Read(0, xbox),) + tuple(
            Read(k, xbox if t.shape == x.shape else Box.full(t.shape)) for k, t in enumerate(node.inputs) if k
        )
        tiles.append(Tile((i,), reads, (Write(0, xbox),), flops=5 * xbox.size))
    return tiles


# Row ops stream each task's rows through a ring in shared memory that fills at the task's start and
# drains at its end: fewer, longer tasks for big ops; 3-4 a processor measured best for rmsnorm and
# softmax (docs/experiments.md, "scripts/row_variants.py").
ROW_WAVES = same(4)
ROWS = _streaming(_rows, "blocks of whole rows along the normalised axis", ROW_WAVES)


MIN_BLOCK_N = 8  # matrix-vector products (decode): a tile is 8 x k weights
MIN_BLOCK_N_TILED = 32  # tiles of 16 rows or more (prefill, tensor cores) read bm x k of A per tile
MIN_BLOCK_N_WGMMA = 64  # a warpgroup MMA tile (sm_90) is at least 64 wide
TASK_COST_WEIGHTS = 16384  # a task's fixed cost, in weights one SM streams meanwhile
# fold_batch: a matmul of few rows a batch index against weights without batch axes (batched decode,
# A [sequences, tokens, hidden]) takes several batch indices a tile, up to this many rows in all, so that
# a tile reads its block of weights once for all of them (the skinny tensor-core path's limit)
FOLD_BATCH_ROWS = 8


def _narrowed(bn: int, bm: int, n: int, k: int, rows: int, processors: int, params: dict[str, int]) -> int:
    """A small grid (decode: m == 1) would leave processors idle: narrow the column tiles (down to 8
    columns: 8 x k weights is still a sizeable task) to the width that finishes soonest: rounds of
    tasks over the processors times the time of one task, its columns plus a fixed cost per task
    (its wait, barrier and signal: about 1 us, the time one SM streams ~16K weights; in columns of
    k weights, 16384 / k). Ties keep the wider tile (fewer tasks to plan and to run).
    Matrix-vector products of many tiles (an LM head) take the width that fills their last round best,
    by the same cost (docs/experiments.md: Llama-3.2-1B's LM head)."""
    fixed = max(1, TASK_COST_WEIGHTS // max(k, 1))
    if rows * math.ceil(n / bn) >= processors:
        if bm >= 16:
            return bn
        widths = range(bn - bn % MIN_BLOCK_N, MIN_BLOCK_N - 1, -MIN_BLOCK_N)
        return min([bn, *widths], key=lambda w: (math.ceil(rows * math.ceil(n / w) / processors) * (w + fixed), -w))
    narrowest = MIN_BLOCK_N if bm < 16 else MIN_BLOCK_N_TILED  # a tall tile re-reads A per column tile
    if params["tensor_cores"] and params["wgmma"] and bm >= 64:
        narrowest = MIN_BLOCK_N_WGMMA  # narrower tiles would leave wgmma for mma.sync
    widths = [bn >> s for s in range(8) if bn >> s >= narrowest] or [bn]
    if bm < 16:  # matrix-vector tiles take any multiple of 8 columns: 5504 columns on 132 SMs are
        # 115 tiles of 48 (one round) where powers of two gave 86 of 64 (an SM streams 64 columns)
        widths += [w for w in range(narrowest, bn, MIN_BLOCK_N) if w not in widths]
    return min(widths, key=lambda w: (math.ceil(rows * math.ceil(n / w) / processors) * (w + fixed), -w))


def _matmul(node: Any, params: dict[str, int], ctx: TileContext) -> list[Tile]:
    a, b = node.inputs
    out = node.outputs[0]
    ta, tb = node.attrs["transpose_a"], node.attrs["transpose_b"]
    *batch, m, n = out.shape
    k = a.shape[-2] if ta else a.shape[-1]
    bm, bn = min(params["block_m"], m), min(params["block_n"], n)
    # batch indices a tile: several where fold_batch asks and the weights have no batch axes of their
    # own, one batch axis varies, and its rows are few (their rows then follow each other in A and out)
    per_tile = 1
    if (
        params["fold_batch"]
        and math.prod(b.shape[:-2]) == 1
        and sum(1 for d in batch if d > 1) == 1
        and m * 2 <= min(params["block_m"], FOLD_BATCH_ROWS)
    ):
        per_tile, bm = min(params["block_m"], FOLD_BATCH_ROWS) // m, m
    batch_boxes = list(chunks(tuple(batch), per_tile))
    rows = len(batch_boxes) * math.ceil(m / bm)
    if params["share"] and ctx.share < 1:
        # sibling matmuls of one input run alongside: size the tiles for this op's share of the
        # processors. Tall tiles (16 rows or more, tensor cores) only ever get wider for it: the cost
        # model below counts a tile's time by its columns, but a narrower tensor-core tile does more
        # work a column (docs/experiments.md)
        shared = _narrowed(bn, bm, n, k, rows, ctx.own_processors, params)
        bn = shared if bm < 16 else max(shared, _narrowed(bn, bm, n, k, rows, ctx.processors, params))
    else:
        bn = _narrowed(bn, bm, n, k, rows, ctx.processors, params)
    tiles = []
    batch_shape = tuple(batch)
    # an A block is read by every column tile of its rows, and by every batch index when A broadcasts
    # over the batch; a B block likewise by the row tiles
    a_sharers = math.ceil(n / bn) * (len(batch_boxes) if math.prod(a.shape[:-2]) == 1 else 1)
    b_sharers = math.ceil(m / bm) * (len(batch_boxes) if math.prod(b.shape[:-2]) == 1 else 1)
    for bi, bidx in enumerate(batch_boxes):
        abatch = project(bidx, batch_shape, a.shape[:-2])
        bbatch = project(bidx, batch_shape, b.shape[:-2])
        for i in range(0, m, bm):
            for j in range(0, n, bn):
                rows, cols = (i, min(m, i + bm)), (j, min(n, j + bn))
                arows = ((0, k), rows) if ta else (rows, (0, k))
                bcols = (cols, (0, k)) if tb else ((0, k), cols)
                abox = Box(abatch.lo + (arows[0][0], arows[1][0]), abatch.hi + (arows[0][1], arows[1][1]))
                bbox = Box(bbatch.lo + (bcols[0][0], bcols[1][0]), bbatch.hi + (bcols[0][1], bcols[1][1]))
                obox = Box(bidx.lo + (rows[0], cols[0]), bidx.hi + (rows[1], cols[1]))
                flops = 2 * bidx.size * (rows[1] - rows[0]) * (cols[1] - cols[0]) * k
                a_bytes, b_bytes = abox.size * a.dtype.itemsize, bbox.size * b.dtype.itemsize
                once = a_bytes // a_sharers + b_bytes // b_sharers
                reads = (Read(0, abox), Read(1, bbox))
                tiles.append(
                    Tile((bi, i // bm, j // bn), reads, (Write(0, obox),), flops, None, 0, a_bytes + b_bytes, once)
                )
    return tiles


MATMUL = Tiling(
    {
        "block_m": {"sm_80": 128, "sm_86": 64, "sm_89": 64, "sm_90": 128},
        # sm_90: a 128 x 256 wgmma block reads 48 KB a K slice of 64 for 2M multiply-adds (128 x 128: 32 KB
        # for 1M): less operand traffic from L2 a multiply-add
        "block_n": {"sm_80": 128, "sm_86": 128, "sm_89": 128, "sm_90": 256},
        # 1: 16-bit operands with K contiguous run on tensor cores (fp32 accumulation; GPU-checked:
        # tests/test_gpu.py, bench/gemm.py); 0: every tile on the SIMT paths
        "tensor_cores": same(1),
        # 1: tiles of at most 8 rows of 16-bit operands (a few tokens, decode) on tensor cores too, the
        # warps sharing the tile's groups of 8 columns x K evenly (ml::mma_skinny), each weight read once
        # for all the rows (bench/results/tp_mlp.json)
        "skinny_mma": same(1),
        # 1: batched decode (rows of several batch indices against weights without batch axes) takes up
        # to FOLD_BATCH_ROWS rows of several batch indices a tile, reading its weights once for all of them
        # (docs/experiments.md); 0: a tile per batch index
        "fold_batch": same(1),
        # 1: matmuls of one input (q, k, v; gate, up) size their tiles for their share of the processors
        # (TileContext.share) so that together they make one round of tasks (docs/experiments.md); 0: each
        # sized for all the processors
        "share": same(1),
        # 1: on Hopper, tensor-core tiles of at least 64 x 64 use warpgroup MMA (wgmma, megaloop/wgmma.cuh);
        # 0: mma.sync as on the other architectures
        "wgmma": {"sm_80": 0, "sm_86": 0, "sm_89": 0, "sm_90": 1},
    },
    _matmul,
    "output tiles of block_m x block_n per batch index, full K; narrower when few; tensor_cores, skinny_mma, "
    "fold_batch, share, wgmma: 0 or 1",
    flags=("tensor_cores", "skinny_mma", "fold_batch", "share", "wgmma"),
    # plan files made before these switches: a tile per batch index, tiles sized for every processor
    saved_without={"fold_batch": 0, "share": 0},
)


def _embedding(node: Any, params: dict[str, int], ctx: TileContext) -> list[Tile]:
    table, ids = node.inputs
    d = table.shape[1]
    tiles = []
    for i, box in enumerate(chunks(ids.shape, max(1, params["elements"] // d))):
        obox = Box(box.lo + (0,), box.hi + (d,))
        # rows are picked by data: the whole (read-only) table is declared, one row per id is moved
        moved = box.size * (ids.dtype.itemsize + 2 * d * table.dtype.itemsize)
        tiles.append(Tile((i,), (Read(0, Box.full(table.shape)), Read(1, box)), (Write(0, obox),), 0, moved))
    return tiles


EMBEDDING = Tiling({"elements": ELEMENTS}, _embedding, "blocks of ids, whole rows of the table")

# scatter_add: a tile owns rows of the output and at most this many of its columns (a warp's lanes hold
# them in registers while it scans the ids)
SCATTER_COLUMNS = 256


def _scatter_add(node: Any, params: dict[str, int], ctx: TileContext) -> list[Tile]:
    values, ids = node.inputs
    rows, dim = node.outputs[0].shape
    cols = min(dim, SCATTER_COLUMNS)
    block = max(1, params["elements"] // cols)
    tiles = []
    for i, r in enumerate(range(0, rows, block)):
        for j, c in enumerate(range(0, dim, cols)):
            box = Box((r, c), (min(rows, r + block), min(dim, c + cols)))
            # every id is read (which rows are its own is in the data); the values' rows that match move
            moved = ids.size * ids.dtype.itemsize + 2 * box.size * values.dtype.itemsize
            reads = (Read(0, Box((0, c), (values.shape[0], box.hi[1]))), Read(1, Box.full(ids.shape)))
            tiles.append(Tile((i, j), reads, (Write(0, box),), flops=box.size, moved=moved))
    return tiles


SCATTER_ADD = Tiling({"elements": ELEMENTS}, _scatter_add, "blocks of the output's rows, every id scanned")


def _rope(node: Any, params: dict[str, int], ctx: TileContext) -> list[Tile]:
    x, pos = node.inputs
    tiles = []
    for i, box in enumerate(chunks(x.shape[:-1], max(1, params["elements"] // x.shape[-1]))):
        xbox = Box(box.lo + (0,), box.hi + (x.shape[-1],))
        reads = (Read(0, xbox), Read(1, project(box, x.shape[:-1], pos.shape)))
        tiles.append(Tile((i,), reads, (Write(0, xbox),), 6 * xbox.size))
    return tiles


ROPE = Tiling({"elements": ELEMENTS}, _rope, "blocks of whole head vectors with their positions")


MASK = 7  # attention's mask operand in attention_slots (its last input, where ``masked`` is set)


def attention_slots(attrs: dict[str, Any]) -> dict[int, int]:
    """Where attention's optional operands are among a node's inputs (slot -> input index): q_positions
    (3) and kv_lengths (4) unless ``absent`` names them, then attention_partial's append form's k_new (5)
    and v_new (6), which a node has where it carries rope's attributes (attention_split.py), then the
    mask (MASK) where the node is ``masked``."""
    slots = [s for s in (3, 4) if s not in attrs.get("absent", ())] + ([5, 6] if "theta" in attrs else [])
    slots += [MASK] if attrs.get("masked") else []
    return {s: 3 + n for n, s in enumerate(slots)}


def mask_box(mask: Any, b: int, h0: int, h1: int, q0: int, q1: int, k0: int, k1: int) -> Box:
    """The box of attention's mask (broadcasting to [batch, heads, queries, keys], right-aligned) that
    the rows of batch item b, query heads [h0, h1), queries [q0, q1) read over keys [k0, k1)."""
    full = ((b, b + 1), (h0, h1), (q0, q1), (k0, k1))[4 - mask.ndim :]
    lo = tuple(0 if n == 1 else a for n, (a, _) in zip(mask.shape, full))
    hi = tuple(1 if n == 1 else c for n, (_, c) in zip(mask.shape, full))
    return Box(lo, hi)


def _attention_tiles(node: Any, params: dict[str, int], ctx: TileContext, splits: int | None) -> list[Tile]:
    """Tiles of attention (``splits`` None: all keys, output [b, h, q, dv]) or of attention_partial
    (one key range each, output [b, h, q, split, dv + 2])."""
    q, k, v = node.inputs[:3]
    slot = attention_slots(node.attrs)  # the optional operands' inputs
    b, hq, tq, d = q.shape
    hkv, tk, dv = k.shape[1], k.shape[2], v.shape[3]
    group = hq // hkv
    chunk = tk if splits is None else -(-tk // splits)
    ranges = [(min(tk, sp * chunk), min(tk, (sp + 1) * chunk)) for sp in range(splits or 1)]
    # Query blocks of up to q_block queries, a 16-query unit per warp at most: a larger block shares
    # each staged key block among more queries, worth it while the op still makes about as many tiles
    # as processors; halved (to 64 at least) where it would not (docs/experiments.md). (The split
    # form's tiles keep q_block: they never take the tensor-core path.)
    qb = min(params["q_block"], tq, 16 * ctx.warps if splits is None else tq)
    while qb > 64 and 4 * b * hq * -(-tq // qb) < 3 * ctx.processors:
        qb = max(64, qb // 2)
    # All query heads of a kv head share its keys; but when that makes fewer tiles than processors
    # (decode: one tile per kv head), tiles take fewer query heads each, re-reading the keys (from L2).
    blocks = b * hkv * -(-tq // qb) * len(ranges)
    hb = next((n for n in range(group, 0, -1) if group % n == 0 and blocks * (group // n) >= ctx.processors), 1)
    tiles = []
    for bi in range(b):
        for h in range(hkv):
            for j in range(0, group, hb):
                h0, h1 = h * group + j, h * group + j + hb
                for s in range(0, tq, qb):
                    e = min(tq, s + qb)
                    for sp, (lo, hi) in enumerate(ranges):
                        reads = [Read(0, Box((bi, h0, s, 0), (bi + 1, h1, e, d)))]
                        if lo < hi:  # an empty range reads no key (and writes m = -inf, l = 0)
                            reads.append(Read(1, Box((bi, h, lo, 0), (bi + 1, h + 1, hi, d))))
                            reads.append(Read(2, Box((bi, h, lo, 0), (bi + 1, h + 1, hi, dv))))
                        if 3 in slot:
                            reads.append(Read(slot[3], Box((bi, s), (bi + 1, e))))
                        if 4 in slot:
                            reads.append(Read(slot[4], Box((bi,), (bi + 1,))))
                        if MASK in slot and lo < hi:  # (the range's every key: the append form's is data)
                            mask = node.inputs[slot[MASK]]
                            reads.append(Read(slot[MASK], mask_box(mask, bi, h0, h1, s, e, lo, hi)))
                        # the append form: every range may hold the new key (a position is data)
                        for n, width in ((5, d), (6, dv)):
                            if n in slot:
                                reads.append(Read(slot[n], Box((bi, h, 0, 0), (bi + 1, h + 1, 1, width))))
                        flops = 2 * hb * (e - s) * (hi - lo) * (d + dv)
                        if splits is None:
                            obox, coords = Box((bi, h0, s, 0), (bi + 1, h1, e, dv)), (bi, h0, s // qb)
                        else:
                            obox = Box((bi, h0, s, sp, 0), (bi + 1, h1, e, sp + 1, dv + 2))
                            coords = (bi, h0, s // qb, sp)
                        tiles.append(Tile(coords, tuple(reads), (Write(0, obox),), flops))
    return tiles


ATTENTION = Tiling(
    {"q_block": same(128)},
    lambda node, params, ctx: _attention_tiles(node, params, ctx, None),
    "a block of queries of the query heads sharing one kv head (fewer heads per tile when tiles would be few)",
)


ATTENTION_PARTIAL = Tiling(
    {"q_block": {"sm_80": 64, "sm_86": 64, "sm_89": 64, "sm_90": 64}},
    lambda node, params, ctx: _attention_tiles(node, params, ctx, node.attrs["splits"]),
    "one key range of a block of queries of the query heads sharing one kv head",
)


def _attention_combine(node: Any, params: dict[str, int], ctx: TileContext) -> list[Tile]:
    x, out = node.inputs[0], node.outputs[0]
    per_row = x.shape[3] * x.shape[4]
    rows = max(1, params["elements"] // per_row)
    if params["warp_rows"]:  # at most a row (batch, head, query) a warp: one round of the block's warps
        rows = min(rows, ctx.warps)
    tiles = []
    for i, box in enumerate(chunks(out.shape[:3], rows)):
        xbox = Box(box.lo + (0, 0), box.hi + x.shape[3:])
        obox = Box(box.lo + (0,), box.hi + (out.shape[3],))
        tiles.append(Tile((i,), (Read(0, xbox),), (Write(0, obox),), 3 * xbox.size))
    return tiles


# warp_rows: a tile holds at most as many rows as the block has warps (the template takes a warp a row,
# each two dependent trips to L2; more rows are rounds of warps on the critical path of every layer).
# 0: ``elements`` values a tile, as plan files saved before the switch were made.
ATTENTION_COMBINE = Tiling(
    {"elements": ELEMENTS, "warp_rows": same(1)},
    _attention_combine,
    "blocks of rows, each reading all its key ranges; warp_rows: 0 or 1",
    flags=("warp_rows",),
    saved_without={"warp_rows": 0},
)


def _kv_update(node: Any, params: dict[str, int], ctx: TileContext) -> list[Tile]:
    cache, new, pos = node.inputs
    b, h, s, d = cache.shape
    tiles = []
    for bi in range(b):
        for hi in range(h):
            slab = Box((bi, hi, 0, 0), (bi + 1, hi + 1, s, d))
            reads = (
                Read(0, slab),
                Read(1, Box((bi, hi, 0, 0), (bi + 1, hi + 1, new.shape[2], d))),
                Read(2, Box((bi, 0), (bi + 1, pos.shape[1]))),
            )
            # the rows written depend on the positions' values: the whole slab is declared
            moved = 2 * new.shape[2] * d * cache.dtype.itemsize + pos.shape[1] * pos.dtype.itemsize
            tiles.append(Tile((bi, hi), reads, (Write(0, slab),), 0, moved))
    return tiles


KV_UPDATE = Tiling({}, _kv_update, "one (batch, kv head) slab of the cache")


def _concat(node: Any, params: dict[str, int], ctx: TileContext) -> list[Tile]:
    out = node.outputs[0]
    axis = node.attrs["axis"]
    starts, at = [], 0
    for t in node.inputs:
        starts.append(at)
        at += t.shape[axis]
    tiles = []
    for i, box in enumerate(chunks(out.shape, params["elements"])):
        reads = []
        for k, t in enumerate(node.inputs):
            lo = max(box.lo[axis], starts[k])
            hi = min(box.hi[axis], starts[k] + t.shape[axis])
            if lo < hi:
                reads.append(Read(k, box.replace(axis, lo - starts[k], hi - starts[k])))
        tiles.append(Tile((i,), tuple(reads), (Write(0, box),), 0))
    return tiles


CONCAT = Tiling({"elements": ELEMENTS}, _concat, "row-major chunks of the output, reading the pieces they cover")


# ---- collectives: a tile reads its box of every member's operand (pulled over NVLink) ----------


def _members(node: Any, ctx: TileContext) -> tuple[int, ...]:
    return node.attrs["group"]


def _exchange_elements(params: dict[str, int], shape: tuple[int, ...], ctx: TileContext) -> int:
    """Elements per exchange task: ``elements``, raised (to whole 64-element runs, so that packed
    loads line up) until the op makes no more than ``waves`` tasks per processor: 256 MB in 4096-element
    tiles would be 32768 tasks a rank, each paying its waits and signal."""
    elements = _elements(params, math.prod(shape), ctx)
    return elements if elements == params["elements"] else -(-elements // 64) * 64


def _all_reduce(node: Any, params: dict[str, int], ctx: TileContext) -> list[Tile]:
    out = node.outputs[0]
    members = _members(node, ctx)
    if params["push"]:
        boxes = list(chunks(out.shape, _push_elements(params, math.prod(out.shape), ctx)))
        if pushable(node, boxes):
            # each member's tile i pushes its own box of x to the others and sums what they pushed: it
            # reads only this rank's x (the members meet in the tile: megaloop.plan.rendezvous)
            others = node.inputs[0].dtype.itemsize * (len(members) - 1)
            return [
                Tile((i,), (Read(0, box),), (Write(0, box),), box.size * len(members), pushed=box.size * others)
                for i, box in enumerate(boxes)
            ]
    return [
        Tile((i,), tuple(Read(0, box, m) for m in members), (Write(0, box),), box.size * len(members))
        for i, box in enumerate(chunks(out.shape, _exchange_elements(params, out.shape, ctx)))
    ]


def _push_elements(params: dict[str, int], total: int, ctx: TileContext) -> int:
    """Elements per pushed tile: at least ``push_elements``, and few enough tiles for one wave over the
    processors. A pushed hop costs about one trip whatever the tile, so tiles on more processors at
    once win, and so do fewer larger tiles once there are more than processors (docs/experiments.md)."""
    spread = -(-total // ctx.processors)
    return params["push_elements"] if spread <= params["push_elements"] else -(-spread // 64) * 64


PUSH_ALIGN = 16  # bytes: a pushed tile moves 16-byte lines, so x and every tile start on a line
# Above this, all_reduce pulls: a pushed all-reduce keeps two slots of the whole tensor per other
# member (iteration parity), 2 (n - 1) x its bytes. Pushed is faster at every size measured (32 KB to
# 256 MB, docs/experiments.md); set the tile parameter push to 0 to save the memory.
PUSH_MAX_BYTES = 1 << 30


def pushable(node: Any, boxes: list[Box]) -> bool:
    """Whether an all_reduce pushes: x one contiguous run starting on a 16-byte line (its storage
    offset) and of at most PUSH_MAX_BYTES, every tile a run starting on a line, elements of at most 8
    bytes (a line holds whole elements of one tile). Otherwise its tiles pull the members' boxes."""
    x = node.inputs[0]
    item = x.dtype.itemsize
    if not x.is_contiguous or (x.offset * item) % PUSH_ALIGN or item > 8 or len(node.attrs["group"]) < 2:
        return False
    if x.size * item > PUSH_MAX_BYTES:
        return False
    strides = contiguous_strides(tuple(x.shape))
    return all(sum(lo * st for lo, st in zip(b.lo, strides)) * item % PUSH_ALIGN == 0 for b in boxes)


def _all_gather(node: Any, params: dict[str, int], ctx: TileContext) -> list[Tile]:
    out = node.outputs[0]
    axis = node.attrs["axis"]
    piece = node.inputs[0].shape[axis]
    tiles = []
    for i, box in enumerate(chunks(out.shape, _exchange_elements(params, out.shape, ctx))):
        reads = []
        for j, m in enumerate(_members(node, ctx)):
            lo, hi = max(box.lo[axis], j * piece), min(box.hi[axis], (j + 1) * piece)
            if lo < hi:
                reads.append(Read(0, box.replace(axis, lo - j * piece, hi - j * piece), m))
        tiles.append(Tile((i,), tuple(reads), (Write(0, box),), 0))
    return tiles


def _reduce_scatter(node: Any, params: dict[str, int], ctx: TileContext) -> list[Tile]:
    out = node.outputs[0]
    axis = node.attrs["axis"]
    members = _members(node, ctx)
    shift = members.index(ctx.rank) * out.shape[axis]
    tiles = []
    for i, box in enumerate(chunks(out.shape, _exchange_elements(params, out.shape, ctx))):
        src = box.replace(axis, box.lo[axis] + shift, box.hi[axis] + shift)
        tiles.append(Tile((i,), tuple(Read(0, src, m) for m in members), (Write(0, box),), box.size * len(members)))
    return tiles


def _recv(node: Any, params: dict[str, int], ctx: TileContext) -> list[Tile]:
    out = node.outputs[0]
    if params["push"]:  # the send's tiles store it here (_send): nothing left to do on this rank
        return []
    return [
        Tile((i,), (Read(PEER_SEND, box, node.attrs["src"]),), (Write(0, box),), 0)
        for i, box in enumerate(chunks(out.shape, _exchange_elements(params, out.shape, ctx)))
    ]


def _send(node: Any, params: dict[str, int], ctx: TileContext) -> list[Tile]:
    """A send has tiles only when its recv pushes (the planner makes its op only then): each stores a
    chunk of x straight into the recv's output on rank dst."""
    x = node.inputs[0]
    out = []
    for i, box in enumerate(chunks(x.shape, _exchange_elements(params, x.shape, ctx))):
        nbytes = box.size * x.dtype.itemsize
        out.append(Tile((i,), (Read(0, box),), (Write(PEER_RECV, box, node.attrs["dst"]),), 0, nbytes, nbytes))
    return out


EXCHANGE = {"elements": same(4096), "waves": WAVES}
COPY_EXCHANGE = {"elements": same(8192), "waves": WAVES}
# push: 1 (default) = each member pushes its tiles into the others' memory (one NVLink trip, no
# waits across ranks); 0 = each member pulls the others' tiles (a wait on the producers, then a read
# across the link and back)
# push_elements: the smallest pushed tile, 1024 elements (2 KB in bf16: small tensors go faster on
# more processors at once, docs/experiments.md)
ALL_REDUCE = Tiling(
    {**EXCHANGE, "push": same(1), "push_elements": same(1024)},
    _all_reduce,
    "chunks; each sums its chunk of every member in rank order (pushed to each other, or pulled)",
    flags=("push",),
)
ALL_GATHER = Tiling(COPY_EXCHANGE, _all_gather, "chunks of the output, read from the members they cover")
REDUCE_SCATTER = Tiling(EXCHANGE, _reduce_scatter, "chunks of this rank's piece of the sum")
# push on a recv: 0 (default) = its tiles pull the chunks from the sender's memory after waiting for
# the send's producers; 1 = the send gets the tiles: each stores its chunk into this rank's memory and
# releases a counter that the recv's consumers wait on here (CPU-checked; not yet measured on GPUs)
RECV = Tiling(
    {**COPY_EXCHANGE, "push": same(0)},
    _recv,
    "chunks of the received tensor, read from the sender (or, push 1, stored by the send's tiles)",
    flags=("push",),
)
SEND = Tiling(COPY_EXCHANGE, _send, "chunks of x stored into the recv's output on dst (a pushing recv's send)")

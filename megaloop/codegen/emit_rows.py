"""C++ for the row ops' tiles (softmax / log_softmax along an axis, layernorm / rmsnorm along the
last): a warp per row for short rows, a group of warps per row (the whole block, or one of its groups
each on rows of its own) for long ones, rows streaming through a ring in shared memory."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megaloop.codegen.emit import Operand, float_literal, pointers
from megaloop.frontend.ops.normalization import LAYERNORM_OPERANDS, RMSNORM_OPERANDS

NORM_OPERANDS = {"layernorm": LAYERNORM_OPERANDS, "rmsnorm": RMSNORM_OPERANDS}  # after x, by name

# A row of at least this many 16-byte packs is spread over the whole block (held in registers, one
# DRAM read, block-wide reductions); shorter rows get a warp each. Decode's rmsnorm over 2048 bf16 on
# one warp took 7.7 us of a 550 us step; 8192-wide rows on a warp each reached 0.3 of copy bandwidth.
BLOCK_ROW_PACKS = 128
BLOCK_ROW_MAX_PACKS_PER_THREAD = 16  # register budget: 16 packs of 16 bytes = 64 registers
BLOCK_ROW_MIN_THREADS = 256  # the block path's registers are sized for at least this many threads
# The next rows stream into a ring of row slots in shared memory (cp.async) while one row is reduced:
# up to ROW_RING_ROWS rows in ROW_RING_BYTES (two rows where they are longer), and never more than
# three quarters of the plan's shared memory (one slot on an RTX card for 64 KB rows: no read-ahead).
# Rows held in registers instead left rmsnorm at 0.48 of copy bandwidth on an H200 whether 2 or 4 rows
# were in flight: each row's block reduction (a barrier) waited for every load into registers still
# in flight, so nothing streamed across it. A cp.async copy in flight is not waited for by a barrier.
ROW_RING_ROWS = 8
ROW_RING_BYTES = 96 * 1024
# The block splits into up to ROW_GROUPS groups of warps, each reducing rows of its own behind its own
# named barrier, where the task has that many rows and the op's ROW_GROUP_LIMITS hold: packs a thread
# at most, ring slots a group at least. Why: with the whole block on one row, every warp is in the same
# phase at once (all loading, all waiting on shuffles, all on the exponentials' MUFU pipe), at 2 warps
# a scheduler: rmsnorm and softmax issued ~30 % of the time (0.79 and 0.47 of copy bandwidth at 8192
# bf16 a row on an H200). Measured there (docs/experiments.md, 764330b): rmsnorm 0.80 -> 0.83-0.86
# with 2 groups of 8 packs (4 groups of 16 packs: 0.80, its weight no longer fits in registers);
# softmax 0.67 (one group) -> 0.78-0.80 (2 groups of 8 packs, exps kept) -> 0.85 (4 groups of 16
# packs, one slot each, exps recomputed: more rows in flight beats fewer exponentials).
ROW_GROUPS = 4
ROW_GROUP_LIMITS = {"softmax": (16, 1), "log_softmax": (16, 1)}  # (max packs a thread, min slots a group)
ROW_GROUP_DEFAULT_LIMITS = (8, 2)  # norms keep their weight's packs in registers beside the row's
ROW_GROUP_MIN_WARPS = 2
SOFTMAX_KEPT_EXPS = 64  # floats a thread keeps between softmax's sum and store passes
ROW_ACCUMULATORS = 4  # independent partial maxima / sums a thread keeps over its packs of a row


def norm_inputs(op: str, attrs: dict[str, Any], n_inputs: int) -> dict[str, int]:
    """A norm's present operands after x by name -> their index among its ``n_inputs`` inputs. Graphs
    saved before the residual operand do not list it as absent: operands past the inputs are absent."""
    absent = attrs.get("absent", ())
    present = [nm for k, nm in enumerate(NORM_OPERANDS.get(op, ()), start=1) if k not in absent]
    return {nm: i for i, nm in enumerate(present[: n_inputs - 1], start=1)}


def _residual(op: str, attrs: dict[str, Any], ins: list[Operand]) -> int | None:
    """The input index of a norm's residual (added to x before normalising), or None."""
    return norm_inputs(op, attrs, len(ins)).get("residual")


def _packed_rows(op: str, attrs: dict[str, Any], ins: list[Operand], out: Operand) -> tuple[int, int] | None:
    """(width, packs a row) of the packed paths' rows, or None when a row is not whole aligned packs
    along the last axis."""
    x = ins[0]
    nd = len(x.shape)
    axis = attrs.get("axis", nd - 1)
    width = 16 // max(o.dtype.itemsize for o in ins + [out])
    res = _residual(op, attrs, ins)
    rows_like = [x, out] + ([ins[res]] if res else [])  # laid out in rows of x's shape
    packed = (
        axis == nd - 1
        and x.shape[axis] % width == 0
        and all(o.strides[-1] == 1 and all(st % width == 0 for st in o.strides[:-1]) for o in rows_like)
        and all(o.strides[0] == 1 for k, o in enumerate(ins) if k and k != res)
    )
    return (width, x.shape[axis] // width) if packed else None


@dataclass(frozen=True)
class BlockRows:
    """The block-per-row path's layout of an op's rows: ``groups`` groups of ``threads`` threads each
    reduce rows of their own (group g rows g, g + groups, ...), a thread holding ``held`` packs of
    ``width`` elements of its row; ``ring`` row slots in shared memory, ``ring // groups`` a group."""

    width: int
    packs: int
    groups: int
    threads: int
    held: int
    ring: int


def block_rows(op: str, attrs: dict[str, Any], ins: list[Operand], out: Operand) -> BlockRows | None:
    """The block-per-row layout, or None when the op takes the warp-per-row paths (``attrs["codegen"]``:
    the plan's ``shared_memory`` per block, ``threads`` a block, the largest tile's ``elements``)."""
    hints = attrs.get("codegen", {})
    packed = _packed_rows(op, attrs, ins, out)
    block = hints.get("threads", BLOCK_ROW_MIN_THREADS)
    if packed is None or block < BLOCK_ROW_MIN_THREADS or block % 32:
        return None  # (a block of fewer threads never takes the block path: no ring to reserve)
    width, packs = packed
    if packs < BLOCK_ROW_PACKS or -(-packs // block) > BLOCK_ROW_MAX_PACKS_PER_THREAD:
        return None
    row = packs * 16 * (2 if _residual(op, attrs, ins) else 1)  # a residual's row streams beside x's
    ring = min(ROW_RING_ROWS, max(ROW_RING_BYTES, 2 * row) // row, hints.get("shared_memory", 0) * 3 // 4 // row)
    # no more slots than the op's largest tile has rows (decode: one row, one slot; the ring's loop is
    # unrolled once per slot, and that code is fetched afresh every iteration)
    elements = hints.get("elements")
    tile_rows = -(-elements // (packs * width)) if elements else ROW_RING_ROWS
    ring = max(1, min(ring, tile_rows)) if ring else 0
    if not ring:
        return None
    max_packs, min_slots = ROW_GROUP_LIMITS.get(op, ROW_GROUP_DEFAULT_LIMITS)
    groups = 1
    while (
        2 * groups <= min(ROW_GROUPS, tile_rows, ring // min_slots)
        and block % (2 * groups * 32) == 0
        and block // (2 * groups) >= 32 * ROW_GROUP_MIN_WARPS
        and -(-packs // (block // (2 * groups))) <= max_packs
    ):
        groups *= 2
    threads = block // groups
    return BlockRows(width, packs, groups, threads, -(-packs // threads), ring // groups * groups)


def rows_shared_bytes(op: str, attrs: dict[str, Any], ins: list[Operand], out: Operand) -> int:
    layout = block_rows(op, attrs, ins, out)
    return layout.ring * layout.packs * 16 * (2 if _residual(op, attrs, ins) else 1) if layout else 0


def _at(o: Operand, pointer: str) -> str:
    """``ml::at<strides...>(pointer)`` (megaloop/elementwise.cuh)."""
    return f"ml::at<{', '.join(str(st) for st in o.strides)}>({pointer})"


ROW_OPS = {
    "softmax": "ml::ROW_SOFTMAX",
    "log_softmax": "ml::ROW_LOG_SOFTMAX",
    "layernorm": "ml::ROW_LAYERNORM",
    "rmsnorm": "ml::ROW_RMSNORM",
}


def rows(op: str, attrs: dict[str, Any], ins: list[Operand], out: Operand) -> list[str]:
    """softmax / log_softmax along an axis, layernorm / rmsnorm along the last (``ml::rows``,
    megaloop/rows.cuh): a warp per row, or groups of warps per row for long rows (``attrs["codegen"]``,
    see ``block_rows``), with packed loads when the row is contiguous and aligned. Python picks the
    paths' layout; the loops, reductions and the ring in shared memory are the header's."""
    x = ins[0]
    axis = attrs.get("axis", len(x.shape) - 1)
    wk = norm_inputs(op, attrs, len(ins))
    packed = _packed_rows(op, attrs, ins, out)
    width = packed[0] if packed else 1
    block = block_rows(op, attrs, ins, out) if packed else None
    notes = []
    layout = "ml::BlockRows<>"
    if block:
        G, T, held = block.groups, block.threads, block.held
        parts = min(ROW_ACCUMULATORS, held)
        if op in ("softmax", "log_softmax"):
            # softmax keeps each exponential for the store pass (registers: at most SOFTMAX_KEPT_EXPS
            # a thread) instead of computing it twice
            keep = op == "softmax" and held * width <= SOFTMAX_KEPT_EXPS
        else:
            # the weight's and bias's packs stay in registers for the whole task where they fit beside
            # the row's (at most BLOCK_ROW_MAX_PACKS_PER_THREAD packs a thread in all: more spilled)
            keep = held * (1 + len([nm for nm in wk if nm != "residual"])) <= BLOCK_ROW_MAX_PACKS_PER_THREAD
        layout = f"ml::BlockRows<{G}, {T}, {held}, {block.ring}, {parts}, {'true' if keep else 'false'}>"
        notes.append(
            f"// {'a block' if G == 1 else f'{G} groups of {T} threads'} per row, {held} pack(s) of {width} a "
            f"thread, {block.ring} rows streaming through shared memory"
        )
    if packed:
        notes.append(f"// packed path: a warp per row, {width} elements per load")

    def operand(name: str) -> str:  # (the weight and bias 1-D, the residual in x's index space)
        return _at(ins[wk[name]], f"in{wk[name]}") if name in wk else "ml::Absent{}"

    eps = float_literal(attrs["eps"]) if "eps" in attrs else "0.0f"
    args = [eps, _at(out, "out0"), _at(x, "in0"), operand("residual"), operand("weight"), operand("bias")]
    return [
        *pointers(ins + [out], len(ins)),
        *notes,
        f"ml::rows<{ROW_OPS[op]}, {axis}, {x.shape[axis]}, {width}, {layout}>(t, {', '.join(args)});",
    ]

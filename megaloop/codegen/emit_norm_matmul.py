"""rmsnorm_matmul's tile: the rmsnorm op's own tile code (emit_rows.rows) norms the tile's rows of x
into shared memory, then matmul's paths (emit_matmul: the skinny tensor-core path for a decode step)
multiply them, reading A from there. The rows hold the same bits as rmsnorm's output would (the same
code, block and reduction order), so the product is matmul's of the stored norm.

Shared memory: the matmul's partial sums and the norm's ring of rows from offset 0 (the norm is done,
behind a barrier, before the first partial sum is written), then x's rows normed: all of x's rows
(at most RMSNORM_MATMUL_MAX_ROWS), each at its row-major place, rows padded 64 bytes past a multiple of
128 so that the rows a 16-byte load phase reads fall in different banks."""

from __future__ import annotations

import math
from typing import Any

from megaloop.codegen.emit import Operand, pointers
from megaloop.codegen.emit_matmul import (
    WGMMA_STATIC_RESERVE,
    _pad_row,
    _simt,
    _skinny_frame,
    matmul_shared_bytes,
    skinny_mma_warps,
)
from megaloop.codegen.emit_rows import rows, rows_shared_bytes
from megaloop.errors import GraphBuildError

# True: the skinny tensor-core path issues each warp's first weights before the rows are normed
# (ml::mma_skinny_after), so the norm runs while they come from DRAM; False: the norm, a barrier, then
# the matmul (measured at 3a58a32 / 2cc241c: each tile ~2 us longer than the matmul alone)
NORM_UNDER_WEIGHTS = True

# True: the prologue norms long rows on rmsnorm's block path (the norm op's own layout: the same bits as
# its output); False: a warp a row (rmsnorm's packed warp path: no ring, no block reductions)
NORM_BLOCK_PATH = True


def _rows_operand(x: Operand) -> Operand:
    """x's rows as they lie in shared memory: row-major, each row ``_pad_row`` bytes apart."""
    pitch = _pad_row(x.shape[-1] * x.dtype.itemsize) // x.dtype.itemsize
    strides = [1, pitch]
    for n in reversed(x.shape[1:-1]):
        strides.append(strides[-1] * n)
    return Operand(x.dtype, x.shape, tuple(reversed(strides))[-len(x.shape) :])


def _norm_parts(attrs: dict[str, Any], ins: list[Operand]) -> tuple[dict[str, Any], list[Operand], Operand, int]:
    """The rmsnorm op's attrs (with the hints its block path sizes its ring by), its operands (x,
    weight, residual), its output (x's rows in shared memory) and the rows' bytes."""
    x = ins[0]
    rows_op = _rows_operand(x)
    a_bytes = rows_op.strides[0] * x.shape[0] * x.dtype.itemsize if len(x.shape) > 1 else 0
    hints = attrs["codegen"]
    room = hints.get("shared_memory", 0) - a_bytes - WGMMA_STATIC_RESERVE
    tile_rows = max(1, hints.get("tile", (1, 0))[0])
    threads = 32 * hints["warps"] if NORM_BLOCK_PATH else 32  # (fewer than 256: the warp-per-row paths)
    norm_hints = {"shared_memory": max(0, room), "threads": threads, "elements": tile_rows * x.shape[-1]}
    norm_attrs = {"eps": attrs["eps"], "codegen": norm_hints, **({} if len(ins) > 3 else {"absent": (2,)})}
    return norm_attrs, [x, ins[2], *ins[3:]], rows_op, a_bytes


def _rows_offset(attrs: dict[str, Any], ins: list[Operand], out: Operand) -> int:
    """Where x's normed rows start in dynamic shared memory: past the matmul's partial sums and the
    norm's ring (both from offset 0), at a multiple of 128 bytes."""
    norm_attrs, norm_ins, rows_op, _ = _norm_parts(attrs, ins)
    partial = matmul_shared_bytes(attrs, [rows_op, ins[1]], out)
    ring = rows_shared_bytes("rmsnorm", norm_attrs, norm_ins, rows_op)
    return -(-max(partial, ring) // 128) * 128


def rmsnorm_matmul_shared_bytes(attrs: dict[str, Any], ins: list[Operand], out: Operand) -> int:
    _, _, _, a_bytes = _norm_parts(attrs, ins)
    total = _rows_offset(attrs, ins, out) + a_bytes
    budget = attrs["codegen"].get("shared_memory", 0)
    if total + WGMMA_STATIC_RESERVE > budget:
        raise GraphBuildError(
            f"rmsnorm_matmul: x's {math.prod(ins[0].shape[:-1])} rows of {ins[0].shape[-1]} "
            f"({a_bytes} bytes normed) do not fit the plan's {budget} bytes of shared memory a block; "
            "use rmsnorm, then matmul"
        )
    return total


# Bytes of each of its first 8 columns that a warp of a skinny tile asks the copy engine to bring into L2
# (cp.async.bulk.prefetch, sm_90) from where its own units start, before the rows are normed: the
# weights' first trips from DRAM then overlap the norm instead of following it. 0: none.
PREFETCH_B_BYTES = 0


def _prefetch_b(attrs: dict[str, Any], rows_op: Operand, b: Operand, out: Operand) -> list[str]:
    """Each warp's first PREFETCH_B_BYTES of B's columns its units start on, into L2, where the tile
    takes the skinny tensor-core path (the same guard)."""
    warps = skinny_mma_warps(attrs, rows_op, b)
    if not PREFETCH_B_BYTES or not warps:
        return []
    f = _skinny_frame(rows_op, b, out, warps, attrs)
    k = rows_op.shape[-1]
    c_ = len(out.shape) - 1
    size = b.dtype.itemsize
    return [
        "#if __CUDA_ARCH__ >= 900",
        f["batches"],
        f"if ({f['guard']}) {{  // B's first bytes on their way into L2 while the rows are normed",
        f"    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, ncols = t.hi[{c_}] - t.lo[{c_}];",
        f"    const int units = (ncols + 7) / 8 * {k // 32}, first = warp * units / {warps};",
        f"    if (lane < 8 && first < (warp + 1) * units / {warps}) {{",
        f"        const int col = min(8 * (first / {k // 32}) + lane, ncols - 1), k0 = 32 * (first % {k // 32});",
        f"        const unsigned bytes = min({PREFETCH_B_BYTES}, ({k} - k0) * {size});",
        f"        const {b.ctype}* p = in1 + {f['bb']} + (ml::i64)col * {f['b_col']} + k0;",
        '        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");',
        "    }",
        "}",
        "#endif",
    ]


def rmsnorm_matmul(op: str, attrs: dict[str, Any], ins: list[Operand], out: Operand) -> list[str]:
    x, b = ins[0], ins[1]
    norm_attrs, norm_ins, rows_op, _ = _norm_parts(attrs, ins)
    offset = _rows_offset(attrs, ins, out)
    norm = rows("rmsnorm", norm_attrs, norm_ins, rows_op)
    n_ptrs = len(norm_ins) + 1
    if not all(line.startswith("[[maybe_unused]]") for line in norm[:n_ptrs]):
        raise AssertionError("emit_rows.rows no longer starts with its operands' pointers")
    # the norm's operands: x (in0), the weight (in2), the residual (in3); its output: the rows here
    norm_ptrs = [
        f"[[maybe_unused]] const {o.ctype}* in{k} = (const {o.ctype}*)(a.arena + off[{slot}]);"
        for k, (o, slot) in enumerate(zip(norm_ins, (0, 2, 3)))
    ] + [f"[[maybe_unused]] {x.ctype}* out0 = normed;"]
    nd = len(out.shape)
    ct = x.ctype
    lines = [
        *pointers([*ins, out], len(ins)),
        *_prefetch_b(attrs, rows_op, b, out),
        "extern __shared__ float4 ml_smem4[];",
        f"{ct}* const normed = reinterpret_cast<{ct}*>(reinterpret_cast<char*>(ml_smem4) + {offset});"
        f"  // x's rows normed, {rows_op.strides[-2]} elements apart",
        "// rmsnorm of the tile's rows of x (+ residual) into shared memory: the rmsnorm op's tile code",
        "auto norm_rows = [&](const ml::Task& t) {",
        *("    " + line for line in norm_ptrs + norm[n_ptrs:]),
        "};",
    ]
    task = [
        "ml::Task nt = t;  // the same rows, all of K",
        f"nt.lo[{nd - 1}] = 0;",
        f"nt.hi[{nd - 1}] = {x.shape[-1]};",
    ]
    norm_then_barrier = [
        "norm_rows(nt);",
        "__syncthreads();  // every row normed (and the ring's last reads done before the partial sums)",
    ]
    if NORM_UNDER_WEIGHTS:  # inside the matmul's paths: the skinny one issues its first weights first
        return [
            *lines,
            *task,
            "{  // matmul's paths, A (in0) the rows normed",
            f"    [[maybe_unused]] const {ct}* in0 = normed;",
            *("    " + line for line in _simt(attrs, rows_op, b, out, norm_then_barrier)),
            "}",
        ]
    return [
        *lines,
        *task,
        *norm_then_barrier,
        "{  // matmul's paths, A (in0) the rows normed",
        f"    [[maybe_unused]] const {ct}* in0 = normed;",
        *("    " + line for line in _simt(attrs, rows_op, b, out)),
        "}",
    ]

"""The tiles of the matmuls that make their own A (decode's few rows) in shared memory first, with the
producing op's own tile code, then run matmul's paths (emit_matmul: the skinny tensor-core path for a
decode step) reading A from there. The rows hold the bits the producing op would have stored (the same
code, block and reduction order), so the product is matmul's of that op's output.

- rmsnorm_matmul (a, b, norm_weight[, residual]): the rmsnorm op's tile code (emit_rows.rows) norms the
  tile's rows of a (+ residual);
- silu_mul_matmul (gate, b, up): silu_mul's elementwise tile code (emit.elementwise).

Shared memory: the matmul's partial sums and the producing op's own (the norm's ring of rows) from offset
0 (the rows are made, behind a barrier, before the first partial sum is written), then A's rows: all
of them (at most 8), each at its row-major place, padded 64 bytes past a multiple of 128 so that the
rows a 16-byte load phase reads fall in different banks."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from megaloop.codegen.emit import Operand, elementwise, pointers
from megaloop.codegen.emit_matmul import (
    WGMMA_STATIC_RESERVE,
    _pad_row,
    _simt,
    matmul_shared_bytes,
)
from megaloop.codegen.emit_rows import rows, rows_shared_bytes
from megaloop.errors import GraphBuildError
from megaloop.frontend.opdef import REGISTRY

# True: the skinny tensor-core path issues each warp's first weights before A's rows are made
# (ml::mma_skinny_after), so that runs while they come from DRAM; False: the rows, a barrier, then the
# matmul (rmsnorm_matmul measured at 3a58a32 / 2cc241c: each tile ~2 us longer than the matmul alone;
# at 51975fe with this on, no faster either: docs/runtime.md)
NORM_UNDER_WEIGHTS = True

# Tried and taken out (docs/runtime.md, H200, 3a58a32 / 2cc241c, decode layer at hidden 2048 / 4096):
# rmsnorm_matmul's rows normed a warp a row instead of on rmsnorm's block path, 71.4 / 148.2 us against
# 65.4-67.0 / 139.7-141.4; each warp's first 2 KB (8 KB) of its columns of B prefetched into L2
# (cp.async.bulk.prefetch) before the norm, 66.5 / 140.9 (66.3 / 161.0).


def _rows_operand(x: Operand) -> Operand:
    """A's rows as they lie in shared memory: row-major, each row ``_pad_row`` bytes apart."""
    pitch = _pad_row(x.shape[-1] * x.dtype.itemsize) // x.dtype.itemsize
    strides = [1, pitch]
    for n in reversed(x.shape[1:-1]):
        strides.append(strides[-1] * n)
    return Operand(x.dtype, x.shape, tuple(reversed(strides))[-len(x.shape) :])


@dataclass(frozen=True)
class Producer:
    """The op whose tile code makes A's rows: its body (its operands' pointers left out), its operands
    with their slots among the fused op's (``off[slot]``), the shared memory it uses from offset 0, and
    A's rows in shared memory (``rows_op``, ``rows_bytes``)."""

    what: str
    body: list[str]
    operands: list[tuple[Operand, int]]
    own_bytes: int
    rows_op: Operand
    rows_bytes: int


def _producer(op: str, attrs: dict[str, Any], ins: list[Operand]) -> Producer:
    x = ins[0]
    rows_op = _rows_operand(x)
    rows_bytes = rows_op.strides[0] * x.shape[0] * x.dtype.itemsize
    hints = attrs["codegen"]
    tile_rows = max(1, hints.get("tile", (1, 0))[0])
    if op == "rmsnorm_matmul":  # a, b, norm_weight[, residual]
        room = hints.get("shared_memory", 0) - rows_bytes - WGMMA_STATIC_RESERVE
        threads = 32 * hints["warps"]
        norm_hints = {"shared_memory": max(0, room), "threads": threads, "elements": tile_rows * x.shape[-1]}
        norm_attrs = {"eps": attrs["eps"], "codegen": norm_hints, **({} if len(ins) > 3 else {"absent": (2,)})}
        norm_ins = [x, ins[2], *ins[3:]]
        body = rows("rmsnorm", norm_attrs, norm_ins, rows_op)
        own = rows_shared_bytes("rmsnorm", norm_attrs, norm_ins, rows_op)
        what = "rmsnorm of the tile's rows of a (+ residual): the rmsnorm op's tile code"
        operands = list(zip(norm_ins, (0, 2, 3)))
    elif op == "silu_mul_matmul":  # gate, b, up
        ew_hints = {"shared_memory": hints.get("shared_memory", 0), "threads": 32 * hints["warps"]}
        ew_hints["elements"] = tile_rows * x.shape[-1]
        expr = REGISTRY["silu_mul"].cuda.expression({})  # silu_mul's own: the same bits as its output
        body = elementwise("silu_mul", {"codegen": ew_hints}, expr, [x, ins[2]], rows_op)
        own, what, operands = 0, "silu(gate) * up of the tile's rows: silu_mul's tile code", [(x, 0), (ins[2], 2)]
    else:
        raise GraphBuildError(f"codegen: {op} makes no A of its own")
    n_ptrs = len(operands) + 1
    if not all(line.startswith("[[maybe_unused]]") for line in body[:n_ptrs]):
        raise AssertionError(f"{op}'s producing template no longer starts with its operands' pointers")
    return Producer(what, body[n_ptrs:], operands, own, rows_op, rows_bytes)


def _rows_offset(attrs: dict[str, Any], ins: list[Operand], out: Operand, p: Producer) -> int:
    """Where A's rows start in dynamic shared memory: past the matmul's partial sums and the producer's
    own (both from offset 0), at a multiple of 128 bytes."""
    partial = matmul_shared_bytes(attrs, [p.rows_op, ins[1]], out)
    return -(-max(partial, p.own_bytes) // 128) * 128


def fused_matmul_shared_bytes(op: str, attrs: dict[str, Any], ins: list[Operand], out: Operand) -> int:
    p = _producer(op, attrs, ins)
    total = _rows_offset(attrs, ins, out, p) + p.rows_bytes
    budget = attrs["codegen"].get("shared_memory", 0)
    if total + WGMMA_STATIC_RESERVE > budget:
        raise GraphBuildError(
            f"{op}: A's {math.prod(ins[0].shape[:-1])} rows of {ins[0].shape[-1]} ({p.rows_bytes} bytes) do not "
            f"fit the plan's {budget} bytes of shared memory a block; use the two ops"
        )
    return total


def fused_matmul(op: str, attrs: dict[str, Any], ins: list[Operand], out: Operand) -> list[str]:
    x, b = ins[0], ins[1]
    p = _producer(op, attrs, ins)
    offset = _rows_offset(attrs, ins, out, p)
    # the producer's operands at their slots among this op's; its output: A's rows in shared memory
    ptrs = [
        f"[[maybe_unused]] const {o.ctype}* in{k} = (const {o.ctype}*)(a.arena + off[{slot}]);"
        for k, (o, slot) in enumerate(p.operands)
    ] + [f"[[maybe_unused]] {x.ctype}* out0 = a_rows;"]
    nd = len(out.shape)
    ct = x.ctype
    lines = [
        *pointers([*ins, out], len(ins)),
        "extern __shared__ float4 ml_smem4[];",
        f"{ct}* const a_rows = reinterpret_cast<{ct}*>(reinterpret_cast<char*>(ml_smem4) + {offset});"
        f"  // A's rows, {p.rows_op.strides[-2]} elements apart",
        f"// {p.what}, into shared memory",
        "auto make_rows = [&](const ml::Task& t) {",
        *("    " + line for line in ptrs + p.body),
        "};",
        "ml::Task nt = t;  // the same rows, all of K",
        f"nt.lo[{nd - 1}] = 0;",
        f"nt.hi[{nd - 1}] = {x.shape[-1]};",
    ]
    then_barrier = [
        "make_rows(nt);",
        "__syncthreads();  // every row made (and the producer's last reads of its shared memory done)",
    ]
    matmul = [
        "{  // matmul's paths, A (in0) the rows made",
        f"    [[maybe_unused]] const {ct}* in0 = a_rows;",
        # inside the matmul's paths: the skinny one issues its first weights first
        *("    " + line for line in _simt(attrs, p.rows_op, b, out, then_barrier if NORM_UNDER_WEIGHTS else None)),
        "}",
    ]
    return [*lines, *([] if NORM_UNDER_WEIGHTS else then_barrier), *matmul]

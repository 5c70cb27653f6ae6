"""What the matmuls that make their own A share (rmsnorm_matmul, silu_mul_matmul: each tile computes the
rows it multiplies into shared memory with the producing op's code, megaloop/codegen/emit_fused_matmul.py):
the limits on those rows, the shape rules on A and b, and matmul's tiling with the producer's reads."""

from __future__ import annotations

import math
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from megaloop.errors import ShapeError
from megaloop.frontend.opdef import OpCall
from megaloop.frontend.ops import _tilings
from megaloop.frontend.ops.elementwise import check_kinds
from megaloop.frontend.tiling import Tile, TileContext, Tiling

# Every tile holds all of A's rows in shared memory (the skinny paths' tiles are at most 8 rows), each
# row padded to 64 bytes past a multiple of 128 (emit_fused_matmul): at most this many bytes of them, so
# that they fit beside the partial sums and the kernel's static shared memory on every architecture
# megaloop plans for (99 KB a block on sm_86 / sm_89)
FUSED_MATMUL_MAX_ROWS = 8
FUSED_MATMUL_MAX_BYTES = 80 * 1024


def a_rows_bytes(shape: tuple[int, ...], itemsize: int) -> int:
    """Shared memory the rows of an A of ``shape`` take in each tile."""
    row = shape[-1] * itemsize
    return math.prod(shape[:-1]) * (row + (64 - row) % 128)


def rows_fit(x: Any) -> bool:
    """Whether a tensor's rows can be a fused matmul's A: at most FUSED_MATMUL_MAX_ROWS of them, in at
    most FUSED_MATMUL_MAX_BYTES."""
    return (
        x.ndim >= 2
        and math.prod(x.shape[:-1]) <= FUSED_MATMUL_MAX_ROWS
        and a_rows_bytes(x.shape, x.dtype.itemsize) <= FUSED_MATMUL_MAX_BYTES
    )


def check_a_and_b(call: OpCall, hint: str) -> int:
    """The rules on operand 0 (A's source, [..., rows, K], float) and operand 1 (b, a 2-D weight,
    transpose_b: stored [N, K]); returns N. ``hint`` names what to use instead."""
    x, b = call.operands[:2]
    a = call.name(0)
    check_kinds(call, x.dtype, "f")
    if call.attrs.setdefault("transpose_a", False):  # (matmul's tiling and paths read it)
        raise call.error(ShapeError, f"{a} cannot be transposed (the rows the op makes are along its last axis)")
    if x.ndim < 2 or b.ndim != 2:
        raise call.error(ShapeError, f"{a} must be [..., rows, K] and b a 2-D weight", hint=hint)
    tb = call.attrs["transpose_b"]
    k, n = (b.shape[1], b.shape[0]) if tb else b.shape
    if x.shape[-1] != k:
        raise call.error(ShapeError, f"{a}'s last axis is {x.shape[-1]} but b's K is {k} (transpose_b={tb})")
    rows = math.prod(x.shape[:-1])
    if rows > FUSED_MATMUL_MAX_ROWS:
        raise call.error(
            ShapeError, f"{a} has {rows} rows; the op takes at most {FUSED_MATMUL_MAX_ROWS} rows", hint=hint
        )
    if a_rows_bytes(x.shape, x.dtype.itemsize) > FUSED_MATMUL_MAX_BYTES:
        raise call.error(
            ShapeError,
            f"{a}'s rows take {a_rows_bytes(x.shape, x.dtype.itemsize)} bytes of shared memory in every tile; "
            f"at most {FUSED_MATMUL_MAX_BYTES}",
            hint=hint,
        )
    return n


def fused_tiling(extra: Callable[[Any, Tile], Tile]) -> Tiling:
    """matmul's tiling (its parameters and switches) of operand 0 against operand 1, each tile then
    given the producer's reads by ``extra(node, tile)``."""

    def tiles(node: Any, params: dict[str, int], ctx: TileContext) -> list[Tile]:
        pair = SimpleNamespace(inputs=node.inputs[:2], outputs=node.outputs, attrs=node.attrs)
        return [extra(node, t) for t in _tilings.MATMUL.make(pair, params, ctx)]

    m = _tilings.MATMUL
    return Tiling(m.params, tiles, f"matmul's tiles ({m.doc})", flags=m.flags, saved_without=m.saved_without)

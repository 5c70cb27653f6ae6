"""A decode matmul that norms its own rows: ``rmsnorm_matmul(x, b, weight, residual)`` is
``matmul(rmsnorm(x, weight, residual=residual), b)`` with the norm's output never stored: each tile
norms the rows of x it multiplies (at most RMSNORM_MATMUL_MAX_ROWS: a decode step's tokens) into
shared memory with the rmsnorm op's own code, then multiplies them. One dependent stage fewer in front
of a layer's q/k/v and gate/up projections (a norm task and its handoff: ~1.3 + ~1.5 us on an H200,
twice a layer), for every tile re-reading a few KB of x from L2. ``rmsnorm_linear`` picks it where it
applies and the two ops elsewhere (prefill: thousands of rows are normed once, not once a column tile).
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import numpy as np

from megaloop.dtypes import as_dtype, round_to
from megaloop.errors import DtypeError, ShapeError
from megaloop.frontend.opdef import Accuracy, CudaTile, OpCall, OpDef, OutSpec, register
from megaloop.frontend.ops import _tilings
from megaloop.frontend.ops._build import apply, require_bool
from megaloop.frontend.ops.elementwise import check_kinds, to_compute
from megaloop.frontend.ops.matmul import _reference as _matmul_reference
from megaloop.frontend.ops.matmul import linear
from megaloop.frontend.ops.normalization import _eps, _rmsnorm_ref, rmsnorm
from megaloop.frontend.shapes import format_shape
from megaloop.frontend.tensor import Tensor
from megaloop.frontend.tiling import Box, Read, Tile, TileContext, Tiling

# Every tile holds all of x's rows in shared memory (the skinny paths' tiles are at most 8 rows), each
# row padded to 64 bytes past a multiple of 128 (emit_fused_matmul): at most this many bytes of them, so
# that they fit beside the partial sums and the kernel's static shared memory on every architecture
# megaloop plans for (99 KB a block on sm_86 / sm_89)
RMSNORM_MATMUL_MAX_ROWS = 8
RMSNORM_MATMUL_MAX_BYTES = 80 * 1024


def a_rows_bytes(shape: tuple[int, ...], itemsize: int) -> int:
    """Shared memory the normed rows of an x of ``shape`` take in each tile."""
    row = shape[-1] * itemsize
    return math.prod(shape[:-1]) * (row + (64 - row) % 128)


def fusable(x: Any, norm_weight: Any, weight: Any) -> bool:
    """Whether rmsnorm_linear(x, norm_weight, weight) is one rmsnorm_matmul: float tensors of one dtype,
    x of at most RMSNORM_MATMUL_MAX_ROWS rows whose normed rows fit RMSNORM_MATMUL_MAX_BYTES, a norm
    weight of x's last axis, a 2-D weight [out, in] of it; otherwise the two ops report what is wrong."""
    return (
        all(isinstance(t, Tensor) for t in (x, norm_weight, weight))
        and x.dtype.is_float
        and x.ndim >= 2
        and weight.ndim == 2
        and weight.shape[1] == x.shape[-1]
        and norm_weight.shape == (x.shape[-1],)
        and x.dtype == weight.dtype == norm_weight.dtype
        and math.prod(x.shape[:-1]) <= RMSNORM_MATMUL_MAX_ROWS
        and a_rows_bytes(x.shape, x.dtype.itemsize) <= RMSNORM_MATMUL_MAX_BYTES
    )


def _infer(call: OpCall) -> list[OutSpec]:
    x, b, w = call.operands[:3]
    check_kinds(call, x.dtype, "f")
    if x.ndim < 2 or b.ndim != 2:
        raise call.error(ShapeError, "a must be [..., rows, K] and b a 2-D weight", hint="use rmsnorm, then matmul")
    if call.attrs.setdefault("transpose_a", False):  # (matmul's tiling and paths read it)
        raise call.error(ShapeError, "a cannot be transposed (its rows are normed along its last axis)")
    tb = call.attrs["transpose_b"]
    k, n = (b.shape[1], b.shape[0]) if tb else b.shape
    if x.shape[-1] != k:
        raise call.error(ShapeError, f"a's last axis is {x.shape[-1]} but b's K is {k} (transpose_b={tb})")
    rows = math.prod(x.shape[:-1])
    if rows > RMSNORM_MATMUL_MAX_ROWS:
        raise call.error(
            ShapeError,
            f"a has {rows} rows; the norm is fused into matmuls of at most {RMSNORM_MATMUL_MAX_ROWS} rows",
            hint="use rmsnorm_linear (it falls back to rmsnorm then linear) or the two ops",
        )
    if a_rows_bytes(x.shape, x.dtype.itemsize) > RMSNORM_MATMUL_MAX_BYTES:
        raise call.error(
            ShapeError,
            f"a's rows take {a_rows_bytes(x.shape, x.dtype.itemsize)} bytes of shared memory in every tile; "
            f"at most {RMSNORM_MATMUL_MAX_BYTES}",
            hint="use rmsnorm_linear (it falls back to rmsnorm then linear) or the two ops",
        )
    for i, t in ((1, b), (2, w)):
        if t.dtype != x.dtype:
            raise call.error(DtypeError, f"{call.name(i)} is {t.dtype.name} but a is {x.dtype.name}")
    if w.shape != (k,):
        raise call.error(ShapeError, f"norm_weight has shape {format_shape(w.shape)} but must be [{k}] (a's last axis)")
    if len(call.operands) > 3:
        r = call.operands[3]
        if r.shape != x.shape or r.dtype != x.dtype:
            raise call.error(
                ShapeError if r.shape != x.shape else DtypeError,
                f"residual is {r.dtype.name} {format_shape(r.shape)} but must be a's {x.dtype.name} "
                f"{format_shape(x.shape)} (it is added to a before normalising)",
            )
    return [OutSpec(x.shape[:-1] + (n,), x.dtype)]


def normed_rows(arrays: list[np.ndarray], attrs: dict[str, Any]) -> np.ndarray:
    """The rows the matmul multiplies: rmsnorm's output, rounded to x's dtype as the op would store it."""
    x, _, w, *residual = arrays
    norm_attrs = {"eps": attrs["eps"]}
    y = _rmsnorm_ref([x, w, *residual], norm_attrs)
    return round_to(y, as_dtype(x.dtype))


def _reference(arrays: list[np.ndarray], attrs: dict[str, Any]) -> np.ndarray:
    a = to_compute(normed_rows(arrays, attrs))
    return _matmul_reference([a, arrays[1]], {"transpose_a": False, "transpose_b": attrs["transpose_b"]})


def _tiles(node: Any, params: dict[str, int], ctx: TileContext) -> list[Tile]:
    """matmul's tiles of a against b; each also reads the norm's weight whole and the residual where it
    reads a (its rows, all of K)."""
    x, b, w, *residual = node.inputs
    tiles = _tilings.MATMUL.make(SimpleNamespace(inputs=[x, b], outputs=node.outputs, attrs=node.attrs), params, ctx)
    out = []
    for t in tiles:
        a_box = t.reads[0].box
        extra = (Read(2, Box.full(w.shape)),) + tuple(Read(3, a_box) for _ in residual)
        out.append(t._replace(reads=t.reads + extra, flops=t.flops + 4 * a_box.size))
    return out


RMSNORM_MATMUL = register(
    OpDef(
        name="rmsnorm_matmul",
        kind="compute",
        category="matmul",
        doc="matmul(rmsnorm(a, norm_weight, eps, residual=residual), b) for a of at most "
        f"{RMSNORM_MATMUL_MAX_ROWS} rows (a decode step's): each tile norms its rows (rounded to a's dtype, "
        "as rmsnorm stores them) in shared memory and multiplies them; b a 2-D weight (transpose_b: "
        "stored [N, K]).",
        operands=("a", "b", "norm_weight", "residual"),
        infer=_infer,
        reference=_reference,
        accuracy=Accuracy(ulps=2.0, per_reduction=True),
        tiling=Tiling(
            _tilings.MATMUL.params,
            _tiles,
            "matmul's tiles (" + _tilings.MATMUL.doc + ")",
            flags=_tilings.MATMUL.flags,
            saved_without=_tilings.MATMUL.saved_without,
        ),
        cuda=CudaTile("fused_matmul"),
    )
)


def rmsnorm_matmul(
    a: Tensor,
    b: Tensor,
    norm_weight: Tensor,
    *,
    eps: float = 1e-6,
    residual: Tensor | None = None,
    transpose_b: bool = False,
) -> Tensor:
    """``matmul(rmsnorm(a, norm_weight, eps=eps, residual=residual), b, transpose_b=transpose_b)`` as one
    op, for a of at most RMSNORM_MATMUL_MAX_ROWS rows (RMSNORM_MATMUL_MAX_BYTES of them normed) and b a
    2-D weight (rmsnorm_linear picks it or the two ops)."""
    operands = [a, b, norm_weight] + ([residual] if residual is not None else [])
    return apply(
        RMSNORM_MATMUL,
        operands,
        eps=_eps(RMSNORM_MATMUL, eps),
        transpose_a=False,
        transpose_b=require_bool(RMSNORM_MATMUL, "transpose_b", transpose_b),
    )


def rmsnorm_linear(
    x: Tensor, norm_weight: Tensor | None, weight: Tensor, *, eps: float = 1e-6, residual: Tensor | None = None
) -> Tensor:
    """``linear(rmsnorm(x, norm_weight, eps=eps, residual=residual), weight)``: one op (rmsnorm_matmul)
    where it applies (``fusable``: a decode step's few rows, a norm weight, a 2-D weight), else the two
    ops, whose errors then name the arguments."""
    if not fusable(x, norm_weight, weight):
        return linear(rmsnorm(x, norm_weight, eps=eps, residual=residual), weight)
    return rmsnorm_matmul(x, weight, norm_weight, eps=eps, residual=residual, transpose_b=True)

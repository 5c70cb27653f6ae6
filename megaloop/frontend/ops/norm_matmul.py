"""A decode matmul that norms its own rows: ``rmsnorm_matmul(x, b, weight, residual)`` is
``matmul(rmsnorm(x, weight, residual=residual), b)`` with the norm's output never stored: each tile
norms the rows of x it multiplies (at most FUSED_MATMUL_MAX_ROWS: a decode step's tokens) into
shared memory with the rmsnorm op's own code, then multiplies them. One dependent stage fewer in front
of a layer's q/k/v and gate/up projections (a norm task and its handoff: ~1.3 + ~1.5 us on an H200,
twice a layer), for every tile re-reading a few KB of x from L2. ``rmsnorm_linear`` picks it where it
applies and the two ops elsewhere (prefill: thousands of rows are normed once, not once a column tile).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from megaloop.dtypes import as_dtype, round_to
from megaloop.errors import DtypeError, ShapeError
from megaloop.frontend.opdef import Accuracy, CudaTile, OpCall, OpDef, OutSpec, register
from megaloop.frontend.ops import _placements
from megaloop.frontend.ops._build import apply, require_bool
from megaloop.frontend.ops._fused_matmul import FUSED_MATMUL_MAX_ROWS, check_a_and_b, fused_tiling, rows_fit
from megaloop.frontend.ops.elementwise import to_compute
from megaloop.frontend.ops.matmul import _reference as _matmul_reference
from megaloop.frontend.ops.matmul import linear
from megaloop.frontend.ops.normalization import _eps, _rmsnorm_ref, rmsnorm
from megaloop.frontend.shapes import format_shape
from megaloop.frontend.tensor import Tensor
from megaloop.frontend.tiling import Box, Read, Tile


def fusable(x: Any, norm_weight: Any, weight: Any) -> bool:
    """Whether rmsnorm_linear(x, norm_weight, weight) is one rmsnorm_matmul: float tensors of one dtype,
    x's rows fitting a tile (``rows_fit``), a norm weight of x's last axis, a 2-D weight [out, in] of it;
    otherwise the two ops report what is wrong."""
    return (
        all(isinstance(t, Tensor) for t in (x, norm_weight, weight))
        and x.dtype.is_float
        and rows_fit(x)
        and weight.ndim == 2
        and weight.shape[1] == x.shape[-1]
        and norm_weight.shape == (x.shape[-1],)
        and x.dtype == weight.dtype == norm_weight.dtype
    )


def _infer(call: OpCall) -> list[OutSpec]:
    x, b, w = call.operands[:3]
    n = check_a_and_b(call, "use rmsnorm_linear (it falls back to rmsnorm then linear) or the two ops")
    k = x.shape[-1]
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


def _tile_reads(node: Any, t: Tile) -> Tile:
    """A tile also reads the norm's weight whole and the residual where it reads a (its rows, all of K)."""
    a_box = t.reads[0].box
    extra = (Read(2, Box.full(node.inputs[2].shape)),) + tuple(Read(3, a_box) for _ in node.inputs[3:])
    return t._replace(reads=t.reads + extra, flops=t.flops + 4 * a_box.size)


def _dims(node: Any) -> list[_placements.Dim]:
    """Rows (with the residual) and columns of b; K is normed over, so it stays whole."""
    a = node.inputs[0]
    residual = tuple(i for i in range(2, len(node.inputs)) if node.inputs[i].shape == a.shape and a.ndim > 1)
    return _placements.matmul_dims(node, a_slots=(0, *residual), k=False)


RMSNORM_MATMUL = register(
    OpDef(
        name="rmsnorm_matmul",
        kind="compute",
        category="matmul",
        doc="matmul(rmsnorm(a, norm_weight, eps, residual=residual), b) for a of at most "
        f"{FUSED_MATMUL_MAX_ROWS} rows (a decode step's): each tile norms its rows (rounded to a's dtype, "
        "as rmsnorm stores them) in shared memory and multiplies them; b a 2-D weight (transpose_b: "
        "stored [N, K]).",
        operands=("a", "b", "norm_weight", "residual"),
        attrs={"eps": "number", "transpose_a": "bool", "transpose_b": "bool"},
        infer=_infer,
        reference=_reference,
        accuracy=Accuracy(ulps=2.0, per_reduction=True),
        tiling=fused_tiling(_tile_reads),
        cuda=CudaTile("fused_matmul"),
        placement=_placements.rule(_dims),
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
    op, for a of at most FUSED_MATMUL_MAX_ROWS rows (FUSED_MATMUL_MAX_BYTES of them normed) and b a
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

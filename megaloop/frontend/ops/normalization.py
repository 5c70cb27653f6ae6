"""Row-wise normalisations: softmax, log_softmax, layernorm and rmsnorm (float32 inside)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from megaloop.dtypes import as_dtype, round_to
from megaloop.errors import DtypeError, GraphBuildError, ShapeError
from megaloop.frontend.opdef import Accuracy, Fast, Lowering, OpCall, OpDef, OutSpec, VjpCall, register
from megaloop.frontend.ops import _placements, _tilings
from megaloop.frontend.ops._build import apply, require_scalar
from megaloop.frontend.ops._fast import VALUES_ONLY, Kernel, dense, rounder
from megaloop.frontend.ops._grad import f32, sum_to_rows
from megaloop.frontend.ops._torch import of, torch
from megaloop.frontend.ops.elementwise import check_kinds, to_compute
from megaloop.frontend.shapes import format_shape
from megaloop.frontend.tensor import BUILDERS as B
from megaloop.frontend.tensor import Tensor

_ROW = Accuracy(ulps=2.0, per_reduction=True)


def _axis_infer(call: OpCall) -> list[OutSpec]:
    check_kinds(call, call.dtype(0), "f")
    call.attrs["axis"] = call.axis(call.attrs["axis"], len(call.shape(0)))
    return [OutSpec(call.shape(0), call.dtype(0))]


def _softmax_ref(arrays: list[np.ndarray], attrs: dict[str, Any]) -> np.ndarray:
    x = to_compute(arrays[0])
    z = x - np.max(x, axis=attrs["axis"], keepdims=True)
    e = np.exp(z)
    return e / np.sum(e, axis=attrs["axis"], keepdims=True)


def _log_softmax_ref(arrays: list[np.ndarray], attrs: dict[str, Any]) -> np.ndarray:
    x = to_compute(arrays[0])
    z = x - np.max(x, axis=attrs["axis"], keepdims=True)
    return z - np.log(np.sum(np.exp(z), axis=attrs["axis"], keepdims=True))


def _softmax_vjp(call: VjpCall) -> list[Tensor]:
    """y (g - sum(g y)) along the axis, in float32."""
    x, y, g, axis = call.inputs[0], f32(call.outputs[0]), f32(call.cotangent()), call.attrs["axis"]
    return [B.cast(y * (g - B.sum(g * y, axis, keepdims=True)), x.dtype)]


def _log_softmax_vjp(call: VjpCall) -> list[Tensor]:
    """g - exp(y) sum(g) along the axis, in float32."""
    x, y, g, axis = call.inputs[0], f32(call.outputs[0]), f32(call.cotangent()), call.attrs["axis"]
    return [B.cast(g - B.exp(y) * B.sum(g, axis, keepdims=True), x.dtype)]


# rows along any axis but the normalised one can be cut; weights stay whole, a residual is cut with x
_AXIS_ROWS = _placements.rule(lambda node: _placements.rows_dims(node, (node.attrs["axis"],)))
_LAST_ROWS = _placements.rule(lambda node: _placements.rows_dims(node, (node.outputs[0].ndim - 1,)))

SOFTMAX = register(
    OpDef(
        name="softmax",
        kind="compute",
        category="normalization",
        doc="exp(x - max) / sum(exp(x - max)) along one axis (numerically stable); "
        "a row of all -inf gives NaN, as in torch.",
        operands=("x",),
        attrs={"axis": "int"},
        infer=_axis_infer,
        reference=_softmax_ref,
        fast=VALUES_ONLY,
        accuracy=_ROW,
        tiling=_tilings.ROWS,
        lowering=Lowering("rows"),
        placement=_AXIS_ROWS,
        vjp=_softmax_vjp,
    )
)
LOG_SOFTMAX = register(
    OpDef(
        name="log_softmax",
        kind="compute",
        category="normalization",
        doc="x - max - log(sum(exp(x - max))) along one axis.",
        operands=("x",),
        attrs={"axis": "int"},
        infer=_axis_infer,
        reference=_log_softmax_ref,
        fast=VALUES_ONLY,
        accuracy=_ROW,
        tiling=_tilings.ROWS,
        lowering=Lowering("rows"),
        placement=_AXIS_ROWS,
        vjp=_log_softmax_vjp,
    )
)


def softmax(x: Tensor, axis: int = -1) -> Tensor:
    return apply(SOFTMAX, [x], axis=axis)


def log_softmax(x: Tensor, axis: int = -1) -> Tensor:
    return apply(LOG_SOFTMAX, [x], axis=axis)


# ---- layernorm / rmsnorm ----------------------------------------------------------------------


def _norm_infer(call: OpCall) -> list[OutSpec]:
    x = call.operands[0]
    check_kinds(call, x.dtype, "f")
    if x.ndim < 1:
        raise call.error(ShapeError, "x must have at least one axis (the normalised last axis)")
    for i in range(1, len(call.operands)):
        p = call.operands[i]
        if call.name(i) == "residual":
            if p.shape != x.shape or p.dtype != x.dtype:
                raise call.error(
                    ShapeError if p.shape != x.shape else DtypeError,
                    f"residual is {p.dtype.name} {format_shape(p.shape)} but must be x's "
                    f"{x.dtype.name} {format_shape(x.shape)} (it is added to x before normalising)",
                )
            continue
        if p.shape != (x.shape[-1],):
            raise call.error(
                ShapeError,
                f"{call.name(i)} has shape {format_shape(p.shape)} but must be "
                f"[{x.shape[-1]}] (the size of x's last axis)",
            )
        if p.dtype != x.dtype:
            raise call.error(
                DtypeError,
                f"{call.name(i)} is {p.dtype.name} but x is {x.dtype.name}",
                hint=f"cast {call.name(i)} to {x.dtype.name}",
            )
    return [OutSpec(x.shape, x.dtype)]


def _operands(arrays: list[np.ndarray], attrs: dict[str, Any], names: tuple[str, ...]) -> dict[str, np.ndarray]:
    """The present operands by name (``names``: the op's after x), arrays in the compute dtype."""
    present = [n for i, n in enumerate(names, start=1) if i not in attrs.get("absent", ())]
    return dict(zip(present, (to_compute(a) for a in arrays[1:])))  # (past the arrays: absent, as in old files)


def _rows_of(arrays: list[np.ndarray], attrs: dict[str, Any], names: tuple[str, ...]) -> np.ndarray:
    """x, or x + residual rounded to x's dtype where a residual is given (what an add would store)."""
    x = arrays[0]
    residual = _operands(arrays, attrs, names).get("residual")
    return to_compute(x) if residual is None else to_compute(round_to(to_compute(x) + residual, as_dtype(x.dtype)))


def _affine(y: np.ndarray, arrays: list[np.ndarray], attrs: dict[str, Any], names: tuple[str, ...]) -> np.ndarray:
    params = _operands(arrays, attrs, names)
    if "weight" in params:
        y = y * params["weight"]
    if "bias" in params:
        y = y + params["bias"]
    return y


LAYERNORM_OPERANDS = ("weight", "bias", "residual")
RMSNORM_OPERANDS = ("weight", "residual")


def _layernorm_ref(arrays: list[np.ndarray], attrs: dict[str, Any]) -> np.ndarray:
    x = _rows_of(arrays, attrs, LAYERNORM_OPERANDS)
    mu = np.mean(x, axis=-1, keepdims=True)
    d = x - mu
    var = np.mean(d * d, axis=-1, keepdims=True)
    y = d / np.sqrt(var + np.float32(attrs["eps"]))
    return _affine(y, arrays, attrs, LAYERNORM_OPERANDS)


def _rmsnorm_ref(arrays: list[np.ndarray], attrs: dict[str, Any]) -> np.ndarray:
    x = _rows_of(arrays, attrs, RMSNORM_OPERANDS)
    ms = np.mean(x * x, axis=-1, keepdims=True)
    y = x / np.sqrt(ms + np.float32(attrs["eps"]))
    return _affine(y, arrays, attrs, RMSNORM_OPERANDS)


def _norm_vjp(call: VjpCall) -> list[Tensor | None]:
    """rmsnorm and layernorm in float32: with xhat the normalised row, r its 1/sqrt(var + eps) and
    gw = g * weight, dx = r (gw - mean(gw) - xhat mean(gw xhat)) (rmsnorm: no mean(gw) term), the
    weight's gradient sum(g xhat) and the bias's sum(g) over the rows; a residual takes dx too."""
    layer = call.node.op.name == "layernorm"
    names = LAYERNORM_OPERANDS if layer else RMSNORM_OPERANDS
    absent = call.attrs.get("absent", ())
    present = [n for k, n in enumerate(names, start=1) if k not in absent][: len(call.inputs) - 1]
    operand = dict(zip(present, call.inputs[1:]))
    x = call.inputs[0]
    h = f32(x if "residual" not in operand else B.add(x, operand["residual"]))
    g, eps = f32(call.cotangent()), call.attrs["eps"]
    if layer:
        h = h - B.mean(h, -1, keepdims=True)
    r = B.rsqrt(B.mean(h * h, -1, keepdims=True) + eps)
    xhat = h * r
    gw = g * f32(operand["weight"]) if "weight" in operand else g
    inner = gw - xhat * B.mean(gw * xhat, -1, keepdims=True)
    if layer:
        inner = inner - B.mean(gw, -1, keepdims=True)
    dx = B.cast(r * inner, x.dtype)
    width = x.shape[-1]
    grads = {
        "weight": lambda: sum_to_rows(g * xhat, width),
        "bias": lambda: sum_to_rows(g, width),
        "residual": lambda: dx,
    }
    out: list[Tensor | None] = [dx]
    for name, t, need in zip(present, call.inputs[1:], call.needs[1:]):
        out.append(B.cast(grads[name](), t.dtype) if need else None)
    return out
def _norm_fast(reference: Any, names: tuple[str, ...]) -> Fast:
    """A norm's reference on compute-form operands, its residual sum first rounded to x's dtype here
    (the one place the reference reads an operand's dtype)."""

    def make(node: Any) -> Kernel:
        attrs, finish = node.attrs, rounder(node.outputs[0].dtype)
        absent = attrs.get("absent", ())
        present = [n for i, n in enumerate(names, start=1) if i not in absent]
        if "residual" not in present:
            return lambda arrays: [finish(reference(arrays, attrs))]
        at = present.index("residual") + 1
        rest = [i for i in range(1, len(present) + 1) if i != at]
        plain = {**attrs, "absent": tuple(sorted((*absent, names.index("residual") + 1)))}
        rows = rounder(node.inputs[0].dtype)
        return lambda arrays: [finish(reference([rows(arrays[0] + arrays[at]), *(arrays[i] for i in rest)], plain))]

    return Fast(make)


def rms_rows(node: Any, eps: float, stored: Any) -> Callable[..., np.ndarray]:
    """``rows(x, weight, residual)``: rmsnorm(x, weight, eps, residual) as an rmsnorm op computes it
    from compute-form operands, in compute form and rounded by ``stored`` (a rounder, given a new
    array): the reference's arithmetic in the same order (np.mean is this sum divided by the count),
    without its overheads, each pass after the first in place."""
    eps32, residual_stored = np.float32(eps), rounder(node.inputs[0].dtype, in_place=True)

    def rows(x: np.ndarray, weight: np.ndarray | None, residual: np.ndarray | None) -> np.ndarray:
        x = residual_stored(x + residual) if residual is not None else dense(x)
        y = x * x
        ms = np.add.reduce(y, axis=-1, keepdims=True)
        ms /= np.float32(x.shape[-1])
        ms += eps32
        np.divide(x, np.sqrt(ms, out=ms), out=y)
        if weight is not None:
            y *= weight
        return stored(y)

    return rows


def _rmsnorm_fast(node: Any) -> Kernel:
    absent = node.attrs.get("absent", ())
    present = [n for i, n in enumerate(RMSNORM_OPERANDS, start=1) if i not in absent]
    at = {n: present.index(n) + 1 for n in present}
    rows = rms_rows(node, node.attrs["eps"], rounder(node.outputs[0].dtype, in_place=True))
    w, r = at.get("weight"), at.get("residual")
    return lambda arrays: [rows(arrays[0], arrays[w] if w else None, arrays[r] if r else None)]


def rmsnorm_torch(eps: float, dtypes: tuple[Any, Any, Any], w: int | None, r: int | None) -> Any:
    """rmsnorm on torch-form operands (``w``, ``r``: the weight's and residual's places, or None;
    ``dtypes``: x's, the weight's (None: no weight) and the result's) in
    float32 from their values (a residual's sum rounded to x's dtype first), rounded to ``dtype``:
    the reference's arithmetic, rsqrt for its divide (within 2 ulps); torch's fused rms_norm where x,
    weight and result share a dtype (it computes in float32 and rounds once: the same bits here)."""
    x_dtype, w_dtype, dtype = dtypes
    fused = x_dtype == dtype and w_dtype in (None, dtype) and hasattr(torch().nn.functional, "rms_norm")

    def run(arrays: list[Any]) -> list[Any]:
        x = of(arrays[0], x_dtype)
        x = x if r is None else x + of(arrays[r], x_dtype)  # (torch's sum of two: rounded once)
        if fused:
            weight = None if w is None else of(arrays[w], dtype)
            return [torch().nn.functional.rms_norm(x, x.shape[-1:], weight, eps)]
        h = x.float()
        y = h * torch().rsqrt(h.square().mean(-1, keepdim=True) + eps)
        if w is not None:
            y *= arrays[w].float()
        return [of(y, dtype)]

    return run


def _rmsnorm_torch(node: Any) -> Any:
    present = [n for i, n in enumerate(RMSNORM_OPERANDS, start=1) if i not in node.attrs.get("absent", ())]
    w, r = (present.index(n) + 1 if n in present else None for n in RMSNORM_OPERANDS)
    dtypes = (node.inputs[0].dtype, None if w is None else node.inputs[w].dtype, node.outputs[0].dtype)
    return rmsnorm_torch(node.attrs["eps"], dtypes, w, r)


LAYERNORM = register(
    OpDef(
        name="layernorm",
        kind="compute",
        category="normalization",
        doc="(x - mean) / sqrt(var + eps) over the last axis (biased variance), then * weight + bias when given; "
        "with a residual, of x + residual rounded to x's dtype (what an add would store).",
        operands=("x", *LAYERNORM_OPERANDS),
        attrs={"eps": "number", "absent": "ints"},
        optional_attrs=frozenset({"absent"}),
        infer=_norm_infer,
        reference=_layernorm_ref,
        fast=_norm_fast(_layernorm_ref, LAYERNORM_OPERANDS),
        accuracy=Accuracy(ulps=4.0, per_reduction=True),
        tiling=_tilings.ROWS,
        lowering=Lowering("rows"),
        placement=_LAST_ROWS,
        vjp=_norm_vjp,
    )
)
RMSNORM = register(
    OpDef(
        name="rmsnorm",
        kind="compute",
        category="normalization",
        doc="x / sqrt(mean(x**2) + eps) over the last axis, then * weight when given "
        "(one rounding at the end; Llama's RMSNorm); with a residual, of x + residual rounded to x's "
        "dtype (what an add would store).",
        operands=("x", *RMSNORM_OPERANDS),
        attrs={"eps": "number", "absent": "ints"},
        optional_attrs=frozenset({"absent"}),
        infer=_norm_infer,
        reference=_rmsnorm_ref,
        fast=Fast(_rmsnorm_fast, torch=_rmsnorm_torch),
        accuracy=Accuracy(ulps=2.0, per_reduction=True),
        tiling=_tilings.ROWS,
        lowering=Lowering("rows"),
        placement=_LAST_ROWS,
        vjp=_norm_vjp,
    )
)


def _eps(op: OpDef, eps: Any) -> float:
    value = float(require_scalar(op, "eps", eps))
    if value < 0:
        raise GraphBuildError(f"{op.name}: eps must be >= 0, got {value}")
    return value


# residual: the norm of x + residual, rounded to x's dtype as an add would store it, without waiting
# for that add: a transformer layer's norm of its residual stream (h = x + attention(...); norm(h))
# becomes norm(attention(...), residual=x) beside h = x + attention(...), which only the next residual
# add reads (the fuse stage makes it: megaloop/fuse/rules/norm_residual.py): on a decode step one task
# and one dependency fewer on the critical path, twice a layer.


def _norm(op: OpDef, x: Tensor, optional: dict[str, Tensor | None], eps: float) -> Tensor:
    operands = [x] + [t for t in optional.values() if t is not None]
    absent = tuple(i for i, t in enumerate(optional.values(), start=1) if t is None)
    return apply(op, operands, eps=_eps(op, eps), **({"absent": absent} if absent else {}))


def layernorm(
    x: Tensor,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    *,
    eps: float = 1e-5,
    residual: Tensor | None = None,
) -> Tensor:
    return _norm(LAYERNORM, x, {"weight": weight, "bias": bias, "residual": residual}, eps)


def rmsnorm(x: Tensor, weight: Tensor | None = None, *, eps: float = 1e-6, residual: Tensor | None = None) -> Tensor:
    return _norm(RMSNORM, x, {"weight": weight, "residual": residual}, eps)

"""Row-wise normalisations: softmax, log_softmax, layernorm and rmsnorm (float32 inside)."""

from __future__ import annotations

from typing import Any

import numpy as np

from megaloop.errors import DtypeError, GraphBuildError, ShapeError
from megaloop.frontend.opdef import Accuracy, CudaTile, OpCall, OpDef, OutSpec, register
from megaloop.frontend.ops import _tilings
from megaloop.frontend.ops._build import apply, require_scalar
from megaloop.frontend.ops.elementwise import check_kinds, to_compute
from megaloop.frontend.shapes import format_shape
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


SOFTMAX = register(
    OpDef(
        name="softmax",
        kind="compute",
        category="normalization",
        doc="exp(x - max) / sum(exp(x - max)) along one axis (numerically stable); "
        "a row of all -inf gives NaN, as in torch.",
        operands=("x",),
        infer=_axis_infer,
        reference=_softmax_ref,
        accuracy=_ROW,
        tiling=_tilings.ROWS,
        cuda=CudaTile("rows"),
    )
)
LOG_SOFTMAX = register(
    OpDef(
        name="log_softmax",
        kind="compute",
        category="normalization",
        doc="x - max - log(sum(exp(x - max))) along one axis.",
        operands=("x",),
        infer=_axis_infer,
        reference=_log_softmax_ref,
        accuracy=_ROW,
        tiling=_tilings.ROWS,
        cuda=CudaTile("rows"),
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


def _affine(y: np.ndarray, arrays: list[np.ndarray], attrs: dict[str, Any], names: tuple[str, ...]) -> np.ndarray:
    present = [n for i, n in enumerate(names, start=1) if i not in attrs.get("absent", ())]
    params = dict(zip(present, (to_compute(a) for a in arrays[1:])))
    if "weight" in params:
        y = y * params["weight"]
    if "bias" in params:
        y = y + params["bias"]
    return y


def _layernorm_ref(arrays: list[np.ndarray], attrs: dict[str, Any]) -> np.ndarray:
    x = to_compute(arrays[0])
    mu = np.mean(x, axis=-1, keepdims=True)
    d = x - mu
    var = np.mean(d * d, axis=-1, keepdims=True)
    y = d / np.sqrt(var + np.float32(attrs["eps"]))
    return _affine(y, arrays, attrs, ("weight", "bias"))


def _rmsnorm_ref(arrays: list[np.ndarray], attrs: dict[str, Any]) -> np.ndarray:
    x = to_compute(arrays[0])
    ms = np.mean(x * x, axis=-1, keepdims=True)
    y = x / np.sqrt(ms + np.float32(attrs["eps"]))
    return _affine(y, arrays, attrs, ("weight",))


LAYERNORM = register(
    OpDef(
        name="layernorm",
        kind="compute",
        category="normalization",
        doc="(x - mean) / sqrt(var + eps) over the last axis (biased variance), then * weight + bias when given.",
        operands=("x", "weight", "bias"),
        infer=_norm_infer,
        reference=_layernorm_ref,
        accuracy=Accuracy(ulps=4.0, per_reduction=True),
        tiling=_tilings.ROWS,
        cuda=CudaTile("rows"),
    )
)
RMSNORM = register(
    OpDef(
        name="rmsnorm",
        kind="compute",
        category="normalization",
        doc="x / sqrt(mean(x**2) + eps) over the last axis, then * weight when given "
        "(one rounding at the end; Llama's RMSNorm).",
        operands=("x", "weight"),
        infer=_norm_infer,
        reference=_rmsnorm_ref,
        accuracy=Accuracy(ulps=2.0, per_reduction=True),
        tiling=_tilings.ROWS,
        cuda=CudaTile("rows"),
    )
)


def _eps(op: OpDef, eps: Any) -> float:
    value = float(require_scalar(op, "eps", eps))
    if value < 0:
        raise GraphBuildError(f"{op.name}: eps must be >= 0, got {value}")
    return value


def layernorm(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, *, eps: float = 1e-5) -> Tensor:
    operands = [x] + [t for t in (weight, bias) if t is not None]
    absent = tuple(i for i, t in ((1, weight), (2, bias)) if t is None)
    return apply(LAYERNORM, operands, eps=_eps(LAYERNORM, eps), **({"absent": absent} if absent else {}))


def rmsnorm(x: Tensor, weight: Tensor | None = None, *, eps: float = 1e-6) -> Tensor:
    operands = [x] if weight is None else [x, weight]
    return apply(RMSNORM, operands, eps=_eps(RMSNORM, eps), **({"absent": (1,)} if weight is None else {}))

"""Rotary position embedding (RoPE), in the half-split ("neox", Llama/HF) or interleaved (GPT-J,
original paper) pairing, for arbitrary integer positions, with optional frequency scaling.

The spec computes angles and their sines/cosines in float64 (exact to float32 output), so it is
the ideal to which faster implementations (float32 tables, fused kernels) are compared.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np

from megaloop.errors import DtypeError, GraphBuildError, ShapeError
from megaloop.frontend.opdef import Accuracy, Fast, Lowering, OpCall, OpDef, OutSpec, VjpCall, register
from megaloop.frontend.ops import _placements, _tilings, _torch
from megaloop.frontend.ops._build import apply, require_int, require_scalar
from megaloop.frontend.ops._fast import Kernel, rounder
from megaloop.frontend.ops.elementwise import check_kinds
from megaloop.frontend.shapes import broadcast_shapes, format_shape
from megaloop.frontend.tensor import BUILDERS as B
from megaloop.frontend.tensor import Tensor
from megaloop.frontend.validate import is_int

LAYOUTS = ("neox", "interleaved")
SCALING_TYPES = ("linear", "llama3", "longrope")
ROPE_ATTRS = {"theta": "number", "layout": LAYOUTS, "rotary_dim": "count?", "scaling": "scaling"}


def inv_frequencies(rotary_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> np.ndarray:
    """The rotary_dim/2 angular frequencies (float64), after Llama-3-style or linear scaling, or
    divided one by one by longrope's ``factors`` (Phi-3's short or long factors: which of them a model
    uses where is its builder's choice)."""
    number = isinstance(theta, (int, float, np.number)) and not isinstance(theta, bool)
    if not (is_int(rotary_dim) and rotary_dim >= 2 and number and (scaling is None or isinstance(scaling, dict))):
        raise GraphBuildError(
            f"inv_frequencies: takes rotary_dim (an int >= 2), theta (a number) and scaling (None or a dict), "
            f"got {rotary_dim!r:.40}, {theta!r:.40}, {scaling!r:.40}"
        )
    inv = 1.0 / theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    if scaling is None:
        return inv
    if scaling["type"] == "linear":
        return inv / scaling["factor"]
    if scaling["type"] == "longrope":
        factors = np.asarray(scaling["factors"], np.float64)
        if factors.shape != inv.shape:
            raise GraphBuildError(
                f"inv_frequencies: longrope scaling has {factors.size} factors; rotary_dim {rotary_dim} needs "
                f"{inv.size} (one a pair)"
            )
        return inv / factors
    # llama3: long wavelengths are slowed by `factor`, short ones kept, a smooth blend between.
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv / factor + smooth * inv
    out = np.where(wavelen > old_len / low, inv / factor, blended)
    return np.where(wavelen < old_len / high, inv, out)


def _infer(call: OpCall) -> list[OutSpec]:
    x, pos = call.operands
    check_kinds(call, x.dtype, "f")
    if not pos.dtype.is_int:
        raise call.error(DtypeError, f"positions must be int32 or int64, got {pos.dtype.name}")
    if x.ndim < 2:
        raise call.error(ShapeError, "x must be [..., tokens, head_dim] with at least 2 axes")
    if broadcast_shapes(pos.shape, x.shape[:-1]) != x.shape[:-1]:
        raise call.error(
            ShapeError,
            f"positions {format_shape(pos.shape)} must broadcast to x's shape without its "
            f"last axis, {format_shape(x.shape[:-1])}",
            hint="for x [batch, heads, tokens, dim] and positions [batch, tokens], "
            "pass positions.reshape(batch, 1, tokens)",
        )
    check_rotary(call, x.shape[-1])
    return [OutSpec(x.shape, x.dtype)]


def positions_dims(node: Any) -> list[_placements.Dim]:
    """Every axis of x but the rotated one; positions (broadcast to x's shape without that axis) are cut
    along the axes they do not broadcast."""
    x, pos = node.inputs[0], node.inputs[1]
    lead = x.ndim - 1 - pos.ndim
    dims = []
    for a in range(x.ndim - 1):
        b = a - lead
        axes = ((1, b, 1),) if b >= 0 and pos.shape[b] == x.shape[a] else ()
        dims.append(_placements.Dim(x.shape[a], ((0, a, 1), *axes, (_placements.OUT, a, 1)), label=f"axis {a}"))
    return dims


def check_rotary(call: OpCall, head_dim: int) -> None:
    """rotary_dim (None: the whole head_dim) and layout of a call with rope's attributes."""
    rd = call.attrs["rotary_dim"]
    if rd is None:
        rd = call.attrs["rotary_dim"] = head_dim
    if rd % 2 or not 2 <= rd <= head_dim:
        raise call.error(ShapeError, f"rotary_dim {rd} must be even and between 2 and head_dim {head_dim}")
    scaling = call.attrs["scaling"]
    if scaling is not None and scaling["type"] == "longrope" and len(scaling["factors"]) != rd // 2:
        raise call.error(
            ShapeError,
            f"longrope scaling has {len(scaling['factors'])} factors; rotary_dim {rd} needs {rd // 2} (one a pair)",
        )
    if call.attrs["layout"] not in LAYOUTS:
        raise call.error(GraphBuildError, f"layout must be one of {LAYOUTS}, got {call.attrs['layout']!r}")


def _reference(arrays: list[np.ndarray], attrs: dict[str, Any]) -> np.ndarray:
    x, pos = arrays
    rd = attrs["rotary_dim"]
    inv = inv_frequencies(rd, attrs["theta"], attrs["scaling"])
    pos = np.broadcast_to(pos, x.shape[:-1]).astype(np.float64)
    angle = pos[..., None] * inv  # [..., rd/2]
    cos, sin = np.cos(angle), np.sin(angle)
    x64 = x.astype(np.float64)
    rot, rest = x64[..., :rd], x64[..., rd:]
    if attrs["layout"] == "neox":
        x1, x2 = rot[..., : rd // 2], rot[..., rd // 2 :]
        out = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = np.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(rot.shape)
    return np.concatenate([out, rest], axis=-1).astype(np.float32)


def _vjp(call: VjpCall) -> list[Tensor | None]:
    """A rotation's transpose is the rotation by minus the angle: rope at the negated positions."""
    positions = call.inputs[1]
    attrs = {k: call.attrs[k] for k in ROPE_ATTRS}
    return [apply(ROPE, [call.cotangent(), B.neg(positions)], **attrs), None]


# the last few positions' (cos, sin) tables: a prefill's layers rotate by the same positions
_TABLES: dict[tuple[Any, ...], tuple[np.ndarray, np.ndarray]] = {}
TABLES_KEPT = 8
_TABLES_LOCK = threading.Lock()


def _cos_sin(pos: np.ndarray, inv: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of pos * inv (float64, broadcasting against x's leading axes), computed once for
    every rope of the same positions and frequencies (read-only: shared)."""
    key = (pos.shape, pos.dtype.str, pos.tobytes(), inv.tobytes())
    found = _TABLES.get(key)
    if found is None:
        angle = pos.astype(np.float64)[..., None] * inv
        found = np.cos(angle), np.sin(angle)
        for table in found:
            table.setflags(write=False)
        with _TABLES_LOCK:  # (graphs may run in threads)
            if len(_TABLES) >= TABLES_KEPT:
                _TABLES.pop(next(iter(_TABLES)))
            _TABLES[key] = found
    return found


def rotated(x: np.ndarray, pos: np.ndarray, attrs: dict[str, Any], inv: np.ndarray) -> np.ndarray:
    """The reference's float32 result, each angle's sine and cosine computed once for all the heads
    that share its position (positions broadcast to x's shape without its last axis; ``inv``:
    inv_frequencies of the attributes): the same float64 products and sums, each written in place
    (float32 values times float64 ones are their float64 products) and the last rounded to float32."""
    rd, half = attrs["rotary_dim"], attrs["rotary_dim"] // 2
    cos, sin = _cos_sin(pos, inv)
    pairs = (slice(0, half), slice(half, rd)) if attrs["layout"] == "neox" else (slice(0, rd, 2), slice(1, rd, 2))
    out = np.empty(x.shape, np.float32)
    (x1, x2), (first, second) = [[a[..., s] for s in pairs] for a in (x, out)]
    a, b = np.multiply(x1, cos), np.multiply(x2, sin)
    np.subtract(a, b, out=first)
    np.multiply(x2, cos, out=a)
    np.multiply(x1, sin, out=b)
    np.add(a, b, out=second)
    out[..., rd:] = x[..., rd:]
    return out


def frequencies(attrs: dict[str, Any]) -> np.ndarray:
    """inv_frequencies of a node's rope attributes (its rotary_dim set by its shape rule)."""
    return inv_frequencies(attrs["rotary_dim"], attrs["theta"], attrs["scaling"])


def _fast(node: Any) -> Kernel:
    attrs, inv, finish = node.attrs, frequencies(node.attrs), rounder(node.outputs[0].dtype, in_place=True)
    return lambda arrays: [finish(rotated(arrays[0], arrays[1], attrs, inv))]


# _TABLES' entries as float32 torch tensors, by the id of their cos: (cos, cos', sin', [cos', cos'], [-sin', sin'])
_TORCH_TABLES: dict[int, tuple[Any, ...]] = {}


def _torch_tables(cos: np.ndarray, sin: np.ndarray) -> tuple[Any, ...]:
    entry = _TORCH_TABLES.get(id(cos))
    if entry is None or entry[0] is not cos:
        c, s = (_torch.from_numpy(t.astype(np.float32)) for t in (cos, sin))
        cat = _torch.torch().cat
        entry = (cos, c, s, cat([c, c], -1), cat([-s, s], -1))
        with _TABLES_LOCK:  # (graphs may run in threads)
            if len(_TORCH_TABLES) >= TABLES_KEPT:
                _TORCH_TABLES.pop(next(iter(_TORCH_TABLES)), None)
            _TORCH_TABLES[id(cos)] = entry
    return entry[1:]


def torch_rotated(x: Any, pos: np.ndarray, attrs: dict[str, Any], inv: np.ndarray, dtype: Any) -> Any:
    """``rotated`` on a torch tensor, rounded to ``dtype`` (a DType), in float32 arithmetic (the
    reference's float64 products and sums rounded once: within rope's 2 ulps but where they cancel)."""
    rd, half = attrs["rotary_dim"], attrs["rotary_dim"] // 2
    cos_t, sin_t, cos2, sin2 = _torch_tables(*_cos_sin(pos, inv))
    xf, torch = x.float(), _torch.torch()
    if attrs["layout"] == "neox" and rd == x.shape[-1]:  # x cos + (-x2, x1) sin: three passes
        rot = torch.cat([xf[..., half:], xf[..., :half]], -1)
        return _torch.of(rot.mul_(sin2).addcmul_(xf, cos2), dtype)
    pairs = (slice(0, half), slice(half, rd)) if attrs["layout"] == "neox" else (slice(0, rd, 2), slice(1, rd, 2))
    x1, x2 = xf[..., pairs[0]], xf[..., pairs[1]]
    out = xf.clone() if rd < x.shape[-1] else torch.empty_like(xf)
    out[..., pairs[0]] = x1 * cos_t - x2 * sin_t
    out[..., pairs[1]] = x2 * cos_t + x1 * sin_t
    return _torch.of(out, dtype)


def _on_torch(node: Any) -> Any:
    attrs, inv, dtype = node.attrs, frequencies(node.attrs), node.outputs[0].dtype
    return lambda arrays: [torch_rotated(arrays[0], arrays[1].numpy(), attrs, inv, dtype)]


ROPE = register(
    OpDef(
        name="rope",
        kind="compute",
        category="position",
        doc="Rotate pairs of the last axis by position * frequency: layout 'neox' pairs i with "
        "i + rotary_dim/2, 'interleaved' pairs 2i with 2i+1; dims past rotary_dim pass through.",
        operands=("x", "positions"),
        attrs=ROPE_ATTRS,
        infer=_infer,
        reference=_reference,
        fast=Fast(_fast, torch=_on_torch),
        accuracy=Accuracy(ulps=2.0),
        tiling=_tilings.ROPE,
        lowering=Lowering("rope"),
        placement=_placements.rule(lambda node: positions_dims(node)),
        vjp=lambda call: _vjp(call),
    )
)


def _check_scaling(scaling: Any, op: OpDef | None = None) -> dict[str, Any] | None:
    op = op or ROPE
    if scaling is None:
        return None
    if not isinstance(scaling, dict) or scaling.get("type", scaling.get("rope_type")) not in SCALING_TYPES:
        raise GraphBuildError(
            f"{op.name}: scaling must be None or a dict with type in {SCALING_TYPES}, got {scaling!r}"
        )
    s = dict(scaling)
    s["type"] = s.pop("rope_type", s.get("type"))
    needed = {
        "linear": ("factor",),
        "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
        "longrope": ("factors",),
    }
    if s["type"] == "longrope":
        factors = s.get("factors")
        if not isinstance(factors, (tuple, list)) or not factors:
            raise GraphBuildError(
                f"{op.name}: longrope scaling needs 'factors', one number a rotary pair, got {factors!r:.80}"
            )
        s["factors"] = tuple(float(require_scalar(op, "scaling['factors']", f)) for f in factors)
        if min(s["factors"]) <= 0:
            raise GraphBuildError(f"{op.name}: longrope's factors must be > 0, got {min(s['factors'])}")
        return {"type": "longrope", "factors": s["factors"]}
    for key in needed[s["type"]]:
        if key not in s:
            raise GraphBuildError(f"{op.name}: {s['type']} scaling needs {key!r} (got keys {sorted(s)})")
        if require_scalar(op, f"scaling[{key!r}]", s[key]) <= 0:
            raise GraphBuildError(f"{op.name}: scaling[{key!r}] must be > 0, got {s[key]}")
    if s["type"] == "llama3" and not s["high_freq_factor"] > s["low_freq_factor"]:
        raise GraphBuildError(
            f"{op.name}: llama3 scaling needs high_freq_factor > low_freq_factor, got "
            f"{s['high_freq_factor']} and {s['low_freq_factor']}"
        )
    return {k: s[k] for k in ("type", *needed[s["type"]])}


def rope(
    x: Tensor,
    positions: Tensor,
    *,
    theta: float = 10000.0,
    layout: str = "neox",
    rotary_dim: int | None = None,
    scaling: dict[str, Any] | None = None,
) -> Tensor:
    return apply(ROPE, [x, positions], **rope_attrs(theta, layout, rotary_dim, scaling))


def rope_attrs(theta: Any, layout: str, rotary_dim: Any, scaling: Any, op: OpDef | None = None) -> dict[str, Any]:
    """rope's attributes, checked (theta > 1, rotary_dim an int >= 2 or None, scaling) and normalised;
    errors name ``op`` (rope by default; an op that takes rope's attributes)."""
    op = op or ROPE
    theta = float(require_scalar(op, "theta", theta))
    if theta <= 1.0:
        raise GraphBuildError(f"{op.name}: theta must be > 1, got {theta}")
    if rotary_dim is not None:
        rotary_dim = require_int(op, "rotary_dim", rotary_dim, minimum=2)
    return {"theta": theta, "layout": layout, "rotary_dim": rotary_dim, "scaling": _check_scaling(scaling, op)}

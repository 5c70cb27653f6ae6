"""``penalize``: a language model's logits made less likely where their tokens already came up, in the
loop kernel, before the next token is chosen (``ml.sample`` or ``ml.argmax``).

``penalize(logits, counts, prompt_mask, repetition, presence, frequency)``: logits [..., n] (any float
dtype); counts [..., n] (int32 or int64, >= 0: how often each token was generated) and prompt_mask
[..., n] (bool: the token is in the prompt), each broadcasting to logits; the penalties per row (shape
logits.shape[:-1], or broadcastable to it), float32. Output float32 logits.shape. For each logit x (as
float32) with count c, every step a correctly rounded float32 operation:

1. Repetition (transformers' ``repetition_penalty``, applied whether the token is then drawn or
   picked greedily): where the token is in the prompt or c > 0, x = x * repetition if x < 0, else
   x / repetition. repetition > 0 (1: off).
2. Frequency and presence (OpenAI's ``frequency_penalty`` and ``presence_penalty``, counting generated
   tokens only): x = x - frequency * c, then x = x - presence where c > 0. Any finite values (0: off).

Values out of range (repetition not > 0 or not finite, presence or frequency not finite, a negative
count) are data errors: a DataError on the reference, a stop of the loop kernel naming the row and
token. The tile is megaloop/sample.cuh's ``penalize_tile`` (megaloop/codegen/emit_sample.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from megaloop import dtypes
from megaloop.errors import DataError, DtypeError, ShapeError
from megaloop.frontend.opdef import Accuracy, Lowering, OpCall, OpDef, OutSpec, register
from megaloop.frontend.ops import _placements, _tilings
from megaloop.frontend.ops._build import apply, require_tensor
from megaloop.frontend.ops._fast import VALUES_ONLY
from megaloop.frontend.ops.elementwise import check_kinds, to_compute
from megaloop.frontend.ops.sample import param_tensor
from megaloop.frontend.shapes import broadcast_shapes, format_shape
from megaloop.frontend.tensor import Tensor

PENALTIES = ("repetition", "presence", "frequency")


def _infer(call: OpCall) -> list[OutSpec]:
    logits, counts, mask = call.operands[:3]
    check_kinds(call, logits.dtype, "f")
    shape = logits.shape
    if not shape:
        raise call.error(ShapeError, "logits must have a vocabulary axis (the last one); got a 0-d tensor")
    if not counts.dtype.is_int:
        raise call.error(DtypeError, f"counts must be int32 or int64 token counts, got {counts.dtype.name}")
    if not mask.dtype.is_bool:
        raise call.error(DtypeError, f"prompt_mask must be bool (the token is in the prompt), got {mask.dtype.name}")
    for k, t in enumerate(call.operands[1:], start=1):
        if k >= 3 and t.dtype != dtypes.float32:
            raise call.error(DtypeError, f"{call.name(k)} must be float32, got {t.dtype.name}", hint="ml.cast it")
        if broadcast_shapes(t.shape, shape) != shape:
            raise call.error(
                ShapeError,
                f"{call.name(k)} has shape {format_shape(t.shape)}, which does not broadcast to the logits' "
                f"{format_shape(shape)}",
                hint="per-row penalties take a last axis of size 1 (ml.penalize adds it to per-row tensors)",
            )
    return [OutSpec(shape, dtypes.float32)]


def penalized(
    x: np.ndarray, counts: np.ndarray, in_prompt: np.ndarray, repetition: Any, presence: Any, frequency: Any
) -> np.ndarray:
    """The definition on host arrays that broadcast together (float32 logits ``x``): float32."""
    x = np.asarray(x, np.float32)
    c = np.asarray(counts).astype(np.int64)
    rep, pres, freq = (np.asarray(v, np.float32) for v in (repetition, presence, frequency))
    with np.errstate(all="ignore"):  # (infinite logits stay infinite, a NaN stays NaN)
        seen = np.asarray(in_prompt, bool) | (c > 0)
        y = np.where(seen, np.where(x < 0, x * rep, x / rep), x)
        y = y - freq * c.astype(np.float32)
        return np.where(c > 0, y - pres, y).astype(np.float32)


def _reference(arrays: list[np.ndarray], attrs: dict[str, Any]) -> np.ndarray:
    x, counts, mask, rep, pres, freq = arrays
    shape = x.shape
    return np.broadcast_to(penalized(to_compute(x).astype(np.float32), counts, mask, rep, pres, freq), shape).copy()


def _check_data(arrays: list[np.ndarray], attrs: dict[str, Any], known: Any) -> None:
    shape = arrays[0].shape
    values = [np.broadcast_to(a, shape) for a in arrays[1:]]
    real = np.ones(shape, bool)
    for m in known[1:]:
        if m is not None:
            real &= np.broadcast_to(m, shape)
    counts, _, rep, pres, freq = values
    rep32, pres32, freq32 = (v.astype(np.float32) for v in (rep, pres, freq))
    bad = ~((rep32 > 0) & np.isfinite(rep32) & np.isfinite(pres32) & np.isfinite(freq32)) | (counts < 0)
    bad &= real
    if np.any(bad):
        where = tuple(int(v) for v in np.argwhere(bad)[0])
        raise DataError(
            f"penalize: at {where} the count is {counts[where]}, repetition {rep[where]}, presence {pres[where]}, "
            f"frequency {freq[where]}; counts must be >= 0, repetition > 0 and finite (1: off), presence and "
            "frequency finite (0: off)"
        )


PENALIZE = register(
    OpDef(
        name="penalize",
        kind="compute",
        category="sampling",
        doc="logits [..., n] penalised where their tokens came up: repetition (prompt or generated; divide a "
        "positive logit, multiply a negative one), then frequency * count and presence (generated); float32; "
        "see megaloop.frontend.ops.sample_penalty.",
        operands=("logits", "counts", "prompt_mask", *PENALTIES),
        infer=_infer,
        reference=_reference,
        fast=VALUES_ONLY,
        check_data=_check_data,
        accuracy=Accuracy(ulps=2.0),  # (against float64: two or three float32 roundings)
        tiling=_tilings.ELEMENTWISE,
        lowering=Lowering("penalize"),
        placement=_placements.rule(_placements.elementwise_dims),
    )
)


def penalize(
    logits: Tensor,
    counts: Tensor,
    prompt_mask: Tensor | None = None,
    repetition: Tensor | float = 1.0,
    presence: Tensor | float = 0.0,
    frequency: Tensor | float = 0.0,
) -> Tensor:
    """``logits`` [..., n] with the repetition, presence and frequency penalties applied: float32
    [..., n]. ``counts`` [..., n] (int): how often each token was generated; ``prompt_mask`` [..., n]
    (bool; None: no prompt): the token is in the prompt. The penalties: per-row tensors (shape
    logits.shape[:-1], or broadcastable to it) or Python numbers. The definition:
    megaloop.frontend.ops.sample_penalty."""
    require_tensor(PENALIZE, "logits", logits)
    require_tensor(PENALIZE, "counts", counts)
    if prompt_mask is None:
        prompt_mask = logits.graph.constant(False, "bool", name="no_prompt")
    params = []
    for name, value in zip(PENALTIES, (repetition, presence, frequency)):
        t = param_tensor(PENALIZE, logits, name, "float32", value)
        params.append(t.reshape(*t.shape, 1) if isinstance(value, Tensor) and logits.ndim else t)
    return apply(PENALIZE, [logits, counts, prompt_mask, *params])

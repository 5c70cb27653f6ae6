"""``sample``: a token drawn from each row of logits (temperature, top-k, top-p, min-p), the same bits
on the numpy reference, the plan interpreter and the GPU.

``sample(logits, seed, offset, temperature, top_k, top_p, min_p)``: logits [..., n] (any float dtype),
the others per row (shape logits.shape[:-1], or broadcastable to it): seed int64, offset int64 (e.g.
the position), temperature float32, top_k int64, top_p float32, min_p float32. Output: int64 token
ids, logits.shape[:-1].
The definition, for one row of logits x (as float32), every float step a correctly rounded float32
operation (megaloop.frontend.ops._sampling holds it as code):

1. Greedy. If temperature < 2^-126 (0 and subnormals), or the row has no finite maximum (a NaN, a
   +inf, or only -inf), the token is ``argmax(x)``: the first largest value (the first NaN), exactly
   what ``ml.argmax`` gives.
2. Weights. m = max(x), c = log2(e) / T (log2(e) rounded to float32), e_i = (x_i - m) * c. Then
   w_i = 0 if e_i < -40, else w_i = floor(P(f_i) * 2^(40 + j_i)) with j_i = floor(e_i), f_i = e_i - j_i
   and P a fixed degree-6 polynomial for 2^f (Horner in float32). Integers: the largest logit weighs
   2^40, every weight is below 2^41, and their sums are exact in any order.
3. Top-k (k >= 1 and k < n; 0 or >= n is off): keep every logit >= the k-th largest logit (counted
   with multiplicity), so that ties at the boundary are all kept (more than k tokens then).
4. Top-p (top_p < 1; it counts in units of 2^-24, rounded to nearest: p24 = rint(top_p * 2^24)):
   with M the weight of the tokens top-k kept and target = floor(M * p24 / 2^24), keep the logits >=
   the largest logit v such that the tokens kept by top-k with logits >= v weigh at least target:
   the fewest top tokens whose weight reaches top_p of M, ties at the boundary all kept.
5. Min-p (min_p > 0; in units of 2^-24 like top_p: q24 = rint(min_p * 2^24)): of the tokens kept so
   far, keep those whose weight w_i >= q24 * 2^16, i.e. whose probability is at least min_p of the
   largest logit's (which weighs 2^40 and always stays). After top-k and top-p, as transformers
   orders them: top-p's mass M is not reduced by min-p. The weights grow with the logits, so min-p
   too keeps the logits from a threshold up.
6. The draw. (x0, x1) = the first two words of Philox4x32-10 with key (seed low, seed high) and
   counter (offset low, offset high, 0, 0); U = x0 + 2^32 x1; r = floor(U * W / 2^64) with W the
   kept tokens' weight. The token is the first index whose running sum of kept weights, in index
   order, exceeds r.

What the quantisation means: token i is drawn with probability w_i / W up to 2^-64 (the 64-bit draw),
and w_i / 2^40 is 2^(e_i) within a relative 1e-7 (P) plus |e_i| * 2^-22 (the float32 roundings of
x_i - m, c and e_i: at most 1e-5 at the cutoff, 2e-6 for tokens within a factor e^-4 of the
largest) plus 2^-40 / 2^(e_i) (the floor). Tokens below 2^-40 of the largest are never drawn (the
weight they drop is below n * 2^-40 of W). Rows with the same seed and offset draw the same U: a
sequence's tokens depend on its own seed and positions, not on the batch it runs in; the builder
refuses rows that share both by broadcasting.

Parameters out of range are data errors (DataError on the reference, the loop kernel stops with
one): temperature NaN, negative or infinite; top_k negative; top_p NaN or outside (0, 1]; min_p NaN or
outside [0, 1].
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from megaloop import dtypes
from megaloop.errors import DataError, DtypeError, GraphBuildError, NonFiniteError, ShapeError
from megaloop.frontend.opdef import Accuracy, Lowering, OpCall, OpDef, OutSpec, register
from megaloop.frontend.ops import _placements
from megaloop.frontend.ops._fast import VALUES_ONLY
from megaloop.frontend.ops._sampling import MAX_VOCAB, sample_rows
from megaloop.frontend.ops.elementwise import check_kinds, to_compute
from megaloop.frontend.shapes import format_shape
from megaloop.frontend.tensor import Tensor
from megaloop.frontend.tiling import Box, Read, Tile, TileContext, Tiling, Write, chunks, project

PARAMS = (
    ("seed", "int64"),
    ("offset", "int64"),
    ("temperature", "float32"),
    ("top_k", "int64"),
    ("top_p", "float32"),
    ("min_p", "float32"),
)
FLOPS_PER_LOGIT = 40  # the weight's arithmetic, a few passes over the row


def rows_of(call: OpCall) -> tuple[int, ...]:
    """The rows (logits' leading axes), after checking logits' dtype and vocabulary axis."""
    check_kinds(call, call.dtype(0), "f")
    shape = call.shape(0)
    if not shape:
        raise call.error(ShapeError, "logits must have a vocabulary axis (the last one); got a 0-d tensor")
    if not 1 <= shape[-1] < MAX_VOCAB:
        raise call.error(ShapeError, f"the vocabulary axis has {shape[-1]} logits; sample takes 1 to {MAX_VOCAB - 1}")
    return shape[:-1]


def check_params(call: OpCall, rows: tuple[int, ...], first: int = 1) -> None:
    """Operands ``first`` .. ``first + 5`` are PARAMS: their dtypes, and shapes that broadcast to ``rows``."""
    for k, (name, dtype) in enumerate(PARAMS):
        t = call.operands[first + k]
        if t.dtype.name != dtype:
            raise call.error(DtypeError, f"{name} must be {dtype}, got {t.dtype.name}", hint=f"ml.cast it to {dtype}")
        try:
            ok = np.broadcast_shapes(t.shape, rows) == rows
        except ValueError:
            ok = False
        if not ok:
            raise call.error(
                ShapeError,
                f"{name} has shape {format_shape(t.shape)}, which does not broadcast to the rows "
                f"{format_shape(rows)} (logits' shape without its last axis)",
            )
    seed, offset = call.operands[first].shape, call.operands[first + 1].shape
    for axis, size in enumerate(rows):
        if size > 1 and _broadcasts(seed, rows, axis) and _broadcasts(offset, rows, axis):
            raise call.error(
                ShapeError,
                f"seed and offset are both the same along row axis {axis} (of {size} rows): those rows would draw "
                "the same random number",
                hint="give each row its own seed (e.g. seed + row index) or offset; broadcast_to them to the rows' "
                "shape if they really are to share it",
            )


def _broadcasts(shape: tuple[int, ...], rows: tuple[int, ...], axis: int) -> bool:
    """Whether a tensor of ``shape`` broadcast to ``rows`` repeats itself along ``axis``."""
    d = axis - (len(rows) - len(shape))
    return d < 0 or shape[d] == 1


def _infer(call: OpCall) -> list[OutSpec]:
    rows = rows_of(call)
    check_params(call, rows)
    return [OutSpec(rows, dtypes.int64)]


def invalid_params(temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray, min_p: np.ndarray) -> np.ndarray:
    """Rows whose parameters are out of range (see the module docstring)."""
    t, p, q = temperature.astype(np.float32), top_p.astype(np.float32), min_p.astype(np.float32)
    return ~(np.isfinite(t) & (t >= 0)) | (top_k < 0) | ~((p > 0) & (p <= 1)) | ~((q >= 0) & (q <= 1))


def row_params(arrays: list[np.ndarray], rows: tuple[int, ...]) -> list[np.ndarray]:
    """PARAMS broadcast to the rows and flattened; rows whose parameters are out of range (refused by
    check_sample_data where they are real: poison in the plan interpreter's tasks) pick the argmax."""
    seed, offset, temperature, top_k, top_p, min_p = (np.broadcast_to(a, rows).reshape(-1) for a in arrays)
    bad = invalid_params(temperature, top_k, top_p, min_p)
    if np.any(bad):
        temperature = np.where(bad, np.float32(0.0), temperature)
        top_k, top_p = np.where(bad, 0, top_k), np.where(bad, np.float32(1.0), top_p)
        min_p = np.where(bad, np.float32(0.0), min_p)
    return [seed, offset, temperature, top_k, top_p, min_p]


def params_data(first: int, what: str) -> Any:
    """check_data of an op whose operands ``first`` .. ``first + 5`` are PARAMS (DataError naming the row)."""
    count = len(PARAMS)

    def check(arrays: list[np.ndarray], attrs: dict[str, Any], known: Any) -> None:
        rows = arrays[0].shape[:-1]
        params = [np.broadcast_to(a, rows) for a in arrays[first : first + count]]
        real = np.ones(rows, bool)
        for m in known[first : first + count]:
            if m is not None:
                real &= np.broadcast_to(m, rows)
        bad = invalid_params(*params[2:]) & real
        if np.any(bad):
            where = tuple(int(v) for v in np.argwhere(bad)[0])
            t, k, p, q = (x[where] for x in params[2:])
            raise DataError(
                f"{what}: row {where} has temperature {t}, top_k {k}, top_p {p}, min_p {q}; temperature must be "
                "finite and >= 0 (0: greedy), top_k >= 0 (0: off), top_p in (0, 1] (1: off), min_p in [0, 1] (0: off)"
            )

    return check


def row_dims(node: Any, leading: tuple[int, ...], params: tuple[int, ...]) -> list[_placements.Dim]:
    """Sampling is row by row: any row axis can be cut, the operands in ``leading`` (rows first, e.g.
    logits) along it, those in ``params`` (broadcast to the rows) where they do not broadcast."""
    rows = node.outputs[0].shape[: len(node.inputs[0].shape) - 1]
    dims = []
    for a, size in enumerate(rows):
        axes = [(i, a, 1) for i in leading]
        for i in params:
            b = a - (len(rows) - node.inputs[i].ndim)
            if b >= 0 and node.inputs[i].shape[b] == size:
                axes.append((i, b, 1))
        dims.append(_placements.Dim(size, (*axes, (_placements.OUT, a, 1)), label=f"rows (axis {a})"))
    return dims


def _reference(arrays: list[np.ndarray], attrs: dict[str, Any]) -> np.ndarray:
    logits = arrays[0]
    rows, n = logits.shape[:-1], logits.shape[-1]
    x = to_compute(logits).astype(np.float32).reshape(-1, n)
    params = row_params(arrays[1:], rows)
    return sample_rows(x, *params).reshape(rows)


def sample_tokens(
    logits: np.ndarray,
    seed: Any,
    offset: Any,
    temperature: Any = 1.0,
    top_k: Any = 0,
    top_p: Any = 1.0,
    min_p: Any = 0.0,
) -> np.ndarray:
    """``sample`` on host arrays (numpy broadcasting of the parameters to logits.shape[:-1]): the same
    tokens as the op, e.g. for a first token drawn from a prefill's logits on the host."""
    x = np.asarray(logits)
    if x.ndim < 1 or not (x.dtype.kind == "f" or x.dtype == dtypes.bfloat16.np):
        raise DataError(f"sample_tokens: logits must be a float array [..., n], got {x.dtype}{list(x.shape)}")
    arrays = [
        np.asarray(seed, np.int64),
        np.asarray(offset, np.int64),
        np.asarray(temperature, np.float32),
        np.asarray(top_k, np.int64),
        np.asarray(top_p, np.float32),
        np.asarray(min_p, np.float32),
    ]
    params_data(1, "sample_tokens")([x, *arrays], {}, [None] * (1 + len(PARAMS)))
    return _reference([x, *arrays], {})


def _tiles(node: Any, params: dict[str, int], ctx: TileContext) -> list[Tile]:
    """A few rows a tile (one round of tiles over the processors), each reading its rows whole."""
    logits = node.inputs[0]
    rows, n = logits.shape[:-1], logits.shape[-1]
    per = max(1, -(-math.prod(rows) // ctx.processors))
    tiles = []
    for i, box in enumerate(chunks(rows, per)):
        reads = [Read(0, Box(box.lo + (0,), box.hi + (n,)))]
        reads += [Read(k, project(box, rows, t.shape)) for k, t in enumerate(node.inputs) if k]
        tiles.append(Tile((i,), tuple(reads), (Write(0, box),), flops=FLOPS_PER_LOGIT * box.size * n))
    return tiles


SAMPLE = register(
    OpDef(
        name="sample",
        kind="compute",
        category="sampling",
        doc="A token id drawn from each row of logits [..., n] with per-row seed, offset (int64), temperature "
        "(float32; 0: argmax), top_k (int64; 0: off), top_p (float32; 1: off) and min_p (float32; 0: off); int64 "
        "[...]; the same bits on every backend (megaloop.frontend.ops.sample has the exact definition).",
        operands=("logits", *(name for name, _ in PARAMS)),
        infer=_infer,
        reference=_reference,
        fast=VALUES_ONLY,
        check_data=params_data(1, "sample"),
        accuracy=Accuracy(ulps=0.0),
        tiling=Tiling({}, _tiles, "a few whole rows a tile: one round over the processors"),
        lowering=Lowering("sample"),
        placement=_placements.rule(lambda node: row_dims(node, (0,), tuple(range(1, 1 + len(PARAMS))))),
    )
)


def param_tensor(op: OpDef, logits: Tensor, name: str, dtype: str, value: Any) -> Tensor:
    """A per-row parameter: a Tensor as it is, a Python number as a constant of ``dtype`` (checked now)."""
    if isinstance(value, Tensor):
        return value
    if isinstance(value, np.generic):
        value = value.item()
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (dtype == "int64" and isinstance(value, float))
    ):
        kind = "an int" if dtype == "int64" else "a number"
        raise GraphBuildError(
            f"{op.name}: {name} must be a megaloop Tensor or {kind}, got {type(value).__name__} {value!r:.60}"
        )
    if isinstance(value, float) and not math.isfinite(value):
        raise NonFiniteError(f"{op.name}: {name} is {value}, but it must be finite")
    ok = {
        "temperature": lambda v: v >= 0,
        "top_k": lambda v: v >= 0,
        "top_p": lambda v: 0 < np.float32(v) <= 1,
        "min_p": lambda v: 0 <= np.float32(v) <= 1,
        "repetition": lambda v: v > 0,
        "presence": lambda v: True,
        "frequency": lambda v: True,
        "seed": lambda v: -(2**63) <= v < 2**63,
        "offset": lambda v: -(2**63) <= v < 2**63,
    }[name]
    if not ok(value):
        rules = {"temperature": ">= 0", "top_k": ">= 0", "top_p": "in (0, 1]", "min_p": "in [0, 1]"}
        rule = {**rules, "repetition": "> 0"}.get(name, "an int64")
        raise GraphBuildError(f"{op.name}: {name} must be {rule}, got {value!r}")
    return logits.graph.constant(value, dtype)


# ``ml.sample``, the builder, is in sample_split.py: with splits it builds that module's ops.

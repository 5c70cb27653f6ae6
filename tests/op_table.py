"""The op test table: one or more rows per registered op.

A row says how to draw random operands (shapes with broadcasts, value domains, extra arguments), how
to build the op with megaloop, and how PyTorch computes the same thing in float64 (the independent
reference). ``test_op_table.py`` runs every row for every dtype it lists and checks the result with
the tolerance the op's own ``Accuracy`` declares. ``test_every_op_has_a_row`` keeps this table and the
registry in step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

import megaloop as ml
from megaloop.frontend.ops.rope import LAYOUTS
from tests.helpers import TORCH_DTYPES, random_values
from tests.sample_ref import sample_partial_ref, sample_ref

TD = TORCH_DTYPES
FLOATS = ("float32", "float16", "bfloat16")
INTS = ("int32", "int64")


@dataclass
class Sample:
    shapes: list[tuple[int, ...]]
    kw: dict[str, Any] = field(default_factory=dict)
    domains: tuple[Any, ...] | None = None  # overrides the row's domains for this draw


@dataclass(frozen=True)
class Row:
    op: str
    label: str
    build: Callable[..., Any]  # (graph, *operand tensors, **kw) -> Tensor or tuple of Tensors
    ref: Callable[..., Any]  # (*torch float64/int64/bool tensors, dtype=name, **kw) -> tensor(s)
    sample: Callable[[np.random.Generator], Sample]
    dtypes: tuple[str, ...] = FLOATS
    domains: tuple[Any, ...] = ()  # per operand: see helpers.random_values; default "normal"
    fixed: dict[int, str] = field(default_factory=dict)  # operand index -> dtype regardless of row dtype
    states: tuple[int, ...] = ()  # operands declared as graph state rather than input
    reduce_len: Callable[[Sample], int] = lambda s: 1
    # True for sums of products (sum, mean, matmul) whose result can cancel to far below its terms:
    # the accumulation error is then judged against the op applied to |operands|
    cancels: bool = False

    @property
    def id(self) -> str:
        return f"{self.op}-{self.label}"


def build_row(row: Row, dtype_name: str, seed: int, graph: ml.Graph | None = None, prefix: str = "") -> tuple:
    """A graph for one draw of a row: (graph, inputs, state, operand arrays, output tensors, sample).
    With ``graph``, the row is added to that graph, its names prefixed by ``prefix``."""
    rng = np.random.default_rng(seed)
    sample = row.sample(rng)
    domains = sample.domains or row.domains or ("normal",) * len(sample.shapes)
    g = graph if graph is not None else ml.Graph(f"{row.id}-{dtype_name}")
    tensors, feeds, state, arrays = [], {}, {}, []
    for i, shape in enumerate(sample.shapes):
        dt = ml.as_dtype(row.fixed.get(i, dtype_name))
        values = random_values(rng, shape, dt, domains[i] if i < len(domains) else "normal")
        arrays.append(values)
        if i in row.states:
            tensors.append(g.state(f"{prefix}s{i}", shape, dt))
            state[f"{prefix}s{i}"] = values
        else:
            tensors.append(g.input(f"{prefix}x{i}", shape, dt))
            feeds[f"{prefix}x{i}"] = values
    with g.scope(prefix.rstrip(".") or "row"):
        built = row.build(g, *tensors, **sample.kw)
    outs = built if isinstance(built, tuple) else (built,)
    for k, t in enumerate(outs):
        g.output(f"{prefix}y{k}", t)
    return g, feeds, state, arrays, outs, sample


# ---- shape generators ---------------------------------------------------------------------------


def rand_shape(rng: np.random.Generator, lo: int = 0, hi: int = 4, dmax: int = 6) -> tuple[int, ...]:
    return tuple(int(d) for d in rng.integers(1, dmax + 1, rng.integers(lo, hi + 1)))


def broadcastable(rng: np.random.Generator, n: int, lo: int = 0) -> list[tuple[int, ...]]:
    """n shapes that broadcast together: a common shape with leading axes dropped and some sizes 1."""
    base = rand_shape(rng, lo=lo)
    out = []
    for _ in range(n):
        drop = int(rng.integers(0, len(base) + 1)) if rng.random() < 0.5 else 0
        s = [1 if rng.random() < 0.3 else d for d in base[drop:]]
        out.append(tuple(s))
    return out


def one(lo: int = 0, hi: int = 4) -> Callable[[np.random.Generator], Sample]:
    return lambda rng: Sample([rand_shape(rng, lo, hi)])


def many(n: int) -> Callable[[np.random.Generator], Sample]:
    return lambda rng: Sample(broadcastable(rng, n))


def rnd(t: torch.Tensor, dtype: str) -> torch.Tensor:
    """Round an intermediate to the graph's dtype, as megaloop does between ops."""
    return t.to(TD[dtype]).double()


# ---- elementwise --------------------------------------------------------------------------------

ROWS: list[Row] = []


def row(*args: Any, **kw: Any) -> None:
    ROWS.append(Row(*args, **kw))


for name, tfn, kinds in [
    ("add", torch.add, FLOATS + INTS),
    ("sub", torch.sub, FLOATS + INTS),
    ("mul", torch.mul, FLOATS + INTS),
    ("div", torch.div, FLOATS),
    ("maximum", torch.maximum, FLOATS + INTS),
    ("minimum", torch.minimum, FLOATS + INTS),
]:
    row(
        name,
        "broadcast",
        lambda g, a, b, _n=name: getattr(ml, _n)(a, b),
        lambda a, b, _f=tfn, **k: _f(a, b),
        many(2),
        kinds,
        domains=("ties", "ties")
        if name in ("maximum", "minimum")
        else ("normal", "positive" if name == "div" else "normal"),
    )

row(
    "silu_mul",
    "broadcast",
    lambda g, a, b: ml.silu_mul(a, b),
    lambda a, b, **k: F.silu(a) * b,
    many(2),
    FLOATS,
    domains=("normal", "normal"),
)
row("pow", "broadcast", lambda g, a, b: a**b, lambda a, b, **k: torch.pow(a, b), many(2), domains=("positive", "unit"))
row("pow", "scalar-exponent", lambda g, a: a**2.0, lambda a, **k: a**2.0, one())
# numpy's integer power, floor_divide and remainder (negative operands, zero divisors: 0 as numpy gives)
row("pow", "int", lambda g, a, b: a**b, lambda a, b, **k: torch.pow(a, b), many(2), INTS,
    domains=(("int", -9, 10), ("int", 0, 6)))  # fmt: skip
row("pow", "int-scalar-exponent", lambda g, a: a**3, lambda a, **k: a**3, one(), INTS)


def _numpy_division(fn: Callable[..., Any]) -> Callable[..., Any]:
    """torch's floor_divide or remainder with numpy's integer zero divisor (0; torch raises)."""

    def ref(a, b, **k):
        if a.dtype.is_floating_point:
            return fn(a, b)
        return torch.where(b == 0, 0, fn(a, torch.where(b == 0, 1, b)))

    return ref


for _name, _fn in (("floor_divide", torch.floor_divide), ("remainder", torch.remainder)):
    _build = getattr(ml, _name)
    row(_name, "broadcast", lambda g, a, b, _b=_build: _b(a, b), _numpy_division(_fn), many(2), FLOATS + INTS,
        domains=(("int", -20, 21), ("int", -4, 5)))  # fmt: skip
    row(_name, "float", lambda g, a, b, _b=_build: _b(a, b), _numpy_division(_fn), many(2), FLOATS,
        domains=("ties", ("choice", -2.5, -0.5, 0.25, 1.5, 4.0)))  # fmt: skip
    row(_name, "scalar", lambda g, a, _b=_build: _b(a, -3), lambda a, _f=_fn, **k: _f(a, -3), one(), FLOATS + INTS,
        domains=(("int", -20, 21),))  # fmt: skip
row("add", "scalar", lambda g, a: a + 0.3, lambda a, **k: a + 0.3, one())
row("add", "int-scalar", lambda g, a: 7 + a, lambda a, **k: 7 + a, one(), INTS)
row("sub", "scalar-left", lambda g, a: 2.0 - a, lambda a, **k: 2.0 - a, one())
row("mul", "scale", lambda g, a: ml.scale(a, 0.125), lambda a, **k: a * 0.125, one())
row("div", "scalar", lambda g, a: a / 3.0, lambda a, **k: a / 3.0, one())
row("div", "scalar-left", lambda g, a: 1.0 / a, lambda a, **k: 1.0 / a, one(), domains=("positive",))
row("maximum", "scalar", lambda g, a: ml.maximum(a, 0.0), lambda a, **k: torch.clamp_min(a, 0.0), one())

for name, tfn in [
    ("equal", torch.eq),
    ("not_equal", torch.ne),
    ("less", torch.lt),
    ("less_equal", torch.le),
    ("greater", torch.gt),
    ("greater_equal", torch.ge),
]:
    row(
        name,
        "broadcast",
        lambda g, a, b, _n=name: getattr(ml, _n)(a, b),
        lambda a, b, _f=tfn, **k: _f(a, b),
        many(2),
        FLOATS + INTS + (("bool",) if name in ("equal", "not_equal") else ()),
        domains=("ties", "ties"),
    )
row("less", "scalar", lambda g, a: a < 0.5, lambda a, **k: a < 0.5, one(), domains=("ties",))
row("equal", "bool", lambda g, a, b: ml.equal(a, b), lambda a, b, **k: a == b, many(2), ("bool",))
row("logical_and", "broadcast", lambda g, a, b: a & b, lambda a, b, **k: a & b, many(2), ("bool",))
row("logical_or", "broadcast", lambda g, a, b: a | b, lambda a, b, **k: a | b, many(2), ("bool",))
row("logical_not", "plain", lambda g, a: ~a, lambda a, **k: ~a, one(), ("bool",))
row(
    "where",
    "broadcast",
    lambda g, c, a, b: ml.where(c, a, b),
    lambda c, a, b, **k: torch.where(c, a, b),
    many(3),
    FLOATS + INTS + ("bool",),
    domains=("bool", "normal", "normal"),
    fixed={0: "bool"},
)
row(
    "where",
    "scalar",
    lambda g, c, a: ml.where(c, a, 0.0),
    lambda c, a, **k: torch.where(c, a, 0.0),
    many(2),
    domains=("bool", "normal"),
    fixed={0: "bool"},
)

for name, tfn, domain, kinds in [
    ("neg", torch.neg, "normal", FLOATS + INTS),
    ("abs", torch.abs, "normal", FLOATS + INTS),
    ("exp", torch.exp, "normal", FLOATS),
    ("log", torch.log, "positive", FLOATS),
    ("sqrt", torch.sqrt, "positive", FLOATS),
    ("rsqrt", torch.rsqrt, "positive", FLOATS),
    ("reciprocal", torch.reciprocal, "normal", FLOATS),
    ("tanh", torch.tanh, "normal", FLOATS),
    ("sigmoid", torch.sigmoid, "normal", FLOATS),
    ("relu", torch.relu, "normal", FLOATS + INTS),
    ("silu", F.silu, "normal", FLOATS),
    ("erf", torch.erf, "normal", FLOATS),
]:
    row(
        name,
        "plain",
        lambda g, a, _n=name: getattr(ml, _n)(a),
        lambda a, _f=tfn, **k: _f(a),
        one(),
        kinds,
        domains=(domain,),
    )
row("gelu", "erf", lambda g, a: ml.gelu(a), lambda a, **k: F.gelu(a), one())
row("gelu", "tanh", lambda g, a: ml.gelu(a, approximate="tanh"), lambda a, **k: F.gelu(a, approximate="tanh"), one())
row("sigmoid", "large", lambda g, a: ml.sigmoid(a * 40.0), lambda a, dtype: torch.sigmoid(rnd(a * 40.0, dtype)), one())
KINKS = ("choice", -5.0, -3.0, -2.75, -1.5, -0.25, 0.0, 0.5, 1.25, 2.75, 3.0, 4.5)  # both sides of -3 and 3
row("hardswish", "kinks", lambda g, a: ml.hardswish(a), lambda a, **k: F.hardswish(a), one(), domains=(KINKS,))
row("hardsigmoid", "kinks", lambda g, a: ml.hardsigmoid(a), lambda a, **k: F.hardsigmoid(a), one(), domains=(KINKS,))
row("clip", "both", lambda g, a: ml.clip(a, -1, 2), lambda a, **k: torch.clamp(a, -1, 2), one(), FLOATS + INTS)


def _cast_ref(a: torch.Tensor, dtype: str, to: str) -> torch.Tensor:
    return a.to(TD[dtype]).to(TD[to])


for to in ("float32", "float16", "bfloat16", "bool"):
    row(
        "cast",
        f"to-{to}",
        lambda g, a, _t=to: ml.cast(a, _t),
        lambda a, dtype, _t=to: _cast_ref(a, dtype, _t),
        lambda rng: Sample([rand_shape(rng)]),
        FLOATS + (("int32", "int64") if to != "bool" else ()) + ("bool",),
    )
row("cast", "int64-to-int32", lambda g, a: a.astype("int32"), lambda a, **k: a.to(torch.int32), one(), ("int64",))

# ---- reductions ----------------------------------------------------------------------------------


def _reduce_sample(rng: np.random.Generator, single_axis: bool = False) -> Sample:
    shape = rand_shape(rng, 1, 4)
    choice = rng.integers(0, 3)
    if single_axis or choice == 0:
        axis: Any = int(rng.integers(-len(shape), len(shape)))
    elif choice == 1:
        axis = None
    else:
        k = int(rng.integers(1, len(shape) + 1))
        axis = tuple(int(a) for a in rng.choice(len(shape), k, replace=False))
    return Sample([shape], {"axis": axis, "keepdims": bool(rng.random() < 0.5)})


def _reduced_len(s: Sample) -> int:
    shape, axis = s.shapes[0], s.kw["axis"]
    axes = range(len(shape)) if axis is None else [axis] if isinstance(axis, int) else axis
    return math.prod(shape[a] for a in axes)


def _torch_axes(axis: Any, ndim: int) -> tuple[int, ...]:
    return tuple(range(ndim)) if axis is None else (axis,) if isinstance(axis, int) else tuple(axis)


row(
    "sum",
    "axes",
    lambda g, a, axis, keepdims: ml.sum(a, axis, keepdims=keepdims),
    lambda a, axis, keepdims, **k: torch.sum(a, _torch_axes(axis, a.ndim), keepdim=keepdims),
    _reduce_sample,
    FLOATS + INTS,
    reduce_len=_reduced_len,
    cancels=True,
)
row(
    "mean",
    "axes",
    lambda g, a, axis, keepdims: ml.mean(a, axis, keepdims=keepdims),
    lambda a, axis, keepdims, **k: torch.mean(a, _torch_axes(axis, a.ndim), keepdim=keepdims),
    _reduce_sample,
    reduce_len=_reduced_len,
    cancels=True,
)
row(
    "max",
    "axes",
    lambda g, a, axis, keepdims: a.max(axis, keepdims=keepdims),
    lambda a, axis, keepdims, **k: torch.amax(a, _torch_axes(axis, a.ndim), keepdim=keepdims),
    _reduce_sample,
    FLOATS + INTS,
    domains=("ties",),
)
row(
    "min",
    "axes",
    lambda g, a, axis, keepdims: a.min(axis, keepdims=keepdims),
    lambda a, axis, keepdims, **k: torch.amin(a, _torch_axes(axis, a.ndim), keepdim=keepdims),
    _reduce_sample,
    FLOATS + INTS,
    domains=("ties",),
)


def _argmax_ref(a: torch.Tensor, axis: Any, keepdims: bool, **k: Any) -> torch.Tensor:
    if axis is None:
        out = torch.argmax(a.reshape(-1))
        return out.reshape((1,) * a.ndim) if keepdims else out
    return torch.argmax(a, axis, keepdim=keepdims)


row(
    "argmax",
    "axis",
    lambda g, a, axis, keepdims: ml.argmax(a, axis, keepdims=keepdims),
    _argmax_ref,
    lambda rng: _reduce_sample(rng, single_axis=True),
    FLOATS + INTS,
    domains=("ties",),
)
row(
    "argmax",
    "flat",
    lambda g, a, axis, keepdims: ml.argmax(a, axis, keepdims=keepdims),
    _argmax_ref,
    lambda rng: Sample([rand_shape(rng, 1)], {"axis": None, "keepdims": bool(rng.random() < 0.5)}),
    FLOATS,
    domains=("ties",),
)


# argmax split over tiles (argmax_partial's ranges, argmax_combine): an axis of 17+ elements (at least
# two ranges of whole packs), long ones on the partial's packed block path, short last ranges
def _split_sample(rng: np.random.Generator) -> Sample:
    shape = list(rand_shape(rng, 0, 2)) + [int(rng.choice([17, 100, 1000, 4100]))]
    axis = int(rng.integers(0, len(shape))) if rng.random() < 0.3 else len(shape) - 1
    shape[axis] = max(shape[axis], 17)
    keepdims = bool(rng.random() < 0.5)
    return Sample([tuple(shape)], {"axis": axis, "keepdims": keepdims, "splits": int(rng.integers(2, 9))})


def _argmax_partial_ref(a: torch.Tensor, axis: int, splits: int, **k: Any) -> torch.Tensor:
    from megaloop.frontend.ops.argmax_split import split_ranges

    n = a.shape[axis]
    _, chunk = split_ranges(n, splits)
    parts = [torch.argmax(a.narrow(axis, lo, min(chunk, n - lo)), axis) + lo for lo in range(0, n, chunk)]
    return torch.stack(parts, axis)


row(
    "argmax_partial",
    "ranges",
    lambda g, a, axis, keepdims, splits: ml.argmax_partial(a, axis, splits=splits),
    _argmax_partial_ref,
    _split_sample,
    FLOATS + INTS,
    domains=("ties",),
)
row(
    "argmax_combine",
    "split",
    lambda g, a, axis, keepdims, splits: ml.argmax(a, axis, keepdims=keepdims, splits=splits),
    lambda a, axis, keepdims, **k: _argmax_ref(a, axis, keepdims),
    _split_sample,
    FLOATS + INTS,
    domains=("ties",),
)

# ---- sampling ------------------------------------------------------------------------------------------


def _sample_sample(rng: np.random.Generator) -> Sample:
    """Rows of logits (ties often: top-k/top-p boundaries inside tie groups) and per-row parameters, some
    broadcast; one of seed and offset always per row (the builder refuses rows sharing both)."""
    rows = rand_shape(rng, 0, 2)
    n = int(rng.choice([1, 2, 7, 33, 300]))
    full, per_row = rows, tuple(1 if rng.random() < 0.5 else d for d in rows)
    seed_shape, offset_shape = (per_row, full) if rng.random() < 0.5 else (full, per_row)
    shapes = [rows + (n,), seed_shape, offset_shape] + [per_row if rng.random() < 0.3 else full for _ in range(4)]
    domains = (
        "ties" if rng.random() < 0.5 else "normal",
        ("int", -(2**62), 2**62),
        ("int", 0, 10**6),
        ("choice", 0.0, 0.25, 1.0, 3.0),
        ("int", 0, n + 2),
        ("choice", 1.0, 0.95, 0.5, 0.1, 1e-9),
        ("choice", 0.0, 0.0, 0.05, 0.3, 1.0),
    )
    return Sample(shapes, domains=domains)


row(
    "sample",
    "temperature-top-k-top-p-min-p",
    lambda g, x, s, o, t, k, p, q: ml.sample(x, s, o, t, k, p, q),
    sample_ref,
    _sample_sample,
    fixed={1: "int64", 2: "int64", 3: "float32", 4: "int64", 5: "float32", 6: "float32"},
)


def _split_sample_sample(rng: np.random.Generator) -> Sample:
    """Rows long enough to split (ranges of 8 up to 4000 logits, some of more than their 32 candidates)."""
    s = _sample_sample(rng)
    n = int(rng.choice([20, 333, 4000]))
    s.shapes[0] = s.shapes[0][:-1] + (n,)
    s.domains = (*s.domains[:4], ("int", 0, n + 2), *s.domains[5:])
    s.kw["splits"] = int(rng.integers(2, 9))
    return s


row(
    "sample_combine",
    "split",
    lambda g, x, s, o, t, k, p, q, splits: ml.sample(x, s, o, t, k, p, q, splits=splits),
    lambda *a, splits, **kw: sample_ref(*a, **kw),
    _split_sample_sample,
    fixed={1: "int64", 2: "int64", 3: "float32", 4: "int64", 5: "float32", 6: "float32"},
)
row(
    "sample_partial",
    "ranges",
    lambda g, x, s, o, t, k, p, q, splits: ml.sample_partial(x, t, splits=splits),
    lambda x, s, o, t, k, p, q, splits, **kw: sample_partial_ref(x, t, splits=splits),
    _split_sample_sample,
    fixed={1: "int64", 2: "int64", 3: "float32", 4: "int64", 5: "float32", 6: "float32"},
)


def _penalty_sample(rng: np.random.Generator) -> Sample:
    """Rows of logits with counts and a prompt mask of their shape (or broadcast: one row's for all),
    per-row penalties (or one for all)."""
    rows = rand_shape(rng, 1, 3)
    n = int(rng.choice([1, 7, 300]))
    full = rows + (n,)
    shared = (1,) * len(rows) + (n,) if rng.random() < 0.3 else full
    per_row = [rows if rng.random() < 0.7 else () for _ in range(3)]
    domains = ("normal", ("int", 0, 4), "bool", ("choice", 1.0, 1.3, 0.7, 2.0), ("choice", 0.0, 0.5, -1.5),
               ("choice", 0.0, 0.25, -0.1))  # fmt: skip
    return Sample([full, shared, shared, *per_row], domains=domains)


def _penalty_ref(x, counts, mask, rep, pres, freq, **kw):
    rep, pres, freq = (v.unsqueeze(-1) for v in (rep, pres, freq))
    seen = mask.bool() | (counts > 0)
    x = torch.where(seen, torch.where(x < 0, x * rep, x / rep), x)
    return x - freq * counts - pres * (counts > 0)


row(
    "penalize",
    "repetition-presence-frequency",
    lambda g, x, c, m, r, p, f: ml.penalize(x, c, m, r, p, f),
    _penalty_ref,
    _penalty_sample,
    fixed={1: "int32", 2: "bool", 3: "float32", 4: "float32", 5: "float32"},
)

# ---- normalisations -------------------------------------------------------------------------------


def _axis_sample(rng: np.random.Generator) -> Sample:
    shape = rand_shape(rng, 1, 4, dmax=9)
    return Sample([shape], {"axis": int(rng.integers(-len(shape), len(shape)))})


row(
    "softmax",
    "axis",
    lambda g, a, axis: ml.softmax(a, axis),
    lambda a, axis, **k: torch.softmax(a, axis),
    _axis_sample,
    reduce_len=lambda s: s.shapes[0][s.kw["axis"]],
)
row(
    "log_softmax",
    "axis",
    lambda g, a, axis: ml.log_softmax(a, axis),
    lambda a, axis, **k: torch.log_softmax(a, axis),
    _axis_sample,
    reduce_len=lambda s: s.shapes[0][s.kw["axis"]],
)
row(
    "softmax",
    "wide-rows",
    lambda g, a: ml.softmax(a * 30.0),
    lambda a, dtype: torch.softmax(rnd(a * 30.0, dtype), -1),
    lambda rng: Sample([(3, 257)]),
    reduce_len=lambda s: 257,
)


def _norm_sample(nparams: int) -> Callable[[np.random.Generator], Sample]:
    def sample(rng: np.random.Generator) -> Sample:
        x = rand_shape(rng, 0, 3) + (int(rng.integers(1, 70)),)
        return Sample([x] + [(x[-1],)] * nparams)

    return sample


row(
    "layernorm",
    "plain",
    lambda g, x: ml.layernorm(x),
    lambda x, **k: F.layer_norm(x, x.shape[-1:], eps=1e-5),
    _norm_sample(0),
    reduce_len=lambda s: s.shapes[0][-1],
)
row(
    "layernorm",
    "affine",
    lambda g, x, w, b: ml.layernorm(x, w, b, eps=1e-3),
    lambda x, w, b, **k: F.layer_norm(x, x.shape[-1:], w, b, eps=1e-3),
    _norm_sample(2),
    reduce_len=lambda s: s.shapes[0][-1],
)
row(
    "layernorm",
    "bias-only",
    lambda g, x, b: ml.layernorm(x, bias=b),
    lambda x, b, **k: F.layer_norm(x, x.shape[-1:], None, b, eps=1e-5),
    _norm_sample(1),
    reduce_len=lambda s: s.shapes[0][-1],
)
row(
    "rmsnorm",
    "weight",
    lambda g, x, w: ml.rmsnorm(x, w, eps=1e-6),
    lambda x, w, **k: F.rms_norm(x, x.shape[-1:], w, eps=1e-6),
    _norm_sample(1),
    reduce_len=lambda s: s.shapes[0][-1],
)
row(
    "rmsnorm",
    "plain",
    lambda g, x: ml.rmsnorm(x, eps=1e-5),
    lambda x, **k: F.rms_norm(x, x.shape[-1:], eps=1e-5),
    _norm_sample(0),
    reduce_len=lambda s: s.shapes[0][-1],
)


# With a residual: the norm of x + residual as an add would have stored it (rounded to the dtype);
# short rows (warp paths), long ones (block path, the residual streaming through its own ring), odd
# lengths (the element-by-element path)
def _residual_sample(lengths: tuple[int, ...], nparams: int) -> Callable[[np.random.Generator], Sample]:
    def sample(rng: np.random.Generator) -> Sample:
        x = rand_shape(rng, 1, 3) + (int(rng.choice(lengths)),)
        return Sample([x, x] + [(x[-1],)] * nparams)

    return sample


row(
    "rmsnorm",
    "residual",
    lambda g, x, r, w: ml.rmsnorm(x, w, eps=1e-6, residual=r),
    lambda x, r, w, dtype, **k: F.rms_norm(rnd(x + r, dtype), x.shape[-1:], w, eps=1e-6),
    _residual_sample((5, 64, 2048, 3080), 1),
    reduce_len=lambda s: s.shapes[0][-1],
)
row(
    "layernorm",
    "residual",
    lambda g, x, r, w, b: ml.layernorm(x, w, b, eps=1e-5, residual=r),
    lambda x, r, w, b, dtype, **k: F.layer_norm(rnd(x + r, dtype), x.shape[-1:], w, b, eps=1e-5),
    _residual_sample((7, 96, 2048), 2),
    reduce_len=lambda s: s.shapes[0][-1],
)

# Rows of 128 packs (16 bytes) or more take the block-per-row path (codegen/emit.py BLOCK_ROW_PACKS);
# lengths not a multiple of the block's threads leave some threads with fewer packs.
row(
    "softmax",
    "long-rows",
    lambda g, a: ml.softmax(a, -1),
    lambda a, **k: torch.softmax(a, -1),
    lambda rng: Sample([(2, 4104)]),
    reduce_len=lambda s: 4104,
)
row(
    "log_softmax",
    "long-rows",
    lambda g, a: ml.log_softmax(a, -1),
    lambda a, **k: torch.log_softmax(a, -1),
    lambda rng: Sample([(3, 2048)]),
    reduce_len=lambda s: 2048,
)
row(
    "layernorm",
    "long-rows",
    lambda g, x, w, b: ml.layernorm(x, w, b, eps=1e-3),
    lambda x, w, b, **k: F.layer_norm(x, x.shape[-1:], w, b, eps=1e-3),
    lambda rng: Sample([(2, 3080), (3080,), (3080,)]),
    reduce_len=lambda s: 3080,
)
row(
    "rmsnorm",
    "long-rows",
    lambda g, x, w: ml.rmsnorm(x, w, eps=1e-6),
    lambda x, w, **k: F.rms_norm(x, x.shape[-1:], w, eps=1e-6),
    lambda rng: Sample([(1, 3, 2048), (2048,)]),
    reduce_len=lambda s: 2048,
)

# ---- matmul -----------------------------------------------------------------------------------------


def _matmul_sample(ta: bool, tb: bool, batch: str) -> Callable[[np.random.Generator], Sample]:
    def sample(rng: np.random.Generator) -> Sample:
        m, k, n = (int(d) for d in rng.integers(1, 40, 3))
        if batch == "none":
            ba, bb = (), ()
        elif batch == "same":
            ba = bb = rand_shape(rng, 1, 2, dmax=3)
        else:  # broadcast batch dims
            ba, bb = broadcastable(rng, 2, lo=1)
        a = ba + ((k, m) if ta else (m, k))
        b = bb + ((n, k) if tb else (k, n))
        return Sample([a, b], {"k": k})

    return sample


def _matmul_ref(a: torch.Tensor, b: torch.Tensor, ta: bool, tb: bool) -> torch.Tensor:
    return torch.matmul(a.transpose(-1, -2) if ta else a, b.transpose(-1, -2) if tb else b)


for ta, tb, batch in [
    (False, False, "none"),
    (True, False, "none"),
    (False, True, "none"),
    (True, True, "none"),
    (False, False, "same"),
    (False, True, "broadcast"),
    (True, False, "broadcast"),
]:
    row(
        "matmul",
        f"ta{int(ta)}-tb{int(tb)}-{batch}",
        lambda g, a, b, k, _ta=ta, _tb=tb: ml.matmul(a, b, transpose_a=_ta, transpose_b=_tb),
        lambda a, b, k, _ta=ta, _tb=tb, **kw: _matmul_ref(a, b, _ta, _tb),
        _matmul_sample(ta, tb, batch),
        reduce_len=lambda s: s.kw["k"],
        cancels=True,
    )
row(
    "matmul",
    "linear",
    lambda g, x, w: ml.linear(x, w),
    lambda x, w, **k: F.linear(x, w),
    lambda rng: Sample([(2, 5, 33), (17, 33)]),
    reduce_len=lambda s: 33,
    cancels=True,
)


# rmsnorm_linear: the rows rmsnorm stores (rounded to the dtype), times w.T. Decode-shaped rows (the
# tiles' packed path: K a multiple of 16 bytes, few rows) and any other shape (the per-element path).
def _norm_linear_sample(residual: bool) -> Callable[[np.random.Generator], Sample]:
    def sample(rng: np.random.Generator) -> Sample:
        if rng.random() < 0.5:
            x, k = (1, int(rng.integers(1, 5))), 8 * int(rng.integers(1, 40))
        else:
            x, k = rand_shape(rng, 1, 3), int(rng.integers(1, 70))
        n = int(rng.integers(1, 40))
        shapes = [x + (k,), (n, k), (k,)] + ([x + (k,)] if residual else [])
        return Sample(shapes, {"k": k})

    return sample


row(
    "rmsnorm_linear",
    "plain",
    lambda g, x, w, nw, k: ml.rmsnorm_linear(x, w, nw, eps=1e-6),
    lambda x, w, nw, dtype, k, **kw: F.linear(rnd(F.rms_norm(x, x.shape[-1:], nw, eps=1e-6), dtype), w),
    _norm_linear_sample(False),
    reduce_len=lambda s: s.kw["k"],
    cancels=True,
)
row(
    "rmsnorm_linear",
    "residual",
    lambda g, x, w, nw, r, k: ml.rmsnorm_linear(x, w, nw, eps=1e-5, residual=r),
    lambda x, w, nw, r, dtype, k, **kw: F.linear(
        rnd(F.rms_norm(rnd(x + r, dtype), x.shape[-1:], nw, eps=1e-5), dtype), w
    ),
    _norm_linear_sample(True),
    reduce_len=lambda s: s.kw["k"],
    cancels=True,
)


# swiglu_linear: silu(h @ gate.T) * (h @ up.T), each product rounded to the dtype, h = x or its
# rmsnorm (with a residual); the same decode-shaped and any-shape samples as rmsnorm_linear.
def _swiglu_sample(norm: bool) -> Callable[[np.random.Generator], Sample]:
    def sample(rng: np.random.Generator) -> Sample:
        s = _norm_linear_sample(norm)(rng)
        x, w = s.shapes[:2]
        return Sample([x, w, w] + ([(x[-1],), x] if norm else []), s.kw)

    return sample


def _swiglu_ref(h: Any, gw: Any, uw: Any, dtype: str) -> Any:
    return F.silu(rnd(F.linear(h, gw), dtype)) * rnd(F.linear(h, uw), dtype)


row(
    "swiglu_linear",
    "plain",
    lambda g, x, gw, uw, k: ml.swiglu_linear(x, gw, uw),
    lambda x, gw, uw, dtype, k, **kw: _swiglu_ref(x, gw, uw, dtype),
    _swiglu_sample(False),
    reduce_len=lambda s: s.kw["k"],
    cancels=True,
)
row(
    "swiglu_linear",
    "normed",
    lambda g, x, gw, uw, nw, r, k: ml.swiglu_linear(x, gw, uw, norm_weight=nw, eps=1e-5, residual=r),
    lambda x, gw, uw, nw, r, dtype, k, **kw: _swiglu_ref(
        rnd(F.rms_norm(rnd(x + r, dtype), x.shape[-1:], nw, eps=1e-5), dtype), gw, uw, dtype
    ),
    _swiglu_sample(True),
    reduce_len=lambda s: s.kw["k"],
    cancels=True,
)


# ---- embedding / rope --------------------------------------------------------------------------------


def _embedding_sample(rng: np.random.Generator) -> Sample:
    v, d = int(rng.integers(1, 50)), int(rng.integers(1, 20))
    return Sample([(v, d), rand_shape(rng, 0, 3)], domains=("normal", ("int", 0, v)))


row(
    "embedding",
    "int64",
    lambda g, t, i: ml.embedding(t, i),
    lambda t, i, **k: F.embedding(i, t),
    _embedding_sample,
    fixed={1: "int64"},
)
row(
    "embedding",
    "int32",
    lambda g, t, i: ml.embedding(t, i),
    lambda t, i, **k: F.embedding(i, t),
    _embedding_sample,
    fixed={1: "int32"},
)


def _scatter_sample(rng: np.random.Generator) -> Sample:
    rows, n, d = int(rng.integers(1, 30)), int(rng.integers(1, 40)), int(rng.integers(1, 300))
    return Sample([(n, d), (n,)], {"rows": rows}, domains=("normal", ("int", 0, rows)))


row(
    "scatter_add",
    "rows",
    lambda g, v, i, rows: ml.scatter_add(v, i, rows),
    lambda v, i, rows, **k: torch.zeros(rows, v.shape[1], dtype=v.dtype).index_add(0, i, v),
    _scatter_sample,
    fixed={1: "int64"},
    reduce_len=lambda s: s.shapes[0][0],
)
row(  # a table of ints (the serving step's token ids by slot and position)
    "embedding",
    "int-table",
    lambda g, t, i: ml.embedding(t, i),
    lambda t, i, **k: t[i],
    _embedding_sample,
    INTS,
    fixed={1: "int64"},
)


def llama3_inv_freq(dim: int, theta: float, factor: float, low: float, high: float, old: int) -> torch.Tensor:
    """Written from the Llama 3.1 release notes' description, independently of megaloop's version."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    out = []
    for f in inv.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(f)
        elif wavelen > old / low:
            out.append(f / factor)
        else:
            s = (old / wavelen - low) / (high - low)
            out.append((1 - s) * f / factor + s * f)
    return torch.tensor(out, dtype=torch.float64)


def rope_ref(
    x: torch.Tensor,
    pos: torch.Tensor,
    theta: float = 10000.0,
    layout: str = "neox",
    rotary_dim: int | None = None,
    scaling: dict | None = None,
    **k: Any,
) -> torch.Tensor:
    d = x.shape[-1]
    rd = rotary_dim or d
    if scaling is None:
        inv = 1.0 / (theta ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd))
    elif scaling["type"] == "linear":
        inv = 1.0 / (theta ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd)) / scaling["factor"]
    elif scaling["type"] == "longrope":  # transformers' form: 1 / (factor * theta^(2i/rd))
        factors = torch.tensor(scaling["factors"], dtype=torch.float64)
        inv = 1.0 / (factors * theta ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd))
    else:
        inv = llama3_inv_freq(
            rd,
            theta,
            scaling["factor"],
            scaling["low_freq_factor"],
            scaling["high_freq_factor"],
            scaling["original_max_position_embeddings"],
        )
    ang = pos.to(torch.float64).broadcast_to(x.shape[:-1]).unsqueeze(-1) * inv
    xr, rest = x[..., :rd], x[..., rd:]
    if layout == "neox":  # Hugging Face's rotate_half formulation
        emb = torch.cat([ang, ang], -1)
        half1, half2 = xr[..., : rd // 2], xr[..., rd // 2 :]
        rotated = torch.cat([-half2, half1], -1)
        out = xr * emb.cos() + rotated * emb.sin()
    else:  # complex multiplication of (even, odd) pairs, as in the original Llama code
        z = torch.view_as_complex(xr.reshape(*xr.shape[:-1], rd // 2, 2).contiguous())
        out = torch.view_as_real(z * torch.polar(torch.ones_like(ang), ang)).reshape(xr.shape)
    return torch.cat([out, rest], -1)


def _rope_sample(rotary: bool = False, three_d: bool = False) -> Callable[[np.random.Generator], Sample]:
    def sample(rng: np.random.Generator) -> Sample:
        b, h, t = (int(v) for v in rng.integers(1, 5, 3))
        d = 2 * int(rng.integers(1, 17))
        kw = {}
        if rotary:
            kw["rotary_dim"] = 2 * int(rng.integers(1, d // 2 + 1))
        if three_d:
            return Sample([(b, t, d), (b, t)], kw)
        return Sample([(b, h, t, d), (b, 1, t)], kw)

    return sample


def _rope_fixed(d: int, rotary: int) -> Callable[[np.random.Generator], Sample]:
    """[b, h, t, d] with ``rotary`` dims turned: a head width longrope's factors are written for."""

    def sample(rng: np.random.Generator) -> Sample:
        b, h, t = (int(v) for v in rng.integers(1, 5, 3))
        return Sample([(b, h, t, d), (b, 1, t)], {"rotary_dim": rotary})

    return sample


def _longrope(pairs: int) -> dict:
    return {"type": "longrope", "factors": tuple(float(f) for f in np.geomspace(1.0, 40.0, pairs))}


_LLAMA3 = {
    "type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
for label, extra, sampler in [
    ("neox", {"layout": "neox"}, _rope_sample()),
    ("interleaved", {"layout": "interleaved"}, _rope_sample()),
    ("partial-neox", {"layout": "neox"}, _rope_sample(rotary=True)),
    ("partial-interleaved", {"layout": "interleaved"}, _rope_sample(rotary=True)),
    ("llama3-scaling", {"theta": 500000.0, "scaling": _LLAMA3}, _rope_sample()),
    ("linear-scaling", {"scaling": {"type": "linear", "factor": 4.0}}, _rope_sample()),
    ("3d", {"theta": 1e6}, _rope_sample(three_d=True)),
    ("longrope-partial", {"scaling": _longrope(6)}, _rope_fixed(16, 12)),
]:
    row(
        "rope",
        label,
        lambda g, x, p, _e=extra, **kw: ml.rope(x, p, **_e, **kw),
        lambda x, p, _e=extra, **kw: rope_ref(x, p, **_e, **{k: v for k, v in kw.items() if k != "dtype"}),
        sampler,
        domains=("normal", ("int", 0, 20000)),
        fixed={1: "int64"},
    )


def _rope_wide(d: int, rotary: int | None = None, tokens: int = 160) -> Callable[[np.random.Generator], Sample]:
    """[2, 4, tokens, d]: rope's per-pair path with 16-byte packs, several items a thread, several tasks
    (and now and then 4 tokens: the plan interpreter's tests take draws of few tasks)."""

    def sample(rng: np.random.Generator) -> Sample:
        n = 4 if rng.random() < 0.3 else tokens
        return Sample([(2, 4, n, d), (2, 1, n)], {} if rotary is None else {"rotary_dim": rotary})

    return sample


for label, extra, sampler in [
    ("wide-neox", {"layout": "neox"}, _rope_wide(64)),
    ("wide-interleaved", {"layout": "interleaved"}, _rope_wide(64)),
    ("wide-partial-neox", {"layout": "neox"}, _rope_wide(128, rotary=48)),
    ("wide-partial-interleaved", {"layout": "interleaved"}, _rope_wide(128, rotary=80)),
    ("wide-llama3", {"theta": 500000.0, "scaling": _LLAMA3}, _rope_wide(128)),
    ("wide-longrope", {"scaling": _longrope(32)}, _rope_wide(64)),
]:
    row(
        "rope",
        label,
        lambda g, x, p, _e=extra, **kw: ml.rope(x, p, **_e, **kw),
        lambda x, p, _e=extra, **kw: rope_ref(x, p, **_e, **{k: v for k, v in kw.items() if k != "dtype"}),
        sampler,
        domains=("normal", ("int", 0, 1_000_000)),  # far positions: the float64 angle and its reduction
        fixed={1: "int64"},
    )


def rope_table_ref(x, cos, sin, *, layout="neox", rotary_dim=None, per_pair=False, **kw):
    """x * cos + rotate(x) * sin over the first rotary_dim dims (transformers' apply_rotary_pos_emb for
    neox tables of a value a dim), a pair's value at both its dims where ``per_pair``."""
    rd = rotary_dim or cos.shape[-1]
    neox = layout == "neox"
    if per_pair:
        cos, sin = ((torch.cat([t, t], -1) if neox else t.repeat_interleave(2, -1)) for t in (cos, sin))
    rot = x[..., :rd]
    if neox:
        turned = torch.cat([-rot[..., rd // 2 :], rot[..., : rd // 2]], -1)
    else:
        turned = torch.stack([-rot[..., 1::2], rot[..., 0::2]], -1).flatten(-2)
    return torch.cat([rot * cos + turned * sin, x[..., rd:]], -1)


def _rope_table_sample(per_pair: bool, partial: bool) -> Callable[[np.random.Generator], Sample]:
    def sample(rng: np.random.Generator) -> Sample:
        b, h, t = int(rng.integers(1, 3)), int(rng.integers(1, 4)), int(rng.integers(1, 9))
        hd = 2 * int(rng.integers(1, 33))
        rd = 2 * int(rng.integers(1, hd // 2 + 1)) if partial else hd
        n = rd // 2 if per_pair else rd
        tables = [(t, n), (b, 1, t, n), (1, n), (b, h, t, n)][int(rng.integers(4))]
        kw = {"rotary_dim": rd} if per_pair or partial else {}
        return Sample([(b, h, t, hd), tables, tables], kw, ("normal", "unit", "unit"))

    return sample


for _layout in LAYOUTS:
    for _pairs, _partial in ((False, False), (True, False), (False, True), (True, True)):
        row(
            "rope_table",
            f"{_layout}{'-pairs' if _pairs else ''}{'-partial' if _partial else ''}",
            lambda g, x, c, s, _l=_layout, **kw: ml.rope_table(x, c, s, layout=_l, **kw),
            lambda x, c, s, _l=_layout, _p=_pairs, **kw: rope_table_ref(x, c, s, layout=_l, per_pair=_p, **kw),
            _rope_table_sample(_pairs, _partial),
            reduce_len=lambda s: 2,
        )

# ---- attention ---------------------------------------------------------------------------------------


def attention_ref(
    q, k, v, qpos=None, lens=None, *, causal=False, window=None, scale=None, softcap=None, mask=None, **kw
):
    """Dense float64 attention with an explicit mask, via torch's SDPA (written out with a softcap,
    which SDPA lacks: c * tanh(s / c) of the scaled scores); ``mask``: the op's mask operand, bool or
    additive (-inf hides a key); rows that see no key are 0."""
    b, hq, tq, _ = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    lens = torch.full((b,), tk) if lens is None else lens
    if qpos is None:
        qpos = lens[:, None] - tq + torch.arange(tq)[None, :]
    j = torch.arange(tk)
    seen = j[None, None, :] < lens[:, None, None]
    if causal:
        seen = seen & (j[None, None, :] <= qpos[:, :, None])
        if window is not None:
            seen = seen & (j[None, None, :] > qpos[:, :, None] - window)
    seen = seen[:, None]  # [b, 1, tq, tk]
    bias = None
    if mask is not None:
        seen = seen & (mask if mask.dtype == torch.bool else mask != -math.inf)
        bias = None if mask.dtype == torch.bool else mask
    anything = seen.any(-1, keepdim=True)
    # SDPA's mask: a row that sees no key attends to every key (no NaN, in the gradient too), then is 0
    attn = seen | ~anything if bias is None else torch.where(anything, torch.where(seen, bias, -math.inf), 0.0)
    rep = hq // hkv
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    if softcap is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn, scale=scale)
    else:
        scores = q @ k.transpose(-1, -2) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
        scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~attn, -math.inf) if attn.dtype == torch.bool else scores + attn
        out = torch.softmax(scores, -1) @ v
    return torch.where(anything, out, torch.zeros(()))


def _attn_sample(
    gqa: bool,
    tq1: bool = False,
    positions: bool = False,
    lengths: bool = False,
    dv: bool = False,
    blocks: bool = False,
    mask: str | None = None,
) -> Callable[[np.random.Generator], Sample]:
    """``blocks``: shapes of the tensor-core path (16-bit heads of 16..128 in steps of 16, blocks of 16
    queries or more, several key blocks of 64, query counts and key counts that are not whole blocks).
    ``mask`` "bool" or "additive": a mask operand last, of one of the shapes that broadcast to the scores."""

    def sample(rng: np.random.Generator) -> Sample:
        b = int(rng.integers(1, 4))
        hkv = int(rng.integers(1, 3))
        hq = hkv * (int(rng.integers(1, 4)) if gqa else 1)
        tk = int(rng.integers(1, 24))
        tq = 1 if tq1 else int(rng.integers(1, tk + 1))
        d = int(rng.integers(1, 33))
        if blocks:
            b, tq = int(rng.integers(1, 3)), int(rng.integers(16, 90))
            tk, d = int(rng.integers(tq, 200)), int(rng.choice([16, 64, 128]))
        shapes = [(b, hq, tq, d), (b, hkv, tk, d), (b, hkv, tk, int(rng.integers(1, 20)) if dv else d)]
        domains: list[Any] = ["normal"] * 3
        if positions:
            shapes.append((b, tq))
            domains.append(("int", 0, tk))
        if lengths:
            shapes.append((b,))
            domains.append(("int", 1, tk + 1))
        if mask is not None:
            options = [(b, hq, tq, tk), (b, 1, 1, tk), (tq, tk), (hq, 1, tk), (tk,)]
            # (a bool mask broadcast over the keys hides whole rows; an additive one there adds a constant
            # to a row, which changes nothing: its gradient is 0 in exact arithmetic, float32 noise here)
            options += [(1, 1, 1, 1), (b, 1, tq, 1)] if mask == "bool" else []
            shapes.append(options[int(rng.integers(len(options)))])
            domains.append("bool" if mask == "bool" else ("choice", 0.0, -1.5, 0.75, 2.0, -math.inf))
        return Sample(shapes, {"tk": tk, "d": d}, tuple(domains))

    return sample


def _attn_row(
    label: str,
    sampler: Callable[[np.random.Generator], Sample],
    positions: bool = False,
    lengths: bool = False,
    kv_splits: int | None = None,
    mask: str | None = None,
    **opts: Any,
) -> None:
    """A row of attention, or with ``kv_splits`` of its split form (attention_partial, then the
    attention_combine this row is filed under), against the same dense reference. ``mask``: the
    sampler's mask operand ("bool" or "additive", of the row's dtype), last."""

    def build(g, q, k, v, *extra, tk, d):
        qp = extra[0] if positions else None
        ln = extra[positions] if lengths else None
        m = extra[-1] if mask else None
        return ml.attention(q, k, v, q_positions=qp, kv_lengths=ln, kv_splits=kv_splits, mask=m, **opts)

    def ref(q, k, v, *extra, tk, d, dtype):
        qp = extra[0] if positions else None
        ln = extra[positions] if lengths else None
        return attention_ref(q, k, v, qp, ln, mask=extra[-1] if mask else None, **opts)

    fixed = {i: "int64" for i in range(3, 3 + positions + lengths)}
    if mask == "bool":
        fixed[3 + positions + lengths] = "bool"
    op = "attention" if kv_splits is None else "attention_combine"
    row(op, label, build, ref, sampler, fixed=fixed, reduce_len=lambda s: s.kw["tk"] + s.kw["d"])


_attn_row("mha", _attn_sample(gqa=False))


def _attn_grad_sample(rng: np.random.Generator) -> Sample:
    """attention's shapes and the cotangent (q's shape); ``n``: the longest sum (keys, or a key's queries)."""
    s = _attn_sample(gqa=True)(rng)
    _, hq, tq, _ = s.shapes[0]
    hkv = s.shapes[1][1]
    return Sample([*s.shapes, s.shapes[0]], {"n": s.kw["tk"] + s.kw["d"] + tq * hq // hkv}, (*s.domains, "normal"))


def _attn_grad_ref(q, k, v, do, *, n, dtype):
    with torch.enable_grad():  # (the table's references run under no_grad)
        q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        return torch.autograd.grad(attention_ref(q, k, v, causal=True), (q, k, v), do)


row("attention_grad", "causal-gqa", lambda g, q, k, v, do, *, n: ml.attention_grad(q, k, v, do, causal=True),
    _attn_grad_ref, _attn_grad_sample, reduce_len=lambda s: s.kw["n"])  # fmt: skip
_attn_row("causal-gqa", _attn_sample(gqa=True), causal=True)
_attn_row(
    "causal-positions-lengths",
    _attn_sample(gqa=True, positions=True, lengths=True),
    positions=True,
    lengths=True,
    causal=True,
)
_attn_row("decode-lengths", _attn_sample(gqa=True, tq1=True, lengths=True), lengths=True, causal=True)
_attn_row("sliding-window", _attn_sample(gqa=True, positions=True), positions=True, causal=True, window=5)
_attn_row("scale-vdim", _attn_sample(gqa=False, dv=True), scale=0.3)
# blocks of queries on tensor cores (16-bit; float32 takes the other paths)
_attn_row("blocks-causal-gqa", _attn_sample(gqa=True, blocks=True), causal=True)
_attn_row(
    "blocks-positions-lengths",
    _attn_sample(gqa=True, positions=True, lengths=True, blocks=True),
    positions=True,
    lengths=True,
    causal=True,
)
_attn_row("blocks-window", _attn_sample(gqa=True, positions=True, blocks=True), positions=True, causal=True, window=37)
_attn_row("blocks-full-scale", _attn_sample(gqa=False, blocks=True), scale=0.3)
_attn_row("split-decode", _attn_sample(gqa=True, tq1=True, lengths=True), lengths=True, causal=True, kv_splits=3)
_attn_row("split-window", _attn_sample(gqa=True, positions=True), positions=True, causal=True, window=5, kv_splits=4)
# the combine keeps up to 16 ranges' weights in registers (emit_attention.COMBINE_HELD_SPLITS), more take
# the loop that recomputes them; a value width that is not whole warps leaves lanes without a value
_attn_row("split-many", _attn_sample(gqa=True, tq1=True, lengths=True), lengths=True, causal=True, kv_splits=20)
_attn_row("split-vdim", _attn_sample(gqa=False, dv=True), scale=0.3, kv_splits=3)
# logit softcapping (Gemma 2) on each path: a warp a row, tensor cores, split keys, key ranges
_attn_row("softcap-causal-gqa", _attn_sample(gqa=True), causal=True, softcap=1.5)
_attn_row("blocks-softcap-window", _attn_sample(gqa=True, positions=True, blocks=True), positions=True, causal=True,
          window=37, softcap=2.0)  # fmt: skip
_attn_row("split-softcap", _attn_sample(gqa=True, tq1=True, lengths=True), lengths=True, causal=True, kv_splits=3,
          softcap=1.5, scale=0.7)  # fmt: skip
# a mask operand (bool or additive, of shapes that broadcast) with each mask rule, on each path
_attn_row("mask-bool", _attn_sample(gqa=True, mask="bool"), mask="bool")
_attn_row("mask-additive-causal", _attn_sample(gqa=True, mask="additive"), mask="additive", causal=True)
_attn_row("mask-additive-softcap-window", _attn_sample(gqa=True, positions=True, mask="additive"), positions=True,
          mask="additive", causal=True, window=5, softcap=1.5)  # fmt: skip
_attn_row("blocks-mask-bool-causal", _attn_sample(gqa=True, blocks=True, mask="bool"), mask="bool", causal=True)
_attn_row("blocks-mask-additive-softcap",
          _attn_sample(gqa=True, positions=True, lengths=True, blocks=True, mask="additive"), positions=True,
          lengths=True, mask="additive", causal=True, window=37, softcap=2.0)  # fmt: skip
_attn_row("split-mask-additive", _attn_sample(gqa=True, tq1=True, lengths=True, mask="additive"), lengths=True,
          mask="additive", causal=True, kv_splits=3)  # fmt: skip
_attn_row("split-mask-bool-window", _attn_sample(gqa=True, positions=True, mask="bool"), positions=True, mask="bool",
          causal=True, window=5, kv_splits=4)  # fmt: skip


def _partial_sample(rng: np.random.Generator) -> Sample:
    b, hkv = int(rng.integers(1, 3)), int(rng.integers(1, 3))
    hq, splits = hkv * int(rng.integers(1, 4)), int(rng.integers(2, 5))
    tk, tq, d = splits * int(rng.integers(1, 6)), int(rng.integers(1, 4)), int(rng.integers(1, 33))
    return Sample([(b, hq, tq, d), (b, hkv, tk, d), (b, hkv, tk, d)], {"tk": tk, "d": d, "splits": splits})


def _partial_ref(q, k, v, *, tk, d, splits, dtype):
    """Per key range: unnormalised output, max score, exp-sum (every key visible: no -inf)."""
    rep = q.shape[1] // k.shape[1]
    scores = q @ k.repeat_interleave(rep, 1).transpose(-1, -2) / math.sqrt(d)
    values = v.repeat_interleave(rep, 1)
    chunk = -(-tk // splits)
    parts = []
    for s in range(splits):
        sc = scores[..., s * chunk : (s + 1) * chunk]
        m = sc.max(-1).values
        p = torch.exp(sc - m[..., None])
        parts.append(torch.cat([p @ values[:, :, s * chunk : (s + 1) * chunk], m[..., None], p.sum(-1)[..., None]], -1))
    return torch.stack(parts, 3)


row(
    "attention_partial",
    "all-visible",
    lambda g, q, k, v, tk, d, splits: ml.attention_partial(q, k, v, splits=splits),
    _partial_ref,
    _partial_sample,
    reduce_len=lambda s: s.kw["tk"] + s.kw["d"],
)


# attention_partial's append form (a decode step): q [b, 1, hq, d] and the new key and value [b, 1, hkv, d]
# as the projections give them (taken as transposed views), the caches' old values, one position a
# sequence; head widths for both the split-key path and the warp-a-row one
_ROUNDED = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _append_sample(rng: np.random.Generator) -> Sample:
    b, hkv = int(rng.integers(1, 3)), int(rng.integers(1, 3))
    hq, splits = hkv * int(rng.integers(1, 4)), int(rng.integers(2, 5))
    tk, d = splits * int(rng.integers(1, 6)), int(rng.choice([6, 16, 32, 64]))
    shapes = [(b, 1, hq, d), (b, hkv, tk, d), (b, hkv, tk, d), (b, 1), (b, 1, hkv, d), (b, 1, hkv, d)]
    domains = ("normal", "normal", "normal", ("int", 0, tk), "normal", "normal")
    return Sample(shapes, {"tk": tk, "d": d, "splits": splits}, domains)


def _append_masked_sample(rng: np.random.Generator) -> Sample:
    """_append_sample's, and a bool mask over the keys of each sequence (the new key's slot included)."""
    sample = _append_sample(rng)
    b, tk = sample.shapes[0][0], sample.kw["tk"]
    return Sample([*sample.shapes, (b, 1, 1, tk)], sample.kw, (*sample.domains, "bool"))


def _append_build(q, k, v, pos, k_new, v_new, splits, softcap=None, mask=None):
    new = {"k_new": k_new.transpose(1, 2), "v_new": v_new.transpose(1, 2)}
    return ml.attention(
        q.transpose(1, 2), k, v, causal=True, q_positions=pos, kv_splits=splits, **new, rope={}, softcap=softcap,
        mask=mask,
    )  # fmt: skip


def _append_ref(q, k, v, pos, k_new, v_new, mask=None, *, tk, d, splits, dtype, softcap=None):
    """rope (its output rounded to the dtype, as stored), the caches written at pos, then attention."""
    rounded = _ROUNDED[dtype]
    q = rope_ref(q.transpose(1, 2), pos[:, None, :]).to(rounded).double()
    k_new = rope_ref(k_new.transpose(1, 2), pos[:, None, :]).to(rounded).double()
    k, v = k.clone(), v.clone()
    for bi in range(k.shape[0]):
        k[bi, :, pos[bi, 0]] = k_new[bi, :, 0]
        v[bi, :, pos[bi, 0]] = v_new[bi, 0]
    return attention_ref(q, k, v, pos, causal=True, softcap=softcap, mask=mask)


row(
    "attention_combine",
    "append-decode-mask",
    lambda g, q, k, v, pos, kn, vn, m, tk, d, splits: _append_build(q, k, v, pos, kn, vn, splits, mask=m),
    _append_ref,
    _append_masked_sample,
    fixed={3: "int64", 6: "bool"},
    reduce_len=lambda s: s.kw["tk"] + s.kw["d"],
)

for _label, _cap in (("append-decode", None), ("append-decode-softcap", 1.5)):
    row(
        "attention_combine",
        _label,
        lambda g, q, k, v, pos, kn, vn, tk, d, splits, _c=_cap: _append_build(q, k, v, pos, kn, vn, splits, _c),
        lambda *a, _c=_cap, **kw: _append_ref(*a, **kw, softcap=_c),
        _append_sample,
        fixed={3: "int64"},
        reduce_len=lambda s: s.kw["tk"] + s.kw["d"],
    )


def _cache_sample(rng: np.random.Generator) -> Sample:
    b, h, s, d = (int(v) for v in rng.integers(1, 6, 4))
    s += 4
    t = int(rng.integers(1, s + 1))
    return Sample([(b, h, s, d), (b, h, t, d), (b, t)], domains=("normal", "normal", ("distinct", s)))


def _cache_ref(cache, new, pos, **k):
    out = cache.clone()
    for bi in range(cache.shape[0]):
        out[bi].index_copy_(1, pos[bi], new[bi])
    return out


def _cache_sample_long(rng: np.random.Generator) -> Sample:
    """A prefill's worth of rows: the packed copy, several packs a thread."""
    b, h, s, d, t = 2, 3, 600, 64, 512
    return Sample([(b, h, s, d), (b, h, t, d), (b, t)], domains=("normal", "normal", ("distinct", s)))


for label, sampler in [("scatter", _cache_sample), ("long-prefill", _cache_sample_long)]:
    row(
        "kv_cache_update",
        label,
        lambda g, c, n, p: ml.kv_cache_update(c, n, p),
        _cache_ref,
        sampler,
        fixed={2: "int64"},
        states=(0,),
    )


def _masked_cache_sample(rng: np.random.Generator) -> Sample:
    """Positions and a mask: the masked-out tokens' positions become -1 (finished sequences)."""
    s = _cache_sample(rng) if rng.random() < 0.7 else _cache_sample_long(rng)
    return Sample([*s.shapes, s.shapes[2]], domains=(*s.domains, "bool"))


def _masked_cache_ref(cache, new, pos, mask, **k):
    out = cache.clone()
    for bi in range(cache.shape[0]):
        keep = mask[bi]
        out[bi].index_copy_(1, pos[bi][keep], new[bi][:, keep])
    return out


row(
    "kv_cache_update",
    "ignore-negative",
    lambda g, c, n, p, m: ml.kv_cache_update(c, n, ml.where(m, p, -1), ignore_negative=True),
    _masked_cache_ref,
    _masked_cache_sample,
    fixed={2: "int64", 3: "bool"},
    states=(0,),
)


# the key rotated at its slot's position and written into the cache in one op: decode's one token, a
# few tokens, a prefill's worth (several items a thread); partial rotary dims; both layouts
def _rope_cache_sample(rng: np.random.Generator) -> Sample:
    b, h = (int(v) for v in rng.integers(1, 4, 2))
    d = 2 * int(rng.integers(1, 33))
    s = int(rng.integers(4, 40)) if rng.random() < 0.8 else 600
    t = 1 if rng.random() < 0.4 else int(rng.integers(1, min(s, 520) + 1))
    kw = {
        "layout": str(rng.choice(["neox", "interleaved"])),
        "rotary_dim": None if rng.random() < 0.6 else 2 * int(rng.integers(1, d // 2 + 1)),
        "theta": float(rng.choice([10000.0, 500000.0])),
    }
    return Sample([(b, h, s, d), (b, h, t, d), (b, t)], kw, domains=("normal", "normal", ("distinct", s)))


row(
    "rope_kv_cache_update",
    "decode-and-prefill",
    lambda g, c, n, p, **kw: ml.rope_kv_cache_update(c, n, p, **kw),
    lambda c, n, p, dtype, **kw: _cache_ref(c, rnd(rope_ref(n, p[:, None, :], **kw), dtype), p),
    _rope_cache_sample,
    fixed={2: "int64"},
    states=(0,),
)


# the paged KV cache (a serving step's rows of any slots): a page table that is one permutation of the
# pool's pages (built from a flat row of distinct page ids), rows of random slots at distinct positions
# (some unused: -1), grouped-query heads, a sliding window, a head_dim not a power of two
def _paged_sample(update: bool) -> Callable[[np.random.Generator], Sample]:
    def draw(rng: np.random.Generator) -> Sample:
        slots, per_slot, page = int(rng.integers(1, 4)), int(rng.integers(1, 4)), int(rng.choice([1, 2, 4, 8]))
        pages = slots * per_slot + int(rng.integers(0, 4))
        hkv, group, d = int(rng.integers(1, 3)), int(rng.integers(1, 3)), int(rng.choice([4, 6, 16, 40]))
        b, t = (1, int(rng.integers(1, 7))) if update else (int(rng.integers(1, 3)), int(rng.integers(1, 5)))
        t = min(t, per_slot * page)
        kw = {"slots": slots, "per_slot": per_slot, "window": None if rng.random() < 0.6 else int(rng.integers(1, 6))}
        pos = ("distinct", per_slot * page)
        if update:
            shapes = [(pages, hkv, page, d), (b, hkv, t, d), (slots * per_slot,), (b, t), (b, t), (b, t)]
            domains = ("normal", "normal", ("distinct", pages), ("int", 0, slots), pos, "bool")
        else:
            shapes = [(b, hkv * group, t, d), (pages, hkv, page, d), (pages, hkv, page, d), (slots * per_slot,),
                      (b, t), (b, t), (b, t)]  # fmt: skip
            domains = ("normal", "normal", "normal", ("distinct", pages), ("int", 0, slots), pos, "bool")
        return Sample(shapes, kw, domains)

    return draw


def _paged_rows(slot, pos, used):
    return [(bi, ti) for bi in range(pos.shape[0]) for ti in range(pos.shape[1]) if used[bi, ti]]


def _paged_gather(pool, table_row):
    """A slot's keys (values) as one cache [1, kv_heads, pages_per_slot * page_size, dim]."""
    return pool[table_row].permute(1, 0, 2, 3).reshape(1, pool.shape[1], -1, pool.shape[3])


def _paged_attention_ref(q, kp, vp, table, slot, pos, used, *, slots, per_slot, window, dtype):
    table = table.reshape(slots, per_slot)
    out = torch.zeros(q.shape, dtype=torch.float64)
    for bi, ti in _paged_rows(slot, pos, used):
        row = table[slot[bi, ti]]
        k, v = _paged_gather(kp, row), _paged_gather(vp, row)
        qpos = pos[bi, ti].reshape(1, 1)
        out[bi, :, ti] = attention_ref(q[bi : bi + 1, :, ti : ti + 1], k, v, qpos, causal=True, window=window)[0, :, 0]
    return out


def _paged_update_ref(pool, new, table, slot, pos, used, *, slots, per_slot, window, dtype):
    table, page = table.reshape(slots, per_slot), pool.shape[2]
    out = pool.clone()
    for bi, ti in _paged_rows(slot, pos, used):
        p = int(pos[bi, ti])
        out[table[slot[bi, ti], p // page], :, p % page] = new[bi, :, ti]
    return out


row(
    "paged_attention",
    "rows-of-slots",
    lambda g, q, kp, vp, tab, sl, pos, used, slots, per_slot, window: ml.paged_attention(
        q, kp, vp, tab.reshape(slots, per_slot), sl, ml.where(used, pos, -1), window=window
    ),
    _paged_attention_ref,
    _paged_sample(update=False),
    fixed={3: "int64", 4: "int64", 5: "int64", 6: "bool"},
    reduce_len=lambda s: s.shapes[1][2] * s.kw["per_slot"] + s.shapes[0][3],
)
row(
    "paged_kv_cache_update",
    "rows-of-slots",
    lambda g, pool, new, tab, sl, pos, used, slots, per_slot, window: ml.paged_kv_cache_update(
        pool, new, tab.reshape(slots, per_slot), sl, ml.where(used, pos, -1)
    ),
    _paged_update_ref,
    _paged_sample(update=True),
    fixed={2: "int64", 3: "int64", 4: "int64", 5: "bool"},
    states=(0,),
)

# ---- layout ---------------------------------------------------------------------------------------------


def _factor_shape(rng: np.random.Generator, n: int) -> tuple[int, ...]:
    dims, left = [], n
    for p in (2, 3, 5, 7):
        while left % p == 0 and rng.random() < 0.7:
            dims.append(p)
            left //= p
    dims.append(left)
    rng.shuffle(dims)
    if rng.random() < 0.3:
        dims.insert(int(rng.integers(0, len(dims) + 1)), 1)
    if rng.random() < 0.3 and len(dims) > 1:
        dims[0] = -1 if dims[0] != 1 else 1
    return tuple(int(d) for d in dims)


def _reshape_sample(rng: np.random.Generator) -> Sample:
    shape = rand_shape(rng, 1, 4)
    return Sample(
        [shape],
        {"new": _factor_shape(rng, math.prod(shape)), "perm": tuple(int(a) for a in rng.permutation(len(shape)))},
    )


row(
    "reshape",
    "contiguous",
    lambda g, a, new, perm: a.reshape(new),
    lambda a, new, perm, **k: a.reshape(new),
    _reshape_sample,
    FLOATS + INTS + ("bool",),
)
row(
    "reshape",
    "after-permute",
    lambda g, a, new, perm: a.permute(perm).reshape(new),
    lambda a, new, perm, **k: a.permute(perm).reshape(new),
    _reshape_sample,
)
row(
    "permute",
    "random",
    lambda g, a, new, perm: a.permute(perm),
    lambda a, new, perm, **k: a.permute(perm),
    _reshape_sample,
    FLOATS + INTS + ("bool",),
)
row(
    "permute",
    "transpose-of-slice",
    lambda g, a: a[1:, ::2].transpose(0, 1),
    lambda a, **k: a[1:, ::2].transpose(0, 1),
    lambda rng: Sample([(int(rng.integers(2, 7)), int(rng.integers(1, 9)))]),
)


def _index_sample(rng: np.random.Generator) -> Sample:
    shape = rand_shape(rng, 1, 4, dmax=7)
    index: list[Any] = []
    for d in shape:
        r = rng.random()
        if r < 0.25:
            index.append(int(rng.integers(-d, d)))
        elif r < 0.9:
            step = int(rng.choice([1, 1, 2, 3, -1, -2]))
            lo = int(rng.integers(-d, d))
            hi = int(rng.integers(-d, d + 1)) if rng.random() < 0.7 else None
            s = slice(lo, hi, step)
            if len(range(*s.indices(d))) == 0:
                s = slice(None, None, step)
            index.append(s)
        else:
            index.append(slice(None))
    if rng.random() < 0.3:
        index.insert(int(rng.integers(0, len(index) + 1)), None)
    if rng.random() < 0.3 and len(index) > 1:
        k = int(rng.integers(0, len(index)))
        if index[k] is not None:
            index[k:] = [Ellipsis] + [it for it in index[k + 1 :]]
    return Sample([shape], {"index": tuple(index)})


def _torch_index(a: torch.Tensor, index: tuple) -> torch.Tensor:
    """numpy's basic indexing is the behaviour megaloop promises (torch has no negative steps)."""
    return torch.from_numpy(np.array(a.numpy()[index], order="C", copy=True))


row(
    "slice",
    "getitem",
    lambda g, a, index: a[index],
    lambda a, index, **k: _torch_index(a, index),
    _index_sample,
    FLOATS + INTS + ("bool",),
)
row(
    "slice",
    "of-permuted",
    lambda g, a: a.T[::-1, 1:],
    lambda a, **k: torch.flip(a.permute(2, 1, 0), [0])[:, 1:],
    lambda rng: Sample([(int(rng.integers(2, 6)), int(rng.integers(2, 6)), int(rng.integers(1, 4)))]),
)


def _bcast_sample(rng: np.random.Generator) -> Sample:
    target = rand_shape(rng, 1, 4)
    drop = int(rng.integers(0, len(target)))
    src = tuple(1 if rng.random() < 0.4 else d for d in target[drop:])
    return Sample([src], {"target": target})


row(
    "broadcast_to",
    "random",
    lambda g, a, target: ml.broadcast_to(a, target),
    lambda a, target, **k: a.broadcast_to(target),
    _bcast_sample,
    FLOATS + INTS + ("bool",),
)
row(
    "broadcast_to",
    "then-reshape",
    lambda g, a: ml.broadcast_to(a, (4, 3, 2)).reshape(12, 2),
    lambda a, **k: a.broadcast_to((4, 3, 2)).reshape(12, 2),
    lambda rng: Sample([(3, 1)]),
)


def _split_sample(rng: np.random.Generator) -> Sample:
    shape = rand_shape(rng, 1, 4)
    axis = int(rng.integers(0, len(shape)))
    cuts = sorted(set(int(c) for c in rng.integers(1, shape[axis], 2))) if shape[axis] > 1 else []
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, shape[axis]])]
    return Sample([shape], {"axis": axis, "sizes": sizes})


row(
    "split",
    "sizes",
    lambda g, a, axis, sizes: ml.split(a, sizes, axis),
    lambda a, axis, sizes, **k: torch.split(a, sizes, axis),
    _split_sample,
    FLOATS + INTS + ("bool",),
)
row(
    "split",
    "equal-then-view",
    lambda g, a: tuple(p.T for p in ml.split(a, 3, axis=1)),
    lambda a, **k: tuple(p.T for p in torch.split(a, 2, 1)),
    lambda rng: Sample([(4, 6)]),
)


def _concat_sample(rng: np.random.Generator) -> Sample:
    base = rand_shape(rng, 1, 4)
    axis = int(rng.integers(0, len(base)))
    n = int(rng.integers(2, 4))
    shapes = [base[:axis] + (int(rng.integers(1, 5)),) + base[axis + 1 :] for _ in range(n)]
    return Sample(shapes, {"axis": axis})


row(
    "concat",
    "axis",
    lambda g, *ts, axis: ml.concat(ts, axis),
    lambda *ts, axis, **k: torch.cat(ts, axis),
    _concat_sample,
    FLOATS + INTS + ("bool",),
)
row(
    "copy",
    "of-transposed",
    lambda g, a: a.mT.copy(),
    lambda a, **k: a.mT.contiguous(),
    lambda rng: Sample([rand_shape(rng, 2, 4)]),
    FLOATS + INTS + ("bool",),
)
row(
    "reshape",
    "squeeze-unsqueeze",
    lambda g, a: a.unsqueeze(1).unsqueeze(-1).squeeze(1),
    lambda a, **k: a.unsqueeze(1).unsqueeze(-1).squeeze(1),
    one(1, 3),
)

# ---- optimizers (in place on the state, operand 0; the counter decides whether this iteration updates) ------

COUNTER = ("int", 0, 7)  # micro-batches done: with accumulate 1-3, some draws update and some do not


def _optim_sample(n_like: int, scalars: int) -> Callable[[np.random.Generator], Sample]:
    """``n_like`` operands of one random shape, ``scalars`` float32 0-d ones, then the counter."""

    def sample(rng: np.random.Generator) -> Sample:
        shape = rand_shape(rng, 0, 3, dmax=40)
        kw = {"accumulate": int(rng.integers(1, 4))}
        return Sample([shape] * n_like + [()] * (scalars + 1), kw)

    return sample


def _step(counter: torch.Tensor, accumulate: int) -> tuple[bool, bool, int]:
    c = int(counter)
    return (c + 1) % accumulate == 0, c % accumulate == 0, (c + 1) // accumulate


def _grad_accumulate_ref(buffer, grad, counter, *, accumulate, **k):
    return grad if _step(counter, accumulate)[1] else buffer + grad


row(
    "grad_accumulate",
    "micro-batches",
    lambda g, b, x, c, **kw: ml.grad_accumulate(b, x, c, **kw),
    _grad_accumulate_ref,
    _optim_sample(2, 0),
    fixed={0: "float32", 2: "int64"},
    domains=("normal", "normal", COUNTER),
    states=(0,),
)


def _moment_sample(rng: np.random.Generator) -> Sample:
    s = _optim_sample(2, 1)(rng)
    return Sample(s.shapes, {**s.kw, "beta": float(rng.choice([0.9, 0.999, 0.5])), "square": bool(rng.random() < 0.5)})


def _adam_moment_ref(state, grad, scale, counter, *, beta, square, accumulate, **k):
    if not _step(counter, accumulate)[0]:
        return state
    x = grad * scale
    return beta * state + (1 - beta) * (x * x if square else x)


row(
    "adam_moment",
    "first-and-second",
    lambda g, st, x, sc, c, **kw: ml.adam_moment(st, x, c, scale=sc, **kw),
    _adam_moment_ref,
    _moment_sample,
    fixed={0: "float32", 2: "float32", 3: "int64"},
    domains=("positive", "normal", "positive", COUNTER),
    states=(0,),
)

ADAMW_KW = {"beta1": 0.9, "beta2": 0.95, "eps": 1e-6, "weight_decay": 0.1}


def _adamw_update_ref(param, m, v, lr, counter, *, accumulate, **k):
    update, _, t = _step(counter, accumulate)
    if not update:
        return param
    b1, b2, eps, wd = (ADAMW_KW[n] for n in ("beta1", "beta2", "eps", "weight_decay"))
    denom = v.sqrt() / math.sqrt(1 - b2**t) + eps
    return param * (1 - lr * wd) - lr / (1 - b1**t) * m / denom


row(
    "adamw_update",
    "bias-corrected",
    lambda g, p, m, v, lr, c, **kw: ml.adamw_update(p, m, v, c, lr=lr, **ADAMW_KW, **kw),
    _adamw_update_ref,
    _optim_sample(3, 1),
    fixed={1: "float32", 2: "float32", 3: "float32", 4: "int64"},
    domains=("normal", "normal", "positive", "positive", COUNTER),
    states=(0,),
)


def _sgd_sample(rng: np.random.Generator) -> Sample:
    s = _optim_sample(3, 1)(rng)
    return Sample(
        s.shapes, {**s.kw, "momentum": 0.9, "dampening": float(rng.choice([0.0, 0.25])), "weight_decay": 0.01}
    )


def _sgd_momentum_ref(buf, grad, param, scale, counter, *, momentum, dampening, weight_decay, accumulate, **k):
    update, _, t = _step(counter, accumulate)
    if not update:
        return buf
    d = grad * scale + weight_decay * param
    return d if t == 1 else momentum * buf + (1 - dampening) * d


row(
    "sgd_momentum",
    "dampened",
    lambda g, b, x, p, sc, c, **kw: ml.sgd_momentum(b, x, p, c, scale=sc, **kw),
    _sgd_momentum_ref,
    _sgd_sample,
    fixed={0: "float32", 3: "float32", 4: "int64"},
    domains=("normal", "normal", "normal", "positive", COUNTER),
    states=(0,),
)


def _sgd_update_sample(rng: np.random.Generator) -> Sample:
    s = _optim_sample(3, 2)(rng)
    momentum = float(rng.choice([0.0, 0.9]))
    return Sample(s.shapes, {**s.kw, "momentum": momentum, "nesterov": momentum > 0 and rng.random() < 0.5})


def _sgd_update_ref(param, grad, buf, lr, scale, counter, *, momentum, nesterov, accumulate, **k):
    if not _step(counter, accumulate)[0]:
        return param
    d = grad * scale + 0.01 * param
    u = d if momentum == 0 else d + momentum * buf if nesterov else buf
    return param - lr * u


row(
    "sgd_update",
    "plain-momentum-nesterov",
    lambda g, p, x, b, lr, sc, c, momentum, nesterov, **kw: ml.sgd_update(
        p,
        x,
        c,
        lr=lr,
        buf=b if momentum else None,
        momentum=momentum,
        nesterov=nesterov,
        weight_decay=0.01,
        scale=sc,
        **kw,
    ),
    _sgd_update_ref,
    _sgd_update_sample,
    fixed={2: "float32", 3: "float32", 4: "float32", 5: "int64"},
    domains=("normal", "normal", "normal", "positive", "positive", COUNTER),
    states=(0,),
)


def _square_sum_sample(rng: np.random.Generator) -> Sample:
    shape = rand_shape(rng, 0, 3, dmax=30)
    rows = shape[0] if shape else 1
    per = int(rng.integers(1, rows + 1))
    return Sample([shape], {"splits": -(-rows // per)})


def _square_sum_ref(x, *, splits, **k):
    x = x.reshape(1) if x.ndim == 0 else x
    per = -(-x.shape[0] // splits)
    return torch.stack([(x[i * per : (i + 1) * per] ** 2).sum() for i in range(splits)])


row(
    "square_sum",
    "ranges-of-rows",
    lambda g, x, **kw: ml.square_sum(x, **kw),
    _square_sum_ref,
    _square_sum_sample,
    reduce_len=lambda s: max(1, math.prod(s.shapes[0])) // s.kw["splits"] + 1,
)


def _lr_sample(rng: np.random.Generator) -> Sample:
    kind = str(rng.choice(["cosine", "linear", "constant"]))
    kw = {"lr": 3e-4, "min_lr": 1e-5, "warmup": int(rng.integers(0, 4)), "total": 6, "kind": kind}
    return Sample([()], {**kw, "accumulate": int(rng.integers(1, 3))}, domains=(("int", 0, 20),))


def _lr_ref(counter, *, lr, min_lr, warmup, total, kind, accumulate, **k):
    s = int(counter) // accumulate
    if s < warmup:
        value = lr * s / warmup
    elif kind == "constant":
        value = lr
    else:
        p = min(1.0, (s - warmup) / max(1, total - warmup))
        decay = 0.5 * (1 + math.cos(math.pi * p)) if kind == "cosine" else 1 - p
        value = min_lr + (lr - min_lr) * decay
    return torch.tensor(value, dtype=torch.float64)


row(
    "lr_schedule",
    "warmup-and-decay",
    lambda g, c, **kw: ml.lr_schedule(c, **kw),
    _lr_ref,
    _lr_sample,
    ("int64",),
)


def _step_batch_sample(rng: np.random.Generator) -> Sample:
    """data [n, *batch] and a counter past n now and then (the data wraps around)."""
    n = int(rng.integers(1, 6))
    return Sample([(n, *rand_shape(rng, 0, 3)), ()], domains=("normal", ("int", 0, 3 * n)))


row(
    "step_batch",
    "wraps",
    lambda g, d, c: ml.step_batch(d, c),
    lambda d, c, **k: d[int(c) % d.shape[0]],
    _step_batch_sample,
    FLOATS + INTS,
    fixed={1: "int64"},
)


def _loss_sample(extra: bool, ignoring: bool = True) -> Callable[[np.random.Generator], Sample]:
    """logits [*lead, vocab] and targets [*lead] in the vocabulary; ignore_index one of its ids (so that
    some targets are ignored) or -100; with ``extra``, a float32 cotangent of each row."""

    def sample(rng: np.random.Generator) -> Sample:
        lead, v = rand_shape(rng, 1, 3, 5), int(rng.integers(2, 40))
        ignore = int(rng.integers(0, v)) if ignoring else -100
        shapes = [(*lead, v), lead] + ([lead] if extra else [])
        return Sample(shapes, {"ignore_index": ignore}, domains=("normal", ("int", 0, v), "normal"))

    return sample


def _cross_entropy_ref(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, **k: Any) -> torch.Tensor:
    v = logits.shape[-1]
    out = F.cross_entropy(logits.reshape(-1, v), targets.reshape(-1), ignore_index=ignore_index, reduction="none")
    return out.reshape(targets.shape)


def _cross_entropy_grad_ref(logits, targets, c, ignore_index: int, **k: Any) -> torch.Tensor:
    p = torch.softmax(logits, -1) - F.one_hot(targets, logits.shape[-1]).double()
    return p * torch.where(targets == ignore_index, 0.0, c)[..., None]


row(
    "cross_entropy",
    "per-token",
    lambda g, x, t, ignore_index: ml.cross_entropy(x, t, ignore_index=ignore_index, reduction="none"),
    _cross_entropy_ref,
    _loss_sample(False),
    fixed={1: "int64"},
    reduce_len=lambda s: s.shapes[0][-1],
)
row(
    "cross_entropy",
    "mean",
    lambda g, x, t, ignore_index: ml.cross_entropy(x, t, ignore_index=ignore_index),
    lambda x, t, ignore_index, **k: F.cross_entropy(x.reshape(-1, x.shape[-1]), t.reshape(-1)),
    _loss_sample(False, ignoring=False),
    fixed={1: "int32"},
    reduce_len=lambda s: int(np.prod(s.shapes[0])),
)
row(
    "cross_entropy_grad",
    "rows",
    lambda g, x, t, c, ignore_index: ml.cross_entropy_grad(x, t, c, ignore_index=ignore_index),
    _cross_entropy_grad_ref,
    _loss_sample(True),
    fixed={1: "int64", 2: "float32"},
    reduce_len=lambda s: s.shapes[0][-1],
)

# Ops whose behaviour needs several ranks or no operands: tested in the named test files instead.
TESTED_ELSEWHERE = {
    "input": "test_graph.py",
    "parameter": "test_graph.py",
    "constant": "test_graph.py",
    "state": "test_graph.py",
    "all_reduce": "test_collectives.py",
    "all_gather": "test_collectives.py",
    "reduce_scatter": "test_collectives.py",
    "send": "test_collectives.py",
    "recv": "test_collectives.py",
}

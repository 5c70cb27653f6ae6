"""The op table's building blocks: rows, samples, building a row's graph, shape generators."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

import megaloop as ml
from tests.helpers import TORCH_DTYPES, random_values

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


ROWS: list[Row] = []


def row(*args: Any, **kw: Any) -> None:
    ROWS.append(Row(*args, **kw))

"""Random graphs for fuzzing backends against the reference: chains of elementwise ops, reductions,
norms, softmax, matmuls and views over random shapes and dtypes. Values stay in ranges where every op
is well conditioned (no huge exponents, no log of negatives), so that differences are bugs."""

from __future__ import annotations

import numpy as np

import megaloop as ml

UNARY = ["neg", "abs", "tanh", "sigmoid", "relu", "silu", "gelu", "erf"]
BINARY = ["add", "sub", "mul", "maximum", "minimum"]


def random_graph(rng: np.random.Generator, g: ml.Graph, prefix: str) -> dict[str, np.ndarray]:
    """Add one random program to ``g`` (names prefixed); returns its input values."""
    dtype = ml.as_dtype(str(rng.choice(["float32", "float16", "bfloat16"])))
    rows, cols = int(rng.integers(1, 24)), int(rng.integers(1, 48))
    lead = () if rng.random() < 0.5 else (int(rng.integers(1, 4)),)
    shape = (*lead, rows, cols)
    feeds = {f"{prefix}x": rng.standard_normal(shape)}
    x = g.input(f"{prefix}x", shape, dtype)
    with g.scope(prefix.rstrip(".")):
        for _ in range(int(rng.integers(2, 7))):
            choice = rng.random()
            if choice < 0.3:
                x = getattr(ml, str(rng.choice(UNARY)))(x)
            elif choice < 0.5:
                other_shape = tuple(1 if rng.random() < 0.3 else d for d in x.shape[-2:])
                name = f"{prefix}y{len(feeds)}"
                feeds[name] = rng.standard_normal(other_shape)
                x = getattr(ml, str(rng.choice(BINARY)))(x, g.input(name, other_shape, dtype))
            elif choice < 0.6:
                x = ml.softmax(x, axis=int(rng.integers(-x.ndim, x.ndim)))
            elif choice < 0.7:
                x = ml.rmsnorm(x) if rng.random() < 0.5 else ml.layernorm(x)
            elif choice < 0.8:
                n = int(rng.integers(1, 40))
                name = f"{prefix}w{len(feeds)}"
                feeds[name] = rng.standard_normal((n, x.shape[-1])) / np.sqrt(x.shape[-1])
                x = ml.linear(x, g.input(name, (n, x.shape[-1]), dtype))
            elif choice < 0.9:
                x = x.mT if x.ndim >= 2 else x
                x = x * 0.5
            else:
                axis = int(rng.integers(0, x.ndim))
                x = ml.mean(x, axis, keepdims=True) + x
    g.output(f"{prefix}out", x)
    return feeds

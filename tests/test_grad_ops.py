"""Every op's gradient (its OpDef's vector-Jacobian rule) against PyTorch autograd in float64, over the
op table's random shapes and dtypes: the loss is sum(y * c) for random cotangents c of each float
output, its gradient with respect to every float operand is compared with torch's."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

import megaloop as ml
from megaloop.frontend.opdef import REGISTRY
from tests.helpers import to_torch64
from tests.op_table import ROWS, Row, build_row

DRAWS = 2
GRAD_DTYPES = ("float32", "float16", "bfloat16")
# the largest error allowed, in units of the operand dtype's epsilon times the gradient's largest
# magnitude: a few roundings of the gradient's own (the cotangent cast back, one or two products, the
# final rounding), on top of the forward value a rule reads back rounded (exp, tanh, softmax)
ULPS = 8.0
# rmsnorm and layernorm's gradient subtracts xhat * mean(g xhat) from g, which cancels where a row is
# short (xhat near +-1): float32 keeps eps of the terms, not of their difference
CANCELS = {"rmsnorm": 8.0, "layernorm": 8.0}
# a gradient that is 0 in exact arithmetic comes out of float64 PyTorch as rounding noise: errors
# below this fraction of eps (the operands and cotangents are of order 1) are that noise
FLOOR = 1e-4
# ops whose gradient is mathematically undefined at the sampled points' kinks or whose rows need a
# reference of their own (the collectives: tests/test_grad.py, several ranks)
SKIP = {"all_reduce", "all_gather", "reduce_scatter", "recv", "send"}


def differentiable(row: Row) -> bool:
    op = REGISTRY[row.op]
    return op.vjp is not None and row.op not in SKIP and any(d in GRAD_DTYPES for d in row.dtypes)


def check_row_gradient(row: Row, dtype: str, seed: int) -> None:
    g, feeds, state, arrays, outs, sample = build_row(row, dtype, seed)
    rng = np.random.default_rng(seed + 1)
    float_operands = [i for i in range(len(arrays)) if ml.as_dtype(row.fixed.get(i, dtype)).is_float]
    wrt = [i for i in float_operands if i not in row.states]  # (a state, a KV cache, takes none)
    floats = [k for k, t in enumerate(outs) if t.dtype.is_float]
    if not wrt or not floats:
        pytest.skip("no float operand or output")
    seeds = {k: rng.standard_normal(outs[k].shape).astype(np.float32) for k in floats}
    terms = []
    for k in floats:
        c = g.input(f"c{k}", outs[k].shape, "float32")
        feeds[f"c{k}"] = seeds[k]
        terms.append(ml.sum(ml.cast(outs[k], "float32") * c))
    loss = terms[0]
    for t in terms[1:]:
        loss = loss + t
    grads = ml.grad(g, loss, [g.inputs[f"x{i}"] for i in wrt])
    for i, t in zip(wrt, grads):
        g.output(f"dx{i}", t)
    got = ml.evaluate(g, feeds, state=state).outputs

    expected_grads = torch_gradients(row, dtype, arrays, wrt, sample, seeds)
    eps = ml.as_dtype(dtype).eps
    for i in wrt:
        expected = expected_grads[i]
        out = got[f"dx{i}"].astype(np.float64)
        assert out.shape == expected.shape and got[f"dx{i}"].dtype == arrays[i].dtype
        scale = max(float(np.max(np.abs(expected), initial=0.0)), 1e-30)
        factor = reduction_factor(arrays[i].shape, outs, sample.shapes) * CANCELS.get(row.op, 1.0)
        allowed = max(ULPS * eps * scale * factor, FLOOR * eps)
        err = np.abs(out - expected)
        worst = np.unravel_index(int(np.argmax(err)), err.shape) if err.size else ()
        assert err[worst] <= allowed, (
            f"{row.id} [{dtype}] seed {seed} shapes {sample.shapes} kw {sample.kw}: gradient of operand {i} "
            f"off by {err[worst]:.3e} at {tuple(int(j) for j in worst)} (got {out[worst]:.6g}, torch "
            f"{expected[worst]:.6g}; allowed {allowed:.3e})"
        )


def torch_gradients(row: Row, dtype: str, arrays: list, wrt: list[int], sample, seeds: dict) -> dict:
    """d(sum_k y_k c_k)/d operand, by PyTorch autograd in float64; for the indexing rows, whose reference
    is numpy's basic indexing, by where each output element comes from (a view is linear)."""
    tensors = [to_torch64(a).requires_grad_(i in wrt) for i, a in enumerate(arrays)]
    try:
        ref = row.ref(*tensors, dtype=dtype, **sample.kw)
    except RuntimeError:  # a reference through numpy: y[j] = x[source[j]]
        (i,) = wrt
        size = arrays[i].size
        source = row.ref(torch.arange(size).reshape(arrays[i].shape), dtype=dtype, **sample.kw).numpy()
        total = np.bincount(source.ravel(), weights=seeds[0].ravel().astype(np.float64), minlength=size)
        return {i: total.reshape(arrays[i].shape)}
    refs = ref if isinstance(ref, tuple) else (ref,)
    total = sum((refs[k].double() * torch.from_numpy(seeds[k]).double()).sum() for k in seeds)
    total.backward()
    return {i: np.zeros(arrays[i].shape) if tensors[i].grad is None else tensors[i].grad.numpy() for i in wrt}


def reduction_factor(shape: tuple[int, ...], outs: tuple, shapes: list[tuple[int, ...]]) -> float:
    """sqrt of the longest sum a gradient can take: along any axis of the shapes involved, or over the
    broadcast elements an operand's gradient gathers from the output."""
    sizes = [d for s in [*shapes, *(t.shape for t in outs)] for d in s]
    spread = max(t.size for t in outs) / max(1, int(np.prod(shape)))
    return float(np.sqrt(max([1.0, spread, *sizes])))


CASES = [(row, dt) for row in ROWS if differentiable(row) for dt in row.dtypes if dt in GRAD_DTYPES]


@pytest.mark.parametrize("row,dtype", CASES, ids=[f"{r.id}-{d}" for r, d in CASES])
def test_gradient_against_torch(row: Row, dtype: str) -> None:
    base = zlib.crc32(f"grad-{row.id}-{dtype}".encode())
    for draw in range(DRAWS):
        check_row_gradient(row, dtype, base + draw)

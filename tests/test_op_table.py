"""Every op of the registry against PyTorch float64, over random shapes (with broadcasts) and every
dtype its table rows list, with the tolerance the op's Accuracy declares."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

import megaloop as ml
from megaloop.frontend.opdef import REGISTRY, Accuracy
from tests.helpers import assert_close, to_torch64
from tests.op_table import ROWS, TESTED_ELSEWHERE, Row, build_row

DRAWS = 6  # random draws per (row, dtype)


def run_row(row: Row, dtype_name: str, seed: int) -> None:
    built = build_row(row, dtype_name, seed)
    g, feeds, state, arrays, outs, sample = built
    result = ml.evaluate(g, feeds, state=state)
    with torch.no_grad():
        ref = row.ref(*[to_torch64(a) for a in arrays], dtype=dtype_name, **sample.kw)
    refs = ref if isinstance(ref, tuple) else (ref,)
    assert len(refs) == len(outs)
    accuracy = REGISTRY[row.op].accuracy
    scale = None
    if row.cancels:
        with torch.no_grad():
            scale = float(row.ref(*[to_torch64(a).abs() for a in arrays], dtype=dtype_name, **sample.kw).max())
    for k, (t, r) in enumerate(zip(outs, refs)):
        what = f"{row.id} [{dtype_name}] seed {seed} shapes {sample.shapes} kw {sample.kw} output {k}"
        assert t.dtype == ml.as_dtype(_torch_name(r.dtype, t.dtype)), f"{what}: dtype {t.dtype} vs torch {r.dtype}"
        r64 = r.double() if r.dtype.is_floating_point else r
        assert_close(result.outputs[f"y{k}"], r64.numpy(), t.dtype, accuracy, row.reduce_len(sample), what, scale)


def _torch_name(tdt: torch.dtype, ours: ml.DType) -> str:
    """torch computes in float64/int64; the row's output dtype is ours when the kinds agree."""
    if tdt == torch.bool:
        return "bool"
    if tdt.is_floating_point:
        return ours.name if ours.is_float else "float32"
    return ours.name if ours.is_int else "int64"


CASES = [(row, dt) for row in ROWS for dt in row.dtypes]


@pytest.mark.parametrize("row,dtype", CASES, ids=[f"{r.id}-{d}" for r, d in CASES])
def test_op_against_torch(row: Row, dtype: str) -> None:
    base = zlib.crc32(f"{row.id}-{dtype}".encode())
    for draw in range(DRAWS):
        run_row(row, dtype, base + draw)


def test_every_op_has_a_row() -> None:
    covered = {row.op for row in ROWS} | set(TESTED_ELSEWHERE)
    missing = sorted(set(REGISTRY) - covered)
    unknown = sorted(covered - set(REGISTRY))
    assert not missing, f"ops without a test row: {missing}"
    assert not unknown, f"table rows for ops that do not exist: {unknown}"


def test_rows_cover_every_supported_dtype() -> None:
    """For each op, the dtypes its rows test are all the dtypes it accepts: building any row with any
    other dtype must fail with a DtypeError."""
    tested: dict[str, set[str]] = {}
    for row in ROWS:
        tested.setdefault(row.op, set()).update(row.dtypes)
    untested = []
    for row in ROWS:
        for dt in ml.ALL_DTYPES:
            if dt.name in tested[row.op]:
                continue
            sample = row.sample(np.random.default_rng(0))
            g = ml.Graph("dtype-coverage")
            tensors = []
            for i, shape in enumerate(sample.shapes):
                d = ml.as_dtype(row.fixed.get(i, dt.name))
                tensors.append(g.state(f"s{i}", shape, d) if i in row.states else g.input(f"x{i}", shape, d))
            try:
                row.build(g, *tensors, **sample.kw)
            except ml.errors.DtypeError:
                continue
            untested.append(f"{row.id} builds with {dt.name}, which no row of {row.op} tests")
    assert not untested, "\n".join(untested)


def test_every_float_op_row_covers_all_float_dtypes() -> None:
    for row in ROWS:
        if any(d in row.dtypes for d in ("float32", "float16", "bfloat16")) and row.op != "cast":
            assert {"float32", "float16", "bfloat16"} <= set(row.dtypes), f"{row.id} skips a float dtype"


def test_checker_catches_a_one_ulp_error() -> None:
    """The tolerance check must fail on a real error: shift one element by 4 ulps of bf16."""
    ref = np.linspace(-3, 3, 64)
    out = ml.dtypes.round_to(ref, ml.bfloat16)
    assert_close(out, ref, ml.bfloat16, Accuracy(ulps=1.0))
    bad = out.astype(np.float32)
    bad[17] += 4 * ml.bfloat16.eps * abs(bad[17])
    with pytest.raises(AssertionError, match="worst at \\(17,\\)"):
        assert_close(ml.dtypes.round_to(bad, ml.bfloat16), ref, ml.bfloat16, Accuracy(ulps=1.0))
    with pytest.raises(AssertionError, match="NaN"):
        nan = out.copy()
        nan[3] = np.nan
        assert_close(nan, ref, ml.bfloat16, Accuracy(ulps=1.0))
    with pytest.raises(AssertionError, match="differ"):
        assert_close(np.array([1, 2, 3]), np.array([1, 2, 4]), ml.int32, Accuracy(ulps=0.0))

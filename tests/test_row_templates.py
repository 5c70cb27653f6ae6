"""The row ops' and reductions' tiles are calls of the header templates in megaloop/rows.cuh and
megaloop/reduce.cuh (the loops, reductions and shared memory live there; Python writes the template
arguments): every such tile function of the op table's rows, the long rows and the long reductions
is one call, its arguments say the layout emit_rows.block_rows chose, and the kernels compile for
sm_90a and sm_80 without spills. What the tiles compute is checked against torch on a GPU
(tests/test_gpu.py: the op table, the block-row edge values, long rows, long reductions)."""

from __future__ import annotations

import re

import pytest

import megaloop as ml
from megaloop.codegen import generate
from megaloop.codegen.emit import Operand
from megaloop.codegen.emit_rows import ROW_ACCUMULATORS, block_rows, rows
from megaloop.plan import make_plan
from megaloop.runtime.compile import compile_cubin, spills
from tests.op_table import ROWS, build_row
from tests.test_codegen import LONG_ROW_CASES, long_rows_graph
from tests.test_long_reductions import TILES, long_reductions_graph

ROW_OPS = ("softmax", "log_softmax", "layernorm", "rmsnorm")
REDUCE_OPS = ("sum", "mean", "max", "min", "argmax", "argmax_partial", "argmax_combine")
CALLS = {
    **{op: "ml::rows<" for op in ROW_OPS},
    **{op: "ml::reduce_" for op in REDUCE_OPS[:5]},
    "argmax_partial": "ml::argmax_partial<",
    "argmax_combine": "ml::argmax_combine<",
}


def table_graph(dtype: str) -> ml.Graph:
    """Three draws of every op table row of the row ops and reductions that takes ``dtype``."""
    g = ml.Graph(f"row-templates-{dtype}")
    n = 0
    for row in ROWS:
        if row.op in CALLS and dtype in row.dtypes:
            for seed in range(3):
                build_row(row, dtype, seed, graph=g, prefix=f"r{n}.")
                n += 1
    return g


def tile_functions(src: str) -> dict[str, tuple[str, str]]:
    """sig_N -> (its op, its body) for every tile function of the kernel source."""
    found = {}
    for m in re.finditer(r"// (sig_\d+): (\w+) [^\n]*\n__device__ [^\n]*\{\n(.*?)\n\}\n", src, re.S):
        found[m[1]] = (m[2], m[3])
    return found


def assert_template_calls(src: str) -> int:
    """Every row-op and reduction tile function of ``src`` is one template call: pointers, comments
    and that call, no loop or shared memory of its own. Returns how many there are."""
    n = 0
    for sig, (op, body) in tile_functions(src).items():
        if op not in CALLS:
            continue
        n += 1
        assert body.count(CALLS[op]) == 1, f"{sig} ({op}) is not one {CALLS[op]} call:\n{body}"
        lines = [line.strip() for line in body.splitlines()]
        code = [line for line in lines if not line.startswith("//") and "(a.arena + off[" not in line]
        assert len(code) == 1, f"{sig} ({op}) has more than the call:\n{body}"
        assert "for (" not in body and "__shared__" not in body, f"{sig} ({op}): a loop of its own\n{body}"
    return n


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int32", "int64"])
def test_table_rows_are_template_calls_and_compile(dtype: str) -> None:
    g = table_graph(dtype)
    src = generate(make_plan(g, processors=8)).source
    assert assert_template_calls(src) > 0
    assert compile_cubin(src, "sm_90a", use_cache=False)[:4] == b"\x7fELF"
    ampere = generate(make_plan(g, processors=8, arch="sm_80")).source
    assert compile_cubin(ampere, "sm_80", use_cache=False)[:4] == b"\x7fELF"


def test_long_rows_and_reductions_are_template_calls_without_spills() -> None:
    kernels = {
        "long rows": generate(make_plan(long_rows_graph(), processors=2)).source,
        "long reductions": generate(make_plan(long_reductions_graph(), processors=132, tiles=TILES)).source,
    }
    for name, src in kernels.items():
        assert assert_template_calls(src) > 0, name
        assert spills(src) == {}, name
    ampere = generate(make_plan(long_rows_graph(), processors=2, arch="sm_80")).source
    assert compile_cubin(ampere, "sm_80", use_cache=False)[:4] == b"\x7fELF"


@pytest.mark.parametrize("name", sorted(LONG_ROW_CASES))
def test_the_call_carries_the_block_rows_layout(name: str) -> None:
    """ml::BlockRows<groups, threads, held, ring, parts, keep> is the layout block_rows chose, and
    the call names the row's op, axis, length and pack width."""
    op, dtype, shape = LONG_ROW_CASES[name]
    dt = ml.as_dtype(dtype)
    x = Operand(dt, shape, (shape[1], 1))
    w = Operand(dt, shape[1:], (1,))
    ins = [x] if op.endswith("softmax") else [x, w] if op == "rmsnorm" else [x, w, w]
    attrs = {"axis": 1, "eps": 1e-5, "codegen": {"threads": 256, "shared_memory": 227 * 1024, "elements": 1 << 15}}
    layout = block_rows(op, attrs, ins, x)
    assert layout is not None
    body = "\n".join(rows(op, attrs, ins, x))
    call = re.search(r"ml::rows<ml::ROW_(\w+), (\d+), (\d+), (\d+), ml::BlockRows<([^>]*)>>", body)
    assert call, body
    assert (call[1], int(call[2]), int(call[3]), int(call[4])) == (op.upper(), 1, shape[1], layout.width)
    groups, threads, held, ring, parts, _ = (v.strip() for v in call[5].split(","))
    want = (layout.groups, layout.threads, layout.held, layout.ring, min(ROW_ACCUMULATORS, layout.held))
    assert tuple(map(int, (groups, threads, held, ring, parts))) == want


def test_rows_without_packs_take_the_element_path_only() -> None:
    """A row of 6 bf16 (not whole 16-byte packs) or strided along its axis: W = 1, no block layout."""
    bf = ml.bfloat16
    for x in (Operand(bf, (4, 6), (6, 1)), Operand(bf, (6, 4), (1, 6))):
        attrs = {"axis": x.shape.index(6), "codegen": {"threads": 256, "shared_memory": 1 << 16}}
        body = "\n".join(rows("softmax", attrs, [x], x))
        assert f"ml::rows<ml::ROW_SOFTMAX, {attrs['axis']}, 6, 1, ml::BlockRows<>>" in body, body
        assert "packed path" not in body

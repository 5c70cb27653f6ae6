"""The op test table: one or more rows per registered op.

A row says how to draw random operands (shapes with broadcasts, value domains, extra arguments), how
to build the op with megaloop, and how PyTorch computes the same thing in float64 (the independent
reference). ``test_op_table.py`` runs every row for every dtype it lists and checks the result with
the tolerance the op's own ``Accuracy`` declares. ``test_every_op_has_a_row`` keeps this table and the
registry in step. The rows are in one module a family of ops; importing them fills ``ROWS`` in order.
"""

import importlib

from tests.op_table._base import ROWS, Row, Sample, build_row

# in this order, the table's since it was one file: some tests pick a row's dtype or partner by index
FAMILIES = ("elementwise", "reductions", "sampling", "norms", "matmul", "rope", "attention", "caches", "layout",
            "training")  # fmt: skip
MODULES = {family: importlib.import_module(f"tests.op_table.{family}") for family in FAMILIES}
attention_ref = MODULES["attention"].attention_ref
rope_ref = MODULES["rope"].rope_ref

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

__all__ = ["ROWS", "TESTED_ELSEWHERE", "Row", "Sample", "attention_ref", "build_row", "rope_ref"]

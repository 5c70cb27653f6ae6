"""x @ w.T over many rows whose output tiles would not fill the processors -> the product over ranges
of K, then their sum (ops.split_k_linear; how many ranges: auto_k_splits). A decode step's few rows
never split: their matrix-vector tiles narrow their columns instead."""

from __future__ import annotations

import math

import megaloop.frontend.ops as ops
from megaloop.frontend.graph import Node
from megaloop.frontend.ops.matmul import auto_k_splits
from megaloop.fuse.patterns import linear
from megaloop.fuse.rewrite import Rewriter
from megaloop.fuse.rule import Rule, register_rule


def _fire(node: Node, rw: Rewriter) -> bool:
    lin = linear(node)
    if lin is None:
        return False
    rows, batches = lin.x.shape[-2], math.prod(lin.x.shape[:-2])  # (a tile takes one batch index's rows)
    splits = auto_k_splits(rows, lin.w.shape[0], lin.w.shape[1], batches)
    if splits is None:
        return False
    with rw.build(node):
        out = ops.linear(lin.x, lin.w, k_splits=splits)
    rw.replace(node.outputs[0], out)
    rw.discard(node)
    return True


register_rule(
    Rule(
        name="split_k_linear",
        makes="matmul",
        roots=("matmul",),
        doc="x @ w.T (w 2-D) of at least SPLIT_K_MIN_ROWS rows whose output tiles are fewer than about half "
        "a wave of the processors (auto_k_splits): a batched product over ranges of K and their sum",
        fire=_fire,
        after=("rmsnorm_linear", "swiglu_linear"),
        differs="each range's product is rounded to the dtype before their float32 sum: about one rounding "
        "more than the single product (ops.split_k_linear)",
    )
)

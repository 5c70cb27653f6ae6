"""rmsnorm -> products of its rows, on a decode step: each product's tiles norm the few rows
themselves (rmsnorm_linear; and swiglu_linear's norm, swiglu_linear.py), so the norm is no stage of
its own. Ops that can take a norm in declare it here with ``takes_norm``, each in its own module."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import megaloop.frontend.ops as ops
from megaloop.frontend.graph import Node
from megaloop.frontend.tensor import Tensor
from megaloop.fuse.patterns import few_rows, linear
from megaloop.fuse.rewrite import Rewriter
from megaloop.fuse.rule import Rule, register_rule


class Norm(NamedTuple):
    """rmsnorm(x, weight, eps, residual) as the product that makes it takes it."""

    x: Tensor
    weight: Tensor
    eps: float
    residual: Tensor | None
    out: Tensor  # the norm's output, which the product read


# op name -> (a reader of a norm's output, the norm) -> a builder of the reader with the norm inside, or
# None where it cannot take it
Taker = Callable[[Node, Norm], Callable[[], Tensor] | None]
TAKERS: dict[str, Taker] = {}


def takes_norm(op: str) -> Callable[[Taker], Taker]:
    """Declare how a reader of an rmsnorm's output of op ``op`` makes the norm itself."""

    def declare(taker: Taker) -> Taker:
        if op in TAKERS:
            raise ValueError(f"op {op!r} takes a norm in two ways")
        TAKERS[op] = taker
        return taker

    return declare


@takes_norm("matmul")
def _linear(node: Node, norm: Norm) -> Callable[[], Tensor] | None:
    lin = linear(node)
    if lin is None or lin.x is not norm.out:
        return None
    return lambda: ops.rmsnorm_linear(norm.x, lin.w, norm.weight, eps=norm.eps, residual=norm.residual)


def _fire(node: Node, rw: Rewriter) -> bool:
    absent = node.attrs.get("absent", ())
    if 1 in absent or len(node.inputs) < 2:  # (no weight: no rmsnorm_linear)
        return False
    x, weight = node.inputs[:2]
    residual = node.inputs[2] if len(node.inputs) > 2 else None
    out = node.outputs[0]
    if not few_rows(x) or x.is_view or (residual is not None and residual.is_view) or rw.kept(out):
        return False
    norm = Norm(x, weight, node.attrs["eps"], residual, out)
    makers = []
    for reader in rw.users(out):
        taker = TAKERS.get(reader.op.name)
        make = taker(reader, norm) if taker else None
        if make is None:
            return False
        makers.append((reader, make))
    if not makers:
        return False
    for reader, make in makers:
        with rw.build(reader):
            made = make()
        rw.replace(reader.outputs[0], made)
        rw.discard(reader)
    rw.discard(node)
    return True


register_rule(
    Rule(
        name="rmsnorm_linear",
        makes="rmsnorm_linear",
        roots=("rmsnorm",),
        doc="rmsnorm(x, w) whose every reader is a product that can make it (x @ W.T: rmsnorm_linear; "
        "swiglu_linear) on one sequence of at most NORMED_ROWS rows (a decode step): each product norms its "
        "rows itself",
        fire=_fire,
        after=("norm_residual", "swiglu_linear"),
    )
)

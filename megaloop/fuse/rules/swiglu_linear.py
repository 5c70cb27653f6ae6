"""silu_mul(x @ gate.T, x @ up.T) -> swiglu_linear(x, gate, up) on a decode step: the gate and up
projections' tiles make SwiGLU's product in their epilogue; with the norm of x inside too where the
rmsnorm_linear rule puts it there (``takes_norm``)."""

from __future__ import annotations

from collections.abc import Callable

import megaloop.frontend.ops as ops
from megaloop.frontend.graph import Node
from megaloop.frontend.tensor import Tensor
from megaloop.fuse.patterns import few_rows, linear, made_by
from megaloop.fuse.rewrite import Rewriter
from megaloop.fuse.rule import Rule, register_rule
from megaloop.fuse.rules.rmsnorm_linear import Norm, takes_norm


def _fire(node: Node, rw: Rewriter) -> bool:
    if "scalars" in node.attrs:
        return False
    gate, up = (linear(made_by(t, "matmul")) for t in node.inputs)
    if gate is None or up is None or gate.x is not up.x or gate.w.shape != up.w.shape:
        return False
    if node.inputs[0] is node.inputs[1] or any(rw.sole_user(t) is not node for t in node.inputs):
        return False
    if not few_rows(gate.x) or gate.x.is_view or node.inputs[0].shape != node.outputs[0].shape:
        return False
    with rw.build(node):
        out = ops.swiglu_linear(gate.x, gate.w, up.w)
    rw.replace(node.outputs[0], out)
    rw.discard(node, *(t.node for t in node.inputs))
    return True


@takes_norm("swiglu_linear")
def _with_norm(node: Node, norm: Norm) -> Callable[[], Tensor] | None:
    x, gate, up, *rest = node.inputs
    if rest or x is not norm.out or norm.out in (gate, up):
        return None
    return lambda: ops.swiglu_linear(norm.x, gate, up, norm_weight=norm.weight, eps=norm.eps, residual=norm.residual)


register_rule(
    Rule(
        name="swiglu_linear",
        makes="swiglu_linear",
        roots=("silu_mul",),
        doc="silu_mul(x @ gate.T, x @ up.T), the products read by nothing else, on one sequence of at most "
        "NORMED_ROWS rows (a decode step), x no view",
        fire=_fire,
        after=("silu_mul",),
    )
)

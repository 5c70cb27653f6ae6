"""silu(a) * b -> silu_mul(a, b): SwiGLU's product in one pass, silu's result kept in float32."""

from __future__ import annotations

import megaloop.frontend.ops as ops
from megaloop.frontend.graph import Node
from megaloop.fuse.patterns import made_by
from megaloop.fuse.rewrite import Rewriter
from megaloop.fuse.rule import Rule, register_rule


def _fire(node: Node, rw: Rewriter) -> bool:
    if "scalars" in node.attrs:  # (a Python number times silu(a): no gate to pair)
        return False
    for i in (0, 1):
        gate, other = node.inputs[i], node.inputs[1 - i]
        silu = made_by(gate, "silu")
        if silu is None or rw.sole_user(gate) is not node:
            continue
        with rw.build(node):
            out = ops.silu_mul(silu.inputs[0], other)
        rw.replace(node.outputs[0], out)
        rw.discard(node, silu)
        return True
    return False


register_rule(
    Rule(
        name="silu_mul",
        makes="silu_mul",
        roots=("mul",),
        doc="mul(silu(a), b) (either order) where silu's result is read by nothing else: one elementwise "
        "stage instead of two, and the pattern swiglu_linear looks for",
        fire=_fire,
        differs="silu's result is not rounded to the dtype before the product: bit for bit in float32, one "
        "rounding fewer in 16-bit dtypes (Hugging Face's LlamaMLP rounds it)",
    )
)

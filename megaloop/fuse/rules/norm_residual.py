"""norm(x + u) -> norm(x, residual=u): the norm adds the residual stream's last update itself (rounding
the sum as the add stores it), so it need not wait for the add; an add something else reads (the
stream) stays, beside the norm: on a decode step one stage fewer on the path, twice a layer."""

from __future__ import annotations

import megaloop.frontend.ops as ops
from megaloop.frontend.graph import Node
from megaloop.fuse.patterns import made_by
from megaloop.fuse.rewrite import Rewriter
from megaloop.fuse.rule import Rule, register_rule

# the norms with a residual operand: the slots of their optional operands after x (absent ones listed)
OPTIONAL = {"rmsnorm": ("weight", "residual"), "layernorm": ("weight", "bias", "residual")}


def _fire(node: Node, rw: Rewriter) -> bool:
    names = OPTIONAL[node.op.name]
    absent = node.attrs.get("absent", ())
    present = [n for slot, n in enumerate(names, start=1) if slot not in absent]
    if "residual" in present[: len(node.inputs) - 1]:
        return False
    add = made_by(node.inputs[0], "add")
    if add is None or "scalars" in add.attrs:
        return False
    x, u = add.inputs
    if x.shape != u.shape or x.shape != node.inputs[0].shape or x.is_view or u.is_view:
        return False
    given = dict(zip(present, node.inputs[1:]))
    build = ops.rmsnorm if node.op.name == "rmsnorm" else ops.layernorm
    with rw.build(node):
        out = build(x, **given, eps=node.attrs["eps"], residual=u)
    rw.replace(node.outputs[0], out)
    rw.discard(node, add)
    return True


register_rule(
    Rule(
        name="norm_residual",
        makes="rmsnorm",
        roots=tuple(OPTIONAL),
        doc="rmsnorm(add(x, u)) -> rmsnorm(x, residual=u) (layernorm too) for x and u of the norm's shape, "
        "neither a view; the add stays where anything else reads it",
        fire=_fire,
    )
)

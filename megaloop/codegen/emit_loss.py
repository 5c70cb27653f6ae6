"""C++ for the cross-entropy's tiles (``ml::cross_entropy`` and ``ml::cross_entropy_grad``,
megaloop/loss.cuh): a warp per row of logits, the operands' leading axes addressed by ``ml::at`` and
the vocabulary by its stride."""

from __future__ import annotations

from typing import Any

from megaloop.codegen.emit import Operand, pointers


def _at(strides: tuple[int, ...], pointer: str) -> str:
    return f"ml::at<{', '.join(str(s) for s in strides)}>({pointer})"


def cross_entropy(op: str, attrs: dict[str, Any], ins: list[Operand], out: Operand) -> list[str]:
    logits, targets = ins[0], ins[1]
    vocab, lead = logits.shape[-1], logits.strides[:-1]
    ignore = f"(ml::i64){attrs['ignore_index']}LL"
    head = [*pointers(ins + [out], len(ins)), "// a warp per row of logits: its log-sum-exp in one pass"]
    if op == "cross_entropy":
        return head + [
            f"ml::cross_entropy<{vocab}, {logits.strides[-1]}, {ignore}>(a, t, tid, {_at(out.strides, 'out0')}, "
            f"{_at(lead, 'in0')}, {_at(targets.strides, 'in1')});"
        ]
    return head + [
        f"ml::cross_entropy_grad<{vocab}, {logits.strides[-1]}, {out.strides[-1]}, {ignore}, {len(lead)}>(a, t, tid, "
        f"{_at(out.strides[:-1], 'out0')}, {_at(lead, 'in0')}, {_at(targets.strides, 'in1')}, "
        f"{_at(ins[2].strides, 'in2')});"
    ]

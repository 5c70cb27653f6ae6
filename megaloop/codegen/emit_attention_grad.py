"""C++ for attention_grad's tiles (megaloop/attention_grad.cuh): one call of ``ml::attention_grad_rows``,
``_dq`` or ``_dkv`` a tile function, with attention's shapes and mask (``ml::AttnShape``) and the
operands' strides as template arguments. Part of megaloop/codegen/emit.py."""

from __future__ import annotations

from typing import Any

from megaloop.codegen.emit import Operand, float_literal, pointers
from megaloop.codegen.emit_attention import at, attn_shape, mask_at
from megaloop.frontend.ops.attention_grad import KVLEN, MASK, QPOS, ROWS, grad_slots

WHAT = {
    "rows": "a warp per (batch, head, query): log-sum-exp and rowsum(P dP), online over its keys",
    "dq": "a warp per (batch, head, query): dQ over its keys",
    "dkv": "a warp per (batch, kv head, key): dK and dV over its query heads' queries",
}


def attention_grad(op: str, attrs: dict[str, Any], ins: list[Operand], out: Operand) -> list[str]:
    """The part's tile: out, q, k, v, do, then the rows part's result (dq, dkv), the query positions
    and key lengths (or Absent), the mask (or Absent)."""
    slot = grad_slots(attrs)
    args = [at(out, "out0")] + [at(ins[n], f"in{n}") for n in range(4)]
    args += [at(ins[slot[s]], f"in{slot[s]}") for s in (ROWS,) if s in slot]
    args += [at(ins[slot[s]], f"in{slot[s]}") if s in slot else at(None, "") for s in (QPOS, KVLEN)]
    args.append(mask_at(ins[slot[MASK]], f"in{slot[MASK]}") if MASK in slot else at(None, ""))
    part = attrs["part"]
    return [
        *pointers(ins + [out], len(ins)),
        f"// {WHAT[part]}",
        f"ml::attention_grad_{part}<{attn_shape(attrs, ins)}>(a, t, tid, {float_literal(attrs['scale'])}, "
        f"{', '.join(args)});",
    ]

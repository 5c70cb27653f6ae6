"""The tiles of sample and of its split form (megaloop/codegen/include/megaloop/sample.cuh computes a row
or a range; megaloop.frontend.ops.sample has the definition they follow bit for bit, sample_split the
split): each row (or range) of the task's box on the whole block, one after another."""

from __future__ import annotations

import math
from typing import Any

from megaloop.codegen.emit import Operand, box_var, broadcast_dims, index_expr, pointers
from megaloop.frontend.ops.sample import PARAMS

TEMPLATES = ("sample", "sample_partial", "sample_combine")
CHUNKS = 512  # sample.cuh CHUNKS: the draw keeps the sums of at most this many chunks of a row
SHARED_BYTES = 8960  # at least sizeof(ml::smp::Shared) (the tiles static_assert it)
DATA_KIND = 3  # ml::fail's kind for a row's sampling parameters out of range (megaloop/runtime/loop.py)


def chunk_elements(n: int) -> int:
    """Elements a chunk of the draw's running sums: multiples of 128 (the scan of a chunk takes 128 at a
    time), at most CHUNKS chunks a row."""
    return max(128, -(-math.ceil(n / CHUNKS) // 128) * 128)


def shared_bytes(template: str, attrs: dict[str, Any]) -> int:
    """Dynamic shared memory a tile of ``template`` uses (the combine: the row's, then the ranges')."""
    if template != "sample_combine":
        return SHARED_BYTES
    return SHARED_BYTES + 12 * attrs["splits"] + 16


def tile(template: str, attrs: dict[str, Any], ins: list[Operand], out: Operand) -> list[str]:
    if template == "sample":
        return _sample(ins, out)
    if template == "sample_partial":
        return _partial(attrs, ins, out)
    return _combine(attrs, ins, out)


def _smem(struct: str, bytes_: int) -> list[str]:
    return [
        f'static_assert(sizeof({struct}) <= {bytes_}, "sample: emit_sample.shared_bytes is too small");',
        "extern __shared__ float4 ml_smem4[];",
        f"{struct}& sh = *reinterpret_cast<{struct}*>(ml_smem4);",
    ]


def _rows_loop(nd: int) -> list[str]:
    return [
        f"for (int e = 0; e < ml::box_count<{box_var(nd)}>(t); ++e) {{",
        f"    int o[{nd + 1}];",
        f"    ml::box_index<{box_var(nd)}>(t, e, o);",
    ]


def _params(params: list[Operand], first: int, nd: int, out: Operand) -> list[str]:
    """The row's parameters (operands first.. first + 4) and their check: a bad one stops the kernel."""
    o = [f"o[{d}]" for d in range(nd)]
    flat = [math.prod(out.shape[d + 1 :]) for d in range(nd)]
    lines = [
        f"    const {p.ctype} {name} = in{first + k}[{index_expr(p.strides, broadcast_dims(nd, p, 'o'))}];"
        for k, ((name, _), p) in enumerate(zip(PARAMS, params))
    ]
    return [
        *lines,
        "    if (!ml::smp::valid(temperature, top_k, top_p)) {",
        f"        if (threadIdx.x == 0) ml::fail(a, ml::DATA, blockIdx.x, tid, t.op, {index_expr(flat, o)}, 0, "
        f"{DATA_KIND}, 0);",
        "        return;",
        "    }",
    ]


def _sample(ins: list[Operand], out: Operand) -> list[str]:
    logits = ins[0]
    n, nd = logits.shape[-1], len(out.shape)
    o = [f"o[{d}]" for d in range(nd)]
    return [
        *pointers([*ins, out], len(ins)),
        f"// rows of {n} logits, one at a time on the whole block (megaloop/sample.cuh)",
        *_smem("ml::smp::Shared", SHARED_BYTES),
        *_rows_loop(nd),
        *_params(ins[1:], 1, nd, out),
        f"    const ml::i64 token = ml::smp::sample_row<{logits.ctype}, {n}, {logits.strides[-1]}, "
        f"{chunk_elements(n)}>(",
        f"        in0 + {index_expr(logits.strides[:-1], o)}, seed, offset, temperature, top_k, top_p, sh);",
        f"    if (threadIdx.x == 0) ml::store(out0 + {index_expr(out.strides, o)}, token);",
        "}",
    ]


def _partial(attrs: dict[str, Any], ins: list[Operand], out: Operand) -> list[str]:
    logits, partial, temperature = ins
    n, nd = logits.shape[-1], len(logits.shape) - 1
    ranges, chunk, cand = attrs["splits"], attrs["chunk"], attrs["candidates"]
    o = [f"o[{d}]" for d in range(nd)]
    t_at = index_expr(temperature.strides, broadcast_dims(nd, temperature, "o"))
    out_at = index_expr(out.strides[:-1], [*o, f"o[{nd}]"])
    return [
        *pointers([*ins, out], len(ins)),
        f"// ranges of {chunk} of a row's {n} logits ({ranges} ranges), one at a time on the whole block",
        *_smem("ml::smp::Shared", SHARED_BYTES),
        f"for (int e = 0; e < ml::box_count<{nd + 1}>(t); ++e) {{",
        f"    int o[{nd + 2}];",
        f"    ml::box_index<{nd + 1}>(t, e, o);",
        f"    const {logits.ctype}* row = in0 + {index_expr(logits.strides[:-1], o)};",
        "    float m;",
        "    ml::i64 first;",
        f"    ml::smp::row_max<{logits.ctype}, {logits.strides[-1]}>(row, {n}, in1 + "
        f"{index_expr(partial.strides[:-1], o)}, {partial.strides[-1]}, {ranges}, m, first, sh);",
        f"    const ml::i64 lo = (ml::i64)o[{nd}] * {chunk};",
        f"    ml::smp::sample_range<{logits.ctype}, {logits.strides[-1]}, {cand}>(row, lo, min((ml::i64){chunk}, "
        f"{n}LL - lo), m, in2[{t_at}], out0 + {out_at}, {out.strides[-1]}, sh);",
        "    __syncthreads();  // (the shared memory is the next range's)",
        "}",
    ]


def _combine(attrs: dict[str, Any], ins: list[Operand], out: Operand) -> list[str]:
    logits, partial, summary = ins[:3]
    n, nd = logits.shape[-1], len(out.shape)
    ranges, chunk, cand = attrs["splits"], attrs["chunk"], attrs["candidates"]
    o = [f"o[{d}]" for d in range(nd)]
    struct = f"ml::smp::CombineShared<{ranges}>"
    targs = f"{logits.ctype}, {n}, {logits.strides[-1]}, {chunk_elements(n)}, {ranges}, {chunk}, {cand}"
    return [
        *pointers([*ins, out], len(ins)),
        f"// rows of {n} logits from {ranges} ranges' candidates ({cand} each), one at a time on the whole block",
        *_smem(struct, shared_bytes("sample_combine", attrs)),
        *_rows_loop(nd),
        *_params(ins[3:], 3, nd, out),
        f"    const ml::i64 token = ml::smp::sample_combined<{targs}>(in0 + {index_expr(logits.strides[:-1], o)},",
        f"        in1 + {index_expr(partial.strides[:-1], o)}, {partial.strides[-1]}, in2 + "
        f"{index_expr(summary.strides[:-2], o)}, {summary.strides[-2]}, {summary.strides[-1]},",
        "        seed, offset, temperature, top_k, top_p, sh);",
        f"    if (threadIdx.x == 0) ml::store(out0 + {index_expr(out.strides, o)}, token);",
        "    __syncthreads();  // (the shared memory is the next row's)",
        "}",
    ]

"""The tiles of sample, of its split form and of penalize: one call each of
megaloop/codegen/include/megaloop/sample.cuh's tile templates. sample's take each row (or range) of the
task's box on the whole block, one after another (megaloop.frontend.ops.sample has the definition they
follow bit for bit, sample_split the split); penalize's takes the box's elements, a thread each
(megaloop.frontend.ops.sample_penalty). Python writes the rows' shape, the row length, the chunks and
the operands' strides."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from megaloop.codegen.emit import Operand, pointers

TEMPLATES = ("sample", "sample_partial", "sample_combine", "penalize")
CHUNKS = 512  # sample.cuh CHUNKS: the draw keeps the sums of at most this many chunks of a row
SHARED_BYTES = 8960  # at least sizeof(ml::smp::Shared) (the tiles static_assert it)
DATA_KIND = 3  # sample.cuh DATA_KIND: ml::fail's kind for a row's sampling parameters out of range
PENALTY_KIND = 4  # sample.cuh PENALTY_KIND: ml::fail's kind for a penalty or count out of range


def chunk_elements(n: int) -> int:
    """Elements a chunk of the draw's running sums: multiples of 128 (the scan of a chunk takes 128 at a
    time), at most CHUNKS chunks a row."""
    return max(128, -(-math.ceil(n / CHUNKS) // 128) * 128)


def shared_bytes(template: str, attrs: dict[str, Any]) -> int:
    """Dynamic shared memory a tile of ``template`` uses (the combine: the row's, then the ranges')."""
    if template == "penalize":
        return 0
    if template != "sample_combine":
        return SHARED_BYTES
    return SHARED_BYTES + 12 * attrs["splits"] + 16


def tile(template: str, attrs: dict[str, Any], ins: list[Operand], out: Operand) -> list[str]:
    if template == "sample":
        return _sample(ins, out)
    if template == "sample_partial":
        return _partial(attrs, ins, out)
    if template == "penalize":
        return _penalize(ins, out)
    return _combine(attrs, ins, out)


def _at(strides: Sequence[int], pointer: str) -> str:
    """``ml::at<strides...>(pointer)`` (megaloop/at.cuh)."""
    return f"ml::at<{', '.join(str(s) for s in strides)}>({pointer})"


def _rows_at(p: Operand, nd: int, pointer: str) -> str:
    """An operand broadcast along the axes where it has size 1 (and those it lacks) in ``nd`` axes."""
    return _at([0] * (nd - len(p.shape)) + [0 if n == 1 else st for n, st in zip(p.shape, p.strides)], pointer)


def _params(params: list[Operand], first: int, nd: int) -> list[str]:
    """seed, offset, temperature, top_k, top_p, min_p (inputs first .. first + 5) in the rows' index space."""
    return [_rows_at(p, nd, f"in{first + k}") for k, p in enumerate(params)]


def _sample(ins: list[Operand], out: Operand) -> list[str]:
    logits = ins[0]
    n = logits.shape[-1]
    targs = ", ".join(str(v) for v in (n, chunk_elements(n), SHARED_BYTES, *out.shape))
    args = [_at(logits.strides, "in0"), *_params(ins[1:], 1, len(out.shape)), _at(out.strides, "out0")]
    return [
        *pointers([*ins, out], len(ins)),
        f"// rows of {n} logits, one at a time on the whole block (megaloop/sample.cuh)",
        f"ml::smp::sample_tile<{targs}>(a, t, tid, {', '.join(args)});",
    ]


def _partial(attrs: dict[str, Any], ins: list[Operand], out: Operand) -> list[str]:
    logits, partial, temperature = ins
    n, nd = logits.shape[-1], len(logits.shape) - 1
    ranges, chunk, cand = attrs["splits"], attrs["chunk"], attrs["candidates"]
    args = [_at(logits.strides, "in0"), _at(partial.strides, "in1"), _rows_at(temperature, nd, "in2")]
    return [
        *pointers([*ins, out], len(ins)),
        f"// ranges of {chunk} of a row's {n} logits ({ranges} ranges), one at a time on the whole block",
        f"ml::smp::sample_partial_tile<{n}, {ranges}, {chunk}, {cand}, {SHARED_BYTES}>(t, {', '.join(args)}, "
        f"{_at(out.strides, 'out0')});",
    ]


def _combine(attrs: dict[str, Any], ins: list[Operand], out: Operand) -> list[str]:
    logits, partial, summary = ins[:3]
    n = logits.shape[-1]
    ranges, chunk, cand = attrs["splits"], attrs["chunk"], attrs["candidates"]
    sizes = (n, chunk_elements(n), ranges, chunk, cand, shared_bytes("sample_combine", attrs), *out.shape)
    args = [_at(o.strides, f"in{k}") for k, o in enumerate((logits, partial, summary))]
    args += [*_params(ins[3:], 3, len(out.shape)), _at(out.strides, "out0")]
    return [
        *pointers([*ins, out], len(ins)),
        f"// rows of {n} logits from {ranges} ranges' candidates ({cand} each), one at a time on the whole block",
        f"ml::smp::sample_combine_tile<{', '.join(str(v) for v in sizes)}>(a, t, tid, {', '.join(args)});",
    ]


def _penalize(ins: list[Operand], out: Operand) -> list[str]:
    operands = [_rows_at(o, len(out.shape), f"in{k}") for k, o in enumerate(ins)]  # (broadcast axes: stride 0)
    return [
        *pointers([*ins, out], len(ins)),
        f"// logits {list(out.shape)} penalised, an element a thread (megaloop/sample.cuh)",
        f"ml::smp::penalize_tile<{', '.join(map(str, out.shape))}>(a, t, tid, {', '.join(operands)}, "
        f"{_at(out.strides, 'out0')});",
    ]

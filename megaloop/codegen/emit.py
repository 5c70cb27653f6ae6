"""C++ for one tile of each op: one function per distinct op signature.

Every function has the same shape, ``void sig_N(const ml::Args& a, const ml::Task& t, int tid,
const ml::i64* off)``: ``off[k]`` is the byte offset in the arena of operand k (inputs, then outputs)
and ``t.lo/t.hi`` the box of the output the task writes. Shapes, strides, dtypes and op constants
are compile-time constants written into the body, so two ops with the same signature (the same layer
of every transformer block) share one function. Each template follows the numpy reference of its op
(megaloop/frontend/ops): float32 arithmetic for every float dtype, one rounding at the store.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from megaloop.dtypes import DType, as_dtype, round_to
from megaloop.frontend.ops._tilings import ELEMENTS, SCATTER_COLUMNS
from megaloop.frontend.ops.rope import inv_frequencies

CTYPE = {
    "float32": "float",
    "float16": "ml::f16",
    "bfloat16": "ml::bf16",
    "int32": "int",
    "int64": "ml::i64",
    "bool": "bool",
}


def compute_type(dtype: DType) -> str:
    return "float" if dtype.is_float else "ml::i64" if dtype.is_int else "bool"


def converter(dtype: DType) -> str:
    return "ml::to_compute_float" if dtype.is_float else "ml::to_compute_int" if dtype.is_int else "ml::to_compute_bool"


@dataclass(frozen=True)
class Operand:
    """What the emitters know about one operand tensor."""

    dtype: DType
    shape: tuple[int, ...]
    strides: tuple[int, ...]

    @property
    def ctype(self) -> str:
        return CTYPE[self.dtype.name]


def float_literal(value: float) -> str:
    """An exact C++ literal for a float32 value (hex float, cast to float)."""
    f = struct.unpack("f", struct.pack("f", float(value)))[0]
    return f"((float){float(f).hex()})"


def double_literal(value: float) -> str:
    return float(value).hex()


def index_expr(strides: Sequence[int], dims: Sequence[str | None]) -> str:
    """sum(index * stride) as C++, skipping axes that do not move (broadcast or size 1)."""
    terms = [f"(ml::i64){d} * {s}" for d, s in zip(dims, strides) if d is not None and s != 0]
    return " + ".join(terms) if terms else "0"


def broadcast_dims(out_ndim: int, operand: Operand, var: str = "i") -> list[str | None]:
    """The output's index variables that address each axis of a broadcast operand (right-aligned)."""
    lead = out_ndim - len(operand.shape)
    return [None if size == 1 else f"{var}[{lead + d}]" for d, size in enumerate(operand.shape)]


def pointers(operands: Sequence[Operand], n_inputs: int) -> list[str]:
    lines = []
    for k, o in enumerate(operands):
        const = "const " if k < n_inputs else ""
        name = f"in{k}" if k < n_inputs else f"out{k - n_inputs}"
        lines.append(f"[[maybe_unused]] {const}{o.ctype}* {name} = ({const}{o.ctype}*)(a.arena + off[{k}]);")
    return lines


# ---- templates ------------------------------------------------------------------------------------


def elementwise(op: str, attrs: dict[str, Any], expr: str, ins: list[Operand], out: Operand) -> list[str]:
    """Any op of one expression over broadcast operands (and Python numbers): ``ml::elementwise``
    (megaloop/elementwise.cuh) with the expression as a lambda over the tensors' compute values (the
    numbers are constants in it), each operand's strides in the output's index space, and the packed
    path's width and packs in flight where the layout allows it (width 0: element by element only)."""
    nd = len(out.shape)
    width, unroll = _elementwise_packs(ins, out, attrs.get("codegen", {}))
    operands = [_at(out.strides, "out0")] + [
        _at([0 if d is None else o.strides[k] for k, d in enumerate(broadcast_dims(nd, o))], f"in{k}", nd)
        for k, o in enumerate(ins)
    ]
    return [
        *pointers(ins + [out], len(ins)),
        f"const auto f = {_lambda(expr, attrs, [o.dtype for o in ins], out.dtype)};",
        *([f"// packed path: {width} elements a load, {unroll} per operand in flight"] if width else []),
        f"ml::elementwise<{width}, {unroll}>(t, f, {', '.join(operands)});",
    ]


NAMES = "abcdefgh"  # an elementwise lambda's operands (ops: a .. c; fused_elementwise: up to 8)


def _lambda(expr: str, attrs: dict[str, Any], dtypes: list[DType], out: DType) -> str:
    """An op's expression as a lambda over its tensors' compute values (its numbers constants in it, of
    the dtype they stand in for: the last tensor's), converted to ``out``'s compute type."""
    scalars = attrs.get("scalars", {})
    tensor_slots = [s for s in range(len(dtypes) + len(scalars)) if s not in scalars]
    compare = out.is_bool and not all(d.is_bool for d in dtypes)
    value_dtype = dtypes[-1] if dtypes else out
    params = ", ".join(f"const {compute_type(d)} {NAMES[s]}" for s, d in zip(tensor_slots, dtypes))
    consts = "".join(
        f"const {compute_type(value_dtype)} {NAMES[s]} = {_scalar(v, value_dtype, compare)}; "
        for s, v in sorted(scalars.items())
    )
    return f"[]({params}) {{ {consts}return {converter(out)}({expr}); }}"


def fused_elementwise(op: str, attrs: dict[str, Any], ins: list[Operand], out: Operand,
                      expression_of: Callable[[dict[str, Any]], str]) -> list[str]:  # fmt: skip
    """fused_elementwise's steps (megaloop/frontend/ops/fused_elementwise.py) as one expression over the
    operands: each step its op's lambda, its result rounded to its dtype (ml::stored) but the last's,
    which ``elementwise`` stores. ``expression_of(step)``: the step's op's C++ expression."""
    steps, lines = attrs["steps"], []
    for k, step in enumerate(steps):
        args = [(NAMES[i], ins[i].dtype) if kind == "in" else (f"s{i}", as_dtype(steps[i]["dtype"]))
                for kind, i in step["args"]]  # fmt: skip
        dtype = as_dtype(step["dtype"])
        value = f"{_lambda(expression_of(step), step['attrs'], [d for _, d in args], dtype)}"
        value += f"({', '.join(name for name, _ in args)})"
        last = k == len(steps) - 1
        lines.append(f"return {value};" if last else f"const auto s{k} = ml::stored<{CTYPE[dtype.name]}>({value});")
    expr = "[&] { " + " ".join(lines) + " }()"
    return elementwise(op, {k: v for k, v in attrs.items() if k != "steps"}, expr, ins, out)


def _at(strides: Sequence[int], pointer: str, nd: int | None = None) -> str:
    """``ml::at<strides...>(pointer)``: an operand's strides right-aligned to the output's ``nd`` axes."""
    full = [0] * ((nd or len(strides)) - len(strides)) + list(strides)
    return f"ml::at<{', '.join(str(s) for s in full)}>({pointer})"


def _elementwise_packs(ins: list[Operand], out: Operand, hints: dict[str, int]) -> tuple[int, int]:
    """(elements a pack, packs an operand in flight) of the packed path, or (0, 1) when the layout rules
    it out at compile time. ``hints``: the op's largest tile (``elements``) and the block's ``threads``,
    where the generator knows them."""
    nd = len(out.shape)
    if nd == 0 or out.strides[-1] != 1:
        return 0, 1
    width = 16 // max([o.dtype.itemsize for o in ins] + [out.dtype.itemsize])
    if width < 2:
        return 0, 1
    vectors = 0
    for o in ins:
        if o.shape and o.shape[-1] != 1:  # (else one value per row of the tile)
            if not (o.strides[-1] == 1 and all(s % width == 0 for s in o.strides[:-1])):
                return 0, 1
            vectors += 1
    if not all(s % width == 0 for s in out.strides[:-1]):
        return 0, 1
    # packs in flight per thread: 8 of each operand for up to two vector operands (fewer stay short of
    # copy bandwidth at one 256-thread block per SM), 4 with more (registers)
    unroll = 8 if vectors <= 2 else 4
    if hints.get("elements") and hints.get("threads"):
        # no more packs a thread than the largest tile has: a decode-sized op (one tile of a few thousand
        # elements) ran 8 unrolled copies of its body, most of them on clamped duplicates, and its code
        # (up to 46 KB for a silu) is fetched into the instruction cache afresh every iteration
        unroll = max(1, min(unroll, -(-hints["elements"] // (width * hints["threads"]))))
    return width, unroll


def _scalar(value: float | int, dtype: DType, compare: bool) -> str:
    if dtype.is_int:
        return f"(ml::i64){int(value)}LL"
    if compare:  # comparisons see the number rounded to the tensor's dtype
        value = float(round_to(np.asarray(float(value)), dtype).astype(np.float32))
    return float_literal(value)


# Packs of a table row each thread of the embedding's packed path has in flight (its id, then the row)
EMBEDDING_UNROLL = 4


def embedding(op: str, attrs: dict[str, Any], table: Operand, ids: Operand, out: Operand) -> list[str]:
    """out[..., d] = table[ids[...], d] (``ml::embedding``, megaloop/gather.cuh): rows copied in 16-byte
    packs where table and out hold whole packs (element by element, a row of 2048 bf16 values costs a
    thread 8 dependent trips to memory on every token's critical path; a pack a thread is one trip),
    else element by element. An id outside the table is a data error naming it."""
    vocab = table.shape[0]
    width = 16 // out.dtype.itemsize
    packed = (
        table.dtype == out.dtype
        and table.strides[1] == 1
        and table.strides[0] % width == 0
        and out.strides[-1] == 1
        and all(st % width == 0 for st in out.strides[:-1])
    )
    if not packed:
        width = 0
    return [
        *pointers([table, ids, out], 2),
        *([f"// packed path: a row in packs of {width}, {EMBEDDING_UNROLL} a thread in flight"] if packed else []),
        f"ml::embedding<{vocab}, {width}, {EMBEDDING_UNROLL}>(a, t, tid, {_at(out.strides, 'out0')}, "
        f"{_at(table.strides, 'in0')}, {_at(ids.strides, 'in1')});",
    ]


def step_batch(op: str, attrs: dict[str, Any], data: Operand, counter: Operand, out: Operand) -> list[str]:
    """out = data[counter mod n] (``ml::step_batch``, megaloop/gather.cuh): the box copied element by
    element from the counter's row (a step's batch of token ids: a few KB a step)."""
    return [
        *pointers([data, counter, out], 2),
        f"// the step's batch: row (counter mod {data.shape[0]}) of the data",
        f"ml::step_batch<{data.shape[0]}, {data.strides[0]}>(a, t, tid, {_at(out.strides, 'out0')}, "
        f"{_at(data.strides[1:], 'in0', len(out.shape))}, ml::at<>(in1));",
    ]


def scatter_add(op: str, attrs: dict[str, Any], values: Operand, ids: Operand, out: Operand) -> list[str]:
    """out[r] = the sum of the values' rows whose id is r (``ml::scatter_add``, megaloop/gather.cuh): a
    warp an output row, its lanes holding the tile's columns (at most SCATTER_COLUMNS: K a lane)."""
    per_lane = -(-min(out.shape[1], SCATTER_COLUMNS) // 32)
    return [
        *pointers([values, ids, out], 2),
        f"// a warp a row of the table's gradient, {per_lane} column(s) a lane, every id scanned in order",
        f"ml::scatter_add<{out.shape[0]}, {ids.shape[0]}, {per_lane}>(a, t, tid, {_at(out.strides, 'out0')}, "
        f"{_at(values.strides, 'in0')}, {_at(ids.strides, 'in1')});",
    ]


# ---- rope and the KV cache updates (megaloop/rope.cuh, megaloop/cache.cuh) -------------------------------

# threads a block and elements of the largest task when an emitter is called without the generator's
# hints (megaloop.codegen.kernel passes them): the plan's default 8 warps and sm_90 task size
DEFAULT_THREADS = 256


def _bool(flag: bool) -> str:
    return "true" if flag else "false"


def rope_frequencies(attrs: dict[str, Any]) -> str:
    """C++: rope's frequencies (rotary_dim / 2 of them, float64) as the table ``inv_freq``, static: one
    table in global memory (a local constexpr array indexed at run time is copied into each thread's
    local memory on every call, 64 stores a thread a tile)."""
    inv = inv_frequencies(attrs["rotary_dim"], attrs["theta"], attrs["scaling"])
    return f"static constexpr double inv_freq[{len(inv)}] = {{{', '.join(double_literal(v) for v in inv)}}};"


def rope(op: str, attrs: dict[str, Any], x: Operand, pos: Operand, out: Operand) -> list[str]:
    """out[d] = x[d] cos - x[p] sin and out[p] = x[p] cos + x[d] sin for each pair (d, p) of the rotary
    dims, dims past rotary_dim copied (``ml::rope``, megaloop/rope.cuh). Python picks the per-pair
    path's pack width and items a thread in flight (``_rope_pairs``; width 0: the per-element path
    only); the frequencies are a table in the tile function."""
    nd = len(x.shape)
    rd, neox = attrs["rotary_dim"], attrs["layout"] == "neox"
    w, unroll = _rope_pairs(attrs, x, out)
    # the leading axes that move (more than one index); pos's strides in their index space
    moving = sum(1 << d for d in range(nd - 1) if x.shape[d] > 1)
    pos_strides = [0 if n == 1 else s for n, s in zip(pos.shape, pos.strides)]
    notes = [f"// per-pair path: whole rows, {w} elements a load, {unroll} item(s) a thread in flight"] if w else []
    return [
        rope_frequencies(attrs),
        *pointers([x, pos, out], 2),
        *notes,
        f"ml::rope<{x.shape[-1]}, {rd}, {_bool(neox)}, {w}, {unroll}, {moving}u>(t, inv_freq, "
        f"{_at(out.strides, 'out0')}, {_at(x.strides, 'in0')}, {_at(pos_strides, 'in1', nd - 1)});",
    ]


def rope_table(op: str, attrs: dict[str, Any], x: Operand, cos: Operand, sin: Operand, out: Operand) -> list[str]:
    """rope_table (``ml::rope_table``, megaloop/rope.cuh), element by element in float64: the tables'
    strides in x's index space (their leading axes right-aligned, 0 where they broadcast), their last
    axis their own."""
    nd = len(x.shape)
    rd, neox = attrs["rotary_dim"], attrs["layout"] == "neox"
    per_pair = cos.shape[-1] != rd

    def table(o: Operand, pointer: str) -> str:
        lead = [0 if n == 1 else st for n, st in zip(o.shape[:-1], o.strides[:-1])]
        return _at([*([0] * (nd - len(o.shape))), *lead, o.strides[-1]], pointer)

    return [
        *pointers([x, cos, sin, out], 3),
        f"// tables of a value a {'pair' if per_pair else 'dim'}, {rd} of {x.shape[-1]} dims turned",
        f"ml::rope_table<{rd}, {_bool(neox)}, {_bool(per_pair)}>(t, {_at(out.strides, 'out0')}, "
        f"{_at(x.strides, 'in0')}, {table(cos, 'in1')}, {table(sin, 'in2')});",
    ]


def _rope_width(x: Operand, out: Operand, rd: int, neox: bool, rows: int, threads: int) -> int:
    """Elements a load for the per-pair path (0: not taken): the widest pack (16 bytes down to one
    element, two for interleaved pairs) that the layout allows and that still gives a task's ``rows``
    at least one item per thread; the narrowest allowed one when none does (decode: 8 heads of 64 make
    32 items of 16-byte packs, a single warp's work)."""
    hd = x.shape[-1]
    if x.strides[-1] != 1 or out.strides[-1] != 1:
        return 0
    row_strides = [s for o in (x, out) for s, n in zip(o.strides[:-1], o.shape[:-1]) if n > 1]
    rotated = rd // 2 if neox else rd  # the first elements of the pairs: packs hold whole runs of them
    chosen, w = 0, 16 // x.dtype.itemsize
    while w >= (1 if neox else 2):
        if rotated % w == 0 and (hd - rd) % w == 0 and all(s % w == 0 for s in row_strides):
            chosen = w
            if rows * (rotated + hd - rd) // w >= threads:
                break
        w //= 2
    return chosen


def _rope_pairs(attrs: dict[str, Any], x: Operand, out: Operand) -> tuple[int, int]:
    """(pack width, items a thread in flight) of the per-pair path, (0, 1) when the layout rules it
    out at compile time. An item is one pack of W elements of a row and its partners; each pair's angle
    is taken once (the per-element path takes it for both elements), and a thread's items are loaded
    before any is stored: a store may alias the next load (one element at a time waited the full memory
    latency each)."""
    hd, rd, neox = x.shape[-1], attrs["rotary_dim"], attrs["layout"] == "neox"
    hints = attrs.get("codegen", {})
    threads = hints.get("threads") or DEFAULT_THREADS
    elements = hints.get("elements") or max(ELEMENTS.values())  # the tiling's task size
    rows = min(math.prod(x.shape[:-1]), max(1, elements // hd))  # of the largest task
    w = _rope_width(x, out, rd, neox, rows, threads)
    if not w:
        return 0, 1
    items = (rd // 2 if neox else rd) // w + (hd - rd) // w  # per row
    return w, max(1, min(4, -(-rows * items // threads)))


def kv_update(op: str, attrs: dict[str, Any], cache: Operand, new: Operand, pos: Operand, out: Operand) -> list[str]:
    """Rows of new into the cache slab of the task's (batch, head), at their positions, in place
    (``ml::kv_update``, megaloop/cache.cuh). A position outside [0, max_len) is reported (ml::DATA) and
    never written (a negative one skipped where the op ignores negative positions)."""
    _, _, s, dim = cache.shape
    tokens = new.shape[2]
    w, unroll = _kv_update_packs(attrs, new, out)
    notes = [f"// batched path: {w} elements a copy, {unroll} copy(ies) a thread in flight"] if w else []
    return [
        *pointers([cache, new, pos, out], 3),
        *notes,
        f"ml::kv_update<{s}, {tokens}, {dim}, {_bool(bool(attrs.get('ignore_negative')))}, {w}, {unroll}>(a, t, tid, "
        f"{_at(out.strides, 'out0')}, {_at(new.strides, 'in1')}, {_at(pos.strides, 'in2')});",
    ]


# items (a rotary pair, or a dim past rotary_dim) a thread loads, with their positions, before it
# stores any (a store may alias the next load: one at a time paid the memory latency per item); fewer
# where the task has fewer items than its threads have (decode: 32 pairs a head)
ROPE_KV_ITEMS = 4


def rope_kv_update(
    op: str, attrs: dict[str, Any], cache: Operand, new: Operand, pos: Operand, out: Operand
) -> list[str]:
    """rope_kv_cache_update (``ml::rope_kv_update``, megaloop/cache.cuh): the rows of new of the task's
    (batch, head), each rotary pair rotated at its token's position with rope's formula (the same bits
    as rope's output) and stored at that position of the cache slab, dims past rotary_dim copied bit
    for bit. A position outside [0, max_len) is reported (ml::DATA) and never written."""
    _, _, s, dim = cache.shape
    tokens = new.shape[2]
    rd = attrs["rotary_dim"]
    per_token = rd // 2 + dim - rd  # items: the rotary pairs, then the dims passed through
    threads = attrs.get("codegen", {}).get("threads") or DEFAULT_THREADS
    u = max(1, min(ROPE_KV_ITEMS, -(-tokens * per_token // threads)))
    neox = attrs["layout"] == "neox"
    return [
        rope_frequencies(attrs),
        *pointers([cache, new, pos, out], 3),
        f"// {tokens} token(s) x ({rd // 2} rotary pairs + {dim - rd} dims copied), {u} item(s) a thread at a time",
        f"ml::rope_kv_update<{s}, {tokens}, {dim}, {rd}, {_bool(neox)}, {u}>(a, t, tid, inv_freq, "
        f"{_at(out.strides, 'out0')}, {_at(new.strides, 'in1')}, {_at(pos.strides, 'in2')});",
    ]


def _kv_update_packs(attrs: dict[str, Any], new: Operand, out: Operand) -> tuple[int, int]:
    """(elements a copy, copies a thread in flight) of the batched path: 16 bytes where the layout
    allows, down to one element at any stride; (0, 1) where a task's copies reach 2^30 (32-bit index
    arithmetic). A per-element loop pays the full memory latency per element (a store may alias the
    next load, so neither compiler nor hardware overlaps them)."""
    _, _, s, dim = out.shape
    tokens = new.shape[2]
    w = 16 // out.dtype.itemsize
    while w > 1 and not (
        dim % w == 0
        and new.strides[3] == 1
        and out.strides[3] == 1
        and (tokens == 1 or new.strides[2] % w == 0)
        and (s == 1 or out.strides[2] % w == 0)
    ):
        w //= 2
    total = tokens * (dim // w)
    if not 0 < total < 2**30:
        return 0, 1
    threads = attrs.get("codegen", {}).get("threads") or DEFAULT_THREADS
    return w, max(1, min(8, -(-total // threads)))


def concat(op: str, attrs: dict[str, Any], ins: list[Operand], out: Operand) -> list[str]:
    """The inputs one after another along the axis (``ml::concat``, megaloop/gather.cuh)."""
    sizes = ", ".join(str(t.shape[attrs["axis"]]) for t in ins)
    operands = ", ".join([_at(out.strides, "out0")] + [_at(t.strides, f"in{k}") for k, t in enumerate(ins)])
    return [*pointers(ins + [out], len(ins)), f"ml::concat<{attrs['axis']}, {sizes}>(t, {operands});"]

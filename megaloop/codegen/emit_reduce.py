"""Tile templates of the reductions (sum, mean, max, min, argmax over one or more axes): a warp per
output element, or the whole block per output element where the reduced elements are a long
contiguous run (megaloop.frontend.ops.reduce has the semantics: float32 accumulation, NaN propagation,
argmax's first index)."""

from __future__ import annotations

import math
from typing import Any

from megaloop.codegen.emit import Operand, box_var, compute_type, index_expr, pointers


def reduction(op: str, attrs: dict[str, Any], x: Operand, out: Operand) -> list[str]:
    axis = attrs["axis"]
    axes = tuple(range(len(x.shape))) if axis is None else (axis,) if isinstance(axis, int) else tuple(axis)
    keep = attrs["keepdims"]
    kept = [d for d in range(len(x.shape)) if d not in axes]
    # output index of each kept input axis
    out_axis, j = {}, 0
    for d in range(len(x.shape)):
        if d in axes:
            j += keep
        else:
            out_axis[d] = j
            j += 1
    total = math.prod(x.shape[d] for d in axes)
    ct = compute_type(x.dtype)
    body = pointers([x, out], 1)
    if total >= BLOCK_REDUCTION_MIN and _contiguous_run(x, axes):
        return body + _block_reduction(op, x, out, axes, kept, out_axis, total)
    body.append(f"ml::for_box_warps<{box_var(len(out.shape))}>(t, [&](const int* o, int lane) {{")
    body.append(
        f"    const ml::i64 base = {index_expr([x.strides[d] for d in kept], [f'o[{out_axis[d]}]' for d in kept])};"
    )
    if op == "argmax":
        init = "ml::neg_inf()" if x.dtype.is_float else "(ml::i64)(-9223372036854775807LL - 1)"
        body.append(f"    {ct} best = {init};")
        body.append("    ml::i64 best_i = 9223372036854775807LL;")
    else:
        init = {"sum": "0", "mean": "0", "max": "ml::neg_inf()", "min": "ml::pos_inf()"}[op]
        if x.dtype.is_int:
            init = {"sum": "0", "max": "(ml::i64)(-9223372036854775807LL - 1)", "min": "9223372036854775807LL"}[op]
        body.append(f"    {ct} acc = {init};")
    body.append(f"    for (ml::i64 r = lane; r < {total}LL; r += 32) {{")
    if _contiguous_run(x, axes):  # r is the offset itself (no 64-bit divisions an element)
        body.append(f"        const {ct} v = ml::load(in0 + base + r);")
    else:
        body.append("        ml::i64 rest = r, at = base;")
        for d in reversed(axes):
            body.append(f"        at += (rest % {x.shape[d]}) * {x.strides[d]}; rest /= {x.shape[d]};")
        body.append(f"        const {ct} v = ml::load(in0 + at);")
    if op == "argmax":
        better = "(v != v) ? (best == best) : (v > best)" if x.dtype.is_float else "v > best"
        body.append(f"        if (best_i == 9223372036854775807LL || ({better})) {{ best = v; best_i = r; }}")
    elif op in ("sum", "mean"):
        body.append("        acc += v;")
    elif op == "max":
        body.append("        acc = (v > acc || v != v) ? v : acc;")
    else:
        body.append("        acc = (v < acc || v != v) ? v : acc;")
    body.append("    }")
    odims = [f"o[{d}]" for d in range(len(out.shape))]
    where = index_expr(out.strides, odims)
    if op == "argmax":
        body.append("    ml::warp_argmax(best, best_i);")
        body.append(f"    if (lane == 0) ml::store(out0 + {where}, best_i);")
    else:
        reduce = {"sum": "ml::warp_sum", "mean": "ml::warp_sum", "max": "ml::warp_max", "min": "ml::warp_min"}[op]
        body.append(f"    acc = {reduce}(acc);")
        final = f"acc / (float){total}" if op == "mean" else "acc"
        body.append(f"    if (lane == 0) ml::store(out0 + {where}, {final});")
    body.append("});")
    return body


# Reductions of at least this many elements an output element take the whole block per output element
# (16-byte packs, several in flight a thread), not a warp: the argmax over a Llama-3.2 vocabulary
# (128256 logits) took one warp's scalar loads 296 us of a 1.7 ms generation step (H200).
BLOCK_REDUCTION_MIN = 8192
BLOCK_REDUCTION_PACKS = 4  # 16-byte packs a thread loads before it folds them in


def _contiguous_run(x: Operand, axes: tuple[int, ...]) -> bool:
    """The reduced axes of ``x`` are one row-major run of memory: the elements of an output element are
    ``total`` consecutive ones from its base."""
    ordered = sorted(axes)
    if not ordered:  # no axis reduced: the one element at base
        return True
    if ordered != list(range(ordered[0], ordered[0] + len(ordered))):
        return False
    step = 1
    for d in reversed(ordered):
        if x.shape[d] > 1 and x.strides[d] != step:
            return False
        step *= x.shape[d]
    return True


def _block_reduction(
    op: str, x: Operand, out: Operand, axes: tuple[int, ...], kept: list[int], out_axis: dict[int, int], total: int
) -> list[str]:
    """The whole block on one output element at a time: each thread folds in its packs (in increasing
    index order, so argmax's ties still go to the first index), then the warps' results are combined in
    a fixed order through shared memory (the same bits every run)."""
    nd = len(out.shape)
    width = 16 // x.dtype.itemsize
    base = index_expr([x.strides[d] for d in kept], [f"o[{out_axis[d]}]" for d in kept])
    where = index_expr(out.strides, [f"o[{d}]" for d in range(nd)])
    return [
        f"// the whole block on each output element: {total} consecutive elements, {width} a 16-byte pack",
        *_block_shared(op, x),
        f"for (int e = 0; e < ml::box_count<{nd}>(t); ++e) {{",
        f"    int o[{nd + 1}];",
        f"    ml::box_index<{nd}>(t, e, o);",
        f"    const {x.ctype}* p = in0 + {base};",
        *_indented(_block_fold(op, x, f"{total}LL", 1, f"out0 + {where}", "", str(total), f"{total // width}LL")),
        "}",
    ]


def _indented(lines: list[str]) -> list[str]:
    """``lines`` one level in (pragmas stay at the line's start, as they were written)."""
    return [line if line.startswith("#") else "    " + line for line in lines]


def _block_shared(op: str, x: Operand) -> list[str]:
    """The block reductions' declarations: each warp's result (and argmax's index) in shared memory."""
    arg = op in ("argmax", "argmax_partial")
    return [
        *(["constexpr ml::i64 NONE = 9223372036854775807LL;  // no element seen yet"] if arg else []),
        f"__shared__ {compute_type(x.dtype)} red[32];  // each warp's result",
        *(["__shared__ ml::i64 red_i[32];  // and its index"] if arg else []),
        "const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;",
    ]


def _block_fold(
    op: str, x: Operand, total: str, step: int, dest: str, index_offset: str, count: str, packs: str
) -> list[str]:
    """One output element on the whole block: the ``total`` elements at ``p``, ``step`` apart (``packs``
    16-byte packs where step is 1 and p is aligned), folded by each thread in increasing index order,
    then the warps combined in a fixed order; thread 0 stores the result at ``dest`` (argmax: the index
    plus ``index_offset``; mean: divided by ``count``)."""
    ct = compute_type(x.dtype)
    width = 16 // x.dtype.itemsize
    arg = op in ("argmax", "argmax_partial")
    if arg:
        init = "ml::neg_inf()" if x.dtype.is_float else "(ml::i64)(-9223372036854775807LL - 1)"
        better = "(v != v) ? (best == best) : (v > best)" if x.dtype.is_float else "v > best"
        fold = f"if (best_i == NONE || ({better})) {{ best = v; best_i = r; }}"
        combine = ["ml::warp_argmax(best, best_i);"]
    else:
        init = {"sum": "0", "mean": "0", "max": "ml::neg_inf()", "min": "ml::pos_inf()"}[op]
        if x.dtype.is_int:
            init = {"sum": "0", "max": "(ml::i64)(-9223372036854775807LL - 1)", "min": "9223372036854775807LL"}[op]
        fold = {
            "sum": "best += v;",
            "mean": "best += v;",
            "max": "best = (v > best || v != v) ? v : best;",
            "min": "best = (v < best || v != v) ? v : best;",
        }[op]
        warp = {"sum": "ml::warp_sum", "mean": "ml::warp_sum", "max": "ml::warp_max", "min": "ml::warp_min"}[op]
        combine = [f"best = {warp}(best);"]
    final = f"best / (float){count}" if op == "mean" else f"best_i{index_offset}" if arg else "best"
    u = BLOCK_REDUCTION_PACKS
    reset = f"best = {init};" + (" best_i = NONE;" if arg else "")
    packed = [
        "if (ml::aligned(p, 16)) {",
        f"    const ml::i64 packs = {packs};",
        f"    for (ml::i64 j0 = threadIdx.x; j0 < packs; j0 += {u} * (ml::i64)blockDim.x) {{",
        f"        ml::Pack<{x.ctype}, {width}> pk[{u}];  // {u} loads in flight before any is used",
        "#pragma unroll",
        f"        for (int k = 0; k < {u}; ++k) {{",
        "            const ml::i64 j = min(j0 + k * (ml::i64)blockDim.x, packs - 1);",
        f"            pk[k] = ml::load_pack<{x.ctype}, {width}>(p + j * {width});",
        "        }",
        "#pragma unroll",
        f"        for (int k = 0; k < {u}; ++k) {{",
        "            if (j0 + k * (ml::i64)blockDim.x >= packs) break;",
        "#pragma unroll",
        f"            for (int w = 0; w < {width}; ++w) {{",
        *([f"                const ml::i64 r = (j0 + k * (ml::i64)blockDim.x) * {width} + w;"] if arg else []),
        f"                const {ct} v = ml::get(pk[k], w);",
        f"                {fold}",
        "            }",
        "        }",
        "    }",
        f"    r0 = packs * {width};",
        "}",
    ]
    at = "p + r" if step == 1 else f"p + r * {step}"
    return [
        f"{ct} best = {init};",
        *(["ml::i64 best_i = NONE;"] if arg else []),
        "ml::i64 r0 = 0;  // elements before r0: folded in (whole packs)",
        *(packed if step == 1 else []),
        f"for (ml::i64 r = r0 + threadIdx.x; r < {total}; r += blockDim.x) {{  // the rest, one at a time",
        f"    const {ct} v = ml::load({at});",
        f"    {fold}",
        "}",
        *combine,
        "if (lane == 0) {",
        "    red[warp] = best;",
        *(["    red_i[warp] = best_i;"] if arg else []),
        "}",
        "__syncthreads();",
        "if (warp == 0) {",
        f"    {reset}",
        "    if (lane < warps) {",
        "        best = red[lane];",
        *(["        best_i = red_i[lane];"] if arg else []),
        "    }",
        *[f"    {c}" for c in combine],
        f"    if (lane == 0) ml::store({dest}, {final});",
        "}",
        "__syncthreads();  // red is the next element's",
    ]


def argmax_partial(attrs: dict[str, Any], x: Operand, out: Operand) -> list[str]:
    """argmax_partial: the whole block on each range of the axis (megaloop.frontend.ops.argmax_split),
    its index along the whole axis stored."""
    a, chunk, n = attrs["axis"], attrs["chunk"], x.shape[attrs["axis"]]
    nd = len(out.shape)
    others = [x.strides[d] for d in range(nd) if d != a]
    base = index_expr(others, [f"o[{d}]" for d in range(nd) if d != a]) if others else "0"
    where = index_expr(out.strides, [f"o[{d}]" for d in range(nd)])
    fold = _block_fold(
        "argmax_partial", x, "count", x.strides[a], f"out0 + {where}", " + lo", "", f"count / {16 // x.dtype.itemsize}"
    )
    return [
        *pointers([x, out], 1),
        f"// the whole block on each range of {chunk} elements of axis {a} ({n} in all; the last range shorter)",
        *_block_shared("argmax_partial", x),
        f"for (int e = 0; e < ml::box_count<{nd}>(t); ++e) {{",
        f"    int o[{nd + 1}];",
        f"    ml::box_index<{nd}>(t, e, o);",
        f"    const ml::i64 lo = (ml::i64)o[{a}] * {chunk};  // the range's first element along the axis",
        f"    const ml::i64 count = min((ml::i64){chunk}, {n}LL - lo);",
        f"    const {x.ctype}* p = in0 + {base} + lo * {x.strides[a]};",
        *_indented(fold),
        "}",
    ]


COMBINE_BATCH = 4  # ranges a lane of argmax_combine loads at once (128 ranges: one batch, two trips)


def argmax_combine(attrs: dict[str, Any], x: Operand, partial: Operand, out: Operand) -> list[str]:
    """argmax_combine: a warp an output element, a lane a few ranges: their indices loaded together,
    then x's values at them together (two trips, not one a range), folded in range order, the lanes
    combined (ties to the smaller index: the earlier range)."""
    a, keep, splits = attrs["axis"], attrs["keepdims"], attrs["splits"]
    nd = len(x.shape)
    per_lane = min(COMBINE_BATCH, -(-splits // 32))  # ranges a lane loads at once (a batch)
    # output coordinates of x's axes other than a: the same with keepdims, shifted past a without
    out_of = {d: d if keep or d < a else d - 1 for d in range(nd) if d != a}
    xbase = index_expr([x.strides[d] for d in out_of], [f"o[{out_of[d]}]" for d in out_of]) if out_of else "0"
    pbase = index_expr([partial.strides[d] for d in out_of], [f"o[{out_of[d]}]" for d in out_of]) if out_of else "0"
    ct = compute_type(x.dtype)
    init = "ml::neg_inf()" if x.dtype.is_float else "(ml::i64)(-9223372036854775807LL - 1)"
    better = "(v != v) ? (best == best) : (v > best)" if x.dtype.is_float else "v > best"
    where = index_expr(out.strides, [f"o[{d}]" for d in range(len(out.shape))]) if out.shape else "0"
    return [
        *pointers([x, partial, out], 2),
        "constexpr ml::i64 NONE = 9223372036854775807LL;  // no range seen yet",
        f"ml::for_box_warps<{box_var(len(out.shape))}>(t, [&](const int* o, int lane) {{",
        f"    const ml::i64 xb = {xbase}, pb = {pbase};",
        f"    {ct} best = {init};",
        "    ml::i64 best_i = NONE;",
        f"    for (int s0 = lane; s0 < {splits}; s0 += {32 * per_lane}) {{  // the lane's ranges s0, s0 + 32, ...",
        f"        ml::i64 at[{per_lane}];  // their best indices",
        "#pragma unroll",
        f"        for (int k = 0; k < {per_lane}; ++k) {{",
        "            const int s = s0 + 32 * k;",
        f"            at[k] = s < {splits} ? in1[pb + (ml::i64)s * {partial.strides[a]}] : NONE;",
        "        }",
        f"        {ct} val[{per_lane}];",
        "#pragma unroll",
        f"        for (int k = 0; k < {per_lane}; ++k)",
        f"            val[k] = at[k] != NONE ? ml::load(in0 + xb + at[k] * {x.strides[a]}) : {init};",
        "#pragma unroll",
        f"        for (int k = 0; k < {per_lane}; ++k) {{",
        f"            const {ct} v = val[k];",
        f"            if (at[k] != NONE && (best_i == NONE || ({better}))) {{ best = v; best_i = at[k]; }}",
        "        }",
        "    }",
        "    ml::warp_argmax(best, best_i);",
        f"    if (lane == 0) ml::store(out0 + {where}, best_i);",
        "});",
    ]

"""C++ for the row ops' tiles (softmax / log_softmax along an axis, layernorm / rmsnorm along the
last): a warp per row for short rows, a group of warps per row (the whole block, or one of its groups
each on rows of its own) for long ones, rows streaming through a ring in shared memory."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from megaloop.codegen.emit import Operand, float_literal, index_expr, pointers
from megaloop.frontend.ops.normalization import LAYERNORM_OPERANDS, RMSNORM_OPERANDS

NORM_OPERANDS = {"layernorm": LAYERNORM_OPERANDS, "rmsnorm": RMSNORM_OPERANDS}  # after x, by name

# A row of at least this many 16-byte packs is spread over the whole block (held in registers, one
# DRAM read, block-wide reductions); shorter rows get a warp each. Decode's rmsnorm over 2048 bf16 on
# one warp took 7.7 us of a 550 us step; 8192-wide rows on a warp each reached 0.3 of copy bandwidth.
BLOCK_ROW_PACKS = 128
BLOCK_ROW_MAX_PACKS_PER_THREAD = 16  # register budget: 16 packs of 16 bytes = 64 registers
BLOCK_ROW_MIN_THREADS = 256  # the block path's registers are sized for at least this many threads
# The next rows stream into a ring of row slots in shared memory (cp.async) while one row is reduced:
# up to ROW_RING_ROWS rows in ROW_RING_BYTES (two rows where they are longer), and never more than
# three quarters of the plan's shared memory (one slot on an RTX card for 64 KB rows: no read-ahead).
# Rows held in registers instead left rmsnorm at 0.48 of copy bandwidth on an H200 whether 2 or 4 rows
# were in flight: each row's block reduction (a barrier) waited for every load into registers still
# in flight, so nothing streamed across it. A cp.async copy in flight is not waited for by a barrier.
ROW_RING_ROWS = 8
ROW_RING_BYTES = 96 * 1024
# The block splits into up to ROW_GROUPS groups of warps, each reducing rows of its own behind its own
# named barrier, where the task has that many rows and the op's ROW_GROUP_LIMITS hold: packs a thread
# at most, ring slots a group at least. Why: with the whole block on one row, every warp is in the same
# phase at once (all loading, all waiting on shuffles, all on the exponentials' MUFU pipe), at 2 warps
# a scheduler: rmsnorm and softmax issued ~30 % of the time (0.79 and 0.47 of copy bandwidth at 8192
# bf16 a row on an H200). Measured there (docs/experiments.md, 764330b): rmsnorm 0.80 -> 0.83-0.86
# with 2 groups of 8 packs (4 groups of 16 packs: 0.80, its weight no longer fits in registers);
# softmax 0.67 (one group) -> 0.78-0.80 (2 groups of 8 packs, exps kept) -> 0.85 (4 groups of 16
# packs, one slot each, exps recomputed: more rows in flight beats fewer exponentials).
ROW_GROUPS = 4
ROW_GROUP_LIMITS = {"softmax": (16, 1), "log_softmax": (16, 1)}  # (max packs a thread, min slots a group)
ROW_GROUP_DEFAULT_LIMITS = (8, 2)  # norms keep their weight's packs in registers beside the row's
ROW_GROUP_MIN_WARPS = 2
SOFTMAX_KEPT_EXPS = 64  # floats a thread keeps between softmax's sum and store passes
ROW_ACCUMULATORS = 4  # independent partial maxima / sums a thread keeps over its packs of a row


def norm_inputs(op: str, attrs: dict[str, Any], n_inputs: int) -> dict[str, int]:
    """A norm's present operands after x by name -> their index among its ``n_inputs`` inputs. Graphs
    saved before the residual operand do not list it as absent: operands past the inputs are absent."""
    absent = attrs.get("absent", ())
    present = [nm for k, nm in enumerate(NORM_OPERANDS.get(op, ()), start=1) if k not in absent]
    return {nm: i for i, nm in enumerate(present[: n_inputs - 1], start=1)}


def _residual(op: str, attrs: dict[str, Any], ins: list[Operand]) -> int | None:
    """The input index of a norm's residual (added to x before normalising), or None."""
    return norm_inputs(op, attrs, len(ins)).get("residual")


def _packed_rows(op: str, attrs: dict[str, Any], ins: list[Operand], out: Operand) -> tuple[int, int] | None:
    """(width, packs a row) of the packed paths' rows, or None when a row is not whole aligned packs
    along the last axis."""
    x = ins[0]
    nd = len(x.shape)
    axis = attrs.get("axis", nd - 1)
    width = 16 // max(o.dtype.itemsize for o in ins + [out])
    res = _residual(op, attrs, ins)
    rows_like = [x, out] + ([ins[res]] if res else [])  # laid out in rows of x's shape
    packed = (
        axis == nd - 1
        and x.shape[axis] % width == 0
        and all(o.strides[-1] == 1 and all(st % width == 0 for st in o.strides[:-1]) for o in rows_like)
        and all(o.strides[0] == 1 for k, o in enumerate(ins) if k and k != res)
    )
    return (width, x.shape[axis] // width) if packed else None


@dataclass(frozen=True)
class BlockRows:
    """The block-per-row path's layout of an op's rows: ``groups`` groups of ``threads`` threads each
    reduce rows of their own (group g rows g, g + groups, ...), a thread holding ``held`` packs of
    ``width`` elements of its row; ``ring`` row slots in shared memory, ``ring // groups`` a group."""

    width: int
    packs: int
    groups: int
    threads: int
    held: int
    ring: int


def block_rows(op: str, attrs: dict[str, Any], ins: list[Operand], out: Operand) -> BlockRows | None:
    """The block-per-row layout, or None when the op takes the warp-per-row paths (``attrs["codegen"]``:
    the plan's ``shared_memory`` per block, ``threads`` a block, the largest tile's ``elements``)."""
    hints = attrs.get("codegen", {})
    packed = _packed_rows(op, attrs, ins, out)
    block = hints.get("threads", BLOCK_ROW_MIN_THREADS)
    if packed is None or block < BLOCK_ROW_MIN_THREADS or block % 32:
        return None  # (a block of fewer threads never takes the block path: no ring to reserve)
    width, packs = packed
    if packs < BLOCK_ROW_PACKS or -(-packs // block) > BLOCK_ROW_MAX_PACKS_PER_THREAD:
        return None
    row = packs * 16 * (2 if _residual(op, attrs, ins) else 1)  # a residual's row streams beside x's
    ring = min(ROW_RING_ROWS, max(ROW_RING_BYTES, 2 * row) // row, hints.get("shared_memory", 0) * 3 // 4 // row)
    # no more slots than the op's largest tile has rows (decode: one row, one slot; the ring's loop is
    # unrolled once per slot, and that code is fetched afresh every iteration)
    elements = hints.get("elements")
    tile_rows = -(-elements // (packs * width)) if elements else ROW_RING_ROWS
    ring = max(1, min(ring, tile_rows)) if ring else 0
    if not ring:
        return None
    max_packs, min_slots = ROW_GROUP_LIMITS.get(op, ROW_GROUP_DEFAULT_LIMITS)
    groups = 1
    while (
        2 * groups <= min(ROW_GROUPS, tile_rows, ring // min_slots)
        and block % (2 * groups * 32) == 0
        and block // (2 * groups) >= 32 * ROW_GROUP_MIN_WARPS
        and -(-packs // (block // (2 * groups))) <= max_packs
    ):
        groups *= 2
    threads = block // groups
    return BlockRows(width, packs, groups, threads, -(-packs // threads), ring // groups * groups)


def rows_shared_bytes(op: str, attrs: dict[str, Any], ins: list[Operand], out: Operand) -> int:
    layout = block_rows(op, attrs, ins, out)
    return layout.ring * layout.packs * 16 * (2 if _residual(op, attrs, ins) else 1) if layout else 0


def _index_j(value: str, statement: str) -> str:
    """The element index j's declaration, where the statement reads j."""
    return f"const int j = {value}; " if re.search(r"\bj\b", statement) else ""


def rows(op: str, attrs: dict[str, Any], ins: list[Operand], out: Operand) -> list[str]:
    """softmax / log_softmax along an axis, layernorm / rmsnorm along the last: a warp per row, or
    the whole block per row for long rows, with packed loads when the row is contiguous and aligned.
    ``attrs["codegen"]`` (see ``block_rows``) lays out the block path's rows."""
    x = ins[0]
    nd = len(x.shape)
    axis = attrs.get("axis", nd - 1)
    n = x.shape[axis]
    body = pointers(ins + [out], len(ins))
    body.append("ml::Task rowt = t;")
    body.append(f"rowt.hi[{axis}] = rowt.lo[{axis}] + 1;  // iterate the box without the row axis")
    packed = _packed_rows(op, attrs, ins, out)
    if packed:
        width = packed[0]
        checks = " && ".join(
            f"ml::aligned({p}, {width * o.dtype.itemsize})"
            for p, o in [(f"in{k}", o) for k, o in enumerate(ins)] + [("out0", out)]
        )
        block = block_rows(op, attrs, ins, out)
        if block:
            G, T = block.groups, block.threads
            body.append(
                f"if ({checks} && blockDim.x == {G * T}) {{  // {'a block' if G == 1 else f'{G} groups of {T} threads'}"
                f" per row, {block.held} pack(s) of {width} a thread, {block.ring} rows streaming through shared memory"
            )
            body.append(
                f"    __shared__ float red[{128 * G}];  // the warps' partial results (ml::group_sum), 128 a group"
            )
            body += ["    " + line for line in _row_program(op, attrs, ins, out, axis, n, width, block)]
            body.append("    return;")
            body.append("}")
        body.append(f"if ({checks}) {{  // packed path: a warp per row, {width} elements per load")
        body += ["    " + line for line in _row_program(op, attrs, ins, out, axis, n, width)]
        body.append("    return;")
        body.append("}")
    body += _row_program(op, attrs, ins, out, axis, n, 1)
    return body


def _row_program(
    op: str,
    attrs: dict[str, Any],
    ins: list[Operand],
    out: Operand,
    axis: int,
    n: int,
    width: int,
    block: BlockRows | None = None,
) -> list[str]:
    """The row loop. ``width`` > 1 walks the row in packs of that many elements; with ``block`` each
    row is spread over a group of warps (the whole block, or one of its groups: see BlockRows), every
    thread holding its packs in registers (one read of the row), with group-wide reductions instead of
    warp-wide ones, the group's next rows arriving in shared memory meanwhile."""
    x = ins[0]
    nd = len(x.shape)
    others = [f"o[{d}]" if d != axis else None for d in range(nd)]
    xs, os_ = x.strides[axis], out.strides[axis]
    held = block.held if block else 0
    res = _residual(op, attrs, ins)  # x + residual is the row (rounded to x's dtype, as an add would store it)
    rb_out = ", ml::i64& rb" if res else ""
    rb_arg = ", rb" if res else ""
    if block:
        G, T, packs = block.groups, block.threads, block.packs
        S = block.ring // G  # slots a group
        pack = f"ml::Pack<{x.ctype}, {width}>"
        # every thread holds exactly `held` packs (the group's threads divide the row): no guards, no
        # placeholder packs (a select per pack and per 16-bit element, on every row). (At 16 packs
        # ptxas once spilled the layernorm's 64 row registers unguarded; since the ring, layernorm
        # over 32768 bf16 takes 232 registers and spills nothing: tests/test_codegen.py checks.)
        full = packs == held * T
        head = [
            f"const int nrows = ml::box_count<{nd}>(rowt);",
            f"auto row_at = [&](int e, ml::i64& xb, ml::i64& ob{rb_out}) {{",
            f"    int o[{nd + 1}];",
            f"    ml::box_index<{nd}>(rowt, e, o);",
            f"    xb = {index_expr(x.strides, others)};",
            f"    ob = {index_expr(out.strides, others)};",
            *([f"    rb = {index_expr(ins[res].strides, others)};"] if res else []),
            "};",
            "int rk = 0;  // group reductions so far: which half of red the next one uses (one barrier each)",
            f"const int g = {'0' if G == 1 else f'threadIdx.x / {T}'};  // this thread's group: rows g, g + {G}, ...",
            f"const int tg = {'threadIdx.x' if G == 1 else f'threadIdx.x % {T}'};  // its place in the group's row",
        ]
        lines = [
            f"// a ring of {block.ring} row slots in shared memory, {S} a group: the group's i-th row in its slot",
            f"// g * {S} + i % {S}; each thread copies and reads back only its own packs (pk = tg + u * {T}), so",
            "// no barrier guards a slot",
            "extern __shared__ float4 ml_smem4[];",
            f"{pack}* slots = reinterpret_cast<{pack}*>(ml_smem4);",
            *(
                [f"{pack}* rslots = slots + {block.ring * packs};  // the residual's rows, slot for slot"]
                if res
                else []
            ),
            "auto fetch = [&](int e, int slot) {  // one commit group a row, empty past the last row (the count",
            "    if (e < nrows) {                 // of groups in flight stays in step with the rows)",
            f"        ml::i64 xb, ob{rb_arg};",
            f"        row_at(e, xb, ob{rb_arg});",
            "#pragma unroll",
            f"        for (int u = 0; u < {held}; ++u) {{",
            f"            const int pk = tg + u * {T};",
            f"            {'' if full else f'if (pk < {packs}) '}ml::cp_async16(slots + slot * {packs} + pk, "
            f"in0 + xb + pk * {width}, true);",
            *(
                [
                    f"            {'' if full else f'if (pk < {packs}) '}ml::cp_async16(rslots + slot * {packs} + pk, "
                    f"in{res} + rb + pk * {width}, true);"
                ]
                if res
                else []
            ),
            "        }",
            "    }",
            "    ml::cp_async_commit();",
            "};",
            "#pragma unroll",
            f"for (int d = 0; d < {S}; ++d) fetch(g + {G} * d, g * {S} + d);",
            f"for (int i0 = 0; g + {G} * i0 < nrows; i0 += {S}) {{",
            # unrolled over the slots: a slot's address a constant (docs/experiments.md)
            "#pragma unroll",
            f"for (int d = 0; d < {S}; ++d) {{",
            f"    const int e = g + {G} * (i0 + d);",
            "    if (e >= nrows) break;  // (the same for the whole group: its barriers stay matched)",
            f"    ml::i64 xb, ob{rb_arg};",
            f"    row_at(e, xb, ob{rb_arg});",
            f"    ml::cp_async_wait<{S - 1}>();  // this thread's packs of row e have landed",
            f"    {pack} px[{held}];  // row e",
            "#pragma unroll",
            f"    for (int u = 0; u < {held}; ++u) {{",
            f"        const int pk = tg + u * {T};",
            f"        px[u] = slots[(g * {S} + d) * {packs} + pk];"
            if full
            else f"        px[u] = pk < {packs} ? slots[(g * {S} + d) * {packs} + pk] : {pack}{{}};",
            *(
                [
                    f"        {'' if full else f'if (pk < {packs}) '}px[u] = ml::add_rounded(px[u], "
                    f"rslots[(g * {S} + d) * {packs} + pk]);"
                ]
                if res
                else []
            ),
            "    }",
        ]
        refill = [
            f"    fetch(e + {G * S}, g * {S} + d);  // the group's row {S} on, into row e's slot: this thread's "
            "packs of row e are in px, used",
        ]
        footer = ["}", "}"]
    else:
        head, refill, full, G, T = [], [], False, 1, 32
        lines = [
            f"ml::for_box_warps<{nd}>(rowt, [&](const int* o, int lane) {{",
            f"    const ml::i64 xb = {index_expr(x.strides, others)};",
            f"    const ml::i64 ob = {index_expr(out.strides, others)};",
            *([f"    const ml::i64 rb = {index_expr(ins[res].strides, others)};"] if res else []),
        ]
        footer = ["});"]

    def held_packs(*body: str) -> list[str]:
        """``body`` for each pack pk of the row this thread holds (px[u])."""
        return [
            "#pragma unroll",
            f"    for (int u = 0; u < {held}; ++u) {{",
            f"        const int pk = tg + u * {T};",
            *([] if full else [f"        if (pk >= {n // width}) break;"]),
            *[("" if line.startswith("#") else "        ") + line for line in body],
            "    }",
        ]

    def reduce(kind: str, value: str) -> str:
        return f"ml::group_{kind}<{T // 32}, {G}>({value}, red, rk++, g)" if held else f"ml::warp_{kind}({value})"

    # the block path's running maxima and sums: ROW_ACCUMULATORS independent partials (a thread's pack u
    # into partial u % A), so a row's elements are not one chain of dependent adds
    parts = min(ROW_ACCUMULATORS, held) if held else 1

    def acc(name: str) -> str:
        return f"{name}_p[u % {parts}]" if held else name

    def acc_init(name: str, init: str) -> list[str]:
        if not held:
            return [f"    float {name} = {init};"]
        return [
            f"    float {name}_p[{parts}];",
            "#pragma unroll",
            f"    for (int a = 0; a < {parts}; ++a) {name}_p[a] = {init};",
        ]

    def acc_total(name: str, combine: str) -> list[str]:
        """name = the partials combined pairwise in a fixed order (``combine``: "+" or a function)."""
        if not held:
            return []
        terms = [f"{name}_p[{a}]" for a in range(parts)]
        while len(terms) > 1:
            pairs = [terms[i : i + 2] for i in range(0, len(terms), 2)]
            terms = [
                (f"({p[0]} + {p[1]})" if combine == "+" else f"{combine}({p[0]}, {p[1]})") if len(p) == 2 else p[0]
                for p in pairs
            ]
        return [f"    float {name} = {terms[0]};"]

    def scalar_row_value() -> str:
        """The row's element j (float) on the element-by-element path: x's, plus the residual's."""
        if res:
            rs = ins[res].strides[axis]
            return f"ml::add_rounded(in0 + xb + (ml::i64)j * {xs}, in{res} + rb + (ml::i64)j * {rs})"
        return f"ml::load(in0 + xb + (ml::i64)j * {xs})"

    def packed_row_value() -> str:
        """The row's pack at j0 on the warp-per-row packed path: x's, plus the residual's."""
        load = f"ml::load_pack<{x.ctype}, {width}>(in0 + xb + j0)"
        return f"ml::add_rounded({load}, ml::load_pack<{x.ctype}, {width}>(in{res} + rb + j0))" if res else load

    def each(statement: str, need_v: bool = True) -> list[str]:
        """Run ``statement`` for every element j of the row, with v = x[j] (float) when asked."""
        if held:
            return held_packs(
                "#pragma unroll",
                f"for (int q = 0; q < {width}; ++q) {{ {_index_j(f'pk * {width} + q', statement)}"
                f"{'const float v = ml::get(px[u], q); ' if need_v else ''}{statement} }}",
            )
        if width == 1:
            load = f"const float v = {scalar_row_value()}; " if need_v else ""
            return [f"    for (int j = lane; j < {n}; j += 32) {{ {load}{statement} }}"]
        out_lines = [f"    for (int j0 = lane * {width}; j0 < {n}; j0 += 32 * {width}) {{"]
        if need_v:
            out_lines.append(f"        const ml::Pack<{x.ctype}, {width}> px = {packed_row_value()};")
        out_lines.append("#pragma unroll")
        out_lines.append(
            f"        for (int q = 0; q < {width}; ++q) {{ {_index_j('j0 + q', statement)}"
            f"{'const float v = ml::get(px, q); ' if need_v else ''}{statement} }}"
        )
        out_lines.append("    }")
        return out_lines

    def store_each(value: str, per_pack: tuple[str, ...] = ()) -> list[str]:
        """out[j] = value for every j; packed stores on the packed paths (``per_pack``: statements run
        once per pack before its elements, on the block-per-row path)."""
        if held:
            return held_packs(
                *per_pack,
                f"ml::Pack<{out.ctype}, {width}> po;",
                "#pragma unroll",
                f"for (int q = 0; q < {width}; ++q) {{ const int j = pk * {width} + q; "
                f"const float v = ml::get(px[u], q); ml::set(po, q, {value}); }}",
                f"ml::store_pack<{out.ctype}, {width}>(out0 + ob + pk * {width}, po);",
            )
        if width == 1:
            return each(f"ml::store(out0 + ob + (ml::i64)j * {os_}, {value});")
        return [
            f"    for (int j0 = lane * {width}; j0 < {n}; j0 += 32 * {width}) {{",
            f"        const ml::Pack<{x.ctype}, {width}> px = {packed_row_value()};",
            f"        ml::Pack<{out.ctype}, {width}> po;",
            "#pragma unroll",
            f"        for (int q = 0; q < {width}; ++q) {{ const int j = j0 + q; const float v = ml::get(px, q); "
            f"ml::set(po, q, {value}); }}",
            f"        ml::store_pack<{out.ctype}, {width}>(out0 + ob + j0, po);",
            "    }",
        ]

    hoisted: list[str] = []  # loaded once per task, before the rows (block-per-row path)
    if op in ("softmax", "log_softmax") and held:
        # one barrier a row: each warp takes its exponentials relative to its own max and sums them,
        # the warps' (max, sum) pairs are combined once (two block reductions in turn, each behind a
        # barrier, left the row's processing longer than its transfer). A NaN needs no max of its own:
        # it reaches every output through the sum, as in torch.
        # the maxima in the row's own dtype, a pack at a time (16-bit: two elements an instruction, no
        # conversions), into `parts` independent running packs
        xpack = f"ml::Pack<{x.ctype}, {width}>"
        lines += [
            f"    {xpack} mp[{parts}];  // running maxima of this thread's packs",
            "#pragma unroll",
            f"    for (int a = 0; a < {parts}; ++a) mp[a] = ml::neg_inf_pack<{x.ctype}, {width}>();",
        ]
        lines += held_packs(f"ml::max_into(mp[u % {parts}], px[u]);")
        lines += [f"    ml::max_into(mp[0], mp[{a}]);" for a in range(1, parts)]
        lines.append("    float m = ml::pack_max(mp[0]);")
        lines += refill
        lines.append("    m = ml::warp_fmax(m);")
        lines.append("    const float mt = m == ml::neg_inf() ? 0.0f : m;  // a warp of -inf only: exps of 0")
        lines += acc_init("s", "0.0f")
        if out.dtype.itemsize == 2:
            # results rounded to 8 or 11 bits: 2^((v - mt) log2 e) to ~2 float32 ulps in three
            # instructions (expf's range reduction made these rows issue-bound: 0.40 of copy bandwidth).
            # Not fmaf(v, log2 e, -mt log2 e): mt log2 e overflows for a bf16 row masked with
            # finfo(bf16).min (every exp inf, the row NaN) and is inexact for huge |mt|
            exp = "ml::exp2_approx((v - mt) * 1.4426950408889634f)"
        else:
            exp = "expf(v - mt)"
        # softmax keeps each exponential for the store pass (registers: at most SOFTMAX_KEPT_EXPS a
        # thread) instead of computing it twice; same values
        keep = op == "softmax" and held * width <= SOFTMAX_KEPT_EXPS
        if keep:
            lines.append(f"    float ex[{held}][{width}];  // exp(v - mt) of each element this thread holds")
            lines += each(f"const float e_ = {exp}; ex[u][q] = e_; {acc('s')} += e_;")
        else:
            lines += each(f"{acc('s')} += {exp};")
        lines += acc_total("s", "+")
        lines += [
            "    s = ml::warp_sum(s);",
            "    float mx = m, sx = s;",
            f"    ml::group_max_sumexp<{T // 32}, {G}>(mx, sx, red, rk++, g);  // the row's max, sum of exp(x - max)",
        ]
        if op == "softmax":
            # the warp's exps are relative to mt: rescaled to the row's max with the sum's reciprocal;
            # nothing to rescale where they are all 0, unless the whole row is -inf (NaN, as torch)
            # (__fdividef: 2 ulps, where IEEE division is a call-guarded sequence on the row's critical path;
            # 0 < sx <= the row's length)
            lines.append(
                "    const float c = (s == 0.0f && mx != ml::neg_inf()) ? 0.0f : __fdividef(expf(m - mx), sx);"
            )
            if keep or out.dtype.itemsize != 2:
                lines += store_each(("ex[u][q]" if keep else exp) + " * c")
            else:
                # recomputed exps take c in their exponent: 2^((v - mt) log2 e + log2 c), one FFMA for
                # the FADD, FMUL and FMUL (c = 0: log2 c = -inf, the output 0; NaN stays NaN)
                lines.append("    const float lc = log2f(c);")
                lines += store_each("ml::exp2_approx(fmaf(v - mt, 1.4426950408889634f, lc))")
        else:
            lines += store_each("(v - mx) - logf(sx)")
    elif op in ("softmax", "log_softmax"):
        lines.append("    float m = ml::neg_inf();")
        lines += each("m = (v > m || v != v) ? v : m;")
        lines += [f"    m = {reduce('max', 'm')};", "    float s = 0.0f;"]
        lines += each("s += expf(v - m);")
        # one division a row, a multiplication an element: at 8 warps an SM, a division per element
        # (an instruction sequence) made these rows issue-bound (softmax 0.21 of copy bandwidth)
        lines.append(f"    s = {reduce('sum', 's')};")
        lines.append("    const float inv_s = 1.0f / s;")
        lines += store_each("expf(v - m) * inv_s" if op == "softmax" else "(v - m) - logf(s)")
    else:
        wk = norm_inputs(op, attrs, len(ins))
        present = [nm for nm in wk if nm != "residual"]  # the affine parameters
        eps = float_literal(attrs["eps"])
        if op == "layernorm":
            lines += acc_init("s", "0.0f")
            lines += each(f"{acc('s')} += v;")
            lines += acc_total("s", "+")
            lines += refill
            lines.append(f"    const float mean = {reduce('sum', 's')} / (float){n};")
            lines += acc_init("q2", "0.0f")
            lines += each(f"const float d = v - mean; {acc('q2')} += d * d;")
            lines += acc_total("q2", "+")
            lines.append(f"    const float inv = 1.0f / sqrtf({reduce('sum', 'q2')} / (float){n} + {eps});")
            y = "(v - mean) * inv"
        else:
            lines += acc_init("q2", "0.0f")
            lines += each(f"{acc('q2')} += v * v;")
            lines += acc_total("q2", "+")
            lines += refill
            lines.append(f"    const float inv = 1.0f / sqrtf({reduce('sum', 'q2')} / (float){n} + {eps});")
            y = "v * inv"

        per_pack: list[str] = []
        # the weight's and bias's packs stay in registers for the whole task where they fit beside the
        # row's (at most BLOCK_ROW_MAX_PACKS_PER_THREAD packs a thread in all: more spilled)
        keep_params = held * (1 + len(present)) <= BLOCK_ROW_MAX_PACKS_PER_THREAD

        def param(name: str) -> str:
            """The weight's or bias's element j: on the block-per-row path from packs each thread loads
            once per task (its columns are the same in every row; a load per row put an L2 round trip
            between each row's reduction and its stores) or, where they do not fit, once per pack of
            the row (one 16-byte load, not one per element), else a load of its own."""
            k = wk[name]
            if held and not keep_params:
                per_pack.append(
                    f"const ml::Pack<{ins[k].ctype}, {width}> pw{k} = ml::load_pack<{ins[k].ctype}, {width}>"
                    f"(in{k} + pk * {width});"
                )
                return f"ml::get(pw{k}, q)"
            if held:
                hoisted.extend(
                    [
                        f"ml::Pack<{ins[k].ctype}, {width}> pw{k}[{held}];  // {name}: this thread's packs",
                        "#pragma unroll",
                        f"for (int u = 0; u < {held}; ++u)",
                        f"    pw{k}[u] = ml::load_pack<{ins[k].ctype}, {width}>(in{k} + min(tg + u * {T}, "
                        f"{n // width - 1}) * {width});",
                    ]
                )
                return f"ml::get(pw{k}[u], q)"
            return f"ml::load(in{k} + (ml::i64)j * {ins[k].strides[0]})"

        if "weight" in wk:
            y = f"({y}) * {param('weight')}"
        if "bias" in wk:
            y = f"({y}) + {param('bias')}"
        lines += store_each(y, tuple(per_pack))
    return head + hoisted + lines + footer

"""The sampling and exchange tiles are calls of the header templates in megaloop/sample.cuh and
megaloop/exchange.cuh (loops, shared memory and the member dispatch live there; Python writes the
template arguments): every such tile function of the op table's sample rows, a Llama-3-vocabulary
split sample, the exchanges between ranks (pulled and pushed, packed and not) and a pushing send is
one call whose arguments carry the plan's choices, and the kernels compile for sm_90a and sm_80
without spills. What the tiles compute: tests/test_sample_codegen.py (the generated sample tiles on
the CPU, bit for bit) and tests/test_gpu_multi.py (the exchanges on GPUs)."""

from __future__ import annotations

import re

import pytest

import megaloop as ml
from megaloop.codegen import generate
from megaloop.plan import make_plan
from megaloop.runtime.compile import spills
from tests.op_table import ROWS, build_row
from tests.test_codegen import exchange_graphs, packed_exchange_graphs
from tests.test_row_templates import tile_functions
from tests.test_sample_codegen import sample_graph

CALLS = {
    "sample": "ml::smp::sample_tile<",
    "sample_partial": "ml::smp::sample_partial_tile<",
    "sample_combine": "ml::smp::sample_combine_tile<",
    "all_reduce": "ml::reduce_members<|ml::push_all_reduce_(ll|bulk)<",
    "reduce_scatter": "ml::reduce_members<",
    "all_gather": "ml::gather_members<",
    "recv": "ml::copy_box<",
    "send": "ml::copy_box<",
}
POINTER = re.compile(r"\(a\.arenas?(\[\d+\])? \+ off\[\d+\]\)")


def assert_template_calls(src: str) -> dict[str, str]:
    """Every sampling and exchange tile function of ``src`` is one template call: pointers, comments
    and that call, no loop or shared memory of its own. Returns op -> a call, for every op found."""
    calls = {}
    for sig, (op, body) in tile_functions(src).items():
        if op not in CALLS:
            continue
        code = [line.strip() for line in body.splitlines()]
        code = [line for line in code if not line.startswith("//") and not POINTER.search(line)]
        assert len(code) == 1 and re.match(CALLS[op], code[0]), f"{sig} ({op}) is not one {CALLS[op]} call:\n{body}"
        assert "for (" not in body and "__shared__" not in body, f"{sig} ({op}): a loop of its own\n{body}"
        calls[op] = code[0]
    return calls


def assert_no_spills(src: str, arch: str) -> None:
    found = spills(src, arch)
    assert not found, f"{arch}: register spills (stores, loads bytes) per function: {found}"


def sample_kernel_graph() -> ml.Graph:
    """A draw of each op table row of sample and its split form (bfloat16), and the Llama-3.2
    generator's split sample (128256 bfloat16 logits in 126 ranges)."""
    g = sample_graph([((1, 1, 128256), "bfloat16", 126)])
    for n, row in enumerate(r for r in ROWS if r.op in ("sample", "sample_partial", "sample_combine")):
        build_row(row, "bfloat16", 0, graph=g, prefix=f"r{n}.")
    return g


ARCHS = {"sm_90": "sm_90a", "sm_80": "sm_80"}  # the plan's architecture -> the cubin's


def test_sample_tiles_are_template_calls_without_spills() -> None:
    g = sample_kernel_graph()
    for arch, cubin in ARCHS.items():
        src = generate(make_plan(g, processors=16, arch=arch)).source
        calls = assert_template_calls(src)
        assert set(calls) == {"sample", "sample_partial", "sample_combine"}, calls
        assert_no_spills(src, cubin)


def test_the_sample_calls_carry_the_rows_and_the_split() -> None:
    """sample_combine_tile<N, CHUNK, RANGES, RCHUNK, L, BYTES, rows...>: the row, the draw's chunks,
    the split's ranges and candidates, the shared memory reserved, the rows' shape; per-row parameters
    broadcast along their size-1 axes (stride 0)."""
    from megaloop.codegen.emit_sample import chunk_elements, shared_bytes

    src = generate(make_plan(sample_graph([((2, 1, 128256), "bfloat16", 126)]), processors=16)).source
    calls = assert_template_calls(src)
    attrs = {"splits": 126}
    want = f"ml::smp::sample_combine_tile<128256, {chunk_elements(128256)}, 126, 1024, 32, "
    assert calls["sample_combine"].startswith(want + f"{shared_bytes('sample_combine', attrs)}, 2, 1>"), calls
    assert "ml::smp::sample_partial_tile<128256, 126, 1024, 32, 8960>" in calls["sample_partial"]
    g = ml.Graph("broadcast-params")
    x = g.input("x", (3, 50), "float32")
    seed, offset = g.input("s", (1,), "int64"), g.input("o", (3,), "int64")
    rest = [g.input("t", (1,), "float32"), g.input("k", (3,), "int64"), g.input("p", (), "float32")]
    g.output("y", ml.sample(x, seed, offset, *rest))
    call = assert_template_calls(generate(make_plan(g, processors=2)).source)["sample"]
    args = "ml::at<50, 1>(in0), ml::at<0>(in1), ml::at<1>(in2), ml::at<0>(in3), ml::at<1>(in4), ml::at<0>(in5), "
    args += "ml::at<0>(in6)"  # min_p: the builder's constant 0
    assert call == f"ml::smp::sample_tile<50, 128, 8960, 3>(a, t, tid, {args}, ml::at<1>(out0));", call


def exchange_kernels(arch: str) -> dict[str, str]:
    """Pulled and pushed exchanges of 2, 3 and 8 ranks (first and last rank), packed and not."""
    kernels = {}
    for world in (2, 3, 8):
        for push in (0, 1):
            plan = make_plan(exchange_graphs(world), processors=4, arch=arch, tiles={"all_reduce": {"push": push}})
            for rank in (0, world - 1):
                kernels[f"exchanges {world} ranks, push {push}, rank {rank}"] = generate(plan, rank).source
    for world in (2, 3):
        plan = make_plan(packed_exchange_graphs(world), processors=4, arch=arch, tiles={"all_reduce": {"push": 0}})
        kernels[f"packed exchanges {world} ranks"] = generate(plan, world - 1).source
    for dtype, n, op in ((ml.bfloat16, 3000, "sum"), (ml.float32, 1 << 20, "max")):  # LL lines, bulk stores
        graphs = ml.spmd(
            lambda g, n=n, dtype=dtype, op=op: g.output("y", ml.all_reduce(g.input("x", (n,), dtype), op)), 3
        )
        kernels[f"pushed {dtype.name}"] = generate(make_plan(graphs, processors=132, arch=arch), 2).source

    def send(g: ml.Graph) -> None:
        ml.send(ml.exp(g.input("x", (8, 1024), ml.bfloat16)), (g.rank + 1) % 2)
        g.output("z", ml.recv(g, (g.rank + 1) % 2, (8, 1024), ml.bfloat16) + 1.0)

    plan = make_plan(ml.spmd(send, 2), processors=16, arch=arch, tiles={"recv": {"push": 1}})
    kernels["pushing send"] = generate(plan, 1).source
    return kernels


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_exchange_tiles_are_template_calls_without_spills(arch: str) -> None:
    seen: set[str] = set()
    for src in exchange_kernels(arch).values():
        seen |= set(assert_template_calls(src))
        assert_no_spills(src, ARCHS[arch])
    assert seen == {"all_reduce", "reduce_scatter", "all_gather", "recv", "send"}, seen


def test_the_exchange_calls_carry_the_layouts() -> None:
    """The pack width where the layouts allow it (0: element by element), the members' pointers at this
    rank's slice for reduce_scatter, the gather's axis and piece, a pushing all_reduce's group and member."""
    packed = make_plan(packed_exchange_graphs(3), processors=4, tiles={"all_reduce": {"push": 0}})
    calls = assert_template_calls(generate(packed, 2).source)
    assert calls["all_gather"].startswith("ml::gather_members<1, 32, 8, 4>(t, ml::at<96, 1>(out0), "), calls
    assert calls["reduce_scatter"].startswith("ml::reduce_members<true, 8, 2>(t, ml::at<32, 1>(out0), ")
    assert calls["recv"] == "ml::copy_box<8, 8>(t, ml::at<32, 1>(out0), ml::at<32, 1>(in0));"
    src = generate(packed, 2).source
    assert "(const ml::bf16*)(a.arenas[1] + off[1]) + 64;  // rank 1" in src  # rank 2's slice: from 64
    plain = assert_template_calls(generate(make_plan(exchange_graphs(3), processors=4), 1).source)
    assert plain["all_gather"].startswith("ml::gather_members<0, 6, 0, 1>("), plain  # rows of 6 bf16
    assert plain["all_reduce"].startswith("ml::push_all_reduce_ll<"), plain
    assert ", 1, 0, 1, 2>(a, t, tid, k, proc, off, " in plain["all_reduce"], plain  # member 1 of ranks 0, 1, 2

"""Generated loop kernels compile with NVRTC (no GPU needed): every op of the table in one kernel per
float dtype for sm_90a, the Llama-style block, and a representative kernel for sm_80, sm_86, sm_89.
The generated source is also checked for what a human reader relies on."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

import megaloop as ml
from megaloop import errors
from megaloop.codegen import generate
from megaloop.models import LlamaConfig, build_llama
from megaloop.plan import KernelOptions, make_plan
from megaloop.runtime.compile import CompileError, compile_cubin
from tests.op_table import ROWS, build_row

NO_RING = KernelOptions(weight_ring_slots=0)  # decode matmuls load their weights themselves (no weight ring)

ROOT = Path(__file__).resolve().parents[1]

GPU_OPS = [row for row in ROWS if ml.REGISTRY[row.op].lowering is not None]


def all_ops_graph(dtype: str) -> ml.Graph:
    g = ml.Graph(f"all-ops-{dtype}")
    for i, row in enumerate(GPU_OPS):
        dt = dtype if dtype in row.dtypes else row.dtypes[0]
        build_row(row, dt, seed=11, graph=g, prefix=f"r{i}.")
    return g


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_every_op_compiles_for_sm90a(dtype: str) -> None:
    g = all_ops_graph(dtype)
    program = generate(make_plan(g, processors=16))
    cubin = compile_cubin(program.source, "sm_90a", use_cache=False)
    assert cubin[:4] == b"\x7fELF"
    assert len(program.signatures) >= len({row.op for row in GPU_OPS}) // 2


def test_llama_block_compiles_for_every_arch() -> None:
    cfg = LlamaConfig(hidden=128, heads=4, kv_heads=2, intermediate=256, layers=2, max_seq=64, vocab=100)
    for tokens in (1, 16):
        source = generate(make_plan(build_llama(cfg, 2, tokens), processors=32)).source
        for arch in ("sm_90a", "sm_80", "sm_86", "sm_89"):
            assert compile_cubin(source, arch, use_cache=False)[:4] == b"\x7fELF"


def test_generated_source_is_readable_and_shared() -> None:
    cfg = LlamaConfig(hidden=64, heads=4, kv_heads=2, intermediate=96, layers=3, max_seq=16, vocab=50)
    plan = make_plan(build_llama(cfg, 1, 1), processors=8)
    program = generate(plan)
    src = program.source
    # every tile function says which op (and the first op of its signature) it runs
    for m in re.finditer(r"__device__ __noinline__ void sig_(\d+)", src):
        assert f"// sig_{m.group(1)}: " in src
    assert "layers.0.attn" in src
    # the three layers share their tile functions: signatures do not grow with depth
    deeper = generate(
        make_plan(
            build_llama(
                LlamaConfig(hidden=64, heads=4, kv_heads=2, intermediate=96, layers=6, max_seq=16, vocab=50), 1, 1
            ),
            processors=8,
        )
    )
    assert len(deeper.signatures) == len(program.signatures)
    # tables: every task's box fits its op's output and its waits point at real counters
    rp = plan.ranks[0]
    for t, row in zip(rp.tasks, program.tasks):
        out = rp.tensors[rp.ops[t.op].outputs[0]]
        assert tuple(row["hi"][: len(out.shape)]) <= out.shape or all(
            h <= d for h, d in zip(row["hi"][: len(out.shape)], out.shape)
        )
    assert np.all(program.waits["counter"] < program.counters)
    assert program.list_begin[-1] == len(rp.tasks)


def exchange_graphs(world: int) -> list[ml.Graph]:
    """Every exchange between ranks, with views, on ``world`` ranks."""

    def build(g: ml.Graph) -> None:
        x = g.input("x", (world * 2, 6), ml.bfloat16)
        a = ml.all_reduce(x * 2.0)
        m = ml.all_reduce(g.input("i", (3, 5), ml.int32), op="max")
        b = ml.all_gather(a[:2].T, axis=0)
        c = ml.reduce_scatter(x, axis=0)
        ml.send(c, (g.rank + 1) % world)
        r = ml.recv(g, (g.rank - 1) % world, (2, 6), ml.bfloat16)
        g.output("y", ml.matmul(b, r))
        for name, value in (("m", m), ("a", a), ("b", b), ("c", c), ("r", r)):
            g.output(name, value)

    return ml.spmd(build, world)


def packed_exchange_graphs(world: int) -> list[ml.Graph]:
    """Every exchange in layouts the 16-byte packed paths take (contiguous last axis, whole packs):
    bf16 and float32 all_reduce, all_gather and reduce_scatter along the last axis, recv."""

    def build(g: ml.Graph) -> None:
        x = g.input("x", (world * 4, 32 * world), ml.bfloat16)
        a = ml.all_reduce(x * 2.0)
        f = ml.all_reduce(g.input("f", (5, 36), ml.float32))
        b = ml.all_gather(a[:3, :32], axis=1)
        c = ml.reduce_scatter(x, axis=1)
        ml.send(c, (g.rank + 1) % world)
        r = ml.recv(g, (g.rank - 1) % world, c.shape, ml.bfloat16)
        for name, value in (("a", a), ("f", f), ("b", b), ("c", c), ("r", r)):
            g.output(name, value)

    return ml.spmd(build, world)


@pytest.mark.parametrize("world", [2, 3])
def test_exchanges_take_packed_loads_where_the_layout_allows(world: int) -> None:
    """The pulling paths (all_reduce pushes by default: tests/test_push_all_reduce.py)."""
    plan = make_plan(packed_exchange_graphs(world), processors=4, tiles={"all_reduce": {"push": 0}})
    src = generate(plan, 0).source
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "recv"):
        body = src[src.index(f": {kind} ") :]
        body = body[: body.index("\n}\n")]
        assert "packed path" in body, f"{kind}: no packed path in\n{body}"
    assert compile_cubin(src, "sm_90a", use_cache=False)[:4] == b"\x7fELF"
    assert (
        "packed path"
        not in generate(make_plan(exchange_graphs(world), processors=4), 0)
        .source.split(": all_gather ")[1]
        .split("\n}\n")[0]
    ), "rows of 6 bf16 are not whole packs"


@pytest.mark.parametrize("world", [2, 3, 8])
def test_exchanges_between_ranks_compile_and_name_their_peers(world: int) -> None:
    plan = make_plan(exchange_graphs(world), processors=4)
    for rank in (0, world - 1):
        program = generate(plan, rank)
        src = program.source
        for kind in ("all_reduce", "all_gather", "reduce_scatter", "recv"):
            assert f": {kind} " in src, f"rank {rank}: no {kind} tile function"
        peers = {int(m) for m in re.findall(r"a\.arenas\[(\d+)\]", src)}
        assert peers == set(range(world)), f"rank {rank} reads ranks {sorted(peers)}"
        # every wait on another rank names a real counter of that rank
        for w in program.waits:
            assert 0 <= w["rank"] < world and w["counter"] < len(plan.ranks[w["rank"]].counters)
        assert any(w["rank"] != rank for w in program.waits)
        assert program.tasks["remote"].any(), "some counter of this rank is waited on by a peer"
        if rank == 0:
            assert compile_cubin(src, "sm_90a", use_cache=False)[:4] == b"\x7fELF"


@pytest.mark.parametrize("world", [2, 3])
def test_every_wait_on_a_peer_polls_a_mirror_the_peer_bumps(world: int) -> None:
    """Cross-rank waits poll a mirror counter in the waiting rank's own memory: every task (on any
    rank) that signals the mirrored counter bumps exactly that mirror, and no two mirrors share a slot
    or overlap the rank's own counters."""
    plan = make_plan(exchange_graphs(world), processors=4)
    programs = [generate(plan, r) for r in range(world)]
    for r, prog in enumerate(programs):
        own = len(plan.ranks[r].counters)
        peer_waits = prog.waits[prog.waits["rank"] != r]
        assert len(peer_waits) and (prog.waits[prog.waits["rank"] == r]["mirror"] == -1).all()
        slots = {}
        for w in peer_waits:
            slots.setdefault((int(w["rank"]), int(w["counter"])), set()).add(int(w["mirror"]))
        assert all(len(v) == 1 for v in slots.values()), "one mirror slot per peer counter"
        used = sorted(next(iter(v)) for v in slots.values())
        assert used == list(range(own, own + len(used))) and prog.counters == own + len(used)
        for (p, c), (slot,) in slots.items():
            producer = programs[p]
            signallers = np.flatnonzero(producer.tasks["counter"] == c)
            assert len(signallers) == len(plan.ranks[p].signalers()[c])
            for t in signallers:
                row = producer.tasks[t]
                bumps = producer.mirrors[row["mirror_begin"] : row["mirror_begin"] + row["mirror_count"]]
                assert row["remote"] == 1 and [(int(b["rank"]), int(b["counter"])) for b in bumps].count((r, slot)) == 1
    # and nothing bumps a mirror nobody polls
    for p, prog in enumerate(programs):
        for b in prog.mirrors:
            r, slot = int(b["rank"]), int(b["counter"])
            assert slot in set(programs[r].waits["mirror"][programs[r].waits["rank"] == p])
    # without native peer atomics (mirrors=False): the waits poll the peers' counters, nothing is bumped
    # remotely, and the same counters are still released at system scope
    for r, prog in enumerate(programs):
        plain = generate(plan, r, mirrors=False)
        assert (plain.waits["mirror"] == -1).all() and len(plain.mirrors) == 0
        assert (plain.tasks["mirror_count"] == 0).all() and (plain.tasks["remote"] == prog.tasks["remote"]).all()
        assert (plain.waits[["counter", "rank", "lag"]] == prog.waits[["counter", "rank", "lag"]]).all()


def test_tp_mlp_kernels_compile_for_every_rank() -> None:
    world, hidden, ffn = 2, 64, 128

    def build(g: ml.Graph) -> None:
        x = g.input("x", (4, hidden), ml.bfloat16)
        w1 = g.parameter("w1", (ffn // world, hidden), ml.bfloat16)
        w2 = g.parameter("w2", (hidden, ffn // world), ml.bfloat16)
        g.output("y", ml.all_reduce(ml.linear(ml.silu(ml.linear(x, w1)), w2)))

    plan = make_plan(ml.spmd(build, world), processors=16)
    for rank in range(world):
        assert compile_cubin(generate(plan, rank).source, "sm_90a", use_cache=False)[:4] == b"\x7fELF"


def test_compile_cache_round_trip(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("MEGALOOP_CACHE", str(tmp_path))
    src = generate(
        make_plan(
            build_llama(
                LlamaConfig(hidden=32, heads=4, kv_heads=2, intermediate=48, layers=1, max_seq=8, vocab=20), 1, 1
            ),
            processors=4,
        )
    ).source
    first = compile_cubin(src, "sm_80")
    entries = list((tmp_path / "cubin").glob("*.cubin"))
    assert len(entries) == 1
    assert compile_cubin(src, "sm_80") == first
    entries[0].write_bytes(b"garbage")  # a corrupt entry is rebuilt
    assert compile_cubin(src, "sm_80") == first
    with pytest.raises(ml.errors.MegaloopError, match="unsupported architecture"):
        compile_cubin(src, "sm_70")


def tensor_core_graph(dtype: str) -> ml.Graph:
    """Matmuls the tensor-core path takes (K contiguous on both sides, odd edges, a broadcast batch,
    a K that is not a multiple of the 32-wide slice) and ones it must leave to the SIMT path."""
    g = ml.Graph(f"mma-{dtype}")
    x = g.input("x", (3, 40, 72), dtype)
    w = g.parameter("w", (24, 72), dtype)
    g.output("xw", ml.matmul(x, w, transpose_b=True))  # batched, B broadcast: tensor cores
    a = g.input("a", (200, 136), dtype)
    b = g.input("b", (144, 136), dtype)
    g.output("ab", ml.matmul(a, b, transpose_b=True))  # tiles larger than 128 x 128: several sub-tiles
    g.output("kn", ml.matmul(a, g.input("kn_b", (136, 48), dtype)))  # B is K-major rows: SIMT
    g.output("row", ml.matmul(g.input("v", (1, 136), dtype), b, transpose_b=True))  # one row: SIMT
    return g


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_tensor_core_matmul_is_chosen_where_it_applies_and_compiles(dtype: str) -> None:
    tiles = {"matmul": {"tensor_cores": 1, "block_m": 256, "block_n": 256}}
    plan = make_plan(tensor_core_graph(dtype), processors=1, tiles=tiles)  # one processor: tiles stay wide
    program = generate(plan)
    mma = "\n".join(c for c in program.signatures if "matmul" in c)
    src = program.source
    # sm_90: the 200 x 144 product on warpgroup MMA (128 x 256 blocks), the 40-row one on mma.sync
    assert (
        src.count("ml::wgmma_tile<") == 1
        and "ml::wgmma_tile<ml::" + ("f16" if dtype == "float16" else "bf16") + ", 256, 2, 4>" in src
    ), mma
    assert src.count("ml::mma_tile<") == 1, mma
    assert program.shared_bytes >= 4 * (128 + 256) * 64 * 2  # four stages of 128-row A and 256-row B slices
    assert compile_cubin(src, "sm_90a", use_cache=False)[:4] == b"\x7fELF"
    ampere = generate(make_plan(tensor_core_graph(dtype), processors=1, tiles=tiles, arch="sm_80")).source
    assert ampere.count("ml::mma_tile<") == 2 and "wgmma" not in ampere.split("megaloop_loop")[-1]
    assert compile_cubin(ampere, "sm_80", use_cache=False)[:4] == b"\x7fELF"
    with pytest.raises(CompileError, match=r"warpgroup MMA .* arch=.sm_80."):
        compile_cubin(src, "sm_80", use_cache=False)  # an sm_90 plan on an older GPU: said in words
    no_wgmma = generate(
        make_plan(tensor_core_graph(dtype), processors=1, tiles={"matmul": {**tiles["matmul"], "wgmma": 0}})
    )
    assert no_wgmma.source.count("ml::mma_tile<") == 2 and "ml::wgmma_tile<" not in no_wgmma.source
    off = generate(make_plan(tensor_core_graph(dtype), processors=4, tiles={"matmul": {"tensor_cores": 0}})).source
    assert "ml::mma_tile<" not in off and "ml::wgmma_tile<" not in off, "tensor cores are off with the switch off"


def test_wgmma_header_is_generated_from_the_script() -> None:
    """megaloop/wgmma_ops.cuh is written by scripts/gen_wgmma_ops.py; an edit by hand would be lost."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_wgmma_ops", ROOT / "scripts" / "gen_wgmma_ops.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert gen.HEADER.read_text() == gen.render(), "run: python scripts/gen_wgmma_ops.py"


@pytest.mark.parametrize("rows, cols, want", [(4096, 4096, (128, 256)), (200, 64, (128, 64)), (64, 100, (64, 128))])
def test_wgmma_blocks_and_stages_fit_the_plan(rows: int, cols: int, want: tuple[int, int]) -> None:
    """Block size from the tile, stages from the plan's shared memory (fewer where it is short, then
    narrower blocks), warpgroups from the warps; tiles below 64 x 64 stay on mma.sync."""
    from megaloop.codegen.emit import Operand
    from megaloop.codegen.emit_matmul import wgmma_config

    bf = ml.as_dtype("bfloat16")
    a_, b_ = Operand(bf, (rows, 512), (512, 1)), Operand(bf, (cols, 512), (512, 1))
    attrs = {"transpose_a": False, "transpose_b": True}
    hints = {"tensor_cores": 1, "wgmma": 1, "arch": "sm_90", "tile": (rows, cols), "shared_memory": 227 * 1024}
    hints["aligned"] = 1  # both operands on 16 bytes (the plan's offsets)
    bm, bn = want
    got = wgmma_config({**attrs, "codegen": {**hints, "warps": 4 * (bm // 64)}}, a_, b_)
    assert got is not None and got[0] == bn and got[1] == bm // 64
    assert got[2] == 4
    short = wgmma_config({**attrs, "codegen": {**hints, "warps": 8, "shared_memory": 120 * 1024}}, a_, b_)
    assert short is not None and short[2] * (128 + short[0]) * 128 + 1024 <= 112 * 1024 and short[2] >= 3
    for off in (
        {"arch": "sm_80"},
        {"wgmma": 0},
        {"warps": 2},
        {"tile": (32, cols)},
        {"tile": (rows, 32)},
        {"aligned": 0},
    ):
        assert wgmma_config({**attrs, "codegen": {**hints, "warps": 8, **off}}, a_, b_) is None, off


FEW_ROW_SHAPES = {2: 4096, 5: 1000, 8: 4104, 16: 520}  # rows: K (not always a multiple of the pack stride)


def few_row_matmul_graph(dtype: str) -> ml.Graph:
    """Matmuls of 2..16-row tiles (the warp-per-column path; 16 rows of 16-bit types go to the tensor
    cores when switched on) and a batched one with 7 rows."""
    g = ml.Graph(f"few-rows-{dtype}")
    for m, k in FEW_ROW_SHAPES.items():
        x = g.input(f"x{m}", (m, k), dtype)
        g.output(f"y{m}", ml.matmul(x, g.parameter(f"w{m}", (700, k), dtype), transpose_b=True))
    xb = g.input("xb", (3, 7, 264), dtype)
    g.output("yb", ml.matmul(xb, g.parameter("wb", (3, 96, 264), dtype), transpose_b=True))
    return g


SKINNY_MMA_SHAPES = {
    "x1": (1, 4096, 700),
    "x3": (3, 2048, 96),
    "x8": (8, 8192, 520),
    "x5": (5, 1024, 4104),
    "xb": ((1, 3), 2048, 200),  # batch axes of size 1 (a decode step's [batch, tokens, hidden])
}


def skinny_mma_graph(dtype: str) -> ml.Graph:
    """Matmuls of at most 8-row tiles with K a multiple of 32 (rows, K, columns): the skinny tensor-core
    path; 700, 4104 and 200 columns leave a partial group of 8, 96 columns on 132 processors make
    tiles of one group (K shared by the warps)."""
    g = ml.Graph(f"skinny-mma-{dtype}")
    for name, (m, k, n) in SKINNY_MMA_SHAPES.items():
        x = g.input(name, (*m, k) if isinstance(m, tuple) else (m, k), dtype)
        g.output(f"y{name}", ml.matmul(x, g.parameter(f"w{name}", (n, k), dtype), transpose_b=True))
    return g


def emulate_mma_skinny(a: np.ndarray, b: np.ndarray, s_begin: int, s_end: int) -> np.ndarray:
    """What ml::mma_skinny computes for one warp (A: rows x K, B: 8 columns x K), by the PTX ISA's
    m16n8k16 fragment layout (a0 = A[g][2q, 2q+1], a1 = A[g+8][..], a2 = A[g][2q+8, 2q+9], a3 =
    A[g+8][2q+8, ..]; b0 = B[2q, 2q+1][g], b1 = B[2q+8, 2q+9][g]) fed the way the template feeds it."""
    nr = a.shape[0]
    c = np.zeros((16, 8))
    for s in range(s_begin, s_end):
        for half in range(2):  # the two mmas of a slice
            fa, fb = np.zeros((16, 16)), np.zeros((16, 8))  # the mma's A (m x k slots) and B (k slots x n)
            for lane in range(32):
                g, q = lane // 4, lane % 4
                w = a[min(g, nr - 1), 32 * s + 8 * q : 32 * s + 8 * q + 8]  # the lane's 16-byte loads
                v = b[g, 32 * s + 8 * q : 32 * s + 8 * q + 8]
                words_a = [w[4 * half : 4 * half + 2], w[4 * half + 2 : 4 * half + 4]]  # a0, a2 (a1 = a3 = 0)
                words_b = [v[4 * half : 4 * half + 2], v[4 * half + 2 : 4 * half + 4]]  # b0, b1
                fa[g, 2 * q : 2 * q + 2], fa[g, 2 * q + 8 : 2 * q + 10] = words_a
                fb[2 * q : 2 * q + 2, g], fb[2 * q + 8 : 2 * q + 10, g] = words_b
            c += fa @ fb
    return c[:nr]


def test_skinny_mma_fragments_cover_k_once() -> None:
    """The template's assignment of K to fragment slots, under the documented layout, gives A @ B.T."""
    rng = np.random.default_rng(3)
    for nr, k in ((1, 64), (5, 128), (8, 96)):
        a, b = rng.standard_normal((nr, k)), rng.standard_normal((8, k))
        got = emulate_mma_skinny(a, b, 0, k // 32)
        parts = emulate_mma_skinny(a, b, 0, 1) + emulate_mma_skinny(a, b, 1, k // 32)  # K split in two parts
        np.testing.assert_allclose(got, a @ b.T, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(parts, a @ b.T, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype,warps", [("bfloat16", 8), ("float16", 8), ("bfloat16", 12)])
def test_skinny_mma_path_is_taken_when_switched_on_and_compiles(dtype: str, warps: int) -> None:
    """Taken for every <= 8-row tile with K a multiple of 32 when switched on, never when off; compiles
    without spills (at 12 warps, fewer slices in flight; at 16 the SIMT few-row path spills already),
    its partial sums in the dynamic shared memory the kernel reserves (a slot per run of a group in a
    warp: groups of the widest tile + warps - 1); weights (parameters) read under L2's evict_first policy."""
    from megaloop.runtime.compile import spills

    on_tiles = {"matmul": {"skinny_mma": 1}}
    plan = make_plan(skinny_mma_graph(dtype), processors=132, warps=warps, tiles=on_tiles, options=NO_RING)
    program = generate(plan)
    on = program.source
    off_tiles = {"matmul": {"skinny_mma": 0}}
    off = generate(
        make_plan(skinny_mma_graph(dtype), processors=132, warps=warps, tiles=off_tiles, options=NO_RING)
    ).source
    assert on.count("at most 8 rows: tensor cores") == len(SKINNY_MMA_SHAPES)
    assert on.count(", true>(in0 + ab") == len(SKINNY_MMA_SHAPES)  # the weights are parameters: streamed
    assert "at most 8 rows: tensor cores" not in off
    widest = max(t.writes[0].box.hi[-1] - t.writes[0].box.lo[-1] for t in plan.ranks[0].tasks)
    assert program.shared_bytes >= 4 * 64 * (-(-widest // 8) + warps - 1)
    assert spills(on) == {}
    for arch in ("sm_90a", "sm_80") if warps == 8 else ("sm_90a",):
        assert compile_cubin(on, arch, use_cache=False)[:4] == b"\x7fELF"


def test_llama_decode_matmuls_take_the_skinny_path_with_streamed_weights() -> None:
    """Every matmul of a batch-1 Llama decode step ([1, 1, hidden] rows against 2-D weights) runs on the
    skinny tensor-core path with its weights under evict_first: until 43e593d the step's 3-D rows fell
    to the per-element path without anyone noticing, and without the policy that path took 99 / 163 us
    a step on an H200 instead of 76 / 148 (docs/runtime.md). With the weight ring (the default) every
    one of them takes its weights from the ring instead (tests/test_ring.py checks its tables)."""
    cfg = LlamaConfig(hidden=256, heads=4, kv_heads=2, intermediate=512, layers=2, max_seq=64, vocab=100)
    for options, marks in (
        (NO_RING, ("at most 8 rows: tensor cores", ", true>(in0 + ab")),
        (None, ("ml::ring_matvec<",)),
    ):
        apart = ml.FuseOptions(off=("rmsnorm_linear", "swiglu_linear", "attention_append", "split_k_linear"))
        src = generate(make_plan(build_llama(cfg, 1, 1), processors=132, options=options, fusion=apart)).source
        matmuls = [f for f in re.split(r"\n// sig_\d+: ", src) if f.startswith("matmul ")]  # a function a signature
        assert len(matmuls) >= 4  # q / o, k / v, gate / up, down, the head: shapes that differ
        for body in matmuls:
            for mark in marks:
                assert mark in body, (mark, body.splitlines()[0])


def test_skinny_mma_leaves_batches_of_several_to_the_per_element_path() -> None:
    """Over a batch of 2 with a tile per batch index (fold_batch=0: each tile reads the whole weight
    block) the skinny path is not taken; at batch 1, or batch 2 folded into one tile's rows (the
    default), it is, its weights streamed (read once)."""
    for batch, fold, taken in ((2, 0, False), (1, 0, True), (2, 1, True)):
        g = ml.Graph("batched-decode")
        x = g.input("x", (batch, 1, 1024), "bfloat16")
        g.output("y", ml.matmul(x, g.parameter("w", (256, 1024), "bfloat16"), transpose_b=True))
        tiles = {"matmul": {"fold_batch": fold}}
        src = generate(make_plan(g, processors=16, tiles=tiles, options=NO_RING)).source
        assert ("at most 8 rows: tensor cores" in src) == taken, batch
        assert (", true>(in0 + ab" in src) == taken, batch


def emulate_skinny_task(a: np.ndarray, b: np.ndarray, warps: int) -> np.ndarray:
    """A whole skinny tile as the emitted code runs it: warp w takes units [w L / W, (w + 1) L / W) of
    the groups x slices (group-major), writing its sum at the end of each run of a group (mma_skinny);
    then each group's sums are added over the warps ml::skinny_sums selects, in warp order. Asserts
    that every unit is multiplied once, that each run has a slot (group + warp) of its own and that
    skinny_sums reads exactly the partial sums written."""
    nr, k = a.shape
    ncols = b.shape[0]
    slices, groups = k // 32, -(-ncols // 8)
    units = groups * slices
    written: dict[tuple[int, int], np.ndarray] = {}
    seen = np.zeros(units, int)
    for w in range(warps):
        lo, hi = w * units // warps, (w + 1) * units // warps
        c = np.zeros((nr, 8))
        for i in range(lo, hi):
            grp, sl = divmod(i, slices)
            cols = b[np.minimum(8 * grp + np.arange(8), ncols - 1)]  # past the tile: a real column
            c += emulate_mma_skinny(a, cols, sl, sl + 1)
            seen[i] += 1
            if sl == slices - 1 or i == hi - 1:
                assert (grp, w) not in written
                written[(grp, w)], c = c, np.zeros((nr, 8))
    assert (seen == 1).all()
    slots = [grp + w for grp, w in written]  # the shared-memory slot of each run: its own, fewer than G + W
    assert len(set(slots)) == len(slots) and max(slots) < groups + warps - 1
    out = np.zeros((nr, groups * 8))
    for grp in range(groups):
        read = []
        for w in range(warps):  # skinny_sums' test
            lo, hi = w * units // warps, (w + 1) * units // warps
            if lo < hi and lo < (grp + 1) * slices and hi > grp * slices:
                read.append(w)
                out[:, 8 * grp : 8 * grp + 8] += written[(grp, w)]
        assert sorted(read) == sorted(w for g_, w in written if g_ == grp)
    return out[:, :ncols]


@pytest.mark.parametrize("warps", [8, 12])
def test_skinny_mma_warps_share_units_evenly_and_sum_every_part(warps: int) -> None:
    """The emitted split of a tile's (column group, K slice) units over the warps, replayed with the
    fragment emulation: A @ B.T for column counts that leave partial groups and fewer units than warps,
    each unit multiplied once, every warp's share within one unit of the others."""
    rng = np.random.default_rng(4)
    cases = ((1, 32, 8), (1, 64, 3), (3, 96, 24), (8, 128, 9), (2, 256, 48), (5, 64, 100), (1, 32, 256), (2, 1024, 88))
    for nr, k, ncols in cases:
        a, b = rng.standard_normal((nr, k)), rng.standard_normal((ncols, k))
        got = emulate_skinny_task(a, b, warps)
        np.testing.assert_allclose(got, a @ b.T, rtol=1e-12, atol=1e-12)
        units = -(-ncols // 8) * (k // 32)
        shares = [(w + 1) * units // warps - w * units // warps for w in range(warps)]
        assert max(shares) - min(shares) <= 1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_few_row_matmuls_take_the_warp_per_column_path_and_compile(dtype: str) -> None:
    """Tiles of 2..16 rows take the warp-per-column path, except 16-bit ones of 16 rows, which the plan
    gives to tensor cores alone (one path a tile, picked from the plan's offsets and block)."""
    src = generate(make_plan(few_row_matmul_graph(dtype), processors=132, options=NO_RING)).source
    mma = 0 if dtype == "float32" else 1  # the 16-row product
    assert src.count("a warp per column") == 5 - mma, src.count("a warp per column")
    assert src.count("// tensor cores:") == mma
    for arch in ("sm_90a", "sm_80"):
        assert compile_cubin(src, arch, use_cache=False)[:4] == b"\x7fELF"


# name: (op, dtype, shape); the weights are [shape[-1]]
LONG_ROW_CASES = {
    "rms": ("rmsnorm", "bfloat16", (301, 2056)),
    "soft": ("softmax", "float16", (77, 4104)),
    "logsoft": ("log_softmax", "bfloat16", (45, 3000)),
    "ln": ("layernorm", "float32", (33, 8188)),  # 32 KB rows: at most 3 in the ring
    "ln_big": ("layernorm", "bfloat16", (9, 32768)),  # 16 packs a thread, 64 KB rows: at most 2 in the ring
}


def long_row_op(op: str, x, w):
    if op == "rmsnorm":
        return ml.rmsnorm(x, w, eps=1e-6)
    if op == "softmax":
        return ml.softmax(x * 3.0, -1)
    if op == "log_softmax":
        return ml.log_softmax(x, -1)
    return ml.layernorm(x, w, w, eps=1e-5)


def long_rows_graph() -> ml.Graph:
    """Normalisations over rows of >= 128 packs (a block per row), several rows to a task."""
    g = ml.Graph("long-rows")
    for name, (op, dtype, shape) in LONG_ROW_CASES.items():
        x = g.input(f"{name}_x", shape, dtype)
        w = g.input(f"{name}_w", shape[-1:], dtype)
        y = long_row_op(op, x, w)
        g.output(name, y)
    return g


def test_long_rows_take_the_block_per_row_path_and_compile() -> None:
    src = generate(make_plan(long_rows_graph(), processors=2)).source
    layouts = re.findall(r"// (a block|\d+ groups of \d+ threads) per row, (\d+) pack\(s\) of \d+ a thread", src)
    # groups of warps, each on rows of its own, where a thread then holds at most 8 packs and each group
    # has two ring slots (softmaxes: 16 packs, one slot): 2056 bf16 (257 packs, not a multiple of the
    # group) on 64 threads, 4104 fp16 on 64, 3000 bf16 on 64 (tasks of 5 and 8 rows: 8 slots, 2 a
    # group); the layernorms a whole block
    assert layouts == [
        ("4 groups of 64 threads", "5"),
        ("4 groups of 64 threads", "9"),
        ("4 groups of 64 threads", "6"),
        ("a block", "8"),
        ("a block", "16"),
    ]
    rings = [int(r) for r in re.findall(r"(\d+) rows streaming through shared memory", src)]
    # slots: at most 8, 96 KB or two rows, and no more than a task has rows (the layernorms: tasks of 6
    # rows of 32 KB and of 2 rows of 64 KB)
    assert rings == [8, 8, 8, 3, 2]
    wide = {"layernorm": {"elements": 1 << 17}}  # layernorm tasks of 4 rows: the ring's limits by row size
    big = generate(make_plan(long_rows_graph(), processors=2, tiles=wide)).source
    rings = [int(r) for r in re.findall(r"(\d+) rows streaming through shared memory", big)]
    assert rings == [8, 8, 8, 3, 2]  # 32 KB rows: 3 in 96 KB; 64 KB rows: 2
    rtx = generate(make_plan(long_rows_graph(), processors=2, arch="sm_86", tiles=wide)).source
    rings = [int(r) for r in re.findall(r"(\d+) rows streaming through shared memory", rtx)]
    assert rings == [8, 8, 8, 2, 1]  # 99 KB of shared memory: one 64 KB row at a time
    for arch in ("sm_90a", "sm_80"):
        assert compile_cubin(src, arch, use_cache=False)[:4] == b"\x7fELF"
    assert compile_cubin(big, "sm_90a", use_cache=False)[:4] == b"\x7fELF"
    assert compile_cubin(rtx, "sm_86", use_cache=False)[:4] == b"\x7fELF"


@pytest.mark.parametrize("warps", [12, 24])
def test_row_groups_of_any_warp_count_compile(warps: int) -> None:
    """Blocks of a warp count that is not a power of two: the group reductions combine the warps in
    order instead of by butterfly (a group of 12 warps once failed a static_assert)."""
    g = ml.Graph("odd-warps")
    for name, rows in (("one", 1), ("many", 64)):  # one row: the whole block; 64 rows: groups of warps
        x = g.input(f"{name}_x", (rows, 4096), ml.bfloat16)
        w = g.input(f"{name}_w", (4096,), ml.bfloat16)
        g.output(f"{name}_soft", ml.softmax(x, -1))
        g.output(f"{name}_rms", ml.rmsnorm(x, w))
    src = generate(make_plan(g, processors=2, warps=warps)).source
    assert re.search(r"a block per row", src) and re.search(r"groups of \d+ threads per row", src)
    assert compile_cubin(src, "sm_90a", use_cache=False)[:4] == b"\x7fELF"


def test_llama_and_exchange_kernels_spill_no_registers() -> None:
    """Spills are silent local-memory traffic in every task: the decode and 16-token Llama kernels,
    the long-rows kernel, the packed exchanges and the 8-token TP MLP must compile without any (undefined pack arrays
    once made ptxas spill up to 224 B a function)."""
    from megaloop.runtime.compile import spills

    cfg = LlamaConfig(hidden=2048, heads=16, kv_heads=4, intermediate=5504, layers=1, max_seq=1040, vocab=None)
    kernels = {
        f"llama {tokens} token(s)": generate(make_plan(build_llama(cfg, 1, tokens), processors=132)).source
        for tokens in (1, 16)
    }
    kernels["long rows"] = generate(make_plan(long_rows_graph(), processors=2)).source
    kernels["packed exchanges"] = generate(make_plan(packed_exchange_graphs(2), processors=4), 0).source
    from bench.tp_mlp import HIDDEN, plan_of  # the few-row matmul path at 8 tokens, K = 4096 and 8192

    tp = plan_of(8, "fused", np.zeros((8, HIDDEN), np.float32))
    kernels["TP MLP 8 tokens"] = generate(tp, 0).source
    found = {name: spills(src) for name, src in kernels.items()}
    assert not any(found.values()), f"register spills (stores, loads bytes) per function: {found}"


def test_float32_matmul_never_takes_tensor_cores() -> None:
    plan = make_plan(tensor_core_graph("float32"), processors=4, tiles={"matmul": {"tensor_cores": 1}})
    assert "ml::mma_tile<" not in generate(plan).source


def test_tile_switch_takes_only_0_or_1() -> None:
    g = tensor_core_graph("bfloat16")
    with pytest.raises(errors.GraphBuildError, match="tensor_cores is a switch: 0 or 1, got 2"):
        make_plan(g, processors=4, tiles={"matmul": {"tensor_cores": 2}})


def test_compile_many_fills_the_cache_in_parallel(tmp_path, monkeypatch) -> None:
    from megaloop.runtime.compile import cache_entry, compile_many

    monkeypatch.setenv("MEGALOOP_CACHE", str(tmp_path))
    sources = [
        generate(make_plan(tensor_core_graph(d), processors=2, arch="sm_80")).source for d in ("float16", "bfloat16")
    ]
    cubins = compile_many(sources + sources[:1], "sm_80", workers=2)
    assert len(cubins) == 3 and all(c[:4] == b"\x7fELF" for c in cubins) and cubins[0] == cubins[2]
    assert all(cache_entry(s, "sm_80") is not None for s in sources)


def test_tensor_core_constants_match_the_header() -> None:
    """emit_matmul sizes shared memory and picks tiles with mma.cuh's constants: they must agree."""
    from megaloop.codegen import emit_matmul
    from megaloop.runtime.compile import INCLUDE

    header = (INCLUDE / "megaloop" / "mma.cuh").read_text()
    for name in ("MMA_BK", "MMA_LD", "MMA_STAGES", "MMA_MAX_FRAGMENTS"):
        found = re.search(rf"constexpr int {name} = ([^;]+);", header)
        assert found, f"{name} not in mma.cuh"
        value = eval(found.group(1), {"MMA_BK": emit_matmul.MMA_BK})  # e.g. "MMA_BK + 8"
        assert value == getattr(emit_matmul, name), f"{name}: mma.cuh {value}, emit_matmul {getattr(emit_matmul, name)}"


@pytest.mark.parametrize("warps", [1, 2, 4, 8, 16, 32])
def test_tensor_core_tiles_keep_accumulators_in_registers(warps: int) -> None:
    from megaloop.codegen.emit import Operand
    from megaloop.codegen.emit_matmul import MMA_MAX_FRAGMENTS, mma_config

    a, b = Operand(ml.bfloat16, (512, 1024), (1024, 1)), Operand(ml.bfloat16, (1024, 1024), (1024, 1))
    hints = {"tensor_cores": 1, "tile": (128, 128), "warps": warps, "aligned": 1}
    bm, bn, wm, wn = mma_config({"transpose_a": False, "transpose_b": True, "codegen": hints}, a, b)
    assert wm * wn == warps and (bm // 16 // wm) * (bn // 8 // wn) <= MMA_MAX_FRAGMENTS


def attention_mma_warps(src: str) -> list[int]:
    """Each ml::attention call's tensor-core warps a unit (attention.cuh's Mma: 0 where the tile has no
    tensor-core path)."""
    calls = r"ml::attention<ml::AttnShape<[^>]*>, (\d+), (?:true|false)(?:, ml::Lanes<[^>]*>)?>"
    return [int(m[1]) for m in re.finditer(calls, src)]


@pytest.mark.parametrize(
    "dtype, d, tq, taken",
    [
        ("bfloat16", 64, 64, True),
        ("float16", 128, 40, True),
        ("float32", 64, 64, False),
        ("bfloat16", 64, 8, False),
        ("bfloat16", 40, 64, False),
    ],
)
def test_attention_blocks_take_tensor_cores_where_they_apply(dtype: str, d: int, tq: int, taken: bool) -> None:
    """16-bit heads of 16..128 (steps of 16) in blocks of 16 queries or more run ml::attention_mma; the
    kernel compiles for Hopper and Ampere without spills and sizes its shared memory for two K/V stages."""
    from megaloop.codegen.emit_attention import attention_mma_bytes
    from megaloop.runtime.compile import spills

    g = ml.Graph(f"attn-{dtype}")
    q = g.input("q", (1, 8, tq, d), dtype)
    k = g.input("k", (1, 2, 300, d), dtype)
    v = g.input("v", (1, 2, 300, d), dtype)
    g.output("y", ml.attention(q, k, v, causal=True))
    for arch in ("sm_90", "sm_80"):
        program = generate(make_plan(g, processors=132, arch=arch))
        assert (max(attention_mma_warps(program.source)) > 0) == taken
        if taken:
            assert program.shared_bytes >= attention_mma_bytes(d)
            assert spills(program.source, arch + ("a" if arch == "sm_90" else "")) == {}


@pytest.mark.parametrize("arch, d, split", [("sm_90", 128, 2), ("sm_86", 128, 1), ("sm_86", 64, 2), ("sm_80", 128, 2)])
def test_attention_blocks_pair_warps_where_shared_memory_holds_two_key_blocks(arch: str, d: int, split: int) -> None:
    """attention_mma<T, D, SPLIT> (ml::attention's Mma argument): SPLIT 2 (a unit's keys over two warps)
    where the plan's shared memory holds stages of two K and V blocks (an RTX card's 99 KB does not at
    head 128), and the kernel's dynamic shared memory covers the layout it picked."""
    from megaloop.codegen.emit_attention import attention_mma_bytes

    g = ml.Graph(f"attn-split-{arch}-{d}")
    q = g.input("q", (1, 4, 64, d), "bfloat16")
    k = g.input("k", (1, 1, 200, d), "bfloat16")
    v = g.input("v", (1, 1, 200, d), "bfloat16")
    g.output("y", ml.attention(q, k, v, causal=True))
    program = generate(make_plan(g, processors=132, arch=arch))
    assert attention_mma_warps(program.source) == [split]
    assert re.search(rf"ml::attention<ml::AttnShape<4, 64, 200, {d}, {d}, true, 0>, {split}, true>\(", program.source)
    assert program.shared_bytes >= attention_mma_bytes(d, split)


def test_attention_blocks_keep_to_their_registers_and_shared_memory() -> None:
    """More than 8 warps (__launch_bounds__ leaves too few registers: 16 warps spilled 0.5 KB a thread),
    a plan whose shared memory cannot hold the K/V stages, and the split form keep the other paths."""
    g = ml.Graph("attn-limits")
    q = g.input("q", (1, 8, 64, 128), "bfloat16")
    k = g.input("k", (1, 2, 300, 128), "bfloat16")
    g.output("y", ml.attention(q, k, k, causal=True))
    assert attention_mma_warps(generate(make_plan(g, processors=132)).source) == [2]
    assert attention_mma_warps(generate(make_plan(g, processors=132, warps=16)).source) == [0]
    assert attention_mma_warps(generate(make_plan(g, processors=132, shared_memory=64 * 1024)).source) == [0]
    split = ml.Graph("attn-split")
    q2 = split.input("q", (1, 8, 64, 128), "bfloat16")
    k2 = split.input("k", (1, 2, 300, 128), "bfloat16")
    split.output("y", ml.attention(q2, k2, k2, causal=True, kv_splits=2))
    src = generate(make_plan(split, processors=132)).source
    assert "ml::attention_partial<" in src and attention_mma_warps(src) == []


def test_kernel_options_are_the_plans_and_change_only_their_defines() -> None:
    """KernelOptions (saved in the plan): 128 waits copied into each task slot ahead instead of 16,
    shorter sleeps between polls or none; the kernel differs from the default's only in its defines,
    compiles without spills, and the plan file carries the options back."""
    import dataclasses

    from bench.llama_layer import dependent_decode_graph, layer_config
    from megaloop.runtime.compile import spills

    cfg = layer_config(2048, 1)
    g = dependent_decode_graph(cfg, np.zeros((1, 1, 2048), np.float32), "auto")
    plan = make_plan(g, processors=132)
    default = generate(plan).source
    assert "#define ML_SLOT_WAITS 16\n#define ML_POLL_SLEEP_NS 0\n" in default
    for options in (KernelOptions(slot_waits=128), KernelOptions(poll_sleep_ns=256), KernelOptions(poll_sleep_ns=64)):
        other = dataclasses.replace(plan, options=options)
        src = generate(other).source
        defines = f"#define ML_SLOT_WAITS {options.slot_waits}\n#define ML_POLL_SLEEP_NS {options.poll_sleep_ns}\n"
        assert defines in src
        assert src.replace(defines, "#define ML_SLOT_WAITS 16\n#define ML_POLL_SLEEP_NS 0\n") == default
        assert spills(src) == {}


def test_kernel_options_round_trip_and_bad_ones_name_the_field(tmp_path) -> None:
    from megaloop.plan import KernelOptions, Plan

    g = ml.Graph("opts")
    x = g.input("x", (4, 64), "float32")
    g.output("y", ml.relu(x))
    plan = make_plan(g, processors=4, options=KernelOptions(slot_waits=32, poll_sleep_ns=64))
    plan.save(tmp_path / "p.json")
    loaded = Plan.load(tmp_path / "p.json")
    assert loaded.options == KernelOptions(slot_waits=32, poll_sleep_ns=64)
    assert generate(loaded).source == generate(plan).source
    # a file without poll_sleep_ns was built with the sleeps of 256 ns the default was then
    assert KernelOptions().poll_sleep_ns == 0
    old = json.loads((tmp_path / "p.json").read_text())
    del old["options"]["poll_sleep_ns"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert "#define ML_POLL_SLEEP_NS 256\n" in generate(Plan.load(tmp_path / "old.json")).source
    with pytest.raises(errors.GraphBuildError, match=r"options\.slot_waits: must be an int in \[1, 128\], got 0"):
        make_plan(g, processors=4, options=KernelOptions(slot_waits=0))
    data = json.loads((tmp_path / "p.json").read_text())
    data["options"]["poll_sleep"] = 3
    (tmp_path / "q.json").write_text(json.dumps(data))
    with pytest.raises(errors.PlanFormatError, match=r"plan\.options: unknown option 'poll_sleep'"):
        Plan.load(tmp_path / "q.json")
    data["version"] = 1
    (tmp_path / "q.json").write_text(json.dumps(data))
    with pytest.raises(errors.PlanFormatError, match=r"version 1 \(made by an older megaloop"):
        Plan.load(tmp_path / "q.json")


@pytest.mark.parametrize(
    "dtype,hidden,packed", [("bfloat16", 2048, True), ("float32", 64, True), ("bfloat16", 12, False)]
)
def test_embedding_copies_rows_in_packs(dtype: str, hidden: int, packed: bool) -> None:
    """The token's row in 16-byte packs, each thread's id read with its packs (a Llama step's row of
    2048 values had each thread make 8 dependent trips element by element); rows of a width that is not
    whole packs take the per-element path; both keep the bad-id data error and compile without spills."""
    from megaloop.runtime.compile import spills

    g = ml.Graph("embedding")
    table = g.parameter("table", (1000, hidden), dtype)
    g.output("y", ml.embedding(table, g.input("tok", (2, 3), ml.int64)))
    src = generate(make_plan(g, processors=8)).source
    body = src[src.index("// sig_0") : src.index("\n}\n", src.index("// sig_0"))]
    assert ("packed path" in body) == packed
    assert "ml::embedding<1000, " in body and "(a, t, tid, " in body  # (its paths report a bad id with them)
    assert spills(src) == {}


def test_shared_memory_opt_in_counts_the_static_bytes() -> None:
    """A kernel opts in to more than 48 KiB of shared memory counting its static bytes too: 46.6 KB of
    dynamic (skinny tiles with 4 rows of A in shared memory) and ~3 KB static left no block resident
    on an H200 when only the dynamic bytes were compared with 48 KiB."""
    from megaloop.runtime.loop import needs_shared_opt_in

    assert needs_shared_opt_in(3400, 46592) and not needs_shared_opt_in(3400, 40000)
    assert needs_shared_opt_in(0, 48 * 1024 + 1) and not needs_shared_opt_in(0, 48 * 1024)


def test_skinny_rounds_feed_the_mma_without_repacking() -> None:
    """The decode matmul's loop in machine code (nvdisasm): two rounds of 8 units of B loaded as 32-bit
    words, each multiplied while the other is in flight. Loaded as packs of bf16 values, ptxas repacked
    every pack with PRMTs (122 in this kernel) where the next round moved into place, and each round
    waited there for the loads it had just issued: one round in flight, about 26 GB/s a processor."""
    from megaloop.runtime.compile import compile_cubin
    from tests.helpers import sass

    g = ml.Graph("decode-matmul")
    x = g.input("x", (1, 1, 2048), ml.bfloat16)
    g.output("y", ml.matmul(x, g.parameter("w", (2048, 2048), ml.bfloat16), transpose_b=True))
    plan = make_plan(g, processors=132, options=NO_RING)  # B through global loads
    code = sass(compile_cubin(generate(plan).source, "sm_90a", use_cache=False))
    assert code.count("PRMT") <= 8, code.count("PRMT")  # the output's conversions only
    assert code.count("LDG.E.128") >= 24  # B: the first round, then two rounds in the loop body

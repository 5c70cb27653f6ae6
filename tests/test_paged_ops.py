"""paged_attention and paged_kv_cache_update (megaloop/frontend/ops/paged.py) without a GPU.

(1) The reference against dense attention on each row's slot gathered (bit for bit) and the update
against a scatter written here; (2) the data rules name the row, slot, page or position; (3) the plan
interpreter, under random legal orders, gives the reference's bits; (4) the kernels compile for sm_90a
and sm_80; (5) the generated tile functions themselves run on the CPU through g++ (tests/test_attention_lanes.py's
shim for the CUDA headers: every thread of a block a coroutine, shuffles as the GPU's butterflies)
against the reference: the warp path (16-byte packs or elements) and the lanes tile over pages.
The op table (tests/op_table/caches.py) checks both ops against PyTorch float64 in every float dtype."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import megaloop as ml
from megaloop.codegen import generate
from megaloop.codegen.emit import Operand
from megaloop.codegen.emit_paged import paged_attention as emit_attention
from megaloop.codegen.emit_paged import paged_attention_shared_bytes, paged_lanes
from megaloop.codegen.emit_paged import paged_kv_update as emit_update
from megaloop.codegen.emit_paged import rope_paged_kv_update as emit_rope_update
from megaloop.frontend.ops.paged import PAGED_ATTENTION_TILING
from megaloop.frontend.tiling import Box, TileContext
from megaloop.plan import make_plan
from megaloop.reference.interpreter import run_plan
from megaloop.runtime.compile import compile_cubin
from tests.test_attention_lanes import WARPS, needs_cxx
from tests.test_attention_lanes import run_tiles as run_block

RNG = np.random.default_rng(7)


def case(dtype: str = "float32", slots: int = 3, per_slot: int = 4, page: int = 4, extra: int = 3, hkv: int = 2,
         group: int = 2, d: int = 8, rows: int = 9, window: int | None = None, seed: int = 0) -> dict:  # fmt: skip
    """A step's worth of paged attention: the page table a permutation of the pool, rows of random slots
    at distinct positions per slot (some unused), the pools filled at random."""
    rng = np.random.default_rng(seed)
    pages = slots * per_slot + extra
    table = rng.permutation(pages)[: slots * per_slot].reshape(slots, per_slot).astype(np.int64)
    slot = rng.integers(0, slots, (1, rows)).astype(np.int64)
    pos = np.full((1, rows), -1, np.int64)
    for s in range(slots):
        mine = np.nonzero(slot[0] == s)[0]
        pos[0, mine] = rng.permutation(per_slot * page)[: len(mine)]
    pos[0, rng.random(rows) < 0.2] = -1
    dt = ml.as_dtype(dtype)
    rnd = lambda shape: ml.dtypes.round_to(rng.standard_normal(shape), dt)
    return {
        "q": rnd((1, hkv * group, rows, d)), "k_new": rnd((1, hkv, rows, d)), "v_new": rnd((1, hkv, rows, d)),
        "k_pool": rnd((pages, hkv, page, d)), "v_pool": rnd((pages, hkv, page, d)), "table": table,
        "slots": slot, "positions": pos, "dtype": dt, "window": window,
    }  # fmt: skip


def step_graph(c: dict, rope: bool = False) -> ml.Graph:
    """The update of both pools, then attention over them (as in the serving step; with ``rope``, the
    key rotated at each row's position clamped at 0 first, as the serving step builds it)."""
    g = ml.Graph("paged")
    dt = c["dtype"]
    q = g.input("q", c["q"].shape, dt)
    kn, vn = g.input("k_new", c["k_new"].shape, dt), g.input("v_new", c["v_new"].shape, dt)
    table = g.state("table", c["table"].shape, "int64")
    slots, pos = g.input("slots", c["slots"].shape, "int64"), g.input("positions", c["positions"].shape, "int64")
    if rope:
        kn = ml.rope(kn, ml.maximum(pos, 0).reshape(1, 1, pos.shape[1]), theta=500.0)
    kp, vp = g.state("k_pool", c["k_pool"].shape, dt), g.state("v_pool", c["v_pool"].shape, dt)
    k_all = ml.paged_kv_cache_update(kp, kn, table, slots, pos)
    v_all = ml.paged_kv_cache_update(vp, vn, table, slots, pos)
    g.output("o", ml.paged_attention(q, k_all, v_all, table, slots, pos, window=c["window"]))
    return g


def feeds(c: dict) -> tuple[dict, dict]:
    return (
        {k: c[k] for k in ("q", "k_new", "v_new", "slots", "positions")},
        {"table": c["table"], "k_pool": c["k_pool"], "v_pool": c["v_pool"]},
    )


def scatter(pool: np.ndarray, new: np.ndarray, c: dict) -> np.ndarray:
    out = pool.copy()
    page = pool.shape[2]
    for t in range(c["slots"].shape[1]):
        p = int(c["positions"][0, t])
        if p >= 0:
            out[c["table"][c["slots"][0, t], p // page], :, p % page] = new[0, :, t]
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("window", [None, 3])
def test_reference_is_dense_attention_on_each_rows_slot(dtype: str, window: int | None) -> None:
    c = case(dtype, window=window, seed=1)
    got = ml.evaluate(step_graph(c), *feeds(c)[:1], state=feeds(c)[1])
    k_pool, v_pool = scatter(c["k_pool"], c["k_new"], c), scatter(c["v_pool"], c["v_new"], c)
    assert np.array_equal(got.state["k_pool"].view(np.uint8), k_pool.view(np.uint8))
    assert np.array_equal(got.state["v_pool"].view(np.uint8), v_pool.view(np.uint8))
    # each used row: ml.attention over its slot's keys gathered into one cache, its query alone
    page, per_slot = c["k_pool"].shape[2], c["table"].shape[1]
    for t in range(c["slots"].shape[1]):
        p, s = int(c["positions"][0, t]), int(c["slots"][0, t])
        row = got.outputs["o"][0, :, t]
        if p < 0:
            assert not row.astype(np.float32).any(), "an unused row gives zeros"
            continue
        g = ml.Graph("dense")
        hkv, d = c["k_pool"].shape[1], c["k_pool"].shape[3]
        q = g.input("q", (1, row.shape[0], 1, d), c["dtype"])
        k = g.input("k", (1, hkv, per_slot * page, d), c["dtype"])
        v = g.input("v", (1, hkv, per_slot * page, d), c["dtype"])
        qp = g.input("qp", (1, 1), "int64")
        g.output("o", ml.attention(q, k, v, causal=True, q_positions=qp, window=window))
        gathered = [pool[c["table"][s]].transpose(1, 0, 2, 3).reshape(1, hkv, -1, d) for pool in (k_pool, v_pool)]
        want = ml.evaluate(g, {"q": c["q"][:, :, t : t + 1], "k": gathered[0], "v": gathered[1],
                               "qp": np.array([[p]])}).outputs["o"][0, :, 0]  # fmt: skip
        assert np.array_equal(row.view(np.uint8), want.view(np.uint8)), f"row {t} (slot {s}, position {p})"


@pytest.mark.parametrize("seed", range(3))
def test_plan_interpreter_gives_the_references_bits(seed: int) -> None:
    c = case("bfloat16", slots=4, per_slot=3, page=2, rows=11, group=3, d=6, window=None if seed else 2, seed=seed)
    g = step_graph(c)
    want = ml.evaluate(g, feeds(c)[0], state=feeds(c)[1], iterations=2)
    plan = make_plan(g, processors=5, arch="sm_90")  # (verified as it is made)
    for order in range(3):
        got = run_plan(plan, feeds(c)[0], state=feeds(c)[1], iterations=2, seed=order)
        assert np.array_equal(got.outputs["o"].view(np.uint8), want.outputs["o"].view(np.uint8)), f"order {order}"
        for name in ("k_pool", "v_pool"):
            assert np.array_equal(got.state[name].view(np.uint8), want.state[name].view(np.uint8)), name


def test_tiles_take_whole_kv_heads_and_blocks_of_rows() -> None:
    c = case(rows=10, hkv=2, group=3)
    g = step_graph(c)
    node = next(n for n in g.nodes if n.op.name == "paged_attention")
    tiles = PAGED_ATTENTION_TILING.make(node, {"rounds": 1}, TileContext(0, 1, 16, warps=8))
    assert len(tiles) == 2 * 5  # kv heads x blocks of 8 // 3 = 2 rows
    out = np.zeros(node.outputs[0].shape, int)
    for tile in tiles:
        (w,) = tile.writes
        out[w.box.slices] += 1
    assert (out == 1).all(), "the tiles cover the output once"


def _data_error(c: dict, match: str) -> None:
    with pytest.raises(ml.errors.DataError, match=match):
        ml.evaluate(step_graph(c), feeds(c)[0], state=feeds(c)[1])


def test_data_rules_name_the_row_and_what_is_wrong() -> None:
    c = case(seed=2)
    t = int(np.argmax(c["positions"][0] >= 4))  # a used row past its slot's first page
    s = int(c["slots"][0, t])
    c["table"][s, int(c["positions"][0, t]) // 4] = -1
    _data_error(c, rf"row \(0, {t}\) writes through slot {s}'s page table entry .*, which is -1: not a page")
    c = case(seed=2)
    c["slots"][0, t] = 7
    _data_error(c, rf"slot 7 of row \(0, {t}\) is outside the page table's 3 slots")
    c = case(seed=2)
    c["positions"][0, t] = 16
    _data_error(c, rf"position 16 of row \(0, {t}\) is past the page table's reach: 4 pages of 4 positions")
    c = case(seed=2)
    used = np.nonzero(c["positions"][0] >= 0)[0]
    a, b = int(used[0]), int(used[1])
    c["slots"][0, b], c["positions"][0, b] = c["slots"][0, a], c["positions"][0, a]
    _data_error(c, rf"rows \(0, {a}\) and \(0, {b}\) both write page .*: one of the writes would be lost")


def test_attention_reads_only_pages_the_host_assigned() -> None:
    """A row reads its slot's pages up to its position: an unassigned entry there is an error, one past
    it is not read."""
    c = case(seed=3)
    t = int(np.argmax(c["positions"][0] >= 0))
    s, p = int(c["slots"][0, t]), int(c["positions"][0, t])
    mine = (c["slots"][0] == s) & (c["positions"][0] >= 0)
    c["table"][s, int(c["positions"][0][mine].max()) // 4 + 1 :] = -1  # past every row of the slot: fine
    ml.evaluate(step_graph(c), feeds(c)[0], state=feeds(c)[1])
    g = ml.Graph("read")
    q = g.input("q", c["q"].shape, c["dtype"])
    kp, vp = g.input("kp", c["k_pool"].shape, c["dtype"]), g.input("vp", c["v_pool"].shape, c["dtype"])
    tab, sl, pos = (g.input(n, c[n].shape, "int64") for n in ("table", "slots", "positions"))
    g.output("o", ml.paged_attention(q, kp, vp, tab, sl, pos))
    c["table"][s, p // 4] = -1
    with pytest.raises(ml.errors.DataError, match=rf"row \(0, {t}\) reads through slot {s}'s page table"):
        ml.evaluate(g, {"q": c["q"], "kp": c["k_pool"], "vp": c["v_pool"], "table": c["table"], "slots": c["slots"],
                        "positions": c["positions"]})  # fmt: skip


def test_shape_rules_name_the_operand() -> None:
    g = ml.Graph("bad")
    q = g.input("q", (1, 4, 3, 8), "float32")
    kp = g.state("kp", (5, 2, 4, 8), "float32")
    table = g.input("table", (2, 3), "int64")
    sl, pos = g.input("sl", (1, 3), "int64"), g.input("pos", (1, 2), "int64")
    with pytest.raises(ml.errors.ShapeError, match=r"positions must be an int tensor \[batch, tokens\] = \[1, 3\]"):
        ml.paged_attention(q, kp, kp, table, sl, pos)
    with pytest.raises(ml.errors.DtypeError, match="page_table must be an int tensor"):
        ml.paged_attention(q, kp, kp, g.input("f", (2, 3), "float32"), sl, sl)
    with pytest.raises(ml.errors.GraphBuildError, match="pool must be a state tensor"):
        ml.paged_kv_cache_update(g.input("notstate", (5, 2, 4, 8), "float32"), q[:, :2], table, sl, sl)
    with pytest.raises(ml.errors.ShapeError, match="heads \\(4\\) must be a multiple of kv_heads \\(3\\)"):
        ml.paged_attention(q, g.input("k3", (5, 3, 4, 8), "float32"), g.input("v3", (5, 3, 4, 8), "float32"), table,
                           sl, sl)  # fmt: skip


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_kernels_compile(arch: str) -> None:
    """head_dim 8: the warp path in 16-byte packs; 64: the lanes tile (the default options) and its fallback,
    and the key's write with its rope (fuse rule rope_paged_kv_cache_update)."""
    small = make_plan(step_graph(case("bfloat16", window=4)), processors=8, arch=arch.removesuffix("a"))
    source = generate(small).source
    assert "ml::paged_attention<2, 8, 8, 15, 4, 3, 4, 4, true, ml::NoLanes>" in source  # (packs of 8 dims)
    assert "ml::paged_kv_update<1, 9, 8, 15, 4, 3, 4>" in source
    assert compile_cubin(source, arch)
    wide = make_plan(step_graph(case("bfloat16", d=64, group=4, page=16), rope=True), processors=8,
                     arch=arch.removesuffix("a"))  # fmt: skip
    source = generate(wide).source
    assert "ml::paged_attention<4, 64, 64, 15, 16, 3, 4, 0, true, ml::Lanes<4, " in source
    assert "ml::paged_write<1, 9, 64, 15, 16, 3, 4, 64, true>(a, t, tid, inv_freq" in source  # (the key's rope inside)
    assert compile_cubin(source, arch)


# ---- the generated tiles on the CPU -----------------------------------------------------------------------

def _operand(a: np.ndarray, dtype: ml.DType) -> Operand:
    strides = [1] * a.ndim
    for d in range(a.ndim - 2, -1, -1):
        strides[d] = strides[d + 1] * a.shape[d + 1]
    return Operand(dtype, a.shape, tuple(strides))


@needs_cxx
@pytest.mark.parametrize(
    "dtype,window,d,shift,packs",
    [("float32", None, 40, 0, True), ("bfloat16", 3, 96, 0, True), ("float32", 5, 8, 0, True),
     ("bfloat16", None, 20, 0, False), ("bfloat16", 2, 16, 2, True)],
)  # fmt: skip
def test_generated_tiles_run_on_the_cpu(dtype: str, window: int | None, d: int, shift: int, packs: bool,
                                        tmp_path: Path) -> None:  # fmt: skip
    """head_dim 40, 8, 20 and 16: a lane a key; 96: two lanes a key (48 dims each). Keys and values in
    16-byte packs where a lane's dims are whole packs (not 20 bf16); the pools 2 bytes past a 16-byte
    boundary take the element path of a kernel built with packs."""
    c = case(dtype, window=window, d=d, rows=5, seed=4, per_slot=3, page=4)
    g = step_graph(c)
    want = ml.evaluate(g, feeds(c)[0], state=feeds(c)[1])
    dt, i64 = c["dtype"], ml.int64
    # the update of the k pool: a task a kv head, on the generated function
    ins = [c["k_pool"], c["k_new"], c["table"], c["slots"], c["positions"]]
    ops_ = [_operand(a, dt if a.dtype != np.int64 else i64) for a in ins]
    body = emit_update("paged_kv_cache_update", {}, ops_, ops_[0])
    boxes = [Box((0, h, 0, 0), (c["k_pool"].shape[0], h + 1, 4, d)) for h in range(c["k_pool"].shape[1])]
    got, info, _ = run_block(body, 0, tmp_path, [*ins, c["k_pool"].copy()], boxes, header="paged.cuh")
    assert info[0] == 0, info
    assert np.array_equal(got.view(np.uint8), want.state["k_pool"].view(np.uint8))
    # attention over the updated pools, a tile per (kv head, block of rows) as the tiling makes them
    node = next(n for n in g.nodes if n.op.name == "paged_attention")
    tiles = PAGED_ATTENTION_TILING.make(node, {"rounds": 1}, TileContext(0, 1, 4, warps=2))
    ins = [c["q"], want.state["k_pool"], want.state["v_pool"], c["table"], c["slots"], c["positions"]]
    ops_ = [_operand(a, dt if a.dtype != np.int64 else i64) for a in ins]
    out = np.zeros(want.outputs["o"].shape, want.outputs["o"].dtype)
    scale = node.attrs["scale"]
    body = emit_attention("paged_attention", {"window": window, "scale": scale}, ops_, _operand(out, dt))
    assert (", true, ml::NoLanes>(a, t, tid" in "".join(body)) == packs, body
    boxes = [t.writes[0].box for t in tiles]
    got, info, _ = run_block(body, 0, tmp_path / "attn", [*ins, out], boxes, shift, header="paged.cuh")
    assert info[0] == 0, info
    ref = want.outputs["o"].astype(np.float32)
    err = np.abs(got.astype(np.float32) - ref) / (np.abs(ref) + np.abs(ref).max())
    eps = 2.0**-23 if dtype == "float32" else 2.0**-8
    print(f"worst error {err.max() / eps:.2f} ulps of {dtype} (of |ref| + max |ref|)")
    assert err.max() <= 8 * eps, f"worst {err.max() / eps:.1f} ulps at {np.unravel_index(err.argmax(), err.shape)}"


@needs_cxx
@pytest.mark.parametrize(
    "dtype,window,d,group,misalign",
    [("bfloat16", None, 64, 4, 0), ("bfloat16", 50, 128, 2, 0), ("float32", None, 32, 1, 0), ("float16", 7, 64, 3, 0),
     ("bfloat16", 3, 128, 8, 0), ("bfloat16", None, 64, 2, 8)],
)  # fmt: skip
def test_the_lanes_tile_runs_on_the_cpu(dtype: str, window: int | None, d: int, group: int, misalign: int,
                                        tmp_path: Path) -> None:  # fmt: skip
    """The lanes-over-keys path (KernelOptions.decode_attention 1: the keys staged through the page table,
    several stages a row, rows of several slots in one tile), every thread of a block a coroutine
    (tests/test_attention_lanes.py's shim), against the reference; pools 8 bytes past a 16-byte boundary
    take the warp path of the same kernel."""
    c = case(dtype, window=window, d=d, group=group, rows=7, seed=5, per_slot=16, page=16)
    c["positions"][0, :2] = [0, 16]  # (a row's first key alone; a row whose key opens a page)
    g = step_graph(c)
    want = ml.evaluate(g, feeds(c)[0], state=feeds(c)[1])
    node = next(n for n in g.nodes if n.op.name == "paged_attention")
    tiles = PAGED_ATTENTION_TILING.make(node, {"rounds": 1}, TileContext(0, 1, 4, warps=WARPS))
    ins = [c["q"], want.state["k_pool"], want.state["v_pool"], c["table"], c["slots"], c["positions"]]
    dt, i64 = c["dtype"], ml.int64
    ops_ = [_operand(a, dt if a.dtype != np.int64 else i64) for a in ins]
    out = np.zeros(want.outputs["o"].shape, want.outputs["o"].dtype)
    attrs = {"window": window, "scale": node.attrs["scale"], "codegen": {"decode_attention": 1, "warps": WARPS}}
    lanes = paged_lanes(attrs, ops_)
    assert lanes is not None and 32 * lanes.blocks < 16 * 16, lanes  # (several stages for the late positions)
    body = emit_attention("paged_attention", attrs, ops_, _operand(out, dt))
    assert f"ml::Lanes<{group}, {lanes.blocks}, {lanes.row_split}>" in "".join(body), body
    shared = paged_attention_shared_bytes(attrs, ops_)
    boxes = [t.writes[0].box for t in tiles]
    assert any(b.hi[2] - b.lo[2] > 1 for b in boxes) or group > 4  # (a tile of several rows, one at a time)
    got, info, kept = run_block(body, shared, tmp_path, [*ins, out], boxes, misalign, header="paged.cuh")
    assert info[0] == 0, info
    assert kept, f"wrote shared memory past the {shared} bytes it asked for"
    ref = want.outputs["o"].astype(np.float32)
    err = np.abs(got.astype(np.float32) - ref) / (np.abs(ref) + np.abs(ref).max())
    eps = {"float32": 2.0**-23, "bfloat16": 2.0**-8, "float16": 2.0**-11}[dtype]
    print(f"worst error {err.max() / eps:.2f} ulps of {dtype} (of |ref| + max |ref|)")
    assert err.max() <= 8 * eps, f"worst {err.max() / eps:.1f} ulps at {np.unravel_index(err.argmax(), err.shape)}"


@needs_cxx
def test_the_lanes_tile_reports_a_page_out_of_range(tmp_path: Path) -> None:
    """A table entry of -1 where a row's keys live: the lanes path reports the page (DATA, PAGED_PAGE)."""
    c = case("bfloat16", d=64, group=4, rows=3, seed=2, per_slot=4, page=16)
    g = step_graph(c)
    want = ml.evaluate(g, feeds(c)[0], state=feeds(c)[1])
    row = int(np.argmax(c["positions"][0] >= 16))  # a row that reads its slot's first page
    assert c["positions"][0, row] >= 16
    table = c["table"].copy()
    table[c["slots"][0, row], 0] = -1
    node = next(n for n in g.nodes if n.op.name == "paged_attention")
    tiles = PAGED_ATTENTION_TILING.make(node, {"rounds": 1}, TileContext(0, 1, 4, warps=WARPS))
    ins = [c["q"], want.state["k_pool"], want.state["v_pool"], table, c["slots"], c["positions"]]
    ops_ = [_operand(a, c["dtype"] if a.dtype != np.int64 else ml.int64) for a in ins]
    out = np.zeros(want.outputs["o"].shape, want.outputs["o"].dtype)
    attrs = {"window": None, "scale": node.attrs["scale"], "codegen": {"decode_attention": 1, "warps": WARPS}}
    body = emit_attention("paged_attention", attrs, ops_, _operand(out, c["dtype"]))
    assert "ml::Lanes<" in "".join(body)
    shared = paged_attention_shared_bytes(attrs, ops_)
    _, info, _ = run_block(body, shared, tmp_path, [*ins, out], [t.writes[0].box for t in tiles], header="paged.cuh")
    assert info[0] == 2 and info[4] == -1 and info[6] == 4, info  # DATA: page -1 of PAGED_PAGE


@needs_cxx
@pytest.mark.parametrize("dtype,layout,rotary", [("bfloat16", "neox", None), ("float32", "interleaved", 6)])
def test_the_rotating_write_runs_on_the_cpu(dtype: str, layout: str, rotary: int | None, tmp_path: Path) -> None:
    """rope_paged_kv_cache_update's generated tile (a kv head a task, rows of several slots, an unused row)
    against its reference: within rope's 2 ulps (its float32 formula against the float64 reference),
    every place no row writes unchanged."""
    c = case(dtype, d=16, rows=6, seed=3, per_slot=3, page=4)
    c["positions"][0, 1] = -1  # (an unused row: rotated at 0 by the reference, written by neither)
    g = ml.Graph("rope-paged")
    dt = c["dtype"]
    pool = g.state("k_pool", c["k_pool"].shape, dt)
    table = g.state("table", c["table"].shape, "int64")
    new = g.input("k_new", c["k_new"].shape, dt)
    slots, pos = g.input("slots", c["slots"].shape, "int64"), g.input("positions", c["positions"].shape, "int64")
    ml.rope_paged_kv_cache_update(pool, new, table, slots, pos, theta=500.0, layout=layout, rotary_dim=rotary)
    feeds_ = {"k_new": c["k_new"], "slots": c["slots"], "positions": c["positions"]}
    want = ml.evaluate(g, feeds_, state={"k_pool": c["k_pool"], "table": c["table"]}).state["k_pool"]
    node = next(n for n in g.nodes if n.op.name == "rope_paged_kv_cache_update")
    ins = [c["k_pool"], c["k_new"], c["table"], c["slots"], c["positions"]]
    ops_ = [_operand(a, dt if a.dtype != np.int64 else ml.int64) for a in ins]
    body = emit_rope_update("rope_paged_kv_cache_update", node.attrs, ops_, ops_[0])
    boxes = [Box((0, h, 0, 0), (c["k_pool"].shape[0], h + 1, 4, 16)) for h in range(c["k_pool"].shape[1])]
    got, info, _ = run_block(body, 0, tmp_path, [*ins, c["k_pool"].copy()], boxes, header="paged.cuh")
    assert info[0] == 0, info
    a, b = got.astype(np.float64), want.astype(np.float64)
    err = np.abs(a - b) / (np.abs(b) + np.abs(b).max())
    eps = 2.0**-23 if dtype == "float32" else 2.0**-8
    print(f"worst error {err.max() / eps:.2f} ulps of {dtype} (of |ref| + max |ref|)")
    assert err.max() <= 2 * eps, f"worst {err.max() / eps:.1f} ulps at {np.unravel_index(err.argmax(), err.shape)}"
    kept = want.view(np.uint8) == c["k_pool"].view(np.uint8)  # (the places no row writes, and a few more)
    assert (got.view(np.uint8)[kept] == want.view(np.uint8)[kept]).all(), "a place no row writes changed"

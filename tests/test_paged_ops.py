"""paged_attention and paged_kv_cache_update (megaloop/frontend/ops/paged.py) without a GPU.

(1) The reference against dense attention on each row's slot gathered (bit for bit) and the update
against a scatter written here; (2) the data rules name the row, slot, page or position; (3) the plan
interpreter, under random legal orders, gives the reference's bits; (4) the kernels compile for sm_90a
and sm_80; (5) the generated tile functions themselves run on the CPU through g++ (a shim for the CUDA
headers; each warp's 32 lanes as 32 threads, warp_sum as the GPU's butterfly) against the reference.
The op table (tests/op_table/caches.py) checks both ops against PyTorch float64 in every float dtype."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import megaloop as ml
from megaloop.codegen import generate
from megaloop.codegen.emit import Operand
from megaloop.codegen.emit_paged import paged_attention as emit_attention
from megaloop.codegen.emit_paged import paged_kv_update as emit_update
from megaloop.frontend.ops.paged import PAGED_ATTENTION_TILING
from megaloop.frontend.tiling import Box, TileContext
from megaloop.plan import make_plan
from megaloop.reference.interpreter import run_plan
from megaloop.runtime.compile import INCLUDE, compile_cubin
from tests.test_rope_kv_codegen import SHIM

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


def step_graph(c: dict) -> ml.Graph:
    """The update of both pools, then attention over them (as in the serving step)."""
    g = ml.Graph("paged")
    dt = c["dtype"]
    q = g.input("q", c["q"].shape, dt)
    kn, vn = g.input("k_new", c["k_new"].shape, dt), g.input("v_new", c["v_new"].shape, dt)
    table = g.state("table", c["table"].shape, "int64")
    slots, pos = g.input("slots", c["slots"].shape, "int64"), g.input("positions", c["positions"].shape, "int64")
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
    c = case("bfloat16", window=4)
    plan = make_plan(step_graph(c), processors=8, arch="sm_90" if arch == "sm_90a" else "sm_80")
    source = generate(plan).source
    assert "ml::paged_attention<2, 8, 8, 15, 4, 3, 4, 4>" in source
    assert "ml::paged_kv_update<1, 9, 8, 15, 4, 3, 4>" in source
    assert compile_cubin(source, arch)


# ---- the generated tiles on the CPU -----------------------------------------------------------------------

# The lanes of a warp as coroutines of one thread (ucontext): each exchange of __shfl_xor_sync is a point
# where every lane yields to the next, so the lanes run in lockstep as a warp's do, without 32 threads
# and their barriers (slow on a loaded 2-core machine); warp_sum is the GPU's butterfly (v += the value
# of lane ^ o, o = 16 .. 1), so the sums are the GPU's bit for bit.
WARPS = r"""
#include <functional>
#include <ucontext.h>
#include <vector>
namespace ml {
inline float neg_inf() { return -INFINITY; }
static int lane_id;
static float exchange[32];
static ucontext_t scheduler, lane_context[32];
static std::function<void(int)>* lane_body;
inline void lanes_meet() { swapcontext(&lane_context[lane_id], &scheduler); }  // resumed after every lane came
inline float __shfl_xor_sync(unsigned, float v, int o) {
    exchange[lane_id] = v;
    lanes_meet();
    const float w = exchange[lane_id ^ o];
    lanes_meet();
    return w;
}
template <int W> inline float lanes_sum(float v) {
    for (int o = W / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
inline float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
static void lane_entry(int lane) { (*lane_body)(lane); }
template <int N, class F> inline void for_box_warps(const Task& t, F f) {  // one warp, its elements in turn
    constexpr size_t STACK = 1 << 18;
    static std::vector<char> stacks(32 * STACK);
    int ext[N + 1];
    i64 total = 1;
    for (int d = 0; d < N; ++d) { ext[d] = t.hi[d] - t.lo[d]; total *= ext[d]; }
    for (i64 e = 0; e < total; ++e) {
        int i[N + 1];
        i64 r = e;
        for (int d = N - 1; d >= 0; --d) { i[d] = t.lo[d] + (int)(r % ext[d]); r /= ext[d]; }
        bool done[32] = {};
        std::function<void(int)> body = [&](int lane) { f(i, lane); done[lane] = true; };
        lane_body = &body;
        for (int lane = 0; lane < 32; ++lane) {
            getcontext(&lane_context[lane]);
            lane_context[lane].uc_stack.ss_sp = stacks.data() + lane * STACK;
            lane_context[lane].uc_stack.ss_size = STACK;
            lane_context[lane].uc_link = &scheduler;
            makecontext(&lane_context[lane], (void (*)())lane_entry, 1, lane);
        }
        for (bool running = true; running;) {  // rounds: each lane on to its next meeting point (or its end)
            running = false;
            for (int lane = 0; lane < 32; ++lane) {
                if (done[lane]) continue;
                lane_id = lane;
                swapcontext(&scheduler, &lane_context[lane]);
                running = true;
            }
        }
    }
}
}  // namespace ml
"""

TILE = r"""
#include "megaloop/paged.cuh"
void tile(const ml::Args& a, const ml::Task& t, int tid, const ml::i64* off) {
BODY
}
extern "C" void run(char* arena, const int* lo, const int* hi, int tasks, const long long* off, int threads,
                    long long* info) {
    const ml::Args a{arena, info};
    blockDim.x = threads;
    for (int k = 0; k < tasks; ++k) {
        ml::Task t{};
        memcpy(t.lo, lo + k * ml::MAX_DIMS, sizeof t.lo);
        memcpy(t.hi, hi + k * ml::MAX_DIMS, sizeof t.hi);
        blockIdx.x = k;
        for (int x = 0; x < threads; ++x) { threadIdx.x = x; tile(a, t, k, off); }
    }
}
"""

needs_cxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs a host C++ compiler (g++)")


def run_tiles(body: list[str], tmp_path: Path, arrays: list[np.ndarray], plan_op, threads: int) -> list[np.ndarray]:
    """Every task of ``plan_op`` run by the tile function ``body`` over ``arrays`` (its operands, then its
    output) laid out contiguously in one arena; the output afterwards, and the error info."""
    stub = tmp_path / "stub" / "megaloop"
    stub.mkdir(parents=True, exist_ok=True)
    (stub / "loop.cuh").write_text(SHIM + WARPS)
    (stub / "vec.cuh").write_text("#pragma once\n")
    src = tmp_path / "tile.cpp"
    src.write_text(TILE.replace("BODY", "\n".join("    " + line for line in body)))
    lib = tmp_path / "tile.so"
    subprocess.run(
        ["g++", "-std=c++20", "-O1", "-pthread", "-ffp-contract=off", "-shared", "-fPIC", "-I", str(stub.parent),
         "-I", str(INCLUDE), "-o", str(lib), str(src)],
        check=True, capture_output=True,
    )  # fmt: skip
    offsets, at = [], 0
    for a in arrays:
        offsets.append(at)
        at += -(-a.nbytes // 64) * 64
    arena = np.zeros(at, np.uint8)
    for a, o in zip(arrays, offsets):
        arena[o : o + a.nbytes] = np.ascontiguousarray(a).view(np.uint8).ravel()
    boxes = [t.box for t in plan_op]
    lo, hi = np.zeros((len(boxes), 6), np.int32), np.ones((len(boxes), 6), np.int32)
    for k, box in enumerate(boxes):
        lo[k, : len(box.lo)], hi[k, : len(box.hi)] = box.lo, box.hi
    info = np.zeros(9, np.int64)
    off = np.array(offsets, np.int64)
    fn = ctypes.CDLL(str(lib)).run
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    fn(arena.ctypes.data, lo.ctypes.data, hi.ctypes.data, len(boxes), off.ctypes.data, threads, info.ctypes.data)
    out = arrays[-1]
    return [arena[offsets[-1] : offsets[-1] + out.nbytes].view(out.dtype).reshape(out.shape), info]


class _Box:
    def __init__(self, box) -> None:
        self.box = box


def _operand(a: np.ndarray, dtype: ml.DType) -> Operand:
    strides = [1] * a.ndim
    for d in range(a.ndim - 2, -1, -1):
        strides[d] = strides[d + 1] * a.shape[d + 1]
    return Operand(dtype, a.shape, tuple(strides))


@needs_cxx
@pytest.mark.parametrize("dtype,window,d", [("float32", None, 40), ("bfloat16", 3, 96), ("float32", 5, 8)])
def test_generated_tiles_run_on_the_cpu(dtype: str, window: int | None, d: int, tmp_path: Path) -> None:
    """head_dim 40 and 8: a lane a key; 96: two lanes a key (48 dims each)."""
    c = case(dtype, window=window, d=d, rows=5, seed=4, per_slot=3, page=4)  # (32 threads a warp: kept small)
    g = step_graph(c)
    want = ml.evaluate(g, feeds(c)[0], state=feeds(c)[1])
    dt, i64 = c["dtype"], ml.int64
    # the update of the k pool: a task a kv head, on the generated function
    ins = [c["k_pool"], c["k_new"], c["table"], c["slots"], c["positions"]]
    ops_ = [_operand(a, dt if a.dtype != np.int64 else i64) for a in ins]
    body = emit_update("paged_kv_cache_update", {}, ops_, ops_[0])
    boxes = [_Box(Box((0, h, 0, 0), (c["k_pool"].shape[0], h + 1, 4, d))) for h in range(c["k_pool"].shape[1])]
    got, info = run_tiles(body, tmp_path, [*ins, c["k_pool"].copy()], boxes, 64)
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
    got, info = run_tiles(body, tmp_path / "attn", [*ins, out], [_Box(t.writes[0].box) for t in tiles], 64)
    assert info[0] == 0, info
    ref = want.outputs["o"].astype(np.float32)
    err = np.abs(got.astype(np.float32) - ref) / (np.abs(ref) + np.abs(ref).max())
    eps = 2.0**-23 if dtype == "float32" else 2.0**-8
    print(f"worst error {err.max() / eps:.2f} ulps of {dtype} (of |ref| + max |ref|)")
    assert err.max() <= 8 * eps, f"worst {err.max() / eps:.1f} ulps at {np.unravel_index(err.argmax(), err.shape)}"

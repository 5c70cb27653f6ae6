"""The loop kernel on a real GPU (skipped without one): every op of the table against PyTorch float64,
the Llama-style block against the CPU reference, 200 random graphs, bitwise reproducibility, the
watchdog and data errors. scripts/gpu_check.sh runs these on the GPU machine."""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest
import torch

import megaloop as ml
from megaloop.codegen import generate
from megaloop.frontend.tiling import max_resident_processors
from megaloop.models import LlamaConfig, build_llama, random_parameters
from megaloop.plan import make_plan
from megaloop.runtime.compile import compile_many
from megaloop.runtime.device import gpus
from tests.helpers import assert_close, assert_watchdog_names_the_stuck_wait, random_values, to_torch64
from tests.op_table import ROWS, build_row
from tests.random_graphs import random_graph

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpus()[0], reason="no GPU: " + gpus()[1])]

GPU_ROWS = [row for row in ROWS if ml.REGISTRY[row.op].lowering is not None]


def loop_kernel(plan, params=None, state=None, **kw):
    from megaloop.runtime.loop import LoopKernel

    return LoopKernel(plan, params, state, **kw)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def every_op_graph(dtype: str) -> tuple:
    """(graph, feeds, state, cases): every GPU row of the op table, two draws each, in one graph
    (scripts/precompile.py compiles its kernel ahead: `every_op`)."""
    g = ml.Graph(f"all-ops-{dtype}")
    cases, feeds, state = [], {}, {}
    for i, row in enumerate(GPU_ROWS):
        dt = dtype if dtype in row.dtypes else row.dtypes[0]
        for draw in range(2):
            prefix = f"r{i}d{draw}."
            _, f, s, arrays, outs, sample = build_row(row, dt, seed=100 + draw, graph=g, prefix=prefix)
            feeds.update(f)
            state.update(s)
            cases.append((row, dt, prefix, arrays, outs, sample))
    return g, feeds, state, cases


def test_every_op_against_torch(dtype: str) -> None:
    g, feeds, state, cases = every_op_graph(dtype)
    plan = make_plan(g, processors=132)
    with loop_kernel(plan, state=state) as k:
        got = k.run(feeds)
    failures = []
    for row, dt, prefix, arrays, outs, sample in cases:
        with torch.no_grad():
            ref = row.ref(*[to_torch64(a) for a in arrays], dtype=dt, **sample.kw)
            scale = (
                float(row.ref(*[to_torch64(a).abs() for a in arrays], dtype=dt, **sample.kw).max())
                if row.cancels
                else None
            )
        refs = ref if isinstance(ref, tuple) else (ref,)
        for j, (t, r) in enumerate(zip(outs, refs)):
            r64 = (r.double() if r.dtype.is_floating_point else r).numpy()
            try:
                assert_close(
                    got[f"{prefix}y{j}"],
                    r64,
                    t.dtype,
                    ml.REGISTRY[row.op].accuracy,
                    row.reduce_len(sample),
                    f"{row.id} [{dt}] {prefix}",
                    scale,
                )
            except AssertionError as e:
                failures.append(str(e))
    assert not failures, f"{len(failures)} mismatches:\n" + "\n".join(failures[:20])


def test_llama_block_against_the_reference() -> None:
    cfg = LlamaConfig(hidden=256, heads=8, kv_heads=2, intermediate=688, layers=2, max_seq=64, vocab=1000)
    params = random_parameters(cfg, seed=3)
    rng = np.random.default_rng(4)
    prefill, decode = build_llama(cfg, 2, 12, "prefill"), build_llama(cfg, 2, 1, "decode")
    feeds = {"tokens": rng.integers(0, 1000, (2, 12)), "positions": np.tile(np.arange(12), (2, 1))}
    ref = ml.evaluate(prefill, feeds, params)
    with loop_kernel(make_plan(prefill, processors=132), params) as k:
        out = k.run(feeds)
        state = k.state()
    _close(out["logits"], ref.outputs["logits"], "prefill logits")
    for name in ref.state:
        _close(state[name], ref.state[name], f"prefill {name}")
    # decode three steps, the GPU's own cache carried from step to step
    ref_state = ref.state
    with loop_kernel(make_plan(decode, processors=132), params, state) as k:
        for step in range(3):
            f = {"tokens": rng.integers(0, 1000, (2, 1)), "positions": np.full((2, 1), 12 + step)}
            out = k.run(f)
            r = ml.evaluate(decode, f, params, ref_state)
            ref_state = r.state
            _close(out["logits"], r.outputs["logits"], f"decode step {step}")


def _close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    g64, w64 = got.astype(np.float64), want.astype(np.float64)
    rel = np.linalg.norm(g64 - w64) / max(np.linalg.norm(w64), 1e-30)
    assert rel < 1e-2, f"{what}: relative L2 difference {rel:.2e} between GPU and CPU reference"


def test_random_graphs_against_the_reference() -> None:
    rng = np.random.default_rng(7)
    total = 0
    cases = []
    for batch in range(10):  # 10 kernels of 20 random programs each
        g = ml.Graph(f"fuzz-{batch}")
        feeds = {}
        for i in range(20):
            feeds.update(random_graph(rng, g, f"p{i}."))
        tiles = {"matmul": {"tensor_cores": int(rng.random() < 0.5)}}  # both matmul paths
        cases.append((g, feeds, make_plan(g, processors=int(rng.choice([7, 64, 132])), tiles=tiles)))
    programs = [generate(plan) for _, _, plan in cases]
    compile_many([p.source for p in programs], gpus()[0][0].arch)  # in parallel
    for batch, ((g, feeds, plan), program) in enumerate(zip(cases, programs)):
        ref = ml.evaluate(g, feeds)
        with loop_kernel(plan, program=program) as k:
            got = k.run(feeds)
        for name, want in ref.outputs.items():
            w = want.astype(np.float64)
            d = np.abs(got[name].astype(np.float64) - w)
            tol = 0.05 * (np.abs(w) + np.sqrt(np.mean(w**2)) + 1e-3)
            assert np.all(d <= tol), f"fuzz {batch} {name}: max difference {d.max():.3e}"
            total += 1
    assert total == 200


def test_hundred_runs_are_bitwise_identical() -> None:
    cfg = LlamaConfig(hidden=128, heads=4, kv_heads=2, intermediate=256, layers=2, max_seq=32, vocab=500)
    g = build_llama(cfg, 1, 8)
    feeds = {"tokens": np.arange(8)[None], "positions": np.arange(8)[None]}
    with loop_kernel(make_plan(g, processors=132), random_parameters(cfg, seed=1)) as k:
        first = k.run(feeds)["logits"].tobytes()
        for _ in range(99):
            assert k.run(feeds)["logits"].tobytes() == first


def test_watchdog_names_the_stuck_wait_and_the_gpu_stays_usable() -> None:
    assert_watchdog_names_the_stuck_wait()


def test_task_stuck_outside_a_wait_is_reported_and_stopped() -> None:
    """A task that never finishes (a codegen bug) must not hang the host: wait() gives up after
    timeout_s + 5 s without progress, and the abort flag makes the kernel leave."""
    from megaloop.runtime.loop import LoopKernelError

    g = ml.Graph("stuck")
    s = g.state("s", (4,), ml.float32)
    g.assign(s, s + 1.0)
    g.output("s", s + 0.0)
    plan = make_plan(g, processors=1)
    program = generate(plan)
    head = "void run_task(const ml::Args& a, const ml::TaskSlot& s, ml::u64 k, int proc) {\n"
    assert head in program.source
    program.source = program.source.replace(head, head + "    while (!ml::aborted(a)) __nanosleep(1000);\n")
    with pytest.raises(LoopKernelError, match=r"made no progress .* It has been stopped"):
        with loop_kernel(plan, timeout_s=0.5, program=program) as k:
            k.run({})
    with loop_kernel(plan) as k:  # the GPU is usable again
        k.run({}, iterations=3)
        assert np.array_equal(k.state()["s"], np.full(4, 3.0, np.float32))


def test_bad_token_id_is_a_data_error() -> None:
    cfg = LlamaConfig(hidden=64, heads=4, kv_heads=2, intermediate=96, layers=1, max_seq=8, vocab=50)
    plan = make_plan(build_llama(cfg, 1, 1), processors=16)
    with loop_kernel(plan, random_parameters(cfg)) as k:
        with pytest.raises(ml.errors.DataError, match=r"embedding .* id 77 is outside \[0, 50\)"):
            k.run({"tokens": [[77]], "positions": [[0]]})


# warps 1: the one warp both waits for a task and copies the next one into its slot (TaskSlot)
@pytest.mark.parametrize("warps", [8, 2, 1])
def test_state_feedback_loop_runs_many_iterations_on_the_gpu(warps: int) -> None:
    g = ml.Graph("loop")
    tok = g.state("token", (2,), ml.int64, init=[1, 3])
    table = g.parameter("table", (6, 8), ml.float32)
    g.assign(tok, ml.argmax(ml.embedding(table, tok) @ table.T, axis=-1))
    g.output("tok", tok + 0)
    params = {"table": np.random.default_rng(0).standard_normal((6, 8))}
    ref = ml.evaluate(g, {}, params, iterations=50)
    with loop_kernel(make_plan(g, processors=4, warps=warps), params) as k:
        k.run({}, iterations=50)
        assert np.array_equal(k.state()["token"], ref.state["token"])


def test_profiled_run_gives_a_timeline_that_obeys_the_plan() -> None:
    """Kernel timestamps: every task stamped in every profiled iteration, tasks of one processor in
    list order without overlap, and a task starting only after the tasks it waits for ended."""
    from megaloop.runtime import trace

    cfg = LlamaConfig(hidden=128, heads=4, kv_heads=2, intermediate=256, layers=2, max_seq=32, vocab=500)
    plan = make_plan(build_llama(cfg, 1, 1), processors=132)
    feeds = {"tokens": np.array([[3]]), "positions": np.array([[0]])}
    with loop_kernel(plan, random_parameters(cfg, seed=1), profile_iterations=3) as k:
        k.run(feeds, iterations=4)  # one more than profiled: the rest are not stamped
        tl = trace.measured_timeline(plan, k.profile_ns(), "measured")
    rp, times = tl.rp, tl.times_ns
    for lst in rp.processors:
        for a, b in itertools.pairwise(lst):
            assert (times[:, b, 0] >= times[:, a, 1]).all(), rp.task_name(rp.tasks[b])
    for t in rp.tasks:
        for w in t.waits:
            if w.lag == 0:
                ends = [times[:, s.id, 1] for s in rp.tasks if s.signal == w.counter]
                assert (times[:, t.id, 0] >= np.max(ends, axis=0)).all(), rp.task_name(t)
    assert "matmul" in trace.format_summary(tl)


def test_demo_runs_on_the_loop_kernel(capsys) -> None:
    from megaloop.cli import main

    args = ["demo", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--intermediate", "128"]
    assert main([*args, "--prompt", "5", "--decode", "3", "--vocab", "97", "--backend", "gpu"]) == 0
    out = capsys.readouterr().out
    assert "running on the loop kernel" in out and out.rstrip().endswith("OK")


def normal_inputs(g: ml.Graph, dt: ml.DType, seed: int) -> tuple[dict, dict]:
    """Standard-normal feeds and parameters of ``g``, rounded to ``dt``."""
    rng = np.random.default_rng(seed)
    feeds = {n: random_values(rng, t.shape, dt) for n, t in g.inputs.items()}
    return feeds, {n: random_values(rng, t.shape, dt) for n, t in g.parameters.items()}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("processors", [1, 132])
@pytest.mark.parametrize("path", ["wgmma", "mma"])
def test_tensor_core_matmul_against_torch(dtype: str, processors: int, path: str) -> None:
    """The tensor-core paths (Hopper's wgmma, and mma.sync with the wgmma switch off): odd edges, a
    broadcast batch, sub-tiles beyond one block, K not a multiple of the slice, plus the layouts that
    stay on the SIMT path."""
    from tests.test_codegen import tensor_core_graph

    g = tensor_core_graph(dtype)
    dt = ml.as_dtype(dtype)
    feeds, params = normal_inputs(g, dt, processors)
    tiles = {"matmul": {"tensor_cores": 1, "wgmma": int(path == "wgmma"), "block_m": 256, "block_n": 256}}
    plan = make_plan(g, processors=processors, tiles=tiles)
    assert f"ml::{path}_tile<" in generate(plan).source
    with loop_kernel(plan, params) as k:
        got = k.run(feeds)
    t64 = {n: to_torch64(v) for n, v in {**feeds, **params}.items()}
    want = {
        "xw": t64["x"] @ t64["w"].T,
        "ab": t64["a"] @ t64["b"].T,
        "kn": t64["a"] @ t64["kn_b"],
        "row": t64["v"] @ t64["b"].T,
    }
    for name, ref in want.items():
        k_len = 72 if name == "xw" else 136
        assert_close(got[name], ref.numpy(), dt, ml.REGISTRY["matmul"].accuracy, k_len, f"{name} [{dtype}]")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("splits", [4, 8])
def test_split_k_linear_against_torch(dtype: str, splits: int) -> None:
    """ops.split_k_linear (a prefill's narrow projections): the partial products on the tensor cores
    over views of x and the weight, their sum a thread an element; float64 torch, two runs the same."""
    from tests.test_split_k import split_graph

    m, n, k = 128, 512, 4096
    g = split_graph((1,), m, n, k, splits, dtype)
    dt = ml.as_dtype(dtype)
    feeds, params = normal_inputs(g, dt, splits)
    plan = make_plan(g, processors=132)
    assert "ml::wgmma_tile<" in generate(plan).source
    with loop_kernel(plan, params) as kern:
        got = kern.run(feeds)["y"]
        again = kern.run(feeds)["y"]
    x64, w64 = to_torch64(feeds["x"]), to_torch64(params["w"])
    part = k // splits
    partials = torch.stack(
        [x64[..., s * part : (s + 1) * part] @ w64[:, s * part : (s + 1) * part].T for s in range(splits)]
    )
    atol = float(partials.abs().max()) * splits * dt.eps / 2  # each partial rounded to dtype
    want = (x64 @ w64.T).numpy()
    assert_close(got, want, dt, ml.REGISTRY["matmul"].accuracy, k, f"split {splits} [{dtype}]", atol=atol)
    assert np.array_equal(got, again), "two runs differ"


def test_more_processors_than_can_be_resident_is_refused() -> None:
    from megaloop.runtime.loop import LoopKernelError

    g = ml.Graph("wide")
    x = g.input("x", (5000, 64), ml.float32)
    g.output("y", x + 1.0)
    # the most any sm_90 GPU could hold (make_plan refuses more); this kernel's registers allow fewer
    most = max_resident_processors("sm_90", 8)
    plan = make_plan(g, processors=most, warps=8, tiles={"add": {"elements": 64}})
    with pytest.raises(LoopKernelError, match=r"resident at once .* processors <= \d+"):
        loop_kernel(plan)


def test_torch_tensors_in_and_zero_copy_views_out() -> None:
    """Inputs as CUDA torch tensors (device-to-device), an input filled in place through a view of
    the kernel's memory, and outputs read as views: all equal to the numpy round trip."""
    cfg = LlamaConfig(hidden=128, heads=4, kv_heads=2, intermediate=256, layers=1, max_seq=16, vocab=300)
    plan = make_plan(build_llama(cfg, 1, 4), processors=132)
    params = random_parameters(cfg, seed=2)
    tokens, positions = np.array([[5, 7, 11, 13]]), np.arange(4)[None]
    with loop_kernel(plan, params) as k:
        want = k.run({"tokens": tokens, "positions": positions})["logits"]
    with loop_kernel(plan, params) as k:
        dev = {"tokens": torch.tensor(tokens, device="cuda"), "positions": torch.tensor(positions, device="cuda")}
        got = k.run(dev)["logits"]
        view = k.tensor("logits")
        assert view.is_cuda and view.dtype == torch.bfloat16 and tuple(view.shape) == want.shape
        assert np.array_equal(ml.dtypes.to_numpy(view).view(np.uint16), want.view(np.uint16))
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16))
    with loop_kernel(plan, params) as k:
        k.tensor("tokens").copy_(torch.tensor(tokens, device="cuda"))  # written in place, no copy
        got = k.run({"positions": positions})["logits"]
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16))


def test_split_key_decode_against_the_reference() -> None:
    """attention_partial + attention_combine on the GPU: decode over a cache split into key ranges."""
    cfg = LlamaConfig(hidden=256, heads=8, kv_heads=2, intermediate=688, layers=2, max_seq=256, vocab=1000)
    params = random_parameters(cfg, seed=6)
    rng = np.random.default_rng(6)
    prefill = build_llama(cfg, 1, 100)
    feeds = {"tokens": rng.integers(0, 1000, (1, 100)), "positions": np.arange(100)[None]}
    state = ml.evaluate(prefill, feeds, params).state
    decode = build_llama(cfg, 1, 1, kv_splits=8)
    step = {"tokens": np.array([[7]]), "positions": np.array([[100]])}
    ref = ml.evaluate(decode, step, params, state)
    with loop_kernel(make_plan(decode, processors=132), params, state) as k:
        out = k.run(step)
    _close(out["logits"], ref.outputs["logits"], "split-key decode logits")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_few_row_matmuls_read_each_weight_once_and_match_torch(dtype: str) -> None:
    """Tiles of 2..16 rows take the warp-per-column path (emit_matmul._skinny): batched decode, a TP
    MLP over a few tokens (tests.test_codegen.few_row_matmul_graph says which cases)."""
    from tests.test_codegen import FEW_ROW_SHAPES, few_row_matmul_graph

    dt = ml.as_dtype(dtype)
    g = few_row_matmul_graph(dtype)
    feeds, params = normal_inputs(g, dt, 7)
    plan = make_plan(g, processors=132, tiles={"matmul": {"tensor_cores": 1}})
    assert "a warp per column" in generate(plan).source
    with loop_kernel(plan, params) as k:
        got = k.run(feeds)
    t64 = {n: to_torch64(v) for n, v in {**feeds, **params}.items()}
    for m, k_len in FEW_ROW_SHAPES.items():
        want = (t64[f"x{m}"] @ t64[f"w{m}"].T).numpy()
        assert_close(got[f"y{m}"], want, dt, ml.REGISTRY["matmul"].accuracy, k_len, f"y{m} [{dtype}]")
    want = (t64["xb"] @ t64["wb"].transpose(1, 2)).numpy()
    assert_close(got["yb"], want, dt, ml.REGISTRY["matmul"].accuracy, 264, f"yb [{dtype}]")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_skinny_tensor_core_matmuls_match_torch(dtype: str) -> None:
    """Tiles of at most 8 rows on tensor cores (tile switch skinny_mma: ml::mma_skinny, fragments loaded
    straight from memory, the tile's column groups x K slices shared evenly by the warps; batch axes a
    tile per index), against torch in float64; 100 runs bitwise the same."""
    from tests.test_codegen import NO_RING, SKINNY_MMA_SHAPES, skinny_mma_graph

    dt = ml.as_dtype(dtype)
    g = skinny_mma_graph(dtype)
    feeds, params = normal_inputs(g, dt, 11)
    # (without the weight ring, whose tiles take the products of at most 4 rows)
    plan = make_plan(g, processors=132, tiles={"matmul": {"skinny_mma": 1}}, options=NO_RING)
    assert generate(plan).source.count("at most 8 rows: tensor cores") == len(SKINNY_MMA_SHAPES)
    with loop_kernel(plan, params) as k:
        got = k.run(feeds)
        again = k.run(feeds, iterations=100)
    t64 = {n: to_torch64(v) for n, v in {**feeds, **params}.items()}
    for name, (_, k_len, _) in SKINNY_MMA_SHAPES.items():
        want = (t64[name] @ t64[f"w{name}"].T).numpy()
        assert_close(got[f"y{name}"], want, dt, ml.REGISTRY["matmul"].accuracy, k_len, f"y{name} [{dtype}]")
        assert np.array_equal(got[f"y{name}"], again[f"y{name}"]), f"y{name}: runs differ"


@pytest.mark.parametrize("layout", ["groups", "block"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_block_row_softmax_edge_values_match_torch(dtype: str, layout: str) -> None:
    """Softmax and log_softmax on the block-per-row path (each warp's exponentials relative to its own
    max, combined across the warps of the row's group; ex2.approx for 16-bit outputs), with groups of
    warps each on rows of their own (several rows a task) and with the whole block on a row (one row a
    task), with -inf, +inf, NaN and the dtype's most negative finite value (padding masks) in the rows:
    NaN exactly where torch has it, a row of -inf only is NaN, -inf entries give 0 (softmax) and -inf
    (log_softmax)."""
    n = 4096
    dt = ml.as_dtype(dtype)
    lowest = float(torch.finfo(getattr(torch, dtype)).min)
    g = ml.Graph("softmax-edges")
    x = g.input("x", (11, n), dt)
    g.output("soft", ml.softmax(x, -1))
    g.output("logsoft", ml.log_softmax(x, -1))
    rng = np.random.default_rng(7)
    v = rng.standard_normal((11, n)).astype(np.float32) * 4
    v[1, ::2] = -np.inf  # half the row
    v[2, :] = -np.inf  # all of it: NaN, as torch
    v[3, 100] = np.nan
    v[4, :] = -np.inf
    v[4, 3000] = 1.0  # one element left, in the last warps' part
    v[5, 7] = np.inf
    v[6, : n // 2] = -np.inf  # whole warps of -inf
    v[7, :] = 80.0 + rng.standard_normal(n).astype(np.float32)  # large values: relative to the max
    v[8, 1000:] = lowest  # a padding mask: whole warps at the most negative finite value
    v[9, :] = lowest  # all masked: 1/n each, as torch
    v[10, 1000:] = -1e20 if dtype != "float16" else lowest
    v = ml.dtypes.round_to(v, dt)
    rows = 1 if layout == "block" else 4  # a task's rows: one, or one for each of 4 groups of 64 threads
    # exactly that many rows a task (balance 0: not grown to fill the processors' last round)
    exact = {"elements": rows * n, "balance": 0}
    plan = make_plan(g, processors=3, tiles={op: exact for op in ("softmax", "log_softmax")})
    assert ("a block per row" if layout == "block" else "4 groups of 64 threads per row") in generate(plan).source
    with loop_kernel(plan) as k:
        got = k.run({"x": v})
    t = to_torch64(v)
    for name, want in (("soft", torch.softmax(t, -1)), ("logsoft", torch.log_softmax(t, -1))):
        op = "softmax" if name == "soft" else "log_softmax"
        assert_close(got[name], want.numpy(), dt, ml.REGISTRY[op].accuracy, n, f"{name} [{dtype}]")


@pytest.mark.parametrize("processors, wide", [(2, False), (132, False), (2, True)])
def test_long_rows_many_to_a_task_match_torch(processors: int, wide: bool) -> None:
    """Block-per-row normalisations with several rows per task: up to 8 rows in a ring in shared
    memory (the next rows arriving while one is reduced and stored); ``wide`` gives the layernorms
    tasks of several rows, so that 32 KB and 64 KB rows fill rings of 3 and 2 slots
    (tests.test_codegen.test_long_rows_take_the_block_per_row_path_and_compile says which rings)."""
    from tests.test_codegen import LONG_ROW_CASES, long_rows_graph

    g = long_rows_graph()
    rng = np.random.default_rng(processors)
    feeds = {
        n: ml.dtypes.round_to(rng.standard_normal(t.shape) + (1.0 if n.endswith("_w") else 0.0), t.dtype)
        for n, t in g.inputs.items()
    }
    plan = make_plan(g, processors=processors, tiles={"layernorm": {"elements": 1 << 17}} if wide else None)
    assert "a block per row" in generate(plan).source
    with loop_kernel(plan) as k:
        got = k.run(feeds)
    tf = torch.nn.functional
    for name, (op, dtype, shape) in LONG_ROW_CASES.items():
        dt = ml.as_dtype(dtype)
        x, w = to_torch64(feeds[f"{name}_x"]), to_torch64(feeds[f"{name}_w"])
        if op == "rmsnorm":
            want = tf.rms_norm(x, shape[-1:], w, eps=1e-6)
        elif op == "softmax":  # the graph scales in the input dtype, then takes the softmax
            want = torch.softmax(to_torch64(ml.dtypes.round_to(feeds[f"{name}_x"] * 3.0, dt)), -1)
        elif op == "log_softmax":
            want = torch.log_softmax(x, -1)
        else:
            want = tf.layer_norm(x, shape[-1:], w, w, eps=1e-5)
        assert_close(got[name], want.numpy(), dt, ml.REGISTRY[op].accuracy, shape[-1], f"{name} [{dtype}]")


@pytest.mark.parametrize("q_block", [64, 128])
def test_prefill_attention_on_tensor_cores_matches_torch(q_block: int) -> None:
    """Prefill-sized causal GQA attention (32 heads of 512 queries, 8 kv heads, head 128) through
    attention_mma, both warp layouts: tiles of 64 queries (4 units on 8 warps: pairs of warps on a
    unit's keys, merged at the end) and of 128 (a unit a warp), against float64 torch."""
    from tests.op_table import attention_ref

    g = ml.Graph(f"prefill-attention-{q_block}")
    shapes = {"q": (1, 32, 512, 128), "k": (1, 8, 512, 128), "v": (1, 8, 512, 128)}
    t = {n: g.input(n, s, ml.bfloat16) for n, s in shapes.items()}
    g.output("y", ml.attention(t["q"], t["k"], t["v"], causal=True))
    plan = make_plan(g, processors=132, tiles={"attention": {"q_block": q_block}})
    program = generate(plan)
    # pairs of warps a unit (Mma 2) where a tile's units leave warps idle
    assert re.search(r"ml::attention<ml::AttnShape<4, 512, 512, 128, 128, true, 0>, 2, true>\(", program.source)
    rp = plan.ranks[0]
    heights = {t.writes[0].box.hi[2] - t.writes[0].box.lo[2] for t in rp.tasks}
    assert heights == {q_block}, f"query blocks {heights}"
    rng = np.random.default_rng(q_block)
    feeds = {n: random_values(rng, s, ml.bfloat16) for n, s in shapes.items()}
    with loop_kernel(plan) as k:
        got = k.run(feeds)["y"]
    ref = attention_ref(*[to_torch64(feeds[n]) for n in "qkv"], causal=True).numpy()
    assert_close(got, ref, ml.bfloat16, ml.REGISTRY["attention"].accuracy, 512 + 128, f"q_block {q_block}")


def test_folded_batch_decode_matches_torch_and_the_reference() -> None:
    """Tile switch fold_batch (on by default): batched decode's matmuls take the rows of several
    sequences a tile on the skinny tensor-core path. The matmuls against torch in float64 (100 runs
    bitwise the same), then a 4-sequence Llama decode step, three steps, against the CPU reference."""
    from tests.test_fold_batch import FOLD, batched_graph

    dt = ml.bfloat16
    rng = np.random.default_rng(12)
    for a_shape in ((4, 1, 1024), (12, 1, 2048), (3, 2, 512)):
        g = batched_graph(a_shape, (520, a_shape[-1]))
        x = ml.dtypes.round_to(rng.standard_normal(a_shape), dt)
        w = ml.dtypes.round_to(rng.standard_normal((520, a_shape[-1])), dt)
        plan = make_plan(g, processors=132, tiles=FOLD)
        assert "rows of its batch indices one after the other" in generate(plan).source
        with loop_kernel(plan, {"w": w}) as k:
            got = k.run({"x": x})["y"]
            again = k.run({"x": x}, iterations=100)["y"]
        want = (to_torch64(x) @ to_torch64(w).T).numpy()
        assert_close(got, want, dt, ml.REGISTRY["matmul"].accuracy, a_shape[-1], f"y {a_shape}")
        assert np.array_equal(got, again), f"{a_shape}: runs differ"
    cfg = LlamaConfig(hidden=256, heads=8, kv_heads=2, intermediate=688, layers=2, max_seq=64, vocab=1000)
    params = random_parameters(cfg, seed=3)
    decode = build_llama(cfg, 4, 1, "decode")
    ref_state = None  # both start from the graph's initial (empty) caches
    with loop_kernel(make_plan(decode, processors=132, tiles=FOLD), params) as k:
        for step in range(3):
            f = {"tokens": rng.integers(0, 1000, (4, 1)), "positions": np.full((4, 1), step)}
            out = k.run(f)
            r = ml.evaluate(decode, f, params, ref_state)
            ref_state = r.state
            _close(out["logits"], r.outputs["logits"], f"folded decode step {step}")


@pytest.mark.parametrize(
    "hidden,sequences,tokens", [(2048, 1, 1), (4096, 1, 1), (2048, 4, 1), (4096, 4, 1), (2048, 1, 64)]
)
def test_benchmark_layers_match_the_reference(hidden: int, sequences: int, tokens: int) -> None:
    """bench/llama_layer.py's layers at their own sizes (the tile widths the planner picks there:
    sibling q, k, v and gate, up tiles sharing the processors, small elementwise ops in several tiles,
    folded sequences) against the CPU reference; two runs bitwise the same. (Passed at f8cd824 with the
    MLP's silu and product apart and as one op, silu_mul, the default since.)"""
    from bench.llama_layer import CONTEXT, layer_config

    cfg = layer_config(hidden, tokens)
    params = random_parameters(cfg, seed=0)
    rng = np.random.default_rng(hidden + sequences + tokens)
    start = CONTEXT if tokens == 1 else 0
    feeds = {
        "hidden": rng.standard_normal((sequences, tokens, hidden)).astype(np.float32),
        "positions": np.tile(np.arange(start, start + tokens), (sequences, 1)),
    }
    g = build_llama(cfg, sequences, tokens)
    with loop_kernel(make_plan(g, processors=132), params) as k:
        got = k.run(feeds)["hidden"]
        again = k.run(feeds)["hidden"]
    want = ml.evaluate(g, feeds, params).outputs["hidden"]
    _close(got, want, f"hidden {hidden} x{sequences}, {tokens} tokens")
    assert np.array_equal(got, again), "two runs differ"


LLAMA3_SCALING = {
    "type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@pytest.mark.parametrize("tokens,layout", [(1, "neox"), (3, "interleaved"), (200, "neox")])
def test_rope_into_the_cache_is_rope_then_the_update_bit_for_bit(tokens: int, layout: str) -> None:
    """rope_kv_cache_update (decode's key, rotated on its way into the cache) stores the same bits as
    rope then kv_cache_update on the GPU (rope's fmas), both within rope's accuracy of the reference;
    the rest of the cache untouched."""
    b, h, s, d = 2, 8, 256, 64
    rng = np.random.default_rng(tokens)
    kw = {"theta": 500000.0, "layout": layout, "scaling": LLAMA3_SCALING if layout == "neox" else None}

    def graph(fused: bool) -> ml.Graph:
        g = ml.Graph("fused" if fused else "apart")
        cache = g.state("cache", (b, h, s, d), "bfloat16")
        new = g.input("new", (b, tokens, h, d), "bfloat16").transpose(1, 2)  # a projection's heads: a view
        pos = g.input("pos", (b, tokens), "int64")
        if fused:
            ml.rope_kv_cache_update(cache, new, pos, **kw)
        else:
            ml.kv_cache_update(cache, ml.rope(new, pos.reshape(b, 1, tokens), **kw), pos)
        return g

    feeds = {
        "new": ml.dtypes.round_to(rng.standard_normal((b, tokens, h, d)), ml.bfloat16),
        "pos": np.stack([rng.choice(s, tokens, replace=False) + 0 for _ in range(b)]).astype(np.int64),
    }
    state = {"cache": ml.dtypes.round_to(rng.standard_normal((b, h, s, d)), ml.bfloat16)}
    caches = {}
    for fused in (True, False):
        g = graph(fused)
        with loop_kernel(make_plan(g, processors=132), None, state) as k:
            k.run(feeds)
            caches[fused] = k.state()["cache"]
        want = ml.evaluate(g, feeds, None, state).state["cache"]
        _close(caches[fused], want, f"{'fused' if fused else 'rope + kv_cache_update'} cache")
    assert np.array_equal(caches[True].view(np.uint16), caches[False].view(np.uint16))
    written = np.zeros((b, s), bool)
    for bi in range(b):
        written[bi, feeds["pos"][bi]] = True
    untouched = caches[True].transpose(0, 2, 1, 3)[~written]
    assert np.array_equal(untouched.view(np.uint16), state["cache"].transpose(0, 2, 1, 3)[~written].view(np.uint16))


def test_zero_size_axes_run_on_the_loop_kernel() -> None:
    """tests/test_zero_size.py's cases that make tasks (a concat with an empty piece, products and
    sums over empty axes made constants, empty results beside full ones) on the GPU, against the
    reference, outputs of no element included."""
    from tests.test_zero_size import CASES, _graph

    g = ml.Graph("zero-size-gpu")
    feeds, names = {}, []
    for i, (name, inputs, build, _) in enumerate(CASES):
        sub, f = _graph(name, {f"c{i}.{n}": spec for n, spec in inputs.items()}, build)
        with g.scope(f"c{i}"):
            ins = [g.input(n, t.shape, t.dtype) for n, t in sub.inputs.items()]
            g.output(f"y{i}", build(*ins))
        feeds.update(f)
        names.append(f"y{i}")
    want = ml.evaluate(g, feeds).outputs
    with loop_kernel(make_plan(g, processors=16)) as k:
        got = k.run(feeds)
    for n in names:
        assert got[n].shape == want[n].shape, n
        assert np.array_equal(np.asarray(got[n], np.float64), np.asarray(want[n], np.float64), equal_nan=True), n

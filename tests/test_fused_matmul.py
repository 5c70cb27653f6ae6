"""rmsnorm_matmul and silu_mul_matmul (matmuls making their own A) without a GPU: what the builders
accept and refuse, that the plan interpreter's random orders give the reference bit for bit as the two
ops do (the tiles declare what they read), and what the generator emits: the producing op's own code
into shared memory, past the partial sums and the norm's ring, then the skinny tensor-core path reading
A there; decode-layer kernels compile without spills. The GPU checks are test_gpu.py's
test_rmsnorm_matmul_is_the_norm_then_the_matmul, test_silu_mul_matmul_is_silu_mul_then_the_matmul and
the every-op test's rows."""

from __future__ import annotations

import re

import numpy as np
import pytest

import megaloop as ml
import megaloop.models.llama as llama
from bench.llama_layer import dependent_decode_graph, layer_config
from megaloop.codegen import generate
from megaloop.codegen.emit import Operand
from megaloop.codegen.emit_fused_matmul import fused_matmul_shared_bytes
from megaloop.errors import GraphBuildError
from megaloop.plan import make_plan
from megaloop.reference.interpreter import run_plan
from megaloop.runtime.compile import compile_cubin, spills
from tests.helpers import assert_close


def _graph(rows: tuple[int, ...], k: int, n: int, residual: bool, dtype: str = "bfloat16") -> ml.Graph:
    g = ml.Graph("norm-matmul")
    x = g.input("x", (*rows, k), dtype)
    r = g.input("r", (*rows, k), dtype) if residual else None
    y = ml.rmsnorm_linear(x, g.parameter("w", (k,), dtype), g.parameter("b", (n, k), dtype), eps=1e-5, residual=r)
    g.output("y", y)
    return g


def test_builders_fuse_decode_rows_and_refuse_or_split_the_rest() -> None:
    assert [nd.op.name for nd in _graph((4, 1), 64, 16, True).nodes][-1] == "rmsnorm_matmul"
    apart = [nd.op.name for nd in _graph((9, 1), 64, 16, True).nodes]  # 9 rows: rmsnorm then linear
    assert "rmsnorm_matmul" not in apart and "rmsnorm" in apart and "matmul" in apart
    g = ml.Graph("bad")
    x = g.input("x", (9, 64), "bfloat16")
    w, b = g.parameter("w", (64,), "bfloat16"), g.parameter("b", (16, 64), "bfloat16")
    with pytest.raises(GraphBuildError, match=r"(?s)rmsnorm_matmul: a has 9 rows.*at most 8 rows.*rmsnorm_linear"):
        ml.rmsnorm_matmul(x, b, w, transpose_b=True)
    x2 = g.input("x2", (2, 64), "bfloat16")
    with pytest.raises(GraphBuildError, match=r"rmsnorm_matmul: norm_weight has shape \[32\] but must be \[64\]"):
        ml.rmsnorm_matmul(x2, b, g.parameter("w2", (32,), "bfloat16"), transpose_b=True)
    with pytest.raises(GraphBuildError, match=r"b.s K is 16"):
        ml.rmsnorm_matmul(x2, b, w)  # b [16, 64] not transposed: K 16
    with pytest.raises(GraphBuildError, match=r"residual is bfloat16 \[3,64\] but must be a's"):
        ml.rmsnorm_matmul(x2, b, w, transpose_b=True, residual=g.input("r", (3, 64), "bfloat16"))
    with pytest.raises(GraphBuildError, match="float16 but a is bfloat16"):
        ml.rmsnorm_matmul(x2, g.parameter("b16", (16, 64), "float16"), w, transpose_b=True)
    # where the op does not apply, rmsnorm_linear is rmsnorm then linear: no norm weight, a batched weight,
    # rows too wide for a tile's shared memory (8 float32 rows of 8192: 256 KB)
    x3 = g.input("x3", (8, 1, 8192), "float32")
    w3, b3 = g.parameter("w3", (8192,), "float32"), g.parameter("b3", (16, 8192), "float32")
    for y in (
        ml.rmsnorm_linear(x2, None, b),
        ml.rmsnorm_linear(x2, w, g.parameter("b3d", (2, 16, 64), "bfloat16")),
        ml.rmsnorm_linear(x3, w3, b3),
    ):
        assert y.node.op.name in ("matmul", "add") and "rmsnorm_matmul" not in [n.op.name for n in g.nodes]
    with pytest.raises(GraphBuildError, match=r"(?s)a's rows take 262656 bytes .* at most 81920.*rmsnorm_linear"):
        ml.rmsnorm_matmul(x3, b3, w3, transpose_b=True)


@pytest.mark.parametrize("rows,k,residual", [((1, 1), 2048, True), ((4, 1), 24, False), ((2, 3), 1032, True)])
def test_interpreter_orders_give_the_reference(rows: tuple[int, ...], k: int, residual: bool) -> None:
    g = _graph(rows, k, 40, residual)
    rng = np.random.default_rng(k)
    feeds = {"x": rng.standard_normal((*rows, k)), "r": rng.standard_normal((*rows, k))}
    if not residual:
        del feeds["r"]
    params = {"w": 1 + 0.1 * rng.standard_normal(k), "b": rng.standard_normal((40, k)) / np.sqrt(k)}
    want = ml.evaluate(g, feeds, params).outputs["y"]
    # the reference itself against rmsnorm then linear (the same two roundings)
    apart = ml.Graph("apart")
    x = apart.input("x", (*rows, k), "bfloat16")
    r = apart.input("r", (*rows, k), "bfloat16") if residual else None
    w, b = apart.parameter("w", (k,), "bfloat16"), apart.parameter("b", (40, k), "bfloat16")
    apart.output("y", ml.linear(ml.rmsnorm(x, w, eps=1e-5, residual=r), b))
    assert ml.evaluate(apart, feeds, params).outputs["y"].tobytes() == want.tobytes()
    for seed in range(4):
        got = run_plan(make_plan(g, processors=5), feeds, params, seed=seed).outputs["y"]
        assert_close(got, want, ml.bfloat16, ml.REGISTRY["rmsnorm_matmul"].accuracy, k, "interpreted")
        assert got.tobytes() == want.tobytes()


def test_rows_lie_past_the_partial_sums_and_the_ring_and_a_full_budget_is_refused() -> None:
    src = generate(make_plan(_graph((4, 1), 2048, 512, True), processors=132)).source
    fn = src[src.index("// sig_0: rmsnorm_matmul") :]
    offset = int(re.search(r"ml_smem4\) \+ (\d+)\);  // A's rows, 2080 elements apart", fn).group(1))
    ring = int(re.search(r"// .*?(\d+) rows streaming through shared memory", fn).group(1)) * 2048 * 2 * 2
    assert offset >= ring and offset % 128 == 0  # past the ring of x's and the residual's rows
    assert "rmsnorm of the tile's rows" in fn and "at most 8 rows: tensor cores" in fn
    assert "ml::mma_skinny_after<ml::bf16, 64, 8, 4, true>(in0 + ab, 2080, nr" in fn  # A from the rows, B streamed
    x = Operand(ml.bfloat16, (8, 1, 8192), (8192, 8192, 1))
    ins = [x, Operand(ml.bfloat16, (64, 8192), (8192, 1)), Operand(ml.bfloat16, (8192,), (1,)), x]
    hints = {"tile": (8, 64), "warps": 8, "skinny_mma": 1, "tensor_cores": 1, "shared_memory": 100 * 1024}
    attrs = {"eps": 1e-5, "transpose_a": False, "transpose_b": True, "codegen": hints}
    with pytest.raises(GraphBuildError, match=r"rmsnorm_matmul: A's 8 rows of 8192 .* do not fit"):
        fused_matmul_shared_bytes("rmsnorm_matmul", attrs, ins, Operand(ml.bfloat16, (8, 1, 64), (64, 64, 1)))


def test_matmul_only_tile_switches_are_refused() -> None:
    with pytest.raises(GraphBuildError, match=r"rmsnorm_matmul .*stage_weights is matmul's only"):
        generate(make_plan(_graph((1, 1), 64, 16, True), processors=4, tiles={"rmsnorm_matmul": {"stage_weights": 1}}))


@pytest.mark.parametrize("hidden,sequences", [(2048, 1), (4096, 4)])
def test_decode_layers_compile_without_spills(monkeypatch, hidden: int, sequences: int) -> None:
    """The decode layer with the norms fused (llama.FUSE_DECODE_NORMS, off by default) compiles without
    spills for sm_90a, and for sm_80."""
    monkeypatch.setattr(llama, "FUSE_DECODE_NORMS", True)
    g = dependent_decode_graph(layer_config(hidden, 1), np.zeros((sequences, 1, hidden), np.float32), "auto")
    src = generate(make_plan(g, processors=132)).source
    assert len(re.findall(r"// sig_\d+: rmsnorm_matmul", src)) >= 3  # q / k, v / gate, up
    assert spills(src, "sm_90a") == {}
    assert compile_cubin(src, "sm_80", use_cache=False)[:4] == b"\x7fELF"


def _silu_graphs(rows: tuple[int, ...], k: int, n: int, dtype: str) -> tuple[ml.Graph, ml.Graph]:
    graphs = []
    for fused in (True, False):
        g = ml.Graph("silu-matmul" if fused else "apart")
        gate, up = g.input("g", (*rows, k), dtype), g.input("u", (*rows, k), dtype)
        w = g.parameter("w", (n, k), dtype)
        g.output("y", ml.silu_mul_linear(gate, up, w) if fused else ml.linear(ml.silu_mul(gate, up), w))
        graphs.append(g)
    return graphs[0], graphs[1]


@pytest.mark.parametrize(
    "rows,k,dtype",
    [((1, 1), 8192, "bfloat16"), ((4, 1), 256, "float32"), ((3,), 40, "float16"), ((2,), 13, "bfloat16")],
)
def test_silu_mul_matmul_is_silu_mul_then_the_matmul(rows: tuple[int, ...], k: int, dtype: str) -> None:
    """The reference and the interpreter's random orders equal silu_mul then linear bit for bit (silu_mul's
    rounding, then the same products); the kernel compiles without spills for sm_90a and sm_80."""
    fused, apart = _silu_graphs(rows, k, 24, dtype)
    assert [nd.op.name for nd in fused.nodes][-1] == "silu_mul_matmul"
    rng = np.random.default_rng(k)
    feeds = {"g": rng.standard_normal((*rows, k)), "u": rng.standard_normal((*rows, k))}
    params = {"w": rng.standard_normal((24, k)) / np.sqrt(k)}
    want = ml.evaluate(apart, feeds, params).outputs["y"]
    assert ml.evaluate(fused, feeds, params).outputs["y"].tobytes() == want.tobytes()
    for seed in range(3):
        assert (
            run_plan(make_plan(fused, processors=5), feeds, params, seed=seed).outputs["y"].tobytes() == want.tobytes()
        )
    src = generate(make_plan(fused, processors=132)).source
    assert "silu(gate) * up of the tile's rows: silu_mul's tile code" in src
    assert spills(src, "sm_90a") == {}
    assert compile_cubin(src, "sm_80", use_cache=False)[:4] == b"\x7fELF"


def test_silu_builders_fall_back_and_refuse() -> None:
    g = ml.Graph("silu-bad")
    w = g.parameter("w", (16, 64), "bfloat16")
    nine = ml.silu_mul_linear(g.input("a", (9, 64), "bfloat16"), g.input("b", (9, 64), "bfloat16"), w)
    assert nine.node.op.name == "matmul"  # 9 rows: silu_mul then linear
    x, u = g.input("x", (2, 64), "bfloat16"), g.input("u", (2, 64), "bfloat16")
    assert ml.silu_mul_linear(x, u, g.parameter("w3", (2, 16, 64), "bfloat16")).node.op.name == "matmul"
    with pytest.raises(GraphBuildError, match=r"(?s)silu_mul_matmul: gate has 9 rows.*silu_mul_linear"):
        ml.silu_mul_matmul(g.input("a9", (9, 64), "bfloat16"), w, g.input("b9", (9, 64), "bfloat16"), transpose_b=True)
    with pytest.raises(GraphBuildError, match=r"silu_mul_matmul: up is \[3,64\] but must be gate's \[2,64\]"):
        ml.silu_mul_matmul(x, w, g.input("u3", (3, 64), "bfloat16"), transpose_b=True)
    with pytest.raises(GraphBuildError, match=r"b's K is 16"):
        ml.silu_mul_matmul(x, w, u)
    # arguments the fused op would refuse go to the two ops, whose errors name them (not the fused op's b)
    for bad in (g.parameter("w_k", (16, 32), "bfloat16"), g.parameter("w_f16", (16, 64), "float16")):
        with pytest.raises(GraphBuildError, match=r"^matmul: "):
            ml.silu_mul_linear(x, u, bad)
        with pytest.raises(GraphBuildError, match=r"^matmul: "):
            ml.rmsnorm_linear(x, g.parameter(f"n_{bad.shape[1]}{bad.dtype.name}", (64,), "bfloat16"), bad)


def test_decode_layer_with_silu_inside_down_compiles_without_spills(monkeypatch) -> None:
    monkeypatch.setattr(llama, "FUSE_DECODE_SILU", True)
    # (hidden 4096, 4 sequences: 4 rows of 11008, 88 KB, past FUSED_MATMUL_MAX_BYTES: silu_mul then down)
    for hidden, sequences, fused in ((2048, 1, True), (2048, 4, True), (4096, 4, False)):
        g = dependent_decode_graph(layer_config(hidden, 1), np.zeros((sequences, 1, hidden), np.float32), "auto")
        assert ("silu_mul" not in [nd.op.name for nd in g.nodes]) == fused
        if not fused:
            continue
        src = generate(make_plan(g, processors=132)).source
        assert len(re.findall(r"// sig_\d+: silu_mul_matmul", src)) == 1
        assert spills(src, "sm_90a") == {}

"""attention_partial's append form (megaloop/frontend/ops/attention_split.py): its reference against
an independent float64 formulation (rope, then the cache write, then plain attention) over positions
at 0, at a split boundary and at the last slot, GQA heads, bf16 and fp32, strided k_new / v_new views,
rope's layouts, partial rotary dims and llama3 scaling; the Llama decode step with the append fusion
equal to the unfused one over several steps, and through the plan interpreter in random orders; the
build-time and data errors; the emitted tiles compile with NVRTC for sm_80/86/89/90a without spills.
The loop kernel against the reference: tests/test_gpu_append.py."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

import megaloop as ml
from megaloop.cli import PRESETS
from megaloop.codegen import generate
from megaloop.errors import DataError, GraphBuildError
from megaloop.frontend.ops.attention_split import ATTENTION_PARTIAL
from megaloop.models import LlamaConfig, build_llama, random_parameters
from megaloop.models.llama import build_llama_generator
from megaloop.plan import make_plan
from megaloop.reference.interpreter import run_plan
from tests.helpers import assert_close
from tests.test_plan_interpreter import same, small_tiles

LLAMA3 = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}  # fmt: skip


def rope64(x: np.ndarray, pos: np.ndarray, theta: float, layout: str, rd: int, scaling: dict | None) -> np.ndarray:
    """x [..., d] rotated at pos (broadcast to x's leading axes), float64, written from the papers'
    formulas (not megaloop's): pairs (i, i + rd/2) or (2i, 2i + 1) turned by pos * theta^(-2i/rd)."""
    inv = theta ** (-np.arange(0, rd, 2) / rd)
    if scaling is not None:  # Llama 3.1's wavelength bands
        old, f = scaling["original_max_position_embeddings"], scaling["factor"]
        lo, hi = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wl = 2 * math.pi / inv
        mix = (old / wl - lo) / (hi - lo)
        inv = np.where(wl < old / hi, inv, np.where(wl > old / lo, inv / f, (1 - mix) * inv / f + mix * inv))
    ang = np.asarray(pos, np.float64)[..., None] * inv
    c, s = np.cos(ang), np.sin(ang)
    out = x.astype(np.float64).copy()
    a, b = (
        (np.arange(rd // 2), np.arange(rd // 2) + rd // 2)
        if layout == "neox"
        else (np.arange(0, rd, 2), np.arange(1, rd, 2))
    )
    xa, xb = x[..., a].astype(np.float64), x[..., b].astype(np.float64)
    out[..., a], out[..., b] = xa * c - xb * s, xb * c + xa * s
    return out


def attention64(q, k, v, pos, tk_len=None, window=None):
    """Dense float64 causal attention of one query a sequence at pos over keys j <= pos (GQA)."""
    b, hq, _, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    group = hq // hkv
    out = np.zeros((b, hq, 1, v.shape[3]))
    for bi in range(b):
        p = int(pos[bi, 0])
        j = np.arange(tk)
        seen = (j <= p) & (j < (tk if tk_len is None else tk_len[bi]))
        if window is not None:
            seen &= j > p - window
        for h in range(hq):
            s = k[bi, h // group] @ q[bi, h, 0] / math.sqrt(d)
            s = np.where(seen, s, -np.inf)
            w = np.exp(s - s.max()) if seen.any() else np.zeros(tk)
            out[bi, h, 0] = (w / max(w.sum(), 1e-300)) @ v[bi, h // group] if seen.any() else 0.0
    return out


def rounded(x: np.ndarray, dtype: ml.DType) -> np.ndarray:
    return x.astype(dtype.np).astype(np.float64)


CASES = [  # (dtype, b, hq, hkv, tk, splits, d, positions, rope, window)
    ("bfloat16", 2, 8, 2, 24, 3, 64, [0, 8], {}, None),  # position 0; the first key of split 1
    ("float32", 2, 4, 2, 24, 3, 16, [16, 23], {}, None),  # a split boundary; the last slot
    ("bfloat16", 1, 6, 3, 30, 4, 32, [7], {"layout": "interleaved", "theta": 500000.0}, None),
    ("float32", 2, 4, 1, 20, 2, 32, [9, 10], {"rotary_dim": 16, "scaling": LLAMA3}, None),
    ("bfloat16", 2, 4, 2, 40, 4, 16, [25, 39], {}, 7),  # a sliding window
    ("float16", 1, 2, 1, 12, 1, 8, [5], {}, None),  # one range: the append form still splits
]


def _append_graph(dtype, b, hq, hkv, tk, splits, d, rope, window, lengths=False):
    """The append form over inputs shaped as a decode step's: q and k_new, v_new as the projections
    give them ([b, 1, heads * d], reshaped and transposed: strided views), the caches' old values."""
    g = ml.Graph("append")
    qp = g.input("q", (b, 1, hq * d), dtype)
    kp, vp = g.input("kp", (b, 1, hkv * d), dtype), g.input("vp", (b, 1, hkv * d), dtype)
    k, v = g.input("k", (b, hkv, tk, d), dtype), g.input("v", (b, hkv, tk, d), dtype)
    pos = g.input("pos", (b, 1), "int64")
    lens = g.input("lens", (b,), "int64") if lengths else None

    def heads(x, n):
        return x.reshape(b, 1, n, d).transpose(1, 2)

    out = ml.attention(heads(qp, hq), k, v, causal=True, q_positions=pos, kv_lengths=lens, window=window,
                       kv_splits=splits, k_new=heads(kp, hkv), v_new=heads(vp, hkv), rope=rope)  # fmt: skip
    g.output("out", out)
    return g


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-tk{c[4]}-s{c[5]}-d{c[6]}-p{c[7]}")
def test_reference_is_rope_then_the_cache_write_then_attention(case) -> None:
    dtype, b, hq, hkv, tk, splits, d, positions, rope, window = case
    dt = ml.as_dtype(dtype)
    g = _append_graph(dt, b, hq, hkv, tk, splits, d, rope, window)
    assert [n.op.name for n in g.nodes if n.op.tiling] == ["attention_partial", "attention_combine"]
    rng = np.random.default_rng(tk + d)
    feeds = {n: rounded(rng.standard_normal(s), dt) for n, s in
             (("q", (b, 1, hq * d)), ("kp", (b, 1, hkv * d)), ("vp", (b, 1, hkv * d)),
              ("k", (b, hkv, tk, d)), ("v", (b, hkv, tk, d)))}  # fmt: skip
    pos = np.array(positions, np.int64).reshape(b, 1)
    got = ml.evaluate(g, {**feeds, "pos": pos}).outputs["out"]
    # independently: rope of q and of the new key, each stored in the dtype, the caches written, attention
    rd = rope.get("rotary_dim", d)
    args = (rope.get("theta", 10000.0), rope.get("layout", "neox"), rd, rope.get("scaling"))
    q = rounded(rope64(feeds["q"].reshape(b, 1, hq, d).transpose(0, 2, 1, 3), pos[:, None, :], *args), dt)
    k_new = rounded(rope64(feeds["kp"].reshape(b, hkv, d), pos, *args), dt)
    k, v = feeds["k"].copy(), feeds["v"].copy()
    for bi in range(b):
        k[bi, :, pos[bi, 0]] = k_new[bi]
        v[bi, :, pos[bi, 0]] = feeds["vp"].reshape(b, hkv, d)[bi]
    want = attention64(q, k, v, pos, window=window)
    assert_close(got, want, dt, ATTENTION_PARTIAL.accuracy, tk + d, f"append {case}")


def test_keys_past_the_lengths_and_the_new_key_past_them_stay_unseen() -> None:
    """kv_lengths below the new position hide it (and the keys from there on)."""
    dt = ml.float32
    g = _append_graph(dt, 2, 4, 2, 16, 2, 16, {}, None, lengths=True)
    rng = np.random.default_rng(3)
    feeds = {
        n: rng.standard_normal(t.shape).astype(np.float32) for n, t in g.inputs.items() if n not in ("pos", "lens")
    }
    pos, lens = np.array([[9], [4]]), np.array([6, 16])
    got = ml.evaluate(g, {**feeds, "pos": pos, "lens": lens}).outputs["out"]
    q = rope64(feeds["q"].reshape(2, 1, 4, 16).transpose(0, 2, 1, 3), pos[:, None, :], 10000.0, "neox", 16, None)
    k, v = feeds["k"].astype(np.float64), feeds["v"].astype(np.float64)
    k[1, :, 4] = rope64(feeds["kp"].reshape(2, 2, 16), pos, 10000.0, "neox", 16, None)[1]
    v[1, :, 4] = feeds["vp"].reshape(2, 2, 16)[1]
    want = attention64(q.astype(np.float32).astype(np.float64), k.astype(np.float32), v, pos, tk_len=lens)
    assert_close(got, want, dt, ATTENTION_PARTIAL.accuracy, 32, "lengths")


def test_a_position_outside_the_caches_is_a_data_error() -> None:
    g = _append_graph(ml.float32, 1, 2, 1, 8, 2, 8, {}, None)
    feeds = {n: np.zeros(t.shape, np.float32) for n, t in g.inputs.items() if n != "pos"}
    with pytest.raises(
        DataError, match=r"q_positions\[0, 0\] is 8: the new key goes to a slot of the caches, in \[0, 8\)"
    ):
        ml.evaluate(g, {**feeds, "pos": np.array([[8]])})


def _operands(g: ml.Graph, tq: int = 1, dtype: str = "float32"):
    q = g.input("q", (1, 4, tq, 16), "float32")
    k, v = g.input("k", (1, 2, 8, 16), dtype), g.input("v", (1, 2, 8, 16), "float32")
    kn, vn = g.input("kn", (1, 2, 1, 16), "float32"), g.input("vn", (1, 2, 1, 16), "float32")
    return q, k, v, g.input("pos", (1, tq), "int64"), kn, vn


@pytest.mark.parametrize(
    "change, message",
    [
        ({"rope": None}, "takes k_new, v_new and rope together; rope missing"),
        ({"v_new": None}, "takes k_new, v_new and rope together; v_new missing"),
        ({"kv_splits": None}, "pass kv_splits .* and q_positions"),
        ({"q_positions": None}, "pass kv_splits .* and q_positions"),
        ({"rope": {"base": 1e4}}, "rope must be a dict of rope's keywords"),
        ({"rope": {"theta": 0.5}}, "theta must be > 1"),
        ({"rope": {"rotary_dim": 18}}, "rotary_dim 18 must be even and between 2 and head_dim 16"),
        ({"causal": False}, "q_positions only matter for a causal mask"),
        ({"k_new": "wide"}, r"k_new must be \[batch, kv_heads, 1, dim\] = \[1,2,1,16\], got \[1,2,2,16\]"),
        ({"v_new": "half"}, "v_new is float16 but the v cache is float32"),
    ],
)
def test_build_errors_name_what_is_wrong(change, message) -> None:
    g = ml.Graph("bad")
    q, k, v, pos, kn, vn = _operands(g)
    kw = {"causal": True, "q_positions": pos, "kv_splits": 2, "k_new": kn, "v_new": vn, "rope": {}}
    kw.update(change)
    if change.get("k_new") == "wide":
        kw["k_new"] = g.input("kn2", (1, 2, 2, 16), "float32")
    if change.get("v_new") == "half":
        kw["v_new"] = g.input("vn2", (1, 2, 1, 16), "float16")
    with pytest.raises(GraphBuildError, match=message):
        ml.attention(q, k, v, **kw)


def test_more_than_one_query_a_sequence_is_refused() -> None:
    g = ml.Graph("bad")
    q, k, v, pos, kn, vn = _operands(g, tq=2)
    with pytest.raises(GraphBuildError, match=r"one query a sequence \(q_len 1, got 2\)"):
        ml.attention(q, k, v, causal=True, q_positions=pos, kv_splits=2, k_new=kn, v_new=vn, rope={})


# ---- the Llama decode step -----------------------------------------------------------------------------

CFG = LlamaConfig(hidden=32, heads=4, kv_heads=2, intermediate=48, layers=2, max_seq=12, vocab=40)


def test_the_decode_layer_writes_its_caches_after_attention() -> None:
    """No rope stage; attention reads the caches' old values and the projections; the writes read the
    projections only, so nothing on the way to the next layer waits for them."""
    g = ml.fuse(build_llama(CFG, 2, 1, "decode", kv_splits=3))
    names = [n.op.name for n in g.nodes if n.op.tiling]
    assert "rope" not in names and names.count("attention_partial") == 2
    for node in g.nodes:
        if node.op.name == "attention_partial":
            assert {t.node.op.name for t in node.inputs[1:3]} == {"state"}
            assert node.attrs["theta"] == CFG.rope_theta
        if node.op.name in ("rope_kv_cache_update", "kv_cache_update"):
            assert node.inputs[0].node.op.name == "state"
            assert not any(node in (t.node for t in other.inputs) for other in g.nodes)  # no reader
    unfused = ml.fuse(build_llama(CFG, 2, 1, "decode", kv_splits=3), ml.FuseOptions(off=("attention_append",)))
    assert [n.op.name for n in unfused.nodes if n.op.tiling].count("rope") == 2  # q's, a layer


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_generation_with_append_equals_the_unfused_model(dtype) -> None:
    """Several steps, each seeing the key the step before appended: the same tokens and logits (the
    same rounding of q and of the stored key as the rope ops)."""
    cfg = dataclasses.replace(CFG, dtype=dtype)
    params = random_parameters(cfg, seed=5)
    state = {"token": np.array([[3], [7]]), "position": np.array([[0], [4]])}
    out = {}
    plain = build_llama_generator(cfg, 2, kv_splits=3)
    for name, off in (("none", ("attention_append",)), ("append", ("rmsnorm_linear", "swiglu_linear")), ("all", ())):
        g = ml.fuse(plain, ml.FuseOptions(off=off))
        out[name] = ml.evaluate(g, {}, params, state, iterations=7)
    want = out["none"]
    for name in ("append", "all"):
        got = out[name]
        assert np.array_equal(got.state["generated"], want.state["generated"]), name
        diff = np.abs(got.outputs["logits"].astype(np.float64) - want.outputs["logits"].astype(np.float64)).max()
        scale = np.abs(want.outputs["logits"].astype(np.float64)).max()
        assert diff <= 8 * ml.as_dtype(dtype).eps * scale, f"{name}: logits differ by {diff} (scale {scale})"
        for layer in range(cfg.layers):
            for c in ("k_cache", "v_cache"):
                key = f"model.layers.{layer}.self_attn.{c}"
                assert np.array_equal(got.state[key], want.state[key]), f"{name}: {key}"


@pytest.mark.parametrize("processors", [1, 7, 132])
def test_generation_with_append_through_the_plan(processors) -> None:
    """Random legal orders of the tasks, several iterations: bitwise the graph's evaluation (the cache
    writes after every read of the old values, before the next step's reads)."""
    params = random_parameters(CFG, seed=5)
    g = build_llama_generator(CFG, 2, kv_splits=3)  # (plain: the plan's graph is fused)
    state = {"token": np.array([[3], [7]]), "position": np.array([[0], [4]])}
    plan = make_plan(g, processors=processors, tiles=small_tiles([g]))
    refs = {n: ml.evaluate(g, {}, params, state, iterations=n) for n in (1, 3, 5)}
    for seed in range(6):
        n = (1, 3, 5)[seed % 3]
        same(run_plan(plan, {}, params, state, iterations=n, seed=seed), refs[n], f"P={processors} seed {seed}")


# ---- the tiles compile -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "arch, target", [("sm_90", "sm_90a"), ("sm_80", "sm_80"), ("sm_86", "sm_86"), ("sm_89", "sm_89")]
)
def test_the_append_tiles_compile_without_spills(arch, target) -> None:
    """Llama-3.2-1B's decode step (split keys, bf16) and the table's variants: fp32, fp16, interleaved
    pairs, partial rotary dims, heads the split-key path does not take (a warp a row)."""
    from tests.test_attention_templates import PARTIAL, assert_compiles_without_spills, template_calls

    g = ml.Graph("append-variants")
    for n, (dtype, d, rope) in enumerate([
        ("float32", 64, {}),
        ("float16", 128, {"layout": "interleaved"}),
        ("bfloat16", 64, {"rotary_dim": 32, "scaling": LLAMA3}),
        ("bfloat16", 40, {}),  # 5 packs of 8: a warp a row
        ("float32", 12, {"layout": "interleaved"}),
    ]):  # fmt: skip
        dt = ml.as_dtype(dtype)
        qp, kp = g.input(f"q{n}", (2, 1, 8 * d), dt), g.input(f"kp{n}", (2, 1, 2 * d), dt)
        vp = g.input(f"vp{n}", (2, 1, 2 * d), dt)
        k, v = g.input(f"k{n}", (2, 2, 96, d), dt), g.input(f"v{n}", (2, 2, 96, d), dt)
        pos = g.input(f"pos{n}", (2, 1), "int64")
        heads = lambda x, h, d=d: x.reshape(2, 1, h, d).transpose(1, 2)
        out = ml.attention(heads(qp, 8), k, v, causal=True, q_positions=pos, kv_splits=3,
                           k_new=heads(kp, 2), v_new=heads(vp, 2), rope=rope)  # fmt: skip
        g.output(f"o{n}", out)
    cfg = dataclasses.replace(PRESETS["llama3.2-1b"], max_seq=256, layers=1)
    for graph in (g, build_llama_generator(cfg, 1, kv_splits="auto")):
        src = generate(make_plan(graph, processors=132, arch=arch)).source
        partial = {s: c for s, c in template_calls(src).items() if c.startswith("ml::attention_partial<")}
        assert partial and all("ml::attn_append<" in c for c in partial.values()), partial
        paths = {PARTIAL.search(c)[9] for c in partial.values()}  # SplitKeys
        assert paths == ({"true", "false"} if graph is g else {"true"}), (graph.name, paths)
        assert_compiles_without_spills(src, target, f"{graph.name} on {target}", set(partial))

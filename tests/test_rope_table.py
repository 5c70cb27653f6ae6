"""rope_table (rope from given cos and sin tables, megaloop/frontend/ops/rope_table.py) beyond the op
table's rows: transformers' own apply_rotary_pos_emb as the reference, tables made from rope's angles
giving rope's result, the generated tile run on the CPU through g++ (the reference's bits), the kernel
compiled for sm_90a and sm_80, and the build errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import megaloop as ml
from megaloop.codegen import emit, generate
from megaloop.errors import ShapeError
from megaloop.frontend.tiling import Box, chunks
from megaloop.plan import make_plan
from megaloop.runtime.compile import compile_cubin
from tests.test_rope_kv_codegen import Arena, contiguous, heads_view, needs_cxx, run_on_cpu


def test_transformers_apply_rotary_pos_emb_is_the_reference() -> None:
    """q and k [batch, heads, tokens, dim] with transformers' [batch, tokens, dim] tables, unsqueezed
    at the heads axis as transformers does: the float64 result rounded once to float32."""
    rng = np.random.default_rng(0)
    b, hq, hkv, t, d = 2, 4, 2, 7, 16
    angles = rng.uniform(0, 50, (b, t, d // 2))
    cos = np.concatenate([np.cos(angles)] * 2, -1).astype(np.float32)
    sin = np.concatenate([np.sin(angles)] * 2, -1).astype(np.float32)
    q = rng.standard_normal((b, hq, t, d)).astype(np.float32)
    k = rng.standard_normal((b, hkv, t, d)).astype(np.float32)
    g = ml.Graph("hf-rope")
    tq, tk = g.input("q", q.shape, "float32"), g.input("k", k.shape, "float32")
    c, s = g.input("cos", (b, 1, t, d), "float32"), g.input("sin", (b, 1, t, d), "float32")
    g.output("q", ml.rope_table(tq, c, s))
    g.output("k", ml.rope_table(tk, c, s))
    feeds = {"q": q, "k": k, "cos": cos[:, None], "sin": sin[:, None]}
    got = ml.evaluate(g, feeds).outputs
    want = apply_rotary_pos_emb(*(torch.from_numpy(a).double() for a in (q, k, cos, sin)))
    for name, w in zip(("q", "k"), want):
        assert np.array_equal(got[name], w.numpy().astype(np.float32)), name


@pytest.mark.parametrize("layout", ["neox", "interleaved"])
def test_tables_of_ropes_angles_give_ropes_result(layout: str) -> None:
    """Per-pair tables cos(p * inv_freq), sin(p * inv_freq) (float32) against rope at positions p:
    the same rotation, within the tables' own rounding."""
    rng = np.random.default_rng(1)
    b, h, t, d, rd = 2, 3, 5, 24, 16
    pos = rng.integers(0, 4000, (b, t))
    inv = ml.inv_frequencies(rd, 10000.0)
    angle = pos[..., None].astype(np.float64) * inv
    g = ml.Graph("rope-vs-table")
    x = g.input("x", (b, h, t, d), "float32")
    p = g.input("p", (b, t), "int64")
    c, s = g.input("cos", (b, 1, t, rd // 2), "float32"), g.input("sin", (b, 1, t, rd // 2), "float32")
    g.output("rope", ml.rope(x, ml.reshape(p, (b, 1, t)), layout=layout, rotary_dim=rd))
    g.output("table", ml.rope_table(x, c, s, layout=layout, rotary_dim=rd))
    feeds = {"x": rng.standard_normal((b, h, t, d)).astype(np.float32), "p": pos}
    feeds |= {"cos": np.cos(angle)[:, None].astype(np.float32), "sin": np.sin(angle)[:, None].astype(np.float32)}
    out = ml.evaluate(g, feeds).outputs
    err = np.abs(out["rope"] - out["table"]).max()
    assert err < 4 * np.finfo(np.float32).eps * np.abs(feeds["x"]).max(), f"worst {err:.3e}"
    assert np.array_equal(out["rope"][..., rd:], feeds["x"][..., rd:])


@pytest.mark.parametrize(
    "tables, kw, words",
    [
        ((7, 16), {}, "the tables' leading axes [7] must broadcast to x's [2,4,5]"),
        ((5, 18), {}, "rotary_dim 18 must be even and between 2 and head_dim 16"),
        ((5, 6), {"rotary_dim": 16}, "the tables' width 6 must be rotary_dim 16 \\(a value a dim\\) or 8"),
        ((5, 9), {}, "rotary_dim 9 must be even"),
    ],
)
def test_tables_that_do_not_fit_are_refused(tables, kw, words) -> None:
    g = ml.Graph("bad-table")
    x = g.input("x", (2, 4, 5, 16), "float32")
    c = g.input("c", tables, "float32")
    with pytest.raises(ShapeError, match="rope_table: " + words.replace("[", r"\[").replace("]", r"\]")):
        ml.rope_table(x, c, c, **kw)


CPU_CASES = [
    # (x, table shape, layout, rotary_dim, rows a task)
    (heads_view("bfloat16", 1, 4, 9, 64), (9, 64), "neox", 64, 8),  # a prefill's view of the projection
    (contiguous("float32", (2, 3, 5, 24)), (2, 1, 5, 8), "neox", 16, 4),  # a value a pair, partial
    (contiguous("float16", (2, 3, 5, 20)), (5, 12), "interleaved", 12, 7),  # a value a dim, partial
    (contiguous("bfloat16", (2, 3, 5, 8)), (1, 2), "interleaved", 4, 30),  # one row of the tables for all
]


@needs_cxx
@pytest.mark.parametrize("case", range(len(CPU_CASES)))
def test_the_generated_tile_gives_the_references_bits(case: int, tmp_path: Path) -> None:
    x, shape, layout, rd, rows = CPU_CASES[case]
    cos, sin, out = contiguous("float32", shape), contiguous("bfloat16", shape), contiguous(x.dtype.name, x.shape)
    rng = np.random.default_rng(case)
    xv = ml.dtypes.round_to(rng.standard_normal(x.shape), x.dtype)
    cv, sv = (ml.dtypes.round_to(rng.uniform(-1, 1, shape), t.dtype) for t in (cos, sin))
    body = emit.rope_table("rope_table", {"layout": layout, "rotary_dim": rd}, x, cos, sin, out)
    boxes = [Box(b.lo + (0,), b.hi + (x.shape[-1],)) for b in chunks(x.shape[:-1], rows)]
    arena = Arena([x, cos, sin, out])
    for k, v in enumerate((xv, cv, sv)):
        arena.write(k, v)
    assert run_on_cpu(body, tmp_path, arena.bytes, arena.offsets, boxes)[0] == 0
    g = ml.Graph("table")
    ins = [g.input(n, o.shape, o.dtype) for n, o in zip("xcs", (x, cos, sin))]
    g.output("y", ml.rope_table(*ins, layout=layout, rotary_dim=rd))
    want = ml.evaluate(g, dict(zip("xcs", (xv, cv, sv)))).outputs["y"]
    assert np.array_equal(arena.read(3).view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_the_tile_compiles_for_the_gpu(arch: str) -> None:
    g = ml.Graph("rope-table")
    for dtype in ("float32", "bfloat16"):
        x = g.input(f"x_{dtype}", (2, 4, 9, 64), dtype)
        c = g.input(f"c_{dtype}", (2, 1, 9, 32), "float32")
        g.output(f"pairs_{dtype}", ml.rope_table(x, c, c, rotary_dim=64))
        g.output(f"dims_{dtype}", ml.rope_table(x, c, c, layout="interleaved"))
    source = generate(make_plan(g, processors=8, arch=arch.rstrip("a"))).source
    assert source.count("ml::rope_table<") == 4  # (a tile function a dtype and table form)
    assert compile_cubin(source, arch, use_cache=False)[:4] == b"\x7fELF"

"""The rope, KV cache update, embedding and concat tiles are calls of the header templates in
megaloop/rope.cuh, megaloop/cache.cuh and megaloop/gather.cuh (the loops live there; Python writes the
template arguments): every such tile function of the op table's rows and of Llama-3.2-1B-shaped decode
and prefill steps is one call, its arguments say the paths the emitter chose, and the kernels compile
for sm_90a and sm_80 without spills. What the tiles compute is checked on the CPU against the reference
and a model of their arithmetic (tests/test_rope_kv_codegen.py) and on a GPU (tests/test_gpu.py)."""

from __future__ import annotations

import re

import pytest

import megaloop as ml
from megaloop.cli import PRESETS
from megaloop.codegen import emit, generate
from megaloop.models import build_llama, build_llama_generator
from megaloop.plan import make_plan
from megaloop.runtime.compile import spills
from tests.op_table import ROWS, build_row
from tests.test_rope_kv_codegen import contiguous, heads_view, rope_attrs
from tests.test_row_templates import tile_functions

CALLS = {
    "rope": "ml::rope<",
    "kv_cache_update": "ml::kv_update<",
    "rope_kv_cache_update": "ml::rope_kv_update<",
    "embedding": "ml::embedding<",
    "concat": "ml::concat<",
}
ARCHS = {"sm_90": "sm_90a", "sm_80": "sm_80"}  # plan arch -> the compile's (an H200's, an A100's)
TABLE = re.compile(r"^static constexpr double inv_freq\[\d+\] = \{[^}]*\};$")  # rope's frequencies, as data


def assert_template_calls(src: str) -> dict[str, int]:
    """Every tile function of ``src`` for the ops of CALLS is one template call: pointers, comments,
    rope's frequency table and that call, no loop or lambda of its own. Returns how many of each op."""
    found = dict.fromkeys(CALLS, 0)
    for sig, (op, body) in tile_functions(src).items():
        if op not in CALLS:
            continue
        found[op] += 1
        assert body.count(CALLS[op]) == 1, f"{sig} ({op}) is not one {CALLS[op]} call:\n{body}"
        lines = [line.strip() for line in body.splitlines()]
        code = [x for x in lines if not x.startswith("//") and "(a.arena + off[" not in x and not TABLE.match(x)]
        assert len(code) == 1 and code[0].startswith(CALLS[op]), f"{sig} ({op}) has more than the call:\n{body}"
        assert "for (" not in body and "[&]" not in body and "ml::fail" not in body, f"{sig} ({op}):\n{body}"
    return found


def table_graph(dtype: str) -> ml.Graph:
    """Two draws of every op table row of these ops that takes ``dtype``."""
    g = ml.Graph(f"rope-cache-templates-{dtype}")
    n = 0
    for row in ROWS:
        if row.op in CALLS and dtype in row.dtypes:
            for seed in range(2):
                build_row(row, dtype, seed, graph=g, prefix=f"r{n}.")
                n += 1
    return g


def llama_1b_graphs() -> dict[str, tuple[ml.Graph, dict]]:
    """A Llama-3.2-1B decode step (the generator, split-key attention) and a 128-token prefill, one layer
    (the layers share their tile functions), each with its make_plan arguments."""
    base = PRESETS["llama3.2-1b"]
    cfg = type(base)(**{**base.__dict__, "max_seq": 256, "layers": 1})
    return {
        "decode": (build_llama_generator(cfg, 1, kv_splits="auto"), {}),
        "prefill": (build_llama(cfg, 1, 128), {"tiles": {"matmul": {"tensor_cores": 1}}}),
    }


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int32", "int64"])
def test_table_rows_are_template_calls_and_compile_without_spills(dtype: str) -> None:
    g = table_graph(dtype)
    for plan_arch, arch in ARCHS.items():
        src = generate(make_plan(g, processors=8, arch=plan_arch)).source
        found = assert_template_calls(src)
        assert sum(found.values()) > 0
        if dtype.startswith("float"):  # (the int dtypes take embedding and concat only)
            assert all(found.values()), found
        assert spills(src, arch) == {}, arch  # (NVRTC compiles the kernel, with ptxas -v)


@pytest.mark.parametrize("step", ["decode", "prefill"])
def test_llama_1b_tiles_are_template_calls_without_spills(step: str) -> None:
    """(The kernel function itself is not judged here: at sm_90a the prefill's spills 72 / 172 bytes,
    from the tensor-core matmul inlined into it.)"""
    g, kw = llama_1b_graphs()[step]
    for plan_arch, arch in ARCHS.items():
        src = generate(make_plan(g, processors=132, arch=plan_arch, **kw)).source
        found = assert_template_calls(src)
        assert found["kv_cache_update"] and found["embedding"], found
        # decode: q's rope is in the attention tiles (the append form), the key's in its cache write
        want = (False, True) if step == "decode" else (True, False)
        assert (found["rope"] > 0, found["rope_kv_cache_update"] > 0) == want, found
        ours = {sig for sig, (op, _) in tile_functions(src).items() if op in CALLS}
        spilled = [f for f in spills(src, arch) if re.sub(r"^_Z\d+(sig_\d+)R.*", r"\1", f) in ours]
        assert not spilled, (arch, spilled)


@pytest.mark.parametrize(
    ("x", "layout", "rd", "call"),
    [
        # decode's 32 query heads: 4-wide packs (a pack a thread), one item; only axis 1 moves (0b10)
        (heads_view("bfloat16", 1, 32, 1, 64), "neox", 64, "ml::rope<64, 64, true, 4, 1, 2u>"),
        # prefill: 16-byte packs, axes 1 and 2 move; interleaved pairs
        (heads_view("bfloat16", 1, 32, 128, 64), "interleaved", 64, "ml::rope<64, 64, false, 8, 4, 6u>"),
        # 3 dims past rotary_dim: no pair-sized pack, the per-element path only (width 0)
        (contiguous("bfloat16", (2, 5, 7)), "interleaved", 4, "ml::rope<7, 4, false, 0, 1, 3u>"),
    ],
)
def test_the_rope_call_carries_the_chosen_path(x, layout: str, rd: int, call: str) -> None:
    """ml::rope<head_dim, rotary_dim, neox, pack width, items in flight, moving axes>, the frequencies
    as a table beside it and pos in the index space of x's leading axes (0 where it is broadcast)."""
    pos = contiguous("int64", (x.shape[0], 1, x.shape[2]) if len(x.shape) == 4 else x.shape[:-1])
    body = "\n".join(emit.rope("rope", rope_attrs(layout, rd), x, pos, contiguous(x.dtype.name, x.shape)))
    assert call + "(t, inv_freq, " in body, body
    if len(x.shape) == 4:  # pos [1, 1, tokens]: only its last axis can move
        assert f"ml::at<0, 0, {int(x.shape[2] > 1)}>(in1)" in body, body


def test_the_cache_calls_carry_the_chosen_path() -> None:
    """ml::kv_update<max_len, tokens, head_dim, skip negative, pack width, packs in flight> and
    ml::rope_kv_update<max_len, tokens, head_dim, rotary_dim, neox, items in flight>, both given the
    arguments they report a bad position with."""
    cache, new = contiguous("bfloat16", (1, 8, 256, 64)), heads_view("bfloat16", 1, 8, 1, 64)
    pos = contiguous("int64", (1, 1))
    body = "\n".join(emit.kv_update("kv_cache_update", {"ignore_negative": True}, cache, new, pos, cache))
    assert "ml::kv_update<256, 1, 64, true, 8, 1>(a, t, tid, ml::at<131072, 16384, 64, 1>(out0), " in body, body
    body = "\n".join(emit.rope_kv_update("k", rope_attrs("neox", 64), cache, new, pos, cache))
    assert "ml::rope_kv_update<256, 1, 64, 64, true, 1>(a, t, tid, inv_freq, " in body, body
    long = contiguous("bfloat16", (1, 1, 1 << 29, 3))  # over 2^30 single-element copies: the per-element loop
    body = "\n".join(emit.kv_update("kv_cache_update", {}, long, long, contiguous("int64", (1, 1 << 29)), long))
    assert f"ml::kv_update<{1 << 29}, {1 << 29}, 3, false, 0, 1>" in body and "batched path" not in body, body

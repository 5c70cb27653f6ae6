"""The attention tiles are calls of the header templates in megaloop/attention.cuh (the loops, the
online softmax, the split-key merge and the tensor-core path live there; Python writes the shapes,
strides and paths as template arguments): every attention, attention_partial and attention_combine
tile function of the op table's rows and of the Llama decode and prefill plans is one call, its
arguments say the paths emit_attention chose, and the kernels compile for sm_90a and sm_80 without
spills. What the tiles compute is checked against torch on a GPU (tests/test_gpu.py: the op table,
prefill on tensor cores, split-key decode); scripts/emulation/split_attention_edge.py models the
split-key path from the same calls."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

import megaloop as ml
from megaloop.cli import PRESETS
from megaloop.codegen import emit_attention, generate
from megaloop.codegen.emit import Operand
from megaloop.codegen.emit_attention import COMBINE_HELD_SPLITS, attention, attention_combine, attention_partial
from megaloop.models import build_llama, build_llama_generator
from megaloop.plan import Plan, make_plan
from megaloop.runtime.compile import spills
from tests.op_table import ROWS, build_row
from tests.test_row_templates import tile_functions

OPS = ("attention", "attention_partial", "attention_combine")
CALLS = {op: f"ml::{op}<" for op in OPS}
SHAPE = r"ml::AttnShape<(\d+), (\d+), (\d+), (\d+), (\d+), (true|false), (\d+)(?:, /\* softcap [^*]* \*/ \d+u)?>"
LANES = r"(?:, ml::Lanes<\d+, \d+, \d+>)?"  # the decode tile of lanes over keys, where it applies
ATTENTION = re.compile(rf"ml::attention<{SHAPE}, (\d+), (true|false){LANES}>\(")
PARTIAL = re.compile(rf"ml::attention_partial<{SHAPE}, (\d+), (true|false){LANES}>\(")
HEADER = Path(emit_attention.__file__).parent / "include" / "megaloop" / "attention.cuh"


def table_graph(dtype: str, seeds: range = range(2), masked: bool | None = None) -> ml.Graph:
    """Draws of every op table row of attention and its split form that takes ``dtype`` (``masked``:
    only the rows with a mask operand, or only those without)."""
    g = ml.Graph(f"attention-templates-{dtype}")
    n = 0
    for row in ROWS:
        if row.op in OPS and dtype in row.dtypes and masked in (None, "mask" in row.label):
            for seed in seeds:
                build_row(row, dtype, seed, graph=g, prefix=f"r{n}.")
                n += 1
    return g


def llama_plans(arch: str) -> dict[str, Plan]:
    """Llama-3.2-1B's decode step (split keys over a 256-key cache) and a 128-token prefill layer
    (tensor cores), two layers and one: every layer's attention is the same tile function."""
    cfg = dataclasses.replace(PRESETS["llama3.2-1b"], max_seq=256, layers=2)
    return {
        "decode": make_plan(build_llama_generator(cfg, 1, kv_splits="auto"), processors=132, arch=arch),
        "prefill": make_plan(
            build_llama(dataclasses.replace(cfg, layers=1), 1, 128),
            processors=132,
            arch=arch,
            tiles={"matmul": {"tensor_cores": 1}},
        ),
    }


def template_calls(src: str) -> dict[str, str]:
    """Every attention tile function of ``src`` is one template call: pointers, comments, rope's
    frequencies (the append form) and that call, no loop or shared memory of its own. Returns sig ->
    (op, the call)."""
    calls = {}
    for sig, (op, body) in tile_functions(src).items():
        if op not in CALLS:
            continue
        assert body.count(CALLS[op]) == 1, f"{sig} ({op}) is not one {CALLS[op]} call:\n{body}"
        lines = [line.strip() for line in body.splitlines()]
        code = [
            line
            for line in lines
            if not line.startswith(("//", "static constexpr double inv_freq[")) and "(a.arena + off[" not in line
        ]
        assert len(code) == 1 and code[0].startswith(CALLS[op]), f"{sig} ({op}) has more than the call:\n{body}"
        assert "for (" not in body and "__shared__" not in body, f"{sig} ({op}): a loop of its own\n{body}"
        calls[sig] = code[0]
    return calls


def assert_compiles_without_spills(src: str, arch: str, name: str, sigs: set[str]) -> None:
    """No attention tile function (``sigs``) of ``src`` spills on ``arch``. (The loop kernel's own
    function is left out: it holds its registers across every tile's call and can spill where the
    tiles take most of them, as the Llama prefill kernel's does on sm_90a.)"""
    found = spills(src, arch)
    tiles = {f: v for f, v in found.items() if (m := re.search(r"(sig_\d+)R", f)) and m[1] in sigs}
    assert tiles == {}, f"{name} on {arch}: spills (bytes stored, loaded) {tiles}"


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_table_rows_are_template_calls_and_compile_without_spills(dtype: str) -> None:
    """Two kernels, the rows without a mask and those with one: ptxas's registers for a 128-wide
    head's tensor-core tile of 16-bit floats (at the edge without spills) depend on the module's other
    functions (measured: a tile that does not spill in either kernel spilled 4 bytes in one kernel of
    both, December 2026), and a model's kernel holds one or two attention tiles, not forty."""
    for arch, target in (("sm_90", "sm_90a"), ("sm_80", "sm_80")):
        calls = ""
        for masked in (False, True):
            src = generate(make_plan(table_graph(dtype, masked=masked), processors=8, arch=arch)).source
            found = template_calls(src)
            calls += " ".join(found.values())
            # the mask operand: the last (an append form's attn_append after it), Absent without one
            ends = {c.endswith("ml::Absent{});") for c in found.values() if "attn_append" not in c and "<ml::Attn" in c}
            assert ends == {not masked}, (dtype, arch, masked)
            what = f"the op table's attention rows [{dtype}, {'with' if masked else 'without'} a mask]"
            assert_compiles_without_spills(src, target, what, set(found))
        mma = {int(m[8]) for m in ATTENTION.finditer(calls)}
        split = {m[9] for m in ATTENTION.finditer(calls)} | {m[9] for m in PARTIAL.finditer(calls)}
        # the paths the rows are there for: tensor cores for 16-bit blocks, split keys, and neither
        assert mma == ({0, 2} if dtype != "float32" else {0}), (dtype, arch, mma)
        assert split == {"true", "false"}, (dtype, arch, split)
        assert re.search(r"ml::attention_combine<\d+, \d+, true>", calls), (dtype, arch)


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_llama_attention_tiles_are_template_calls_without_spills(arch: str) -> None:
    for name, plan in llama_plans(arch).items():
        src = generate(plan).source
        found = template_calls(src)
        calls = " ".join(found.values())
        if name == "decode":  # split keys over ranges of 64 keys, merged by a combine holding 4
            assert PARTIAL.search(calls).groups() == ("4", "1", "256", "64", "64", "true", "0", "64", "true"), calls
            assert "ml::attention_combine<4, 64, true>(" in calls, calls
        else:  # tensor cores, pairs of warps a unit
            assert ATTENTION.search(calls).groups() == ("4", "128", "256", "64", "64", "true", "0", "2", "true"), calls
        target = arch + ("a" if arch == "sm_90" else "")
        assert_compiles_without_spills(src, target, f"Llama-3.2-1B {name}", set(found))


def _operands(dtype: str, hq: int, hkv: int, tq: int, tk: int, d: int, dv: int) -> list[Operand]:
    dt = ml.as_dtype(dtype)
    shapes = ((hq, tq, d), (hkv, tk, d), (hkv, tk, dv))
    return [Operand(dt, (1, h, t, w), (h * t * w, t * w, w, 1)) for h, t, w in shapes]


@pytest.mark.parametrize(
    "dtype, tq, d, mma, split",
    [
        ("bfloat16", 64, 64, 2, True),  # a block of queries: tensor cores (then split keys where unaligned)
        ("float16", 40, 128, 2, True),
        ("float32", 64, 64, 0, True),
        ("bfloat16", 1, 64, 0, True),  # decode: split keys
        ("bfloat16", 64, 40, 0, False),  # 5 packs of 8 do not divide a warp: a warp a row
        ("float32", 4, 12, 0, False),  # 3 packs of 4 do not divide a warp
    ],
)
def test_the_call_carries_the_paths_and_the_mask(dtype: str, tq: int, d: int, mma: int, split: bool) -> None:
    """ml::attention<AttnShape<group, tq, tk, d, dv, causal, window>, Mma, SplitKeys>: the shapes and
    mask of the op, Mma from _mma_applies / attention_mma_split, SplitKeys from _split_applies."""
    ins = _operands(dtype, 8, 2, tq, 300, d, d)
    out = Operand(ins[0].dtype, ins[0].shape, ins[0].strides)
    hints = {"warps": 8, "shared_memory": 227 * 1024}
    attrs = {"causal": True, "window": 37, "scale": 0.125, "absent": (3, 4), "codegen": hints}
    body = "\n".join(attention("attention", attrs, ins, out))
    call = ATTENTION.search(body)
    assert call, body
    assert call.groups() == ("4", str(tq), "300", str(d), str(d), "true", "37", str(mma), "true" if split else "false")
    assert "ml::Absent{}, ml::Absent{});" in body  # no positions, no lengths
    if mma:
        assert f"tensor cores ({mma} warp(s)" in body


def test_partial_and_combine_calls_carry_their_ranges() -> None:
    """attention_partial's key ranges of ceil(tk / splits); the combine holds up to COMBINE_HELD_SPLITS
    ranges' weights in registers, more recompute them; positions and lengths by their input slots."""
    q, k, v = _operands("bfloat16", 8, 2, 1, 300, 64, 64)
    lens = Operand(ml.int64, (1,), (1,))
    out = Operand(ml.float32, (1, 8, 1, 3, 66), (1584, 198, 198, 66, 1))
    attrs = {"causal": True, "window": None, "scale": 0.125, "splits": 3, "absent": (3,)}
    body = "\n".join(attention_partial("attention_partial", attrs, [q, k, v, lens], out))
    call = PARTIAL.search(body)
    assert call and call.groups() == ("4", "1", "300", "64", "64", "true", "0", "100", "true"), body
    assert body.rstrip().endswith("ml::Absent{}, ml::at<1>(in3), ml::Absent{});"), body  # (no mask)
    for splits in (COMBINE_HELD_SPLITS, COMBINE_HELD_SPLITS + 1):
        x = Operand(ml.float32, (1, 8, 1, splits, 66), (8 * splits * 66, splits * 66, splits * 66, 66, 1))
        y = Operand(ml.bfloat16, (1, 8, 1, 64), (512, 64, 64, 1))
        body = "\n".join(attention_combine("attention_combine", {}, [x], y))
        held = "true" if splits <= COMBINE_HELD_SPLITS else "false"
        assert f"ml::attention_combine<{splits}, 64, {held}>(t, ml::at<512, 64, 64, 1>(out0), " in body, body


def test_the_header_stages_the_key_blocks_emit_attention_sizes() -> None:
    """emit_attention sizes the tensor-core path's shared memory with attention.cuh's ATT_BK."""
    found = re.search(r"constexpr int ATT_BK = (\d+);", HEADER.read_text())
    assert found and int(found[1]) == emit_attention.ATT_BK
    assert "2 * 2 * split * ATT_BK * (d + 8) * 2 + 256" in HEADER.read_text()
    assert emit_attention.attention_mma_bytes(64, 2) == 2 * 2 * 2 * 64 * 72 * 2 + 256

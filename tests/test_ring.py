"""The weight ring (megaloop/ring.cuh, KernelOptions.weight_ring_*): which matmul tiles take their
weights from it, and the copy tables the host hands the kernel. The tables are checked by doing
what the kernel's bulk copies do on a numpy arena: every ring tile must see exactly its own weight
rows, in order. The GPU run of the same kernels is tests/test_gpu_generate.py (tokens equal)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

import megaloop as ml
from megaloop.codegen import generate
from megaloop.models import LlamaConfig, build_llama
from megaloop.plan import KernelOptions, Plan, make_plan
from megaloop.runtime.compile import compile_cubin, spills


def decode_matmuls(k: int = 512, n: int = 384) -> ml.Graph:
    """Two chained matrix-vector products (a decode step's shape) with bf16 weights, plus one whose
    weight is an input (not a parameter: it may change between runs, so it stays off the ring)."""
    g = ml.Graph("ring")
    x = g.input("x", (1, 1, k), ml.bfloat16)
    h = ml.matmul(x, g.parameter("w1", (n, k), ml.bfloat16), transpose_b=True)
    y = ml.matmul(h, g.parameter("w2", (k, n), ml.bfloat16), transpose_b=True)
    g.output("y", y)
    g.output("z", ml.matmul(x, g.input("w3", (64, k), ml.bfloat16), transpose_b=True))
    return g


def ring_ops(prog: Any) -> set[int]:
    return {int(t["op"]) for t in prog.tasks if t["ring_first"] >= 0}


def replay_ring(plan: Plan, prog: Any) -> dict[int, dict[int, Any]]:
    """Each ring tile's weight rows as the ring would hand them over: op -> task -> (rows, row bytes),
    copied from a numpy arena whose every byte is its own address (so a wrong offset shows)."""
    arena_bytes = max(b.offset + b.nbytes for b in plan.ranks[0].buffers) + 16
    arena = (np.arange(arena_bytes, dtype=np.int64) * 2654435761 % 251).astype(np.uint8)
    seen: dict[int, dict[int, Any]] = {}
    for p in range(prog.processors):
        chunks = prog.ring_chunks[prog.ring_begin[p] : prog.ring_begin[p + 1]]
        for tid in prog.lists[prog.list_begin[p] : prog.list_begin[p + 1]]:
            task = prog.tasks[tid]
            if task["ring_first"] < 0:
                continue
            lo, hi = int(task["lo"][2]), int(task["hi"][2])  # the output's columns: weight rows
            rows, j = [], int(task["ring_first"])
            while sum(len(r) for r in rows) < hi - lo:
                c = chunks[j]
                assert c["src"] % 16 == 0 and c["row_bytes"] % 16 == 0, c  # cp.async.bulk's rule
                assert 0 < c["rows"] * c["row_bytes"] <= plan.options.weight_ring_slot_bytes, c
                rows.append(np.stack([arena[c["src"] + r * c["stride"] :][: c["row_bytes"]] for r in range(c["rows"])]))
                j += 1
            got = np.concatenate(rows)
            assert len(got) == hi - lo, (tid, len(got), lo, hi)
            seen.setdefault(int(task["op"]), {})[int(tid)] = (got, lo, arena)
    return seen


def test_ring_tiles_get_exactly_their_weight_rows_in_order() -> None:
    g = decode_matmuls()
    plan = make_plan(g, processors=8)
    prog = generate(plan)
    assert '#include "megaloop/ring.cuh"' in prog.source and "ml::ring_matvec<" in prog.source
    rp = plan.ranks[0]
    names = {op.id: op.name for op in rp.ops}
    weights = {op.id: rp.tensors[op.inputs[1]] for op in rp.ops if op.op == "matmul"}
    on_ring = ring_ops(prog)
    assert len(on_ring) == 2, [names[o] for o in on_ring]  # w1 and w2, not the input w3
    seen = replay_ring(plan, prog)
    for op, tiles in seen.items():
        w = weights[op]
        base = rp.buffers[w.buffer].offset + w.offset * w.dtype.itemsize
        row_bytes = w.shape[-1] * w.dtype.itemsize
        covered = 0
        for got, lo, arena in tiles.values():
            want = np.stack([arena[base + (lo + r) * row_bytes :][:row_bytes] for r in range(len(got))])
            assert np.array_equal(got, want), f"{names[op]}: tile from column {lo} got other bytes"
            covered += len(got)
        assert covered == w.shape[0], (names[op], covered, w.shape)  # every weight row once
    assert int(prog.ring_begin[-1]) == len(prog.ring_chunks)


def test_a_llama_decode_step_streams_every_projection_through_the_ring() -> None:
    cfg = LlamaConfig(hidden=256, heads=4, kv_heads=2, intermediate=512, layers=2, max_seq=32, vocab=512)
    plan = make_plan(build_llama(cfg, 1, 1), processors=16)
    prog = generate(plan)
    rp = plan.ranks[0]
    # (the weight: operand 1; swiglu_linear's up, operand 2, follows it)
    matmuls = {op.id for op in rp.ops if op.op in ("matmul", "rmsnorm_linear", "swiglu_linear")}
    assert ring_ops(prog) == matmuls, sorted(op.name for op in rp.ops if op.id in matmuls - ring_ops(prog))
    replay_ring(plan, prog)
    total = sum(int(c["rows"]) for c in prog.ring_chunks)
    weights = [w for op in rp.ops if op.id in matmuls for w in op.inputs[1 : 3 if op.op == "swiglu_linear" else 2]]
    want = sum(rp.tensors[w].shape[0] for w in weights)
    assert total == want, (total, want)


@pytest.mark.parametrize(
    "how",
    [
        {"options": KernelOptions(weight_ring_slots=0)},
        {"arch": "sm_80"},
        {"shared_memory": 64 * 1024},  # 8 slots of 16 KB do not fit beside the kernel's own
    ],
    ids=["option-off", "sm_80-plan", "no-room"],
)
def test_without_the_ring_the_kernel_has_none_of_it(how: dict) -> None:
    prog = generate(make_plan(decode_matmuls(), processors=8, **how))
    assert "ring.cuh" not in prog.source and "ring_matvec" not in prog.source
    assert len(prog.ring_chunks) == 0 and (prog.tasks["ring_first"] == -1).all()
    assert not prog.ring_begin.any()


def test_ring_kernels_compile_for_hopper_and_keep_a_path_before_it() -> None:
    """An sm_90 plan's ring kernel: no spills on sm_90a; compiled for sm_80 (no bulk copies there) the
    ring tiles read the same chunks from global memory, so the source still compiles."""
    cfg = LlamaConfig(hidden=256, heads=4, kv_heads=2, intermediate=512, layers=1, max_seq=32, vocab=512)
    src = generate(make_plan(build_llama(cfg, 1, 1), processors=16)).source
    assert "ml::ring_matvec<" in src
    assert spills(src) == {}
    for arch in ("sm_80", "sm_86", "sm_89"):
        assert compile_cubin(src, arch, use_cache=False)


def test_ring_options_travel_in_the_plan_file_and_bad_ones_name_the_field(tmp_path) -> None:
    options = KernelOptions(weight_ring_slots=16, weight_ring_slot_bytes=8192)
    plan = make_plan(decode_matmuls(), processors=8, options=options)
    plan.save(tmp_path / "p.json")
    loaded = Plan.load(tmp_path / "p.json")
    assert loaded.options == options
    assert generate(loaded).source == generate(plan).source
    assert "#define ML_RING_SLOTS 16" in generate(loaded).source
    for field, value in (("weight_ring_slots", 65), ("weight_ring_slot_bytes", 1000), ("weight_ring_slot_bytes", 4100)):
        with pytest.raises(ml.errors.MegaloopError, match=field):
            make_plan(decode_matmuls(), processors=8, options=dataclasses.replace(KernelOptions(), **{field: value}))


def norm_linear_graph(k: int, n: int, dtype: str, rows: tuple[int, ...], residual: bool) -> ml.Graph:
    g = ml.Graph("norm-linear")
    x = g.input("x", (*rows, k), dtype)
    r = g.input("r", (*rows, k), dtype) if residual else None
    w, nw = g.parameter("w", (n, k), dtype), g.parameter("nw", (k,), dtype)
    g.output("y", ml.rmsnorm_linear(x, w, nw, eps=1e-5, residual=r))
    return g


@pytest.mark.parametrize(
    "k,n,dtype,rows,residual,options,path",
    [
        (2048, 512, "bfloat16", (1, 1), True, None, "ml::ring_matvec<"),
        (2048, 512, "bfloat16", (1, 1), False, KernelOptions(weight_ring_slots=0), "ml::direct_matvec<"),
        (256, 64, "float32", (1, 3), True, None, "ml::direct_matvec<"),  # 32-bit: no ring (skinny rule)
        (33, 17, "bfloat16", (2, 5), True, None, "ml::norm_linear_elements<"),  # odd K, batch axes
    ],
    ids=["ring", "direct", "float32-direct", "elements"],
)
def test_rmsnorm_linear_tiles_take_the_path_their_layout_allows(k, n, dtype, rows, residual, options, path) -> None:
    """Where the weights can come from the ring, they do; otherwise whole rows from global memory, or
    element by element for layouts without whole 16-byte pieces. Every path compiles, no spills, and
    for sm_80 too (the GPU runs: tests/test_gpu.py's op table, tests/test_gpu_generate.py)."""
    plan = make_plan(norm_linear_graph(k, n, dtype, rows, residual), processors=8, options=options)
    prog = generate(plan)
    assert path in prog.source
    assert spills(prog.source) == {}
    assert compile_cubin(prog.source, "sm_80", use_cache=False)
    if path == "ml::ring_matvec<":
        replay_ring(plan, prog)
        # the block's normed row and its warps' sums in the tile's shared memory, under the ring
        assert prog.shared_bytes >= k * 2 + plan.warps * 4 + plan.options.weight_ring_slots * 16384


@pytest.mark.parametrize(
    "off,counts",
    [
        (("swiglu_linear",), {"rmsnorm_linear": 5, "rmsnorm": 1, "silu_mul": 1, "swiglu_linear": 0}),
        (("rmsnorm_linear",), {"rmsnorm_linear": 0, "rmsnorm": 3, "silu_mul": 0, "swiglu_linear": 1}),
        ((), {"rmsnorm_linear": 3, "rmsnorm": 1, "silu_mul": 0, "swiglu_linear": 1}),
    ],
    ids=["norms", "swiglu", "both"],
)
def test_fused_small_ops_leave_no_stage_and_the_same_values(off: tuple, counts: dict) -> None:
    """The decode step fused (ml.fuse) on one sequence: the norms inside q/k/v and gate/up
    (rmsnorm_linear, swiglu_linear), silu(gate) * up inside gate/up (swiglu_linear); the values equal
    the layer with its small ops apart, bit for bit on the reference; over several sequences the small
    ops stay apart (the final norm is the output's: always apart)."""
    from bench.llama_layer import dependent_decode_graph
    from megaloop.models import random_parameters

    cfg = LlamaConfig(hidden=256, heads=4, kv_heads=2, intermediate=512, layers=1, max_seq=32, vocab=None)
    params = random_parameters(cfg, seed=3)
    x0 = np.random.default_rng(3).standard_normal((1, 1, 256)).astype(np.float32)
    plain = dependent_decode_graph(cfg, x0, None)
    fused = ml.fuse(plain, ml.FuseOptions(off=off))
    apart = ml.fuse(plain, ml.FuseOptions(off=("rmsnorm_linear", "swiglu_linear")))
    ops = [n.op.name for n in fused.nodes]
    assert {op: ops.count(op) for op in counts} == counts
    assert [n.op.name for n in apart.nodes].count("rmsnorm") == 3
    feeds = {"positions": np.array([[7]])}
    got, want = (ml.evaluate(g, feeds, params).outputs["hidden"] for g in (fused, apart))
    np.testing.assert_array_equal(got, want)  # the same roundings: bit for bit on the reference
    batched = ml.fuse(dependent_decode_graph(cfg, np.zeros((2, 1, 256), np.float32), None), ml.FuseOptions(off=off))
    assert not {"rmsnorm_linear", "swiglu_linear"} & {n.op.name for n in batched.nodes}

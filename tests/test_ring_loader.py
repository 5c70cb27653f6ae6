"""The weight ring's loader warp (KernelOptions.weight_ring_loader, megaloop/ring_loader.cuh) without a
GPU: which kernels get the ninth warp, its shared memory, that every kernel with it compiles for
sm_80/86/89/90a without spills, that kernels without it keep their exact source, and that tiles count
and synchronise only the compute threads (megaloop/block.cuh). The GPU runs: tests/test_gpu_ring_loader.py."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest

import megaloop as ml
from megaloop.codegen import generate
from megaloop.models import LlamaConfig, build_llama, random_parameters
from megaloop.plan import KernelOptions, Plan, make_plan
from megaloop.reference.interpreter import run_plan
from megaloop.runtime.compile import compile_cubin, spills
from tests.test_ring import decode_matmuls, replay_ring

LOADER = KernelOptions(weight_ring_loader=1)
CODEGEN = Path(ml.__file__).parent / "codegen"
SMALL = LlamaConfig(hidden=256, heads=4, kv_heads=2, intermediate=512, layers=1, max_seq=32, vocab=512)


def test_a_ring_kernel_with_the_loader_gets_a_ninth_warp_and_its_slots_barriers() -> None:
    off = generate(make_plan(decode_matmuls(), processors=8, options=dataclasses.replace(LOADER, weight_ring_loader=0)))
    plan = make_plan(decode_matmuls(), processors=8, options=LOADER)
    on = generate(plan)
    assert (off.threads, on.threads) == (256, 288)
    assert "#define ML_COMPUTE_THREADS 256\n" in on.source and "#define ML_RING_IN_FLIGHT 49152\n" in on.source
    assert "ml::loop_body<ml::LoaderRing>" in on.source and "__launch_bounds__(288, 1)" in on.source
    # an empty barrier more a slot
    assert on.shared_bytes - off.shared_bytes == plan.options.weight_ring_slots * 8
    # the same copies: the loader walks the tables the tiles consume
    assert np.array_equal(on.ring_chunks, off.ring_chunks) and np.array_equal(on.tasks, off.tasks)
    replay_ring(plan, on)


@pytest.mark.parametrize(
    "how",
    [
        {"options": dataclasses.replace(LOADER, weight_ring_slots=0)},
        {"options": LOADER, "arch": "sm_80"},
        {"options": LOADER, "shared_memory": 64 * 1024},  # no room for the ring: no loader either
    ],
    ids=["ring-off", "sm_80-plan", "no-room"],
)
def test_without_a_ring_the_loader_option_changes_nothing(how: dict) -> None:
    plan = make_plan(decode_matmuls(), processors=8, **how)
    without = make_plan(decode_matmuls(), processors=8, **{**how, "options": KernelOptions(weight_ring_slots=0)})
    prog = generate(plan)
    assert prog.threads == 256 and "ML_RING_LOADER" not in prog.source and "ML_COMPUTE_THREADS" not in prog.source
    assert prog.source == generate(without).source


def test_loader_kernels_compile_for_every_architecture_without_spills() -> None:
    """The Llama decode step's kernel (matmul, norm-linear and SwiGLU ring tiles, attention, sampling-free
    argmax) with the loader at two caps: no spills on sm_90a under 288 threads' register budget; for
    sm_80/86/89 (no bulk copies) the loader warp leaves at once and the tiles read global memory."""
    for options in (LOADER, KernelOptions(weight_ring_loader=2, weight_ring_loader_bytes=16384, weight_ring_slots=12)):
        src = generate(make_plan(build_llama(SMALL, 1, 1), processors=16, options=options)).source
        assert f"#define ML_RING_LOADER {options.weight_ring_loader}\n" in src
        assert "ml::ring_matvec<" in src and "ml::ring_columns<" in src and "ml::LoaderRing" in src
        assert spills(src) == {}
        for arch in ("sm_80", "sm_86", "sm_89"):
            assert compile_cubin(src, arch, use_cache=False)


def test_the_1b_generator_with_the_loader_compiles_without_spills() -> None:
    """bench/generate's greedy step (the Llama-3.2-1B shape, two layers: every tile kind of the full
    one) with the loader warp: sm_90a without spills."""
    from megaloop.cli import PRESETS
    from megaloop.models import build_llama_generator

    cfg = dataclasses.replace(PRESETS["llama3.2-1b"], layers=2, max_seq=256)
    prog = generate(make_plan(build_llama_generator(cfg, 1, kv_splits="auto"), processors=132, options=LOADER))
    assert prog.threads == 288 and "ml::LoaderRing" in prog.source
    assert len(prog.ring_chunks) > 0
    assert spills(prog.source) == {}


def test_loader_options_travel_in_the_plan_file_and_bad_ones_name_the_field(tmp_path) -> None:
    options = KernelOptions(weight_ring_loader=1, weight_ring_loader_bytes=32768)
    plan = make_plan(decode_matmuls(), processors=8, options=options)
    plan.save(tmp_path / "p.json")
    loaded = Plan.load(tmp_path / "p.json")
    assert loaded.options == options
    assert generate(loaded).source == generate(plan).source
    assert "#define ML_RING_IN_FLIGHT 32768\n" in generate(loaded).source
    bad = (
        {"weight_ring_loader": 3},
        {"weight_ring_loader": True},
        {"weight_ring_loader_bytes": 512},
        {"weight_ring_loader": 1, "weight_ring_slots": 33},  # a lane of the loader warp a slot
        {"weight_ring_slots": 33},  # (the loader is on by default)
    )
    for fields in bad:
        field = list(fields)[-1]
        with pytest.raises(ml.errors.MegaloopError, match=field):
            make_plan(decode_matmuls(), processors=8, options=KernelOptions(**fields))
    make_plan(decode_matmuls(), processors=8, options=KernelOptions(weight_ring_loader=0, weight_ring_slots=33))


def test_the_plan_interpreter_runs_a_loader_plan_as_the_reference() -> None:
    """The option is the kernel's business: the plan's tasks and waits are the same, verified, and the
    interpreter's interleavings give the reference's values."""
    plan = make_plan(build_llama(SMALL, 1, 1), processors=16, options=LOADER)
    plain = make_plan(build_llama(SMALL, 1, 1), processors=16)
    rp, rq = plan.ranks[0], plain.ranks[0]
    assert [(t.op, t.coords) for t in rp.tasks] == [(t.op, t.coords) for t in rq.tasks]
    assert rp.processors == rq.processors
    plan.verify()
    params = random_parameters(SMALL, seed=4)
    feeds = {"tokens": np.array([[5]]), "positions": np.array([[3]])}
    want = ml.evaluate(rp.graph, feeds, params).outputs["logits"]
    for seed in (0, 1):
        got = run_plan(plan, feeds, params, seed=seed).outputs["logits"]
        np.testing.assert_array_equal(got, want)


def _code_lines(path: Path) -> list[str]:
    text = path.read_text()
    if path.suffix == ".cuh":
        text = re.sub(r"//[^\n]*", "", text)
    return text.splitlines()


def test_tiles_count_and_synchronise_only_the_compute_threads() -> None:
    """With a loader warp beside them, a tile that waited for the whole block or strode by blockDim
    would hang or skip elements: headers and emitters use ml::block_sync / ml::block_threads. The one
    whole-block barrier is the loop body's first (the loader warp waits for the ring's barriers)."""
    found = []
    for path in [*sorted((CODEGEN / "include" / "megaloop").glob("*.cuh")), *sorted(CODEGEN.glob("*.py"))]:
        if path.name == "block.cuh":
            continue
        for n, line in enumerate(_code_lines(path), 1):
            if re.search(r"\b__syncthreads\s*\(|\bblockDim\b", line):
                found.append((path.name, n, line.strip()))
    assert [(name, text) for name, _, text in found] == [("loop_body.cuh", "__syncthreads();")], found


def test_a_kernel_of_several_programs_has_the_ring_without_its_loader_warp() -> None:
    """The loader warp numbers one program's chunks: after a program switch it would copy the wrong rows,
    so a kernel of several programs keeps the ring (its tiles issue the copies) and has no loader warp."""
    from megaloop.plan.cache import make_programs

    plan = make_programs({"a": decode_matmuls(), "b": decode_matmuls()}, use_cache=False, processors=8, options=LOADER)
    prog = generate(plan)
    assert prog.threads == 256 and "ml::WeightRing" in prog.source and "ML_RING_LOADER" not in prog.source
    single = generate(make_plan(decode_matmuls(), processors=8, options=LOADER))
    assert single.threads == 288 and "ml::LoaderRing" in single.source


def test_the_ring_takes_as_many_slots_as_fit_up_to_the_option() -> None:
    """weight_ring_slots is the most: 30 slots of 16 KB cannot sit beside the tiles in 227 KB, so the
    kernel gets the most that fit (and its shared memory stays within the plan's)."""
    plan = make_plan(decode_matmuls(), processors=8, options=KernelOptions(weight_ring_slots=30))
    prog = generate(plan)
    slots = int(re.search(r"#define ML_RING_SLOTS (\d+)\n", prog.source).group(1))
    assert 4 <= slots < 30 and prog.shared_bytes <= plan.shared_memory
    assert prog.shared_bytes + (16384 + 20) > plan.shared_memory - 8 * 1024  # one more would not fit
    few = generate(make_plan(decode_matmuls(), processors=8, options=KernelOptions(weight_ring_slots=3)))
    assert "#define ML_RING_SLOTS 3\n" in few.source

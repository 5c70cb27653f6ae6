"""The weight ring's loader warp (KernelOptions.weight_ring_loader, megaloop/ring_loader.cuh) without a
GPU: which kernels get the ninth warp (kernels of several programs too), its shared memory, that the decode
kernels with it compile for sm_80/86/89/90a without spills, that kernels without it keep their exact
source, that tiles count and synchronise only the compute threads (megaloop/block.cuh), and the
loader's chunk numbering across program switches (megaloop/loader_runs.cuh through g++). The GPU
runs: tests/test_gpu_ring_loader.py, tests/test_gpu_programs.py."""

from __future__ import annotations

import ctypes
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
from tests.helpers import host_library
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


def ring_program(name: str, rows: int, weights: tuple[str, ...] = ("w1", "w2"), k: int = 512) -> ml.Graph:
    """One program of ring_programs: the first ``rows`` rows of the bf16 state ``h`` [8, k] through the
    weights named (each k x k, bf16; a product of up to RING_MAX_ROWS rows streams its weight through
    the ring, eight rows take other tiles), then tanh, written back; output ``y``: the new rows."""
    g = ml.Graph(name)
    init = np.random.default_rng(0).uniform(-1, 1, (8, k)).astype(ml.bfloat16.np)
    h = g.state("h", (8, k), ml.bfloat16, init=init)
    x = h[:rows]
    for w in weights:
        x = ml.matmul(x, g.parameter(w, (k, k), ml.bfloat16), transpose_b=True)
    y = ml.tanh(x)
    g.assign(h, y if rows == 8 else ml.concat([y, h[rows:]], 0))
    g.output("y", y * 1)
    return g


def ring_programs() -> dict[str, ml.Graph]:
    """Three programs over one state and two weights, as the serving engine's: ``mixed`` (8 rows: no
    ring chunk on any processor), ``decode_1`` (one row through w1 and w2) and ``decode_2`` (two rows
    through w1: half the chunks). Planned for RING_PROCESSORS, some processors get none of either."""
    return {"mixed": ring_program("mixed", 8), "decode_1": ring_program("decode_1", 1),
            "decode_2": ring_program("decode_2", 2, ("w1",))}  # fmt: skip


RING_PROCESSORS = 24


def test_a_kernel_of_several_programs_gets_the_loader_warp() -> None:
    """The loader walks each grant's program's chunks (megaloop/loader_runs.cuh), so a kernel of several
    programs has its ninth warp as one of one program has: the programs' chunk counts differ by
    processor (some none), and the kernel compiles for every architecture, the loader without spills
    (the 8-row product's tile spills a little under 288 threads' 168 registers, as it does in a kernel
    of one program: docs/runtime.md, "The loader warp")."""
    from megaloop.plan.cache import make_programs

    off_options = KernelOptions(weight_ring_loader=0)
    off = generate(make_programs(ring_programs(), processors=RING_PROCESSORS, options=off_options))
    plan = make_programs(ring_programs(), processors=RING_PROCESSORS)
    prog = generate(plan)
    assert (off.threads, prog.threads) == (256, 288) and "ml::LoaderRing" in prog.source
    assert "#define ML_PROGRAMS 3\n" in prog.source and "#define ML_COMPUTE_THREADS 256\n" in prog.source
    assert prog.shared_bytes - off.shared_bytes == 8 * int(re.search(r"#define ML_RING_SLOTS (\d+)", prog.source)[1])
    counts = [np.diff(p.ring_begin) for p in (prog, *prog.others)]
    assert [c.sum() > 0 for c in counts] == [False, True, True] and not np.array_equal(counts[1], counts[2])
    assert (counts[1] == 0).any() and (counts[1] > 0).any(), counts[1]
    for mine, theirs in zip((prog, *prog.others), (off, *off.others)):  # the loader walks the tables the tiles use
        assert np.array_equal(mine.ring_chunks, theirs.ring_chunks) and np.array_equal(mine.tasks, theirs.tasks)
    assert not [f for f in spills(prog.source) if "ring_loader" in f]
    for arch in ("sm_80", "sm_86", "sm_89"):
        assert compile_cubin(prog.source, arch, use_cache=False)


def test_the_llama_decode_programs_with_the_loader_compile_without_spills() -> None:
    """Three programs of the small Llama step (1, 2 and 4 tokens: every ring tile kind) in one kernel
    with the loader: sm_90a without spills under 288 threads' register budget."""
    from megaloop.plan.cache import make_programs

    graphs = {f"tokens_{t}": build_llama(SMALL, 1, t) for t in (1, 2, 4)}
    prog = generate(make_programs(graphs, processors=16))
    assert prog.threads == 288 and "ml::LoaderRing" in prog.source and len(prog.others) == 2
    assert spills(prog.source) == {}


HOST_TYPES = r"""
#pragma once
#define __device__
#define __forceinline__ inline
namespace ml { typedef unsigned long long u64; }
"""

HOST_MAIN = r"""
#include "megaloop/loader_runs.cuh"
typedef unsigned long long u64;
// a run as three words: first, end, program
static ml::LoaderRun load(const u64* r) { return {r[0], r[1], (int)(long long)r[2]}; }
extern "C" u64 grant_word(u64 taken, u64 iterations, int chunks, int program) {
    return ml::run_grant(taken, iterations, chunks, program);
}
extern "C" int follow(u64* r, u64 word) {
    ml::LoaderRun run = load(r);
    const bool switched = ml::run_follow(run, word);
    r[0] = run.first, r[1] = run.end, r[2] = (u64)(long long)run.program;
    return switched;
}
extern "C" int entry(const u64* r, u64 g, int n) { return ml::run_entry(load(r), g, n); }
"""


@pytest.fixture(scope="module")
def loader_runs(tmp_path_factory) -> ctypes.CDLL:
    header = (CODEGEN / "include" / "megaloop" / "loader_runs.cuh").read_text()
    root = tmp_path_factory.mktemp("loader_runs")
    dll = host_library(root, {"types.cuh": HOST_TYPES, "loader_runs.cuh": header}, HOST_MAIN)
    u64 = ctypes.c_uint64
    dll.grant_word.argtypes, dll.grant_word.restype = [u64, u64, ctypes.c_int, ctypes.c_int], u64
    dll.follow.argtypes, dll.follow.restype = [ctypes.POINTER(u64), u64], ctypes.c_int
    dll.entry.argtypes, dll.entry.restype = [ctypes.POINTER(u64), u64, ctypes.c_int], ctypes.c_int
    return dll


def _walk(lib: ctypes.CDLL, counts: list[int], grants: list[tuple[int, int]], rng: np.random.Generator):
    """One processor's ring under grants (program, iterations), the loader and thread 0 interleaved at
    random as the kernel allows: thread 0 publishes a grant's word once every chunk of the grant
    before was copied (and consumed), so the loader may miss words; the loader copies the chunks
    below its run's end, reading the latest word when it has none left. Returns the consumers' (program,
    entry) per chunk, the loader's, and which grants' words it read."""
    consumers, words, taken = [], [], 0
    for p, m in grants:  # thread 0: the word at the grant; the tiles: chunk g = ring_first_chunk + i
        words.append((lib.grant_word(taken, m, counts[p], p), taken + m * counts[p]))
        consumers += [(p, i) for _ in range(m) for i in range(counts[p])]
        taken += m * counts[p]
    run = (ctypes.c_uint64 * 3)(0, 0, 2**64 - 1)  # no run yet
    copied, read, published = [], set(), 0
    while True:
        idle = len(copied) >= run[1]
        may_publish = published + 1 < len(words) and len(copied) >= words[published][1]
        if may_publish and (not idle or rng.random() < 0.5):
            published += 1
        elif idle:
            if published + 1 == len(words) and run[1] == words[-1][1]:
                return consumers, copied, read
            lib.follow(run, words[published][0])
            read.add(published)
        else:
            g = len(copied)
            assert g < words[published][1], f"chunk {g} copied past the grants ({words[published][1]} granted)"
            copied.append((int(run[2]), lib.entry(run, g, counts[run[2]])))


def test_the_loaders_walk_numbers_chunks_as_the_consumers_across_program_switches(loader_runs) -> None:
    """megaloop/loader_runs.cuh on the CPU: over random sequences of grants of four programs with 5, 0, 3
    and 1 chunks on a processor (a program extended by grants of its own, switched, or left for one
    with no chunk here and back) and random interleavings, the loader copies chunk g from the list
    entry the consumers take it as, never past the grants, though it misses words."""
    counts = [5, 0, 3, 1]
    rng = np.random.default_rng(7)
    missed_empty = 0
    for trial in range(200):
        grants = [(int(rng.integers(4)), int(rng.integers(1, 4))) for _ in range(int(rng.integers(1, 25)))]
        consumers, copied, read = _walk(loader_runs, counts, grants, rng)
        first = next((g for g, (x, y) in enumerate(zip(copied, consumers)) if x != y), None)
        assert copied == consumers, f"trial {trial}, grants {grants}: chunk {first} or the count differs"
        missed = [grants[j][0] for j in range(len(grants)) if j not in read]
        assert all(counts[p] == 0 for p in missed), (trial, grants, read)  # (the model's own rule)
        missed_empty += len(missed)
    assert missed_empty > 20, "the runs never skipped a word of a program without chunks: not the case tested"
    run = (ctypes.c_uint64 * 3)(0, 0, 2**64 - 1)
    assert loader_runs.follow(run, loader_runs.grant_word(2**50, 3, 7, 15)) == 1
    assert list(run) == [0, 2**50 + 21, 15]


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

"""Compile the loop kernels a GPU call will run, here (NVRTC needs no GPU), into the compile cache, so
the lent machine's minutes go to running them. Carry the cache folder with the call and point
MEGALOOP_CACHE at it there (scripts/gpu_check.sh takes MEGALOOP_CACHE from the environment):

    MEGALOOP_CACHE=$PWD/.cubin-cache python scripts/precompile.py generate profile:generate1b
    # device call: carry [".cubin-cache"], command "MEGALOOP_CACHE=$PWD/.cubin-cache bash scripts/gpu_check.sh ..."

A carried folder counts with the tree against the call's 64 MiB: past it, carry one archive (cubins
and plans compress ~2x and ~27x) and unpack it there first (`tar -C /tmp/c -xzf .carry/cache.tgz`,
MEGALOOP_CACHE=/tmp/c). Plans land in the cache too (generators, serve), so the GPU does not plan.

Targets: ``generate[:SHAPE]`` (bench/generate's prefill, greedy and sampling generators; GENERATE_OPTIONS,
GENERATE_COMPARE_OPTIONS and GENERATE_COMPARE as JSON, as its --options / --compare-options /
--compare; GENERATE_COMPARE_LOADER=1 as --compare-loader, GENERATE_COMPARE_LANES=1 as --compare-lanes),
``profile:CASE`` (scripts/profile_cases.py's
case with PROFILE_OPTIONS), ``serve`` (bench/serve's Generator batches and engines, planned and
compiled through their own code against a stand-in H100 whose LoopKernel never starts; plans land in
the plan cache), ``every_op[:DTYPE]`` (tests/test_gpu.py's op table kernels), ``train:BxS[:STEPS]``
(bench/train's step for that batch and sequence; plans land in the plan cache). A cubin is keyed by
its source, the header library, the architecture and the NVRTC version: one the device's NVRTC would
not make is not used."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import matmul_tiles
from megaloop.codegen.kernel import generate
from megaloop.plan import FuseOptions, KernelOptions, make_plan
from megaloop.runtime.compile import compile_many


def generate_plans(shape: str = "1b") -> list:
    import bench.generate as bg
    from megaloop.cli import PRESETS
    from megaloop.models import build_llama_generator

    base = PRESETS[bg.SHAPES[shape][0]]
    cfg = type(base)(**{**base.__dict__, "max_seq": bg.PROMPT + bg.NEW})
    options = KernelOptions(**json.loads(os.environ.get("GENERATE_OPTIONS", "{}")))
    plans = [bg._prefill_plan(cfg, FuseOptions())]
    for sampling in (False, True):
        graph = build_llama_generator(cfg, 1, kv_splits=bg._splits(), sampling=sampling)
        plans.append(make_plan(graph, processors=132, options=options))
    graph = build_llama_generator(cfg, 1, kv_splits=bg._splits())
    compare = json.loads(os.environ.get("GENERATE_COMPARE_OPTIONS", "[]"))
    if os.environ.get("GENERATE_COMPARE_LOADER"):  # (as --compare-loader)
        compare += [json.loads(text) for text in bg.LOADER_COMPARE]
    if os.environ.get("GENERATE_COMPARE_LANES"):  # (as --compare-lanes)
        compare += [json.loads(text) for text in bg.LANES_COMPARE]
    for text in compare:
        plans.append(make_plan(graph, processors=132, options=KernelOptions(**text)))
    for text in json.loads(os.environ.get("GENERATE_COMPARE", "[]")):  # (as --compare: FuseOptions.parse)
        plans.append(make_plan(graph, processors=132, options=options, fusion=FuseOptions.parse(text)))
    return plans


def profile_plan(case: str):
    import profile_cases as pc

    options = {}
    for item in filter(None, os.environ.get("PROFILE_OPTIONS", "").split(",")):
        key, _, value = item.partition("=")
        options[key.strip()] = int(value)
    g, *_ = pc.CASES[case]()
    fusion = FuseOptions.parse(os.environ.get("PROFILE_FUSION") or pc.FUSION.get(case, "all"))  # (as profile_cases)
    return make_plan(g, processors=132, tiles=matmul_tiles(), options=KernelOptions(**options), fusion=fusion)


class _NoKernel(Exception):
    pass


def serve_setup(clients: tuple[int, ...] = (1, 8, 32), slots: int = 32, chunk: int = 32, max_seq: int = 512) -> None:
    """bench/serve's plans and kernels (its defaults), made by the Generator and the Engine themselves."""
    import megaloop as ml
    import megaloop.runtime as runtime
    import megaloop.runtime.loop as loop
    from bench.generate_checkpoint import make_checkpoint
    from bench.serve import prompt_ids
    from megaloop.runtime.device import GpuInfo
    from megaloop.serving.engine import Engine

    h100 = GpuInfo(0, "NVIDIA H100 80GB HBM3", (9, 0), 132, 80 << 30)
    runtime.gpus = lambda: ([h100], "")

    class NoKernel:
        def __init__(self, *args, **kwargs) -> None:
            raise _NoKernel

    loop.LoopKernel = NoKernel
    folder = make_checkpoint("1b", Path("/tmp/megaloop-checkpoints/1b"), device="cpu")
    gen = ml.Generator(folder, backend="gpu", max_seq=max_seq, eos_token_ids=[])
    for batch in (1, *clients):
        try:
            gen.generate([prompt_ids(gen, 128, c) for c in range(batch)], max_new_tokens=4)
        except _NoKernel:
            pass
    for n in (slots, 1):
        try:
            Engine(gen, backend="gpu", max_slots=n, chunk=chunk, max_seq=max_seq)
        except _NoKernel:
            pass


def train_plan(spec: str):
    """bench/train's step for ``BxS[:STEPS]`` (its default 200 steps), planned through the plan cache as
    the Trainer's GPU runner plans it on an H100 or H200 (132 processors)."""
    import bench.train as bt
    from megaloop.plan.cache import load_or_make_plan

    shape, _, steps = spec.partition(":")
    batch, seq = (int(x) for x in shape.split("x"))
    texts = bt.stdlib_text(None)
    folder = Path("/tmp/megaloop-checkpoints/train-bench") / "llama-bench"
    if not (folder / "model.safetensors").is_file():
        bt.make_checkpoint(folder, bt.FULL, texts, "bfloat16")
    trainer, _, windows = bt.bench_trainer(folder, texts, batch, seq, int(steps or 200), "gpu")
    trainer.build(windows)
    return load_or_make_plan(trainer.training.graph, processors=132, arch="sm_90")[0]


DTYPES = ("float32", "float16", "bfloat16")


def every_op_plans(dtype: str = "") -> list:
    """tests/test_gpu.py::test_every_op_against_torch's plans (one dtype, or all three)."""
    from tests.test_gpu import every_op_graph

    return [make_plan(every_op_graph(dt)[0], processors=132) for dt in ([dtype] if dtype else DTYPES)]


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    plans = []
    for target in sys.argv[1:]:
        if target == "serve":
            t0 = time.perf_counter()
            serve_setup()
            print(f"serve: planned and compiled in {time.perf_counter() - t0:.0f} s")
            continue
        if target.startswith("every_op"):  # tests/test_gpu.py's op table kernels (every_op[:DTYPE])
            plans += every_op_plans(target.partition(":")[2])
            continue
        if target.startswith("train:"):
            plans.append(train_plan(target.removeprefix("train:")))
            continue
        if target.startswith("generate"):  # bench/generate's kernels (generate[:SHAPE], 1b or 8b)
            plans += generate_plans(target.partition(":")[2] or "1b")
            continue
        plans.append(profile_plan(target.removeprefix("profile:")))
    t0 = time.perf_counter()
    sources = [generate(p).source for p in plans]
    compile_many(sources, "sm_90a")
    print(f"{len(set(sources))} kernels in {os.environ.get('MEGALOOP_CACHE')}: {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()

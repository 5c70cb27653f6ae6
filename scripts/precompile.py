"""Compile the loop kernels a GPU call will run, here (NVRTC needs no GPU), into the compile cache, so
the lent machine's minutes go to running them. Carry the cache folder with the call and point
MEGALOOP_CACHE at it there (scripts/gpu_check.sh takes MEGALOOP_CACHE from the environment):

    MEGALOOP_CACHE=$PWD/.cubin-cache python scripts/precompile.py generate profile:generate1b
    # device call: carry [".cubin-cache"], command "MEGALOOP_CACHE=$PWD/.cubin-cache bash scripts/gpu_check.sh ..."

Targets: ``generate`` (bench/generate's prefill, greedy and sampling generators; GENERATE_OPTIONS,
GENERATE_COMPARE_OPTIONS and GENERATE_COMPARE as JSON, as its --options / --compare-options /
--compare) and ``profile:CASE``
(scripts/profile_cases.py's case with PROFILE_OPTIONS). A cubin is keyed by its source, the header
library, the architecture and the NVRTC version: one the device's NVRTC would not make is not used."""

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


def generate_plans() -> list:
    import bench.generate as bg
    from megaloop.cli import PRESETS
    from megaloop.models import build_llama_generator

    base = PRESETS["llama3.2-1b"]
    cfg = type(base)(**{**base.__dict__, "max_seq": bg.PROMPT + bg.NEW})
    options = KernelOptions(**json.loads(os.environ.get("GENERATE_OPTIONS", "{}")))
    plans = [bg._prefill_plan(cfg, FuseOptions())]
    for sampling in (False, True):
        graph = build_llama_generator(cfg, 1, kv_splits=bg._splits(), sampling=sampling)
        plans.append(make_plan(graph, processors=132, options=options))
    graph = build_llama_generator(cfg, 1, kv_splits=bg._splits())
    for text in json.loads(os.environ.get("GENERATE_COMPARE_OPTIONS", "[]")):
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


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    plans = []
    for target in sys.argv[1:]:
        plans += generate_plans() if target == "generate" else [profile_plan(target.removeprefix("profile:"))]
    t0 = time.perf_counter()
    sources = [generate(p).source for p in plans]
    compile_many(sources, "sm_90a")
    print(f"{len(set(sources))} kernels in {os.environ.get('MEGALOOP_CACHE')}: {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()

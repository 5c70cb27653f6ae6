"""The partitioner's cost model (megaloop/parallel/cost.py) against the committed H200 measurements in
bench/results: every case rebuilt as the benchmark built it, its step predicted, the ratio printed.
Runs on the CPU (no GPU: it reads the measurements). ``--fit`` searches the three constants the model
takes from measurements (Machine.tile_scale, stage_us, l2_scale) for the least squares of the log ratios.

    python -m bench.cost_model          # the table (docs/partition.md holds a copy)
    python -m bench.cost_model --fit
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np

import megaloop as ml
from megaloop.models import LlamaConfig, build_llama, build_llama_generator
from megaloop.parallel.cost import H200, Machine
from megaloop.parallel.predict import predict_step

RESULTS = Path(__file__).parent / "results"

Case = tuple[str, Callable[[], list[ml.Graph]], float]  # name, graphs of one step, measured us
# the rewrites the Llama builders made themselves before the fuse stage (the layer cases' graphs)
APART = ml.FuseOptions.only("norm_residual", "rope_kv_cache_update")


def _load(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def _layer_config(hidden: int) -> LlamaConfig:
    from bench.llama_layer import layer_config

    return layer_config(hidden, 1)


def cases() -> list[Case]:
    out: list[Case] = []
    layer = _load("llama_layer")
    for hidden in (2048, 4096):
        for key, (b, t) in (("decode", (1, 1)), ("decode_batch4", (4, 1)), ("prefill512", (1, 512))):
            m = layer[f"hidden{hidden}_{key}"]
            us = m.get("loop_kernel_dependent_us", m["loop_kernel_us"])
            # measured with every small op a stage of its own (bench/results/llama_layer.json)
            build = lambda h=hidden, b=b, t=t: [ml.fuse(build_llama(_layer_config(h), b, t), APART)]
            out.append((f"layer {hidden} {key}", build, us))
    gen = _load("generate")
    from megaloop.cli import PRESETS

    base = PRESETS["llama3.2-1b"]
    cfg = replace(base, max_seq=gen["prompt"] + gen["new_tokens"])
    generator = lambda: [ml.fuse(build_llama_generator(cfg, 1, kv_splits=gen["kv_splits"]))]  # (as planned)
    out.append(("1B generate, a token", generator, gen["loop_us_per_token"]))
    prefill = lambda: [ml.fuse(build_llama(cfg, 1, gen["prompt"]))]
    out.append(("1B prefill, 128 tokens", prefill, gen["loop_prefill_ms"] * 1e3))
    gemm = _load("gemm")
    for size, m in gemm["sizes"].items():
        n = int(size)
        out.append((f"bf16 GEMM {n}^3", lambda n=n: [_gemm(n)], m["loop_ms"] * 1e3))
    mem = _load("memory_bound")
    for name, m in mem["ops"].items():
        out.append((f"{name} 32768x8192 bf16", lambda name=name: [_memory(name)], m["ms"] * 1e3))
    tp = _load("tp_mlp")
    for tokens, m in tp["tokens"].items():
        out.append((f"TP MLP 2 GPUs, {tokens} tokens", lambda t=int(tokens): _tp_mlp(t), m["loop_dependent_us"]))
    coll = _load("collectives")
    for size, m in coll["all_reduce"].items():
        if "dependent_us" in m:
            name = f"all_reduce 2 GPUs {int(size) // 1024} KiB"
            out.append((name, lambda s=int(size): _all_reduce(s), m["dependent_us"]))
    return out


def _gemm(n: int) -> ml.Graph:
    g = ml.Graph("gemm")
    a, b = g.input("a", (n, n), ml.bfloat16), g.input("b", (n, n), ml.bfloat16)
    g.output("c", a @ b)
    return g


def _memory(name: str) -> ml.Graph:
    g = ml.Graph(name)
    a, b = g.input("a", (32768, 8192), ml.bfloat16), g.input("b", (32768, 8192), ml.bfloat16)
    y = {"add": lambda: a + b, "rmsnorm": lambda: ml.rmsnorm(a, b[0]), "softmax": lambda: ml.softmax(a, -1)}[name]()
    g.output("y", y)
    return g


def _tp_mlp(tokens: int) -> list[ml.Graph]:
    from bench.tp_mlp import graphs

    return graphs(tokens, "fused", np.zeros((tokens, 4096), np.float32))


def _all_reduce(nbytes: int) -> list[ml.Graph]:
    """One all-reduce of a chain (bench/collectives.py times a chain and divides)."""

    def build(g: ml.Graph) -> None:
        s = g.state("s", (nbytes // 2,), ml.bfloat16)
        y = ml.all_reduce(s)
        g.output("y", y)
        g.assign(s, y)

    return ml.spmd(build, 2)


def table(machine: Machine, built: list, tiles: dict | None = None) -> list[tuple[str, float, float]]:
    tiles = {} if tiles is None else tiles
    return [(name, predict_step(graphs, machine, tiles)["step_us"], us) for name, graphs, us in built]


def worst(rows: list[tuple[str, float, float]]) -> float:
    return max(abs(p / m - 1) for _, p, m in rows)


def _misfit(machine: Machine, built: list, tiles: dict) -> float:
    return sum(math.log(p / m) ** 2 for _, p, m in table(machine, built, tiles))


def fit(built: list, tiles: dict) -> Machine:
    """The grid point of least squared log error (tile times are cached per l2_scale)."""
    grid = itertools.product(np.arange(1.0, 1.21, 0.04), np.arange(0.90, 1.21, 0.02), np.arange(0.0, 1.61, 0.1))
    machines = [replace(H200, l2_scale=float(l2), tile_scale=float(t), stage_us=float(s)) for l2, t, s in grid]
    return min(machines, key=lambda m: _misfit(m, built, tiles))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", action="store_true", help="search tile_scale, stage_us and l2_scale")
    args = ap.parse_args()
    built = [(name, make(), us) for name, make, us in cases()]
    machine = H200
    tiles: dict = {}
    if args.fit:
        machine = fit(built, tiles)
        m = machine
        print(f"fitted: tile_scale={m.tile_scale:.2f} stage_us={m.stage_us:.1f} l2_scale={m.l2_scale:.2f}")
    rows = table(machine, built, tiles)
    print("| case | measured (us) | predicted (us) | error |\n|---|---|---|---|")
    for name, p, m in rows:
        print(f"| {name} | {m:.1f} | {p:.1f} | {p / m - 1:+.0%} |")
    print(f"worst error {worst(rows):.0%}; mean |error| {np.mean([abs(p / m - 1) for _, p, m in rows]):.0%}")


if __name__ == "__main__":
    main()

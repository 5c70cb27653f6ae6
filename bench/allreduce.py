"""All-reduce of bf16 vectors, 4 KB to 256 MB, on 2 GPUs: inside the loop kernel (one process, peer
memory, tiles pulled over NVLink and summed in rank order) against NCCL's all-reduce driven from the
same process (torch.cuda.nccl), same run. Latency per all-reduce (the loop kernel: wall time over many
resident iterations) and bus bandwidth 2 (n - 1) / n x bytes / time."""

from __future__ import annotations

import os

import numpy as np
import torch

import megaloop as ml
from bench.common import resident_seconds, write
from megaloop.plan import make_plan
from megaloop.runtime.group import LoopKernelGroup

SIZES = [int(s) for s in os.environ.get("ALLREDUCE_SIZES", "4096,32768,262144,1048576,16777216,268435456").split(",")]
WORLD = 2


def nccl_seconds(nbytes: int, repeat: int = 30) -> float:
    from torch.cuda import nccl

    xs = [torch.randn(nbytes // 2, device=f"cuda:{d}", dtype=torch.bfloat16) for d in range(WORLD)]
    for _ in range(5):
        nccl.all_reduce(xs)
    for d in range(WORLD):
        torch.cuda.synchronize(d)
    times = []
    for _ in range(repeat):
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(WORLD)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(WORLD)]
        for d in range(WORLD):
            with torch.cuda.device(d):
                starts[d].record()
        nccl.all_reduce(xs)
        for d in range(WORLD):
            with torch.cuda.device(d):
                ends[d].record()
        for d in range(WORLD):
            ends[d].synchronize()
        times.append(max(s.elapsed_time(e) for s, e in zip(starts, ends)) / 1e3)
    return float(np.median(times))


def loop_seconds(nbytes: int) -> tuple[float, int]:
    n = nbytes // 2
    graphs = ml.spmd(lambda g: g.output("y", ml.all_reduce(g.input("x", (n,), ml.bfloat16))), WORLD)
    plan = make_plan(graphs, processors=132)
    rng = np.random.default_rng(nbytes)
    feeds = [{"x": rng.standard_normal(n, dtype=np.float32)} for _ in range(WORLD)]
    iterations = 200 if nbytes <= 1 << 20 else 20
    with LoopKernelGroup(plan) as gr:
        out = gr.run(feeds)
        want = ml.dtypes.round_to(feeds[0]["x"], ml.bfloat16).astype(np.float32) + ml.dtypes.round_to(
            feeds[1]["x"], ml.bfloat16
        ).astype(np.float32)
        assert np.array_equal(out[0]["y"], ml.dtypes.round_to(want, ml.bfloat16)), "loop-kernel all-reduce is wrong"
        seconds = resident_seconds(gr, iterations)
    return seconds, len(plan.ranks[0].tasks)


def main() -> None:
    results: dict = {"world": WORLD, "sizes": {}}
    for nbytes in SIZES:
        loop_s, tasks = loop_seconds(nbytes)
        nccl_s = nccl_seconds(nbytes)
        bus = 2 * (WORLD - 1) / WORLD * nbytes
        results["sizes"][str(nbytes)] = {
            "loop_us": loop_s * 1e6,
            "nccl_us": nccl_s * 1e6,
            "loop_bus_GBps": bus / loop_s / 1e9,
            "nccl_bus_GBps": bus / nccl_s / 1e9,
            "speedup_vs_nccl": nccl_s / loop_s,
            "tasks_per_rank": tasks,
        }
        print(nbytes, results["sizes"][str(nbytes)], flush=True)
    write("allreduce", results)


if __name__ == "__main__":
    main()

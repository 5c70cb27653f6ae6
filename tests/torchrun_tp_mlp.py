"""Run by tests/test_gpu_multi.py under torchrun (one process per GPU): the tensor-parallel MLP on a
DistributedLoopKernel per rank against the CPU reference; rank 0 prints OK or what differed."""

from __future__ import annotations

import sys

import numpy as np
import torch.distributed as dist

import megaloop as ml
from megaloop.plan import make_plan
from megaloop.runtime.distributed import DistributedLoopKernel

WORLD, HIDDEN, FFN = 2, 256, 1024


def build(g: ml.Graph) -> None:
    x = g.input("x", (8, HIDDEN), ml.bfloat16)
    w1 = g.parameter("w1", (FFN // WORLD, HIDDEN), ml.bfloat16)
    w2 = g.parameter("w2", (HIDDEN, FFN // WORLD), ml.bfloat16)
    g.output("y", ml.all_reduce(ml.linear(ml.silu(ml.linear(x, w1)), w2)))


def main() -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    graphs = ml.spmd(build, WORLD)
    rng = np.random.default_rng(0)  # the same draws on every rank
    x = rng.standard_normal((8, HIDDEN))
    params = [
        {
            "w1": rng.standard_normal((FFN // WORLD, HIDDEN)) * 0.05,
            "w2": rng.standard_normal((HIDDEN, FFN // WORLD)) * 0.05,
        }
        for _ in range(WORLD)
    ]
    ref = ml.evaluate(graphs, [{"x": x}] * WORLD, params)[rank].outputs["y"].astype(np.float64)
    with DistributedLoopKernel(make_plan(graphs, processors=132), params[rank]) as k:
        outs = [k.run({"x": x})["y"] for _ in range(20)]
    bad = [i for i, o in enumerate(outs) if o.tobytes() != outs[0].tobytes()]
    d = float(np.abs(outs[0].astype(np.float64) - ref).max())
    gathered: list = [None] * WORLD
    dist.all_gather_object(gathered, outs[0].tobytes())
    ok = not bad and d <= 0.02 * np.abs(ref).max() and gathered[0] == gathered[1]
    if rank == 0:
        print(
            "OK" if ok else f"FAIL: runs {bad} differ, max difference {d:.3e}, ranks agree {gathered[0] == gathered[1]}"
        )
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Run by tests/test_gpu_multi.py under torchrun (one process per GPU): the tensor-parallel MLP on a
DistributedLoopKernel per rank against the CPU reference; rank 0 prints OK or what differed, and
which peer memory the ranks used (peer_memory=symmetric or ipc; $MEGALOOP_PEER_MEMORY chooses)."""

from __future__ import annotations

import sys

import numpy as np
import torch.distributed as dist

import megaloop as ml
from megaloop.plan import make_plan
from megaloop.runtime.distributed import DistributedLoopKernel
from tests.helpers import tp_mlp

WORLD = 2


def main() -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    graphs, x, params = tp_mlp(WORLD, tokens=8, hidden=256, ffn=1024, scale=0.05, seed=0)  # same on every rank
    ref = ml.evaluate(graphs, [{"x": x}] * WORLD, params)[rank].outputs["y"].astype(np.float64)
    with DistributedLoopKernel(make_plan(graphs, processors=132), params[rank]) as k:
        outs = [k.run({"x": x})["y"] for _ in range(20)]
    used = f"peer_memory={k.peer_memory} {k.peer_memory_note}".strip()
    bad = [i for i, o in enumerate(outs) if o.tobytes() != outs[0].tobytes()]
    d = float(np.abs(outs[0].astype(np.float64) - ref).max())
    gathered: list = [None] * WORLD
    dist.all_gather_object(gathered, outs[0].tobytes())
    ok = not bad and d <= 0.02 * np.abs(ref).max() and gathered[0] == gathered[1]
    if rank == 0:
        print(
            f"OK {used}"
            if ok
            else f"FAIL: runs {bad} differ, max difference {d:.3e}, ranks agree {gathered[0] == gathered[1]}; {used}"
        )
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

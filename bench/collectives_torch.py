"""PyTorch side of bench/collectives.py, run under torchrun (one process per GPU, NCCL): all_reduce,
all_gather and reduce_scatter of bf16, per call, timed with CUDA events (median), three ways:

- ``nccl_eager_us``: CALLS back-to-back calls between two events, divided by CALLS;
- ``nccl_graph_us``: the same CALLS calls captured in one CUDA graph, replayed (no launch overhead:
  what NCCL costs inside a CUDA-graphed model);
- ``symm_mem_one_shot_us`` (all_reduce only): torch symmetric memory's one-shot all-reduce
  (torch.ops.symm_mem.one_shot_all_reduce, every rank reads every peer's buffer), when this torch has it.

Sizes are bytes of each rank's input (all_gather: of its output), as in bench/collectives.py. A
measurement that fails is recorded with its error instead of stopping the others. Rank 0 prints one
JSON line; the process exits without tearing NCCL down (a hang at shutdown lost the result once)."""

from __future__ import annotations

import json
import os
import sys
from functools import partial

import torch
import torch.distributed as dist

from bench.common import cuda_graph, time_torch

SIZES = [int(s) for s in os.environ.get("COLLECTIVE_SIZES", "4096,32768,262144,1048576,16777216,268435456").split(",")]
CALLS = 20


def buffers(kind: str, n: int, world: int):
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(x)
    if kind == "all_gather":  # n: the gathered output
        out = torch.empty(n, device="cuda", dtype=torch.bfloat16)
        piece = x[: n // world].contiguous()
        return lambda: dist.all_gather_into_tensor(out, piece)
    out = torch.empty(n // world, device="cuda", dtype=torch.bfloat16)
    return lambda: dist.reduce_scatter_tensor(out, x)


def back_to_back(fn):
    def calls():
        for _ in range(CALLS):
            fn()

    return calls


def per_call_us(fn) -> float:
    return time_torch(back_to_back(fn), warmup=2, repeat=15) * 1e6 / CALLS


def graphed_us(fn) -> float:
    return time_torch(cuda_graph(back_to_back(fn)).replay, warmup=3, repeat=15) * 1e6 / CALLS


def symm_mem_one_shot(n: int):
    import torch.distributed._symmetric_memory as symm_mem

    group = dist.group.WORLD.group_name
    if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed by older torch, harmless after
        symm_mem.enable_symm_mem_for_group(group)
    x = symm_mem.empty(n, device="cuda", dtype=torch.bfloat16)
    symm_mem.rendezvous(x, group)
    x.normal_()
    return lambda: torch.ops.symm_mem.one_shot_all_reduce(x, "sum", group)


def one_shot_us(n: int) -> float:
    return per_call_us(symm_mem_one_shot(n))


def measure(row: dict, key: str, make) -> None:
    try:
        row[key] = make()
    except Exception as e:  # recorded, not fatal: the other columns are still worth having
        row[key + "_error"] = f"{type(e).__name__}: {e}"[:300]


def main() -> None:
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)  # before the communicator: else every rank may land on GPU 0
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    out: dict = {}
    for kind in ("all_reduce", "all_gather", "reduce_scatter"):
        rows = out[kind] = {}
        for nbytes in SIZES:
            print(f"rank {rank}: {kind} {nbytes}", file=sys.stderr, flush=True)  # where a hang happened
            fn = buffers(kind, nbytes // 2, world)
            row: dict = {}
            measure(row, "nccl_eager_us", partial(per_call_us, fn))
            measure(row, "nccl_graph_us", partial(graphed_us, fn))
            rows[str(nbytes)] = row
            torch.cuda.synchronize()
    if rank == 0:  # NCCL's figures first: symmetric memory (alpha) could hang; the last line wins
        print("RESULT " + json.dumps(out), flush=True)
    for nbytes in SIZES:
        print(f"rank {rank}: symm_mem one-shot all_reduce {nbytes}", file=sys.stderr, flush=True)
        measure(out["all_reduce"][str(nbytes)], "symm_mem_one_shot_us", partial(one_shot_us, nbytes // 2))
        torch.cuda.synchronize()
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # no NCCL teardown: a hang there once cost the whole result


if __name__ == "__main__":
    main()

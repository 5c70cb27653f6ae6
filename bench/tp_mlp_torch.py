"""PyTorch + NCCL side of bench/tp_mlp.py, run under torchrun (one process per GPU): a Megatron-style
tensor-parallel MLP step, eager and captured in a CUDA graph, timed with CUDA events (median).
Rank 0 prints one JSON line."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from bench.common import cuda_graph, time_torch

HIDDEN, FFN = 4096, 16384
TOKENS = [int(t) for t in os.environ.get("TP_TOKENS", "8,512").split(",")]


def main() -> None:
    # the device first: a communicator made before set_device can land every rank on GPU 0
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator(device="cuda").manual_seed(rank)
    w1 = torch.randn(FFN // world, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen) / 64
    w2 = torch.randn(HIDDEN, FFN // world, device="cuda", dtype=torch.bfloat16, generator=gen) / 64
    out = {}
    for tokens in TOKENS:
        print(f"rank {rank}: {tokens} tokens", file=sys.stderr, flush=True)  # where a hang happened
        x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)

        def step(x=x):
            y = F.silu(x @ w1.T) @ w2.T
            dist.all_reduce(y)
            return y

        eager = time_torch(step, repeat=50) * 1e6
        print(f"rank {rank}: eager {eager:.1f} us, capturing", file=sys.stderr, flush=True)
        graphed = time_torch(cuda_graph(step).replay, repeat=50) * 1e6
        out[str(tokens)] = {"torch_eager_us": eager, "torch_cuda_graph_us": graphed}
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    dist.barrier()
    print(f"rank {rank}: done", file=sys.stderr, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

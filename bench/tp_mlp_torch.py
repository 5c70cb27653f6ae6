"""PyTorch + NCCL side of bench/tp_mlp.py, run under torchrun (one process per GPU): a Megatron-style
tensor-parallel MLP step, eager and captured in a CUDA graph, timed with CUDA events (median).
Rank 0 prints one JSON line."""

from __future__ import annotations

import json
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

HIDDEN, FFN = 4096, 16384
TOKENS = [int(t) for t in os.environ.get("TP_TOKENS", "8,512").split(",")]


def timed(fn, repeat: int = 50) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return float(np.median(times))


def main() -> None:
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    gen = torch.Generator(device="cuda").manual_seed(rank)
    w1 = torch.randn(FFN // world, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    w2 = torch.randn(HIDDEN, FFN // world, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    out = {}
    for tokens in TOKENS:
        x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)

        def step(x=x):
            y = F.silu(x @ w1.T) @ w2.T
            dist.all_reduce(y)
            return y

        eager = timed(step)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        graphed = timed(graph.replay)
        out[str(tokens)] = {"torch_eager_us": eager, "torch_cuda_graph_us": graphed}
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

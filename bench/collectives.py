"""Collectives of bf16 vectors, 4 KB to 256 MB, on 2 GPUs: inside the loop kernel (one process, peer
memory, tiles pulled over NVLink and combined in rank order) against NCCL driven from the same process
(torch.cuda.nccl), same run. Sizes are the bytes of each rank's input (all_gather: of its output).

Two ways of timing the loop kernel, because its iterations may overlap (a block starts iteration k + 1
as soon as that task's waits allow, not after a barrier):
- ``dependent_us`` (all_reduce only; ``dependent_pull_us``: the same with the tile parameter push 0,
  each member pulling the others' tiles): a chain of all-reduces, each reading the previous one's result,
  whose last result is the next iteration's first input (a state): nothing overlaps, so this is the
  latency of one all-reduce, hop included. The sums double every step and overflow to inf after a few
  iterations; the data moved and the arithmetic are the same (timing on bf16 does not depend on values).
- ``overlapped_us``: one collective per iteration on a fixed input, so consecutive iterations overlap:
  a throughput figure (bytes per second of back-to-back collectives), not a latency.
NCCL from this process (torch.cuda.nccl, ``nccl_one_process_us``): the median over repeats of ``CALLS``
back-to-back calls between device events, per call; host-launch bound at small sizes. NCCL under
torchrun, eager and in a CUDA graph, and torch symmetric memory's one-shot all-reduce
(``torch_*`` columns) come from bench/collectives_torch.py, run first in the same job.
Bus bandwidth: (n - 1) / n x bytes of the full vector / time, x 2 for all_reduce (NCCL's convention).
``send_recv``: the loop kernel only, a chain of dependent hops (swap_graphs), pushed and pulled."""

from __future__ import annotations

import os
from functools import partial

import numpy as np
import torch

import megaloop as ml
from bench.common import resident_seconds, torchrun_result, write
from megaloop.dtypes import round_to
from megaloop.plan import make_plan
from megaloop.runtime.group import LoopKernelGroup

SIZES = [int(s) for s in os.environ.get("COLLECTIVE_SIZES", "4096,32768,262144,1048576,16777216,268435456").split(",")]
KINDS = os.environ.get("COLLECTIVES", "all_reduce,all_gather,reduce_scatter,send_recv").split(",")
WORLD = 2
CALLS = 20


def chain_depth(nbytes: int) -> int:
    """All-reduces per iteration in the dependent chain: many for small sizes (the iteration's own
    overhead is shared by them), two at 256 MB (the states alone are 2 x 256 MB a rank)."""
    return 16 if nbytes <= 1 << 20 else 4 if nbytes <= 16 << 20 else 2


def nccl_seconds(kind: str, nbytes: int, repeat: int = 15) -> float:
    from torch.cuda import nccl

    n = nbytes // 2
    ins = [torch.randn(n, device=f"cuda:{d}", dtype=torch.bfloat16) for d in range(WORLD)]
    if kind == "all_reduce":
        call = partial(nccl.all_reduce, ins)
    elif kind == "all_gather":  # nbytes is the gathered output
        pieces = [x[: n // WORLD].contiguous() for x in ins]
        call = partial(nccl.all_gather, pieces, ins)
    else:
        outs = [torch.empty(n // WORLD, device=f"cuda:{d}", dtype=torch.bfloat16) for d in range(WORLD)]
        call = partial(nccl.reduce_scatter, ins, outs)
    for _ in range(5):
        call()
    for d in range(WORLD):
        torch.cuda.synchronize(d)
    times = []
    for _ in range(repeat):
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(WORLD)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(WORLD)]
        for d in range(WORLD):
            with torch.cuda.device(d):
                starts[d].record()
        for _ in range(CALLS):
            call()
        for d in range(WORLD):
            with torch.cuda.device(d):
                ends[d].record()
        for d in range(WORLD):
            ends[d].synchronize()
        times.append(max(s.elapsed_time(e) for s, e in zip(starts, ends)) / 1e3 / CALLS)
    return float(np.median(times))


def bf16(x: np.ndarray) -> np.ndarray:
    return round_to(x, ml.bfloat16).astype(np.float32)


def rank_data(rank: int, n: int) -> np.ndarray:
    return np.random.default_rng([n, rank]).standard_normal(n, dtype=np.float32)


def chain_graphs(n: int, depth: int, world: int = WORLD) -> list[ml.Graph]:
    """``depth`` all-reduces of n bf16 a rank, each of the previous one's result; the last one is the
    next iteration's first input (the state ``s``, rank_data at first)."""

    def build(g: ml.Graph) -> None:
        s = g.state("s", (n,), ml.bfloat16, init=rank_data(g.rank, n))
        y = s
        for _ in range(depth):
            y = ml.all_reduce(y)
        g.output("y", y)
        g.assign(s, y)  # written in place by the last all-reduce: no copy (the plan has only all-reduces)

    return ml.spmd(build, world)


def dependent_seconds(nbytes: int, push: int = 1) -> float:
    """Seconds per all-reduce in a chain where each reads the previous one's result (see above);
    ``push`` 0: the members pull each other's tiles (the all_reduce tile parameter)."""
    n, depth = nbytes // 2, chain_depth(nbytes)
    plan = make_plan(chain_graphs(n, depth), processors=132, tiles={"all_reduce": {"push": push}})
    assert all(op.op == "all_reduce" for op in plan.ranks[0].ops), "the chain has copies in it"
    with LoopKernelGroup(plan) as gr:
        out = gr.run()  # one iteration: (s0 + s1) doubled depth - 1 times, exactly
        want = bf16(bf16(rank_data(0, n)) + bf16(rank_data(1, n))) * 2.0 ** (depth - 1)
        for r in range(WORLD):
            assert np.array_equal(out[r]["y"], want), f"loop-kernel all-reduce chain is wrong on rank {r}"
        iterations = 50 if nbytes <= 1 << 20 else 5
        return resident_seconds(gr, iterations) / depth


def swap_graphs(n: int, depth: int) -> list[ml.Graph]:
    """``depth`` hops a rank: each sends what it holds to the other and holds what it receives, so
    every hop waits for the previous one; the last is the next iteration's first (the state ``s``,
    rank_data at first). After an odd number of hops each rank holds the other's data."""

    def build(g: ml.Graph) -> None:
        s = g.state("s", (n,), ml.bfloat16, init=rank_data(g.rank, n))
        y = s
        for d in range(depth):
            ml.send(y, 1 - g.rank, tag=d)
            y = ml.recv(g, 1 - g.rank, (n,), ml.bfloat16, tag=d)
        g.output("y", y)
        g.assign(s, y)

    return ml.spmd(build, 2)


def hop_seconds(nbytes: int, push: int) -> float:
    """Seconds per send/recv hop in the swap chain (see swap_graphs); ``push``: the recv's tile parameter
    (1: the send stores into the receiver's memory; 0: the recv pulls from the sender's)."""
    n, depth = nbytes // 2, chain_depth(nbytes)
    plan = make_plan(swap_graphs(n, depth), processors=132, tiles={"recv": {"push": push}})
    with LoopKernelGroup(plan) as gr:
        out = gr.run()
        for r in range(WORLD):  # depth is even: each rank holds its own data again
            assert np.array_equal(out[r]["y"], bf16(rank_data(r, n))), f"send/recv chain is wrong on rank {r}"
        iterations = 50 if nbytes <= 1 << 20 else 5
        return resident_seconds(gr, iterations) / depth


def overlapped_seconds(kind: str, nbytes: int) -> tuple[float, int]:
    """Seconds per collective, one per iteration on a fixed input (iterations overlap; see above)."""
    n = nbytes // 2
    n_in = n // WORLD if kind == "all_gather" else n

    def build(g: ml.Graph) -> None:
        x = g.input("x", (n_in,), ml.bfloat16)
        g.output("y", getattr(ml, kind)(x) if kind != "all_gather" else ml.all_gather(x, axis=0))

    plan = make_plan(ml.spmd(build, WORLD), processors=132)
    feeds = [{"x": rank_data(r, n_in)} for r in range(WORLD)]
    xs = [bf16(f["x"]) for f in feeds]
    want = {
        "all_reduce": [bf16(xs[0] + xs[1])] * WORLD,
        "all_gather": [np.concatenate(xs)] * WORLD,
        "reduce_scatter": list(np.split(bf16(xs[0] + xs[1]), WORLD)),
    }[kind]
    with LoopKernelGroup(plan) as gr:
        out = gr.run(feeds)
        for r in range(WORLD):
            assert np.array_equal(out[r]["y"], want[r]), f"loop-kernel {kind} is wrong on rank {r}"
        seconds = resident_seconds(gr, 200 if nbytes <= 1 << 20 else 20)
    return seconds, len(plan.ranks[0].tasks)


def bus(kind: str, nbytes: int, seconds: float) -> float:
    return (2 if kind == "all_reduce" else 1) * (WORLD - 1) / WORLD * nbytes / seconds / 1e9


def main() -> None:
    results: dict = {"world": WORLD, "nccl_calls_per_timing": CALLS}
    # PyTorch under torchrun first, while no loop kernel holds the GPUs: NCCL eager and CUDA-graphed,
    # torch symmetric memory's one-shot all-reduce (bench/collectives_torch.py). A failure is recorded.
    try:
        torch_rows = torchrun_result("collectives_torch.py", WORLD, timeout=300)
    except RuntimeError as e:
        torch_rows = {}
        results["torch_error"] = str(e)[-1500:]
        print("PyTorch side failed:", results["torch_error"], flush=True)
    for kind in KINDS:
        rows = results[kind] = {}
        if kind == "send_recv":  # the loop kernel only: a dependent hop, pushed and pulled
            for nbytes in SIZES:
                push_s, pull_s = hop_seconds(nbytes, 1), hop_seconds(nbytes, 0)
                rows[str(nbytes)] = {
                    "hop_push_us": push_s * 1e6,
                    "hop_pull_us": pull_s * 1e6,
                    "hop_push_GBps": nbytes / push_s / 1e9,
                    "hop_pull_GBps": nbytes / pull_s / 1e9,
                    "chain_depth": chain_depth(nbytes),
                }
                print(kind, nbytes, {k: round(v, 2) for k, v in rows[str(nbytes)].items()}, flush=True)
            continue
        for nbytes in SIZES:
            loop_s, tasks = overlapped_seconds(kind, nbytes)
            nccl_s = nccl_seconds(kind, nbytes)
            row = {
                "overlapped_us": loop_s * 1e6,
                "nccl_one_process_us": nccl_s * 1e6,
                "overlapped_bus_GBps": bus(kind, nbytes, loop_s),
                "nccl_one_process_bus_GBps": bus(kind, nbytes, nccl_s),
                "tasks_per_rank": tasks,
            }
            theirs = torch_rows.get(kind, {}).get(str(nbytes), {})
            row.update({f"torch_{k}": v for k, v in theirs.items()})
            for key in ("nccl_eager_us", "nccl_graph_us", "symm_mem_one_shot_us"):
                if isinstance(theirs.get(key), float):
                    row[f"torch_{key[:-3]}_bus_GBps"] = bus(kind, nbytes, theirs[key] / 1e6)
            if kind == "all_reduce":
                dep_s = dependent_seconds(nbytes)
                pull_s = dependent_seconds(nbytes, push=0)
                row.update(
                    dependent_us=dep_s * 1e6,
                    dependent_pull_us=pull_s * 1e6,
                    dependent_pull_bus_GBps=bus(kind, nbytes, pull_s),
                    dependent_bus_GBps=bus(kind, nbytes, dep_s),
                    chain_depth=chain_depth(nbytes),
                    dependent_speedup_vs_nccl_one_process=nccl_s / dep_s,
                )
                for key in ("nccl_graph_us", "symm_mem_one_shot_us"):
                    if isinstance(theirs.get(key), float):
                        row[f"dependent_speedup_vs_torch_{key[:-3]}"] = theirs[key] / 1e6 / dep_s
            rows[str(nbytes)] = row
            print(kind, nbytes, {k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    write("collectives", results)


if __name__ == "__main__":
    main()

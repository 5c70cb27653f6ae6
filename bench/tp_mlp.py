"""The tensor-parallel MLP the partitioner makes of a single-device MLP (ml.parallelize: both weights
cut, one all-reduce) at hidden 4096 on 2 GPUs, per step: the loop kernel (matmul tiles and all-reduce
tiles overlapped: a tile of the all-reduce starts when the matmul tiles it needs are done, on each
rank) with each step's input the
previous step's output (``loop_dependent_us``: what a model's consecutive layers need, and what the
PyTorch ratios use) and with a fixed input (``loop_overlapped_us``: consecutive steps may overlap in
the resident kernel), the same work as two dependent loop kernels run one after the other (compute,
then the all-reduce: ``loop_no_overlap_us``), and PyTorch + NCCL eager and CUDA-graphed
(bench/tp_mlp_torch.py under torchrun, steps in stream order), all in one run."""

from __future__ import annotations

import os

import numpy as np

import megaloop as ml
from bench.common import matmul_tiles, resident_seconds, torchrun_result, write
from megaloop.plan import make_plan
from megaloop.runtime.group import LoopKernelGroup

HIDDEN, FFN, WORLD = 4096, 16384, 2
TOKENS = [int(t) for t in os.environ.get("TP_TOKENS", "8,512").split(",")]
TILES = matmul_tiles()  # the defaults, or MEGALOOP_BENCH_MATMUL's settings


def graphs(tokens: int, part: str, x0: np.ndarray, fixed_input: bool = False):
    """One step: "fused" (the partitioner's split of the single-device MLP: matmuls and the all-reduce
    in one kernel), "compute" (the same ranks' graphs without their all-reduce) or "comm" (the
    all-reduce alone, twice: see below). Each step's input is the previous step's output (a state
    starting at x0), so steps cannot overlap, as consecutive layers of a model; ``fixed_input`` gives
    "fused" the same input x0 every step instead (consecutive steps may then overlap)."""
    if part == "comm":

        def build(g: ml.Graph) -> None:  # two chained all-reduces: the second writes the state in place
            x = g.state("x", (tokens, HIDDEN), ml.bfloat16, init=x0)  # (one alone reads it while writing)
            y = ml.all_reduce(ml.all_reduce(x))
            g.output("y", y)
            g.assign(x, y)

        return ml.spmd(build, WORLD)
    ranks = split(tokens, x0, fixed_input).graphs
    if part == "compute":
        for rank in ranks:
            (reduce,) = [n for n in rank.nodes if n.op.name == "all_reduce"]
            rank.replace_uses(reduce.outputs[0], reduce.inputs[0])
            rank.nodes.remove(reduce)
            for i, n in enumerate(rank.nodes):
                n.id = i
    return ranks


def split(tokens: int, x0: np.ndarray, fixed_input: bool) -> ml.Partition:
    """The single-device MLP step, tensor parallel over WORLD GPUs by ml.parallelize."""
    g = ml.Graph("mlp")
    if fixed_input:
        x = g.input("x", (tokens, HIDDEN), ml.bfloat16)
    else:
        x = g.state("x", (tokens, HIDDEN), ml.bfloat16, init=x0)
    w1 = g.parameter("w1", (FFN, HIDDEN), ml.bfloat16)
    w2 = g.parameter("w2", (HIDDEN, FFN), ml.bfloat16)
    y = ml.linear(ml.silu(ml.linear(x, w1)), w2)
    g.output("y", y)
    if not fixed_input:
        g.assign(x, y)
    return ml.parallelize(g, WORLD, "tp")


def weights(rng: np.random.Generator) -> list[dict]:
    """Each rank's pieces of the single-device MLP's weights (1/64: the step keeps the activations' scale
    roughly, as the dependent variant feeds each step's output back in for a hundred steps)."""
    full = {
        "w1": rng.standard_normal((FFN, HIDDEN), dtype=np.float32) / 64,
        "w2": rng.standard_normal((HIDDEN, FFN), dtype=np.float32) / 64,
    }
    return split(8, np.zeros((8, HIDDEN), np.float32), True).shard_parameters(full)


def plan_of(tokens: int, part: str, x0: np.ndarray, fixed_input: bool = False):
    plan = make_plan(graphs(tokens, part, x0, fixed_input), processors=132, tiles=TILES)
    assert "assign:x" not in {op.name for op in plan.ranks[0].ops}, "the step copies its state"
    return plan


def per_step(gr: LoopKernelGroup, feeds: list, iterations: int) -> float:
    gr.run(feeds)
    return resident_seconds(gr, iterations)


def torch_side() -> dict:
    return torchrun_result("tp_mlp_torch.py", WORLD, timeout=150)


def main() -> None:
    rng = np.random.default_rng(0)
    params = weights(rng)
    results: dict = {"hidden": HIDDEN, "ffn": FFN, "world": WORLD, "tokens": {}}
    # PyTorch first, while this process has no loop kernel on the GPUs (a resident kernel holds every
    # SM: had one outlived its group, torchrun's kernels would never start). A failure there is
    # recorded, not fatal: the loop kernel's numbers are still worth writing.
    try:
        torch_rows = torch_side()
    except RuntimeError as e:
        torch_rows = {}
        results["torch_error"] = str(e)[-1500:]
        print("PyTorch side failed:", results["torch_error"], flush=True)
    for tokens in TOKENS:
        x = rng.standard_normal((tokens, HIDDEN), dtype=np.float32)
        iterations = 100 if tokens <= 64 else 20
        row: dict = {}
        with LoopKernelGroup(plan_of(tokens, "fused", x, fixed_input=True), params) as gr:
            row["loop_overlapped_us"] = per_step(gr, [{"x": x}] * WORLD, iterations) * 1e6
        with LoopKernelGroup(plan_of(tokens, "fused", x), params) as gr:
            row["loop_dependent_us"] = per_step(gr, [None] * WORLD, iterations) * 1e6
        with LoopKernelGroup(plan_of(tokens, "compute", x), params) as gr:
            compute = per_step(gr, [None] * WORLD, iterations)
        with LoopKernelGroup(plan_of(tokens, "comm", x)) as gr:  # sums double each step: inf in time
            comm = per_step(gr, [None] * WORLD, iterations) / 2
        row["loop_no_overlap_us"] = (compute + comm) * 1e6
        results["tokens"][str(tokens)] = row
        print(tokens, row, flush=True)
    for tokens, row in torch_rows.items():
        results["tokens"][tokens].update(row)
        r = results["tokens"][tokens]
        # per step of a model: each step needs the previous step's output (PyTorch's steps run in order)
        r["speedup_vs_torch_eager"] = r["torch_eager_us"] / r["loop_dependent_us"]
        r["speedup_vs_torch_cuda_graph"] = r["torch_cuda_graph_us"] / r["loop_dependent_us"]
    results["matmul_tiles"] = TILES["matmul"]
    write("tp_mlp", results)


if __name__ == "__main__":
    main()

"""bf16 GEMM Y = A @ W^T (A [n, n] row-major, W [n, n] stored [out, in] as checkpoints store weights)
at n = 4096 and 8192: the loop kernel with the matmul tile switch ``tensor_cores`` on, against
torch.matmul (cuBLAS) in the same run, fresh random inputs, the result checked against torch's."""

from __future__ import annotations

import os
import time

import numpy as np
import torch

import megaloop as ml
from bench.common import resident_seconds, time_torch, write
from megaloop.plan import make_plan
from megaloop.runtime.loop import LoopKernel

SIZES = [int(s) for s in os.environ.get("GEMM_SIZES", "4096,8192").split(",")]
# GEMM_TILE=BMxBN: the matmul tile (default: the architecture's block_m x block_n)
TILE = (
    dict(zip(("block_m", "block_n"), (int(v) for v in os.environ["GEMM_TILE"].split("x"))))
    if "GEMM_TILE" in os.environ
    else {}
)


def main() -> None:
    rng = np.random.default_rng(0)
    results: dict = {"sizes": {}, "tile": TILE or "default"}
    for n in SIZES:
        g = ml.Graph(f"gemm{n}")
        a = g.input("a", (n, n), ml.bfloat16)
        w = g.input("w", (n, n), ml.bfloat16)
        g.output("y", ml.matmul(a, w, transpose_b=True))
        feeds = {"a": rng.standard_normal((n, n), dtype=np.float32), "w": rng.standard_normal((n, n), dtype=np.float32)}
        at = torch.tensor(feeds["a"], device="cuda").bfloat16()
        wt = torch.tensor(feeds["w"], device="cuda").bfloat16()
        torch_s = time_torch(lambda at=at, wt=wt: at @ wt.T, warmup=5, repeat=30)
        want = (at @ wt.T).float().cpu().numpy()
        t0 = time.perf_counter()
        plan = make_plan(g, processors=132, tiles={"matmul": {"tensor_cores": 1, **TILE}})
        plan_s = time.perf_counter() - t0
        iterations = 20 if n <= 4096 else 5
        with LoopKernel(plan) as k:
            got = k.run(feeds)["y"].astype(np.float32)
            loop_s = resident_seconds(k, iterations)
        rel = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        flops = 2.0 * n**3
        results["sizes"][str(n)] = {
            "loop_ms": loop_s * 1e3,
            "torch_ms": torch_s * 1e3,
            "loop_TFLOPs": flops / loop_s / 1e12,
            "torch_TFLOPs": flops / torch_s / 1e12,
            "ratio_vs_torch": torch_s / loop_s,
            "relative_l2_vs_torch": rel,
            "tasks": len(plan.ranks[0].tasks),
            "plan_s": plan_s,
        }
        print(n, results["sizes"][str(n)], flush=True)
    write("gemm", results)


if __name__ == "__main__":
    main()

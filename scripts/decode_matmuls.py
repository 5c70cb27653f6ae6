"""Tuning experiment, not a benchmark: how fast the loop kernel's decode matmul tiles stream their
weights on their own, outside a decode step. For each decode matmul shape of bench/llama_layer.py's
layers (one row against [out, in] bf16 weights), COPIES independent matmuls on different weights
(so that a step's weights are several times L2 and none is read from it) run as one loop-kernel
iteration, iterations back to back; the same matmuls through torch (cuBLAS), replayed as a CUDA
graph. Prints weight bytes per second for both. Writes $OUT/decode_matmuls.json.

    PYTHONPATH=. python scripts/decode_matmuls.py        # on a GPU machine
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch
import torch.nn.functional as F

import megaloop as ml
from bench.common import commit, cuda_graph, device_name, matmul_tiles, resident_seconds, time_torch
from megaloop.plan import make_plan
from megaloop.runtime.loop import LoopKernel

SHAPES = [(2048, 2048), (5504, 2048), (2048, 5504), (4096, 4096), (11008, 4096), (4096, 11008)]  # (out, in)
# weights a step: several times the 50 MB L2; DECODE_MATMULS_MIN_BYTES=0 runs one copy (its weights
# stay in L2 from one iteration to the next where they fit)
MIN_BYTES = int(os.environ.get("DECODE_MATMULS_MIN_BYTES", 160 << 20))


def graph(out: int, k: int, copies: int) -> ml.Graph:
    g = ml.Graph(f"decode-matmuls-{out}x{k}")
    x = g.input("x", (1, 1, k), ml.bfloat16)
    for c in range(copies):
        g.output(f"y{c}", ml.matmul(x, g.parameter(f"w{c}", (out, k), ml.bfloat16), transpose_b=True))
    return g


def torch_seconds(x: np.ndarray, weights: list[np.ndarray]) -> float:
    """The same matmuls through torch (cuBLAS), one CUDA graph replay: median seconds."""
    ws = [torch.tensor(w, dtype=torch.bfloat16, device="cuda") for w in weights]
    xt = torch.tensor(x, dtype=torch.bfloat16, device="cuda")
    replay = cuda_graph(lambda: [F.linear(xt, w) for w in ws])
    return time_torch(replay.replay, warmup=3, repeat=20)


def main() -> None:
    res = {"experiment": "decode_matmuls", "device": device_name(), "commit": commit(), "min_bytes": MIN_BYTES}
    res["matmul_tiles"] = matmul_tiles()["matmul"]
    rng = np.random.default_rng(0)
    for out, k in SHAPES:
        nbytes = out * k * 2
        copies = max(1, -(-MIN_BYTES // nbytes))
        params = {f"w{c}": rng.standard_normal((out, k), dtype=np.float32) for c in range(copies)}
        x = rng.standard_normal((1, 1, k), dtype=np.float32)
        plan = make_plan(graph(out, k, copies), processors=132, tiles=matmul_tiles())
        tasks = sum(1 for t in plan.ranks[0].tasks if t.op == 0)
        with LoopKernel(plan, params) as kern:
            kern.run({"x": x}, iterations=3)
            loop_s = resident_seconds(kern, 50)
        torch_s = torch_seconds(x, list(params.values()))
        row = {
            "copies": copies,
            "tiles_an_op": tasks,
            "loop_kernel_us_an_op": loop_s / copies * 1e6,
            "torch_us_an_op": torch_s / copies * 1e6,
            "loop_kernel_tb_s": nbytes * copies / loop_s / 1e12,
            "torch_tb_s": nbytes * copies / torch_s / 1e12,
        }
        res[f"{out}x{k}"] = row
        print(out, k, {n: round(v, 2) if isinstance(v, float) else v for n, v in row.items()}, flush=True)
        torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "decode_matmuls.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

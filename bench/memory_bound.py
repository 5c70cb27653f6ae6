"""Memory-bound ops at >= 1 GB moved: elementwise add, rmsnorm, softmax in bf16, through the loop
kernel, against the device-to-device copy bandwidth measured in the same run (bytes read + written).
Time per iteration is taken over many iterations of the resident kernel (fresh random inputs)."""

from __future__ import annotations

import numpy as np
import torch

import megaloop as ml
from bench.common import resident_seconds, time_torch, write
from megaloop.plan import make_plan
from megaloop.runtime.loop import LoopKernel

ROWS, COLS = 32768, 8192  # bf16: 512 MiB per tensor


def copy_bandwidth() -> float:
    x = torch.randn(ROWS * COLS * 2, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    seconds = time_torch(lambda: y.copy_(x), warmup=3, repeat=20)
    return 2 * x.numel() * 2 / seconds


def loop_time(g: ml.Graph, feeds: dict, iterations: int = 10) -> float:
    """Seconds an iteration of the resident kernel (bench.common.resident_seconds: the median of 5
    timed runs, one doorbell round trip each, ~10 us against ~5 ms of work)."""
    with LoopKernel(make_plan(g, processors=132)) as k:
        k.run(feeds, iterations=2)
        return resident_seconds(k, iterations)


def main() -> None:
    rng = np.random.default_rng(0)
    copy = copy_bandwidth()
    results = {"copy_bandwidth_GBps": copy / 1e9, "ops": {}}
    x = rng.standard_normal((ROWS, COLS), dtype=np.float32)
    y = rng.standard_normal((ROWS, COLS), dtype=np.float32)
    cases = {
        "add": (lambda g, a, b: a + b, 3),
        "rmsnorm": (lambda g, a, b: ml.rmsnorm(a, b[0]), 2),
        "softmax": (lambda g, a, b: ml.softmax(a, -1), 2),
    }
    for name, (build, tensors_moved) in cases.items():
        g = ml.Graph(name)
        a = g.input("a", (ROWS, COLS), ml.bfloat16)
        b = g.input("b", (ROWS, COLS), ml.bfloat16)
        g.output("y", build(g, a, b))
        seconds = loop_time(g, {"a": x, "b": y})
        moved = tensors_moved * ROWS * COLS * 2
        bw = moved / seconds
        results["ops"][name] = {
            "ms": seconds * 1e3,
            "GB_moved": moved / 1e9,
            "GBps": bw / 1e9,
            "fraction_of_copy": bw / copy,
        }
    write("memory_bound", results)


if __name__ == "__main__":
    main()

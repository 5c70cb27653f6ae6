"""Iteration overhead of the loop kernel: a one-task plan, timed (a) inside the kernel as wall time of
many iterations per doorbell ring over their count and (b) as a host run() round trip of one
iteration. Both exclude compilation and launch (the kernel is resident)."""

from __future__ import annotations

import time

import numpy as np

import megaloop as ml
from bench.common import write
from megaloop.plan import make_plan
from megaloop.runtime.loop import LoopKernel


def main() -> None:
    results = {}
    for processors in (1, 132):
        g = ml.Graph("tiny")
        s = g.state("s", (4,), ml.float32)
        g.assign(s, s + 1.0)
        g.output("s", s + 0.0)
        with LoopKernel(make_plan(g, processors=processors)) as k:
            k.run({}, iterations=100)  # warm up
            iters = 100_000
            t0 = time.perf_counter()
            k.start(iters)
            k.wait()
            per_iteration = (time.perf_counter() - t0) / iters
            trips = []
            for _ in range(300):
                t0 = time.perf_counter()
                k.start(1)
                k.wait()
                trips.append(time.perf_counter() - t0)
            state = k.state()["s"]
        results[f"processors_{processors}"] = {
            "tasks": len(make_plan(g, processors=processors).ranks[0].tasks),
            "us_per_iteration_in_kernel": per_iteration * 1e6,
            "host_round_trip_us_median": float(np.median(trips) * 1e6),
            "host_round_trip_us_p99": float(np.percentile(trips, 99) * 1e6),
            "final_state_check": float(state[0]),
        }
    write("loop_overhead", results)


if __name__ == "__main__":
    main()

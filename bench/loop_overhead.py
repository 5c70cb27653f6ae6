"""Iteration overhead of the loop kernel: a one-task plan, timed (a) inside the kernel as wall time of
many iterations per doorbell ring over their count and (b) as a host run() round trip of one
iteration. Both exclude compilation and launch (the kernel is resident). Then (c) the round trip
split into its parts with the kernel's %globaltimer stamps (LoopKernel.grant_ns, profile_ns) beside
the host's clock: the doorbell to block 0, block 0 to the last block, the tasks, the last block's
end to the host seeing it."""

from __future__ import annotations

import time

import numpy as np

import megaloop as ml
from bench.common import write
from megaloop.plan import make_plan
from megaloop.runtime.loop import LoopKernel

SPLIT_TRIPS = 300


def round_trip_parts(plan) -> dict[str, float]:
    """Medians over SPLIT_TRIPS one-iteration round trips of a profiled kernel, in us. The host's
    stamps are CLOCK_REALTIME and the kernel's %globaltimer: the parts that cross between them hold
    the clocks' offset too (the device-only parts do not)."""
    host = np.zeros((SPLIT_TRIPS, 2), np.int64)
    with LoopKernel(plan, profile_iterations=SPLIT_TRIPS) as k:
        for i in range(SPLIT_TRIPS):
            host[i, 0] = time.time_ns()
            k.start(1)
            k.wait()
            host[i, 1] = time.time_ns()
        grant = k.grant_ns().astype(np.int64)  # (trip, block, (seen, done))
        tasks = k.profile_ns().astype(np.int64)  # (trip, task, (start, end))
    parts = {
        "host_total": host[:, 1] - host[:, 0],
        "host_ring_to_block0_seen (clock offset included)": grant[:, 0, 0] - host[:, 0],
        "block0_seen_to_last_block_seen": grant[:, :, 0].max(1) - grant[:, 0, 0],
        "last_block_seen_to_first_task_start": tasks[:, :, 0].min(1) - grant[:, :, 0].max(1),
        "tasks_first_start_to_last_end": tasks[:, :, 1].max(1) - tasks[:, :, 0].min(1),
        "last_task_end_to_last_block_done": grant[:, :, 1].max(1) - tasks[:, :, 1].max(1),
        "last_block_done_to_host_seen (clock offset included)": host[:, 1] - grant[:, :, 1].max(1),
    }
    return {name: float(np.median(v[10:]) / 1e3) for name, v in parts.items()}  # (the first trips warm up)


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
            "round_trip_parts_us_median": round_trip_parts(make_plan(g, processors=processors)),
        }
        print(processors, results[f"processors_{processors}"], flush=True)
    write("loop_overhead", results)


if __name__ == "__main__":
    main()

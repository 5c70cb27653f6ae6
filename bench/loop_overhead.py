"""Iteration overhead of the loop kernel, for each setting of the loop's own cost (KernelOptions:
task_records, completion_word, doorbell_reads) in the same run, alternating: a 3-task plan timed
(a) inside the kernel as wall time of many iterations per doorbell ring over their count and (b) as
a host start()+wait() round trip of one iteration. Both exclude compilation and launch (the kernel
is resident). Then (c) the round trip split into its parts ("parts"), with the kernel's
%globaltimer stamps (KernelOptions.round_trip_stamps) on the host's clock: block 0 reads the host's
clock word with the doorbell in one load, so each trip calibrates the two clocks (docs/runtime.md,
"The loop's own cost").

    python -m bench.loop_overhead [--variants baseline,records,...] [--rounds 2]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import megaloop as ml
from bench.common import write
from megaloop.plan import KernelOptions, make_plan
from megaloop.runtime.loop import HOST_NS, LoopKernel
from megaloop.runtime.stamps import STAMP_FIELDS

SPLIT_TRIPS = 300
WARM = 20  # the first trips of each measurement warm up (not counted)
VARIANTS = {
    "baseline": {},
    "records": {"task_records": 1},
    "completion": {"completion_word": 1},
    "doorbell1": {"doorbell_reads": 1},
    "doorbell4": {"doorbell_reads": 4},
    "all": {"task_records": 1, "completion_word": 1, "doorbell_reads": 4},
}
F = {name: i for i, name in enumerate(STAMP_FIELDS)}


def tiny_graph() -> ml.Graph:
    """3 chained tasks: s + 1 (the next state), s + 0 (the output), the state's copy."""
    g = ml.Graph("tiny")
    s = g.state("s", (4,), ml.float32)
    g.assign(s, s + 1.0)
    g.output("s", s + 0.0)
    return g


def timings(plan) -> dict[str, float]:
    """(a) and (b) for one plan, on a fresh kernel."""
    with LoopKernel(plan) as k:
        k.run({}, iterations=100)  # warm up
        iters = 100_000
        t0 = time.perf_counter()
        k.start(iters)
        k.wait()
        per_iteration = (time.perf_counter() - t0) / iters
        trips = []
        for _ in range(SPLIT_TRIPS):
            t0 = time.perf_counter()
            k.start(1)
            k.wait()
            trips.append(time.perf_counter() - t0)
        state = float(k.state()["s"][0])
    trips = np.array(trips[WARM:])
    expected = 100 + iters + SPLIT_TRIPS
    assert state == expected, f"state {state} after {expected} iterations: the kernel skipped or repeated some"
    return {
        "us_per_iteration_in_kernel": per_iteration * 1e6,
        "host_round_trip_us_median": float(np.median(trips) * 1e6),
        "host_round_trip_us_p99": float(np.percentile(trips, 99) * 1e6),
    }


def stamped_trips(plan) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """SPLIT_TRIPS one-iteration round trips of a stamped kernel, the host writing its clock into
    Control.host_ns while it waits: host stamps (trip, (before start, after start, saw done, wait
    returned)), the blocks' stamps, the tasks' stamps, and the host's clock loop period in ns."""
    host = np.zeros((SPLIT_TRIPS, 4), np.int64)
    clock = time.perf_counter_ns
    with LoopKernel(plan, profile_iterations=SPLIT_TRIPS) as k:
        control = k.control
        n = 0
        t0 = clock()
        while n < 10_000:  # the loop below, timed: how stale the clock word is when a read is served
            control[HOST_NS] = clock()
            n += 1
        period = (clock() - t0) / n
        for i in range(SPLIT_TRIPS):
            control[HOST_NS] = host[i, 0] = clock()
            k.start(1)
            host[i, 1] = clock()
            while True:
                control[HOST_NS] = clock()
                if k.finished():
                    break
            host[i, 2] = clock()
            k.wait()  # (returns at once; its error check)
            host[i, 3] = clock()
        blocks = k.grant_ns().astype(np.int64)  # (trip, block, STAMP_FIELDS)
        tasks = k.profile_ns().astype(np.int64)  # (trip, task, (start, end))
    return host, blocks, tasks, period


def round_trip_parts(plan) -> dict[str, float]:
    """The stamped round trips of ``plan`` split into their parts (parts_of)."""
    host, blocks, tasks, period = stamped_trips(plan)
    return parts_of(host[WARM:], blocks[WARM:], tasks[WARM:], period)


def parts_of(host: np.ndarray, blocks: np.ndarray, tasks: np.ndarray, period: float) -> dict[str, float]:
    """Medians over the trips, in us. The clocks: block 0's doorbell read returns the
    host's clock word as it was when the read was served, taken to be the read's midpoint on the
    GPU's clock (offset theta = midpoint - host word - half the host loop's period; its median over
    the trips). The parts add up to the host's total exactly; theta moves time between the parts on
    either side of a PCIe crossing, by its error (reported as the spread of the per-trip offsets)."""
    b0 = blocks[:, 0]
    theta_trip = (b0[:, F["issued"]] + b0[:, F["seen"]]) // 2 - b0[:, F["host"]] - int(period / 2)
    theta = int(np.median(theta_trip))
    starts, ends = tasks[:, :, 0], tasks[:, :, 1]
    first_start = np.where(starts > 0, starts, np.iinfo(np.int64).max).min(1)
    last_end = ends.max(1)
    seen_last = blocks[:, :, F["seen"]].max(1)
    done_last = blocks[:, :, F["done"]].max(1)
    reported_last = blocks[:, :, F["reported"]].max(1)
    parts = {
        "host_start_call (start() after the clock, the doorbell write inside)": host[:, 1] - host[:, 0],
        "doorbell_written_to_block0_sees_it": (b0[:, F["seen"]] - theta) - host[:, 1],
        "block0_publishes_grant": b0[:, F["published"]] - b0[:, F["seen"]],
        "grant_published_to_first_task_start": first_start - b0[:, F["published"]],
        "tasks_first_start_to_last_end": last_end - first_start,
        "last_task_end_to_last_block_done": done_last - last_end,
        "last_block_done_to_report_issued": reported_last - done_last,
        "report_issued_to_host_sees_it": host[:, 2] - (reported_last - theta),
        "host_wait_returns": host[:, 3] - host[:, 2],
    }
    out = {name: float(np.median(v) / 1e3) for name, v in parts.items()}
    out["sum_of_medians"] = sum(out.values())
    out["host_total"] = float(np.median(host[:, 3] - host[:, 0]) / 1e3)
    out["detail: block0_doorbell_read_trip"] = float(np.median(b0[:, F["seen"]] - b0[:, F["issued"]]) / 1e3)
    out["detail: grant_published_to_last_block_seen"] = float(np.median(seen_last - b0[:, F["published"]]) / 1e3)
    out["detail: host_clock_loop_period"] = period / 1e3
    q25, q75 = np.percentile(theta_trip, [25, 75])
    out["detail: clock_offset_spread_iqr"] = float((q75 - q25) / 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS)}")
    ap.add_argument("--rounds", type=int, default=2, help="rounds over the variants, alternating")
    ap.add_argument("--processors", default="1,132")
    ap.add_argument("--no-parts", action="store_true", help="skip the stamped round trips")
    args = ap.parse_args()
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; the variants are {list(VARIANTS)}")
    results: dict = {"variants": {n: VARIANTS[n] for n in names}}
    for processors in (int(p) for p in args.processors.split(",")):
        entry: dict = {"tasks": len(make_plan(tiny_graph(), processors=processors).ranks[0].tasks)}
        for r in range(args.rounds):
            for name in names:
                plan = make_plan(tiny_graph(), processors=processors, options=KernelOptions(**VARIANTS[name]))
                entry.setdefault(name, []).append(timings(plan))
                print(processors, f"round {r}", name, entry[name][-1], flush=True)
        if not args.no_parts:
            entry["parts"] = {}
            for name in ("baseline", "all"):
                opts = KernelOptions(round_trip_stamps=1, **VARIANTS[name])
                entry["parts"][name] = round_trip_parts(make_plan(tiny_graph(), processors=processors, options=opts))
                print(processors, "parts", name, entry["parts"][name], flush=True)
        results[f"processors_{processors}"] = entry
    write("loop_overhead", results)


if __name__ == "__main__":
    main()

"""The loop kernel's %globaltimer stamps in its profile buffer (``profile_iterations`` of them): each
task's (start, end) for the timelines (megaloop/runtime/trace.py), then, with
KernelOptions.round_trip_stamps, STAMP_FIELDS per (iteration, block): the host's round trip split
into its parts (bench/loop_overhead.py; megaloop/loop.cuh ``Stamp`` has the same order)."""

from __future__ import annotations

from megaloop.plan.model import KernelOptions

STAMP_FIELDS = (
    "seen",  # the block knew it may run the iteration (block 0: its doorbell read returned)
    "issued",  # block 0: that read was issued
    "host",  # block 0: the host's clock word (Control.host_ns) read by that same load, host ns
    "published",  # block 0: the grant republished in device memory for the other blocks
    "done",  # the block's last task of the iteration ended
    "reported",  # the block's completion or progress store was issued
    "spare6",
    "spare7",
)
STAMP_WORDS = len(STAMP_FIELDS)


def profile_bytes(options: KernelOptions, tasks: int, processors: int, iterations: int) -> int:
    """The profile buffer: two u64 a task, then (with round-trip stamps) STAMP_WORDS a block, per iteration."""
    per_block = STAMP_WORDS if options.round_trip_stamps else 0
    return 8 * (2 * tasks + per_block * processors) * iterations

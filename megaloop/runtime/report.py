"""What the loop kernel's error report (the control page's error word and info) means, in words:
a watchdog timeout names the task, the counter or the pushed tile and the peer rank; a data error
names the op and the value."""

from __future__ import annotations

from megaloop.codegen.abi import DATA, WATCHDOG
from megaloop.errors import DataError, MegaloopError
from megaloop.plan.model import Plan


class LoopKernelError(MegaloopError, RuntimeError):
    """The loop kernel gave up (watchdog) or could not be run."""


def kernel_error(
    plan: Plan, rank: int, timeout_s: float, code: int, info: list[int], devices: list[int] | None = None
) -> MegaloopError:
    """The exception for error ``code`` with ``info`` (megaloop/loop.cuh ``fail``) of rank ``rank``;
    ``devices``: each rank's GPU, where known (a peer on this GPU is named as such)."""
    rp = plan.ranks[rank]
    if code == WATCHDOG:
        proc, task, op, counter, expected, seen, k, peer = info
        same_gpu = devices is not None and 0 <= peer < len(devices) and devices[peer] == devices[rank]
        running = "its loop kernel shares this GPU: is it running?" if same_gpu else "a peer GPU: is it running?"
        waiting = rp.task_name(rp.tasks[task]) if 0 <= task < len(rp.tasks) else f"task {task}"
        if counter == -3:  # a weight-ring slot's copy (megaloop/ring.cuh)
            return LoopKernelError(
                f"watchdog: rank {rank} processor {proc} waited more than {timeout_s:g} s in iteration {k} in "
                f"{waiting} for the weight ring's slot {seen} (phase {expected}): its bulk copy of parameter "
                "rows never landed. The kernel has stopped; make a new LoopKernel to run again"
            )
        if counter < 0:  # inside a pushing all_reduce's tile: a member's data (megaloop/exchange.cuh)
            what = "LL line flag" if counter == -1 else "arrival count"
            return LoopKernelError(
                f"watchdog: rank {rank} processor {proc} waited more than {timeout_s:g} s in iteration "
                f"{k} in {waiting}: the tile rank {peer} pushes to it never arrived ({running}); "
                f"its {what} stayed at {seen}, expected {expected}. The kernel has stopped; make a new LoopKernel "
                "to run again"
            )
        owner = plan.ranks[peer] if 0 <= peer < len(plan.ranks) else rp
        signaler = owner.counters[counter].name if 0 <= counter < len(owner.counters) else f"counter {counter}"
        where = f" of rank {peer} ({running})" if peer != rank else ""
        return LoopKernelError(
            f"watchdog: rank {rank} processor {proc} waited more than {timeout_s:g} s in iteration {k} "
            f"before {waiting}: counter {counter}{where} ({signaler}) stayed at {seen}, expected {expected}. "
            "The kernel has stopped; make a new LoopKernel to run again"
        )
    if code == DATA:
        proc, task, op, value, limit, kind, _, _ = info
        kinds = {0: "id", 1: "cache position", 2: "kv length", 4: "page (a page table entry)", 5: "slot"}
        what = kinds.get(kind, "index")
        name = rp.ops[op].name if 0 <= op < len(rp.ops) else f"op {op}"
        if kind == 3:  # megaloop.codegen.emit_sample.DATA_KIND: value is the row
            return DataError(
                f"sample {name}: row {value} (counted in the rows' row-major order) has a temperature, top_k, "
                "top_p or min_p out of range: temperature must be finite and >= 0, top_k >= 0, top_p in (0, 1], "
                f"min_p in [0, 1] (found by task {task} on processor {proc}); the kernel has stopped"
            )
        if kind == 6:  # megaloop/gather.cuh STEP_COUNTER_KIND: value is the counter, limit the batches
            return DataError(
                f"step_batch {name}: the step counter is {value}; it counts the steps done and must be >= 0 (the "
                f"data holds {limit} batches; found by task {task} on processor {proc}); the kernel has stopped"
            )
        if kind == 4:  # megaloop.codegen.emit_sample.PENALTY_KIND: value is the row, limit the token
            return DataError(
                f"penalize {name}: row {value} (counted in the rows' row-major order), token {limit} has a count "
                "below 0, a repetition penalty not > 0 or not finite, or a presence or frequency penalty not finite "
                f"(found by task {task} on processor {proc}); the kernel has stopped"
            )
        return DataError(
            f"{rp.ops[op].op if 0 <= op < len(rp.ops) else 'op'} {name}: {what} {value} is "
            f"outside [0, {limit}) (found by task {task} on processor {proc}); the kernel has stopped"
        )
    return LoopKernelError(f"the loop kernel reported error code {code}")

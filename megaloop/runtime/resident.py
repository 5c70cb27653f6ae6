"""Which loop kernels this process holds resident on which GPU, and the rules that keep a GPU from
hanging under them (measured on an H200, driver 580: docs/runtime.md "Loop kernels sharing a GPU"):

- ``cuModuleLoadData`` blocks while a loop kernel is resident in the context, so a LoopKernel made
  while another runs on its GPU would hang in its constructor: ``refuse_if_occupied`` says so at once,
  naming the kernel that holds the GPU. Kernels share a GPU only as ranks of one LoopKernelGroup,
  which loads every module before it launches any.
- Loop kernels on one GPU must be resident together (a block that never starts stalls the others):
  ``co_residency`` checks the arithmetic before anything is launched.
- ``cuMemFree`` blocks while a loop kernel is resident: ``free_when_idle`` defers a kernel's frees
  until no kernel of its GPU or of its group is still running.
- At process exit (atexit) and when a LoopKernel is garbage collected, kernels left running are
  stopped (a context torn down under a resident kernel could hang the exit).

The registry knows this process only: another process's kernel on the same GPU is time-sliced with
ours by the driver, not refused here.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from megaloop.runtime.report import LoopKernelError


class ResidencyError(LoopKernelError):
    """A loop kernel cannot become resident: its GPU is held, or its blocks do not all fit."""


@dataclass(frozen=True)
class Resident:
    """A loop kernel resident on a GPU (or stuck there: it did not leave when asked)."""

    device: int
    processors: int
    what: str  # e.g. "graph 'mlp' (rank 1 of 2)"
    group: int | None  # kernels launched together (a LoopKernelGroup), else None
    since: float  # time.monotonic() at launch
    stuck: bool = False

    def describe(self) -> str:
        age = time.monotonic() - self.since
        state = ", STUCK: it did not stop when asked (restart the process)" if self.stuck else ""
        return f"{self.what}, {self.processors} processors, resident for {age:.1f} s{state}"


@dataclass(frozen=True)
class Launch:
    """A loop kernel about to be launched: its thread blocks and how many of them fit an SM alone
    (cuOccupancyMaxActiveBlocksPerMultiprocessor: registers, shared memory, threads)."""

    processors: int
    blocks_per_sm: int
    what: str


_lock = threading.RLock()
_entries: dict[int, tuple[Any, Resident]] = {}  # id(kernel) -> (weak reference, entry)
_deferred: list[tuple[int, int | None, Callable[[], None]]] = []  # (device, group, free) waiting


def resident(device: int | None = None) -> list[Resident]:
    """The loop kernels this process holds resident (on ``device``, or on every GPU)."""
    with _lock:
        return [e for _, e in _entries.values() if device is None or e.device == device]


def refuse_if_occupied(device: int, what: str) -> None:
    """Raise at once when a loop kernel of this process holds GPU ``device``: loading ``what``'s
    module there would block in the driver until that kernel stops."""
    held = resident(device)
    if not held:
        return
    names = "; ".join(e.describe() for e in held)
    raise ResidencyError(
        f"{what} cannot be loaded on GPU {device}: a loop kernel of this process is resident there ({names}). "
        "Loading a module while a loop kernel is resident blocks in the CUDA driver until it stops. Stop it "
        "first (k.stop(), or leave its with block), or run the kernels together as ranks of one "
        "LoopKernelGroup(plan, devices=[...]), which loads every module before launching any"
    )


def co_residency(sm_count: int, launches: Sequence[Launch]) -> str | None:
    """Why ``launches`` (with the kernels already resident) cannot all be resident on a GPU of
    ``sm_count`` SMs at once; None when they can. One kernel alone: the driver's occupancy, its
    blocks per SM x SMs. Several: an SM for every block, the only placement the hardware guarantees
    (blocks of different kernels share an SM only when its shared-memory carveout suits both)."""
    if not launches:
        return None
    for k in launches:
        if k.blocks_per_sm < 1:
            return f"no thread block of {k.what} fits on an SM (its registers or shared memory exceed one)"
    if len(launches) == 1:
        (k,) = launches
        fit = k.blocks_per_sm * sm_count
        if k.processors <= fit:
            return None
        return (
            f"{k.what} has {k.processors} processors (thread blocks), but at most {fit} are resident at once "
            f"({sm_count} SMs x {k.blocks_per_sm} blocks per SM)"
        )
    total = sum(k.processors for k in launches)
    if total <= sm_count:
        return None
    each = " + ".join(f"{k.processors} ({k.what})" for k in launches)
    return (
        f"{len(launches)} loop kernels need {each} = {total} thread blocks, and loop kernels sharing a GPU "
        f"need an SM for each block: {sm_count} SMs"
    )


def check_co_resident(device: int, gpu_name: str, sm_count: int, launches: Sequence[Launch]) -> None:
    """Raise before launching when ``launches`` and the kernels resident on ``device`` cannot all be
    resident at once, naming the numbers and the processors that would fit."""
    held = [Launch(e.processors, 1, e.what + " (resident)") for e in resident(device)]
    why = co_residency(sm_count, held + list(launches))
    if why is None:
        return
    sharing = len(held) + len(launches)
    fit = (sm_count - sum(k.processors for k in held)) // max(len(launches), 1) if sharing > 1 else None
    advice = (
        f"; make the plan with processors <= {max(fit, 0)} ({sm_count} SMs shared by {sharing} loop kernels)"
        if fit is not None
        else f"; make the plan with processors <= {launches[0].blocks_per_sm * sm_count}"
    )
    raise ResidencyError(f"GPU {device} ({gpu_name}): {why}{advice}")


def register(kernel: object, entry: Resident) -> None:
    """``kernel`` was launched (it is resident until ``unregister``)."""
    with _lock:
        _entries[id(kernel)] = (weakref.ref(kernel), entry)


def unregister(kernel: object) -> None:
    """``kernel`` has left its GPU; frees that waited for it (``free_when_idle``) run now."""
    with _lock:
        _entries.pop(id(kernel), None)
        ready = [d for d in _deferred if not _busy(d[0], d[1])]
        for d in ready:
            _deferred.remove(d)
    for _, _, free in ready:
        free()


def mark_stuck(kernel: object) -> None:
    """``kernel`` did not leave when asked: it stays resident (and its GPU refused) for good."""
    with _lock:
        if id(kernel) in _entries:
            ref, entry = _entries[id(kernel)]
            _entries[id(kernel)] = (ref, replace(entry, stuck=True))


def free_when_idle(device: int, group: int | None, free: Callable[[], None]) -> bool:
    """Run ``free`` now if no loop kernel is resident on ``device`` nor in ``group``, else once the
    last of them has left (freeing meanwhile would block in the driver, or take memory a peer still
    reads). True when it ran now."""
    with _lock:
        if _busy(device, group):
            _deferred.append((device, group, free))
            return False
    free()
    return True


def _busy(device: int, group: int | None) -> bool:
    return any(e.device == device or (group is not None and e.group == group) for _, e in _entries.values())


def stop_everything() -> None:
    """Make every kernel this process left running leave (all of them first, then their memory goes):
    registered to run at process exit."""
    with _lock:
        kernels = [ref() for ref, e in _entries.values() if not e.stuck]
    for k in kernels:
        if k is None:
            continue
        try:
            k._halt()
        except Exception:  # exiting: a kernel that cannot be stopped is reported by nothing else
            pass
    for k in kernels:
        if k is not None and not getattr(k, "_stuck", True):
            try:
                k._free()
            except Exception:
                pass


atexit.register(stop_everything)

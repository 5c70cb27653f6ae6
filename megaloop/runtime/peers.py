"""Peer memory under torchrun: where each rank's arena and counters come from, so that every other
rank's loop kernel can read and signal them (megaloop/runtime/distributed.py). In one process the
same comes from peer access between contexts (megaloop/runtime/group.py) and nothing here is used.

Two providers, one interface (``PeerMemory``):

- ``symmetric``: torch symmetric memory (``torch.distributed._symmetric_memory``, its CUDA backend).
  ``empty`` allocates; ``rendezvous`` over the default process group maps every rank's allocation
  into every process and its ``buffer_ptrs`` are the addresses. The handles travel through the
  default group's store (any backend, gloo too) and a Unix socket, never through megaloop's gloo
  group, and every rank makes the same calls in the same order, so neither can wait on the other.
  torch marks the module private and alpha, hence the fallback.
- ``ipc``: ``cuMemAlloc`` and legacy CUDA IPC handles, exchanged through megaloop's gloo group and
  opened with lazy peer access. Needs nothing beyond the driver.

Both hand out device addresses valid in the device's primary context: torch's runtime always works
in the primary context, VMM mappings (symmetric memory) belong to the whole process with access
granted to the device, and ``LoopKernel`` retains and uses that same primary context.

``open_peer_memory`` decides, identically on every rank: the ranks first compare what they asked for
and whether symmetric memory could be allocated, then whether its rendezvous worked, and use it only
if every rank succeeded; otherwise ``auto`` falls back to ``ipc`` on all of them together, and an
explicit ``symmetric`` raises, naming the ranks and what failed.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

from megaloop.plan.model import Plan
from megaloop.runtime.loop import LoopKernelError, _check, memory_sizes

CHOICES = ("auto", "symmetric", "ipc")
ENV = "MEGALOOP_PEER_MEMORY"
IPC_HANDLE_BYTES = 64

AllGather = Callable[[Any], list]


class PeerMemory(Protocol):
    """This rank's arena and counters (``arena``, ``counters``: device addresses, set by ``allocate``)."""

    name: str
    arena: int
    counters: int

    def allocate(self) -> None:
        """Allocate this rank's memory; local (no other rank takes part)."""

    def exchange(self, all_gather: AllGather) -> tuple[list[int], list[int]]:
        """Every rank's arena and counters, as addresses valid in this process (collective). A call of
        ``all_gather`` must be made on every rank or on none, whatever fails locally."""

    def close(self) -> None:
        """Unmap the peers' memory (this rank's kernel has stopped)."""

    def free(self) -> None:
        """Free this rank's memory (every rank has stopped); also after a failed allocate or exchange."""


def requested_peer_memory(peer_memory: str | None) -> str:
    """The argument, else $MEGALOOP_PEER_MEMORY, else "auto"; refused unless one of CHOICES."""
    asked = peer_memory if peer_memory is not None else os.environ.get(ENV) or "auto"
    if asked not in CHOICES:
        where = "peer_memory" if peer_memory is not None else f"${ENV}"
        raise LoopKernelError(f"{where} must be one of {list(CHOICES)}, got {asked!r}")
    return asked


def open_peer_memory(
    requested: str, rank: int, all_gather: AllGather, providers: Mapping[str, Callable[[], PeerMemory]]
) -> tuple[PeerMemory, list[int], list[int], str]:
    """The provider every rank agreed on, every rank's (arenas, counters), and why symmetric memory
    was not used ("" when it was, or when ipc was asked for). ``all_gather`` goes through megaloop's
    gloo group; every rank makes the same calls in the same order whatever happens locally."""
    symmetric = providers["symmetric"]() if requested != "ipc" else None
    err = _attempt(symmetric.allocate) if symmetric is not None else None
    asked = all_gather((requested, err))
    if len({a for a, _ in asked}) > 1:
        if symmetric is not None:
            symmetric.free()
        each = ", ".join(f"rank {r}: {a}" for r, (a, _) in enumerate(asked))
        raise LoopKernelError(
            f"rank {rank}: the ranks asked for different peer memory ({each}); every rank must pass the same "
            f"peer_memory= (or ${ENV})"
        )
    note = ""
    if symmetric is not None:
        failed = {r: e for r, (_, e) in enumerate(asked) if e}
        if not failed:  # every rank allocated: map each other's memory
            got: list[list[int]] = []
            failed = _failures(all_gather(_attempt(lambda: got.extend(symmetric.exchange(all_gather)))))
            if not failed:
                return symmetric, got[0], got[1], ""
        symmetric.free()
        why = "; ".join(f"rank {r}: {e}" for r, e in sorted(failed.items()))
        if requested == "symmetric":
            raise LoopKernelError(
                f"rank {rank}: peer_memory='symmetric' failed: torch symmetric memory did not work on every rank "
                f"({why}); use peer_memory='ipc' (legacy CUDA IPC handles) or 'auto'"
            )
        note = f"torch symmetric memory failed ({why}); using CUDA IPC handles"
    ipc = providers["ipc"]()
    try:
        failed = _failures(all_gather(_attempt(ipc.allocate)))
        if failed:
            why = "; ".join(f"rank {r}: {e}" for r, e in sorted(failed.items()))
            raise LoopKernelError(f"rank {rank}: allocating the arena and counters failed ({why})")
        arenas, counters = ipc.exchange(all_gather)
    except BaseException:
        ipc.free()
        raise
    return ipc, arenas, counters, note


def _failures(errors: list) -> dict[int, str]:
    return {r: e for r, e in enumerate(errors) if e}


def _attempt(step: Callable[[], None]) -> str | None:
    """None when ``step`` worked, else what went wrong in a line (torch's messages can be pages)."""
    try:
        step()
    except Exception as e:
        lines = str(e).strip().splitlines()
        return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]
    return None


class SymmetricPeers:
    """torch symmetric memory. Every rank allocates the same sizes (the rendezvous insists): the
    largest arena and counters of any rank of the plan."""

    name = "symmetric"

    def __init__(self, plan: Plan, rank: int, device: int, group: str) -> None:
        """``group``: the name of the process group to rendezvous over, of exactly the plan's ranks."""
        sizes = [memory_sizes(plan, r) for r in range(len(plan.ranks))]
        self.sizes = (max(a for a, _ in sizes), max(c for _, c in sizes))
        self.rank, self.world, self.device, self.group = rank, plan.world_size, device, group
        self.arena = self.counters = 0
        self._tensors: list[Any] = []  # torch owns the memory: alive as long as these are
        self._handles: list[Any] = []

    def allocate(self) -> None:
        import torch

        symm_mem = _symmetric_memory_module()
        if not torch.cuda.is_available():
            raise RuntimeError(f"torch {torch.__version__} sees no CUDA device")
        with _no_multicast(), torch.cuda.device(self.device):  # empty() picks its pool by the current device
            self._tensors = [symm_mem.empty(n, dtype=torch.uint8, device=f"cuda:{self.device}") for n in self.sizes]
        self.arena, self.counters = (int(t.data_ptr()) for t in self._tensors)

    def exchange(self, all_gather: AllGather) -> tuple[list[int], list[int]]:
        import torch

        symm_mem = _symmetric_memory_module()
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None and not hasattr(enable, "__deprecated__"):
            enable(self.group)  # torch < 2.11 finds the group's store only this way; 2.11 deprecated it
        with _no_multicast(), torch.cuda.device(self.device):
            self._handles = [symm_mem.rendezvous(t, self.group) for t in self._tensors]
        out = []
        for what, t, h in zip(("arena", "counters"), self._tensors, self._handles):
            ptrs = [int(p) for p in h.buffer_ptrs]
            if len(ptrs) != self.world or ptrs[self.rank] != int(t.data_ptr()) or not all(ptrs):
                raise RuntimeError(
                    f"the {what}'s rendezvous gave addresses {[hex(p) for p in ptrs]} for {self.world} ranks; "
                    f"expected this rank's at {hex(int(t.data_ptr()))} and every peer's mapped"
                )
            out.append(ptrs)
        return out[0], out[1]

    def close(self) -> None:
        """Nothing to do: torch unmaps the peers' memory when ours is freed."""

    def free(self) -> None:
        self._handles.clear()
        self._tensors.clear()  # back to torch (its symmetric memory pool, or the driver)
        self.arena = self.counters = 0


def _symmetric_memory_module():
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as e:
        raise RuntimeError(f"this torch has no symmetric memory ({e})") from None
    missing = [f for f in ("empty", "rendezvous") if not hasattr(symm_mem, f)]
    if missing:
        raise RuntimeError(f"this torch's symmetric memory lacks {missing}")
    return symm_mem


@contextlib.contextmanager
def _no_multicast() -> Iterator[None]:
    """The loop kernels use plain peer pointers, never an NVLink multicast object: keep torch from
    making one during the rendezvous (another collective, refused by some GPUs), unless the user
    chose otherwise by setting the variable."""
    key = "TORCH_SYMM_MEM_DISABLE_MULTICAST"
    if key in os.environ:
        yield
        return
    os.environ[key] = "1"
    try:
        yield
    finally:
        os.environ.pop(key, None)


class IpcPeers:
    """cuMemAlloc'd arena and counters, shared with legacy CUDA IPC handles."""

    name = "ipc"

    def __init__(self, plan: Plan, rank: int, device: int) -> None:
        self.sizes = memory_sizes(plan, rank)
        self.rank, self.device = rank, device
        self.arena = self.counters = 0
        self._ctx = None
        self._opened: list[int] = []

    def _use(self) -> None:
        """The device's primary context (the one LoopKernel uses), retained until ``free``."""
        from cuda.bindings import driver as d

        if self._ctx is None:
            _check(d.cuInit(0))
            self._ctx = _check(d.cuDevicePrimaryCtxRetain(_check(d.cuDeviceGet(self.device))))
        _check(d.cuCtxSetCurrent(self._ctx))

    def allocate(self) -> None:
        from cuda.bindings import driver as d

        self._use()
        self.arena = int(_check(d.cuMemAlloc(self.sizes[0])))
        self.counters = int(_check(d.cuMemAlloc(self.sizes[1])))

    def exchange(self, all_gather: AllGather) -> tuple[list[int], list[int]]:
        from cuda.bindings import driver as d

        self._use()
        mine: list[bytes] = []
        err = _attempt(lambda: mine.extend(_ipc_handle(d, p) for p in (self.arena, self.counters)))
        gathered = all_gather((err, mine))  # sent even after a failure: no rank waits for one that gave up
        failed = _failures([e for e, _ in gathered])
        if failed:
            why = "; ".join(f"rank {r}: {e}" for r, e in sorted(failed.items()))
            raise LoopKernelError(f"rank {self.rank}: exporting CUDA IPC handles failed ({why})")
        handles = [h for _, h in gathered]
        arenas, counters = [], []
        flag = d.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
        for r, (arena_h, counters_h) in enumerate(handles):
            if r == self.rank:
                arenas.append(self.arena)
                counters.append(self.counters)
                continue
            for handle, into in ((arena_h, arenas), (counters_h, counters)):
                ptr = int(_check(d.cuIpcOpenMemHandle(_ipc_from_bytes(d, handle), flag)))
                self._opened.append(ptr)
                into.append(ptr)
        return arenas, counters

    def close(self) -> None:
        from cuda.bindings import driver as d

        if self._opened:
            self._use()
            for ptr in self._opened:
                d.cuIpcCloseMemHandle(ptr)
            self._opened.clear()

    def free(self) -> None:
        from cuda.bindings import driver as d

        if self._ctx is None:
            return
        self.close()
        self._use()
        for ptr in (self.arena, self.counters):
            if ptr:
                d.cuMemFree(ptr)
        self.arena = self.counters = 0
        d.cuDevicePrimaryCtxRelease(_check(d.cuDeviceGet(self.device)))
        self._ctx = None


def _ipc_handle(d, ptr: int) -> bytes:
    handle = _check(d.cuIpcGetMemHandle(ptr))
    return ctypes.string_at(handle.getPtr(), IPC_HANDLE_BYTES)


def _ipc_from_bytes(d, raw: bytes):
    handle = d.CUipcMemHandle()
    ctypes.memmove(handle.getPtr(), raw, IPC_HANDLE_BYTES)
    return handle

"""This process's rank of a multi-rank plan, one process per GPU under ``torchrun`` (the PyTorch
convention, and the way to more than one node later: docs/multinode.md).

    torch.distributed.init_process_group("gloo")             # any backend: megaloop only exchanges
    k = DistributedLoopKernel(plan, params=my_weights)       #   small setup messages through it
    out = k.run({"x": x})                                    # every rank calls run alike

Setup, before any kernel starts: every rank checks that all ranks planned the same program (a hash
of the plan; a mismatch names the ranks that differ), that all ranks share this machine, and that
its GPU can reach every peer's GPU (naming the pair that cannot). Peer memory is shared with CUDA IPC
handles of each rank's arena and counters (torch symmetric memory, the intended provider, is not
used yet: it is marked alpha, and IPC needs nothing beyond the driver). After that each rank's loop
kernel reads its peers' memory directly, exactly as in one process (megaloop/runtime/group.py). A
peer that dies or hangs leaves this rank's kernel waiting on counters nobody bumps: its watchdog
fires and the error names the peer rank, the op and the tile.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import socket
from collections.abc import Mapping
from typing import Any

import numpy as np

from megaloop.plan.model import Plan
from megaloop.runtime.loop import LoopKernel, LoopKernelError, _check

IPC_HANDLE_BYTES = 64


def plan_digest(plan: Plan) -> str:
    """A hash of everything the ranks must agree on: the whole plan as saved."""
    from megaloop.plan.format import plan_to_dict

    return hashlib.sha256(json.dumps(plan_to_dict(plan), sort_keys=True).encode()).hexdigest()


def check_same_program(plan: Plan, rank: int, world: int, all_gather) -> None:
    """Refuse to start unless every rank planned the same program; ``all_gather(obj) -> list``."""
    if plan.world_size != world:
        raise LoopKernelError(f"rank {rank}: the plan has {plan.world_size} ranks; the job has {world} processes")
    digests = all_gather(plan_digest(plan))
    differ = [r for r, d in enumerate(digests) if d != digests[0]]
    if differ:
        raise LoopKernelError(
            f"rank {rank}: ranks {differ} planned a different program than rank 0 (plan hashes differ); every "
            "rank must build the same graphs with the same settings (make_plan(...) with equal arguments)"
        )


class DistributedLoopKernel:
    def __init__(
        self,
        plan: Plan,
        params: Mapping[str, Any] | None = None,
        state: Mapping[str, Any] | None = None,
        *,
        device: int | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise LoopKernelError("torch.distributed is not initialised: call init_process_group first (torchrun)")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

        def all_gather(obj: Any) -> list:
            out: list = [None] * self.world
            dist.all_gather_object(out, obj)
            return out

        self._all_gather, self._dist = all_gather, dist
        check_same_program(plan, self.rank, self.world, all_gather)
        device = int(os.environ.get("LOCAL_RANK", self.rank)) if device is None else device
        self.timeout_s = timeout_s
        hosts = all_gather(socket.gethostname())
        if len(set(hosts)) > 1:
            raise LoopKernelError(
                f"rank {self.rank}: the ranks run on {len(set(hosts))} machines ({sorted(set(hosts))}); megaloop's "
                "loop kernels exchange data over NVLink within one machine (multi-node: docs/multinode.md)"
            )
        self.kernel = LoopKernel(
            plan, params, state, device=device, timeout_s=timeout_s, rank=self.rank, _in_group=True
        )
        self._opened: list[int] = []
        try:
            self._connect(all_gather(device))
        except BaseException:
            self._close()
            raise
        self._barrier()  # every rank mapped its peers before any kernel runs

    def _connect(self, devices: list[int]) -> None:
        from cuda.bindings import driver as d

        k = self.kernel
        shared = [r for r, dev in enumerate(devices) if dev == k.device]
        if len(shared) > 1:
            raise LoopKernelError(
                f"ranks {shared} would share GPU {k.device}: each loop kernel holds its whole GPU, so two on one "
                "GPU wait for each other forever; give each rank its own GPU (LOCAL_RANK or device=)"
            )
        k._use()
        me = _check(d.cuDeviceGet(k.device))
        for r, dev in enumerate(devices):
            if (
                r != self.rank
                and dev != k.device
                and not _check(d.cuDeviceCanAccessPeer(me, _check(d.cuDeviceGet(dev))))
            ):
                raise LoopKernelError(
                    f"rank {self.rank}: GPU {k.device} cannot access GPU {dev} (rank {r}) directly (no peer path); "
                    "the loop kernels need every pair of GPUs to reach each other"
                )
        handles = self._all_gather((_ipc_handle(d, k.arena), _ipc_handle(d, k.counters)))
        arenas, counters = [], []
        for r, (arena_h, counters_h) in enumerate(handles):
            if r == self.rank:
                arenas.append(k.arena)
                counters.append(k.counters)
                continue
            flag = d.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
            for handle, into in ((arena_h, arenas), (counters_h, counters)):
                ptr = int(_check(d.cuIpcOpenMemHandle(_ipc_from_bytes(d, handle), flag)))
                self._opened.append(ptr)
                into.append(ptr)
        k._connect(arenas, counters)
        k._launch()

    def run(self, inputs: Mapping[str, Any] | None = None, iterations: int = 1) -> dict[str, np.ndarray]:
        """This rank's inputs and outputs; every rank must ask for the same iterations."""
        return self.kernel.run(inputs, iterations)

    def state(self) -> dict[str, np.ndarray]:
        return self.kernel.state()

    def tensor(self, name: str):
        return self.kernel.tensor(name)

    def stop(self) -> None:
        """Stop this rank's kernel; free memory only once every rank stopped reading it."""
        k = self.kernel
        left = k._halt() if k._launched else True
        if not left:
            raise LoopKernelError(
                f"rank {self.rank}: the loop kernel did not stop (a task is stuck: a megaloop bug); its memory stays "
                "allocated and this process must be restarted"
            )
        try:
            self._barrier()  # peers' kernels have left too: nobody reads our arena any more
        except Exception as e:
            raise LoopKernelError(
                f"rank {self.rank}: stopped, but the other ranks did not confirm they stopped ({e}); this rank's "
                "memory stays allocated (a peer may still read it)"
            ) from None
        self._close()

    def _barrier(self) -> None:
        """A barrier that gives up (gloo's monitored barrier names the missing ranks)."""
        import datetime

        if self._dist.get_backend() == "gloo":
            self._dist.monitored_barrier(timeout=datetime.timedelta(seconds=self.timeout_s + 30))
        else:
            self._dist.barrier()

    def _close(self) -> None:
        from cuda.bindings import driver as d

        if self._opened:
            self.kernel._use()
            for ptr in self._opened:
                d.cuIpcCloseMemHandle(ptr)
            self._opened.clear()
        self.kernel._free()

    def __enter__(self) -> DistributedLoopKernel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _ipc_handle(d, ptr: int) -> bytes:
    handle = _check(d.cuIpcGetMemHandle(ptr))
    return ctypes.string_at(handle.getPtr(), IPC_HANDLE_BYTES)


def _ipc_from_bytes(d, raw: bytes):
    handle = d.CUipcMemHandle()
    ctypes.memmove(handle.getPtr(), raw, IPC_HANDLE_BYTES)
    return handle

"""This process's rank of a multi-rank plan, one process per GPU under ``torchrun`` (the PyTorch
convention, and the way to more than one node later: docs/multinode.md).

    torch.distributed.init_process_group("gloo")             # any backend: megaloop only exchanges
    k = DistributedLoopKernel(plan, params=my_weights)       #   small setup messages through it
    out = k.run({"x": x})                                    # every rank calls run alike

Setup, before any kernel starts: every rank checks that all ranks planned the same program (a hash
of the plan; a mismatch names the ranks that differ), that all ranks share this machine, and that
its GPU can reach every peer's GPU (naming the pair that cannot). Then the ranks allocate their
arenas and counters where every peer can map them (megaloop/runtime/peers.py): torch symmetric
memory by default, legacy CUDA IPC handles when torch lacks it or it fails on any rank (all ranks
fall back together), or whichever ``peer_memory=`` / $MEGALOOP_PEER_MEMORY names; ``k.peer_memory``
says which. After that each rank's loop kernel reads its peers' memory directly, exactly as in one
process (megaloop/runtime/group.py). A peer that dies or hangs leaves this rank's kernel waiting on
counters nobody bumps: its watchdog fires and the error names the peer rank, the op and the tile.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from collections.abc import Mapping
from typing import Any

import numpy as np

from megaloop.codegen.kernel import generate
from megaloop.plan.model import Plan
from megaloop.runtime.device import gpus
from megaloop.runtime.group import native_peer_atomics
from megaloop.runtime.loop import LoopKernel, LoopKernelError, _check
from megaloop.runtime.peers import IpcPeers, SymmetricPeers, open_peer_memory, requested_peer_memory

MAX_PEERS = 8  # peer mappings a GPU can hold (CUDA_ERROR_TOO_MANY_PEERS beyond)


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
        peer_memory: str | None = None,
    ) -> None:
        """``peer_memory``: "auto" (torch symmetric memory, else CUDA IPC), "symmetric" or "ipc"; left
        out, $MEGALOOP_PEER_MEMORY or "auto". Every rank must ask alike. ``self.peer_memory`` says which
        was used and ``self.peer_memory_note`` why symmetric memory was not, under "auto"."""
        import torch.distributed as dist

        if not dist.is_initialized():
            raise LoopKernelError("torch.distributed is not initialised: call init_process_group first (torchrun)")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if self.world > MAX_PEERS + 1:
            raise LoopKernelError(f"{self.world} ranks: a GPU maps at most {MAX_PEERS} peers' memory")
        requested = requested_peer_memory(peer_memory)
        # megaloop's own messages go through a gloo group: with an NCCL default group, a barrier is a GPU
        # kernel, which cannot start while a loop kernel holds every SM
        self._group = dist.new_group(backend="gloo")
        self._dist, self.timeout_s = dist, timeout_s
        check_same_program(plan, self.rank, self.world, self._all_gather)
        device = int(os.environ.get("LOCAL_RANK", self.rank)) if device is None else device
        hosts = self._all_gather(socket.gethostname())
        if len(set(hosts)) > 1:
            raise LoopKernelError(
                f"rank {self.rank}: the ranks run on {len(set(hosts))} machines ({sorted(set(hosts))}); megaloop's "
                "loop kernels exchange data over NVLink within one machine (multi-node: docs/multinode.md)"
            )
        found, reason = gpus()
        if not 0 <= device < len(found):
            raise LoopKernelError(
                f"rank {self.rank}: GPU {device} does not exist ({len(found)} visible{', ' + reason if reason else ''})"
            )
        # every pair of GPUs with native peer atomics, by every rank's account: mirror counters
        mirrors = all(self._all_gather(self._check_gpus(device, self._all_gather(_bus_id(device)))))
        self.peers, arenas, counters, self.peer_memory_note = open_peer_memory(
            requested,
            self.rank,
            self._all_gather,
            {
                # over the default group, all of the job's ranks: its store carries torch's handles
                "symmetric": lambda: SymmetricPeers(plan, self.rank, device, dist.group.WORLD.group_name),
                "ipc": lambda: IpcPeers(plan, self.rank, device),
            },
        )
        self.peer_memory: str = self.peers.name
        try:
            self.kernel = LoopKernel(
                plan,
                params,
                state,
                device=device,
                timeout_s=timeout_s,
                program=generate(plan, self.rank, mirrors=mirrors),
                rank=self.rank,
                _in_group=True,
                _memory=(self.peers.arena, self.peers.counters),
            )
        except BaseException:
            self.peers.free()  # nothing reads it yet: every rank maps its peers before any kernel runs
            raise
        rp = self.kernel.rp
        host_written = [*rp.graph.inputs.values(), *rp.graph.states.values()]
        # a peer may still read inputs or state of ours the host is about to overwrite: runs line up first
        self._line_up = any(rp.buffers[rp.tensors[rp.tensor_of[t]].buffer].peer for t in host_written)
        try:
            self.kernel._connect(arenas, counters)
            self._barrier()  # every rank mapped its peers before any kernel runs
            self.kernel._launch()
        except BaseException:
            self._close()
            raise

    def _all_gather(self, obj: Any) -> list:
        out: list = [None] * self.world
        self._dist.all_gather_object(out, obj, group=self._group)
        return out

    def _check_gpus(self, device: int, bus_ids: list[str]) -> bool:
        """Every rank has a GPU of its own (by PCI bus id: ordinals differ between processes) that can
        reach every peer's GPU directly. True when its atomics on every peer's memory are native."""
        from cuda.bindings import driver as d

        mine = bus_ids[self.rank]
        shared = [r for r, b in enumerate(bus_ids) if b == mine]
        if len(shared) > 1:
            raise LoopKernelError(
                f"ranks {shared} would share GPU {mine}: loop kernels of separate processes are time-sliced by the "
                "driver, not run side by side, so ranks waiting on each other would stall; give each rank its own GPU "
                "(LOCAL_RANK or device=), or run the ranks from one process, sharing the GPU's SMs: "
                "LoopKernelGroup(plan, devices=[...])"
            )
        me = _check(d.cuDeviceGet(device))
        atomics = True
        for r, bus in enumerate(bus_ids):
            if r == self.rank:
                continue
            err, peer = d.cuDeviceGetByPCIBusId(bus.encode())
            if err != d.CUresult.CUDA_SUCCESS:
                raise LoopKernelError(
                    f"rank {self.rank}: rank {r}'s GPU {bus} is not visible to this process (CUDA_VISIBLE_DEVICES?); "
                    "every rank must see every GPU of the job to map its memory"
                )
            if not _check(d.cuDeviceCanAccessPeer(me, peer)):
                raise LoopKernelError(
                    f"rank {self.rank}: GPU {mine} cannot access GPU {bus} (rank {r}) directly (no peer path); "
                    "the loop kernels need every pair of GPUs to reach each other"
                )
            atomics = atomics and native_peer_atomics(d, me, peer)
        return atomics

    def run(self, inputs: Mapping[str, Any] | None = None, iterations: int = 1) -> dict[str, np.ndarray]:
        """This rank's inputs and outputs; every rank must call it alike (the same iterations)."""
        if self._line_up:
            self._barrier()  # every rank finished its last run: nobody still reads what we overwrite
        return self.kernel.run(inputs, iterations)

    def state(self) -> dict[str, np.ndarray]:
        return self.kernel.state()

    def tensor(self, name: str):
        return self.kernel.tensor(name)

    def stop(self) -> None:
        """Stop this rank's kernel, unmap the peers' memory, and free ours once every rank has done the
        same (a peer's kernel or mapping may still refer to it until then)."""
        k = self.kernel
        if k._launched:
            k._halt()
        if k._stuck:
            raise LoopKernelError(
                f"rank {self.rank}: the loop kernel did not stop (a task is stuck: a megaloop bug); its memory stays "
                "allocated and this process must be restarted"
            )
        self.peers.close()
        try:
            self._barrier()
        except Exception as e:
            raise LoopKernelError(
                f"rank {self.rank}: stopped, but the other ranks did not confirm they stopped ({e}); this rank's "
                "memory stays allocated (a peer may still read it)"
            ) from None
        k._free()
        self.peers.free()

    def _barrier(self) -> None:
        """A barrier that gives up and names the missing ranks (gloo's monitored barrier)."""
        import datetime

        self._dist.monitored_barrier(group=self._group, timeout=datetime.timedelta(seconds=self.timeout_s + 30))

    def _close(self) -> None:
        """Setup failed: nothing was launched; unmap and free."""
        self.peers.close()
        self.kernel._free()
        self.peers.free()

    def __enter__(self) -> DistributedLoopKernel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _bus_id(device: int) -> str:
    from cuda.bindings import driver as d

    _check(d.cuInit(0))
    raw = _check(d.cuDeviceGetPCIBusId(32, _check(d.cuDeviceGet(device))))
    return (raw.decode() if isinstance(raw, bytes) else str(raw)).split("\0", 1)[0]

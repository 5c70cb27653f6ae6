"""All ranks of a multi-rank plan on this machine's GPUs, driven by one Python process (no launcher):
one resident loop kernel per GPU, peer access between every pair, and each kernel reading its peers'
arenas and counters directly over NVLink (the exchange tiles of megaloop/codegen/emit_collective.py).

    with LoopKernelGroup(plan, params=[w0, w1]) as group:      # rank r on GPU r
        outs = group.run([{"x": x0}, {"x": x1}])               # one dict of outputs per rank

Setup checks, before anything is launched, that the machine has a GPU per rank and that every pair
of them can reach each other, naming the pair that cannot. A kernel that reports an error (its
watchdog, waiting on a peer that stopped) halts every rank, and the error names the rank and the
peer. Memory is freed only after every kernel has left, since peers read each other's arenas.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from megaloop.codegen import generate
from megaloop.plan.model import Plan
from megaloop.runtime.compile import compile_many
from megaloop.runtime.device import gpus
from megaloop.runtime.loop import ERROR, LoopKernel, LoopKernelError, _check

MAX_PEERS = 8  # cuCtxEnablePeerAccess: CUDA_ERROR_TOO_MANY_PEERS beyond 8


class LoopKernelGroup:
    def __init__(
        self,
        plan: Plan,
        params: Sequence[Mapping[str, Any] | None] | None = None,
        state: Sequence[Mapping[str, Any] | None] | None = None,
        *,
        devices: Sequence[int] | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        from cuda.bindings import driver

        world = plan.world_size
        if world > MAX_PEERS + 1:
            raise LoopKernelError(
                f"the plan has {world} ranks; a GPU can map at most {MAX_PEERS} peers' memory (CUDA's limit), so "
                f"one machine runs at most {MAX_PEERS + 1} ranks of a plan"
            )
        found, reason = gpus()
        devices = list(range(world)) if devices is None else [int(d) for d in devices]
        if len(devices) != world or len(set(devices)) != world:
            raise LoopKernelError(f"the plan has {world} ranks; give one distinct GPU per rank, got devices {devices}")
        if not found or max(devices) >= len(found):
            have = f"{len(found)} GPU(s)" if found else f"no GPU ({reason})"
            raise LoopKernelError(f"the plan has {world} ranks on GPUs {devices}; this machine has {have}")
        self._d = driver
        self.plan, self.devices, self.timeout_s = plan, devices, timeout_s
        mirrors = _check_peers(driver, devices)  # native peer atomics on every pair: mirror counters
        params = list(params) if params is not None else [None] * world
        state = list(state) if state is not None else [None] * world
        if len(params) != world or len(state) != world:
            raise LoopKernelError(
                f"params and state: one mapping per rank ({world}), got {len(params)} and {len(state)}"
            )
        programs = [generate(plan, r, mirrors=mirrors) for r in range(world)]
        for arch in {found[d].arch for d in devices}:  # every rank's kernel at once
            compile_many([p.source for p, d in zip(programs, devices) if found[d].arch == arch], arch)
        self.kernels: list[LoopKernel] = []
        try:
            for r, d in enumerate(devices):
                self.kernels.append(
                    LoopKernel(
                        plan,
                        params[r],
                        state[r],
                        device=d,
                        timeout_s=timeout_s,
                        program=programs[r],
                        rank=r,
                        _in_group=True,
                    )
                )
            for k in self.kernels:  # k's kernel reads every other rank's memory
                k._use()
                for other in self.kernels:
                    if other is not k:
                        (err,) = driver.cuCtxEnablePeerAccess(other._ctx, 0)
                        if err not in (
                            driver.CUresult.CUDA_SUCCESS,
                            driver.CUresult.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED,
                        ):
                            raise LoopKernelError(
                                f"enabling peer access from GPU {k.device} (rank {k.rank}) to GPU {other.device} "
                                f"(rank {other.rank}) failed: {err.name}"
                            )
            arenas = [k.arena for k in self.kernels]
            counters = [k.counters for k in self.kernels]
            for k in self.kernels:
                k._connect(arenas, counters)
            for k in self.kernels:
                k._launch()
        except BaseException:
            self._stop_all()
            raise

    # ---- running ----------------------------------------------------------------------------------
    def run(
        self, inputs: Sequence[Mapping[str, Any] | None] | None = None, iterations: int = 1
    ) -> list[dict[str, np.ndarray]]:
        """Write every rank's inputs, ring every doorbell, wait for all; the outputs of each rank."""
        inputs = list(inputs) if inputs is not None else [None] * len(self.kernels)
        if len(inputs) != len(self.kernels):
            raise LoopKernelError(f"inputs: one mapping per rank ({len(self.kernels)}), got {len(inputs)}")
        for k, inp in zip(self.kernels, inputs):
            k._stage_inputs(inp, iterations)
        self.start(iterations)
        self.wait()
        return [k._outputs() for k in self.kernels]

    def start(self, iterations: int) -> None:
        """Ring every rank's doorbell for ``iterations`` more iterations (returns at once)."""
        for k in self.kernels:
            k.start(iterations)

    def wait(self) -> None:
        """Until every rank finished what was asked; the first error any rank reports halts them all."""
        if any(k.control is None for k in self.kernels):
            raise LoopKernelError("the loop kernels have been stopped and their memory freed")
        grace = self.timeout_s + 5.0
        deadline = time.monotonic() + grace
        last = [k.completed() for k in self.kernels]
        spins = 0
        while True:
            self._raise_first_error()
            now = [k.completed() for k in self.kernels]
            if all(c >= k._requested for c, k in zip(now, self.kernels)):
                # an error recorded by a task of the last iteration arrives with its progress
                self._raise_first_error()
                return
            if now != last:
                last, deadline = now, time.monotonic() + grace
            if time.monotonic() > deadline:
                behind = [k.rank for c, k in zip(now, self.kernels) if c < k._requested]
                left = [k._halt() for k in self.kernels if k._launched]  # every one, no short circuit
                raise LoopKernelError(
                    f"ranks {behind} made no progress for {grace:.0f} s and reported nothing (a megaloop bug: "
                    "please report it with the plan). "
                    + ("Every rank has been stopped" if all(left) else "Some did not stop: restart the process")
                )
            spins += 1
            if spins > 1000:
                time.sleep(0.0002)

    def _raise_first_error(self) -> None:
        for k in self.kernels:
            if int(k.control[ERROR]):
                for other in self.kernels:
                    if other is not k and other._launched:
                        other._halt()
                k._raise_kernel_error()

    def state(self) -> list[dict[str, np.ndarray]]:
        return [k.state() for k in self.kernels]

    def tensor(self, rank: int, name: str):
        """Rank ``rank``'s output, input or state ``name`` as a torch tensor on its GPU (no copy)."""
        return self.kernels[rank].tensor(name)

    def stop(self) -> None:
        self._stop_all()

    def _stop_all(self) -> None:
        """Every kernel leaves before any memory is freed: peers read each other's arenas. If one is
        stuck (it did not leave when asked, now or earlier), nothing is freed."""
        for k in self.kernels:
            if k._launched:
                k._halt()
        if any(k._stuck for k in self.kernels):
            raise LoopKernelError(
                "a rank's loop kernel did not stop when asked (a task is stuck: a megaloop bug); its memory and "
                "its peers' stay allocated and this process must be restarted to use the GPUs again"
            )
        for k in self.kernels:
            k._free()

    def __enter__(self) -> LoopKernelGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _check_peers(driver, devices: list[int]) -> bool:
    """Every pair of GPUs must reach each other directly; name the first pair that cannot. True when
    every pair also has native peer atomics (NVLink; usually not over PCIe): the mirror counters'
    remote increments need them (megaloop/codegen/kernel.py mirror_counters)."""
    _check(driver.cuInit(0))
    handles = [_check(driver.cuDeviceGet(d)) for d in devices]
    atomics = True
    for i, a in enumerate(handles):
        for j, b in enumerate(handles):
            if i != j and not _check(driver.cuDeviceCanAccessPeer(a, b)):
                raise LoopKernelError(
                    f"GPU {devices[i]} (rank {i}) cannot access GPU {devices[j]} (rank {j}) directly (no peer "
                    "access: no NVLink or PCIe peer path between them); the loop kernels need every pair"
                )
            if i != j:
                atomics = atomics and native_peer_atomics(driver, a, b)
    return atomics


def native_peer_atomics(driver, a, b) -> bool:
    """Whether GPU a's atomics on GPU b's memory are native (CUdevice handles)."""
    attr = driver.CUdevice_P2PAttribute.CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED
    err, value = driver.cuDeviceGetP2PAttribute(attr, a, b)
    return err == driver.CUresult.CUDA_SUCCESS and bool(value)

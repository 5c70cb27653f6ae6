"""All ranks of a multi-rank plan driven by one Python process (no launcher): one resident loop
kernel per rank, each reading its peers' arenas and counters directly (the exchange tiles of
megaloop/codegen/emit_collective.py): across NVLink between GPUs (peer access between every pair),
or in the GPU's own memory when ranks share a GPU.

    with LoopKernelGroup(plan, params=[w0, w1]) as group:      # rank r on GPU r
        outs = group.run([{"x": x0}, {"x": x1}])               # one dict of outputs per rank

    plan = make_plan(graphs, processors=sm_count // 2)          # two ranks on ONE GPU: half its SMs each
    with LoopKernelGroup(plan, params, devices=[0, 0]) as group: ...

``devices[r]`` is rank r's GPU; a GPU named several times is shared: its ranks' loop kernels run side
by side, each on ``plan.processors`` SMs, so the plan's processors times the ranks on a GPU must not
exceed its SMs (checked before anything is launched, naming the numbers). Ranks on one GPU need no
peer access (one context, plain device pointers; their system-scope releases and mirror counters are
ordinary device atomics there); every pair of distinct GPUs must reach each other directly, and the
pair that cannot is named. Every module is loaded before the first launch (loading one blocks while
a loop kernel is resident), and memory is freed only after every kernel has left, since peers read
each other's arenas. A kernel that reports an error (its watchdog, waiting on a peer that stopped)
halts every rank, and the error names the rank and the peer.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from megaloop.codegen import generate
from megaloop.plan.model import Plan
from megaloop.runtime import resident
from megaloop.runtime.compile import compile_many
from megaloop.runtime.device import gpus
from megaloop.runtime.loop import ERROR, LoopKernel, LoopKernelError, _check
from megaloop.runtime.upload import ProgressCallback, nbytes_of, progress_callback

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
        progress: bool | ProgressCallback | None = None,
    ) -> None:
        """``devices``: rank r runs on GPU ``devices[r]`` (repeats share a GPU's SMs); left out, GPU r.
        ``progress``: as LoopKernel's (compile counts every rank's kernel, upload every rank's bytes)."""
        from cuda.bindings import driver

        world = plan.world_size
        found, reason = gpus()
        devices = check_devices(world, devices, len(found), reason)
        distinct = sorted(set(devices))
        self._d = driver
        self.plan, self.devices, self.timeout_s = plan, devices, timeout_s
        self.kernels: list[LoopKernel] = []
        self._copy_streams: dict[int, Any] = {}
        params = list(params) if params is not None else [None] * world
        state = list(state) if state is not None else [None] * world
        if len(params) != world or len(state) != world:
            raise LoopKernelError(
                f"params and state: one mapping per rank ({world}), got {len(params)} and {len(state)}"
            )
        report = progress_callback(progress)
        for d in distinct:  # before compiling anything: a GPU held, or too few SMs for its ranks
            resident.refuse_if_occupied(d, f"the loop kernels of graph {plan.ranks[0].graph.name!r}")
            ranks = [r for r, g in enumerate(devices) if g == d]
            if len(ranks) > 1:  # the plan's processors side by side (each kernel's occupancy: after loading)
                launches = [resident.Launch(plan.processors, 1, f"rank {r}") for r in ranks]
                resident.check_co_resident(d, found[d].name, found[d].sm_count, launches)
        mirrors = _check_peers(driver, distinct)  # native peer atomics on every pair: mirror counters
        programs = [generate(plan, r, mirrors=mirrors) for r in range(world)]
        for arch in {found[d].arch for d in devices}:  # every rank's kernel at once
            sources = [p.source for p, d in zip(programs, devices) if found[d].arch == arch]
            compile_many(sources, arch, progress=None if report is None else lambda n, t: report("compile", n, t))
        uploads = _Uploads(report, [_host_bytes(plan, r, params[r], state[r]) for r in range(world)])
        try:
            for r, d in enumerate(devices):  # every module loaded before any kernel is launched
                self.kernels.append(
                    LoopKernel(
                        plan,
                        params[r],
                        state[r],
                        device=d,
                        timeout_s=timeout_s,
                        program=programs[r],
                        rank=r,
                        progress=uploads.for_rank(r),
                        _in_group=True,
                        _defer_setup=True,
                        _group=id(self),
                        _copies=self._copy_stream(d) if devices.count(d) > 1 else None,
                    )
                )
                self.kernels[-1]._devices = devices
            for d in distinct:  # with the loaded kernels' own occupancy
                on = [k for k in self.kernels if k.device == d]
                resident.check_co_resident(d, found[d].name, found[d].sm_count, [k.launch_spec() for k in on])
            for k in self.kernels:
                k._setup()
            self._enable_peer_access(distinct)
            arenas = [k.arena for k in self.kernels]
            counters = [k.counters for k in self.kernels]
            for k in self.kernels:
                k._connect(arenas, counters)
            for k in self.kernels:
                k._launch()
        except BaseException:
            self._stop_all()
            raise

    def _copy_stream(self, device: int) -> Any:
        """One copy stream for the ranks sharing ``device``: fewer streams than hardware queues
        (CUDA_DEVICE_MAX_CONNECTIONS, 8 by default), so that no copy queues behind a resident kernel.
        In the device's primary context (retained for the process, as LoopKernel's)."""
        if device not in self._copy_streams:
            _check(self._d.cuInit(0))
            ctx = _check(self._d.cuDevicePrimaryCtxRetain(_check(self._d.cuDeviceGet(device))))
            _check(self._d.cuCtxSetCurrent(ctx))
            flags = self._d.CUstream_flags.CU_STREAM_NON_BLOCKING
            self._copy_streams[device] = (ctx, _check(self._d.cuStreamCreate(flags)))
        return self._copy_streams[device][1]

    def _enable_peer_access(self, distinct: list[int]) -> None:
        """Each distinct GPU's context maps every other's memory (ranks on one GPU share a context)."""
        driver = self._d
        first = {d: next(k for k in self.kernels if k.device == d) for d in distinct}
        for a in distinct:
            first[a]._use()
            for b in distinct:
                if a == b:
                    continue
                (err,) = driver.cuCtxEnablePeerAccess(first[b]._ctx, 0)
                if err not in (driver.CUresult.CUDA_SUCCESS, driver.CUresult.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED):
                    raise LoopKernelError(
                        f"enabling peer access from GPU {a} (rank {first[a].rank}) to GPU {b} (rank {first[b].rank}) "
                        f"failed: {err.name}"
                    )

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
            if all([k.finished() for k in self.kernels]):  # a list: every rank updates its slowest block
                # an error recorded by a task of the last iteration arrives with its progress
                self._raise_first_error()
                return
            spins += 1
            if spins & 15:
                continue
            self._raise_first_error()
            now = [k.completed() for k in self.kernels]
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
        for ctx, stream in self._copy_streams.values():  # every kernel using them has been freed
            _check(self._d.cuCtxSetCurrent(ctx))
            self._d.cuStreamDestroy(stream)
        self._copy_streams.clear()

    def __del__(self) -> None:
        """A group dropped while running stops all its kernels first (then its memory goes)."""
        import sys

        if sys.is_finalizing() or not any(k._launched for k in getattr(self, "kernels", [])):
            return
        try:
            self._stop_all()
        except Exception:  # nowhere to report it; a stuck kernel keeps its GPU refused
            pass

    def __enter__(self) -> LoopKernelGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def check_devices(world: int, devices: Sequence[int] | None, visible: int, reason: str = "") -> list[int]:
    """Rank r's GPU for every rank: ``devices`` checked (one per rank, each visible; repeats share a
    GPU), or GPU r when left out."""
    if world > MAX_PEERS + 1 and devices is None:
        raise LoopKernelError(
            f"the plan has {world} ranks; a GPU can map at most {MAX_PEERS} peers' memory (CUDA's limit), so one "
            f"machine runs at most {MAX_PEERS + 1} ranks of a plan on GPUs of their own (ranks may share a GPU: "
            "devices=[...])"
        )
    have = f"{visible} GPU(s)" if visible else f"no GPU ({reason})" if reason else "no GPU"
    if devices is None:
        if world > visible:
            raise LoopKernelError(
                f"the plan has {world} ranks, one GPU each by default, and this machine has {have}; to run them on "
                f"one GPU, split its SMs: make the plan with processors = SMs // {world} and pass devices={[0] * world}"
            )
        return list(range(world))
    if isinstance(devices, (str, bytes)) or not all(isinstance(d, int) and not isinstance(d, bool) for d in devices):
        raise LoopKernelError(f"devices must be a list of GPU indices, one per rank, got {devices!r}")
    devices = list(devices)
    if len(devices) != world:
        raise LoopKernelError(f"the plan has {world} ranks; give one GPU per rank, got devices {devices}")
    bad = [d for d in devices if not 0 <= d < visible]
    if bad:
        raise LoopKernelError(f"devices {devices}: GPU(s) {sorted(set(bad))} do not exist; this machine has {have}")
    if len(set(devices)) > MAX_PEERS + 1:
        raise LoopKernelError(
            f"devices {devices}: {len(set(devices))} distinct GPUs, but a GPU can map at most {MAX_PEERS} peers' memory"
        )
    return devices


def _host_bytes(plan: Plan, rank: int, params: Mapping[str, Any] | None, state: Mapping[str, Any] | None) -> int:
    """Bytes rank ``rank``'s LoopKernel reports uploading (its parameters and the state handed in)."""
    g = plan.ranks[rank].graph
    total = sum(nbytes_of(t.shape, t.dtype) for n, t in g.parameters.items() if n in (params or {}))
    return total + sum(nbytes_of(t.shape, t.dtype) for n, t in g.states.items() if n in (state or {}))


class _Uploads:
    """Every rank's upload as one count of bytes (ranks set up one after the other)."""

    def __init__(self, report: ProgressCallback | None, per_rank: list[int]) -> None:
        self.report, self.per_rank = report, per_rank

    def for_rank(self, rank: int) -> ProgressCallback | None:
        if self.report is None:
            return None
        before, total = sum(self.per_rank[:rank]), sum(self.per_rank)
        report = self.report

        def forward(stage: str, done: int, _: int) -> None:
            if stage == "upload":  # compiles are reported by the group (compile_many)
                report("upload", before + done, total)

        return forward


def _check_peers(driver, devices: list[int]) -> bool:
    """Every pair of distinct GPUs must reach each other directly; name the first pair that cannot.
    True when every pair also has native peer atomics (NVLink; usually not over PCIe): the mirror
    counters' remote increments need them (megaloop/codegen/kernel.py mirror_counters). Ranks on one
    GPU need nothing: their counters and mirrors are that GPU's own memory."""
    _check(driver.cuInit(0))
    handles = [_check(driver.cuDeviceGet(d)) for d in devices]
    atomics = True
    for i, a in enumerate(handles):
        for j, b in enumerate(handles):
            if i != j and not _check(driver.cuDeviceCanAccessPeer(a, b)):
                raise LoopKernelError(
                    f"GPU {devices[i]} cannot access GPU {devices[j]} directly (no peer access: no NVLink or PCIe "
                    "peer path between them); the loop kernels need every pair of their GPUs"
                )
            if i != j:
                atomics = atomics and native_peer_atomics(driver, a, b)
    return atomics


def native_peer_atomics(driver, a, b) -> bool:
    """Whether GPU a's atomics on GPU b's memory are native (CUdevice handles)."""
    attr = driver.CUdevice_P2PAttribute.CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED
    err, value = driver.cuDeviceGetP2PAttribute(attr, a, b)
    return err == driver.CUresult.CUDA_SUCCESS and bool(value)

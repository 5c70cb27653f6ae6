"""Running a plan as one persistent loop kernel on one GPU (CUDA driver API through cuda-bindings).

    with LoopKernel(plan, params=weights) as k:     # compile (cached), allocate, upload, launch once
        out = k.run({"tokens": ids, "positions": pos}, iterations=1)
        k.state()                                    # state buffers after the run
        logits = k.tensor("logits")                  # a torch CUDA tensor that IS the kernel's memory

Inputs may be numpy arrays or torch tensors; CUDA tensors (of the input's dtype, contiguous) are
copied device to device. ``tensor(name)`` hands out outputs, inputs and states as torch tensors
without copies (see megaloop/runtime/interop.py, and never torch.cuda.synchronize() while a loop
kernel is resident: it waits for the whole device).

The kernel stays resident between runs: ``run`` writes the inputs into the arena (on a second stream,
while the kernel idles), rings the doorbell (the number of iterations asked for, in mapped pinned
memory) and waits for the kernel to report them done. Errors the kernel records (watchdog timeouts,
bad ids or positions) come back as Python exceptions that say what waited on what; the kernel has
then left, and a new LoopKernel can be made in the same process.
"""

from __future__ import annotations

import ctypes
import math
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from megaloop.codegen import LoopProgram, generate
from megaloop.codegen.kernel import MAX_OPERANDS, counter_slots
from megaloop.errors import DataError, EvaluationError, MegaloopError
from megaloop.frontend.shapes import is_contiguous
from megaloop.frontend.values import coerce
from megaloop.plan.model import Plan
from megaloop.plan.rendezvous import exchange_region
from megaloop.runtime.compile import compile_cubin
from megaloop.runtime.device import gpus
from megaloop.runtime.interop import DeviceView, as_torch, device_source, wait_for_torch

ARGS_DTYPE = np.dtype(
    [
        (name, np.uint64)
        for name in (
            "arena",
            "tasks",
            "waits",
            "list_begin",
            "lists",
            "operand_offsets",
            "counters",
            "abort",
            "doorbell",
            "progress",
            "control",
            "profile",
            "timeout_ns",
        )
    ]
    + [("profile_iterations", np.int32), ("n_tasks", np.int32)]
    + [("arenas", np.uint64), ("rank_counters", np.uint64), ("rank", np.int32), ("world", np.int32)]
    + [("mirrors", np.uint64)]
)
CONTROL_WORDS = 3 + 8  # requested, stop, error, info[8]
REQUESTED, STOP, ERROR, INFO = 0, 1, 2, 3


def needs_shared_opt_in(static_bytes: int, dynamic_bytes: int) -> bool:
    """Whether a kernel must opt in (CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES) to launch with
    ``dynamic_bytes`` of dynamic shared memory a block: past 48 KiB of static and dynamic together (CUDA
    programming guide). Testing the dynamic bytes alone left kernels of 46 KB dynamic and 3 KB static
    unlaunchable: no block resident."""
    return static_bytes + dynamic_bytes > 48 * 1024


class LoopKernelError(MegaloopError, RuntimeError):
    """The loop kernel gave up (watchdog) or could not be run."""


def memory_sizes(plan: Plan, rank: int) -> tuple[int, int]:
    """Bytes of a rank's arena and counters (one u64 per counter, its mirrors of peers' counters
    included), as a LoopKernel allocates them and as a peer-memory provider (megaloop/runtime/peers.py)
    must."""
    start, inbox_bytes = exchange_region(plan, rank)  # pushing all_reduces' inboxes, after the plan's buffers
    arena = start + inbox_bytes if inbox_bytes else plan.ranks[rank].arena_bytes
    return max(arena, 8), 8 * max(counter_slots(plan, rank), 1)


def _check(result: Any) -> Any:
    """cuda-bindings calls return (err, *values): raise on error, return the values."""
    err, *values = result if isinstance(result, tuple) else (result,)
    from cuda.bindings import driver

    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        raise LoopKernelError(f"CUDA driver error {name.decode() if isinstance(name, bytes) else name}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


class LoopKernel:
    def __init__(
        self,
        plan: Plan,
        params: Mapping[str, Any] | None = None,
        state: Mapping[str, Any] | None = None,
        *,
        device: int = 0,
        timeout_s: float = 10.0,
        profile_iterations: int = 0,
        program: LoopProgram | None = None,
        rank: int = 0,
        _in_group: bool = False,
        _memory: tuple[int, int] | None = None,
    ) -> None:
        """``_memory``: the device addresses of an arena and counters allocated elsewhere (at least as
        large as this rank's; megaloop/runtime/peers.py), used instead of allocating them and never freed
        here: their provider frees them."""
        from cuda.bindings import driver

        if plan.world_size > 1 and not _in_group:
            raise LoopKernelError(
                f"the plan has {plan.world_size} ranks; LoopKernel runs one of them. Run all of them "
                "together with megaloop.runtime.group.LoopKernelGroup(plan, ...)"
            )
        found, reason = gpus()
        if not found:
            raise LoopKernelError(f"no GPU to run the loop kernel on: {reason}")
        if not 0 <= device < len(found):
            raise LoopKernelError(f"GPU {device} does not exist ({len(found)} visible)")
        self.plan, self.rank, self.rp = plan, rank, plan.ranks[rank]
        self.device = device
        self._in_place: set[str] = set()  # inputs handed out by tensor(): the caller writes them there
        self.program = program or generate(plan, rank)
        self.timeout_s = timeout_s
        self.profile_iterations = profile_iterations
        self._d = driver
        self._allocations: list[int] = []
        self._memory = _memory
        self._launched = False
        self._stuck = False
        self._requested = 0
        self.control = self.progress = None  # views of the mapped control page, once allocated
        self.cubin = compile_cubin(self.program.source, found[device].arch)
        _check(driver.cuInit(0))
        dev = _check(driver.cuDeviceGet(device))
        self._ctx = _check(driver.cuDevicePrimaryCtxRetain(dev))
        _check(driver.cuCtxSetCurrent(self._ctx))
        try:
            self._module = _check(driver.cuModuleLoadData(self.cubin))
            self._function = _check(driver.cuModuleGetFunction(self._module, b"megaloop_loop"))
            static = self._static_shared = int(
                _check(
                    driver.cuFuncGetAttribute(
                        driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, self._function
                    )
                )
            )
            if needs_shared_opt_in(static, self.program.shared_bytes):
                limit = _check(
                    driver.cuDeviceGetAttribute(
                        driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, dev
                    )
                )
                if static + self.program.shared_bytes > limit:
                    raise LoopKernelError(
                        f"the loop kernel needs {self.program.shared_bytes} bytes of dynamic shared memory per "
                        f"block (split-key attention for {self.program.threads // 32} warps, tensor-core matmul "
                        f"stages, rmsnorm_matmul's normed rows) besides its {static} static ones; this GPU allows "
                        f"{limit}: plan with fewer warps or smaller matmul tiles"
                    )
                _check(
                    driver.cuFuncSetAttribute(
                        self._function,
                        driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        self.program.shared_bytes,
                    )
                )
            self._check_resident(found[device])
            flags = driver.CUstream_flags.CU_STREAM_NON_BLOCKING
            self._stream = _check(driver.cuStreamCreate(flags))
            self._copies = _check(driver.cuStreamCreate(flags))
            self._setup_memory()
            self._load_host_values(params or {}, state or {})
            if not _in_group:  # alone: its own arena and counters are the whole world
                self._connect([self.arena], [self.counters])
                self._launch()
        except BaseException:
            self._free()  # whatever was allocated before the failure
            raise

    def _use(self) -> None:
        """Make this kernel's GPU current (one process may drive several)."""
        _check(self._d.cuCtxSetCurrent(self._ctx))

    def _check_resident(self, gpu) -> None:
        """Every block must be resident at once: a block that never starts leaves the others waiting
        on counters it would have signalled (until the watchdog fires, with a confusing report)."""
        per_sm = _check(
            self._d.cuOccupancyMaxActiveBlocksPerMultiprocessor(
                self._function, self.program.threads, self.program.shared_bytes
            )
        )
        resident = int(per_sm) * gpu.sm_count
        if resident == 0:
            self._free()
            raise LoopKernelError(
                f"no block of the loop kernel ({self.program.threads} threads, {self.program.shared_bytes} bytes of "
                f"dynamic and {self._static_shared} of static shared memory) fits on a multiprocessor of {gpu.name}: "
                "plan with fewer warps or smaller matmul tiles"
            )
        if self.program.processors > resident:
            self._free()
            raise LoopKernelError(
                f"the plan has {self.program.processors} processors (thread blocks of {self.program.threads} "
                f"threads, {self.program.shared_bytes} bytes of dynamic shared memory), but {gpu.name} keeps at most "
                f"{resident} of them resident at once ({gpu.sm_count} SMs x {per_sm}); make the plan with "
                f"processors <= {resident}"
            )

    # ---- memory ------------------------------------------------------------------------------------
    def _alloc(self, nbytes: int) -> int:
        ptr = int(_check(self._d.cuMemAlloc(max(int(nbytes), 8))))
        self._allocations.append(ptr)
        return ptr

    def _upload(self, array: np.ndarray) -> int:
        array = np.ascontiguousarray(array)
        ptr = self._alloc(array.nbytes)
        if array.nbytes:
            _check(self._d.cuMemcpyHtoD(ptr, array, array.nbytes))
        return ptr

    def _setup_memory(self) -> None:
        d, prog = self._d, self.program
        arena_bytes, counter_bytes = memory_sizes(self.plan, self.rank)
        if self._memory is None:
            self.arena = self._alloc(arena_bytes)
            self.counters = self._alloc(counter_bytes)
        else:  # valid here: torch and the IPC provider work in this device's primary context, our self._ctx
            self.arena, self.counters = self._memory
        _check(d.cuMemsetD8(self.arena, 0xFF, arena_bytes))  # poison: NaN in every float
        inbox_at, inbox_bytes = exchange_region(self.plan, self.rank)
        if inbox_bytes:  # no flag or count of a pushed tile matches a zero
            _check(d.cuMemsetD8(self.arena + inbox_at, 0, inbox_bytes))
        _check(d.cuMemsetD8(self.counters, 0, counter_bytes))
        self.flags = self._alloc(24)  # abort; the doorbell's device copy (granted, stop), kept by block 0
        _check(d.cuMemsetD8(self.flags, 0, 24))
        # mapped pinned memory: the doorbell and error report, then each block's finished iterations
        words = CONTROL_WORDS + prog.processors
        host = _check(d.cuMemHostAlloc(8 * words, d.CU_MEMHOSTALLOC_DEVICEMAP | d.CU_MEMHOSTALLOC_PORTABLE))
        self._control_host = int(host)
        mapped = np.ctypeslib.as_array((ctypes.c_uint64 * words).from_address(self._control_host))
        mapped[:] = 0
        self.control, self.progress = mapped[:CONTROL_WORDS], mapped[CONTROL_WORDS:]
        control_dev = int(_check(d.cuMemHostGetDevicePointer(self._control_host, 0)))
        self.profile = 0
        if self.profile_iterations:
            self.profile = self._alloc(16 * len(self.rp.tasks) * self.profile_iterations)
            _check(d.cuMemsetD8(self.profile, 0, 16 * len(self.rp.tasks) * self.profile_iterations))
        args = np.zeros(1, ARGS_DTYPE)
        args["arena"], args["counters"], args["control"] = self.arena, self.counters, control_dev
        args["abort"], args["doorbell"] = self.flags, self.flags + 8
        args["progress"] = control_dev + 8 * CONTROL_WORDS
        args["tasks"] = self._upload(prog.tasks)
        args["waits"] = self._upload(prog.waits)
        args["list_begin"] = self._upload(prog.list_begin)
        args["lists"] = self._upload(prog.lists)
        args["operand_offsets"] = self._upload(prog.operand_offsets.reshape(-1, MAX_OPERANDS))
        args["mirrors"] = self._upload(prog.mirrors)
        args["profile"] = self.profile
        args["timeout_ns"] = int(self.timeout_s * 1e9)
        args["profile_iterations"] = self.profile_iterations
        args["n_tasks"] = len(self.rp.tasks)
        self._args_host = args

    def _connect(self, arenas: list[int], counters: list[int]) -> None:
        """Every rank's arena and counters (device addresses valid here: peer access is on), then the
        argument block the kernel reads."""
        self._use()
        args = self._args_host
        args["arenas"] = self._upload(np.array(arenas, np.uint64))
        args["rank_counters"] = self._upload(np.array(counters, np.uint64))
        args["rank"], args["world"] = self.rank, len(arenas)
        self._args = self._upload(args)

    def _write(self, tensor_id: int, values: np.ndarray) -> None:
        self._use()
        t = self.rp.tensors[tensor_id]
        buf = self.rp.buffers[t.buffer]
        if t.offset or t.strides != _contiguous(t.shape):
            raise LoopKernelError(f"cannot upload into the strided view {t.name!r}")
        data = np.ascontiguousarray(values)
        _check(self._d.cuMemcpyHtoDAsync(self.arena + buf.offset, data, data.nbytes, self._copies))
        _check(self._d.cuStreamSynchronize(self._copies))

    def _put(self, gt: Any, value: Any, what: str) -> None:
        """The value of graph tensor ``gt``: host data (converted, then copied up) or a GPU array
        (copied device to device, no conversion)."""
        tensor_id = self.rp.tensor_of[gt]
        t = self.rp.tensors[tensor_id]
        src = device_source(value, t.dtype, t.shape, what, self.device, self.timeout_s)
        if src is None:
            self._write(tensor_id, coerce(value, gt, what))
            return
        buf = self.rp.buffers[t.buffer]
        if t.offset or t.strides != _contiguous(t.shape):
            raise LoopKernelError(f"cannot upload into the strided view {t.name!r}")
        if src.nbytes:
            self._use()
            _check(self._d.cuMemcpyDtoDAsync(self.arena + buf.offset, src.ptr, src.nbytes, self._copies))
            _check(self._d.cuStreamSynchronize(self._copies))

    def _read(self, tensor_id: int) -> np.ndarray:
        self._use()
        t = self.rp.tensors[tensor_id]
        buf = self.rp.buffers[t.buffer]
        item = t.dtype.itemsize
        if is_contiguous(t.shape, t.strides):  # its own bytes straight into the array returned (a
            # prefill's 33 MB of logits were copied whole buffer first, then once more on the host)
            raw = np.empty(math.prod(t.shape) * item, np.uint8)
            at = self.arena + buf.offset + t.offset * item
            _check(self._d.cuMemcpyDtoHAsync(raw, at, raw.nbytes, self._copies))
            _check(self._d.cuStreamSynchronize(self._copies))
            return raw.view(t.dtype.np).reshape(t.shape)
        raw = np.empty(buf.nbytes, np.uint8)
        _check(self._d.cuMemcpyDtoHAsync(raw, self.arena + buf.offset, buf.nbytes, self._copies))
        _check(self._d.cuStreamSynchronize(self._copies))
        return np.array(
            np.ndarray(
                t.shape, t.dtype.np, buffer=raw, offset=t.offset * item, strides=tuple(s * item for s in t.strides)
            ),
            copy=True,
        )

    def _load_host_values(self, params: Mapping[str, Any], state: Mapping[str, Any]) -> None:
        g = self.rp.graph
        missing = [k for k in g.parameters if k not in params]
        unknown = [k for k in params if k not in g.parameters]
        if missing or unknown:
            raise EvaluationError(f"parameters missing {missing}, unknown {unknown}")
        for name, t in g.parameters.items():
            self._put(t, params[name], f"parameter {name!r}")
        for t in g.constants:
            self._write(self.rp.tensor_of[t], t.node.attrs["value"])
        self.set_state(state, all_states=True)

    def set_state(self, state: Mapping[str, Any], *, all_states: bool = False) -> None:
        """Overwrite state buffers (between runs); with ``all_states``, the others get their init."""
        g = self.rp.graph
        unknown = [k for k in state if k not in g.states]
        if unknown:
            raise EvaluationError(f"unknown state {unknown}")
        for name, t in g.states.items():
            if name in state:
                self._put(t, state[name], f"state {name!r}")
                continue
            if all_states:
                values = t.node.attrs["init"] if "init" in t.node.attrs else np.zeros(t.shape, t.dtype.np)
            else:
                continue
            self._write(self.rp.tensor_of[t], values)

    # ---- running ----------------------------------------------------------------------------------
    def _launch(self) -> None:
        self._use()
        d = self._d
        params = ((self._args,), (ctypes.c_void_p,))
        _check(
            d.cuLaunchKernel(
                self._function,
                self.program.processors,
                1,
                1,
                self.program.threads,
                1,
                1,
                self.program.shared_bytes,
                self._stream,
                params,
                0,
            )
        )
        self._launched = True

    def run(self, inputs: Mapping[str, Any] | None = None, iterations: int = 1) -> dict[str, np.ndarray]:
        """Write ``inputs``, run ``iterations`` iterations, return the outputs of the last one."""
        self._stage_inputs(inputs, iterations)
        self.start(iterations)
        self.wait()
        return self._outputs()

    def _stage_inputs(self, inputs: Mapping[str, Any] | None, iterations: int) -> None:
        """Check the request and write the inputs (the kernel idles meanwhile)."""
        if not self._launched:
            raise LoopKernelError("the loop kernel is not running (stopped, or it failed earlier)")
        if not isinstance(iterations, int) or iterations < 1:
            raise EvaluationError(f"iterations must be an int >= 1, got {iterations!r}")
        g = self.rp.graph
        inputs = dict(inputs or {})
        missing = [k for k in g.inputs if k not in inputs and k not in self._in_place]
        unknown = [k for k in inputs if k not in g.inputs]
        if missing or unknown:
            raise EvaluationError(
                f"{self._who()}inputs missing {missing}, unknown {unknown} (an input written in place through "
                "tensor(name) may be left out)"
            )
        for name, value in inputs.items():
            self._put(g.inputs[name], value, f"{self._who()}input {name!r}")
        if self._in_place:  # torch work writing those inputs must be done before the doorbell rings
            wait_for_torch(
                self.device, f"{self._who()}inputs {sorted(self._in_place)} written in place", self.timeout_s
            )

    def _outputs(self) -> dict[str, np.ndarray]:
        return {name: self._read(tid) for name, tid in self.rp.outputs.items()}

    def _who(self) -> str:
        return f"rank {self.rank}: " if self.plan.world_size > 1 else ""

    def start(self, iterations: int) -> None:
        """Ring the doorbell for ``iterations`` more iterations (returns at once)."""
        if not self._launched:
            raise LoopKernelError("the loop kernel is not running (stopped, or it failed earlier)")
        self._requested += iterations
        self.control[REQUESTED] = self._requested

    def wait(self) -> None:
        """Until the kernel finished what was asked, or raise what it reported."""
        if self.control is None:
            raise LoopKernelError("the loop kernel has been stopped and its memory freed")
        deadline = time.monotonic() + self.timeout_s + 5.0
        last = self.completed()
        spins = 0
        while self.completed() < self._requested:
            if int(self.control[ERROR]):
                self._raise_kernel_error()
            now = self.completed()
            if now != last:
                last, deadline = now, time.monotonic() + self.timeout_s + 5.0
            if time.monotonic() > deadline:
                left = self._halt()
                raise LoopKernelError(
                    f"the loop kernel made no progress for {self.timeout_s + 5:.0f} s and reported nothing: "
                    "a task is stuck outside a wait (a megaloop bug; please report it with the plan). "
                    + (
                        "It has been stopped; make a new LoopKernel to run again"
                        if left
                        else "It did not stop either: its memory stays allocated and this process must be restarted "
                        "to use the GPU again"
                    )
                )
            spins += 1
            if spins > 1000:
                time.sleep(0.0002)
        if int(self.control[ERROR]):
            self._raise_kernel_error()

    def completed(self) -> int:
        """Iterations every block has finished."""
        return int(self.progress.min())

    def _raise_kernel_error(self) -> None:
        code = int(self.control[ERROR])
        info = [int(np.int64(np.uint64(v))) for v in self.control[INFO : INFO + 8]]
        self._halt()  # every block leaves (a block stuck in a task is reported by stop())
        if code == 1:
            proc, task, op, counter, expected, seen, k, peer = info
            rp = self.rp
            waiting = rp.task_name(rp.tasks[task]) if 0 <= task < len(rp.tasks) else f"task {task}"
            if counter == -3:  # inside a matmul tile: its weights, staged by the copy engine (megaloop/stage.cuh)
                raise LoopKernelError(
                    f"watchdog: rank {self.rank} processor {proc} waited more than {self.timeout_s:g} s in iteration "
                    f"{k} in {waiting}: the weights copied into shared memory for it (tile switch stage_weights) "
                    "never landed. The kernel has stopped; make a new LoopKernel to run again (set stage_weights "
                    "to 0 on the matmul to load them without the copy engine)"
                )
            if counter < 0:  # inside a pushing all_reduce's tile: a member's data (megaloop/exchange.cuh)
                what = "LL line flag" if counter == -1 else "arrival count"
                raise LoopKernelError(
                    f"watchdog: rank {self.rank} processor {proc} waited more than {self.timeout_s:g} s in iteration "
                    f"{k} in {waiting}: the tile rank {peer} pushes to it never arrived (a peer GPU: is it running?); "
                    f"its {what} stayed at {seen}, expected {expected}. The kernel has stopped; make a new LoopKernel "
                    "to run again"
                )
            owner = self.plan.ranks[peer] if 0 <= peer < len(self.plan.ranks) else rp
            signaler = owner.counters[counter].name if 0 <= counter < len(owner.counters) else f"counter {counter}"
            where = f" of rank {peer} (a peer GPU: is it running?)" if peer != self.rank else ""
            raise LoopKernelError(
                f"watchdog: rank {self.rank} processor {proc} waited more than {self.timeout_s:g} s in iteration {k} "
                f"before {waiting}: counter {counter}{where} ({signaler}) stayed at {seen}, expected {expected}. "
                "The kernel has stopped; make a new LoopKernel to run again"
            )
        if code == 2:
            proc, task, op, value, limit, kind, _, _ = info
            what = ["id", "cache position", "kv length"][kind] if 0 <= kind < 3 else "index"
            name = self.rp.ops[op].name if 0 <= op < len(self.rp.ops) else f"op {op}"
            if kind == 3:  # megaloop.codegen.emit_sample.DATA_KIND: value is the row
                raise DataError(
                    f"sample {name}: row {value} (counted in the rows' row-major order) has a temperature, top_k or "
                    "top_p out of range: temperature must be finite and >= 0, top_k >= 0, top_p in (0, 1] (found by "
                    f"task {task} on processor {proc}); the kernel has stopped"
                )
            raise DataError(
                f"{self.rp.ops[op].op if 0 <= op < len(self.rp.ops) else 'op'} {name}: {what} {value} is "
                f"outside [0, {limit}) (found by task {task} on processor {proc}); the kernel has stopped"
            )
        raise LoopKernelError(f"the loop kernel reported error code {code}")

    def state(self) -> dict[str, np.ndarray]:
        g = self.rp.graph
        return {name: self._read(self.rp.tensor_of[t]) for name, t in g.states.items()}

    def tensor(self, name: str):
        """A torch tensor that IS the kernel's memory for output, input or state ``name`` (looked up in
        that order): no copy. An output's values are those of the last ``run``; an input handed out
        here may be filled in place (by torch work on the current stream) and then left out of
        ``run``'s inputs. Valid until the kernel stops."""
        rp, g = self.rp, self.rp.graph
        if name in rp.outputs:
            tid = rp.outputs[name]
        elif name in g.inputs:
            tid = rp.tensor_of[g.inputs[name]]
            self._in_place.add(name)
        elif name in g.states:
            tid = rp.tensor_of[g.states[name]]
        else:
            raise EvaluationError(
                f"no output, input or state named {name!r}; outputs {sorted(rp.outputs)}, inputs "
                f"{sorted(g.inputs)}, states {sorted(g.states)}"
            )
        t = rp.tensors[tid]
        item = t.dtype.itemsize
        ptr = self.arena + rp.buffers[t.buffer].offset + t.offset * item
        view = DeviceView(ptr, t.shape, tuple(s * item for s in t.strides), t.dtype, self.device, owner=self)
        return as_torch(view)

    def profile_ns(self) -> np.ndarray:
        """(iterations, tasks, 2) globaltimer start/end of each task for the first profiled iterations."""
        n = len(self.rp.tasks) * self.profile_iterations
        out = np.zeros(2 * n, np.uint64)
        self._use()
        if n:
            _check(self._d.cuMemcpyDtoH(out, self.profile, out.nbytes))
        return out.reshape(self.profile_iterations, len(self.rp.tasks), 2)

    def _halt(self) -> bool:
        """Make every block leave: the stop word first (idle blocks), then the abort flag (blocks in a
        wait). False when the kernel is still running after that: a task itself is stuck."""
        self._use()
        d = self._d
        self._launched = False
        self.control[STOP] = 1
        if self._left(self.timeout_s + 5.0):
            return True
        one = np.ones(1, np.uint64)
        _check(d.cuMemcpyHtoDAsync(self.flags, one, 8, self._copies))
        _check(d.cuStreamSynchronize(self._copies))
        if self._left(5.0):
            return True
        self._stuck = True
        return False

    def _left(self, seconds: float) -> bool:
        """Whether the kernel finished within ``seconds`` (polling, never blocking without bound)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            (err,) = self._d.cuStreamQuery(self._stream)
            if err == self._d.CUresult.CUDA_SUCCESS:
                return True
            if err != self._d.CUresult.CUDA_ERROR_NOT_READY:
                _check((err,))
            time.sleep(0.001)
        return False

    def stop(self) -> None:
        """Tell the kernel to leave, wait for it, free everything."""
        try:
            if self._launched and not self._halt():
                raise LoopKernelError(
                    "the loop kernel did not stop when asked (a task is stuck: a megaloop bug); its memory stays "
                    "allocated and this process must be restarted to use the GPU again"
                )
        finally:
            if not self._stuck:  # freeing memory a running kernel still uses could corrupt it: leave it all
                self._free()

    def _free(self) -> None:
        self._use()
        d = self._d
        for ptr in self._allocations:
            d.cuMemFree(ptr)
        self._allocations.clear()
        if getattr(self, "_control_host", 0):
            self.control = self.progress = None  # views of the pinned page: gone with it
            d.cuMemFreeHost(self._control_host)
            self._control_host = 0
        for s in ("_stream", "_copies"):
            if getattr(self, s, None) is not None:
                d.cuStreamDestroy(getattr(self, s))
                setattr(self, s, None)
        if getattr(self, "_module", None) is not None:
            d.cuModuleUnload(self._module)
            self._module = None

    def __enter__(self) -> LoopKernel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    from megaloop.frontend.shapes import contiguous_strides

    return contiguous_strides(shape)

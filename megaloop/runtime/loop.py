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

Parameters and initial state go up through pinned staging buffers piece by piece (megaloop/runtime/
upload.py: a memory-mapped checkpoint is read straight into them, never copied whole); ``progress=True``
draws tqdm bars for the compile and the upload, a callable ``(stage, done, total)`` gets the numbers.
A resident kernel holds its GPU: a second LoopKernel there is refused at once (megaloop/runtime/
resident.py says why), and kernels left running are stopped at exit and when collected.
"""

from __future__ import annotations

import ctypes
import math
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from megaloop.codegen import LoopProgram, generate
from megaloop.codegen.abi import ARGS_DTYPE, CONTROL, MAX_OPERANDS, word
from megaloop.errors import EvaluationError
from megaloop.frontend.shapes import is_contiguous
from megaloop.frontend.values import coerce
from megaloop.plan.model import Plan
from megaloop.plan.rendezvous import exchange_region
from megaloop.runtime import resident
from megaloop.runtime.compile import compile_and_load
from megaloop.runtime.device import gpus
from megaloop.runtime.driver import _check, load_module  # (_check: the modules beside this one use it from here)
from megaloop.runtime.interop import DeviceView, as_torch, device_source, wait_for_torch
from megaloop.runtime.programs import connect_counters, memory_sizes, program_index, upload_tables
from megaloop.runtime.report import LoopKernelError, kernel_error
from megaloop.runtime.stamps import STAMP_WORDS, profile_bytes
from megaloop.runtime.upload import CHUNK_BYTES, ProgressCallback, Staging, nbytes_of, progress_callback, upload

# the mapped control block (ml::Control) as u64 words: the doorbell, the error report, then each block's progress
CONTROL_WORDS = CONTROL.dtype.itemsize // 8
REQUESTED, HOST_NS, STOP, ERROR, INFO, PROGRAM, DONE = (
    word(CONTROL, n) for n in ("requested", "host_ns", "stop", "error", "info", "program", "done")
)


def needs_shared_opt_in(static_bytes: int, dynamic_bytes: int) -> bool:
    """Whether a kernel must opt in (CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES) to launch with
    ``dynamic_bytes`` of dynamic shared memory a block: past 48 KiB of static and dynamic together (CUDA
    programming guide). Testing the dynamic bytes alone left kernels of 46 KB dynamic and 3 KB static
    unlaunchable: no block resident."""
    return static_bytes + dynamic_bytes > 48 * 1024


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
        progress: bool | ProgressCallback | None = None,
        _in_group: bool = False,
        _memory: tuple[int, int] | None = None,
        _defer_setup: bool = False,
        _group: int | None = None,
        _copies: Any = None,
    ) -> None:
        """``progress``: None (quiet), True (tqdm bars) or a callable ``(stage, done, total)``: "compile"
        (kernels) and "upload" (bytes of parameters and state). ``_memory``: the device addresses of
        an arena and counters allocated elsewhere (at least as large as this rank's; megaloop/runtime/
        peers.py), used instead of allocating them and never freed here: their provider frees them.
        ``_defer_setup``: stop after loading the module (the group checks residency, then calls
        ``_setup``); ``_group``: the group launched with it; ``_copies``: a copy stream it lends."""
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
        self.device, self.gpu = device, found[device]
        self._in_place: set[str] = set()  # inputs handed out by tensor(): the caller writes them there
        self.timeout_s = timeout_s
        self.profile_iterations = profile_iterations
        self._completion_word = bool(plan.options.completion_word)
        self._d = driver
        self._allocations: list[int] = []
        self._staged: list[np.ndarray] = []  # host arrays of copies in flight
        self._memory = _memory
        self._launched = False
        self._stuck = False
        self._requested = 0
        self._program = 0  # the program of the iterations asked for last
        self._group = _group
        self._lent_copies = _copies is not None
        self.control = self.progress = None  # views of the mapped control page, once allocated
        self._slowest = 0  # the block wait() polls first
        self._progress = progress_callback(progress)
        resident.refuse_if_occupied(device, self._what())  # before anything: loading would hang
        self.program = program or generate(plan, rank)
        _check(driver.cuInit(0))
        dev = _check(driver.cuDeviceGet(device))
        self._ctx = _check(driver.cuDevicePrimaryCtxRetain(dev))
        _check(driver.cuCtxSetCurrent(self._ctx))
        try:
            self._report("compile", 0, 1)
            self.cubin, self._module = compile_and_load(self.program.source, self.gpu.arch, self._load)
            self._report("compile", 1, 1)
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
                        f"stages, the row ops' rings of rows) besides its {static} static ones; this GPU allows "
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
            self._copies = _copies if _copies is not None else _check(driver.cuStreamCreate(flags))
            self._host_values = (params or {}, state or {})
            if not _defer_setup:
                self._setup()
            if not _in_group:  # alone: its own arena and counters are the whole world
                self._connect([self.arena], [self.counters])
                self._launch()
        except BaseException:
            self._free()  # whatever was allocated before the failure
            raise

    def _setup(self) -> None:
        """The arena, counters and control page, then parameters, constants and initial state."""
        self._setup_memory()
        params, state = self._host_values
        self._host_values = ({}, {})  # not kept alive by the kernel
        self._load_host_values(params, state)

    def _what(self) -> str:
        rank = f" (rank {self.rank} of {self.plan.world_size})" if self.plan.world_size > 1 else ""
        return f"the loop kernel of graph {self.rp.graph.name!r}{rank}"

    def _report(self, stage: str, done: int, total: int) -> None:
        if self._progress is not None:
            self._progress(stage, done, total)

    def _load(self, cubin: bytes) -> Any:
        resident.refuse_if_occupied(self.device, self._what())  # a kernel launched meanwhile (a thread)
        return load_module(cubin)

    def launch_spec(self) -> resident.Launch:
        """Its thread blocks and how many fit an SM, for the residency arithmetic."""
        return resident.Launch(self.program.processors, self.blocks_per_sm, self._what())

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
        self.blocks_per_sm = int(per_sm)
        fit = int(per_sm) * gpu.sm_count
        if fit == 0:
            self._free()
            raise LoopKernelError(
                f"no block of the loop kernel ({self.program.threads} threads, {self.program.shared_bytes} bytes of "
                f"dynamic and {self._static_shared} of static shared memory) fits on a multiprocessor of {gpu.name}: "
                "plan with fewer warps or smaller matmul tiles"
            )
        if self.program.processors > fit:
            self._free()
            raise LoopKernelError(
                f"the plan has {self.program.processors} processors (thread blocks of {self.program.threads} "
                f"threads, {self.program.shared_bytes} bytes of dynamic shared memory), but {gpu.name} keeps at most "
                f"{fit} of them resident at once ({gpu.sm_count} SMs x {per_sm}); make the plan with "
                f"processors <= {fit}"
            )

    # ---- memory ------------------------------------------------------------------------------------
    def _alloc(self, nbytes: int) -> int:
        ptr = int(_check(self._d.cuMemAlloc(max(int(nbytes), 8))))
        self._allocations.append(ptr)
        return ptr

    def _upload(self, array: np.ndarray) -> int:
        """A new allocation holding ``array``, copied on the copy stream (every setup step is queued
        there, in order, and waited for once: ``_sync`` before the launch)."""
        array = np.ascontiguousarray(array)
        ptr = self._alloc(array.nbytes)
        if array.nbytes:
            self._staged.append(array)  # alive until the copy stream is synchronised
            _check(self._d.cuMemcpyHtoDAsync(ptr, array, array.nbytes, self._copies))
        return ptr

    def _setup_memory(self) -> None:
        d, prog = self._d, self.program
        arena_bytes, counter_bytes = memory_sizes(self.plan, self.rank)
        if self._memory is None:
            self.arena = self._alloc(arena_bytes)
            self.counters = self._alloc(counter_bytes)
        else:  # valid here: torch and the IPC provider work in this device's primary context, our self._ctx
            self.arena, self.counters = self._memory
        # on the copy stream, as the uploads after them: a non-blocking stream is not ordered after
        # the legacy default stream's memsets
        copies = self._copies
        _check(d.cuMemsetD8Async(self.arena, 0xFF, arena_bytes, copies))  # poison: NaN in every float
        inbox_at, inbox_bytes = exchange_region(self.plan, self.rank)
        if inbox_bytes:  # no flag or count of a pushed tile matches a zero
            _check(d.cuMemsetD8Async(self.arena + inbox_at, 0, inbox_bytes, copies))
        _check(d.cuMemsetD8Async(self.counters, 0, counter_bytes, copies))
        # abort; the doorbell's device copy (granted, stop, program) kept by block 0; the arrival counter
        self.flags = self._alloc(40)
        _check(d.cuMemsetD8Async(self.flags, 0, 40, copies))
        # mapped pinned memory: the doorbell and error report, then each block's finished iterations
        words = CONTROL_WORDS + prog.processors
        host = _check(d.cuMemHostAlloc(8 * words, d.CU_MEMHOSTALLOC_DEVICEMAP | d.CU_MEMHOSTALLOC_PORTABLE))
        self._control_host = int(host)
        mapped = np.ctypeslib.as_array((ctypes.c_uint64 * words).from_address(self._control_host))
        mapped[:] = 0
        self.control, self.progress = mapped[:CONTROL_WORDS], mapped[CONTROL_WORDS:]
        control_dev = int(_check(d.cuMemHostGetDevicePointer(self._control_host, 0)))
        self.profile = 0
        n_tasks = max(len(p.tasks) for p in [prog, *prog.others])  # (profiles index tasks of any program)
        if self.profile_iterations:  # each task's (start, end), then each block's round-trip stamps
            stamps = profile_bytes(self.plan.options, n_tasks, prog.processors, self.profile_iterations)
            self.profile = self._alloc(stamps)
            _check(d.cuMemsetD8Async(self.profile, 0, stamps, copies))
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
        args["ring_chunks"] = self._upload(prog.ring_chunks)
        args["ring_begin"] = self._upload(prog.ring_begin)
        self._programs = upload_tables(prog, self._upload, self.plan.options)
        args["records"] = self._programs[0]["records"]
        args["n_programs"] = len(self._programs)
        args["profile"] = self.profile
        args["timeout_ns"] = int(self.timeout_s * 1e9)
        args["profile_iterations"] = self.profile_iterations
        args["n_tasks"] = self._n_tasks = n_tasks
        self._args_host = args
        self._sync_setup("setting up the arena and tables")

    def _connect(self, arenas: list[int], counters: list[int]) -> None:
        """Every rank's arena and counters (device addresses valid here: peer access is on), then the
        argument block the kernel reads."""
        self._use()
        args = self._args_host
        args["arenas"] = self._upload(np.array(arenas, np.uint64))
        args["rank_counters"] = self._upload(np.array(counters, np.uint64))
        args["rank"], args["world"] = self.rank, len(arenas)
        connect_counters(self._programs, self.plan, self.rank, counters, self._upload)
        args["programs"] = self._upload(self._programs)
        self._args = self._upload(args)
        self._sync_setup("uploading the kernel's arguments")

    def _sync_setup(self, what: str) -> None:
        self._sync(self._copies, what)
        self._staged.clear()

    def _sync(self, stream: Any, what: str) -> None:
        """Until the work queued on ``stream`` is done, polling with a deadline (a copy queued behind a
        resident loop kernel in a shared hardware queue would otherwise block the host for good)."""
        d = self._d
        deadline, spins = None, 0
        while True:
            (err,) = d.cuStreamQuery(stream)
            if err == d.CUresult.CUDA_SUCCESS:
                return
            if err != d.CUresult.CUDA_ERROR_NOT_READY:
                _check((err,))
            spins += 1
            if deadline is None:
                deadline = time.monotonic() + self.timeout_s + 5.0
            elif spins > 1000:  # a long copy (a big output): stop spinning
                time.sleep(0.0001)
            if time.monotonic() > deadline:
                raise LoopKernelError(
                    f"{self._who()}{what} has not finished after {self.timeout_s + 5:.0f} s. With several loop kernels "
                    "on one GPU, a copy stream may share a hardware queue with a resident kernel: raise "
                    "CUDA_DEVICE_MAX_CONNECTIONS (e.g. to 32) before CUDA starts in this process"
                )

    def _destination(self, tensor_id: int) -> int:
        """The arena address tensor ``tensor_id`` is written at (whole buffers only)."""
        t = self.rp.tensors[tensor_id]
        if t.offset or t.strides != _contiguous(t.shape):
            raise LoopKernelError(f"cannot upload into the strided view {t.name!r}")
        return self.arena + self.rp.buffers[t.buffer].offset

    def _write(self, tensor_id: int, values: np.ndarray) -> None:
        self._use()
        at = self._destination(tensor_id)
        data = np.ascontiguousarray(values)
        _check(self._d.cuMemcpyHtoDAsync(at, data, data.nbytes, self._copies))
        self._sync(self._copies, f"writing {self.rp.tensors[tensor_id].name!r}")

    def _zero(self, tensor_id: int) -> None:
        """Zero bytes are 0 in every dtype: a state without an init needs no host array."""
        self._use()
        t = self.rp.tensors[tensor_id]
        n = nbytes_of(t.shape, t.dtype)
        if n:
            _check(self._d.cuMemsetD8Async(self._destination(tensor_id), 0, n, self._copies))
            self._sync(self._copies, f"zeroing {t.name!r}")

    def _put(self, gt: Any, value: Any, what: str, staging: Staging | None = None) -> None:
        """The value of graph tensor ``gt``: host data (converted, then copied up: piece by piece through
        ``staging`` when given) or a GPU array (copied device to device, no conversion)."""
        tensor_id = self.rp.tensor_of[gt]
        t = self.rp.tensors[tensor_id]
        src = device_source(value, t.dtype, t.shape, what, self.device, self.timeout_s)
        if src is None:
            if staging is None:
                self._write(tensor_id, coerce(value, gt, what))
                return
            self._use()
            upload(
                staging.put,
                self._destination(tensor_id),
                value,
                t.shape,
                t.dtype,
                what,
                staging.chunk_bytes,
                self._uploaded,
            )
            return
        at = self._destination(tensor_id)
        if src.nbytes:
            self._use()
            _check(self._d.cuMemcpyDtoDAsync(at, src.ptr, src.nbytes, self._copies))
            self._sync(self._copies, f"copying {what} from its GPU array")
            self._uploaded(src.nbytes)

    def _read(self, tensor_id: int) -> np.ndarray:
        self._use()
        t = self.rp.tensors[tensor_id]
        buf = self.rp.buffers[t.buffer]
        item = t.dtype.itemsize
        if is_contiguous(t.shape, t.strides):  # its own bytes straight into the array returned (not
            # the whole buffer, then once more on the host: a prefill's logits are 33 MB)
            raw = np.empty(math.prod(t.shape) * item, np.uint8)
            at = self.arena + buf.offset + t.offset * item
            _check(self._d.cuMemcpyDtoHAsync(raw, at, raw.nbytes, self._copies))
            self._sync(self._copies, f"reading {t.name!r}")
            return raw.view(t.dtype.np).reshape(t.shape)
        raw = np.empty(buf.nbytes, np.uint8)
        _check(self._d.cuMemcpyDtoHAsync(raw, self.arena + buf.offset, buf.nbytes, self._copies))
        self._sync(self._copies, f"reading {t.name!r}")
        return np.array(
            np.ndarray(
                t.shape, t.dtype.np, buffer=raw, offset=t.offset * item, strides=tuple(s * item for s in t.strides)
            ),
            copy=True,
        )

    def _load_host_values(self, params: Mapping[str, Any], state: Mapping[str, Any]) -> None:
        """Parameters and given state through pinned staging buffers (nothing else is running yet), the
        rest of the state from its init, or zeroed on the GPU."""
        g = self.rp.graph
        missing = [k for k in g.parameters if k not in params]
        unknown = [k for k in params if k not in g.parameters]
        if missing or unknown:
            raise EvaluationError(f"parameters missing {missing}, unknown {unknown}")
        unknown = [k for k in state if k not in g.states]
        if unknown:
            raise EvaluationError(f"unknown state {unknown}")
        values = [(t, params[n], f"parameter {n!r}") for n, t in g.parameters.items()]
        values += [(t, state[n], f"state {n!r}") for n, t in g.states.items() if n in state]
        self._upload_total = sum(nbytes_of(t.shape, t.dtype) for t, _, _ in values)
        self._upload_done = 0
        self._report("upload", 0, self._upload_total)
        if values:
            staging = Staging(
                self._d, self._copies, _check, min(CHUNK_BYTES, max(self._upload_total, 8)), self.timeout_s
            )
            try:
                for t, value, what in values:
                    self._put(t, value, what, staging)
                staging.finish()
            finally:
                staging.close()
        for q, p in enumerate(self.plan.programs):  # each program's constants: its own bytes
            self._select(q)
            for t in p.ranks[self.rank].graph.constants:
                self._write(self.rp.tensor_of[t], t.node.attrs["value"])
        self._select(0)
        self._initial_state(exclude=set(state))

    def _select(self, program: int) -> None:  # the program whose tensors rp names from now on
        self.rp = self.plan.programs[program].ranks[self.rank]

    def _uploaded(self, nbytes: int) -> None:
        self._upload_done = getattr(self, "_upload_done", 0) + nbytes
        if self._upload_done <= getattr(self, "_upload_total", 0):
            self._report("upload", self._upload_done, self._upload_total)

    def _initial_state(self, exclude: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        for name, t in self.rp.graph.states.items():
            if name in exclude:
                continue
            if "init" in t.node.attrs:
                self._write(self.rp.tensor_of[t], t.node.attrs["init"])
            else:
                self._zero(self.rp.tensor_of[t])

    def set_state(self, state: Mapping[str, Any], *, all_states: bool = False) -> None:
        """Overwrite state buffers (between runs); with ``all_states``, the others get their init."""
        g = self.rp.graph
        unknown = [k for k in state if k not in g.states]
        if unknown:
            raise EvaluationError(f"unknown state {unknown}")
        for name, t in g.states.items():
            if name in state:
                self._put(t, state[name], f"state {name!r}")
        if all_states:
            self._initial_state(exclude=set(state))

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
        resident.register(
            self, resident.Resident(self.device, self.program.processors, self._what(), self._group, time.monotonic())
        )

    def run(self, inputs: Mapping[str, Any] | None = None, iterations: int = 1, program: int | str = 0) -> dict:
        """Write ``inputs``, run ``iterations`` iterations of ``program``, return the last one's outputs."""
        self.start(0, program)  # (waits for another program's iterations, then names this one's tensors)
        self._stage_inputs(inputs, iterations)
        self.start(iterations, program)
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

    def start(self, iterations: int, program: int | str = 0) -> None:
        """Ring the doorbell for ``iterations`` more iterations of ``program`` (``plan.programs``, by
        index or name; returns at once, but first waits for the iterations asked for before if they
        were another program's)."""
        if not self._launched:
            raise LoopKernelError("the loop kernel is not running (stopped, or it failed earlier)")
        try:
            index = program_index(self.plan, program)
        except KeyError as e:
            raise EvaluationError(f"{self._who()}{e.args[0]}") from None
        if index != self._program:
            if not self.finished():  # the blocks take a new program only once all finished the old
                self.wait()
            self._program = index
            self._select(index)
            self.control[PROGRAM] = index  # (before requested: block 0 reads them in that order)
        if iterations <= 0:
            return
        self._requested += iterations
        self.control[REQUESTED] = self._requested

    def wait(self) -> None:
        """Until the kernel finished what was asked, or raise what it reported."""
        if self.control is None:
            raise LoopKernelError("the loop kernel has been stopped and its memory freed")
        for _ in range(64):  # a short run: spin on one word first, the clock and the minimum later
            if self.finished():
                break
        else:
            self._wait_long()
        if int(self.control[ERROR]):
            self._raise_kernel_error()

    def _wait_long(self) -> None:
        deadline = time.monotonic() + self.timeout_s + 5.0
        last = self.completed()
        spins = 0
        while not self.finished():
            spins += 1
            if spins & 15:
                continue
            if int(self.control[ERROR]):
                self._raise_kernel_error()
            now = self.completed()
            if now != last:
                last, deadline = now, time.monotonic() + self.timeout_s + 5.0
            if time.monotonic() > deadline:
                self._no_progress()
            if spins > 1000:
                time.sleep(0.0002)

    def _no_progress(self) -> None:
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

    def finished(self) -> bool:
        """Whether every block finished what was asked. Polls the block that finished last the previous
        time (one word) and takes the minimum over all blocks only once it is there: a minimum over 132
        words is a few us of Python a poll. With KernelOptions.completion_word: the one word the last block writes."""
        if self._completion_word:
            return int(self.control[DONE]) >= self._requested
        if int(self.progress[self._slowest]) < self._requested:
            return False
        if self.completed() >= self._requested:
            return True
        self._slowest = int(self.progress.argmin())
        return False

    def completed(self) -> int:
        """Iterations every block has finished."""
        least = int(self.progress.min())
        return max(least, int(self.control[DONE])) if self._completion_word else least

    def _raise_kernel_error(self) -> None:
        code = int(self.control[ERROR])
        info = [int(np.int64(np.uint64(v))) for v in self.control[INFO : INFO + 8]]
        self._halt()  # every block leaves (a block stuck in a task is reported by stop())
        ran = self.plan.programs[self._program]
        raise kernel_error(ran, self.rank, self.timeout_s, code, info, getattr(self, "_devices", None))

    def state(self, names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """The states' values (``names``: only those, e.g. to leave the KV caches on the GPU)."""
        g = self.rp.graph
        unknown = sorted(set(names or ()) - set(g.states))
        if unknown:
            raise EvaluationError(f"no state named {unknown}; the states are {sorted(g.states)}")
        return {n: self._read(self.rp.tensor_of[g.states[n]]) for n in (g.states if names is None else names)}

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
        """(iterations, tasks, 2) globaltimer start/end of each task for the first profiled iterations
        (several programs: by task id of the program each iteration ran, the most tasks of any)."""
        return self._stamps(0, self._n_tasks)

    def grant_ns(self) -> np.ndarray:
        """(iterations, processors, STAMP_WORDS) round-trip stamps of each block, first profiled iterations
        (megaloop/runtime/stamps.py STAMP_FIELDS; 0: not stamped); KernelOptions(round_trip_stamps=1) only."""
        if not self.plan.options.round_trip_stamps:
            raise LoopKernelError("grant_ns: the plan was made without KernelOptions(round_trip_stamps=1)")
        return self._stamps(2 * self._n_tasks, self.plan.processors, STAMP_WORDS)

    def _stamps(self, first: int, count: int, words: int = 2) -> np.ndarray:
        iterations = self.profile_iterations
        out = np.zeros(words * count * iterations, np.uint64)
        self._use()
        if out.size:
            _check(self._d.cuMemcpyDtoH(out, self.profile + 8 * first * iterations, out.nbytes))
        return out.reshape(iterations, count, words)

    def _halt(self) -> bool:
        """Make every block leave: the stop word first (idle blocks), then the abort flag (blocks in a
        wait). False when the kernel is still running after that: a task itself is stuck."""
        self._use()
        d = self._d
        self._launched = False
        self.control[STOP] = 1
        if not self._left(self.timeout_s + 5.0):
            one = np.ones(1, np.uint64)
            _check(d.cuMemcpyHtoDAsync(self.flags, one, 8, self._copies))
            self._sync(self._copies, "raising the abort flag")
            if not self._left(5.0):
                self._stuck = True
                resident.mark_stuck(self)  # its GPU stays refused: nothing can be loaded there now
                return False
        resident.unregister(self)
        return True

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
        """Tell the kernel to leave, wait for it, free everything (the GPU is then free for another)."""
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
        """Free everything, once no loop kernel runs on this GPU or in this kernel's group (cuMemFree
        would block meanwhile, or free memory a peer still reads): now, or when the last one leaves."""
        if getattr(self, "_d", None) is None:
            return  # never set up
        resident.free_when_idle(self.device, self._group, self._free_now)

    def _free_now(self) -> None:
        self._use()
        d = self._d
        for ptr in self._allocations:
            d.cuMemFree(ptr)
        self._allocations.clear()
        if getattr(self, "_control_host", 0):
            self.control = self.progress = None  # views of the pinned page: gone with it
            d.cuMemFreeHost(self._control_host)
            self._control_host = 0
        streams = ("_stream",) if self._lent_copies else ("_stream", "_copies")
        for s in streams:
            if getattr(self, s, None) is not None:
                d.cuStreamDestroy(getattr(self, s))
                setattr(self, s, None)
        if getattr(self, "_module", None) is not None:
            d.cuModuleUnload(self._module)
            self._module = None

    def __del__(self) -> None:
        """A kernel dropped while running is stopped (and its memory freed once its GPU is idle)."""
        if not getattr(self, "_launched", False) or sys.is_finalizing():
            return
        try:
            self.stop()
        except Exception:  # nowhere to report it; the registry keeps a stuck kernel's GPU refused
            pass

    def __enter__(self) -> LoopKernel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    from megaloop.frontend.shapes import contiguous_strides

    return contiguous_strides(shape)

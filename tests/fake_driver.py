"""A stand-in for cuda.bindings.driver, for CPU tests of the runtime's host code (LoopKernel,
LoopKernelGroup, staged uploads, the registry): device memory is bytes in a dict, every copy is done
at once, and a launched loop kernel is a thread that reports every iteration asked for as done
(it computes nothing) until the stop word or the abort flag is set.

It enforces what the real driver does to a resident loop kernel, as measured on an H200 (docs/
runtime.md): loading a module, or freeing memory, on a GPU where a loop kernel is resident blocks
forever there; here it raises ``WouldHang`` so that a test fails instead. Nothing here says the real
driver behaves so in every other respect: the GPU tests check that.
"""

from __future__ import annotations

import ctypes
import enum
import threading
import time
from types import SimpleNamespace

import numpy as np

from megaloop.runtime.loop import ARGS_DTYPE, CONTROL_WORDS, DONE, REQUESTED, STOP


class WouldHang(AssertionError):
    """The real driver would block here for as long as a loop kernel is resident."""


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_NOT_READY = 600
    CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704
    CUDA_ERROR_INVALID_IMAGE = 200
    CUDA_ERROR_NO_BINARY_FOR_GPU = 209


OK = CUresult.CUDA_SUCCESS
CU_MEMHOSTALLOC_PORTABLE, CU_MEMHOSTALLOC_DEVICEMAP = 1, 2
CUdevice_attribute = SimpleNamespace(
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR="major",
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR="minor",
    CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT="sms",
    CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN="optin",
)
CUfunction_attribute = SimpleNamespace(
    CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES="static", CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES="dynamic"
)
CUstream_flags = SimpleNamespace(CU_STREAM_NON_BLOCKING=1)
CUevent_flags = SimpleNamespace(CU_EVENT_DISABLE_TIMING=2)
CUdevice_P2PAttribute = SimpleNamespace(CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED="atomic")


class FakeDriver:
    """One per test: ``gpus`` SMs each, ``blocks_per_sm`` for every kernel (the occupancy answer)."""

    def __init__(self, gpus: int = 1, sms: int = 132, blocks_per_sm: int = 1) -> None:
        self.gpus, self.sms, self.blocks_per_sm = gpus, sms, blocks_per_sm
        self.memory: dict[int, bytearray] = {}  # device allocations by base address
        self.host: dict[int, ctypes.Array] = {}  # pinned host allocations by address
        self.kernels: list[SimpleNamespace] = []  # launches
        self.current: int | None = None  # the device of the current context
        self.loads: list[int] = []  # devices modules were loaded on, in order
        self.peer_access: set[tuple[int, int]] = set()
        self.refuse_images = 0  # cuModuleLoadData answers CUDA_ERROR_INVALID_IMAGE this many times
        self._next = 0x7000_0000_0000
        self._lock = threading.Lock()
        for name in ("CUresult", "CUdevice_attribute", "CUfunction_attribute", "CUstream_flags", "CUevent_flags"):
            setattr(self, name, globals()[name])
        self.CUdevice_P2PAttribute = CUdevice_P2PAttribute
        self.CU_MEMHOSTALLOC_PORTABLE, self.CU_MEMHOSTALLOC_DEVICEMAP = 1, 2

    # ---- what is resident ----------------------------------------------------------------------------
    def resident(self, device: int) -> list[SimpleNamespace]:
        return [k for k in self.kernels if k.device == device and not k.left.is_set()]

    def _blocked(self, what: str) -> None:
        if self.current is not None and self.resident(self.current):
            raise WouldHang(f"{what} on GPU {self.current} while a loop kernel is resident there")

    # ---- devices and contexts ------------------------------------------------------------------------
    def cuInit(self, flags):
        return (OK,)

    def cuDeviceGetCount(self):
        return OK, self.gpus

    def cuDeviceGet(self, i):
        return OK, i

    def cuDeviceGetName(self, n, dev):
        return OK, b"Fake H200\0"

    def cuDeviceGetAttribute(self, attr, dev):
        return OK, {"major": 8, "minor": 0, "sms": self.sms, "optin": 232448}[attr]  # sm_80: quick compiles

    def cuDeviceTotalMem(self, dev):
        return OK, 141 << 30

    def cuGetErrorName(self, err):
        return OK, CUresult(err).name.encode()

    def cuDevicePrimaryCtxRetain(self, dev):
        return OK, ("ctx", dev)

    def cuDevicePrimaryCtxRelease(self, dev):
        return (OK,)

    def cuCtxSetCurrent(self, ctx):
        self.current = ctx[1]
        return (OK,)

    def cuDeviceCanAccessPeer(self, a, b):
        return OK, int(a != b)

    def cuDeviceGetP2PAttribute(self, attr, a, b):
        return OK, 1

    def cuCtxEnablePeerAccess(self, ctx, flags):
        if ctx[1] == self.current:
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        pair = (self.current, ctx[1])
        if pair in self.peer_access:
            return (CUresult.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED,)
        self.peer_access.add(pair)
        return (OK,)

    # ---- modules and functions -----------------------------------------------------------------------
    def cuModuleLoadData(self, image):
        self._blocked("cuModuleLoadData")
        if self.refuse_images:
            self.refuse_images -= 1
            return CUresult.CUDA_ERROR_INVALID_IMAGE, None
        assert bytes(image[:4]) == b"\x7fELF"
        self.loads.append(self.current)
        return OK, SimpleNamespace(device=self.current, unloaded=False)

    def cuModuleUnload(self, module):
        self._blocked("cuModuleUnload")
        module.unloaded = True
        return (OK,)

    def cuModuleGetFunction(self, module, name):
        return OK, SimpleNamespace(module=module, name=name)

    def cuFuncGetAttribute(self, attr, function):
        return OK, 0

    def cuFuncSetAttribute(self, function, attr, value):
        return (OK,)

    def cuOccupancyMaxActiveBlocksPerMultiprocessor(self, function, threads, shared):
        return OK, self.blocks_per_sm

    # ---- memory --------------------------------------------------------------------------------------
    def cuMemAlloc(self, n):
        with self._lock:  # the kernels' threads read the memory meanwhile
            address = self._next
            self._next += (int(n) + 0xFFFF) & ~0xFFFF
            self.memory[address] = bytearray(int(n))
        return OK, address

    def cuMemFree(self, address):
        self._blocked("cuMemFree")
        with self._lock:
            del self.memory[int(address)]
        return (OK,)

    def cuMemHostAlloc(self, n, flags):
        buf = (ctypes.c_uint8 * int(n))()
        self.host[ctypes.addressof(buf)] = buf
        return OK, ctypes.addressof(buf)

    def cuMemHostGetDevicePointer(self, address, flags):
        return OK, address  # unified addressing: the same address

    def cuMemFreeHost(self, address):
        self._blocked("cuMemFreeHost")
        del self.host[int(address)]
        return (OK,)

    def _device(self, address: int, n: int) -> tuple[bytearray, int]:
        with self._lock:
            allocations = list(self.memory.items())
        for base, buf in allocations:
            if base <= address and address + n <= base + len(buf):
                return buf, address - base
        raise AssertionError(f"{n} bytes at {address:#x} are not in any allocation (out of bounds)")

    def read(self, address: int, n: int) -> bytes:
        buf, at = self._device(int(address), n)
        return bytes(buf[at : at + n])

    def _host_bytes(self, src, n: int) -> bytes:
        if isinstance(src, int):
            return ctypes.string_at(src, n)
        return np.ascontiguousarray(src).view(np.uint8).reshape(-1)[:n].tobytes()

    def cuMemcpyHtoDAsync(self, dst, src, n, stream):
        buf, at = self._device(int(dst), int(n))
        buf[at : at + n] = self._host_bytes(src, int(n))
        return (OK,)

    def cuMemcpyDtoHAsync(self, dst, src, n, stream):
        data = self.read(int(src), int(n))
        if isinstance(dst, int):
            ctypes.memmove(dst, data, n)
        else:
            dst.view(np.uint8).reshape(-1)[:n] = np.frombuffer(data, np.uint8)
        return (OK,)

    def cuMemcpyDtoH(self, dst, src, n):
        return self.cuMemcpyDtoHAsync(dst, src, n, None)

    def cuMemcpyDtoDAsync(self, dst, src, n, stream):
        data = self.read(int(src), int(n))
        buf, at = self._device(int(dst), int(n))
        buf[at : at + n] = data
        return (OK,)

    def cuMemsetD8Async(self, dst, value, n, stream):
        buf, at = self._device(int(dst), int(n))
        buf[at : at + n] = bytes([value]) * n
        return (OK,)

    # ---- streams, events, launches -------------------------------------------------------------------
    def cuStreamCreate(self, flags):
        return OK, SimpleNamespace(device=self.current, destroyed=False)

    def cuStreamDestroy(self, stream):
        self._blocked("cuStreamDestroy")
        stream.destroyed = True
        return (OK,)

    def cuStreamQuery(self, stream):
        busy = any(k.stream is stream and not k.left.is_set() for k in self.kernels)
        return (CUresult.CUDA_ERROR_NOT_READY if busy else OK,)

    def cuEventCreate(self, flags):
        return OK, SimpleNamespace()

    def cuEventRecord(self, event, stream):
        return (OK,)

    def cuEventQuery(self, event):
        return (OK,)

    def cuEventDestroy(self, event):
        return (OK,)

    def cuLaunchKernel(self, function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        (args_address,), _ = params
        args = np.frombuffer(self.read(int(args_address), ARGS_DTYPE.itemsize), ARGS_DTYPE)[0]
        assert not function.module.unloaded and function.module.device == self.current == stream.device
        k = SimpleNamespace(
            device=self.current, stream=stream, blocks=gx, args=args, left=threading.Event(), module=function.module
        )
        self.kernels.append(k)
        threading.Thread(target=self._run, args=(k,), daemon=True).start()
        return (OK,)

    def _run(self, k: SimpleNamespace) -> None:
        """Report every iteration asked for as done, until stop (or the abort flag) is set."""
        words = CONTROL_WORDS + k.blocks
        control = np.ctypeslib.as_array((ctypes.c_uint64 * words).from_address(int(k.args["control"])))
        try:
            while not (control[STOP] or self.read(int(k.args["abort"]), 8) != bytes(8)):
                control[CONTROL_WORDS:] = control[DONE] = control[REQUESTED]
                time.sleep(0.0005)
        finally:  # a fault in the fake itself ends the kernel too (the test then fails on what it checks)
            k.left.set()


def install(monkeypatch, fake: FakeDriver) -> FakeDriver:
    """Make ``from cuda.bindings import driver`` give ``fake`` for the rest of the test."""
    import sys

    import cuda.bindings
    import cuda.core  # binds the real driver when first imported: NVRTC keeps compiling

    monkeypatch.setattr(cuda.bindings, "driver", fake, raising=False)
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", fake)
    return fake

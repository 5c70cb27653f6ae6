"""Loop-kernel memory shared with other GPU libraries, without copies through the host.

``DeviceView`` describes a tensor in the kernel's arena with the CUDA Array Interface (version 3),
which torch (``torch.as_tensor``), CuPy and Numba read without copying; ``as_torch`` makes the torch
tensor (bfloat16 travels as uint16, which the interface can name, and is viewed back).
``device_source`` recognises GPU arrays handed in (torch CUDA tensors, anything with the interface)
so that the runtime copies them device to device.

A view does not own its memory: it is valid until the LoopKernel stops.

While a loop kernel is resident it holds every SM (one block per SM, all registers), so a torch
*kernel* queued meanwhile (an argmax, a cast, arange on the GPU) cannot start until the loop kernel
stops. Copies still run (copy engines): host-to-device tensors, ``view.copy_(same-dtype tensor)``.
megaloop therefore waits for torch work on a deadline (``wait_for_torch``) and says this in the
error instead of hanging; compute GPU inputs before launching, or hand them over by copies. Never
call ``torch.cuda.synchronize()`` (a whole-device wait) while a loop kernel is resident.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from megaloop.dtypes import DType
from megaloop.errors import EvaluationError

TYPESTR = {"float32": "<f4", "float16": "<f2", "bfloat16": "<u2", "int32": "<i4", "int64": "<i8", "bool": "|b1"}


@dataclass
class DeviceView:
    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in bytes
    dtype: DType
    device: int
    owner: Any = None  # keeps the LoopKernel object alive while the view is

    @property
    def __cuda_array_interface__(self) -> dict:
        # stream None: the memory is ready (the kernel finished the iterations the host waited for)
        return {
            "shape": self.shape,
            "typestr": TYPESTR[self.dtype.name],
            "data": (self.ptr, False),
            "strides": self.strides,
            "version": 3,
            "stream": None,
        }


def as_torch(view: DeviceView):
    import torch

    t = torch.as_tensor(view, device=f"cuda:{view.device}")
    return t.view(torch.bfloat16) if view.dtype.name == "bfloat16" else t


@dataclass
class DeviceSource:
    ptr: int
    nbytes: int


def wait_for_torch(device: int, what: str, timeout_s: float) -> None:
    """Until the work queued on torch's current stream of ``device`` is done, or raise after
    ``timeout_s`` (never a blocking synchronize: see the module's note)."""
    import torch

    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(device))
    deadline = time.monotonic() + timeout_s
    while not done.query():
        if time.monotonic() > deadline:
            raise EvaluationError(
                f"{what}: the torch work producing it has not finished after {timeout_s:g} s. While a loop "
                "kernel is resident it holds every SM, so torch kernels queued meanwhile cannot run: compute "
                "GPU inputs before launching, or hand them over by copies (host tensors, same-dtype copy_)"
            )
        time.sleep(0.0001)


def _device_of(ptr: int) -> int | None:
    """The GPU a device pointer belongs to (None when the driver cannot tell, e.g. no driver)."""
    try:
        from cuda.bindings import driver

        attr = driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
        err, ordinal = driver.cuPointerGetAttribute(attr, ptr)
    except Exception:
        return None
    return int(ordinal) if err == driver.CUresult.CUDA_SUCCESS else None


def device_source(
    value: Any, dtype: DType, shape: tuple[int, ...], what: str, device: int, timeout_s: float = 10.0
) -> DeviceSource | None:
    """Where ``value`` lives if it is a GPU array (None for host data). It must already have the
    tensor's dtype and shape and be contiguous: a device copy converts nothing. Work queued on the
    producer's stream is waited for first."""
    if type(value).__module__.startswith("torch"):
        if not value.is_cuda:
            return None

        got = str(value.dtype).removeprefix("torch.")
        if got != dtype.name or tuple(value.shape) != shape or not value.is_contiguous():
            raise EvaluationError(
                f"{what}: a GPU tensor must already be a contiguous {dtype.name} tensor of shape {shape} "
                f"(got {got}, {tuple(value.shape)}, contiguous={value.is_contiguous()}); convert it first"
            )
        if value.device.index != device:
            raise EvaluationError(
                f"{what}: the tensor is on cuda:{value.device.index}; the loop kernel on cuda:{device}"
            )
        wait_for_torch(device, what, timeout_s)
        return DeviceSource(value.data_ptr(), value.numel() * value.element_size())
    cai = getattr(value, "__cuda_array_interface__", None)
    if cai is None:
        return None
    packed = [dtype.itemsize]
    for d in reversed(shape[1:]):
        packed.insert(0, packed[0] * d)
    contiguous = cai.get("strides") is None or tuple(cai["strides"]) == tuple(packed[-len(shape) :] if shape else ())
    if cai["typestr"] != TYPESTR[dtype.name] or tuple(cai["shape"]) != shape or not contiguous:
        raise EvaluationError(
            f"{what}: a GPU array must already be a contiguous {dtype.name} array of shape {shape} "
            f"(got typestr {cai['typestr']}, shape {tuple(cai['shape'])}, strides {cai.get('strides')})"
        )
    ptr = int(cai["data"][0])
    ordinal = _device_of(ptr)
    if ordinal is not None and ordinal != device:
        raise EvaluationError(f"{what}: the array is on GPU {ordinal}; the loop kernel on GPU {device}")
    stream = cai.get("stream")
    if stream:
        from cuda.bindings import driver

        (err,) = driver.cuStreamSynchronize(driver.CUstream(stream))
        if err != driver.CUresult.CUDA_SUCCESS:
            raise EvaluationError(f"{what}: waiting for the array's stream failed ({err.name})")
    n = 1
    for d in shape:
        n *= d
    return DeviceSource(ptr, n * dtype.itemsize)

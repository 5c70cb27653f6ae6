"""Loop-kernel memory shared with other GPU libraries, without copies through the host.

``DeviceView`` describes a tensor in the kernel's arena with the CUDA Array Interface (version 3),
which torch (``torch.as_tensor``), CuPy and Numba read without copying; ``as_torch`` makes the torch
tensor (bfloat16 travels as uint16, which the interface can name, and is viewed back).
``device_source`` recognises GPU arrays handed in (torch CUDA tensors, anything with the interface)
so that the runtime copies them device to device.

A view does not own its memory: it is valid until the LoopKernel stops. Never call
``torch.cuda.synchronize()`` (a whole-device wait) while a loop kernel is resident: it would wait for
the kernel, which only ends when stopped. Stream-level waits are fine, and are what megaloop uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megaloop.dtypes import DType
from megaloop.errors import EvaluationError

TYPESTR = {"float32": "<f4", "float16": "<f2", "bfloat16": "<u2", "int32": "<i4", "int64": "<i8", "bool": "|b1"}
TORCH_NAMES = {
    "float32": "float32",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "int32": "int32",
    "int64": "int64",
    "bool": "bool",
}


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


def device_source(value: Any, dtype: DType, shape: tuple[int, ...], what: str, device: int) -> DeviceSource | None:
    """Where ``value`` lives if it is a GPU array (None for host data). It must already have the
    tensor's dtype and shape and be contiguous: a device copy converts nothing. Work queued on the
    producer's stream is waited for first."""
    if type(value).__module__.startswith("torch"):
        if not value.is_cuda:
            return None
        import torch

        got = str(value.dtype).removeprefix("torch.")
        if got != TORCH_NAMES[dtype.name] or tuple(value.shape) != shape or not value.is_contiguous():
            raise EvaluationError(
                f"{what}: a GPU tensor must already be a contiguous {dtype.name} tensor of shape {shape} "
                f"(got {got}, {tuple(value.shape)}, contiguous={value.is_contiguous()}); convert it first"
            )
        if value.device.index != device:
            raise EvaluationError(
                f"{what}: the tensor is on cuda:{value.device.index}; the loop kernel on cuda:{device}"
            )
        torch.cuda.current_stream(value.device).synchronize()
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
    stream = cai.get("stream")
    if stream:
        from cuda.bindings import driver

        (err,) = driver.cuStreamSynchronize(driver.CUstream(stream))
        if err != driver.CUresult.CUDA_SUCCESS:
            raise EvaluationError(f"{what}: waiting for the array's stream failed ({err.name})")
    n = 1
    for d in shape:
        n *= d
    return DeviceSource(int(cai["data"][0]), n * dtype.itemsize)

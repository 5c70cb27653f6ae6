"""GPU arrays handed to the loop kernel and views of its memory handed out (the parts that need no
GPU: the CUDA Array Interface description and the checks on arrays coming in)."""

from __future__ import annotations

import pytest
import torch

import megaloop as ml
from megaloop.errors import EvaluationError
from megaloop.runtime.interop import DeviceView, device_source


class FakeGpuArray:
    def __init__(self, typestr: str, shape: tuple[int, ...], strides=None, ptr: int = 0x7F0000001000) -> None:
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": typestr,
            "data": (ptr, False),
            "strides": strides,
            "version": 3,
        }


def test_views_describe_the_arena_memory() -> None:
    view = DeviceView(0x1000, (2, 3), (2, 4), ml.bfloat16, device=0)
    cai = view.__cuda_array_interface__
    assert cai["data"] == (0x1000, False) and cai["shape"] == (2, 3) and cai["strides"] == (2, 4)
    assert cai["typestr"] == "<u2" and cai["version"] == 3  # bf16 travels as its bits
    assert DeviceView(0, (4,), (4,), ml.float32, 0).__cuda_array_interface__["typestr"] == "<f4"


def test_gpu_arrays_coming_in_are_checked() -> None:
    src = device_source(FakeGpuArray("<f2", (2, 3)), ml.float16, (2, 3), "input 'x'", 0)
    assert src is not None and src.ptr == 0x7F0000001000 and src.nbytes == 12
    same = device_source(FakeGpuArray("<f2", (2, 3), strides=(6, 2)), ml.float16, (2, 3), "input 'x'", 0)
    assert same is not None  # explicit C-contiguous strides are fine
    with pytest.raises(EvaluationError, match=r"input 'x': a GPU array must already be a contiguous float16"):
        device_source(FakeGpuArray("<f4", (2, 3)), ml.float16, (2, 3), "input 'x'", 0)
    with pytest.raises(EvaluationError, match="contiguous"):
        device_source(FakeGpuArray("<f2", (2, 3), strides=(2, 4)), ml.float16, (2, 3), "input 'x'", 0)
    with pytest.raises(EvaluationError, match=r"shape \(2, 3\)"):
        device_source(FakeGpuArray("<f2", (3, 2)), ml.float16, (2, 3), "input 'x'", 0)


def test_host_data_is_not_a_device_source() -> None:
    assert device_source(torch.zeros(2, 3), ml.float32, (2, 3), "x", 0) is None
    import numpy as np

    assert device_source(np.zeros((2, 3), np.float32), ml.float32, (2, 3), "x", 0) is None

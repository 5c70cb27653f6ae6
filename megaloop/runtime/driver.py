"""cuda-bindings driver calls as the runtime makes them: errors raised with their names, and a module
load that tells an image the driver refuses (rebuilt from source: megaloop/runtime/compile.py) from
other failures."""

from __future__ import annotations

from typing import Any

from megaloop.runtime.compile import CubinLoadError
from megaloop.runtime.report import LoopKernelError


def _check(result: Any) -> Any:
    """cuda-bindings calls return (err, *values): raise on error, return the values."""
    err, *values = result if isinstance(result, tuple) else (result,)
    from cuda.bindings import driver

    if err != driver.CUresult.CUDA_SUCCESS:
        raise LoopKernelError(f"CUDA driver error {_error_name(err)}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def _error_name(err: Any) -> str:
    from cuda.bindings import driver

    _, name = driver.cuGetErrorName(err)
    return name.decode() if isinstance(name, bytes) else str(name)


# cuModuleLoadData's answers that mean "this image is not loadable here": the cache entry is rebuilt
IMAGE_ERRORS = (
    "CUDA_ERROR_INVALID_IMAGE",
    "CUDA_ERROR_NO_BINARY_FOR_GPU",
    "CUDA_ERROR_INVALID_PTX",
    "CUDA_ERROR_UNSUPPORTED_PTX_VERSION",
    "CUDA_ERROR_INVALID_SOURCE",
    "CUDA_ERROR_SHARED_OBJECT_INIT_FAILED",
)


def load_module(cubin: bytes) -> Any:
    """cuModuleLoadData in the current context; CubinLoadError when the driver refuses the image."""
    from cuda.bindings import driver

    err, module = driver.cuModuleLoadData(cubin)
    if err == driver.CUresult.CUDA_SUCCESS:
        return module
    name = _error_name(err)
    if name in IMAGE_ERRORS:
        raise CubinLoadError(f"cuModuleLoadData: {name}")
    raise LoopKernelError(f"loading the loop kernel's module failed: CUDA driver error {name}")

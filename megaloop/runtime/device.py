"""Which NVIDIA GPUs this process can use, asked of the driver through cuda-bindings.

No GPU, no driver, or a driver too old for the bindings all mean "no GPU": callers fall back to
the CPU reference, and ``reason`` says why.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    compute_capability: tuple[int, int]
    sm_count: int
    memory_bytes: int

    @property
    def arch(self) -> str:
        """NVRTC target, with the 'a' suffix on sm_90 so that Hopper-only instructions are allowed."""
        major, minor = self.compute_capability
        return f"sm_{major}{minor}a" if (major, minor) == (9, 0) else f"sm_{major}{minor}"

    @property
    def plan_arch(self) -> str:
        """The planner's architecture for this GPU: the newest one megaloop has tile defaults for
        that this GPU can run (a newer GPU runs code for an older architecture)."""
        from megaloop.frontend.tiling import ARCHS

        cc = 10 * self.compute_capability[0] + self.compute_capability[1]
        usable = [a for a in ARCHS if int(a[3:]) <= cc]
        return usable[-1] if usable else ARCHS[0]


def gpus() -> tuple[list[GpuInfo], str]:
    """The visible GPUs, and a reason when there are none."""
    try:
        from cuda.bindings import driver
    except Exception as e:  # an install without cuda-bindings
        return [], f"cuda-bindings is not importable ({e})"
    try:
        (err,) = driver.cuInit(0)
    except Exception as e:  # no libcuda.so: no NVIDIA driver on this machine
        return [], f"no NVIDIA driver found ({type(e).__name__})"
    if err != driver.CUresult.CUDA_SUCCESS:
        return [], f"the NVIDIA driver did not initialise ({err.name})"
    err, count = driver.cuDeviceGetCount()
    if err != driver.CUresult.CUDA_SUCCESS or count == 0:
        return [], "the driver reports no GPU"
    out = []
    attr = driver.CUdevice_attribute
    for i in range(count):
        _, dev = driver.cuDeviceGet(i)
        _, raw = driver.cuDeviceGetName(64, dev)
        _, major = driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
        _, minor = driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
        _, sms = driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev)
        _, mem = driver.cuDeviceTotalMem(dev)
        name = raw.split(b"\0", 1)[0].decode(errors="replace")
        out.append(GpuInfo(i, name, (major, minor), sms, mem))
    return out, ""

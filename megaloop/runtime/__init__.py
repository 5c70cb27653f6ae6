"""Runtime: finding GPUs, NVRTC compilation with a disk cache (``compile``), the launch-once loop
kernel with its doorbell and watchdog (``loop.LoopKernel``), and per-task timelines (``trace``)."""

from megaloop.runtime.device import GpuInfo, gpus

__all__ = ["GpuInfo", "gpus"]

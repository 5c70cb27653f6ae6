"""Runtime: finding GPUs, NVRTC compilation with a checked disk cache (``compile``), the launch-once
loop kernel with its doorbell and watchdog (``loop.LoopKernel``), all ranks of a plan from one process
(``group.LoopKernelGroup``: on GPUs of their own or sharing one), what is resident where
(``resident``), uploads through pinned staging (``upload``), and per-task timelines (``trace``)."""

from megaloop.runtime.device import GpuInfo, gpus

__all__ = ["GpuInfo", "gpus"]

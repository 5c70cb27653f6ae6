"""Runtime: finding GPUs today; next, NVRTC compilation with a disk cache, the device arena, the
launch-once loop kernel with its doorbell, the watchdog and peer memory."""

from megaloop.runtime.device import GpuInfo, gpus

__all__ = ["GpuInfo", "gpus"]

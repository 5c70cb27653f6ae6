"""Shared benchmark plumbing: device events timing with warm-up and medians, fresh random inputs, and
results written as JSON with the device, the commit and the date."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


def commit() -> str:
    """MEGALOOP_COMMIT when set (the GPU machine's copy of the tree carries no trustworthy git
    metadata: a run there once recorded an older commit than the code it ran), else git's HEAD."""
    if os.environ.get("MEGALOOP_COMMIT"):
        return os.environ["MEGALOOP_COMMIT"]
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            check=True,
        ).stdout.strip()
    except Exception:
        return "unknown"


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def matmul_tiles() -> dict[str, dict[str, int]]:
    """Matmul tile settings for a benchmark's plans: the architecture's defaults, overridden by
    MEGALOOP_BENCH_MATMUL="tensor_cores=0,skinny_mma=1,..." (so one GPU session compares paths without
    edits); the effective settings go into the results JSON."""
    from megaloop.frontend.ops._tilings import MATMUL

    settings = MATMUL.defaults("sm_90")
    for item in filter(None, os.environ.get("MEGALOOP_BENCH_MATMUL", "").split(",")):
        key, _, value = item.partition("=")
        if key.strip() not in settings:
            raise SystemExit(f"MEGALOOP_BENCH_MATMUL: unknown matmul tile setting {key!r}; known: {sorted(settings)}")
        settings[key.strip()] = int(value)
    return {"matmul": settings}


def time_torch(fn, warmup: int = 5, repeat: int = 30) -> float:
    """Median seconds of ``fn()`` measured with CUDA events."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return float(np.median(times))


def cuda_graph(fn, warmup: int = 3):
    """``fn`` captured in a CUDA graph (after ``warmup`` calls on a side stream, as capture needs);
    time ``graph.replay`` to measure it without launch overhead."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def resident_seconds(kernel, iterations: int, repeats: int = 5) -> float:
    """Median seconds per iteration of a resident loop kernel (a LoopKernel or LoopKernelGroup):
    ``iterations`` iterations per doorbell, wall time from the ring to the last block's report."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        kernel.start(iterations)
        kernel.wait()
        times.append((time.perf_counter() - t0) / iterations)
    return float(np.median(times))


def write(name: str, results: dict[str, Any], quiet: bool = False) -> Path:
    out = Path(os.environ.get("OUT", Path(__file__).parent / "results"))
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    payload = {
        "benchmark": name,
        "device": device_name(),
        "commit": commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **results,
    }
    path.write_text(json.dumps(payload, indent=1))
    if not quiet:
        print(json.dumps(payload, indent=1))
    return path


def torchrun_result(script: str, world: int, timeout: float) -> dict:
    """Run bench/<script> under torchrun (one process per GPU) and return the JSON of its last
    "RESULT " line; the result is read even when the run is killed at the timeout (a hang at NCCL
    shutdown once lost it). Raises RuntimeError with the output's tail when there is no result."""
    path = Path(__file__).with_name(script)
    root = str(path.parent.parent)  # the scripts import bench.common
    pythonpath = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": pythonpath, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), str(path)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        stdout, stderr = done.stdout, done.stderr
    except subprocess.TimeoutExpired as e:
        stdout, stderr = (v.decode() if isinstance(v, bytes) else v or "" for v in (e.stdout, e.stderr))
    results = [line[len("RESULT ") :] for line in stdout.splitlines() if line.startswith("RESULT ")]
    if not results:
        raise RuntimeError(f"{script} gave no result:\n{stdout[-2000:]}\n{stderr[-2000:]}")
    return json.loads(results[-1])

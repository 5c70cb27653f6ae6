"""Faults on the GPU (skipped without one): compile-cache entries cut short or refused by the driver,
a second kernel while one is resident, a kernel left running at exit or dropped, a process killed
while compiling, a watchdog that fired followed by 100 more kernels (device memory flat), 10,000
runs with fresh inputs (memory flat, results checked every 100th), and parameters uploaded from a
memory-mapped file (timed against one plain copy). Cases that could crash or hang the process run
in a process of their own (tests/gpu_fault_cases.py). The host logic of each has a CPU test in
tests/test_runtime_host.py or tests/test_runtime_fake_gpu.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import megaloop as ml
from megaloop.codegen import generate
from megaloop.plan import make_plan
from megaloop.runtime.device import gpus
from tests.gpu_fault_cases import check_run, kernel, tiny

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpus()[0], reason="no GPU: " + gpus()[1])]
ROOT = Path(__file__).resolve().parent.parent


def run_case(name: str, cache: Path, timeout: float = 120.0) -> subprocess.CompletedProcess:
    """tests/gpu_fault_cases.py CASE in a fresh process with its own cache; a crash or a hang fails here."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "tests.gpu_fault_cases", name, str(cache)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{name} hung for {timeout:.0f} s:\n{(e.stdout or '')[-2000:]}") from None
    print(done.stdout)
    assert done.returncode == 0, f"{name} exited with {done.returncode}:\n{done.stdout[-2000:]}{done.stderr[-3000:]}"
    return done


def test_a_truncated_cache_entry_is_rebuilt_in_a_process_that_ran_a_kernel(tmp_path) -> None:
    assert "OK truncated entry" in run_case("truncated_entry", tmp_path).stdout


def test_an_entry_the_driver_refuses_is_rebuilt_then_named(tmp_path) -> None:
    out = run_case("refused_entry", tmp_path).stdout
    assert "OK an entry the driver refused was rebuilt" in out and "OK refused twice" in out
    assert "OK the GPU is usable afterwards" in out


def test_a_second_kernel_while_one_is_resident_is_refused_at_once(tmp_path) -> None:
    out = run_case("second_kernel", tmp_path).stdout
    assert "OK refused after" in out and "OK the second kernel runs" in out


def test_a_kernel_left_running_is_stopped_at_exit(tmp_path) -> None:
    start = time.monotonic()
    out = run_case("left_running", tmp_path, timeout=90).stdout
    took = time.monotonic() - start
    assert "OK exiting with the kernel resident" in out
    print(f"the process with a resident kernel exited {took:.1f} s after it started")
    g, params = tiny("after-exit")
    with kernel(g, params) as k:  # and the GPU is free
        check_run(k, g, params)


def test_a_dropped_kernel_is_stopped_when_collected(tmp_path) -> None:
    assert "OK collected" in run_case("dropped", tmp_path).stdout


def test_a_process_killed_while_compiling_leaves_the_cache_valid(tmp_path, monkeypatch) -> None:
    """SIGKILL half way through writing the entry; then a kernel of that source compiles afresh,
    stores a valid entry and runs."""
    from megaloop.runtime import compile as cc
    from tests.test_runtime_host import KILLED

    monkeypatch.setenv("MEGALOOP_CACHE", str(tmp_path))
    g, params = tiny("killed", 320)
    source = generate(make_plan(g, processors=4)).source
    (tmp_path / "k.cu").write_text(source)
    arch = gpus()[0][0].arch
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-c", KILLED, str(tmp_path), "write", str(tmp_path / "k.cu"), arch]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    assert proc.stdout.readline().strip() == "READY"
    proc.kill()
    proc.wait(timeout=60)
    assert cc.cache_entry(source, arch) is None and list((tmp_path / "cubin").glob(".*.tmp"))
    with kernel(g, params) as k:
        check_run(k, g, params)
    entry = cc.cache_entry(source, arch)
    assert entry is not None and cc.entry_problem(entry.name, entry.read_bytes()) is None


def device_free() -> int:
    from cuda.bindings import driver

    err, free, _ = driver.cuMemGetInfo()
    assert err == driver.CUresult.CUDA_SUCCESS, err
    return int(free)


def host_resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_watchdog_then_a_hundred_kernels_leak_nothing() -> None:
    from megaloop.runtime import resident
    from megaloop.runtime.loop import LoopKernel, LoopKernelError

    g = ml.Graph("watchdog-leak")  # two matmuls: the second waits on the first's tiles
    x = g.input("x", (8, 256), ml.float32)
    w = g.parameter("w", (256, 256), ml.float32)
    g.output("y", ml.matmul(ml.exp(ml.matmul(x, w) * 0.01), w))
    params = {"w": np.random.default_rng(7).standard_normal((256, 256)).astype(np.float32)}
    plan = make_plan(g, processors=4)
    program = generate(plan)
    first = int(np.flatnonzero(program.waits["lag"] == 0)[0])
    program.waits["per_iteration"][first] = 1_000_000  # a target no counter reaches
    with pytest.raises(LoopKernelError, match=r"watchdog: rank 0 processor \d+ waited more than 0.5 s"):
        with LoopKernel(plan, params, timeout_s=0.5, program=program) as k:
            k.run({"x": np.ones((8, 256))})
    assert not resident.resident()
    samples = []
    start = time.monotonic()
    for i in range(100):
        with LoopKernel(plan, params) as k:
            xs = np.random.default_rng(i).standard_normal((8, 256)).astype(np.float32)
            got = k.run({"x": xs})["y"]
            w64 = params["w"].astype(np.float64)
            h = np.exp(xs.astype(np.float64) @ w64 * 0.01)
            bound = 4 * 256 * np.finfo(np.float32).eps * (np.abs(h) @ np.abs(w64))  # two length-256 dots
            worst = float(np.max(np.abs(got - h @ w64) / bound))
            assert worst <= 1, f"kernel {i}: error {worst:.2f} of the float32 bound"
        if i in (4, 99):
            samples.append((device_free(), host_resident()))
    (free0, rss0), (free1, rss1) = samples
    took = time.monotonic() - start
    print(
        f"100 kernels after a watchdog: {took:.1f} s; device free {free0 >> 20} -> {free1 >> 20} MiB, host "
        f"resident {rss0 >> 20} -> {rss1 >> 20} MiB"
    )
    assert abs(free1 - free0) <= 4 << 20, f"device memory went from {free0} to {free1} bytes free"
    assert rss1 - rss0 <= 64 << 20, f"host memory grew by {(rss1 - rss0) >> 20} MiB over 95 kernels"
    assert not resident.resident()


def test_ten_thousand_runs_keep_memory_flat() -> None:
    """Fresh random inputs every run, the result checked every 100th against numpy (one float32
    product: bitwise), device and host memory the same at run 10,000 as at run 100."""
    g, params = tiny("ten-thousand")
    rng = np.random.default_rng(0)
    w = params["w"].astype(np.float32)
    with kernel(g, params) as k:
        start = time.monotonic()
        for i in range(10_000):
            x = rng.standard_normal(256).astype(np.float32)
            y = k.run({"x": x})["y"]
            if i % 100 == 99:
                assert np.array_equal(y, x * w), f"run {i}: wrong result"
            if i == 99:
                free0, rss0 = device_free(), host_resident()
        took = time.monotonic() - start
        free1, rss1 = device_free(), host_resident()
    print(
        f"10,000 runs: {took:.2f} s ({took * 100:.1f} us a run); device free {free0 >> 20} -> {free1 >> 20} "
        f"MiB, host resident {rss0 >> 20} -> {rss1 >> 20} MiB"
    )
    assert free1 == free0, f"device memory went from {free0} to {free1} bytes free"
    assert rss1 - rss0 <= 16 << 20, f"host memory grew by {(rss1 - rss0) >> 20} MiB over 9,900 runs"


def test_parameters_from_a_memory_map_reach_the_gpu_whole(tmp_path) -> None:
    """1 GiB of bfloat16 weights memory-mapped from a file, uploaded through the staging buffers with
    a progress callback: the arena holds the file's bytes. Timed with the file's pages cached and
    dropped, beside one plain cuMemcpyHtoD of the mapped pages (the numbers are printed)."""
    from cuda.bindings import driver

    from megaloop.runtime.compile import compile_cubin
    from megaloop.runtime.loop import LoopKernel, _check

    rows, cols = 1 << 15, 1 << 14  # 2^29 elements, 1 GiB
    path = tmp_path / "w.bin"
    mapped = np.memmap(path, dtype=ml_dtypes.bfloat16, mode="w+", shape=(rows, cols))
    for i in range(0, rows, 4096):
        mapped[i : i + 4096] = np.random.default_rng(i).standard_normal((4096, cols), np.float32)
    mapped.flush()
    del mapped
    g = ml.Graph("memmap-upload")
    w = g.parameter("w", (rows, cols), ml.bfloat16)
    g.output("y", ml.sum(w[:8, :64], axis=-1))
    plan = make_plan(g, processors=8)
    compile_cubin(generate(plan).source, gpus()[0][0].arch)  # not in the times
    for cache in ("warm", "cold"):
        if cache == "cold":  # drop the file's pages from the page cache (clean, unmapped: no root needed)
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        mapped = np.memmap(path, dtype=ml_dtypes.bfloat16, mode="r", shape=(rows, cols))
        seen: list[tuple] = []
        start = time.perf_counter()
        with LoopKernel(plan, {"w": mapped}, progress=lambda *report, seen=seen: seen.append(report)) as k:
            took = time.perf_counter() - start
            tid = k.rp.tensor_of[g.parameters["w"]]
            assert np.array_equal(k._read(tid).view(np.uint16), np.asarray(mapped).view(np.uint16))
            out = k.run({})["y"]
        want = np.asarray(mapped[:8, :64], np.float32).sum(-1)
        np.testing.assert_allclose(out.astype(np.float32), want, rtol=2e-2, atol=1e-1)
        assert seen[-1] == ("upload", rows * cols * 2, rows * cols * 2)
        print(f"staged upload, pages {cache}: {took:.2f} s for 1 GiB ({1 / took:.2f} GiB/s, kernel setup included)")
        del mapped  # unmapped: its pages can be dropped
    mapped = np.memmap(path, dtype=ml_dtypes.bfloat16, mode="r", shape=(rows, cols))
    start = time.perf_counter()
    ptr = _check(driver.cuMemAlloc(rows * cols * 2))
    _check(driver.cuMemcpyHtoD(ptr, mapped, rows * cols * 2))
    took = time.perf_counter() - start
    _check(driver.cuMemFree(ptr))
    print(f"one cuMemcpyHtoD of the mapped pages (cached): {took:.2f} s ({1 / took:.2f} GiB/s)")

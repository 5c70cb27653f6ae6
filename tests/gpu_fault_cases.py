"""GPU fault cases run in a process of their own (tests/test_gpu_faults.py starts them), so that a
crash or a hang, the very faults they check for, fails one test instead of the whole session:

    python -m tests.gpu_fault_cases CASE CACHE_DIR

Each prints lines starting with "OK" (with its numbers) and exits 0, or raises.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

import megaloop as ml
from megaloop.plan import make_plan


def tiny(name: str, n: int = 256) -> tuple[ml.Graph, dict]:
    g = ml.Graph(name)
    x = g.input("x", (n,), ml.float32)
    w = g.parameter("w", (n,), ml.float32)
    g.output("y", x * w)  # one rounding: bitwise the reference
    return g, {"w": np.linspace(-2, 2, n)}


def check_run(k, g: ml.Graph, params: dict, seed: int = 0) -> None:
    x = np.random.default_rng(seed).standard_normal(g.inputs["x"].shape)
    got = k.run({"x": x})["y"]
    want = ml.evaluate(g, {"x": x}, params).outputs["y"]
    assert np.array_equal(got, want), f"{g.name}: the GPU's y differs from the reference"


def kernel(g: ml.Graph, params: dict, **kw):
    from megaloop.runtime.loop import LoopKernel

    return LoopKernel(make_plan(g, processors=4), params, **kw)


def entry_of(g: ml.Graph):
    from megaloop.codegen import generate
    from megaloop.runtime.compile import cache_entry
    from megaloop.runtime.device import gpus

    return cache_entry(generate(make_plan(g, processors=4)).source, gpus()[0][0].arch)


def truncated_entry() -> None:
    """In a process that already ran a kernel (where the driver once crashed on such an image), an
    entry cut short but still starting with the ELF magic is rebuilt, not loaded."""
    g, params = tiny("first")
    with kernel(g, params) as k:
        check_run(k, g, params)
    h, hp = tiny("truncated", 512)
    kernel(h, hp).stop()  # its entry is in the cache
    entry = entry_of(h)
    data = entry.read_bytes()
    entry.write_bytes(data[: len(data) * 2 // 3])
    assert entry.read_bytes()[:4] == b"\x7fELF"
    with kernel(h, hp) as k:
        check_run(k, h, hp)
    from megaloop.runtime.compile import entry_problem

    rebuilt = entry_of(h)
    assert rebuilt is not None and entry_problem(rebuilt.name, rebuilt.read_bytes()) is None, "rebuilt whole"
    print(f"OK truncated entry of {len(data)} bytes cut to {len(data) * 2 // 3}: rebuilt, kernel ran")


def refused_entry() -> None:
    """An entry whose name, length and hash are right but whose image the driver refuses (an sm_80
    cubin under this GPU's key) is rebuilt once; if the rebuilt one is refused too, the error names
    the entry and the GPU stays usable."""
    import megaloop.runtime.compile as cc
    from megaloop.codegen import generate
    from megaloop.runtime.device import gpus

    g, params = tiny("refused")
    source = generate(make_plan(g, processors=4)).source
    foreign = cc.compile_cubin(source, "sm_80", use_cache=False)
    key = cc.cache_key(source, gpus()[0][0].arch)
    cc.store_entry(key, foreign)
    with kernel(g, params) as k:
        check_run(k, g, params)
    print("OK an entry the driver refused was rebuilt")
    cc.store_entry(key, foreign)
    real = cc._nvrtc
    cc._nvrtc = lambda *a: foreign  # NVRTC now gives what the driver refuses
    try:
        kernel(g, params)
    except cc.CompileError as e:
        assert str(cc.cache_dir()) in str(e) and "refused again" in str(e), e
        print(f"OK refused twice: {str(e)[:200]}")
    else:
        raise AssertionError("a cubin refused twice was accepted")
    finally:
        cc._nvrtc = real
    with kernel(g, params) as k:  # usable: the entry was removed, a good one is built
        check_run(k, g, params)
    print("OK the GPU is usable afterwards")


def second_kernel() -> None:
    """A second LoopKernel while one is resident: refused at once, naming the first (it hung in
    cuModuleLoadData for more than 200 s); the first keeps working; after it stops the second runs."""
    from megaloop.runtime.resident import ResidencyError

    g, params = tiny("holder")
    h, hp = tiny("second", 128)
    kernel(h, hp).stop()  # compiled and cached: only the load is left
    with kernel(g, params) as first:
        check_run(first, g, params)
        start = time.monotonic()
        try:
            kernel(h, hp)
        except ResidencyError as e:
            took = time.monotonic() - start
            assert took < 2.0 and "graph 'holder'" in str(e), (took, e)
            print(f"OK refused after {took * 1000:.1f} ms: {str(e)[:160]}")
        else:
            raise AssertionError("a second kernel was made while one was resident")
        for seed in range(5):
            check_run(first, g, params, seed)
    with kernel(h, hp) as k:
        check_run(k, h, hp)
    print("OK the second kernel runs once the first stopped")


def left_running() -> None:
    """A kernel never stopped: the exit handler stops it, and the process exits (the parent times it)."""
    g, params = tiny("left-running")
    k = kernel(g, params)
    check_run(k, g, params)
    print("OK exiting with the kernel resident", flush=True)
    sys.stdout.flush()


def dropped() -> None:
    """A kernel dropped without stop() is stopped when collected; the GPU takes a new one at once."""
    import gc

    from megaloop.runtime import resident

    g, params = tiny("dropped")
    k = kernel(g, params)
    check_run(k, g, params)
    del k
    gc.collect()
    assert not resident.resident(), resident.resident()
    start = time.monotonic()
    with kernel(g, params) as k:
        check_run(k, g, params)
    print(f"OK collected; the next kernel started in {time.monotonic() - start:.2f} s")


CASES = {f.__name__: f for f in (truncated_entry, refused_entry, second_kernel, left_running, dropped)}

if __name__ == "__main__":
    os.environ["MEGALOOP_CACHE"] = sys.argv[2]
    CASES[sys.argv[1]]()

"""The runtime's host-side logic, without a GPU: the compile cache's validation (a corrupt entry never
reaches the driver; a refused one is rebuilt once, then named; a process killed while writing leaves
the cache valid), the resident-kernel registry (GPUs held, residency arithmetic, deferred frees, the
exit handler), parameter upload in pieces (views of a memory map, conversions as coerce does them,
bounded host memory), progress reports, and a group's device checks. The GPU runs of the same
mechanisms: tests/test_gpu_faults.py and tests/test_gpu_shared.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import megaloop as ml
from megaloop.codegen import generate
from megaloop.errors import EvaluationError
from megaloop.frontend.values import coerce
from megaloop.plan import make_plan
from megaloop.runtime import compile as cc
from megaloop.runtime import resident
from megaloop.runtime.upload import TqdmProgress, pieces, progress_callback, upload

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def source() -> str:
    g = ml.Graph("cache-test")
    x = g.input("x", (16,), ml.float32)
    g.output("y", x * 2.0 + 1.0)
    return generate(make_plan(g, processors=2)).source


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("MEGALOOP_CACHE", str(tmp_path))
    return tmp_path / "cubin"


def entries(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.cubin"))


# ---- the compile cache ---------------------------------------------------------------------------------


def test_an_entry_records_its_length_and_hash(cache, source) -> None:
    data = cc.compile_cubin(source, "sm_80")
    (entry,) = entries(cache)
    found = cc.ENTRY.match(entry.name)
    assert found and int(found["size"]) == len(data) == entry.stat().st_size
    assert cc.entry_problem(entry.name, data) is None
    assert cc.cache_entry(source, "sm_80") == entry
    assert not list(cache.glob(".*.tmp")), "the temporary file was left behind"


def truncated(data: bytes) -> bytes:
    return data[:-100]  # still starts with the ELF magic


def flipped(data: bytes) -> bytes:
    mid = len(data) // 2
    return data[:mid] + bytes([data[mid] ^ 0x40]) + data[mid + 1 :]


@pytest.mark.parametrize(
    "corrupt",
    [truncated, lambda d: d[: len(d) // 2], flipped, lambda d: b"garbage", lambda d: b"", lambda d: d + b"\0"],
    ids=["truncated", "half", "flipped", "garbage", "empty", "longer"],
)
def test_a_corrupt_entry_never_reaches_the_driver(cache, source, corrupt) -> None:
    """A bad entry is found by its length, hash or ELF structure and rebuilt; the loader only ever
    sees the whole cubin (the driver took a truncated one for valid and crashed)."""
    good = cc.compile_cubin(source, "sm_80")
    (entry,) = entries(cache)
    entry.write_bytes(corrupt(good))
    seen: list[bytes] = []
    data, loaded = cc.compile_and_load(source, "sm_80", lambda b: seen.append(b) or "module")
    assert data == good and seen == [good] and loaded == "module"
    (entry,) = entries(cache)
    assert entry.read_bytes() == good


def test_every_truncation_of_a_cubin_is_refused(source) -> None:
    data = cc.compile_cubin(source, "sm_80", use_cache=False)
    assert cc.cubin_problem(data) is None
    cuts = sorted({*range(0, 200, 7), *range(len(data) - 300, len(data)), *range(0, len(data), 997)})
    missed = [n for n in cuts if n < len(data) and cc.cubin_problem(data[:n]) is None]
    assert not missed, f"truncations to {missed[:10]} bytes pass as whole cubins"
    assert "not CUDA" in cc.cubin_problem(data[:18] + b"\x3e\x00" + data[20:])  # an x86-64 ELF file


def test_an_entry_of_the_old_format_is_not_served(cache, source) -> None:
    good = cc.compile_cubin(source, "sm_80")
    (entry,) = entries(cache)
    old = cache / (entry.name.split(".")[0] + ".cubin")
    entry.rename(old)
    old.write_bytes(truncated(good))  # unverifiable: length and hash unknown
    seen: list[bytes] = []
    cc.compile_and_load(source, "sm_80", seen.append)
    assert seen == [good] and not old.exists()


def test_an_entry_the_driver_refuses_is_rebuilt_once(cache, source) -> None:
    good = cc.compile_cubin(source, "sm_80")
    calls: list[bytes] = []

    def load(data: bytes) -> str:
        calls.append(data)
        if len(calls) == 1:
            raise cc.CubinLoadError("cuModuleLoadData: CUDA_ERROR_INVALID_IMAGE")
        return "module"

    assert cc.compile_and_load(source, "sm_80", load) == (good, "module")
    assert len(calls) == 2 and len(entries(cache)) == 1


@pytest.mark.parametrize("cached", [True, False])
def test_a_cubin_refused_twice_is_an_error_naming_the_entry(cache, source, cached: bool) -> None:
    if cached:
        cc.compile_cubin(source, "sm_80")
    calls: list[bytes] = []

    def refuse(data: bytes) -> None:
        calls.append(data)
        raise cc.CubinLoadError("cuModuleLoadData: CUDA_ERROR_NO_BINARY_FOR_GPU")

    key = cc.cache_key(source, "sm_80")
    with pytest.raises(
        cc.CompileError, match=rf"cache entry {cache}/{key}\.\d+\.[0-9a-f]{{16}}\.cubin: .*refused again"
    ):
        cc.compile_and_load(source, "sm_80", refuse)
    assert len(calls) == (2 if cached else 1)
    assert not entries(cache), "a refused cubin must not be served again"


def test_other_load_failures_are_not_retried(cache, source) -> None:
    def fail(data: bytes) -> None:
        raise ml.errors.MegaloopError("out of memory")

    with pytest.raises(ml.errors.MegaloopError, match="out of memory"):
        cc.compile_and_load(source, "sm_80", fail)


KILLED = r"""
import os, sys, time
os.environ["MEGALOOP_CACHE"] = sys.argv[1]
import megaloop.runtime.compile as c
point, source = sys.argv[2], open(sys.argv[3]).read()
def ready(*args, **kw):
    print("READY", flush=True)
    time.sleep(600)
if point == "compile":
    c._nvrtc = ready
elif point == "write":
    def half(f, data):
        f.write(data[: len(data) // 2])
        f.flush()
        ready()
    c._write_temp = half
elif point == "rename":
    os.replace = ready
c.compile_cubin(source, sys.argv[4] if len(sys.argv) > 4 else "sm_80")
print("FINISHED", flush=True)
"""


@pytest.mark.parametrize("point", ["compile", "write", "rename"])
def test_a_process_killed_while_compiling_leaves_the_cache_valid(cache, source, tmp_path, point: str) -> None:
    """SIGKILL while NVRTC runs, half way through writing the entry, and with the entry written but
    not yet renamed: no entry (never a partial one), and the next compile stores a valid one."""
    src = tmp_path / "kernel.cu"
    src.write_text(source)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-c", KILLED, str(cache.parent), point, str(src)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "READY", f"the child did not reach {point}: {line!r} {proc.stderr.read()[-2000:]}"
        proc.kill()
    finally:
        proc.wait(timeout=60)
    assert cc.cache_entry(source, "sm_80") is None and not entries(cache)
    assert bool(list(cache.glob(".*.tmp"))) == (point != "compile"), "where the child died"
    good = cc.compile_cubin(source, "sm_80", use_cache=False)
    assert cc.compile_cubin(source, "sm_80") == good
    (entry,) = entries(cache)
    assert cc.entry_problem(entry.name, entry.read_bytes()) is None


def test_temporary_files_of_killed_writers_are_removed_in_time(cache, source) -> None:
    cache.mkdir(parents=True)
    stale, fresh = cache / ".abc.old.tmp", cache / ".abc.new.tmp"
    stale.write_bytes(b"x")
    fresh.write_bytes(b"x")
    old = time.time() - cc.STALE_TEMP_S - 10
    os.utime(stale, (old, old))
    cc.compile_cubin(source, "sm_80")
    assert not stale.exists() and fresh.exists(), "only a writer's file older than STALE_TEMP_S is removed"


def test_compile_many_reports_progress(cache, source) -> None:
    other = source.replace("cache-test", "cache-test-2")
    cc.compile_cubin(source, "sm_80")
    seen: list[tuple[int, int]] = []
    out = cc.compile_many([source, other, source], "sm_80", workers=1, progress=lambda d, t: seen.append((d, t)))
    assert len(out) == 3 and out[0] == out[2]
    assert seen[0] == (1, 2) and seen[-1] == (2, 2), seen


# ---- the resident-kernel registry ---------------------------------------------------------------------


class FakeKernel:
    """What the registry calls on a kernel: _halt (it leaves and unregisters) and _free."""

    def __init__(self, leaves: bool = True) -> None:
        self.leaves, self.halted, self.freed, self._stuck = leaves, 0, 0, False

    def _halt(self) -> bool:
        self.halted += 1
        if self.leaves:
            resident.unregister(self)
        else:
            self._stuck = True
            resident.mark_stuck(self)
        return self.leaves

    def _free(self) -> None:
        self.freed += 1


@pytest.fixture
def registry(monkeypatch):
    monkeypatch.setattr(resident, "_entries", {})
    monkeypatch.setattr(resident, "_deferred", [])
    return resident


def launch(reg, kernel, device: int = 0, processors: int = 66, group=None, what="graph 'a'") -> None:
    reg.register(kernel, reg.Resident(device, processors, what, group, time.monotonic()))


def test_a_held_gpu_is_refused_at_once_naming_its_kernel(registry) -> None:
    k = FakeKernel()
    launch(registry, k, device=1, what="the loop kernel of graph 'mlp'")
    registry.refuse_if_occupied(0, "the loop kernel of graph 'b'")  # another GPU: fine
    with pytest.raises(registry.ResidencyError, match=r"graph 'b' cannot be loaded on GPU 1: .*graph 'mlp', 66 proc"):
        registry.refuse_if_occupied(1, "the loop kernel of graph 'b'")
    assert [e.what for e in registry.resident(1)] == ["the loop kernel of graph 'mlp'"]
    registry.unregister(k)
    registry.refuse_if_occupied(1, "the loop kernel of graph 'b'")


@pytest.mark.parametrize(
    ("sms", "launches", "fits"),
    [
        (132, [(132, 1)], True),
        (132, [(133, 1)], False),
        (132, [(264, 2)], True),  # one kernel alone: the driver's occupancy
        (132, [(10, 0)], False),  # no block fits
        (132, [(66, 1), (66, 1)], True),
        (132, [(67, 1), (66, 1)], False),
        (132, [(66, 2), (67, 2)], False),  # several: an SM per block, whatever fits one alone
        (132, [(33, 1)] * 4, True),
        (132, [(44, 1)] * 3, True),
        (132, [(34, 1)] * 4, False),
        (78, [(39, 1), (39, 1)], True),
    ],
)
def test_co_residency_arithmetic(sms: int, launches: list, fits: bool) -> None:
    why = resident.co_residency(sms, [resident.Launch(p, b, f"rank {i}") for i, (p, b) in enumerate(launches)])
    assert (why is None) == fits, why


def test_co_residency_errors_name_the_numbers_and_the_fix(registry) -> None:
    launches = [registry.Launch(80, 1, "rank 0"), registry.Launch(80, 1, "rank 1")]
    with pytest.raises(
        registry.ResidencyError,
        match=r"GPU 0 \(H200\): 2 loop kernels need 80 \(rank 0\) \+ 80 \(rank 1\) = 160 thread blocks.* 132 SMs; "
        r"make the plan with processors <= 66",
    ):
        registry.check_co_resident(0, "H200", 132, launches)
    with pytest.raises(registry.ResidencyError, match=r"at most 132 are resident at once \(132 SMs x 1 blocks"):
        registry.check_co_resident(0, "H200", 132, [registry.Launch(200, 1, "graph 'g'")])
    launch(registry, FakeKernel(), processors=100)  # already there: counted in
    with pytest.raises(registry.ResidencyError, match=r"100 \(graph 'a' \(resident\)\) \+ 40 .*processors <= 32"):
        registry.check_co_resident(0, "H200", 132, [registry.Launch(40, 1, "rank 0")])


def test_frees_wait_for_the_gpu_and_for_the_group(registry) -> None:
    a, b, c = FakeKernel(), FakeKernel(), FakeKernel()
    launch(registry, a, device=0, group=7)
    launch(registry, b, device=1, group=7)
    freed: list[str] = []
    assert not registry.free_when_idle(0, None, lambda: freed.append("gpu 0"))  # a runs there
    assert not registry.free_when_idle(2, 7, lambda: freed.append("group 7"))  # b, a read it
    assert registry.free_when_idle(3, None, lambda: freed.append("gpu 3"))  # idle: now
    a._halt()
    assert freed == ["gpu 3", "gpu 0"]
    launch(registry, c, device=2)
    b._halt()
    assert freed == ["gpu 3", "gpu 0"], "GPU 2 is still busy with c"
    c._halt()
    assert freed == ["gpu 3", "gpu 0", "group 7"]


def test_a_stuck_kernel_keeps_its_gpu_refused(registry) -> None:
    k = FakeKernel(leaves=False)
    launch(registry, k)
    assert not k._halt()
    with pytest.raises(registry.ResidencyError, match="STUCK: it did not stop when asked"):
        registry.refuse_if_occupied(0, "a new kernel")
    registry.stop_everything()
    assert k.halted == 1, "a stuck kernel is not asked again at exit"


def test_exit_stops_every_kernel_left_running_then_frees(registry) -> None:
    kernels = [FakeKernel(), FakeKernel()]
    for i, k in enumerate(kernels):
        launch(registry, k, device=0, group=1, what=f"rank {i}")
    registry.stop_everything()
    assert [k.halted for k in kernels] == [1, 1] and [k.freed for k in kernels] == [1, 1]
    assert not registry.resident()


def test_an_unfinished_loop_kernel_is_dropped_quietly() -> None:
    """A LoopKernel whose constructor never ran (or failed early) has nothing to stop or free."""
    from megaloop.runtime.loop import LoopKernel

    k = LoopKernel.__new__(LoopKernel)
    k.__del__()
    k._free()


def test_a_watchdog_names_a_peer_on_the_same_gpu() -> None:
    from megaloop.runtime.report import kernel_error

    graphs = ml.spmd(lambda g: g.output("y", ml.all_reduce(g.input("x", (64,), ml.float32) * 2.0)), 2)
    plan = make_plan(graphs, processors=2, tiles={"all_reduce": {"push": 1}})
    task = next(t for t in plan.ranks[0].tasks if plan.ranks[0].ops[t.op].op == "all_reduce")
    info = [1, task.id, task.op, -1, 5, 0, 3, 1]
    same = str(kernel_error(plan, 0, 1.0, 1, info, [0, 0]))
    apart = str(kernel_error(plan, 0, 1.0, 1, info, [0, 1]))
    assert "the tile rank 1 pushes to it never arrived (its loop kernel shares this GPU: is it running?)" in same
    assert "(a peer GPU: is it running?)" in apart


# ---- uploads in pieces -----------------------------------------------------------------------------------

CASES = [
    ((), "float32", np.float64),
    ((0, 5), "bfloat16", np.float32),
    ((1000,), "float32", np.float32),
    ((7, 300), "bfloat16", "bfloat16"),
    ((3, 5, 700), "bfloat16", np.float64),  # a row past the chunk: cut within rows
    ((40, 33), "float16", np.float32),
    ((64, 50), "int32", np.int64),
    ((9, 17), "bool", np.bool_),
]


@pytest.mark.parametrize(("shape", "dtype", "source"), CASES)
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_pieces_are_the_coerced_value_in_c_order(shape, dtype, source, layout: str) -> None:
    dt = ml.as_dtype(dtype)
    src = ml_dtypes.bfloat16 if source == "bfloat16" else source
    rng = np.random.default_rng(len(shape))
    if layout == "transposed" and len(shape) >= 2:
        value = (rng.standard_normal(shape[::-1]) * 50).astype(src).T  # a strided view, C order differs
    else:
        value = (rng.standard_normal(shape) * 50).astype(src)
    chunk = 1024
    got = list(pieces(value, shape, dt, "parameter 'w'", chunk))
    assert all(p.nbytes <= chunk for p in got), [p.nbytes for p in got]
    want = coerce(value, _tensor(shape, dt), "parameter 'w'")
    assert b"".join(np.ascontiguousarray(p).tobytes() for p in got) == want.tobytes()


def _tensor(shape, dt):
    class T:
        pass

    t = T()
    t.shape, t.dtype = tuple(shape), dt
    return t


def test_pieces_of_a_memory_map_of_the_right_dtype_are_views(tmp_path) -> None:
    path = tmp_path / "w.bin"
    np.arange(4096, dtype=np.float32).astype(ml_dtypes.bfloat16).tofile(path)
    mapped = np.memmap(path, dtype=ml_dtypes.bfloat16, mode="r", shape=(64, 64))
    got = list(pieces(mapped, (64, 64), ml.bfloat16, "w", 1024))
    assert len(got) == 8 and all(np.shares_memory(p, mapped) for p in got)


@pytest.mark.parametrize("source", ["bfloat16", "float32"])
def test_uploading_a_memory_map_holds_no_copy_of_it(tmp_path, source: str) -> None:
    """32 MB from a memory-mapped file through a 1 MB staging buffer (the GPU side faked): the host
    never allocates more than a few pieces, converted (float32 -> bfloat16) or not."""
    dtype = ml_dtypes.bfloat16 if source == "bfloat16" else np.float32
    rows = (32 << 20) // (1024 * np.dtype(dtype).itemsize)
    path = tmp_path / "w.bin"
    np.memmap(path, dtype=dtype, mode="w+", shape=(rows, 1024))[:] = 1.5
    mapped = np.memmap(path, dtype=dtype, mode="r", shape=(rows, 1024))
    chunk = 1 << 20
    staging = np.empty(chunk, np.uint8)
    device = bytearray(rows * 1024 * 2)
    sums: list[int] = []

    def put(address: int, piece: np.ndarray) -> None:  # what Staging.put does, into host memory
        view = staging[: piece.nbytes].view(piece.dtype).reshape(piece.shape)
        np.copyto(view, piece)
        device[address : address + piece.nbytes] = staging[: piece.nbytes].tobytes()
        sums.append(piece.nbytes)

    tracemalloc.start()
    try:
        wrote = upload(put, 0, mapped, (rows, 1024), ml.bfloat16, "w", chunk, advance=lambda n: None)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert wrote == len(device) == sum(sums)
    assert peak < 4 * chunk, f"peak host allocation {peak / 2**20:.1f} MB for a 1 MB chunk"
    assert np.all(np.frombuffer(bytes(device), ml_dtypes.bfloat16) == ml_dtypes.bfloat16(1.5))


@pytest.mark.parametrize(
    ("value", "shape", "dtype"),
    [(np.zeros((3, 2)), (2, 3), "float32"), (np.array([1, 2**40]), (2,), "int32"), (np.zeros(2), (2,), "bool")],
    ids=["shape", "range", "kind"],
)
def test_upload_errors_are_coerces(value, shape, dtype: str) -> None:
    dt = ml.as_dtype(dtype)
    with pytest.raises(EvaluationError) as want:
        coerce(value, _tensor(shape, dt), "parameter 'w'")
    with pytest.raises(EvaluationError) as got:
        upload(lambda address, piece: None, 0, value, shape, dt, "parameter 'w'")
    assert str(got.value) == str(want.value)


def test_progress_arguments() -> None:
    assert progress_callback(None) is None and progress_callback(False) is None
    seen = []
    cb = progress_callback(lambda *a: seen.append(a))
    cb("upload", 1, 2)
    assert seen == [("upload", 1, 2)]
    assert isinstance(progress_callback(True), TqdmProgress)
    with pytest.raises(EvaluationError, match="progress must be None, False, True"):
        progress_callback("yes")


def test_tqdm_bars_follow_the_stages(capsys) -> None:
    bars = TqdmProgress()
    bars("compile", 0, 2)
    bars("upload", 1 << 20, 4 << 20)
    bars("compile", 2, 2)
    bars("upload", 4 << 20, 4 << 20)
    err = capsys.readouterr().err
    assert "compile" in err and "2/2" in err and "upload" in err and "4.19M" in err, err
    assert not bars._bars, "finished stages close their bars"


# ---- a group's devices ---------------------------------------------------------------------------------


def test_group_devices_are_checked() -> None:
    from megaloop.runtime.group import check_devices
    from megaloop.runtime.loop import LoopKernelError

    assert check_devices(2, None, 2) == [0, 1]
    assert check_devices(3, [0, 0, 0], 1) == [0, 0, 0]  # three ranks on one GPU
    assert check_devices(4, [0, 0, 1, 1], 2) == [0, 0, 1, 1]
    with pytest.raises(LoopKernelError, match=r"this machine has 1 GPU\(s\); .* pass devices=\[0, 0\]"):
        check_devices(2, None, 1)
    with pytest.raises(LoopKernelError, match=r"no GPU \(no driver\)"):
        check_devices(2, None, 0, "no driver")
    with pytest.raises(LoopKernelError, match=r"give one GPU per rank, got devices \[0\]"):
        check_devices(2, [0], 1)
    with pytest.raises(LoopKernelError, match=r"GPU\(s\) \[3\] do not exist"):
        check_devices(2, [0, 3], 2)
    with pytest.raises(LoopKernelError, match="devices must be a list of GPU indices"):
        check_devices(2, "0,0", 1)
    assert check_devices(12, [0] * 12, 1) == [0] * 12  # past 9 ranks: fine on shared GPUs


def test_a_group_reports_every_ranks_upload_as_one_count() -> None:
    from megaloop.runtime.group import _Uploads

    seen = []
    uploads = _Uploads(lambda *a: seen.append(a), [100, 50])
    uploads.for_rank(0)("compile", 1, 1)  # the group reports compiles itself
    uploads.for_rank(0)("upload", 100, 100)
    uploads.for_rank(1)("upload", 20, 50)
    assert seen == [("upload", 100, 150), ("upload", 120, 150)]
    assert _Uploads(None, [1]).for_rank(0) is None

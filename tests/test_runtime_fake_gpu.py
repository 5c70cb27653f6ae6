"""LoopKernel and LoopKernelGroup driven against a fake CUDA driver (tests/fake_driver.py: memory is
bytes, a launched kernel is a thread that reports iterations done and computes nothing), so that their
host code runs on every CI machine: what lands in the arena (parameters through the staging buffers,
memory-mapped ones included), the order of loads, launches and frees (the fake raises where the real
driver would block under a resident kernel), the registry's refusals, stops at collection and at
exit, and ranks sharing one GPU. What the GPU itself does is tests/test_gpu_shared.py's and
tests/test_gpu_faults.py's."""

from __future__ import annotations

import gc
import time

import ml_dtypes
import numpy as np
import pytest

import megaloop as ml
from megaloop import errors
from megaloop.frontend.values import coerce
from megaloop.plan import make_plan
from megaloop.runtime import resident, upload
from megaloop.runtime.compile import CompileError, cache_entry
from megaloop.runtime.loop import ERROR, INFO, LoopKernel, LoopKernelError
from megaloop.runtime.resident import ResidencyError
from tests.fake_driver import FakeDriver, install


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def fake(monkeypatch, cache_dir):
    monkeypatch.setenv("MEGALOOP_CACHE", str(cache_dir))
    monkeypatch.setattr(resident, "_entries", {})
    monkeypatch.setattr(resident, "_deferred", [])
    driver = install(monkeypatch, FakeDriver(gpus=2))
    yield driver
    resident.stop_everything()  # whatever a failing test left running


def graph(name: str = "fake", hidden: int = 40) -> ml.Graph:
    g = ml.Graph(name)
    x = g.input("x", (4, hidden), ml.bfloat16)
    w = g.parameter("w", (hidden, hidden), ml.bfloat16)
    b = g.parameter("b", (hidden,), ml.float32)
    s = g.state("s", (4, hidden), ml.float32, init=np.full((4, hidden), 3.0, np.float32))
    z = g.state("z", (2, 8), ml.int64)
    c = g.state("c", (3,), ml.float32)
    y = ml.linear(x, w) + 1.0
    g.assign(s, s + ml.cast(y, ml.float32) + b)
    g.assign(z, z + 1)
    g.assign(c, c * 2.0)
    g.output("y", y)
    return g


def arena_bytes(fake: FakeDriver, k: LoopKernel, name: str, kind: str) -> bytes:
    g = k.rp.graph
    t = k.rp.tensors[k.rp.tensor_of[{"param": g.parameters, "state": g.states}[kind][name]]]
    return fake.read(k.arena + k.rp.buffers[t.buffer].offset, t.dtype.itemsize * int(np.prod(t.shape)))


def allocated(fake: FakeDriver) -> tuple[int, int]:
    return len(fake.memory), len(fake.host)


def test_parameters_and_state_land_in_the_arena(fake, tmp_path, monkeypatch) -> None:
    """A memory-mapped bf16 weight (uploaded in pieces: the staging buffers made small), a float64
    bias converted piece by piece, a given state, an init state and a zeroed one; progress to the end."""
    monkeypatch.setattr("megaloop.runtime.loop.CHUNK_BYTES", 512)
    g = graph()
    path = tmp_path / "w.bin"
    w = np.random.default_rng(0).standard_normal((40, 40)).astype(ml_dtypes.bfloat16)
    w.tofile(path)
    params = {"w": np.memmap(path, dtype=ml_dtypes.bfloat16, mode="r", shape=(40, 40)), "b": np.arange(40.0) / 3}
    state = {"c": np.array([1.0, 2.0, 3.0])}
    seen = []
    with LoopKernel(make_plan(g, processors=4), params, state, progress=lambda *a: seen.append(a)) as k:
        assert arena_bytes(fake, k, "w", "param") == w.tobytes()
        assert arena_bytes(fake, k, "b", "param") == coerce(params["b"], g.parameters["b"], "b").tobytes()
        assert arena_bytes(fake, k, "c", "state") == np.float32([1, 2, 3]).tobytes()
        assert arena_bytes(fake, k, "s", "state") == np.full((4, 40), 3.0, np.float32).tobytes()
        assert arena_bytes(fake, k, "z", "state") == bytes(2 * 8 * 8)
        out = k.run({"x": np.ones((4, 40))}, iterations=3)
        assert out["y"].shape == (4, 40) and k.completed() == 3
        assert [e.what for e in resident.resident(0)] == ["the loop kernel of graph 'fake'"]
    total = 40 * 40 * 2 + 40 * 4 + 3 * 4
    uploads = [d for stage, d, t in seen if stage == "upload"]
    assert uploads == sorted(uploads) and uploads[-1] == total and len(uploads) > 6, uploads
    assert ("compile", 1, 1) in seen
    assert not resident.resident() and allocated(fake) == (0, 0), "everything freed"


def test_named_states_are_read_alone(fake, monkeypatch) -> None:
    """state(names) copies only those states off the GPU (the generator reads its tokens this way,
    leaving the KV caches there); an unknown name is refused with the states there are."""
    reads = []
    with LoopKernel(make_plan(graph(), processors=4), {"w": np.eye(40), "b": np.zeros(40)}, {"c": [1.0, 2, 3]}) as k:
        real = fake.cuMemcpyDtoHAsync
        monkeypatch.setattr(fake, "cuMemcpyDtoHAsync", lambda dst, src, n, s: reads.append(n) or real(dst, src, n, s))
        got = k.state(["c", "z"])
        assert sorted(got) == ["c", "z"] and reads == [3 * 4, 2 * 8 * 8], reads
        assert got["c"].tolist() == [1.0, 2.0, 3.0] and got["z"].tolist() == [[0] * 8] * 2
        with pytest.raises(errors.EvaluationError, match=r"no state named \['kv'\]; the states are \['c', 's', 'z'\]"):
            k.state(["kv"])


def test_a_second_kernel_on_a_held_gpu_is_refused_at_once(fake) -> None:
    plan = make_plan(graph(), processors=4)
    params = {"w": np.zeros((40, 40)), "b": np.zeros(40)}
    with LoopKernel(plan, params) as first:
        loads = list(fake.loads)
        start = time.monotonic()
        with pytest.raises(ResidencyError, match=r"cannot be loaded on GPU 0: .*graph 'fake', 4 processors"):
            LoopKernel(make_plan(graph("second"), processors=4), params)
        assert time.monotonic() - start < 2 and fake.loads == loads, "refused before loading anything"
        other = LoopKernel(make_plan(graph("second"), processors=4), params, device=1)  # another GPU: fine
        other.stop()
        first.run({"x": np.zeros((4, 40))})
    with LoopKernel(plan, params) as again:  # the GPU is free once the first stopped
        again.run({"x": np.zeros((4, 40))})


def test_a_dropped_kernel_is_stopped_and_freed(fake) -> None:
    k = LoopKernel(make_plan(graph(), processors=4), {"w": np.zeros((40, 40)), "b": np.zeros(40)})
    launched = fake.kernels[-1]
    del k
    gc.collect()
    assert launched.left.is_set() and not resident.resident() and allocated(fake) == (0, 0)


def test_the_exit_handler_stops_kernels_left_running(fake) -> None:
    k = LoopKernel(make_plan(graph(), processors=4), {"w": np.zeros((40, 40)), "b": np.zeros(40)})
    resident.stop_everything()
    assert fake.kernels[-1].left.is_set() and not resident.resident() and allocated(fake) == (0, 0)
    k.stop()  # already stopped: nothing more to do


def test_a_refused_image_is_rebuilt_then_named(fake, cache_dir) -> None:
    plan = make_plan(graph("refused"), processors=4)
    params = {"w": np.zeros((40, 40)), "b": np.zeros(40)}
    LoopKernel(plan, params).stop()  # the entry is in the cache now
    fake.refuse_images = 1
    with LoopKernel(plan, params) as k:
        k.run({"x": np.zeros((4, 40))})
    fake.refuse_images = 2
    with pytest.raises(CompileError, match=r"cache entry .*\.cubin: .*CUDA_ERROR_INVALID_IMAGE.*refused again"):
        LoopKernel(plan, params)
    assert allocated(fake) == (0, 0) and cache_entry(k.program.source, "sm_80") is None


# ---- ranks sharing a GPU ------------------------------------------------------------------------------


def tp_graphs(world: int) -> list[ml.Graph]:
    def build(g: ml.Graph) -> None:
        x = g.input("x", (4, 64), ml.float32)
        w = g.parameter("w", (64, 64), ml.float32)
        y = ml.all_reduce(ml.linear(x, w))
        ml.send(y[:1], (g.rank + 1) % g.world_size)
        g.output("y", y + ml.recv(g, (g.rank - 1) % g.world_size, (1, 64), ml.float32))

    return ml.spmd(build, world)


def group(plan, world: int, **kw):
    from megaloop.codegen import generate
    from megaloop.runtime.compile import compile_cubin
    from megaloop.runtime.group import LoopKernelGroup

    for r in range(world):  # here, not in compile_many's worker processes (seconds each to start)
        compile_cubin(generate(plan, r).source, "sm_80")
    rng = np.random.default_rng(world)
    params = [{"w": rng.standard_normal((64, 64))} for _ in range(world)]
    return LoopKernelGroup(plan, params, **kw), params


@pytest.mark.parametrize(("world", "devices"), [(2, [0, 0]), (3, [0, 0, 0]), (4, [0, 0, 1, 1])])
def test_ranks_sharing_a_gpu_load_everything_before_launching(fake, world: int, devices: list) -> None:
    per_gpu = world // len(set(devices))
    plan = make_plan(tp_graphs(world), processors=132 // per_gpu)
    gr, params = group(plan, world, devices=devices)
    with gr:
        assert [k.device for k in gr.kernels] == devices and len(fake.kernels) == world
        assert len(fake.loads) >= world  # every module loaded before the first launch (else WouldHang)
        for k, p in zip(gr.kernels, params):
            assert arena_bytes(fake, k, "w", "param") == p["w"].astype(np.float32).tobytes()
        arenas = [k.arena for k in gr.kernels]
        for launched in fake.kernels:  # every kernel is handed every rank's arena
            got = np.frombuffer(fake.read(int(launched.args["arenas"]), 8 * world), np.uint64)
            assert list(got) == arenas and int(launched.args["world"]) == world
        assert fake.peer_access == ({(0, 1), (1, 0)} if len(set(devices)) > 1 else set())
        for d in set(devices):  # the ranks of a GPU share one copy stream
            assert len({id(k._copies) for k in gr.kernels if k.device == d}) == 1
        outs = gr.run([{"x": np.ones((4, 64))}] * world, iterations=2)
        assert len(outs) == world and all(o["y"].shape == (4, 64) for o in outs)
    assert all(k.left.is_set() for k in fake.kernels) and allocated(fake) == (0, 0)
    assert not resident.resident()


def test_ranks_that_cannot_all_be_resident_are_refused_before_compiling(fake) -> None:
    plan = make_plan(tp_graphs(2), processors=80)
    with pytest.raises(
        ResidencyError,
        match=r"GPU 0 \(Fake H200\): 2 loop kernels need 80 \(rank 0\) \+ 80 \(rank 1\) = 160 thread blocks, .*"
        r"132 SMs; make the plan with processors <= 66 \(132 SMs shared by 2 loop kernels\)",
    ):
        group(plan, 2, devices=[0, 0])
    assert not fake.loads and allocated(fake) == (0, 0)


def test_kernels_whose_blocks_do_not_fit_an_sm_are_refused_before_any_upload(fake) -> None:
    fake.blocks_per_sm = 0
    with pytest.raises(LoopKernelError, match="fits on a multiprocessor"):
        group(make_plan(tp_graphs(2), processors=66), 2, devices=[0, 0])
    assert not fake.kernels and allocated(fake) == (0, 0)


def test_a_dropped_group_stops_every_rank_first(fake) -> None:
    gr, _ = group(make_plan(tp_graphs(2), processors=66), 2, devices=[0, 0])
    del gr
    gc.collect()
    assert all(k.left.is_set() for k in fake.kernels) and allocated(fake) == (0, 0)


def test_a_rank_stopped_alone_keeps_its_memory_until_its_peers_leave(fake) -> None:
    """Freeing while the other rank runs would block in the driver (and free what it reads)."""
    gr, _ = group(make_plan(tp_graphs(2), processors=66), 2, devices=[0, 0])
    first, second = gr.kernels
    before = allocated(fake)
    first.stop()
    assert allocated(fake) == before, "freed while rank 1 is resident"
    second.stop()
    assert allocated(fake)[0] == 0
    gr.stop()


def test_an_error_on_one_rank_halts_every_rank(fake) -> None:
    gr, _ = group(make_plan(tp_graphs(2), processors=66), 2, devices=[0, 0], timeout_s=1.0)
    with gr:
        plan, victim = gr.plan, gr.kernels[0]
        task = next(t for t in plan.ranks[0].tasks if plan.ranks[0].ops[t.op].op == "recv")
        wait = task.waits[0]
        victim.start(1)
        gr.kernels[1].start(1)
        victim.control[INFO : INFO + 8] = np.array([3, task.id, task.op, wait.counter, 4, 1, 0, 1]).astype(np.uint64)
        victim.control[ERROR] = 1
        with pytest.raises(LoopKernelError, match=r"watchdog: rank 0 .* of rank 1 \(its loop kernel shares this GPU"):
            gr.wait()
        assert all(k.left.is_set() for k in fake.kernels)


def test_staging_moves_pieces_in_order(fake) -> None:
    """Staging itself: pieces of a large value through two small buffers land where they belong."""
    from megaloop.runtime.loop import _check

    fake.cuCtxSetCurrent(("ctx", 0))
    _, dst = fake.cuMemAlloc(10_000)
    staging = upload.Staging(fake, None, _check, 1024, 1.0)
    value = np.random.default_rng(1).integers(-(2**60), 2**60, 1250)
    upload.upload(staging.put, dst, value, (1250,), ml.int64, "v", 1024)
    staging.finish()
    staging.close()
    assert fake.read(dst, 10_000) == value.tobytes() and not fake.host

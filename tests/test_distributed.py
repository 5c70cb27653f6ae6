"""One process per rank (torchrun's way): ranks that planned different programs are refused before
any GPU work, naming the ranks; checked here with two CPU processes and the gloo backend. Then the
choice of peer memory (megaloop/runtime/peers.py) on ranks simulated by threads: torch symmetric
memory when every rank has it, else IPC on every rank together, or a named error."""

from __future__ import annotations

import os
import socket
import threading

import pytest
import torch.multiprocessing as mp

import megaloop as ml
from megaloop.plan import make_plan
from megaloop.runtime.distributed import check_same_program, plan_digest
from megaloop.runtime.loop import LoopKernelError, memory_sizes


def plan_for(processors: int):
    graphs = ml.spmd(lambda g: g.output("y", ml.all_reduce(g.input("x", (64,), ml.float32))), 2)
    return make_plan(graphs, processors=processors)


def test_digests_see_any_difference() -> None:
    assert plan_digest(plan_for(4)) == plan_digest(plan_for(4))
    assert plan_digest(plan_for(4)) != plan_digest(plan_for(5))


def test_a_different_program_is_named() -> None:
    a, b = plan_for(4), plan_for(5)
    with pytest.raises(LoopKernelError, match=r"rank 0: ranks \[1\] planned a different program"):
        check_same_program(a, 0, 2, lambda _: [plan_digest(a), plan_digest(b)])
    with pytest.raises(LoopKernelError, match="the plan has 2 ranks; the job has 3 processes"):
        check_same_program(a, 0, 3, lambda _: [])


def _rank_main(rank: int, port: int, results) -> None:
    import torch.distributed as dist

    from megaloop.runtime.distributed import DistributedLoopKernel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        DistributedLoopKernel(plan_for(4 + rank))  # rank 1 planned with other settings
        results.put((rank, "started"))
    except Exception as e:
        results.put((rank, f"{type(e).__name__}: {e}"))
    finally:
        dist.destroy_process_group()


def test_mismatched_ranks_are_refused_across_processes() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    for rank in (0, 1):
        assert f"rank {rank}: ranks [1] planned a different program" in got[rank], got


# ---- peer memory: which provider, decided alike on every rank (megaloop/runtime/peers.py) ------------


class FakeWorld:
    """``world`` ranks as threads: ``all_gather`` meets the others as a gloo group would (a rank that
    skips or adds a call breaks the barrier instead of hanging the test)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.slots: list = [None] * world
        self.meet = threading.Barrier(world, timeout=10)
        self.calls = [0] * world

    def all_gather(self, rank: int):
        def gather(obj):
            self.calls[rank] += 1
            self.slots[rank] = obj
            self.meet.wait()
            out = list(self.slots)
            self.meet.wait()
            return out

        return gather

    def run(self, each) -> list:
        """``each(rank, all_gather)`` on every rank at once: its result or the exception it raised."""
        out: list = [None] * self.world

        def main(rank: int) -> None:
            try:
                out[rank] = each(rank, self.all_gather(rank))
            except Exception as e:
                out[rank] = e

        threads = [threading.Thread(target=main, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        return out


class FakePeers:
    """A provider whose addresses say whose they are (rank r: arena 1000 r, counters 1000 r + 8)."""

    def __init__(self, name: str, rank: int, fail: str = "", log: list | None = None) -> None:
        self.name, self.rank, self.fail = name, rank, fail
        self.arena = self.counters = 0
        self.log = log if log is not None else []

    def allocate(self) -> None:
        self.log.append((self.name, self.rank, "allocate"))
        if self.fail == "allocate":
            raise RuntimeError(f"no {self.name} memory here\nC++ stack trace that must not be shown")
        self.arena, self.counters = 1000 * self.rank, 1000 * self.rank + 8

    def exchange(self, all_gather):
        self.log.append((self.name, self.rank, "exchange"))
        if self.fail == "exchange":
            raise RuntimeError(f"{self.name} rendezvous failed")
        if self.name == "ipc":  # the IPC provider's handles go through megaloop's group
            pairs = all_gather((self.arena, self.counters))
            return [a for a, _ in pairs], [c for _, c in pairs]
        return [1000 * r for r in range(2)], [1000 * r + 8 for r in range(2)]

    def close(self) -> None:
        self.log.append((self.name, self.rank, "close"))

    def free(self) -> None:
        self.log.append((self.name, self.rank, "free"))


def open_on_two_ranks(requested, fail: dict[int, str] | None = None, log: list | None = None) -> list:
    """open_peer_memory on two ranks; ``fail[rank]``: which step of symmetric memory fails there."""
    from megaloop.runtime.peers import open_peer_memory

    fail = fail or {}
    log = log if log is not None else []
    asked = requested if isinstance(requested, list) else [requested] * 2

    def each(rank, all_gather):
        providers = {
            "symmetric": lambda: FakePeers("symmetric", rank, fail.get(rank, ""), log),
            "ipc": lambda: FakePeers("ipc", rank, "", log),
        }
        peers, arenas, counters, note = open_peer_memory(asked[rank], rank, all_gather, providers)
        return peers.name, arenas, counters, note

    return FakeWorld(2).run(each)


@pytest.mark.parametrize("requested", ["auto", "symmetric"])
def test_symmetric_memory_when_every_rank_has_it(requested: str) -> None:
    log: list = []
    got = open_on_two_ranks(requested, log=log)
    for rank in (0, 1):
        assert got[rank] == ("symmetric", [0, 1000], [8, 1008], ""), got
    assert not [e for e in log if e[0] == "ipc"], "ipc was set up although symmetric memory worked"
    assert not [e for e in log if e[2] == "free"], "memory in use was freed"


@pytest.mark.parametrize("step", ["allocate", "exchange"])
def test_auto_falls_back_to_ipc_on_every_rank_when_one_rank_fails(step: str) -> None:
    log: list = []
    got = open_on_two_ranks("auto", fail={1: step}, log=log)
    for rank in (0, 1):
        name, arenas, counters, note = got[rank]
        assert (name, arenas, counters) == ("ipc", [0, 1000], [8, 1008]), got
        assert "rank 1: RuntimeError:" in note and "rank 0" not in note, note
        assert "stack trace" not in note, "only the first line of an error belongs in the note"
    for rank in (0, 1):  # rank 0's symmetric memory worked, but it must go too
        assert ("symmetric", rank, "free") in log, log
        assert log.index(("symmetric", rank, "free")) < log.index(("ipc", rank, "allocate")), log


@pytest.mark.parametrize("step", ["allocate", "exchange"])
def test_explicit_symmetric_fails_on_every_rank_naming_the_rank_and_the_way_out(step: str) -> None:
    got = open_on_two_ranks("symmetric", fail={0: step})
    for rank in (0, 1):
        assert isinstance(got[rank], LoopKernelError), got
        msg = str(got[rank])
        assert msg.startswith(f"rank {rank}: peer_memory='symmetric' failed"), msg
        assert "rank 0: RuntimeError: " in msg and "use peer_memory='ipc'" in msg, msg


def test_ipc_asked_for_never_touches_symmetric_memory() -> None:
    log: list = []
    got = open_on_two_ranks("ipc", log=log)
    assert got == [("ipc", [0, 1000], [8, 1008], "")] * 2, got
    assert all(e[0] == "ipc" for e in log), log


def test_ranks_asking_for_different_peer_memory_are_refused() -> None:
    got = open_on_two_ranks(["ipc", "auto"])
    for rank in (0, 1):
        assert isinstance(got[rank], LoopKernelError), got
        assert "rank 0: ipc, rank 1: auto" in str(got[rank]), got[rank]


def test_peer_memory_argument_and_environment(monkeypatch) -> None:
    from megaloop.runtime.peers import ENV, requested_peer_memory

    monkeypatch.delenv(ENV, raising=False)
    assert requested_peer_memory(None) == "auto"
    monkeypatch.setenv(ENV, "ipc")
    assert requested_peer_memory(None) == "ipc"
    assert requested_peer_memory("symmetric") == "symmetric"  # the argument wins
    with pytest.raises(
        LoopKernelError, match=r"peer_memory must be one of \['auto', 'symmetric', 'ipc'\], got 'nvshmem'"
    ):
        requested_peer_memory("nvshmem")
    monkeypatch.setenv(ENV, "IPC")
    with pytest.raises(LoopKernelError, match=r"\$MEGALOOP_PEER_MEMORY must be one of"):
        requested_peer_memory(None)


def test_torch_without_cuda_symmetric_memory_falls_back_or_is_named() -> None:
    """This machine's torch has no CUDA: the real symmetric provider fails to allocate, and "auto"
    uses IPC on every rank while "symmetric" says why it cannot."""
    from megaloop.runtime.peers import SymmetricPeers, open_peer_memory

    plan = plan_for(4)

    def each(requested):
        def run(rank, all_gather):
            providers = {
                "symmetric": lambda: SymmetricPeers(plan, rank, rank, "0"),
                "ipc": lambda: FakePeers("ipc", rank),
            }
            peers, _, _, note = open_peer_memory(requested, rank, all_gather, providers)
            return peers.name, note

        return run

    got = FakeWorld(2).run(each("auto"))
    for rank in (0, 1):
        assert got[rank][0] == "ipc" and "sees no CUDA device" in got[rank][1], got
    got = FakeWorld(2).run(each("symmetric"))
    for rank in (0, 1):
        assert isinstance(got[rank], LoopKernelError) and "sees no CUDA device" in str(got[rank]), got


def test_symmetric_provider_against_a_fake_torch(monkeypatch) -> None:
    """Equal sizes on every rank (the largest of the plan), multicast off during the rendezvous only,
    the deprecated group registration skipped, and addresses checked before use."""
    import contextlib
    import types

    import torch

    import megaloop.runtime.peers as peers

    seen: dict = {}

    class Handle:
        def __init__(self, ptrs):
            self.buffer_ptrs = ptrs

    class Tensor:
        def __init__(self, n, ptr):
            self.n, self.ptr = n, ptr

        def data_ptr(self):
            return self.ptr

    def empty(n, dtype, device):
        seen.setdefault("sizes", []).append(n)
        seen["device"] = device
        return Tensor(n, 0x1000 * len(seen["sizes"]))

    def rendezvous(t, group):
        seen["multicast"] = os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST")
        seen["group"] = group
        return Handle([t.ptr, t.ptr + 0x100000] if not seen.get("bad") else [t.ptr + 8, 1])

    def enable(group):
        raise AssertionError("the deprecated enable_symm_mem_for_group must not be called")

    enable.__deprecated__ = "deprecated"
    fake = types.SimpleNamespace(empty=empty, rendezvous=rendezvous, enable_symm_mem_for_group=enable)
    monkeypatch.setattr(peers, "_symmetric_memory_module", lambda: fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device", lambda _: contextlib.nullcontext())
    monkeypatch.delenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", raising=False)

    graphs = ml.spmd(lambda g: g.output("y", ml.all_reduce(g.input("x", (64,), ml.float32))), 2)
    plan = make_plan(graphs, processors=4)
    plan.ranks[1].arena_bytes += 4096  # ranks may need different arenas: each allocates the largest
    p = peers.SymmetricPeers(plan, 0, 1, "0")
    p.allocate()
    assert seen["sizes"] == [memory_sizes(plan, 1)[0], 8 * len(plan.ranks[0].counters)], seen
    assert seen["device"] == "cuda:1"
    assert (p.arena, p.counters) == (0x1000, 0x2000)
    arenas, counters = p.exchange(lambda _: pytest.fail("symmetric memory does not use megaloop's group"))
    assert (arenas, counters) == ([0x1000, 0x101000], [0x2000, 0x102000])
    assert seen["multicast"] == "1" and seen["group"] == "0", seen
    assert "TORCH_SYMM_MEM_DISABLE_MULTICAST" not in os.environ, "the user's environment must be left as found"
    seen["bad"] = True
    with pytest.raises(RuntimeError, match="arena's rendezvous gave addresses"):
        p.exchange(lambda _: None)
    p.free()
    assert (p.arena, p.counters, p._tensors) == (0, 0, [])

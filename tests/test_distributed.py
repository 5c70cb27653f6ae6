"""One process per rank (torchrun's way): ranks that planned different programs are refused before
any GPU work, naming the ranks; checked here with two CPU processes and the gloo backend."""

from __future__ import annotations

import socket

import pytest
import torch.multiprocessing as mp

import megaloop as ml
from megaloop.plan import make_plan
from megaloop.runtime.distributed import check_same_program, plan_digest
from megaloop.runtime.loop import LoopKernelError


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

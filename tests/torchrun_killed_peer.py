"""Run by tests/test_gpu_multi.py under torchrun (one process per GPU): rank 1 is killed (SIGKILL: no
cleanup, no goodbye) after a first run that both ranks finished; rank 0 then starts a second run,
whose all-reduce waits on rank 1's counters, and must get the watchdog's error naming rank 1, the op
and the tile. Rank 0 prints one line starting KILLED-PEER with the peer memory used and the error
(or what happened instead), then how stop() went. $MEGALOOP_PEER_MEMORY chooses the peer memory."""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np
import torch.distributed as dist

import megaloop as ml
from megaloop.plan import make_plan
from megaloop.runtime.distributed import DistributedLoopKernel
from megaloop.runtime.loop import LoopKernelError

TIMEOUT_S = 2.0


def main() -> int:
    # torchrun stops the other workers once one has failed (SIGTERM, SIGKILL 30 s later): rank 0 must
    # outlive that long enough for its watchdog to fire and to report
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    graphs = ml.spmd(lambda g: g.output("y", ml.all_reduce(g.input("x", (64,), ml.float32) * 2.0)), 2)
    k = DistributedLoopKernel(make_plan(graphs, processors=2), timeout_s=TIMEOUT_S)
    x = {"x": np.ones(64, np.float32)}
    first = k.run(x)["y"]
    # both runs done: rank 0 no longer reads rank 1's memory of this iteration when rank 1 dies
    dist.barrier()
    if rank == 1:
        print("rank 1: killing itself", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if not np.all(first == 4.0):
        print(f"KILLED-PEER FAIL: the first run gave {first[:4]}..., expected 4.0", flush=True)
        os._exit(1)
    if k._line_up:  # such a run would wait in a barrier for the dead rank instead of in the kernel
        print("KILLED-PEER FAIL: run() starts with a barrier, though no peer reads a host-written buffer", flush=True)
        os._exit(1)
    start = time.monotonic()
    try:
        k.run(x)
        outcome = "FAIL: the second run finished without rank 1"
    except LoopKernelError as e:
        outcome = f"error after {time.monotonic() - start:.1f} s: {e}"
    except Exception as e:
        outcome = f"FAIL: {type(e).__name__} after {time.monotonic() - start:.1f} s: {e}"
    print(f"KILLED-PEER peer_memory={k.peer_memory} {outcome}", flush=True)
    try:  # informational: with a dead peer, stop() must not hang or free what was shared
        k.stop()
        print("STOP returned", flush=True)
    except LoopKernelError as e:
        print(f"STOP raised: {e}", flush=True)
    os._exit(0)  # no process-group teardown with a dead peer


if __name__ == "__main__":
    sys.exit(main())

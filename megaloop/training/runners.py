"""Where a training graph runs: each runner holds the graph's states between runs of many
iterations (steps), reads back the few it is asked for (the loss history, the weights for a
checkpoint), and does no host work between the iterations of one run.

- ``reference``: ``ml.evaluate``, the numpy definition (slow: every op in float64 and rounded);
- ``cpu``: the fast CPU path (megaloop.reference.fast): the same ops with numpy's BLAS, the
  reference's bits except attention (within its accuracy contract);
- ``gpu``: the loop kernel, launched once; ``run(n)`` rings its doorbell for n iterations.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from megaloop.errors import UsageError
from megaloop.frontend.graph import Graph
from megaloop.reference import evaluate
from megaloop.reference.fast import FastGraph

BACKENDS = ("cpu", "reference", "gpu")


class ReferenceRunner:
    def __init__(self, graph: Graph, state: Mapping[str, Any]) -> None:
        self.graph, self.state = graph, dict(state)

    def run(self, iterations: int) -> None:
        self.state = evaluate(self.graph, {}, state=self.state, iterations=iterations).state

    def read(self, names: Sequence[str]) -> dict[str, np.ndarray]:
        return {n: np.asarray(self.state[n]) for n in names}

    def close(self) -> None:
        pass


class FastRunner:
    def __init__(self, graph: Graph, state: Mapping[str, Any]) -> None:
        self.fast = FastGraph(graph, {})
        self.fast.reset(state)

    def run(self, iterations: int) -> None:
        self.fast.run({}, iterations)

    def read(self, names: Sequence[str]) -> dict[str, np.ndarray]:
        return self.fast.read_state(list(names))

    def close(self) -> None:
        pass


class GpuRunner:
    """The loop kernel on GPU ``device`` (planned for all its processors)."""

    def __init__(self, graph: Graph, state: Mapping[str, Any], device: int = 0, progress: bool = False) -> None:
        from megaloop.plan import make_plan
        from megaloop.runtime.device import gpus
        from megaloop.runtime.loop import LoopKernel

        found, reason = gpus()
        if not found:
            raise UsageError(f"--backend gpu: no GPU ({reason}); train on the CPU with --backend cpu (slow)")
        self.gpu = found[device]
        plan = make_plan(graph, processors=self.gpu.sm_count, arch=self.gpu.plan_arch)
        self.kernel = LoopKernel(plan, None, state, device=device, progress=progress, timeout_s=120.0)

    def run(self, iterations: int) -> None:
        self.kernel.run(None, iterations=iterations)

    def read(self, names: Sequence[str]) -> dict[str, np.ndarray]:
        return self.kernel.state(list(names))

    def close(self) -> None:
        self.kernel.stop()


def make_runner(backend: str, graph: Graph, state: Mapping[str, Any], progress: bool = False) -> Any:
    if backend not in BACKENDS:
        raise UsageError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "gpu":
        return GpuRunner(graph, state, progress=progress)
    return (FastRunner if backend == "cpu" else ReferenceRunner)(graph, state)

"""Where a training graph runs: each runner holds the graph's states between runs of many
iterations (steps), reads back the few it is asked for (the loss history, the weights for a
checkpoint), and does no host work between the iterations of one run.

- ``reference``: ``ml.evaluate``, the numpy definition (slow: every op in float64 and rounded);
- ``cpu``: the fast CPU path (megaloop.reference.fast): the same ops with numpy's BLAS, the
  reference's bits except attention (within its accuracy contract);
- ``gpu``: the loop kernel, launched once; ``run(n)`` rings its doorbell for n iterations.

Several ranks (a split step): ``cpu`` and ``reference`` run every rank's graph on the numpy
reference (``ml.evaluate`` of the ranks together: slower still); ``gpu`` runs a ``LoopKernelGroup``,
rank r on GPU ``gpus[r]`` (ranks may share a GPU, each kernel on its share of the SMs).
Every runner has ``run(n)``, ``read(names)`` (a name from the first rank holding it),
``read_ranks(names)`` (one dict a rank, of the names it holds) and ``close()``.
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

    def read_ranks(self, names: Sequence[str]) -> list[dict[str, np.ndarray]]:
        return [self.read([n for n in names if n in self.state])]

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

    def read_ranks(self, names: Sequence[str]) -> list[dict[str, np.ndarray]]:
        return [self.read([n for n in names if n in self.fast.graph.states])]

    def close(self) -> None:
        pass


class GpuRunner:
    """The loop kernel on GPU ``device`` (planned for all its processors)."""

    def __init__(self, graph: Graph, state: Mapping[str, Any], device: int = 0, progress: bool = False) -> None:
        from megaloop.plan.cache import load_or_make_plan
        from megaloop.runtime.device import gpus
        from megaloop.runtime.loop import LoopKernel

        found, reason = gpus()
        if not found:
            raise UsageError(f"--backend gpu: no GPU ({reason}); train on the CPU with --backend cpu (slow)")
        self.gpu = found[device]
        plan, _ = load_or_make_plan(graph, processors=self.gpu.sm_count, arch=self.gpu.plan_arch)
        self.kernel = LoopKernel(plan, None, state, device=device, progress=progress, timeout_s=120.0)

    def run(self, iterations: int) -> None:
        self.kernel.run(None, iterations=iterations)

    def read(self, names: Sequence[str]) -> dict[str, np.ndarray]:
        return self.kernel.state(list(names))

    def read_ranks(self, names: Sequence[str]) -> list[dict[str, np.ndarray]]:
        return [self.read([n for n in names if n in self.kernel.rp.graph.states])]

    def close(self) -> None:
        self.kernel.stop()


class RanksReferenceRunner:
    """Every rank's graph on the numpy reference, the ranks' collectives and transfers between them."""

    def __init__(self, graphs: Sequence[Graph], states: Sequence[Mapping[str, Any]]) -> None:
        self.graphs, self.states = list(graphs), [dict(s) for s in states]

    def run(self, iterations: int) -> None:
        results = evaluate(self.graphs, None, None, self.states, iterations=iterations)
        self.states = [r.state for r in results]

    def read(self, names: Sequence[str]) -> dict[str, np.ndarray]:
        return _first_holder(names, self.read_ranks(names))

    def read_ranks(self, names: Sequence[str]) -> list[dict[str, np.ndarray]]:
        return [{n: np.asarray(st[n]) for n in names if n in st} for st in self.states]

    def close(self) -> None:
        pass


class RanksGpuRunner:
    """The ranks' loop kernels (``LoopKernelGroup``): rank r on GPU ``gpus[r]`` (None: rank r on GPU
    r, or round robin over the GPUs there are, sharing them); each planned for the SMs of its GPU
    over the ranks sharing it."""

    def __init__(
        self,
        graphs: Sequence[Graph],
        states: Sequence[Mapping[str, Any]],
        gpus: Sequence[int] | None = None,
        progress: bool = False,
    ) -> None:
        from megaloop.plan.cache import load_or_make_plan
        from megaloop.runtime.device import gpus as visible
        from megaloop.runtime.group import LoopKernelGroup

        found, reason = visible()
        if not found:
            raise UsageError(f"--backend gpu: no GPU ({reason}); train on the CPU with --backend cpu (slow)")
        ranks = len(graphs)
        devices = list(gpus) if gpus is not None else [r % len(found) for r in range(ranks)]
        if len(devices) != ranks or any(not 0 <= d < len(found) for d in devices):
            raise UsageError(
                f"gpus {devices}: give one GPU for each of the {ranks} ranks, each one of the {len(found)} visible"
            )
        self.gpu = found[devices[0]]
        share = min(found[d].sm_count // devices.count(d) for d in devices)
        plan, _ = load_or_make_plan(list(graphs), processors=share, arch=self.gpu.plan_arch)
        self.group = LoopKernelGroup(plan, None, list(states), devices=devices, timeout_s=120.0, progress=progress)
        self.devices = devices

    def run(self, iterations: int) -> None:
        self.group.run(None, iterations=iterations)

    def read(self, names: Sequence[str]) -> dict[str, np.ndarray]:
        return _first_holder(names, self.read_ranks(names))

    def read_ranks(self, names: Sequence[str]) -> list[dict[str, np.ndarray]]:
        out = []
        for k in self.group.kernels:
            held = k.rp.graph.states
            out.append(k.state([n for n in names if n in held]))
        return out

    def close(self) -> None:
        self.group.stop()


def _first_holder(names: Sequence[str], ranks: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    out = {}
    for n in names:
        holder = next((r for r in ranks if n in r), None)
        if holder is None:
            raise UsageError(f"no rank holds a state named {n!r}")
        out[n] = holder[n]
    return out


def make_runner(backend: str, graph: Graph, state: Mapping[str, Any], progress: bool = False) -> Any:
    if backend not in BACKENDS:
        raise UsageError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "gpu":
        return GpuRunner(graph, state, progress=progress)
    return (FastRunner if backend == "cpu" else ReferenceRunner)(graph, state)


def make_ranks_runner(
    backend: str,
    graphs: Sequence[Graph],
    states: Sequence[Mapping[str, Any]],
    gpus: Sequence[int] | None = None,
    progress: bool = False,
) -> Any:
    """A runner of several ranks' graphs (module docstring)."""
    if backend not in BACKENDS:
        raise UsageError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "gpu":
        return RanksGpuRunner(graphs, states, gpus, progress)
    return RanksReferenceRunner(graphs, states)

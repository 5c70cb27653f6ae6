"""Where the engine's step runs: the CPU (the step graphs prepared once, megaloop.reference.fast), the
CPU reference (``ml.evaluate`` of them, their states kept here) or one loop kernel resident on a GPU
(their states in the kernel's arena). Each is given the engine's programs (name -> step graph, over
one set of states: megaloop/serving/step.py) and takes the same four calls: ``write`` states
(whole), ``run`` n steps of one program, ``read`` states, ``close``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from megaloop.errors import MegaloopError
from megaloop.frontend.graph import Graph
from megaloop.generation.progress import Progress
from megaloop.reference import evaluate
from megaloop.reference.fast import FastGraph


def initial_state(graph: Graph) -> dict[str, np.ndarray]:
    """Every state's first value: its init, else zeros."""
    out = {}
    for name, t in graph.states.items():
        init = t.node.attrs.get("init")
        out[name] = np.array(init) if init is not None else np.zeros(t.shape, t.dtype.np)
    return out


def _checked(programs: Mapping[str, Graph] | Graph) -> dict[str, Graph]:
    return {"mixed": programs} if isinstance(programs, Graph) else dict(programs)


class CpuStep:
    """The CPU: each program's graph prepared once (megaloop.reference.fast: the weights converted once,
    shared with the Generator's graphs where ``params`` is its ComputeWeights; BLAS products; the page
    pools written in place), one set of states handed to the program that runs. Its values are
    ml.evaluate's but for attention's order of sums (within attention's contract:
    tests/test_serving_engine.py holds it to ReferenceStep)."""

    name = "cpu"

    def __init__(self, programs: Mapping[str, Graph] | Graph, params: Mapping[str, Any],
                 progress: Progress | None = None, plan_cache: bool = True) -> None:  # fmt: skip
        self.programs: dict[str, FastGraph] = {}
        for name, graph in _checked(programs).items():
            fast = FastGraph(graph, params if not self.programs else next(iter(self.programs.values())).weights)
            if self.programs:  # (one copy of the states: the first program's, its pools included)
                fast.set_state(self.fast.state, adopt=True)
            else:
                self.fast = fast
            self.programs[name] = fast
        self.description = "the CPU (numpy and BLAS)"

    def write(self, states: Mapping[str, np.ndarray]) -> None:
        self.fast.set_state(states)

    def run(self, iterations: int, program: str = "mixed") -> None:
        step = self.programs[program]
        if step is not self.fast:
            step.set_state(self.fast.state, adopt=True)
            self.fast = step
        step.run(iterations=iterations)

    def read(self, names: Sequence[str]) -> dict[str, np.ndarray]:
        return self.fast.read_state(names)

    def close(self) -> None:
        for step in self.programs.values():
            step.state = {}


class ReferenceStep:
    """The numpy reference: each run evaluates the program's graph n times, the states carried here
    (the definition; the weights converted on every step)."""

    name = "reference"

    def __init__(self, programs: Mapping[str, Graph] | Graph, params: Mapping[str, Any],
                 progress: Progress | None = None, plan_cache: bool = True) -> None:  # fmt: skip
        self.programs, self.params = _checked(programs), params
        self.state = initial_state(next(iter(self.programs.values())))
        self.description = "the CPU reference (numpy): slow, for checking"

    def write(self, states: Mapping[str, np.ndarray]) -> None:
        self.state.update({k: np.array(v) for k, v in states.items()})

    def run(self, iterations: int, program: str = "mixed") -> None:
        self.state = evaluate(self.programs[program], {}, self.params, self.state, iterations=iterations).state

    def read(self, names: Sequence[str]) -> dict[str, np.ndarray]:
        return {n: self.state[n] for n in names}

    def close(self) -> None:
        self.state = {}


class GpuStep:
    """One loop kernel that stays resident while the engine lives, holding every program (a plan of
    several programs, megaloop/plan/programs.py; each cached on disk), compiled (cached), the weights
    uploaded once; a run rings the doorbell for n steps of one program."""

    name = "gpu"

    def __init__(self, programs: Mapping[str, Graph] | Graph, params: Mapping[str, Any], progress: Progress,
                 plan_cache: bool = True, gpu: Any = None) -> None:  # fmt: skip
        from megaloop.codegen import generate
        from megaloop.plan.cache import make_programs
        from megaloop.runtime import gpus
        from megaloop.runtime.compile import compile_cubin
        from megaloop.runtime.loop import LoopKernel

        if gpu is None:
            found, reason = gpus()
            if not found:
                raise MegaloopError(f"no GPU for the loop kernel: {reason}")
            gpu = found[0]
        self.description = f"the loop kernel on {gpu.name} ({gpu.arch}, {gpu.sm_count} SMs)"
        graphs = _checked(programs)
        with progress.phase("plan", len(graphs), unit="graph") as bar:
            self.plan = make_programs(graphs, use_cache=plan_cache, processors=gpu.sm_count, arch=gpu.plan_arch)
            program = generate(self.plan)
            bar.update(len(graphs))
        with progress.phase("compile", 1, unit="kernel") as bar:
            compile_cubin(program.source, gpu.arch)  # (cached on disk: LoopKernel finds it there)
            bar.update(1)
        nbytes = sum(int(np.asarray(v).nbytes) for v in params.values())
        with progress.phase("upload", nbytes, unit="B", unit_scale=True) as bar:
            first = next(iter(graphs.values()))
            self.kernel = LoopKernel(self.plan, params, initial_state(first), program=program, device=gpu.index)
            bar.update(nbytes)

    def write(self, states: Mapping[str, np.ndarray]) -> None:
        if states:
            self.kernel.set_state(states)

    def run(self, iterations: int, program: str = "mixed") -> None:
        self.kernel.start(iterations, program=program)  # (not run(): it would read the outputs back every time)
        self.kernel.wait()

    def read(self, names: Sequence[str]) -> dict[str, np.ndarray]:
        return self.kernel.state(names)

    def close(self) -> None:
        if self.kernel is not None:
            self.kernel.stop()
            self.kernel = None


class _Ranks:
    """The step split over devices (``ml.parallelize``): each state written as its ranks' pieces, read
    back put together from the ranks that hold them."""

    def __init__(self, graph: Graph, params: Mapping[str, Any], devices: int, strategy: str) -> None:
        from megaloop.parallel import parallelize

        self.split = parallelize(graph, devices, strategy)
        self.params = self.split.shard_parameters(params)
        self.how = self.split.describe().splitlines()[0].partition(": ")[2]

    def pieces(self, states: Mapping[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        return self.split.shard_state(states)

    def names(self, names: Sequence[str]) -> list[list[str]]:
        """Per rank, the local names of its pieces of ``names``."""
        wanted = set(names)
        return [
            sorted(n.attrs["name"] for n, info in part.sources.items() if info.kind == "state" and info.name in wanted)
            for part in self.split.parts
        ]

    def gather(self, states: Sequence[Mapping[str, np.ndarray]], names: Sequence[str]) -> dict[str, np.ndarray]:
        whole = self.split.gather_state(states)
        return {n: whole[n] for n in names}


class SplitCpuStep:
    """The CPU reference over N ranks: the ranks' step graphs in one ``ml.evaluate``, exchanges included
    (the mixed step only: the engine builds no decode-only programs for several devices)."""

    name = "cpu"

    def __init__(self, programs: Mapping[str, Graph] | Graph, params: Mapping[str, Any], progress: Progress,
                 plan_cache: bool = True, devices: int = 2, strategy: str = "auto") -> None:  # fmt: skip
        graph = _checked(programs)["mixed"]
        with progress.phase("split", 1, unit="graph"):
            self.ranks = _Ranks(graph, params, devices, strategy)
        self.state = self.ranks.pieces(initial_state(graph))
        self.description = f"the CPU reference (numpy) as {devices} ranks: {self.ranks.how}"

    def write(self, states: Mapping[str, np.ndarray]) -> None:
        for mine, piece in zip(self.state, self.ranks.pieces(states)):
            mine.update({k: np.array(v) for k, v in piece.items()})

    def run(self, iterations: int, program: str = "mixed") -> None:
        r = self.ranks
        results = evaluate(r.split.graphs, [{}] * r.split.world_size, r.params, self.state, iterations=iterations)
        self.state = [x.state for x in results]

    def read(self, names: Sequence[str]) -> dict[str, np.ndarray]:
        return self.ranks.gather(self.state, names)

    def close(self) -> None:
        self.state = []


class SplitGpuStep:
    """N loop kernels (``LoopKernelGroup``), resident while the engine lives: rank r on GPU r mod the
    GPUs found, ranks sharing a GPU with its SMs divided between them (the mixed step only)."""

    name = "gpu"

    def __init__(self, programs: Mapping[str, Graph] | Graph, params: Mapping[str, Any], progress: Progress,
                 plan_cache: bool = True, devices: int = 2, strategy: str = "auto") -> None:  # fmt: skip
        graph = _checked(programs)["mixed"]
        from megaloop.plan.cache import load_or_make_plan
        from megaloop.runtime import gpus
        from megaloop.runtime.group import LoopKernelGroup

        found, reason = gpus()
        if not found:
            raise MegaloopError(f"no GPU for the loop kernels: {reason}")
        self.gpus = [r % len(found) for r in range(devices)]
        share = max(self.gpus.count(d) for d in set(self.gpus))
        processors = min(found[d].sm_count for d in set(self.gpus)) // share
        with progress.phase("split", 1, unit="graph"):
            self.ranks = _Ranks(graph, params, devices, strategy)
        with progress.phase("plan", 1, unit="graph"):
            plan, _ = load_or_make_plan(self.ranks.split.graphs, use_cache=plan_cache, processors=processors,
                                        arch=found[self.gpus[0]].plan_arch)  # fmt: skip
        with progress.phase("upload", 1, unit="group"):  # (the group compiles its ranks' kernels too)
            state = self.ranks.pieces(initial_state(graph))
            self.group: Any = LoopKernelGroup(plan, self.ranks.params, state, devices=self.gpus)
        self.description = f"{devices} loop kernels on {len(set(self.gpus))} GPU(s) ({found[0].name}): {self.ranks.how}"

    def write(self, states: Mapping[str, np.ndarray]) -> None:
        for kernel, piece in zip(self.group.kernels, self.ranks.pieces(states)):
            if piece:
                kernel.set_state(piece)

    def run(self, iterations: int, program: str = "mixed") -> None:
        self.group.start(iterations)
        self.group.wait()

    def read(self, names: Sequence[str]) -> dict[str, np.ndarray]:
        local = self.ranks.names(names)
        return self.ranks.gather([k.state(n) for k, n in zip(self.group.kernels, local)], names)

    def close(self) -> None:
        if self.group is not None:
            self.group.stop()
            self.group = None

"""Generation split over several devices (``Generator(devices=N)``, ``megaloop generate --devices N``).

Both graphs a backend runs, the padded prefill and the self-feeding generator, are split by
``ml.parallelize`` (tp, pp, dp, or auto: the cost model's pick, made for each graph on its own). The
ranks run on the CPU reference as N ranks of one ``ml.evaluate``, or on the GPU as N loop kernels of
one ``LoopKernelGroup`` (rank r on GPU r mod the GPUs there are: ranks sharing a GPU split its SMs).
The prefill's KV caches are put back together on the host and cut again for the generator, so the
two graphs may be split differently.

dp cuts the batch of prompts: each device runs its share of the sequences with every weight; a
batch smaller than the devices is refused (auto never picks dp for it). What one device gives and
what a split gives (docs/generate.md): pp and dp compute every value as one device does; tp adds
partial sums in rank order, so float32 logits differ by reassociation (about 1e-6 relative) and a
token can differ only where the two best logits (greedy) or a sampled draw lie that close.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from megaloop.errors import MegaloopError
from megaloop.fuse import fuse
from megaloop.generation.backends import generator_graph, history_names, start_state
from megaloop.generation.progress import Progress
from megaloop.models.decoding import PLAIN, Decoding
from megaloop.models.llama import LlamaConfig, build_llama_prefill
from megaloop.parallel import Partition, parallelize
from megaloop.reference import evaluate

STRATEGIES = ("auto", "tp", "pp", "dp")


def problem(devices: Any, strategy: Any, cfg: LlamaConfig | None, batch: int | None = None) -> str | None:
    """Why ``devices`` and ``strategy`` cannot split ``cfg``'s generation (a batch of ``batch``
    prompts, where known; without ``cfg``, the arguments alone), in words; None when they can."""
    if isinstance(devices, bool) or not isinstance(devices, (int, np.integer)) or devices < 1:
        return f"devices must be an int >= 1 (the number of devices to split the model over), got {devices!r}"
    if strategy not in STRATEGIES:
        return f"strategy must be one of {STRATEGIES}, got {strategy!r}"
    if cfg is not None and devices > 1 and strategy == "tp" and devices > cfg.kv_heads:
        return (
            f"devices {devices} with strategy 'tp': tensor parallelism splits attention by key/value heads (each "
            f"with its query heads) and this model has {cfg.kv_heads}, so at most {cfg.kv_heads} devices; use "
            "strategy 'pp' or 'auto' for more"
        )
    if devices > 1 and strategy == "dp" and batch is not None and batch < devices:
        return (
            f"devices {devices} with strategy 'dp': data parallelism gives each device its own prompts, and a batch "
            f"of {batch} prompt{'s' * (batch > 1)} cannot fill {devices} devices; give at least {devices} prompts "
            "or use strategy 'tp', 'pp' or 'auto'"
        )
    return None


class Split:
    """The prefill's and the generator's partitions, and each rank's parameters (views)."""

    def __init__(self, prefill: Any, generator: Any, params: Mapping[str, Any], devices: int, strategy: str) -> None:
        self.devices, self.strategy = devices, strategy
        # fused before the split (megaloop.fuse, docs/fuse.md): the partitioner prices the fused ops and
        # keeps each whole by its placement rules; make_plan fuses each rank's graph again
        self.prefill: Partition = parallelize(fuse(prefill), devices, strategy)
        self.generator: Partition = parallelize(fuse(generator), devices, strategy)
        self.params = [self.prefill.shard_parameters(params), self.generator.shard_parameters(params)]

    def summary(self) -> str:
        """One line: how each graph was split, what that divides, and the predicted step against one
        device's (``Partition.summary``)."""
        how = [p.summary() for p in (self.prefill, self.generator)]
        return f"split over {self.devices} devices ({self.strategy}): prefill {how[0]}; generator {how[1]}"

    @property
    def ranks(self) -> tuple[int, int]:
        """The prefill's and the generator's rank counts (auto may keep one on one device)."""
        return self.prefill.world_size, self.generator.world_size

    def history(self, states: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """The generator's HISTORY states put together from the ranks' (each rank's full state or
        just its pieces of those)."""
        names = local_names(self.generator, history_names(self.generator.original))
        mine = [{k: v for k, v in st.items() if k in keep} for st, keep in zip(states, names)]
        return self.generator.gather_state(mine)

    def generator_state(self, caches: Mapping[str, np.ndarray], start: Mapping[str, np.ndarray]) -> list[dict]:
        """Each rank's first generator state: the prefill's caches (whole) and the start states, cut."""
        whole = {**caches, **start_state(self.generator.original, start)}
        return self.generator.shard_state({k: v for k, v in whole.items() if k in self.generator.original.states})


def _ranks_text(ranks: tuple[int, int]) -> str:
    """ "2 ranks", or "2 ranks for the prefill, 1 for the generator" where auto kept one whole."""
    prefill, generator = ranks
    if prefill == generator:
        return f"{prefill} rank{'s' * (prefill > 1)}"
    return f"{prefill} rank{'s' * (prefill > 1)} for the prefill, {generator} for the generator"


def local_names(partition: Partition, names: Sequence[str]) -> list[set[str]]:
    """Per rank, the local names of its pieces of the single-device states ``names``."""
    return [
        {node.attrs["name"] for node, info in part.sources.items() if info.kind == "state" and info.name in names}
        for part in partition.parts
    ]


def _graphs(
    cfg: LlamaConfig, batch: int, tokens: int, sampling: bool, eos_ids: Sequence[int], decoding: Decoding
) -> tuple[Any, Any]:
    return build_llama_prefill(cfg, batch, tokens), generator_graph(cfg, batch, sampling, eos_ids, decoding)


class SplitCpuBackend:
    """The CPU reference over N ranks: ``ml.evaluate`` of the ranks' graphs, exchanges included."""

    name = "cpu"

    def __init__(
        self, cfg: LlamaConfig, params: Mapping[str, Any], batch: int, tokens: int, *, sampling: bool,
        eos_ids: Sequence[int], progress: Progress, plan_cache: bool = True, devices: int = 2, strategy: str = "auto",
        decoding: Decoding = PLAIN,
    ) -> None:  # fmt: skip
        with progress.phase("split", 2, unit="graph"):
            self.split = Split(*_graphs(cfg, batch, tokens, sampling, eos_ids, decoding), params, devices, strategy)
        self.description = f"the CPU reference (numpy) as {_ranks_text(self.split.ranks)}"
        self.state: list[dict[str, np.ndarray]] = []
        self.caches: dict[str, np.ndarray] = {}

    def setup_prefill(self) -> None:
        pass

    def prefill(self, feeds: Mapping[str, np.ndarray]) -> np.ndarray:
        p = self.split.prefill
        results = evaluate(p.graphs, p.shard_inputs(feeds), self.split.params[0])
        self.caches = p.gather_state([r.state for r in results])
        return p.gather_outputs(results)["logits"]

    def setup_generator(self, start: Mapping[str, np.ndarray]) -> None:
        self.state = self.split.generator_state(self.caches, start)
        self.caches = {}

    def advance(self, iterations: int) -> dict[str, np.ndarray]:
        g = self.split.generator
        results = evaluate(g.graphs, [{}] * g.world_size, self.split.params[1], self.state, iterations=iterations)
        self.state = [r.state for r in results]
        return self.split.history(self.state)

    def chunk(self, step: int) -> int:
        return 1

    def close(self) -> None:
        self.state, self.caches = [], {}


class SplitGpuBackend:
    """N loop kernels (``LoopKernelGroup``) for the prefill, then N for the generator, the caches
    handed over through the host as the single-device backend does. Rank r runs on GPU r mod the
    GPUs found; ranks sharing a GPU get its SMs divided between them."""

    name = "gpu"

    def __init__(
        self, cfg: LlamaConfig, params: Mapping[str, Any], batch: int, tokens: int, *, sampling: bool,
        eos_ids: Sequence[int], progress: Progress, plan_cache: bool = True, devices: int = 2, strategy: str = "auto",
        decoding: Decoding = PLAIN,
    ) -> None:  # fmt: skip
        from megaloop.plan.cache import load_or_make_plan
        from megaloop.runtime import gpus

        found, reason = gpus()
        if not found:
            raise MegaloopError(f"no GPU for the loop kernels: {reason}")
        arch = {found[r % len(found)].plan_arch for r in range(devices)}
        if len(arch) > 1:
            raise MegaloopError(f"--devices {devices}: the GPUs differ ({sorted(arch)}); one plan serves one kind")
        self.progress = progress
        with progress.phase("split", 2, unit="graph"):
            self.split = Split(*_graphs(cfg, batch, tokens, sampling, eos_ids, decoding), params, devices, strategy)
        # per graph (auto may keep one on one device): rank r on GPU r mod the GPUs, sharing its SMs
        self.devices = [[r % len(found) for r in range(n)] for n in self.split.ranks]
        shares = [max(d.count(x) for x in set(d)) for d in self.devices]
        processors = [min(found[x].sm_count for x in set(d)) // k for d, k in zip(self.devices, shares)]
        used = len(set(self.devices[0]) | set(self.devices[1]))
        self.description = (
            f"{_ranks_text(self.split.ranks).replace('rank', 'loop kernel')} on {used} GPU{'s' * (used > 1)} "
            f"({found[0].name}"
            + (f", {max(shares)} ranks a GPU of {min(processors)} SMs each" if max(shares) > 1 else "")
            + ")"
        )
        self.plans = []
        with progress.phase("plan", 2, unit="graph") as bar:
            for part, share in zip((self.split.prefill, self.split.generator), processors):
                plan, _ = load_or_make_plan(
                    part.graphs, use_cache=plan_cache, processors=share, arch=found[0].plan_arch
                )
                self.plans.append(plan)
                bar.update(1)
        self.group: Any = None
        wanted = history_names(self.split.generator.original)
        self.history_names = [sorted(n) for n in local_names(self.split.generator, wanted)]

    def _group(self, which: int, state: Sequence[Mapping[str, Any]] | None = None) -> Any:
        from megaloop.runtime.group import LoopKernelGroup

        self.close()
        phase = "upload" if which == 0 else "upload generator"  # (the group compiles its ranks' kernels too)
        with self.progress.phase(phase, 1, unit="group"):
            params, devices = self.split.params[which], self.devices[which]
            self.group = LoopKernelGroup(self.plans[which], params, state, devices=devices)
        return self.group

    def setup_prefill(self) -> None:
        self._group(0)

    def prefill(self, feeds: Mapping[str, np.ndarray]) -> np.ndarray:
        p = self.split.prefill
        return p.gather_outputs(self.group.run(p.shard_inputs(feeds)))["logits"]

    def setup_generator(self, start: Mapping[str, np.ndarray]) -> None:
        caches = self.split.prefill.gather_state(self.group.state())
        self._group(1, self.split.generator_state(caches, start))

    def advance(self, iterations: int) -> dict[str, np.ndarray]:
        self.group.run(iterations=iterations)
        states = [k.state(names) for k, names in zip(self.group.kernels, self.history_names)]
        return self.split.history(states)

    def chunk(self, step: int) -> int:
        return min(16, 1 << min(step, 4))

    def close(self) -> None:
        if self.group is not None:
            self.group.stop()
            self.group = None

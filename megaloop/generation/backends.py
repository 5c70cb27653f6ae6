"""Where generation runs: the CPU (the graphs prepared once and run by megaloop.reference.fast), the
CPU reference (``ml.evaluate`` of the graphs: the definition, slow) or the GPU's loop kernels. All
run the same two graphs: a padded prefill that returns each sequence's next-token logits
(``build_llama_prefill``), then the self-feeding generator (``build_llama_generator``), its KV caches
handed over from the prefill.

A backend's steps, in order: ``setup_prefill`` (GPU: upload the weights into the prefill kernel),
``prefill`` (each prompt's next-token logits), ``setup_generator`` (the caches handed over; GPU: the
generator kernel), then ``advance(n)`` as often as needed, and ``close``.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from megaloop.errors import MegaloopError
from megaloop.frontend.graph import Graph
from megaloop.frontend.ops._fast import TORCH_MIN_WEIGHT, TORCH_ROWS
from megaloop.frontend.tensor import Tensor
from megaloop.fuse import FuseOptions, fuse
from megaloop.generation.progress import Progress
from megaloop.models.decoding import PLAIN, Decoding
from megaloop.models.llama import LlamaConfig, build_llama_generator, build_llama_prefill
from megaloop.reference import evaluate
from megaloop.reference.fast import ComputeWeights, FastGraph

HISTORY = ("generated", "token", "position")  # the generator's states a step's tokens are read from


def history_names(graph: Graph) -> tuple[str, ...]:
    """The states read after each run: HISTORY, and the log-probabilities where the graph records them."""
    return HISTORY + (("logprobs",) if "logprobs" in graph.states else ())


def generator_graph(
    cfg: LlamaConfig, batch: int, sampling: bool, eos_ids: Sequence[int], decoding: Decoding = PLAIN
) -> Graph:
    """The self-feeding generator, stopping each sequence in the kernel at its stop position or at one
    of ``eos_ids``; with ``sampling``, drawing the tokens (temperature, top-k, top-p, min-p, seed
    states); ``decoding``: penalties and log-probabilities (megaloop.models.decoding)."""
    return build_llama_generator(cfg, batch, sampling=sampling, eos_ids=tuple(eos_ids), decoding=decoding)


def start_state(graph: Graph, start: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The generator's first states: those of ``start`` the graph has (a graph without in-kernel
    stopping has no ``stop``)."""
    return {k: v for k, v in start.items() if k in graph.states}


def first_tokens(logits: np.ndarray, lengths: Sequence[int], states: Mapping[str, np.ndarray] | None) -> np.ndarray:
    """Each sequence's first new token from its [1, vocab] prefill logits, as the generator chooses the
    next ones from its ``states`` (megaloop.models.decoding): penalised where it has the penalties'
    states (nothing generated yet, the prompt's tokens); greedy, the argmax (first index on ties);
    sampled, drawn with the same op's definition, seed, and the offset of the logits' position,
    prompt length - 1."""
    rows, states = logits[:, -1].astype(np.float32), states or {}
    if "repetition_penalty" in states:
        from megaloop.frontend.ops.sample_penalty import penalized

        per_row = [states[k] for k in ("repetition_penalty", "presence_penalty", "frequency_penalty")]
        rows = penalized(rows, states["token_counts"][:, 0], states["prompt_tokens"][:, 0], *per_row)
    if "temperature" not in states:
        return rows.argmax(-1).astype(np.int64)
    from megaloop.frontend.ops.sample import sample_tokens

    offset = np.asarray(lengths, np.int64) - 1
    seed, temperature, top_k, top_p = (states[k][:, 0] for k in ("seed", "temperature", "top_k", "top_p"))
    min_p = states["min_p"][:, 0] if "min_p" in states else 0.0
    return np.asarray(sample_tokens(rows, seed, offset, temperature, top_k, top_p, min_p), np.int64)


def prefill_products(weights: ComputeWeights, cfg: LlamaConfig, graph: Graph) -> str:
    """The prefill's products: "torch" for a bfloat16 model where ``weights`` allow torch's ("torch", or
    "auto" on a machine with bfloat16 dot products) and some weight is twinned (ComputeWeights.twinned:
    large enough for torch's to be faster); else "numpy". torch's import is started when the model
    loads (Generator), so the prefill rarely waits for it: no length threshold."""
    if weights.products == "numpy" or cfg.dtype.name != "bfloat16":
        return "numpy"
    return "torch" if any(weights.twinned(t) for t in graph.parameters.values()) else "numpy"


def prefill_activations(weights: ComputeWeights, cfg: LlamaConfig, graph: Graph, rows: int) -> str:
    """Whether the prefill runs in torch form (FastGraph's ``activations``): "torch" where ``weights``
    allow it and it was asked for, or ("auto") for a prefill of TORCH_ROWS rows or more with a weight of
    TORCH_MIN_WEIGHT values or more (a tiny model's ops are faster in numpy) whose products torch makes
    faster (a float32 model's; a bfloat16 one's where the CPU has bfloat16 dot products); else "numpy"."""
    if weights.activations == "numpy":
        return "numpy"
    if weights.requested_activations == "torch":
        return "torch"
    large = any(t.size >= TORCH_MIN_WEIGHT for t in graph.parameters.values())
    fast_products = cfg.dtype.name != "bfloat16" or weights.products == "torch"
    return "torch" if rows >= TORCH_ROWS and large and fast_products else "numpy"


class CpuBackend:
    """The CPU: both graphs prepared once (megaloop.reference.fast), the weights converted to float32
    once (kept by ``params`` where it is a ComputeWeights, as Generator's is), BLAS products, the KV
    caches kept in place and handed from the prefill to the generator without a copy. Its values are
    ml.evaluate's but for attention's order of sums (within attention's accuracy contract), and for
    the prefill's products where the weights' ``products`` is "torch" (bfloat16 products by torch),
    and the whole prefill where its ``activations`` is (prefill_activations: torch's kernels in the
    model's dtype, each op within its accuracy contract). A linear layer is one product here (the
    GPU's split-K ranges fill its processors; here they would be two products and a sum)."""

    name = "cpu"
    fusion = FuseOptions().without("split_k_linear")

    def __init__(
        self, cfg: LlamaConfig, params: Mapping[str, Any], batch: int, tokens: int, *, sampling: bool,
        eos_ids: Sequence[int], progress: Progress, plan_cache: bool = True, decoding: Decoding = PLAIN,
    ) -> None:  # fmt: skip
        self.params = params
        # fused as make_plan fuses the GPU's (megaloop.fuse), but for the backend's ``fusion``
        self.prefill_graph = fuse(build_llama_prefill(cfg, batch, tokens), self.fusion)
        self.generator = fuse(generator_graph(cfg, batch, sampling, eos_ids, decoding), self.fusion)
        self.history = history_names(self.generator)
        self.progress = progress
        self.runs: tuple[FastGraph, FastGraph] | None = None
        self.weights = params if isinstance(params, ComputeWeights) else ComputeWeights(params)
        self.products = prefill_products(self.weights, cfg, self.prefill_graph)
        self.activations = prefill_activations(self.weights, cfg, self.prefill_graph, batch * tokens)

    @property
    def description(self) -> str:
        if self.activations == "torch":
            return "the CPU (numpy and BLAS; the prefill by torch)"
        torch = self.products == "torch"
        return "the CPU (numpy and BLAS" + ("; the prefill's bfloat16 products by torch)" if torch else ")")

    def setup_prefill(self) -> None:
        if self.runs is not None:
            return
        weights, graphs = self.weights, (self.prefill_graph, self.generator)
        if self.activations == "torch":
            self.runs = (self._prefill_ahead(), None)
            return
        torch = {g: g is graphs[0] and self.products == "torch" for g in graphs}  # (twins)
        self._convert([(n, t, torch[g]) for g in graphs for n, t in g.parameters.items()])
        prefill = FastGraph(graphs[0], weights, products=self.products, activations=self.activations)
        self.runs = (prefill, FastGraph(graphs[1], weights))

    def _prefill_ahead(self) -> FastGraph:
        """The prefill in torch form, what it needs made on the weights' ``ahead`` thread while it runs,
        each op waiting for its own (docs/generate.md, start to first token): a float32 model's float32
        weights in the prefill's order, a bfloat16 model's packed weights (torch form reads the
        checkpoint's bfloat16 memory as it is); the decode's float32 copies on the weights' ``later``
        thread (a lower priority: cores the prefill leaves idle). A setup phase ("convert") is what
        the decode still waits for after the prefill (setup_generator)."""
        weights, graph = self.weights, self.prefill_graph
        weights.convert_ahead((n, t) for n, t in graph.parameters.items() if weights.copied_for_torch(n, t))
        prefill = FastGraph(graph, weights, activations="torch")  # (torch imported)
        prefill.prepare_ahead()  # (bfloat16: each linear layer's weight packed for oneDNN, once a backend)
        weights.convert_ahead(self.generator.parameters.items(), later=True)  # (after torch's import: it slowed)
        return prefill

    def _decode_run(self) -> FastGraph:
        """The generator's graph on the float32 weights: those still being made ahead waited for, as the
        "convert" setup phase."""
        self._convert([(n, t, False) for n, t in self.generator.parameters.items()])
        return FastGraph(self.generator, self.weights)

    def _convert(self, wanted: list[tuple[str, Tensor, bool]]) -> None:
        """The weights (name, tensor, torch's twin) not made yet, made here as the "convert" setup phase
        (a Generator's weights are converted by its first call only)."""
        weights = self.weights
        todo = [(n, t, twin) for n, t, twin in wanted if not weights.has(n, t, twin)]
        if todo:
            with self.progress.phase("convert", sum(t.size for _, t, _ in todo), unit="weight", unit_scale=True) as bar:
                for name, t, twin in todo:
                    weights.get(name, t, twin)
                    bar.update(t.size)

    def prefill(self, feeds: Mapping[str, np.ndarray]) -> np.ndarray:
        if self.runs is None:  # (callers that go straight to the prefill, as the reference allowed)
            self.setup_prefill()
        run = self.runs[0]
        run.reset()  # (the caches of an earlier prefill went to the generator)
        with self.progress.steps("prefill", len(run.nodes), unit="op") as bar:
            return run.run(feeds, on_node=(lambda i: bar.update(1)) if self.progress.enabled else None)["logits"]

    def setup_generator(self, start: Mapping[str, np.ndarray]) -> None:
        prefill, generator = self.runs
        if generator is None:
            generator = self._decode_run()
            self.runs = (prefill, generator)
        generator.reset()
        generator.set_state(prefill.state, adopt=True)  # the caches, no copy
        generator.set_state(start_state(self.generator, start))
        prefill.reset()

    def advance(self, iterations: int) -> dict[str, np.ndarray]:
        self.runs[1].run(iterations=iterations)
        return self.runs[1].read_state(self.history)

    def chunk(self, step: int) -> int:
        """Iterations per advance: one, so that text streams token by token."""
        return 1

    def close(self) -> None:
        if self.runs is not None:
            for run in self.runs:
                if run is not None:
                    run.reset()


class ReferenceBackend(CpuBackend):
    """The CPU reference: ``ml.evaluate`` of the prefill, then of the generator for n iterations (the
    definition every other backend is tested against; the weights converted on every step)."""

    name = "reference"
    description = "the CPU reference (numpy)"
    fusion = FuseOptions()  # (the GPU's graphs, split-K ranges included)

    def setup_prefill(self) -> None:
        self.state: dict[str, np.ndarray] = {}

    def prefill(self, feeds: Mapping[str, np.ndarray]) -> np.ndarray:
        out = evaluate(self.prefill_graph, feeds, self.params)
        self.state = out.state
        return out.outputs["logits"]

    def setup_generator(self, start: Mapping[str, np.ndarray]) -> None:
        self.state = {**self.state, **start_state(self.generator, start)}

    def advance(self, iterations: int) -> dict[str, np.ndarray]:
        self.state = evaluate(self.generator, {}, self.params, self.state, iterations=iterations).state
        return {n: self.state[n] for n in self.history}

    def close(self) -> None:
        self.state = {}


class GpuBackend:
    """The loop kernels: one for the prefill, then one for the generator that runs ``advance(n)``'s
    n tokens with no host work between them (the prefill's caches copied over through the host:
    two loop kernels cannot be resident at once)."""

    name = "gpu"

    def __init__(
        self, cfg: LlamaConfig, params: Mapping[str, Any], batch: int, tokens: int, *, sampling: bool,
        eos_ids: Sequence[int], progress: Progress, plan_cache: bool = True, gpu: Any = None,
        decoding: Decoding = PLAIN,
    ) -> None:  # fmt: skip
        from megaloop.codegen import generate
        from megaloop.plan.cache import load_or_make_plan
        from megaloop.runtime import gpus
        from megaloop.runtime.compile import compile_cubin

        if gpu is None:
            found, reason = gpus()
            if not found:
                raise MegaloopError(f"no GPU for the loop kernel: {reason}")
            gpu = found[0]
        self.gpu, self.params, self.progress = gpu, params, progress
        self.description = f"the loop kernel on {gpu.name} ({gpu.arch}, {gpu.sm_count} SMs)"
        graphs = [build_llama_prefill(cfg, batch, tokens), generator_graph(cfg, batch, sampling, eos_ids, decoding)]
        self.generator = graphs[1]
        self.history = history_names(self.generator)
        self.plans, self.programs = [], []
        # NVRTC releases the GIL: the prefill kernel (the slower to compile) compiles in a thread
        # while the generator is planned; "compile" is then what is left to wait for
        pool = concurrent.futures.ThreadPoolExecutor(len(graphs), thread_name_prefix="megaloop-nvrtc")
        try:
            compiling = []
            with progress.phase("plan", len(graphs), unit="graph") as bar:
                for g in graphs:
                    plan, _ = load_or_make_plan(g, use_cache=plan_cache, processors=gpu.sm_count, arch=gpu.plan_arch)
                    self.plans.append(plan)
                    self.programs.append(generate(plan))
                    compiling.append(pool.submit(compile_cubin, self.programs[-1].source, gpu.arch))  # cached on disk
                    bar.update(1)
            with progress.phase("compile", len(graphs), unit="kernel") as bar:
                for future in compiling:
                    future.result()
                    bar.update(1)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)  # an error need not wait for a compile
        self.param_bytes = sum(int(np.asarray(v).nbytes) for v in params.values())
        self.kernel: Any = None
        self.state: dict[str, np.ndarray] = {}

    def _kernel(self, which: int, state: Mapping[str, Any] | None = None) -> Any:
        from megaloop.runtime.loop import LoopKernel

        if self.kernel is not None:
            self.kernel.stop()
            self.kernel = None
        # The upload happens inside LoopKernel(); the bar can only mark it done (a per-tensor hook
        # would belong to the runtime). The generator's upload comes after the first token.
        phase = "upload" if which == 0 else "upload generator"
        with self.progress.phase(phase, self.param_bytes, unit="B", unit_scale=True) as bar:
            self.kernel = LoopKernel(self.plans[which], self.params, state, program=self.programs[which])
            bar.update(self.param_bytes)
        return self.kernel

    def setup_prefill(self) -> None:
        self._kernel(0)

    def prefill(self, feeds: Mapping[str, np.ndarray]) -> np.ndarray:
        return self.kernel.run(feeds)["logits"]

    def setup_generator(self, start: Mapping[str, np.ndarray]) -> None:
        caches = self.kernel.state()  # the prefill graph's states are its KV caches
        self._kernel(1, {**caches, **start_state(self.generator, start)})

    def advance(self, iterations: int) -> dict[str, np.ndarray]:
        self.kernel.run(iterations=iterations)
        return self.kernel.state(self.history)  # a few small states: the KV caches stay on the GPU

    def chunk(self, step: int) -> int:
        """Iterations per advance: 1, 2, 4, ... up to 16, so that the first tokens show at once and
        later ones cost one doorbell and one read of the history per 16 tokens."""
        return min(16, 1 << min(step, 4))

    def close(self) -> None:
        if self.kernel is not None:
            self.kernel.stop()
            self.kernel = None


def timed(fn: Any, *args: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0

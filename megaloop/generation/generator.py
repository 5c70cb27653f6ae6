"""``megaloop.Generator``: text in, text out, from a Hugging Face checkpoint folder.

    gen = megaloop.Generator("Llama-3.2-1B-Instruct")          # the loop kernel, or the CPU reference
    result = gen.generate("The capital of France is", max_new_tokens=32)
    print(result[0].text, result.stats.summary())
    gen.generate(["Hi", "A longer prompt"], chat=True)          # several prompts of any lengths at once
    gen.generate("Tell a story", temperature=0.8, min_p=0.05, stop=["\\n\\n"], n=3, logprobs=5)

Prompts of a batch are padded to one prefill step; each sequence's first token comes from its own
last prompt position and the generator then advances every sequence from its own position (the
same tokens as generating it alone). A sequence ends at one of the model's end-of-sequence tokens,
at one of its stop strings or after its max_new_tokens. Settings not given come from the
checkpoint's generation_config.json, then megaloop's defaults (megaloop.generation.settings).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from megaloop.errors import MegaloopError
from megaloop.generation.backends import CpuBackend, GpuBackend, ReferenceBackend, first_tokens
from megaloop.generation.progress import Progress
from megaloop.generation.requests import Batch, build_batch, chat_messages, start_states
from megaloop.generation.sequences import Completion, Sequences, host_logprobs
from megaloop.generation.settings import GenerationError, GenerationSettings, read_generation_config
from megaloop.generation.split import SplitCpuBackend, SplitGpuBackend, problem
from megaloop.models.checkpoint import load_llama
from megaloop.models.llama import LlamaConfig
from megaloop.models.tokenizer import Tokenizer, checkpoint_stop_ids
from megaloop.reference.fast import ACTIVATIONS, PRODUCTS, ComputeWeights

Prompt = str | Sequence[int] | Sequence[dict]  # text, token ids, or a conversation (chat messages)

__all__ = ["Completion", "GenerationError", "GenerationInterrupted", "GenerationResult", "GenerationStats", "Generator"]


@dataclass
class GenerationStats:
    """Times of one ``generate`` call. ``prefill_s``: the prompts to their first tokens; ``decode_s``:
    the generator's runs (``decode_steps`` iterations, one token of every sequence each). ``seed``: the
    seed of a sampled call (``seed_drawn``: megaloop drew it); ``from_file``: the settings
    generation_config.json decided (name -> how the file says it)."""

    backend: str
    batch: int
    prompt_tokens: list[int]
    prefill_s: float = 0.0
    first_token_s: float = 0.0  # from the call (the first: from loading the folder) to the first tokens
    handoff_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0
    new_tokens: int = 0
    setup: dict[str, float] = field(default_factory=dict)
    split: str = ""  # how the graphs were split over devices (one line of Partition.describe)
    seed: int | None = None
    seed_drawn: bool = False
    from_file: dict[str, str] = field(default_factory=dict)
    interrupted: bool = False

    @property
    def per_token_s(self) -> float | None:
        return self.decode_s / self.decode_steps if self.decode_steps else None

    @property
    def tokens_per_s(self) -> float | None:
        """Tokens of all sequences made by the generator's steps, per second of them."""
        decoded = self.new_tokens - self.batch
        return decoded / self.decode_s if self.decode_steps and self.decode_s > 0 else None

    def summary(self) -> str:
        prompt = "+".join(map(str, self.prompt_tokens)) if self.batch <= 4 else f"{sum(self.prompt_tokens)} in all"
        parts = [f"{self.backend}: {self.batch} sequence{'s' * (self.batch > 1)}, prompt {prompt} tokens"]
        if self.interrupted:
            parts.append(f"interrupted after {self.new_tokens} new tokens")
        if self.prefill_s:
            parts.append(f"prefill {1e3 * self.prefill_s:.1f} ms (first token after {self.first_token_s:.2f} s)")
        if self.decode_steps:
            parts.append(
                f"{self.decode_steps} decode steps in {self.decode_s:.2f} s: {1e3 * self.per_token_s:.2f} ms/token, "
                f"{self.tokens_per_s:.1f} tokens/s"
            )
        if self.setup:
            parts.append("setup " + ", ".join(f"{k} {v:.1f} s" for k, v in self.setup.items()))
        return "; ".join(parts)


@dataclass
class GenerationResult(Sequence[Completion]):
    """The completions, in prompt order (a prompt's n sequences together), and the call's ``stats``."""

    completions: list[Completion]
    stats: GenerationStats

    def __getitem__(self, i: Any) -> Any:
        return self.completions[i]

    def __len__(self) -> int:
        return len(self.completions)

    @property
    def texts(self) -> list[str]:
        return [c.text for c in self.completions]


class GenerationInterrupted(KeyboardInterrupt):
    """Ctrl-C (KeyboardInterrupt) during ``generate``: ``result`` holds what was generated until then
    (unfinished sequences' finish_reason "interrupted"), the backend already closed."""

    def __init__(self, result: GenerationResult) -> None:
        super().__init__("generation interrupted")
        self.result = result


BACKENDS = ("auto", "cpu", "gpu", "reference")


class Generator:
    """A checkpoint folder (config.json, safetensors, and tokenizer.json for text prompts) ready to
    generate. ``backend``: "gpu" (the loop kernel), "cpu" (the CPU: megaloop.reference.fast, weights
    converted once and kept), "reference" (ml.evaluate, the definition: slow), "auto" (the loop kernel
    where there is a GPU, else "cpu"). ``dtype`` overrides the config's; ``max_seq`` caps the context
    (default: the model's max_position_embeddings); ``eos_token_ids`` replaces the checkpoint's stop
    tokens; ``progress`` shows setup bars on stderr (None: when it is a terminal); ``plan_cache``
    keeps plans on disk (megaloop.plan.cache). ``devices`` > 1 splits both graphs over that many
    devices with ``ml.parallelize``'s ``strategy`` ("auto", "tp", "pp", "dp"; megaloop.generation.split).
    ``allow_long_context`` lets ``max_seq`` pass the model's context, ``allow_unknown_fields`` loads a
    config.json with fields megaloop does not know (megaloop.models.load_llama). ``cpu_products``: the
    CPU's products, "numpy" (the reference's bits but for attention's sums), "torch" (a prefill's
    bfloat16 products by torch) or "auto" (torch's for a prefill's products of large bfloat16 weights,
    where torch is installed and the CPU has bfloat16 dot products: backends.prefill_products).
    ``cpu_activations``: the CPU prefill's values between ops, "numpy" (float32 compute form), "torch"
    (torch tensors of the model's dtype, every op torch's where it has a kernel) or "auto" (torch where
    it is installed and makes the prefill faster, unless ``cpu_products`` is "numpy":
    backends.prefill_activations).
    ``defaults``: generation_config.json's settings (megaloop.generation.settings)."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        backend: str = "auto",
        dtype: Any = None,
        max_seq: int | None = None,
        eos_token_ids: Sequence[int] | None = None,
        progress: bool | None = None,
        plan_cache: bool = True,
        devices: int = 1,
        strategy: str = "auto",
        allow_long_context: bool = False,
        allow_unknown_fields: bool = False,
        cpu_products: str = "auto",
        cpu_activations: str = "auto",
    ) -> None:
        if backend not in BACKENDS:
            raise GenerationError(f"Generator: backend must be one of {BACKENDS}, got {backend!r}")
        if cpu_products not in PRODUCTS:
            raise GenerationError(f"Generator: cpu_products must be one of {PRODUCTS}, got {cpu_products!r}")
        if cpu_activations not in ACTIVATIONS:
            raise GenerationError(f"Generator: cpu_activations must be one of {ACTIVATIONS}, got {cpu_activations!r}")
        if (why := problem(devices, strategy, None)) is not None:  # before loading: the model's part after
            raise GenerationError(f"Generator: {why}")
        self.devices, self.strategy = devices, strategy
        self.folder = Path(model_dir)
        self.progress = Progress(progress)
        with self.progress.phase("load", 1, unit="model"):
            self.cfg, params = load_llama(
                self.folder, max_seq=max_seq, dtype=dtype, allow_long_context=allow_long_context,
                allow_unknown_fields=allow_unknown_fields,
            )  # fmt: skip
            # (the CPU converts each weight once, when first used)
            self.params = ComputeWeights(params, cpu_products, cpu_activations)
            has_tokenizer = (self.folder / "tokenizer.json").is_file()
            self.tokenizer: Tokenizer | None = Tokenizer.from_folder(self.folder) if has_tokenizer else None
            self.defaults = read_generation_config(self.folder)
        if (why := problem(devices, strategy, self.cfg)) is not None:
            raise GenerationError(f"Generator: {why}")
        if eos_token_ids is not None:
            stops = [int(i) for i in eos_token_ids]
        elif self.tokenizer is not None:
            stops = list(self.tokenizer.eos_token_ids)
        else:
            stops = checkpoint_stop_ids(self.folder)
        # (a tokenizer's stop token past the model's vocabulary can never be generated)
        self.eos_token_ids = tuple(i for i in stops if 0 <= i < self.cfg.vocab)
        self.requested, self.plan_cache = backend, plan_cache
        self.backend, self.reason = self._choose(backend)
        if self.backend == "cpu" and (self.cfg.dtype.name == "bfloat16" or self.params.activations == "torch"):
            self.params.import_torch_early()  # (for the prefill, where it may be torch's)
        self._backends: dict[tuple, Any] = {}
        self._setup_reported: dict[str, float] = {}

    @staticmethod
    def _choose(backend: str) -> tuple[str, str]:
        from megaloop.runtime import gpus

        if backend in ("cpu", "reference"):
            return backend, "asked for"
        found, reason = gpus()
        if found:
            return "gpu", f"{found[0].name}"
        if backend == "gpu":
            raise GenerationError(f"backend 'gpu', but there is no GPU ({reason})")
        return "cpu", reason

    # ---- prompts -----------------------------------------------------------------------------------
    def encode(self, prompt: Prompt, chat: bool = False, system: str | None = None) -> list[int]:
        """A prompt's token ids: text (with the tokenizer's special tokens, or through the chat
        template with ``chat``, after a ``system`` message where given), a conversation (a list of
        message dicts: the chat template), or ids."""
        is_text = isinstance(prompt, str)
        conversation = isinstance(prompt, Sequence) and bool(prompt) and all(isinstance(m, dict) for m in prompt)
        if (is_text and (chat or system is not None)) or conversation:
            messages = chat_messages(prompt if is_text else list(prompt), system, "a chat prompt")
            text = self._tokenizer("a chat prompt").apply_chat_template(messages, add_generation_prompt=True)
            ids = self._tokenizer("a chat prompt").encode(text, add_special_tokens=False)
        elif is_text:
            ids = self._tokenizer("a text prompt").encode(prompt)
        elif isinstance(prompt, (Sequence, np.ndarray)) and all(
            isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in prompt
        ):
            if system is not None:
                raise GenerationError("a system prompt needs a text or a conversation, not token ids")
            ids = [int(i) for i in prompt]
        else:
            raise GenerationError(
                f"a prompt is a str, a list of token ids or a list of chat messages, got {type(prompt).__name__} "
                f"{prompt!r:.80}"
            )
        bad = [i for i in ids if not 0 <= i < self.cfg.vocab]
        if bad:
            raise GenerationError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.cfg.vocab})")
        if not ids:
            raise GenerationError("the prompt is empty (no tokens): give at least one token")
        return ids

    def _tokenizer(self, what: str) -> Tokenizer:
        if self.tokenizer is None:
            raise GenerationError(f"{self.folder} has no tokenizer.json, so {what} cannot be encoded: give token ids")
        return self.tokenizer

    # ---- generation --------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        *,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        seed: int | Sequence[int] | None = None,
        stop: str | Sequence[str] | None = None,
        n: int | None = None,
        logprobs: int | None = None,
        chat: bool = False,
        system: str | None = None,
        settings: GenerationSettings | Sequence[GenerationSettings] | None = None,
        on_text: Callable[[int, str], None] | None = None,
    ) -> GenerationResult:
        """Complete one prompt or a batch of them (``Prompt``: text, token ids or a conversation).
        The settings (megaloop.generation.settings; None: not given here): temperature 0 is greedy,
        top_k 0, top_p 1, min_p 0 and the penalties 1, 0, 0 are off; ``stop`` strings end a sequence
        (not included in its text); ``n`` sequences per prompt; ``logprobs`` N: each token's
        log-probability and the N likeliest alternatives (Completion.logprobs). ``seed``: one for the
        call, sequence r drawing with seed + r (so that copies of a prompt differ), or one per prompt;
        any int (mod 2^64); a sampled call without one draws one (``stats.seed``). A sequence's tokens
        depend on its seed alone, not on the rest of the batch. ``settings``: per-prompt settings (one,
        or one per prompt) that win over the arguments. ``chat``/``system``: text through the chat
        template. ``on_text(index, text)`` receives each sequence's text as it is generated (index:
        the sequence's row, the prompt's when n is 1). Ctrl-C raises GenerationInterrupted with the
        partial result."""
        items = [prompts] if _is_single(prompts) else list(prompts)
        if not items:
            raise GenerationError("generate: no prompts")
        ids = [self.encode(p, chat, system) for p in items]
        prompt_seeds = None
        if seed is not None and not (isinstance(seed, int) and not isinstance(seed, bool)):
            if not isinstance(seed, Sequence) or len(seed) != len(ids):
                raise GenerationError(f"generate: seed must be an int or one int per prompt ({len(ids)}), got {seed!r}")
            prompt_seeds = [GenerationSettings(seed=s).checked("generate").seed for s in seed]
            seed = None
        call = GenerationSettings(
            max_new_tokens, temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty,
            frequency_penalty, seed, stop, n, logprobs,
        ).checked("generate")  # fmt: skip
        per_prompt = _per_prompt(settings, len(ids))
        batch = build_batch(ids, call, per_prompt, prompt_seeds, self.defaults, self.cfg.max_seq)
        if any(r.settings.stop for r in batch.rows) and self.tokenizer is None:
            raise GenerationError(f"stop strings need the text: {self.folder} has no tokenizer.json")
        try:
            return self._run(batch, on_text)
        except _SetupFailed as e:  # the loop kernel could not be set up: say so, then the CPU
            print(f"megaloop: the loop kernel failed ({e}); running on the CPU instead", file=sys.stderr)
            self.backend, self.reason = "cpu", "the loop kernel failed"
            return self._run(batch, on_text)

    def _backend_for(self, batch: Batch) -> tuple[Any, int, int]:
        rows, lengths = len(batch.rows), batch.lengths
        cls = {"gpu": GpuBackend, "cpu": CpuBackend, "reference": ReferenceBackend}[self.backend]
        split = {"devices": self.devices, "strategy": self.strategy} if self.devices > 1 else {}
        if split:
            cls = SplitGpuBackend if self.backend == "gpu" else SplitCpuBackend
            if (why := problem(self.devices, self.strategy, self.cfg, rows)) is not None:
                raise GenerationError(f"generate: {why}")
        need, longest = max((n + k, n) for n, k in zip(lengths, batch.new))
        if need > self.cfg.max_seq:
            raise GenerationError(
                f"a prompt of {longest} tokens and max_new_tokens {need - longest} need {need} positions; the context "
                f"is {self.cfg.max_seq} (max_position_embeddings or max_seq): shorten the prompt or generate fewer "
                "tokens"
            )
        if cls.name == "gpu":  # sizes rounded up, so that plans and kernels serve many requests
            max_seq = min(self.cfg.max_seq, _pow2(max(need, 64)))
            tokens = min(max_seq, _pow2(max(max(lengths), 8)))
        else:  # the CPU computes what it is given: no padding beyond the batch's longest prompt
            max_seq, tokens = need, max(lengths)
        key = (cls.name, rows, tokens, max_seq, batch.sampling, batch.decoding)
        if key not in self._backends:
            cfg = _with_context(self.cfg, max_seq)
            try:
                backend = cls(
                    cfg, self.params, rows, tokens, sampling=batch.sampling, eos_ids=self.eos_token_ids,
                    progress=self.progress, plan_cache=self.plan_cache, decoding=batch.decoding, **split,
                )  # fmt: skip
            except MegaloopError as e:
                if cls.name == "gpu" and self.requested == "auto" and not isinstance(e, GenerationError):
                    raise _SetupFailed(f"{type(e).__name__}: {e}") from e
                raise
            self._backends = {key: backend}  # one at a time: a GPU backend holds its plans and kernels
        return self._backends[key], tokens, max_seq

    def _run(self, batch: Batch, on_text: Callable[[int, str], None] | None) -> GenerationResult:
        ids, lengths = [r.ids for r in batch.rows], batch.lengths
        before = dict(self._setup_reported)  # setup phases since the last call (the first: the load too)
        began = time.perf_counter() - (self.progress.seconds.get("load", 0.0) if not before else 0.0)
        backend, tokens, _ = self._backend_for(batch)
        stats = GenerationStats(backend.description, len(ids), lengths, seed=batch.seed, seed_drawn=batch.seed_drawn)
        stats.from_file = dict(batch.from_file)
        stats.split = backend.split.summary() if hasattr(backend, "split") else ""
        run = Sequences(
            ids, batch.new, self.eos_token_ids, self.tokenizer, on_text,
            stops=[r.settings.stop for r in batch.rows], logprobs=[r.settings.logprobs for r in batch.rows],
        )  # fmt: skip
        states = start_states(batch, self.cfg.vocab)
        interrupted = False
        try:
            self._generate(batch, backend, tokens, run, states, stats, began)
        except KeyboardInterrupt:
            interrupted = stats.interrupted = True
        finally:
            backend.close()
        completions = run.finish(interrupted)
        for c, r in zip(completions, batch.rows):
            c.index, c.sample, c.seed = r.index, r.sample, r.seed
        stats.new_tokens = sum(len(c.tokens) + (c.finish_reason == "stop" and isinstance(c.stop, int))
                               for c in completions)  # fmt: skip
        stats.setup = {k: v - before.get(k, 0.0) for k, v in self.progress.seconds.items() if v > before.get(k, 0.0)}
        self._setup_reported = dict(self.progress.seconds)
        result = GenerationResult(completions, stats)
        if interrupted:
            raise GenerationInterrupted(result)
        return result

    def _generate(
        self, batch: Batch, backend: Any, tokens: int, run: Sequences, states: dict, stats: GenerationStats,
        began: float,
    ) -> None:  # fmt: skip
        """The prefill, the first tokens, then the generator's runs until every sequence has ended."""
        lengths = batch.lengths
        try:
            backend.setup_prefill()
        except MegaloopError as e:
            if backend.name == "gpu" and self.requested == "auto":
                raise _SetupFailed(f"{type(e).__name__}: {e}") from e
            raise
        feeds = _prefill_feeds([r.ids for r in batch.rows], tokens)
        t0 = time.perf_counter()
        logits = backend.prefill(feeds)
        first = first_tokens(logits, lengths, states)
        stats.prefill_s = time.perf_counter() - t0
        stats.first_token_s = time.perf_counter() - began
        records = None
        if batch.decoding.logprobs is not None:
            records = host_logprobs(logits[:, -1], first, batch.decoding.logprobs)[:, None]
        run.add(first[:, None], np.ones(len(lengths), np.int64), records)
        if not run.done():
            t0 = time.perf_counter()
            backend.setup_generator({**self._start(first, lengths, batch.new), **states})
            stats.handoff_s = time.perf_counter() - t0
        step = 0
        while not run.done():
            n = min(backend.chunk(step), run.steps_left())
            t0 = time.perf_counter()
            history = backend.advance(n)
            stats.decode_s += time.perf_counter() - t0
            stats.decode_steps += n
            step += 1
            run.add_history(history, lengths)

    def _start(self, first: np.ndarray, lengths: list[int], new: list[int]) -> dict[str, np.ndarray]:
        """The generator's states after the prefill: each sequence's first token at its position, and
        the position where it stops (its new-th token made: L + new - 1)."""
        b = len(lengths)
        position = np.array(lengths, np.int64).reshape(b, 1)
        return {"token": first.reshape(b, 1), "position": position, "stop": position + np.reshape(new, (b, 1)) - 1}


class _SetupFailed(MegaloopError):
    """The GPU backend could not be set up (the caller falls back to the CPU reference)."""


def _per_prompt(settings: Any, count: int) -> list[GenerationSettings]:
    """Per-prompt settings, checked: none, one for every prompt, or one per prompt."""
    if settings is None:
        return [GenerationSettings()] * count
    if isinstance(settings, GenerationSettings):
        return [settings.checked("generate: settings")] * count
    items = list(settings)
    if len(items) != count or not all(isinstance(s, GenerationSettings) for s in items):
        raise GenerationError(f"generate: settings must be one GenerationSettings or one per prompt ({count})")
    return [s.checked(f"generate: settings[{i}]") for i, s in enumerate(items)]


def _is_single(prompts: Any) -> bool:
    if isinstance(prompts, (str, np.ndarray)) and not (isinstance(prompts, np.ndarray) and prompts.ndim == 2):
        return True
    if isinstance(prompts, Sequence) and prompts and all(isinstance(x, dict) for x in prompts):
        return True  # one conversation
    return isinstance(prompts, Sequence) and bool(prompts) and all(isinstance(x, (int, np.integer)) for x in prompts)


def _prefill_feeds(ids: list[list[int]], tokens: int) -> dict[str, np.ndarray]:
    """The prompts padded on the right to ``tokens`` (the padding's cache rows are overwritten by
    the generated tokens before any query sees them), and each one's last position."""
    batch = len(ids)
    padded = np.zeros((batch, tokens), np.int64)
    for b, p in enumerate(ids):
        padded[b, : len(p)] = p
    return {
        "tokens": padded,
        "positions": np.broadcast_to(np.arange(tokens, dtype=np.int64), (batch, tokens)).copy(),
        "last": np.array([len(p) - 1 for p in ids], np.int64),
    }


def _with_context(cfg: LlamaConfig, max_seq: int) -> LlamaConfig:
    """``cfg`` with a KV cache of ``max_seq`` positions (a sliding window that cannot drop a key of
    it left out)."""
    window = cfg.sliding_window
    if window is not None and window >= max_seq:
        return dataclasses.replace(cfg, max_seq=max_seq, sliding_window=None, sliding_layers=None)
    return dataclasses.replace(cfg, max_seq=max_seq)


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()

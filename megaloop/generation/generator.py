"""``megaloop.Generator``: text in, text out, from a Hugging Face checkpoint folder.

    gen = megaloop.Generator("Llama-3.2-1B-Instruct")          # the loop kernel, or the CPU reference
    result = gen.generate("The capital of France is", max_new_tokens=32)
    print(result[0].text, result.stats.summary())
    gen.generate(["Hi", "A longer prompt"], chat=True)          # several prompts of any lengths at once

Prompts of a batch are padded to one prefill step; each sequence's first token comes from its own
last prompt position and the generator then advances every sequence from its own position (the
same tokens as generating it alone). A sequence ends at one of the model's end-of-sequence tokens
or after ``max_new_tokens``.
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
from megaloop.generation.backends import CpuBackend, GpuBackend, first_tokens
from megaloop.generation.progress import Progress
from megaloop.generation.split import SplitCpuBackend, SplitGpuBackend, problem
from megaloop.models.checkpoint import load_llama
from megaloop.models.llama import LlamaConfig
from megaloop.models.tokenizer import Tokenizer, checkpoint_stop_ids

Prompt = str | Sequence[int] | Sequence[dict]  # text, token ids, or a conversation (chat messages)


class GenerationError(MegaloopError, ValueError):
    """A generation request megaloop cannot serve as asked (prompt, lengths, settings)."""


@dataclass
class Completion:
    """One sequence's result: its prompt's token ids, the generated ids (without the end-of-sequence
    token that stopped it), their text, and why it ended ("stop": an end-of-sequence token,
    "length": max_new_tokens)."""

    prompt_tokens: list[int]
    tokens: list[int]
    text: str
    finish_reason: str


@dataclass
class GenerationStats:
    """Times of one ``generate`` call. ``prefill_s``: the prompts to their first tokens; ``decode_s``:
    the generator's runs (``decode_steps`` iterations, one token of every sequence each)."""

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
    """The completions, in prompt order, and the call's ``stats``."""

    completions: list[Completion]
    stats: GenerationStats

    def __getitem__(self, i: Any) -> Any:
        return self.completions[i]

    def __len__(self) -> int:
        return len(self.completions)

    @property
    def texts(self) -> list[str]:
        return [c.text for c in self.completions]


BACKENDS = ("auto", "cpu", "gpu")


class Generator:
    """A checkpoint folder (config.json, safetensors, and tokenizer.json for text prompts) ready to
    generate. ``backend``: "gpu" (the loop kernel), "cpu" (the numpy reference), "auto" (the loop
    kernel where there is a GPU). ``dtype`` overrides the config's; ``max_seq`` caps the context
    (default: the model's max_position_embeddings); ``eos_token_ids`` replaces the checkpoint's stop
    tokens; ``progress`` shows setup bars on stderr (None: when it is a terminal); ``plan_cache``
    keeps plans on disk (megaloop.plan.cache). ``devices`` > 1 splits both graphs over that many
    devices with ``ml.parallelize``'s ``strategy`` ("auto", "tp", "pp", "dp"; megaloop.generation.split).
    ``allow_long_context`` lets ``max_seq`` pass the model's context, ``allow_unknown_fields`` loads a
    config.json with fields megaloop does not know (megaloop.models.load_llama)."""

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
    ) -> None:
        if backend not in BACKENDS:
            raise GenerationError(f"Generator: backend must be one of {BACKENDS}, got {backend!r}")
        if (why := problem(devices, strategy, None)) is not None:  # before loading: the model's part after
            raise GenerationError(f"Generator: {why}")
        self.devices, self.strategy = devices, strategy
        self.folder = Path(model_dir)
        self.progress = Progress(progress)
        with self.progress.phase("load", 1, unit="model"):
            self.cfg, self.params = load_llama(
                self.folder, max_seq=max_seq, dtype=dtype, allow_long_context=allow_long_context,
                allow_unknown_fields=allow_unknown_fields,
            )  # fmt: skip
            has_tokenizer = (self.folder / "tokenizer.json").is_file()
            self.tokenizer: Tokenizer | None = Tokenizer.from_folder(self.folder) if has_tokenizer else None
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
        self._backends: dict[tuple, Any] = {}
        self._setup_reported: dict[str, float] = {}

    @staticmethod
    def _choose(backend: str) -> tuple[str, str]:
        from megaloop.runtime import gpus

        if backend == "cpu":
            return "cpu", "asked for"
        found, reason = gpus()
        if found:
            return "gpu", f"{found[0].name}"
        if backend == "gpu":
            raise GenerationError(f"backend 'gpu', but there is no GPU ({reason})")
        return "cpu", reason

    # ---- prompts -----------------------------------------------------------------------------------
    def encode(self, prompt: Prompt, chat: bool = False) -> list[int]:
        """A prompt's token ids: text (with the tokenizer's special tokens, or through the chat
        template with ``chat``), a conversation (a list of message dicts: the chat template), or ids."""
        if isinstance(prompt, str):
            if chat:
                return self.encode([{"role": "user", "content": prompt}])
            ids = self._tokenizer("a text prompt").encode(prompt)
        elif isinstance(prompt, Sequence) and prompt and all(isinstance(m, dict) for m in prompt):
            text = self._tokenizer("a chat prompt").apply_chat_template(list(prompt), add_generation_prompt=True)
            ids = self._tokenizer("a chat prompt").encode(text, add_special_tokens=False)
        elif isinstance(prompt, (Sequence, np.ndarray)) and all(
            isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in prompt
        ):
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
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | Sequence[int] = 0,
        chat: bool = False,
        on_text: Callable[[int, str], None] | None = None,
    ) -> GenerationResult:
        """Complete one prompt or a batch of them (``Prompt``: text, token ids or a conversation).
        ``temperature`` 0 is greedy; top_k 0 and top_p 1 are off. ``seed``: one per prompt, or one
        for the batch, prompt i then drawing with seed + i (so that copies of a prompt differ); a
        sequence's tokens depend on its seed alone, not on the rest of the batch. ``on_text(index,
        text)`` receives each sequence's text as it is generated."""
        items = [prompts] if _is_single(prompts) else list(prompts)
        if not items:
            raise GenerationError("generate: no prompts")
        ids = [self.encode(p, chat) for p in items]
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        sampling = _sampling(len(ids), temperature, top_k, top_p, seed)
        try:
            return self._run(ids, max_new_tokens, sampling, on_text)
        except _SetupFailed as e:  # the loop kernel could not be set up: say so, then the CPU reference
            print(f"megaloop: the loop kernel failed ({e}); running on the CPU reference instead", file=sys.stderr)
            self.backend, self.reason = "cpu", "the loop kernel failed"
            return self._run(ids, max_new_tokens, sampling, on_text)

    def _backend_for(self, batch: int, lengths: list[int], new: int, sampling: dict | None) -> tuple[Any, int, int]:
        cls = GpuBackend if self.backend == "gpu" else CpuBackend
        split = {"devices": self.devices, "strategy": self.strategy} if self.devices > 1 else {}
        if split:
            cls = SplitGpuBackend if self.backend == "gpu" else SplitCpuBackend
            if (why := problem(self.devices, self.strategy, self.cfg, batch)) is not None:
                raise GenerationError(f"generate: {why}")
        need = max(lengths) + new
        if need > self.cfg.max_seq:
            raise GenerationError(
                f"a prompt of {max(lengths)} tokens and max_new_tokens {new} need {need} positions; the context is "
                f"{self.cfg.max_seq} (max_position_embeddings or max_seq): shorten the prompt or generate fewer tokens"
            )
        if cls.name == "gpu":  # sizes rounded up, so that plans and kernels serve many requests
            max_seq = min(self.cfg.max_seq, _pow2(max(need, 64)))
            tokens = min(max_seq, _pow2(max(max(lengths), 8)))
        else:  # the reference computes what it is given: no padding beyond the batch's longest prompt
            max_seq, tokens = need, max(lengths)
        key = (cls.name, batch, tokens, max_seq, sampling is not None)
        if key not in self._backends:
            cfg = _with_context(self.cfg, max_seq)
            try:
                backend = cls(
                    cfg, self.params, batch, tokens, sampling=sampling is not None, eos_ids=self.eos_token_ids,
                    progress=self.progress, plan_cache=self.plan_cache, **split,
                )  # fmt: skip
            except MegaloopError as e:
                if cls.name == "gpu" and self.requested == "auto" and not isinstance(e, GenerationError):
                    raise _SetupFailed(f"{type(e).__name__}: {e}") from e
                raise
            self._backends = {key: backend}  # one at a time: a GPU backend holds its plans and kernels
        return self._backends[key], tokens, max_seq

    def _run(
        self, ids: list[list[int]], new: int, sampling: dict | None, on_text: Callable[[int, str], None] | None
    ) -> GenerationResult:
        batch, lengths = len(ids), [len(p) for p in ids]
        before = dict(self._setup_reported)  # setup phases since the last call (the first: the load too)
        began = time.perf_counter() - (self.progress.seconds.get("load", 0.0) if not before else 0.0)
        backend, tokens, _ = self._backend_for(batch, lengths, new, sampling)
        stats = GenerationStats(backend.description, batch, lengths)
        stats.split = backend.split.summary() if hasattr(backend, "split") else ""
        run = _Sequences(ids, new, self.eos_token_ids, self.tokenizer, on_text)
        try:
            try:
                backend.setup_prefill()
            except MegaloopError as e:
                if backend.name == "gpu" and self.requested == "auto":
                    raise _SetupFailed(f"{type(e).__name__}: {e}") from e
                raise
            feeds = _prefill_feeds(ids, tokens)
            t0 = time.perf_counter()
            first = first_tokens(backend.prefill(feeds), lengths, sampling)
            stats.prefill_s = time.perf_counter() - t0
            stats.first_token_s = time.perf_counter() - began
            run.add(first[:, None], np.ones(batch, np.int64))
            if not run.done():
                t0 = time.perf_counter()
                backend.setup_generator(self._start(first, lengths, new, sampling))
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
        finally:
            backend.close()
        completions = run.finish()
        stats.new_tokens = sum(len(c.tokens) + (c.finish_reason == "stop") for c in completions)
        stats.setup = {k: v - before.get(k, 0.0) for k, v in self.progress.seconds.items() if v > before.get(k, 0.0)}
        self._setup_reported = dict(self.progress.seconds)
        return GenerationResult(completions, stats)

    def _start(self, first: np.ndarray, lengths: list[int], new: int, sampling: dict | None) -> dict[str, np.ndarray]:
        """The generator's states after the prefill: each sequence's first token at its position, and
        the position where it stops (its new-th token made: L + new - 1)."""
        b = len(lengths)
        position = np.array(lengths, np.int64).reshape(b, 1)
        start = {"token": first.reshape(b, 1), "position": position, "stop": position + new - 1}
        if sampling is not None:
            start.update(sampling)
        return start


class _SetupFailed(MegaloopError):
    """The GPU backend could not be set up (the caller falls back to the CPU reference)."""


class _Sequences:
    """The batch's tokens as they come: cut at an end-of-sequence token or max_new_tokens, their
    text streamed to ``on_text``."""

    def __init__(self, prompts: list[list[int]], new: int, eos: Sequence[int], tokenizer: Tokenizer | None,
                 on_text: Callable[[int, str], None] | None) -> None:  # fmt: skip
        self.prompts, self.new, self.eos = prompts, new, set(eos)
        self.tokens: list[list[int]] = [[] for _ in prompts]
        self.reason: list[str | None] = [None] * len(prompts)
        self.streams = [tokenizer.stream() for _ in prompts] if tokenizer is not None else None
        self.tokenizer, self.on_text = tokenizer, on_text

    def done(self) -> bool:
        return all(r is not None for r in self.reason)

    def steps_left(self) -> int:
        return max(self.new - len(t) for t, r in zip(self.tokens, self.reason) if r is None)

    def add(self, produced: np.ndarray, counts: np.ndarray) -> None:
        """Sequence b's next ``counts[b]`` tokens, ``produced[b, :counts[b]]``."""
        for b, row in enumerate(produced):
            for token in row[: counts[b]]:
                if self.reason[b] is not None:
                    break
                token = int(token)
                if token in self.eos:
                    self.reason[b] = "stop"
                    break
                self.tokens[b].append(token)
                if self.streams is not None and self.on_text is not None:
                    piece = self.streams[b].push(token)
                    if piece:
                        self.on_text(b, piece)
                if len(self.tokens[b]) >= self.new:
                    self.reason[b] = "length"

    def add_history(self, history: dict[str, np.ndarray], lengths: list[int]) -> None:
        """After generator iterations: sequence b has made generated[b, L_b:position_b] and then
        ``token`` (the next one it would feed), of which the tokens not seen yet are new."""
        generated = history["generated"][:, 0, :, 0].astype(np.int64)
        position, token = history["position"][:, 0].astype(np.int64), history["token"][:, 0].astype(np.int64)
        rows, counts = [], []
        for b, n in enumerate(lengths):
            made = [*generated[b, n : position[b]].tolist(), int(token[b])]
            seen = len(self.tokens[b]) + (self.reason[b] == "stop")
            rows.append(made[seen:])
            counts.append(len(made) - seen)
        width = max(max(counts), 1)
        padded = np.array([r + [0] * (width - len(r)) for r in rows], np.int64)
        self.add(padded, np.array(counts))

    def finish(self) -> list[Completion]:
        out = []
        for b, prompt in enumerate(self.prompts):
            text = ""
            if self.tokenizer is not None:
                text = self.tokenizer.decode(self.tokens[b])
                if self.streams is not None and self.on_text is not None:
                    rest = self.streams[b].flush()
                    if rest:
                        self.on_text(b, rest)
            out.append(Completion(list(prompt), self.tokens[b], text, self.reason[b] or "length"))
        return out


def _is_single(prompts: Any) -> bool:
    if isinstance(prompts, (str, np.ndarray)) and not (isinstance(prompts, np.ndarray) and prompts.ndim == 2):
        return True
    if isinstance(prompts, Sequence) and prompts and all(isinstance(x, dict) for x in prompts):
        return True  # one conversation
    return isinstance(prompts, Sequence) and bool(prompts) and all(isinstance(x, (int, np.integer)) for x in prompts)


def _sampling(batch: int, temperature: Any, top_k: Any, top_p: Any, seed: Any) -> dict[str, np.ndarray] | None:
    """The sampling states of the generator (None: greedy), checked."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
        raise GenerationError(f"temperature must be a number >= 0 (0: greedy), got {temperature!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise GenerationError(f"top_k must be an int >= 0 (0: off), got {top_k!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise GenerationError(f"top_p must be a number in (0, 1] (1: off), got {top_p!r}")
    one = isinstance(seed, (int, np.integer)) and not isinstance(seed, bool)
    seeds = [int(seed) + i for i in range(batch)] if one else list(seed)  # rows apart: a batch's copies differ
    if len(seeds) != batch or not all(isinstance(s, (int, np.integer)) and not isinstance(s, bool) for s in seeds):
        raise GenerationError(f"seed must be an int or one int per prompt ({batch}), got {seed!r}")
    if temperature == 0:
        return None
    col = lambda v, dt: np.full((batch, 1), v, dt)
    return {
        "temperature": col(temperature, np.float32),
        "top_k": col(top_k, np.int64),
        "top_p": col(top_p, np.float32),
        "seed": np.array(seeds, np.int64).reshape(batch, 1),
    }


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

"""``megaloop.Engine``: a model that stays loaded and serves requests as they come, many at once.

    engine = ml.Engine("Llama-3.2-1B-Instruct", max_slots=8)     # the loop kernel, or the CPU reference
    request = engine.submit("The capital of France is", max_tokens=32)
    for delta in request:                                         # or: async for delta in request
        print(delta.text, end="")
    request.result()                                              # a Completion (tokens, text, reason)
    engine.generate(["Hi", "Hello"], temperature=0.7, seed=1)     # submit all, wait for all
    engine.close()

A background thread steps the model (megaloop/serving/step.py) over a table of ``max_slots``
sequence slots with a paged KV cache: between two runs it frees the slots of finished or cancelled
requests and admits waiting ones (first come, first served), so prompts are prefilled in chunks of
``chunk`` tokens beside the other slots' decoding. Each completion is the one the request gets alone
(docs/serving.md says why, and where the bits may differ).
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megaloop.errors import MegaloopError
from megaloop.generation.generator import GenerationError, Generator
from megaloop.generation.progress import Progress
from megaloop.generation.sequences import Completion
from megaloop.generation.split import problem
from megaloop.models.tokenizer import ChatTemplateError
from megaloop.serving.backends import CpuStep, GpuStep, ReferenceStep, SplitCpuStep, SplitGpuStep
from megaloop.serving.requests import EngineClosed, QueueFull, Request, RequestError, Settings, _Progress
from megaloop.serving.slots import Event, SlotTable
from megaloop.serving.step import PROGRESS, StepShape, build_serving_programs, decode_buckets

DEFAULT_MAX_SEQ = 2048  # the longest sequence a slot holds, unless the model's context is shorter
GPU_ITERATIONS = 8  # the most steps a run of the loop kernel takes while no request waits


class Engine:
    """A checkpoint folder (or a ``Generator`` already loaded) served by a resident step over
    ``max_slots`` slots. ``chunk``: the most prompt tokens a slot feeds in one step; ``page_size``,
    ``pages``: the paged KV cache (default: enough pages for every slot to reach ``max_seq``);
    ``max_seq``: the longest prompt + completion (default: the model's context, at most 2048);
    ``backend``: "gpu", "cpu" or "auto"; ``max_queue``: requests that may wait for a slot (more are
    refused with QueueFull); ``check_pages``: check the page pool's rules after every run (tests);
    ``devices`` > 1: the step split over that many devices by ``ml.parallelize``'s ``strategy``.
    ``decode_rows``: the row counts of the decode-only steps (default: 1, 2, 4, ... and max_slots; ()
    none): a run in which no slot has prompt tokens left to feed runs the smallest that holds every
    active slot, the others the mixed step (docs/serving.md, "Programs").
    The other keywords are ``Generator``'s (dtype, eos_token_ids, progress, plan_cache, ...)."""

    def __init__(
        self,
        model: str | Path | Generator,
        *,
        max_slots: int = 8,
        chunk: int = 32,
        page_size: int = 16,
        pages: int | None = None,
        max_seq: int | None = None,
        backend: str = "auto",
        max_queue: int = 1024,
        check_pages: bool = False,
        max_iterations: int | None = None,
        devices: int = 1,
        strategy: str = "auto",
        decode_rows: Sequence[int] | None = None,
        **generator_options: Any,
    ) -> None:
        for name, value in (("max_slots", max_slots), ("chunk", chunk), ("page_size", page_size),
                            ("max_queue", max_queue)):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise EngineError(f"Engine: {name} must be an int >= 1, got {value!r}")
        if isinstance(model, Generator):
            self.generator = model
        else:
            self.generator = Generator(model, backend="cpu", max_seq=max_seq, **generator_options)
        self.cfg, self.tokenizer = self.generator.cfg, self.generator.tokenizer
        self.eos_token_ids = self.generator.eos_token_ids
        self.backend_name, self.reason = Generator._choose(backend)
        length = min(self.cfg.max_seq, max_seq or DEFAULT_MAX_SEQ)
        per_slot = -(-length // page_size)
        self.shape = StepShape(max_slots, chunk, page_size, pages or max_slots * per_slot, length)
        self.max_queue, self.check_pages = max_queue, check_pages
        self.max_iterations = max_iterations or (GPU_ITERATIONS if self.backend_name == "gpu" else 1)
        self.decode_rows = self._check_decode_rows(decode_rows, max_slots, devices)
        self.programs = build_serving_programs(self.cfg, self.shape, self.eos_token_ids, self.decode_rows)
        self.graph = self.programs["mixed"]
        self.runs: collections.Counter[str] = collections.Counter()  # runs of each program so far
        progress = self.generator.progress if isinstance(self.generator.progress, Progress) else Progress(None)
        if (why := problem(devices, strategy, self.cfg)) is not None:
            raise EngineError(f"Engine: {why}")
        if devices > 1:
            step = SplitGpuStep if self.backend_name == "gpu" else SplitCpuStep
            self.step = step(self.programs, self.generator.params, progress, self.generator.plan_cache, devices,
                             strategy)  # fmt: skip
        else:
            step = {"gpu": GpuStep, "cpu": CpuStep, "reference": ReferenceStep}[self.backend_name]
            self.step = step(self.programs, self.generator.params, progress, plan_cache=self.generator.plan_cache)
        self.slots = SlotTable(self.shape)
        self.queue: collections.deque[Request] = collections.deque()
        self._lock = threading.Condition()
        self._cancelled: list[Request] = []
        self._ids = 0
        self._closing = self._draining = False
        self._failure: BaseException | None = None
        self.steps = 0  # steps run so far
        self._thread = threading.Thread(target=self._serve, name="megaloop-engine", daemon=True)
        self._thread.start()

    @property
    def failure(self) -> BaseException | None:
        """What stopped the step, if it failed (the engine then serves no more requests)."""
        return self._failure

    @property
    def description(self) -> str:
        return self.step.description

    # ---- requests ------------------------------------------------------------------------------------
    def submit(self, prompt: Any, *, chat: bool = False, **settings: Any) -> Request:
        """Queue one prompt (text, token ids, or a conversation: a list of message dicts) with its
        ``Settings`` (max_tokens, temperature, top_k, top_p, min_p, seed, stop, stop_token_ids); ``chat`` wraps
        a text prompt in the chat template. Raises RequestError for a request that can never run,
        QueueFull when max_queue requests wait already, EngineClosed after close()."""
        self._check_open()
        ids = self.encode(prompt, chat)
        unknown = set(settings) - set(Settings.__dataclass_fields__)
        if unknown:
            raise RequestError(f"unknown settings {sorted(unknown)}; known: {sorted(Settings.__dataclass_fields__)}",
                               sorted(unknown)[0])  # fmt: skip
        options = Settings(**settings)
        if options.stop and self.tokenizer is None:
            raise RequestError(f"stop strings need the text: {self.generator.folder} has no tokenizer.json", "stop")
        self._check_fits(len(ids), options.max_tokens)
        progress = _Progress(options, self.tokenizer, frozenset(self.eos_token_ids))
        with self._lock:
            self._check_open()
            if len(self.queue) >= self.max_queue:
                raise QueueFull(f"{len(self.queue)} requests wait for a slot already (max_queue {self.max_queue})")
            self._ids += 1
            request = Request(self._ids, ids, options, progress, self)
            self.queue.append(request)
            self._lock.notify_all()
        return request

    def encode(self, prompt: Any, chat: bool = False) -> list[int]:
        """A prompt's token ids (``Generator.encode``); RequestError naming "prompt" or "messages"."""
        try:
            return self.generator.encode(prompt, chat)
        except (GenerationError, ChatTemplateError) as e:
            raise RequestError(str(e), "messages" if chat or _is_chat(prompt) else "prompt") from None

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def _check_open(self) -> None:
        with self._lock:
            if self._failure is not None:
                raise EngineClosed(f"the engine failed and serves no more requests: {self._failure}")
            if self._closing:
                raise EngineClosed("the engine is stopping: it takes no more requests")

    def _check_fits(self, prompt: int, max_tokens: int) -> None:
        shape = self.shape
        if prompt + max_tokens > shape.max_seq:
            field = "prompt" if prompt >= shape.max_seq else "max_tokens"
            raise RequestError(
                f"a prompt of {prompt} tokens and max_tokens {max_tokens} need {prompt + max_tokens} positions; a "
                f"slot holds {shape.max_seq} (max_seq): shorten the prompt or ask for fewer tokens", field
            )  # fmt: skip
        if -(-(prompt + max_tokens) // shape.page_size) > shape.pages:
            raise RequestError(
                f"a prompt of {prompt} tokens and max_tokens {max_tokens} need more pages of the KV cache than the "
                f"pool has ({shape.pages} of {shape.page_size} positions)", "max_tokens"
            )  # fmt: skip

    def generate(self, prompts: Sequence[Any], *, chat: bool = False, **settings: Any) -> list[Completion]:
        """Submit every prompt (each with ``settings``), then wait for all: the completions in order."""
        requests = [self.submit(p, chat=chat, **settings) for p in prompts]
        return [r.result() for r in requests]

    def max_tokens_left(self, prompt_tokens: int) -> int:
        """The most tokens a prompt of that many tokens may ask for."""
        return min(self.shape.max_seq - prompt_tokens, self.shape.pages * self.shape.page_size - prompt_tokens)

    def stats(self) -> dict[str, Any]:
        """The slots in use, the requests waiting, the pages free and the steps run so far."""
        with self._lock:
            return {
                "backend": self.backend_name,
                "slots": self.shape.slots,
                "running": len(self.slots.live),
                "queued": len(self.queue),
                "pages_free": self.slots.pages.available,
                "pages": self.shape.pages,
                "steps": self.steps,
                "runs": dict(self.runs),
            }

    def _cancel(self, request: Request) -> None:
        with self._lock:
            if request.done:
                return
            if request in self.queue:
                self.queue.remove(request)
                request._push(finished="cancelled")
            else:
                self._cancelled.append(request)
                self._lock.notify_all()

    # ---- stopping --------------------------------------------------------------------------------------
    def close(self, drain: bool = False, timeout: float | None = None) -> None:
        """Stop: with ``drain``, after the requests queued and running have finished (those still going
        after ``timeout`` seconds are cancelled); else cancelling them now. Then the backend is closed
        and every page must be back in the pool."""
        with self._lock:
            self._closing = True
            self._draining = drain
            self._lock.notify_all()
        if drain:
            self._thread.join(timeout)
        with self._lock:
            self._draining = False
            self._lock.notify_all()
        self._thread.join()
        self.step.close()
        if self._failure is None and not self.slots.pages.all_free():
            raise EngineError("the engine stopped with pages still taken from the pool (a megaloop bug)")

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the stepping thread -----------------------------------------------------------------------------
    def _serve(self) -> None:
        try:
            iterations = 1
            while True:
                with self._lock:
                    while not self._work_left() and not self._closing:
                        self._lock.wait()
                    if self._closing and not (self._draining and self._work_left()):
                        self._finish_all("cancelled")
                        return
                    admitted = self._between_runs()
                    if not self.slots.live:
                        continue
                    iterations = 1 if admitted or self.queue else min(2 * iterations, self.max_iterations)
                    writes = self.slots.prepare(iterations)
                    program = self._program()
                self.step.write(writes)
                self.step.run(iterations, program)
                progress = self.step.read(PROGRESS)
                with self._lock:
                    self.steps += iterations
                    self.runs[program] += 1
                    events = self.slots.absorb(progress)
                    if self.check_pages:
                        self.slots.check()
                self._deliver(events)
        except BaseException as e:  # the step failed: every request hears why, and no new one comes
            with self._lock:
                self._failure = e
            print(f"megaloop engine: the step failed: {type(e).__name__}: {e}", file=sys.stderr)
            self._finish_all("error", e)

    @staticmethod
    def _check_decode_rows(decode_rows: Sequence[int] | None, slots: int, devices: int) -> tuple[int, ...]:
        if devices > 1:
            return ()  # (the split steps run the mixed step only)
        if decode_rows is None:
            return decode_buckets(slots)
        rows = tuple(decode_rows)
        if any(isinstance(r, bool) or not isinstance(r, int) or not 1 <= r <= slots for r in rows):
            raise EngineError(f"Engine: decode_rows must be ints in [1, max_slots {slots}], got {rows!r}")
        return tuple(sorted(set(rows)))

    def _program(self) -> str:
        """The program of the next run: the smallest decode-only step that holds every active slot
        when none has prompt tokens left to feed (each wants one row), else the mixed step."""
        st = self.slots.state
        active = st["length"] < st["limit"]
        if (st["length"] - st["cursor"])[active].max(initial=1) > 1:
            return "mixed"
        rows = int(active.sum())
        return next((f"decode_{r}" for r in self.decode_rows if r >= rows), "mixed")

    def _work_left(self) -> bool:
        return bool(self.queue or self.slots.live or self._cancelled)

    def _between_runs(self) -> bool:
        """Cancelled requests out, waiting ones in (while slots and pages allow); whether any came in."""
        events = [e for r in self._cancelled if (e := self.slots.cancel(r)) is not None]
        self._cancelled = []
        self._deliver(events)
        admitted = False
        while self.queue and (slot := self.slots.free_slot()) is not None:
            if not self.slots.admit(slot, self.queue[0]):
                break  # first come, first served: the head of the queue waits for pages
            self.queue.popleft()
            admitted = True
        return admitted

    def _deliver(self, events: list[Event]) -> None:
        for e in events:
            e.request._push(e.delta, e.finished)

    def _finish_all(self, reason: str, error: BaseException | None = None) -> None:
        with self._lock:
            requests = list(self.queue) + [r for r in self.slots.requests if r is not None]
            self.queue.clear()
            for s in list(self.slots.live):
                self.slots.release(s)
        for r in requests:
            r._push(finished=reason, error=error)


class EngineError(MegaloopError, RuntimeError):
    """The engine cannot be built or run as asked."""


def _is_chat(prompt: Any) -> bool:
    return isinstance(prompt, (list, tuple)) and bool(prompt) and all(isinstance(m, dict) for m in prompt)


def wait_for(requests: Sequence[Request], timeout: float) -> None:
    """Until every request has finished, or TimeoutError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    for r in requests:
        r.result(max(0.0, deadline - time.monotonic()))

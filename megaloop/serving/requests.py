"""A request to the engine as its submitter sees it: its settings (checked when it is submitted), its
tokens and text as they come (``Delta``), and the handle that streams them to a thread or an asyncio
task (``Request``)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from megaloop.errors import MegaloopError
from megaloop.generation.sequences import Completion, StopMatcher
from megaloop.models.tokenizer import Tokenizer

MAX_STOPS = 16  # stop strings a request may give (OpenAI's API takes 4)


class RequestError(MegaloopError, ValueError):
    """A request the engine cannot serve as asked; ``field`` names the setting."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class QueueFull(MegaloopError, RuntimeError):
    """More requests wait than the engine's ``max_queue``: try again later (HTTP 429)."""


class EngineClosed(MegaloopError, RuntimeError):
    """The engine is stopping or stopped: it takes no more requests (HTTP 503)."""


@dataclass(frozen=True)
class Settings:
    """How one request samples and when it stops: ``temperature`` 0 is greedy, top_k 0 and top_p 1 are
    off, min_p 0 is off, ``seed`` picks the draws (the same seed, the same tokens); the completion ends after
    ``max_tokens``, at one of the model's end-of-sequence tokens, at one of ``stop_token_ids`` (left out
    of the completion, as the end-of-sequence tokens are) or before one of the ``stop`` strings."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        def bad(name: str, want: str) -> RequestError:
            return RequestError(f"{name} must be {want}, got {getattr(self, name)!r}", name)

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", "an int >= 1")
        if not _is_number(self.temperature) or not 0 <= self.temperature < float("inf"):
            raise bad("temperature", "a finite number >= 0 (0: greedy)")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", "an int >= 0 (0: off)")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "a number in (0, 1] (1: off)")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "a number in [0, 1] (0: off)")
        if not _is_int(self.seed) or not -(2**63) <= self.seed < 2**63:
            raise bad("seed", "an int that fits 64 bits")
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if len(stops) > MAX_STOPS or not all(isinstance(s, str) and s for s in stops):
            raise bad("stop", f"a non-empty string or a list of at most {MAX_STOPS} of them")
        object.__setattr__(self, "stop", stops)
        ids = tuple(self.stop_token_ids or ())
        if not all(_is_int(i) and i >= 0 for i in ids):
            raise bad("stop_token_ids", "a list of token ids")
        object.__setattr__(self, "stop_token_ids", tuple(int(i) for i in ids))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass
class Delta:
    """What a request made since the last one: token ids and the text they complete (the text may
    lag a token: a character's bytes can span tokens, and text that may begin a stop string waits)."""

    tokens: list[int]
    text: str


@dataclass
class _Progress:
    """The engine thread's side of a request: tokens decoded into text, cut at its stops."""

    settings: Settings
    tokenizer: Tokenizer | None
    eos: frozenset[int]
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    reason: str | None = None
    stop: str | int | None = None  # the stop string or token that ended it

    def __post_init__(self) -> None:
        self.decoder = self.tokenizer.stream() if self.tokenizer is not None else None
        self.matcher = StopMatcher(self.settings.stop)

    def add(self, token: int) -> Delta:
        """One token made by the step; sets ``reason`` (and ``stop``) where it ends the request."""
        if token in self.eos or token in self.settings.stop_token_ids:
            self.reason, self.stop = "stop", token
            return Delta([], "")
        self.tokens.append(token)
        text = self.matcher.push(self.decoder.push(token)) if self.decoder is not None else ""
        if self.matcher.stopped is not None:
            self.reason, self.stop = "stop", self.matcher.stopped
        elif len(self.tokens) >= self.settings.max_tokens:
            self.reason = "length"
        self.text += text
        return Delta([token], text)

    def finish(self) -> str:
        """The text held back, once the request is over."""
        rest = ""
        if self.decoder is not None and self.matcher.stopped is None:
            rest = self.matcher.push(self.decoder.flush()) + self.matcher.flush()
        self.text += rest
        return rest


class Request:
    """A submitted request: iterate it (``for delta in request`` in a thread, ``async for delta in
    request`` in asyncio) for its ``Delta``\\ s as they come, or wait for the whole ``result()``.
    ``cancel()`` ends it (its slot is freed before the next step); leaving an ``async for`` early
    cancels it too. ``status``: "queued", "running" or "finished"."""

    def __init__(self, rid: int, prompt: list[int], settings: Settings, progress: _Progress, engine: Any) -> None:
        self.id, self.prompt_tokens, self.settings = rid, prompt, settings
        self._progress, self._engine = progress, engine
        self._cond = threading.Condition()
        self._deltas: list[Delta] = []
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self.status = "queued"
        self.error: BaseException | None = None
        self.finish_reason: str | None = None

    # ---- the engine's side -------------------------------------------------------------------------
    def _push(self, delta: Delta | None = None, finished: str | None = None, error: BaseException | None = None,
              ) -> None:  # fmt: skip
        with self._cond:
            if delta is not None and (delta.tokens or delta.text):
                self._deltas.append(delta)
            if finished is not None:
                self.status, self.finish_reason, self.error = "finished", finished, error
            self._cond.notify_all()
            waiters = list(self._waiters)
        for loop, event in waiters:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # (that loop has closed: nobody waits there any more)
                pass

    # ---- the submitter's side ------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self.status == "finished"

    def cancel(self) -> None:
        """End the request now (finish_reason "cancelled" unless it has already finished)."""
        self._engine._cancel(self)

    def __iter__(self) -> Iterator[Delta]:
        seen = 0
        while True:
            with self._cond:
                while len(self._deltas) == seen and not self.done:
                    self._cond.wait()
                new, finished = self._deltas[seen:], self.done
            seen += len(new)
            yield from new
            if finished and seen == len(self._deltas):
                self._raise_error()
                return

    async def __aiter__(self) -> AsyncIterator[Delta]:
        loop, event = asyncio.get_running_loop(), asyncio.Event()
        with self._cond:
            self._waiters.append((loop, event))
        seen, complete = 0, False
        try:
            while True:
                event.clear()  # (before reading: a delta pushed after the read sets it again)
                with self._cond:
                    new, finished = self._deltas[seen:], self.done
                seen += len(new)
                for delta in new:
                    yield delta
                if finished and not new:
                    complete = True
                    self._raise_error()
                    return
                if not new:
                    await event.wait()
        finally:
            with self._cond:
                self._waiters.remove((loop, event))
            if not complete and not self.done:
                self.cancel()  # the consumer left early: nobody wants the rest

    def result(self, timeout: float | None = None) -> Completion:
        """The whole completion, once the request has finished (raises what ended it, if it failed)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.done, timeout):
                raise TimeoutError(f"request {self.id} has not finished after {timeout} s")
        self._raise_error()
        p = self._progress
        seed = self.settings.seed if self.settings.temperature > 0 else None
        return Completion(list(self.prompt_tokens), list(p.tokens), p.text, self.finish_reason or "cancelled",
                          stop=p.stop, seed=seed)  # fmt: skip

    async def aresult(self) -> Completion:
        """``result()`` for asyncio code: the whole completion, without blocking the event loop."""
        async for _ in self:
            pass
        return self.result()

    def _raise_error(self) -> None:
        if self.error is not None:
            raise self.error

    def __repr__(self) -> str:
        return f"Request({self.id}, {self.status}, {len(self.prompt_tokens)} prompt tokens)"

"""The host's copy of the step's slot states, and what it does with them between two runs: admit a
request into a free slot, give slots the pages the next steps write, take the tokens a run made and
find the slots that finished (docs/serving.md, "What the host does"). No threads here: the engine
calls these under its lock."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megaloop.serving.pages import PagePool
from megaloop.serving.requests import Delta, Request
from megaloop.serving.step import SLOT_STATES, StepShape


@dataclass
class Event:
    """What a run did for one request: its ``delta``, and ``finished`` (the reason) if it ended."""

    request: Request
    delta: Delta
    finished: str | None = None


class SlotTable:
    """S slots: their requests, the host's copy of their states (``state``; ``dirty`` names those
    changed since the kernel last had them), and the page pool."""

    def __init__(self, shape: StepShape) -> None:
        s, col = shape.slots, (shape.slots, 1)
        self.shape = shape
        self.pages = PagePool(shape.pages, shape.page_size, s, shape.pages_per_slot)
        self.state: dict[str, np.ndarray] = {
            "sequence": np.zeros((s, shape.max_seq), np.int64),
            "length": np.zeros(col, np.int64),
            "cursor": np.zeros(col, np.int64),
            "limit": np.zeros(col, np.int64),
            "temperature": np.ones(col, np.float32),
            "top_k": np.zeros(col, np.int64),
            "top_p": np.ones(col, np.float32),
            "min_p": np.zeros(col, np.float32),
            "seed": np.arange(s, dtype=np.int64).reshape(col),
            "page_table": self.pages.table,
        }
        assert set(self.state) == set(SLOT_STATES)
        self.dirty: set[str] = set(SLOT_STATES)
        self.requests: list[Request | None] = [None] * s
        self.seen = [0] * s  # the position up to which each slot's tokens went to its request

    @property
    def live(self) -> set[int]:
        return {s for s, r in enumerate(self.requests) if r is not None}

    def free_slot(self) -> int | None:
        return next((s for s, r in enumerate(self.requests) if r is None), None)

    def admit(self, slot: int, request: Request) -> bool:
        """``request`` into the free ``slot``, its pages reserved; False (nothing changed) if the pool
        cannot promise them yet."""
        prompt, settings = request.prompt_tokens, request.settings
        limit = len(prompt) + settings.max_tokens
        if not self.pages.reserve(slot, limit):
            return False
        st = self.state
        st["sequence"][slot] = 0
        st["sequence"][slot, : len(prompt)] = prompt
        st["length"][slot], st["cursor"][slot], st["limit"][slot] = len(prompt), 0, limit
        st["temperature"][slot] = settings.temperature
        st["top_k"][slot], st["top_p"][slot], st["seed"][slot] = settings.top_k, settings.top_p, settings.seed
        st["min_p"][slot] = settings.min_p
        self.dirty |= {"sequence", "length", "cursor", "limit", "temperature", "top_k", "top_p", "min_p", "seed"}
        self.requests[slot], self.seen[slot] = request, len(prompt)
        request.status = "running"
        return True

    def release(self, slot: int) -> None:
        """The slot free again: no row of the step, its pages back in the pool."""
        st = self.state
        st["length"][slot] = st["cursor"][slot] = st["limit"][slot] = 0
        self.pages.release(slot)
        self.dirty |= {"length", "cursor", "limit", "page_table"}
        self.requests[slot] = None

    def prepare(self, iterations: int) -> dict[str, np.ndarray]:
        """Pages for every position the next ``iterations`` steps can write (a slot feeds at most a
        chunk a step, never at or past its limit), then the states the kernel must be given."""
        st = self.state
        for s in self.live:
            reach = min(int(st["limit"][s, 0]), int(st["cursor"][s, 0]) + iterations * self.shape.chunk)
            if self.pages.grow(s, reach):
                self.dirty.add("page_table")
        out = {name: st[name] for name in sorted(self.dirty)}
        self.dirty = set()
        return out

    def absorb(self, progress: dict[str, np.ndarray]) -> list[Event]:
        """The states a run left (length, cursor, limit, sequence): each live slot's new tokens to its
        request, and the slots that finished (the step's limit reached, or the request ended on the
        host: a stop string or a stop token) released."""
        for name, value in progress.items():
            self.state[name][...] = value
        events = []
        st = self.state
        for s in sorted(self.live):
            request = self.requests[s]
            assert request is not None
            length, limit = int(st["length"][s, 0]), int(st["limit"][s, 0])
            tokens, text = [], ""
            progress_ = request._progress
            for token in st["sequence"][s, self.seen[s] : length].tolist():
                delta = progress_.add(int(token))
                tokens += delta.tokens
                text += delta.text
                if progress_.reason is not None:
                    break
            self.seen[s] = length
            reason = progress_.reason or ("length" if length >= limit else None)
            if reason is not None:
                text += progress_.finish()
                self.release(s)
            events.append(Event(request, Delta(tokens, text), reason))
        return events

    def cancel(self, request: Request) -> Event | None:
        """End a running request now (its slot released); None if it holds no slot."""
        for s, r in enumerate(self.requests):
            if r is request:
                text = request._progress.finish()
                self.release(s)
                return Event(request, Delta([], text), "cancelled")
        return None

    def check(self) -> None:
        """The page pool's rules (PagePool.check) and that the host's table is the step's."""
        self.pages.check(self.live)

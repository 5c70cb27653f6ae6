"""The host's side of the paged KV cache: which pool page each slot holds, reserved when a request is
admitted and assigned as its sequence grows (docs/serving.md, "Pages").

A request reserves every page its longest sequence can need (prompt + max_tokens) when it is admitted,
so a running sequence never waits for a page and nothing is ever preempted; pages are taken from the
reservation into the slot's table only as positions are about to be written, and all of them (taken
or not) go back when the slot is freed.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from megaloop.errors import MegaloopError


class PageError(MegaloopError, RuntimeError):
    """The page pool's bookkeeping broke a rule (a megaloop bug: please report it)."""


class PagePool:
    """``pages`` pages of ``page_size`` positions for ``slots`` slots of at most ``per_slot`` pages;
    ``table`` is the step's page_table state as the host keeps it (-1: no page)."""

    def __init__(self, pages: int, page_size: int, slots: int, per_slot: int) -> None:
        self.pages, self.page_size, self.per_slot = pages, page_size, per_slot
        self.free: deque[int] = deque(range(pages))
        self.reserved = [0] * slots  # pages promised to each slot and not yet in its table
        self.held: list[list[int]] = [[] for _ in range(slots)]  # pages in each slot's table, in order
        self.table = np.full((slots, per_slot), -1, np.int64)

    def pages_for(self, positions: int) -> int:
        return -(-positions // self.page_size)

    @property
    def available(self) -> int:
        """Pages neither assigned nor promised."""
        return len(self.free) - sum(self.reserved)

    def reserve(self, slot: int, positions: int) -> bool:
        """Promise ``slot`` the pages of ``positions`` positions; False (nothing changed) if too few are left."""
        need = self.pages_for(positions)
        if self.held[slot] or self.reserved[slot]:
            raise PageError(f"slot {slot} reserves pages while it still holds some")
        if need > self.available:
            return False
        self.reserved[slot] = need
        return True

    def grow(self, slot: int, positions: int) -> bool:
        """Assign ``slot`` pages from its reservation until its table covers ``positions`` positions;
        whether its table row changed."""
        need = min(self.pages_for(positions), self.per_slot) - len(self.held[slot])
        if need <= 0:
            return False
        if need > self.reserved[slot]:
            raise PageError(f"slot {slot} needs {need} more pages but has {self.reserved[slot]} reserved")
        for _ in range(need):
            page = self.free.popleft()
            self.table[slot, len(self.held[slot])] = page
            self.held[slot].append(page)
        self.reserved[slot] -= need
        return True

    def release(self, slot: int) -> None:
        """Every page of ``slot`` back to the pool, its reservation dropped, its table row cleared."""
        self.free.extend(self.held[slot])
        self.held[slot] = []
        self.reserved[slot] = 0
        self.table[slot] = -1

    def check(self, live: set[int]) -> None:
        """The rules: no page in two tables, every page free or held exactly once, tables agree with the
        pages held, free slots (not in ``live``) hold nothing, reservations fit in the free pages."""
        counts = np.bincount(np.concatenate([np.asarray(h, np.int64) for h in self.held] + [np.asarray(
            list(self.free), np.int64)]), minlength=self.pages)  # fmt: skip
        if len(counts) != self.pages or (counts != 1).any():
            bad = int(np.argmax(counts != 1)) if len(counts) == self.pages else len(counts) - 1
            owners = [s for s, h in enumerate(self.held) if bad in h]
            raise PageError(
                f"page {bad} is counted {int(counts[bad]) if bad < len(counts) else '?'} times "
                f"(held by slots {owners}, {'free' if bad in self.free else 'not free'})"
            )
        for s, held in enumerate(self.held):
            row = self.table[s]
            if row[: len(held)].tolist() != held or (row[len(held) :] != -1).any():
                raise PageError(f"slot {s}'s page table {row.tolist()} disagrees with the pages it holds {held}")
            if s not in live and (held or self.reserved[s]):
                raise PageError(f"free slot {s} still holds pages {held} (and {self.reserved[s]} reserved)")
        if sum(self.reserved) > len(self.free):
            raise PageError(f"{sum(self.reserved)} pages are reserved but only {len(self.free)} are free")

    def all_free(self) -> bool:
        return len(self.free) == self.pages and not any(self.reserved)

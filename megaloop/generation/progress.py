"""Progress bars (tqdm, on stderr) for setting a model up: load, plan, compile, upload; and the
seconds each phase took, for the summary line."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class Progress:
    """``enabled=None``: bars only when stderr is a terminal. The times are kept either way. ``delay``:
    the seconds a ``steps`` bar waits before it shows (a short prefill shows none)."""

    delay = 1.0

    def __init__(self, enabled: bool | None = None) -> None:
        self.enabled = sys.stderr.isatty() if enabled is None else bool(enabled)
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str, total: float | None = None, **bar: Any) -> Iterator[Any]:
        """A bar for one phase (``update(n)`` it as work is done); its time is added to ``seconds``."""
        from tqdm import tqdm

        t0 = time.perf_counter()
        with tqdm(
            total=total, desc=f"{name:<8}", disable=not self.enabled, file=sys.stderr, leave=False, **bar
        ) as progress:
            yield progress
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    @contextmanager
    def steps(self, name: str, total: float, **bar: Any) -> Iterator[Any]:
        """A bar for work that is not setup (a long prefill), shown only once it has taken a second."""
        from tqdm import tqdm

        shown = {"disable": not self.enabled, "file": sys.stderr, "leave": False, "delay": self.delay}
        with tqdm(total=total, desc=f"{name:<8}", **shown, **bar) as progress:
            yield progress

    def summary(self) -> str:
        return ", ".join(f"{name} {s:.1f} s" for name, s in self.seconds.items())

"""Work done ahead, in one background thread, for a caller that needs each piece later: the CPU
path's float32 copies of the weights (for the decode) and its packed weights (for the prefill),
made while the prefill runs instead of before it (numpy's and torch's kernels release the GIL).

``Ahead.submit(key, what, fn)`` queues a job; ``wait(key)`` returns once it is done: at once where
it is, running it in the caller's thread where the worker has not started it (no waiting behind the
queue), else waiting for the worker. A job's exception is raised by every ``wait`` for it, named by
the job's ``what``; a worker that is gone never leaves a wait hanging.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable, Hashable
from typing import Any

from megaloop.errors import EvaluationError, InternalError, MegaloopError

QUEUED, RUNNING, DONE = "queued", "running", "done"


class _Job:
    __slots__ = ("error", "finished", "fn", "state", "what")

    def __init__(self, what: str, fn: Callable[[], Any]) -> None:
        self.what, self.fn = what, fn
        self.state, self.error = QUEUED, None
        self.finished = threading.Event()


class Ahead:
    """Jobs run by one daemon thread (``name``): the urgent ones first, each kind in the order submitted.
    ``nice``: added to the thread's niceness (on Linux; elsewhere ignored), for work that nobody waits
    for yet and should take only a core the others leave idle (a wait runs a queued job itself)."""

    poll_s = 0.5  # how often a wait checks that the worker is still there

    def __init__(self, name: str = "megaloop-ahead", nice: int = 0) -> None:
        self.name, self.nice = name, nice
        self._jobs: dict[Hashable, _Job] = {}
        self._queue: list[Hashable] = []
        self._urgent = 0  # (the queue's first jobs are urgent ones)
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None

    def submit(self, key: Hashable, what: str, fn: Callable[[], Any], urgent: bool = False) -> None:
        """Queue ``fn`` under ``key`` (a key submitted before is left as it is), after the other urgent
        jobs where ``urgent`` (before every other job); ``what`` names it in errors."""
        with self._lock:
            if key in self._jobs:
                return
            self._jobs[key] = _Job(what, fn)
            self._queue.insert(self._urgent, key) if urgent else self._queue.append(key)
            self._urgent += urgent
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._work, name=self.name, daemon=True)
                self._thread.start()
            self._lock.notify()

    def has(self, key: Hashable) -> bool:
        """Whether a job was submitted under ``key`` and is not done yet."""
        job = self._jobs.get(key)
        return job is not None and job.state != DONE

    def pending(self) -> int:
        """Jobs not done yet."""
        return sum(job.state != DONE for job in list(self._jobs.values()))

    def wait(self, key: Hashable) -> None:
        """Return once ``key``'s job is done (nothing to wait for where none was submitted); raise its
        error where it failed."""
        with self._lock:
            job = self._jobs.get(key)
            if job is None:
                return
            mine = job.state == QUEUED
            if mine:  # (not started: run here rather than wait behind the queue)
                self._urgent -= self._queue.index(key) < self._urgent
                self._queue.remove(key)
                job.state = RUNNING
        if mine:
            self._run(job)
        while not job.finished.wait(self.poll_s):
            if self._thread is None or not self._thread.is_alive():
                raise InternalError(f"{job.what}: the thread {self.name!r} that made it ended before it was done")
        if job.error is not None:
            if isinstance(job.error, MegaloopError):
                raise job.error
            raise EvaluationError(f"{job.what}: {type(job.error).__name__}: {job.error}") from job.error

    def _next(self) -> _Job:
        with self._lock:
            while not self._queue:
                self._lock.wait()
            job = self._jobs[self._queue.pop(0)]
            self._urgent = max(0, self._urgent - 1)
            job.state = RUNNING
            return job

    def _work(self) -> None:
        if self.nice > 0 and sys.platform == "linux":  # (there a thread id is a PRIO_PROCESS target)
            with contextlib.suppress(OSError):
                me = threading.get_native_id()
                os.setpriority(os.PRIO_PROCESS, me, os.getpriority(os.PRIO_PROCESS, me) + self.nice)
        while True:
            self._run(self._next())

    @staticmethod
    def _run(job: _Job) -> None:
        try:
            job.fn()
        except BaseException as e:  # (kept for the waits: raised where the result is needed)
            job.error = e
        finally:
            job.fn = None  # (what it made is kept by its caller; the job keeps nothing alive)
            job.state = DONE
            job.finished.set()

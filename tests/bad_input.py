"""The bad-input suite's table machinery: a case is an input (a call), the megaloop error class it must
raise, and words its message must contain. A case fails when the call returns, raises anything that is
not a MegaloopError (a bare Python exception, a traceback), raises the wrong class, leaves out a word,
or runs longer than CASE_SECONDS (a hang). ``found`` marks the examples of issue 23's "Found" list."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import megaloop as ml

CASE_SECONDS = 20  # far above any case's time here: more means it would have hung


@dataclass(frozen=True)
class Case:
    id: str
    call: Callable[[], Any]
    error: type[BaseException]
    words: tuple[str, ...] = ()
    found: bool = False  # an example of issue 23's "Found" section

    @property
    def param(self) -> Any:
        return pytest.param(self, id=self.id, marks=[pytest.mark.found] if self.found else [])


def case(id: str, error: type[BaseException], *words: str, found: bool = False) -> Callable[[Callable], Case]:
    """Decorator form for cases that need a few lines: ``@case("id", ShapeError, "word")``."""
    return lambda call: Case(id, call, error, words, found)


def params(cases: list[Case]) -> list[Any]:
    ids = [c.id for c in cases]
    assert len(set(ids)) == len(ids), "case ids repeat"
    return [c.param for c in cases]


@contextlib.contextmanager
def deadline(seconds: float, what: str) -> Iterator[None]:
    """Fail with an AssertionError if the block runs longer than ``seconds`` (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def fire(signum: int, frame: Any) -> None:
        raise AssertionError(f"{what}: still running after {seconds} s (a hang)")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def check(c: Case) -> None:
    with deadline(CASE_SECONDS, c.id):
        try:
            result = c.call()
        except ml.MegaloopError as e:
            assert isinstance(e, c.error), f"{c.id}: {type(e).__name__} instead of {c.error.__name__}: {e}"
            missing = [w for w in c.words if w.lower() not in str(e).lower()]
            assert not missing, f"{c.id}: the message lacks {missing}: {type(e).__name__}: {e}"
            return
        except AssertionError:
            raise
        except Exception as e:
            raise AssertionError(f"{c.id}: a non-megaloop {type(e).__name__}: {e}") from e
    raise AssertionError(f"{c.id}: no error (returned {result!r:.80})")


# ---- the CLI: main([...]) in-process --------------------------------------------------------------------


class CliFailure(Exception):
    """Stands for 'the command failed cleanly' in a Case's error slot (not a megaloop class)."""


def cli(*argv: str, cwd: Any = None) -> Callable[[], Any]:
    """A call running ``megaloop argv`` in-process that raises CliFailure (message: its output) when the
    command fails cleanly (exit code != 0, no traceback); anything escaping main is left to fail."""

    def call() -> Any:
        from megaloop.cli import main

        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), _chdir(cwd):
            try:
                code = main(list(argv))
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (print(e.code, file=err) or 1)
        text = out.getvalue() + err.getvalue()
        assert "Traceback" not in text, f"megaloop {' '.join(argv)} printed a traceback:\n{text}"
        if code == 0:
            return text
        raise CliFailure(text)

    return call


@contextlib.contextmanager
def _chdir(path: Any) -> Iterator[None]:
    if path is None:
        yield
        return
    before = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


def check_cli(c: Case) -> None:
    with deadline(CASE_SECONDS, c.id):
        try:
            result = c.call()
        except CliFailure as e:
            missing = [w for w in c.words if w.lower() not in str(e).lower()]
            assert not missing, f"{c.id}: the output lacks {missing}:\n{e}"
            return
        except AssertionError:
            raise
        except Exception as e:
            raise AssertionError(f"{c.id}: megaloop ended in a {type(e).__name__}: {e}") from e
    raise AssertionError(f"{c.id}: the command succeeded:\n{result}")


# ---- small fixtures the tables share ---------------------------------------------------------------------


def graph(name: str = "bad", **kw: Any) -> ml.Graph:
    return ml.Graph(name, **kw)


def x32(shape: tuple[int, ...] = (2, 4), dtype: Any = ml.float32, g: ml.Graph | None = None) -> ml.Tensor:
    g = g or graph()
    return g.input(f"x{len(g.nodes)}", shape, dtype)


def xs(*specs: Any) -> list[ml.Tensor]:
    """Inputs of one new graph: each spec a shape, or (shape, dtype)."""
    g = graph()
    out = []
    for spec in specs:
        shape, dtype = spec if len(spec) == 2 and isinstance(spec[0], tuple) else (spec, ml.float32)
        out.append(x32(shape, dtype, g))
    return out


def ranks2(rank: int = 0) -> ml.Graph:
    return ml.Graph("r", rank=rank, world_size=2)


def zeros(*shape: int) -> np.ndarray:
    return np.zeros(shape, np.float32)

"""Host values (parameters, initial state) into the loop kernel's arena without a host copy of the
model: each value is cut into pieces of at most ``CHUNK_BYTES`` in C order (``pieces``), and the
pieces travel through two pinned staging buffers (``Staging``): the host copies piece i + 1 from
wherever it lives (a numpy memmap of a checkpoint reads the file's pages here) while the copy
engine moves piece i to the GPU. Extra host memory: the two buffers, whatever the model's size.

A piece of the value's own dtype is a view (nothing copied before the staging buffer); one that
needs converting (float32 weights for a bfloat16 model) is converted piece by piece by
``megaloop.frontend.values.coerce``, so the rules and errors are the same as for small inputs.

``progress`` arguments (LoopKernel, LoopKernelGroup) take ``progress_callback``'s forms: None or False
(quiet), True (tqdm bars), or a callable ``(stage, done, total)`` called with stage "compile" (kernels
ready of total) and "upload" (bytes on the GPU of total).
"""

from __future__ import annotations

import ctypes
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from megaloop.dtypes import DType, to_numpy
from megaloop.errors import EvaluationError, MegaloopError
from megaloop.frontend.shapes import format_shape
from megaloop.frontend.values import coerce

CHUNK_BYTES = 32 << 20  # each of the two staging buffers
ProgressCallback = Callable[[str, int, int], None]


class _Piece:
    """What ``coerce`` reads of a tensor: the shape and dtype a piece must have."""

    def __init__(self, shape: tuple[int, ...], dtype: DType) -> None:
        self.shape, self.dtype = shape, dtype


def pieces(value: Any, shape: tuple[int, ...], dtype: DType, what: str, chunk_bytes: int) -> Iterator[np.ndarray]:
    """``value`` as ``dtype``, in C order, as arrays of at most ``chunk_bytes`` (views of ``value``
    where it already has the dtype; converted copies of a piece otherwise)."""
    try:
        arr = to_numpy(value)
    except ValueError as e:
        raise EvaluationError(f"{what}: not an array ({e})") from None
    if arr.shape != tuple(shape):
        raise EvaluationError(f"{what}: expected shape {format_shape(tuple(shape))}, got {format_shape(arr.shape)}")
    same = arr.dtype == dtype.np
    for block in _blocks(arr, max(chunk_bytes // dtype.itemsize, 1)):
        yield block if same else coerce(block, _Piece(block.shape, dtype), what)  # type: ignore[arg-type]


def _blocks(arr: np.ndarray, limit: int) -> Iterator[np.ndarray]:
    """Views of ``arr`` of at most ``limit`` elements that tile it in C order."""
    if arr.size <= limit or arr.ndim == 0:
        yield arr
        return
    per = arr.size // arr.shape[0]
    if per <= limit:
        step = limit // per
        for i in range(0, arr.shape[0], step):
            yield arr[i : i + step]
        return
    for i in range(arr.shape[0]):
        yield from _blocks(arr[i], limit)


def nbytes_of(shape: tuple[int, ...], dtype: DType) -> int:
    return math.prod(shape) * dtype.itemsize


def upload(
    put: Callable[[int, np.ndarray], None],
    dst: int,
    value: Any,
    shape: tuple[int, ...],
    dtype: DType,
    what: str,
    chunk_bytes: int = CHUNK_BYTES,
    advance: Callable[[int], None] | None = None,
) -> int:
    """``value``'s bytes as ``dtype`` to device address ``dst`` on, piece by piece through ``put(address,
    piece)``; returns the bytes written."""
    offset = 0
    for piece in pieces(value, shape, dtype, what, chunk_bytes):
        if piece.nbytes:
            put(dst + offset, piece)
            offset += piece.nbytes
            if advance is not None:
                advance(piece.nbytes)
    if offset != nbytes_of(shape, dtype):
        raise MegaloopError(f"{what}: wrote {offset} bytes of {nbytes_of(shape, dtype)} (a megaloop bug)")
    return offset


class Staging:
    """Two pinned host buffers of ``chunk_bytes`` and an event each: ``put`` copies a piece into the
    buffer whose last transfer has finished and queues its transfer on ``stream``."""

    def __init__(self, driver: Any, stream: Any, check: Callable, chunk_bytes: int, timeout_s: float) -> None:
        self._d, self._stream, self._check, self.timeout_s = driver, stream, check, timeout_s
        self.chunk_bytes = chunk_bytes
        self._buffers: list[int] = []
        self._events: list[Any] = []
        self._views: list[np.ndarray] = []
        self._next = 0
        try:
            for _ in range(2):
                address = int(check(driver.cuMemHostAlloc(chunk_bytes, 0)))
                self._buffers.append(address)
                self._views.append(np.ctypeslib.as_array((ctypes.c_uint8 * chunk_bytes).from_address(address)))
                self._events.append(check(driver.cuEventCreate(driver.CUevent_flags.CU_EVENT_DISABLE_TIMING)))
        except BaseException:
            self.close()
            raise

    def put(self, dst: int, piece: np.ndarray) -> None:
        if piece.nbytes > self.chunk_bytes:
            raise MegaloopError(f"a piece of {piece.nbytes} bytes exceeds the {self.chunk_bytes}-byte staging buffer")
        i, self._next = self._next, 1 - self._next
        self._wait(i)  # its previous transfer has left the buffer
        host = self._views[i][: piece.nbytes].view(piece.dtype).reshape(piece.shape)
        np.copyto(host, piece)  # reads a memmap's pages here
        d = self._d
        self._check(d.cuMemcpyHtoDAsync(dst, self._buffers[i], piece.nbytes, self._stream))
        self._check(d.cuEventRecord(self._events[i], self._stream))

    def finish(self) -> None:
        """Until every queued transfer has landed."""
        for i in range(len(self._events)):
            self._wait(i)

    def _wait(self, i: int) -> None:
        d = self._d
        deadline = time.monotonic() + self.timeout_s + 5.0
        while True:
            (err,) = d.cuEventQuery(self._events[i])
            if err == d.CUresult.CUDA_SUCCESS:
                return
            if err != d.CUresult.CUDA_ERROR_NOT_READY:
                self._check((err,))
            if time.monotonic() > deadline:
                raise MegaloopError(
                    f"a host-to-GPU copy of {self.chunk_bytes} bytes has not finished after {self.timeout_s + 5:.0f} s"
                )
            time.sleep(0.0001)

    def close(self) -> None:
        """Free the buffers (after ``finish``, or after a failure: waits for transfers in flight)."""
        d = self._d
        for i, event in enumerate(self._events):
            try:
                self._wait(i)
            except MegaloopError:
                pass
            d.cuEventDestroy(event)
        self._events.clear()
        self._views.clear()
        for address in self._buffers:
            d.cuMemFreeHost(address)
        self._buffers.clear()


def progress_callback(progress: Any) -> ProgressCallback | None:
    """The callable behind a ``progress`` argument: None/False nothing, True tqdm bars, or the
    callable itself."""
    if progress is None or progress is False:
        return None
    if progress is True:
        return TqdmProgress()
    if callable(progress):
        return progress
    raise EvaluationError(
        f"progress must be None, False, True (tqdm bars) or a callable(stage, done, total), got {progress!r}"
    )


class TqdmProgress:
    """A tqdm bar per stage ("compile": kernels, "upload": bytes), closed when its stage is done."""

    def __init__(self, prefix: str = "") -> None:
        try:
            import tqdm  # noqa: F401
        except ImportError:
            raise EvaluationError("progress=True draws tqdm bars: pip install tqdm (or pass a callable)") from None
        self.prefix = prefix
        self._bars: dict[str, Any] = {}

    def __call__(self, stage: str, done: int, total: int) -> None:
        from tqdm import tqdm

        bar = self._bars.get(stage)
        if bar is None:
            unit = {"upload": "B"}.get(stage, "kernel")
            bar = self._bars[stage] = tqdm(total=total, desc=f"{self.prefix}{stage}", unit=unit, unit_scale=unit == "B")
        bar.total = total
        bar.update(done - bar.n)
        if done >= total:
            bar.close()
            del self._bars[stage]

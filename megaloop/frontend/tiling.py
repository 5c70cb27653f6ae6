"""How an op splits into tile tasks: part of each op's single definition (``OpDef.tiling``).

A ``Tiling`` has named integer parameters with a default per GPU architecture, and a function that
turns one node plus chosen parameters into ``Tile``\\ s. A tile names the boxes (per-axis index ranges,
in each tensor's own index space) it reads from the op's operands and writes to its outputs, and how
many floating-point operations it performs. The planner turns boxes into byte ranges, derives the
dependencies between tiles from them, and schedules the tiles; the plan interpreter executes each
tile with the op's numpy reference, reading *only* the declared boxes (everything else is poisoned),
so a tiling that under-declares its reads produces NaNs there instead of a silently right answer.

A read may name another rank (``rank=``) for collectives; operand index ``PEER_SEND`` in a recv's
read means "the tensor the matching send on the source rank hands over". A pushing all_reduce's tiles
declare only their own rank's reads: each member's tile hands its box to the others itself
(``megaloop.plan.rendezvous``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from megaloop.errors import GraphBuildError

ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90")
# the most dynamic shared memory one thread block may use (CUDA programming guide, compute capabilities)
SHARED_MEMORY_PER_BLOCK = {"sm_80": 163 * 1024, "sm_86": 99 * 1024, "sm_89": 99 * 1024, "sm_90": 227 * 1024}
MAX_WARPS = 32  # 1024 threads per block
# What one GPU of an architecture can hold resident at once (the largest part of each: A100 108 SMs,
# A40 84, L40S 142, H100/H200 132), with the guide's limits of blocks and warps per SM: every
# processor of a loop kernel must be resident, so a plan for more processors could never start.
LARGEST_SM_COUNT = {"sm_80": 108, "sm_86": 84, "sm_89": 142, "sm_90": 132}
BLOCKS_PER_SM = {"sm_80": 32, "sm_86": 16, "sm_89": 24, "sm_90": 32}
WARPS_PER_SM = {"sm_80": 64, "sm_86": 48, "sm_89": 48, "sm_90": 64}


def max_resident_processors(arch: str, warps: int) -> int:
    """The most thread blocks of ``warps`` warps any GPU of ``arch`` keeps resident at once (registers
    and shared memory may allow fewer: the runtime checks the real kernel)."""
    return LARGEST_SM_COUNT[arch] * min(BLOCKS_PER_SM[arch], WARPS_PER_SM[arch] // warps)


PEER_SEND = -1  # operand index of a recv's read: the matched send's input on the source rank
PEER_RECV = -2  # output index of a pushing send's write: the matched recv's output on the destination rank


class Box(NamedTuple):
    """Index ranges [lo[d], hi[d]) per axis of a tensor. (Tuples: planning makes hundreds of
    thousands of these, and tuples are the cheapest immutable records Python has.)"""

    lo: tuple[int, ...]
    hi: tuple[int, ...]

    @staticmethod
    def full(shape: Sequence[int]) -> Box:
        return Box(tuple(0 for _ in shape), tuple(shape))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(h - lo for lo, h in zip(self.lo, self.hi))

    @property
    def size(self) -> int:
        n = 1
        for lo, h in zip(self.lo, self.hi):
            n *= h - lo
        return n

    @property
    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(lo, h) for lo, h in zip(self.lo, self.hi))

    def replace(self, axis: int, lo: int, hi: int) -> Box:  # type: ignore[override]
        return Box(self.lo[:axis] + (lo,) + self.lo[axis + 1 :], self.hi[:axis] + (hi,) + self.hi[axis + 1 :])

    def __str__(self) -> str:
        return "[" + ", ".join(f"{lo}:{h}" for lo, h in zip(self.lo, self.hi)) + "]"


class Read(NamedTuple):
    operand: int  # index into the node's operands (PEER_SEND for a recv)
    box: Box
    rank: int | None = None  # another rank's copy of the operand (collectives); None: this rank


class Write(NamedTuple):
    output: int  # index into the node's outputs (PEER_RECV for a pushing send)
    box: Box
    rank: int | None = None  # another rank's tensor (a pushing send: the recv's output); None: this rank


class Tile(NamedTuple):
    coords: tuple[int, ...]  # position in the op's grid of tiles, for names ("matmul_12[0,3]")
    reads: tuple[Read, ...]
    writes: tuple[Write, ...]
    flops: int = 0
    moved: int | None = None  # bytes really moved, when the declared boxes over-approximate (gathers)
    pushed: int = 0  # bytes it stores into other ranks' memory (a pushing collective's tiles)
    # operand bytes it streams through L2 in blocks that other tiles read too (a matmul's A and B
    # blocks), and its share of them from HBM (each block comes once, split over the tiles sharing it):
    # the cost model reads the first at L2's rate and counts only the second against HBM
    streamed: int = 0
    streamed_once: int = 0


@dataclass(frozen=True)
class TileContext:
    """What a tiling function may look at besides the node."""

    rank: int
    world_size: int
    processors: int  # thread blocks the plan has: small ops may pick smaller tiles to use them all
    warps: int = 8  # a block's warps: tiles may size their units of work to keep them all busy
    # the part of the processors this op can count on: ops that become ready together and run side by
    # side (the q, k and v projections of one input) share them (megaloop.plan.tasks.processor_share)
    share: float = 1.0

    @property
    def own_processors(self) -> int:
        return max(1, round(self.processors * self.share))


@dataclass(frozen=True)
class Tiling:
    params: dict[str, dict[str, int]]  # parameter -> architecture -> default
    make: Callable[[Any, dict[str, int], TileContext], list[Tile]]  # (node, params, ctx) -> tiles
    doc: str = ""
    flags: tuple[str, ...] = ()  # parameters that are switches (0 or 1), not sizes
    # what a plan file that leaves a parameter out meant, where that is not today's default: the
    # parameter came later, and the file's tasks were made the old way (megaloop.plan.edit)
    saved_without: dict[str, int] = field(default_factory=dict)

    def minimum(self, name: str) -> int:
        return 0 if name in self.flags else 1

    def defaults(self, arch: str) -> dict[str, int]:
        if arch not in ARCHS:
            raise GraphBuildError(f"unknown architecture {arch!r}; megaloop plans for {', '.join(ARCHS)}")
        return {name: by_arch[arch] for name, by_arch in self.params.items()}

    def resolve(self, op_name: str, arch: str, overrides: dict[str, Any] | None) -> dict[str, int]:
        """Defaults for ``arch`` with ``overrides`` applied; unknown names or non-positive values fail."""
        params = self.defaults(arch)
        for key, value in (overrides or {}).items():
            if key not in params:
                raise GraphBuildError(f"{op_name}: unknown tile parameter {key!r}; it takes {sorted(params)}")
            if (key in self.flags and value not in (0, 1)) or isinstance(value, bool):
                raise GraphBuildError(f"{op_name}: tile parameter {key} is a switch: 0 or 1, got {value!r}")
            if not isinstance(value, int) or (value < 1 and key not in self.flags):
                raise GraphBuildError(f"{op_name}: tile parameter {key} must be an int >= 1, got {value!r}")
            params[key] = value
        return params


def same(value: int) -> dict[str, int]:
    """The same default on every architecture."""
    return {arch: value for arch in ARCHS}


# ---- helpers the op tilings share -----------------------------------------------------------------


def _split_axis(shape: tuple[int, ...], elements: int) -> tuple[int, int] | None:
    """The axis ``chunks`` splits into blocks and the elements below it (whole trailing axes), or None
    when the whole tensor is one chunk."""
    if not shape:
        return None
    k, inner = len(shape) - 1, 1
    while k > 0 and inner * shape[k] <= elements:
        inner *= shape[k]
        k -= 1
    return None if inner * shape[k] <= elements else (k, inner)


def chunks(shape: Sequence[int], elements: int) -> Iterator[Box]:
    """Cover ``shape`` with boxes of at most ``elements`` elements that are contiguous runs in row-major
    order: whole trailing axes, a block of one axis, and single indices before it."""
    shape = tuple(shape)
    split = _split_axis(shape, elements)
    if split is None:
        yield Box.full(shape)
        return
    k, inner = split
    block = max(1, elements // inner)
    for outer in _indices(shape[:k]):
        for start in range(0, shape[k], block):
            stop = min(shape[k], start + block)
            yield Box(
                outer + (start,) + (0,) * (len(shape) - k - 1), tuple(i + 1 for i in outer) + (stop,) + shape[k + 1 :]
            )


# A chunk that splits the last axis starts and ends on a multiple of this many elements, so that its
# 16-byte packs line up (the generated elementwise code falls back to one element at a time otherwise)
LAST_AXIS_RUN = 64


def balanced(shape: Sequence[int], elements: int, processors: int, fixed: int) -> int:
    """A size for ``chunks(shape, size)`` whose chunks fill their last round over the processors best:
    the fewest rounds times (a chunk plus ``fixed``, a task's own cost in elements), over chunks of the
    block ``chunks(shape, elements)`` makes up to twice that (never fewer elements a chunk than it).
    Why: 32768 rows in chunks of 31 are 1058 tasks, 8 rounds of 132 processors and 2 tasks left over, a
    ninth round for 2 processors while the other 130 idle; chunks of 50 rows are 5 full rounds."""
    shape = tuple(shape)
    split = _split_axis(shape, elements)
    if split is None:
        return elements  # one chunk
    k, inner = split
    outer, n, lo = math.prod(shape[:k]), shape[k], max(1, elements // inner)
    step = 1
    if k == len(shape) - 1 and lo >= LAST_AXIS_RUN:  # runs of the last axis: whole packs
        step = LAST_AXIS_RUN
        lo = -(-lo // step) * step
    return _fewest_rounds(lo, n, lambda block: outer * -(-n // block), inner, processors, fixed, step) * inner


def balanced_blocks(shape: Sequence[int], elements: int, processors: int, fixed: int, cols: int = 128) -> int:
    """``balanced`` for ``blocks(shape, size, cols)``: blocks of elements // cols rows or of twice that
    (prefill's 512 x 4096 residual add: 256 blocks of 64 rows, two rounds over 132 processors; 128
    blocks of 128 rows, one), never in between, so that they still line up with matmul tiles."""
    shape = tuple(shape)
    if len(shape) < 2 or shape[-1] < 2 * cols or shape[-2] < max(2, elements // cols):
        return balanced(shape, elements, processors, fixed)  # blocks() takes chunks
    outer, n, width = math.prod(shape[:-2]), shape[-2], -(-shape[-1] // cols)
    lo = max(1, elements // cols)
    return _fewest_rounds(lo, n, lambda rows: outer * -(-n // rows) * width, cols, processors, fixed, lo) * cols


def _fewest_rounds(
    lo: int, n: int, tasks: Callable[[int], int], unit: int, processors: int, fixed: int, step: int = 1
) -> int:
    """The block (lo..min(n, 2 lo) units of ``unit`` elements, in steps of ``step``) that minimises
    rounds of ``tasks(block)`` over the processors times (a block plus ``fixed``); the smaller on ties.
    Only the smallest block of each count of blocks along n is a candidate (a larger one costs more
    and makes no fewer tasks), so a long range costs n / lo candidates at most."""
    hi = min(n, 2 * lo)
    if (hi - lo) // step <= n // lo:
        candidates = range(lo, hi + 1, step)
    else:  # the smallest block (a multiple of step) that splits n into c blocks, for each count c
        counts = range(math.ceil(n / hi), math.ceil(n / lo) + 1)
        candidates = sorted({max(lo, math.ceil(math.ceil(n / c) / step) * step) for c in counts})
        candidates = [b for b in candidates if b <= hi] or [lo]

    def cost(block: int) -> tuple[int, int]:
        return -(-tasks(block) // processors) * (block * unit + fixed), block

    return min(candidates, key=cost)


def blocks(shape: Sequence[int], elements: int, cols: int = 128) -> Iterator[Box]:
    """Like ``chunks``, but when a tensor has many wide rows, (rows x ``cols``) blocks of its last two
    axes: they line up with matmul output tiles, so an elementwise tile after a matmul depends on one
    tile instead of a whole row of them."""
    shape = tuple(shape)
    if len(shape) < 2 or shape[-1] < 2 * cols or shape[-2] < max(2, elements // cols):
        yield from chunks(shape, elements)
        return
    rows = max(1, elements // cols)
    for outer in _indices(shape[:-2]):
        after = tuple(i + 1 for i in outer)
        for r in range(0, shape[-2], rows):
            for c in range(0, shape[-1], cols):
                yield Box(outer + (r, c), after + (min(shape[-2], r + rows), min(shape[-1], c + cols)))


def _indices(shape: Sequence[int]) -> Iterator[tuple[int, ...]]:
    if not shape:
        yield ()
        return
    for i in range(shape[0]):
        for rest in _indices(shape[1:]):
            yield (i, *rest)


def project(box: Box, out_shape: Sequence[int], operand_shape: Sequence[int]) -> Box:
    """The box of a broadcast operand that an output box reads (numpy broadcasting, aligned right)."""
    lead = len(out_shape) - len(operand_shape)
    lo, hi = [], []
    for d, size in enumerate(operand_shape):
        if size == 1:
            lo.append(0)
            hi.append(1)
        else:
            lo.append(box.lo[lead + d])
            hi.append(box.hi[lead + d])
    return Box(tuple(lo), tuple(hi))


# ---- what a tile costs ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Rates:
    hbm: float  # bytes/s, whole chip (device-to-device copy, read + write)
    math: float  # flop/s, whole chip (dense bf16 tensor cores)
    peer: float  # bytes/s to another GPU (NVLink), whole chip
    l2: float  # bytes/s from L2 into the SMs, whole chip (operand blocks that tiles share)
    # dependency check, barriers, signal and the next task's dispatch: in a profiled 512-token prefill
    # on an H200 a processor's tasks started ~2.6 us after the previous one ended, and the 8192-element
    # tasks of the row and elementwise ops ran ~1 us longer than their HBM share
    task_overhead_ns: float = 2500.0


# Measured on H200 for sm_90 (ARCHITECTURE.md; l2: the operand feed of 128 x 256 GEMM blocks,
# bench/results/gemm_probe.json, which also puts a 512-token prefill's 128 x 128 x 4096 matmul tiles at
# their measured 46 us where the HBM share gave 67); vendor figures and guesses for the others.
RATES = {
    "sm_90": Rates(hbm=4.2e12, math=790e12, peer=394e9, l2=5.8e12),
    "sm_80": Rates(hbm=1.9e12, math=300e12, peer=250e9, l2=3.5e12),
    "sm_86": Rates(hbm=0.9e12, math=140e12, peer=50e9, l2=1.8e12),
    "sm_89": Rates(hbm=0.95e12, math=300e12, peer=30e9, l2=2.5e12),
}


def task_cost_ns(
    arch: str,
    processors: int,
    local_bytes: int,
    remote_bytes: int,
    flops: int,
    streamed_bytes: int = 0,
    rates: Rates | None = None,
) -> float:
    """A tile's time in ns on one of ``processors``: the task overhead plus its slowest feed."""
    r = RATES[arch] if rates is None else rates
    share = 1.0 / processors
    seconds = max(
        local_bytes / (r.hbm * share),
        remote_bytes / (r.peer * share),
        flops / (r.math * share),
        streamed_bytes / (r.l2 * share),
    )
    return r.task_overhead_ns + seconds * 1e9

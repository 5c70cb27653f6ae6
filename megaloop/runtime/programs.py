"""The loop kernel's programs on the device (megaloop/plan/programs.py): each program's tables
uploaded, its counters a range of the rank's counters of its own, and the ``ml::Program`` array
the blocks copy a program's tables from when a run of another program starts."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from megaloop.codegen import LoopProgram
from megaloop.codegen.abi import MAX_OPERANDS, PROGRAM_DTYPE
from megaloop.codegen.kernel import counter_slots
from megaloop.plan.model import KernelOptions, Plan
from megaloop.plan.rendezvous import exchange_region
from megaloop.runtime.records import task_records

TABLES = ("tasks", "waits", "list_begin", "lists", "operand_offsets", "mirrors", "ring_chunks", "ring_begin")


def counter_bases(plan: Plan, rank: int) -> list[int]:
    """Per program, its first counter among the rank's counters; then the count of all of them."""
    out = [0]
    for p in plan.programs:
        out.append(out[-1] + counter_slots(p, rank))
    return out


def memory_sizes(plan: Plan, rank: int) -> tuple[int, int]:
    """Bytes of a rank's arena and counters (one u64 per counter, its mirrors of peers' counters
    included, every program's), as a LoopKernel allocates them and as a peer-memory provider
    (megaloop/runtime/peers.py) must."""
    start, inbox_bytes = exchange_region(plan, rank)  # pushing all_reduces' inboxes, after the plan's buffers
    arena = start + inbox_bytes if inbox_bytes else plan.ranks[rank].arena_bytes
    return max(arena, 8), 8 * max(counter_bases(plan, rank)[-1], 1)


def program_index(plan: Plan, which: int | str) -> int:
    """A program's index, by index or name; KeyError naming the programs there are."""
    names = [p.name for p in plan.programs]
    if isinstance(which, int) and not isinstance(which, bool) and 0 <= which < len(names):
        return which
    if isinstance(which, str) and which in names:
        return names.index(which)
    raise KeyError(f"no program {which!r}: the plan's programs are {names}")


def upload_tables(program: LoopProgram, upload: Callable[[np.ndarray], int], options: KernelOptions) -> np.ndarray:
    """Every program's tables uploaded (``upload``: array -> device address): the ``ml::Program``
    rows, their counters not yet set (``connect_counters``); with ``options.task_records``, each
    program's task records too (megaloop/runtime/records.py)."""
    rows = np.zeros(1 + len(program.others), PROGRAM_DTYPE)
    for row, p in zip(rows, [program, *program.others]):
        for name in TABLES:
            table = getattr(p, name)
            row[name] = upload(table.reshape(-1, MAX_OPERANDS) if name == "operand_offsets" else table)
        if options.task_records:
            row["records"] = upload(task_records(p, options.slot_waits))
    return rows


def connect_counters(rows: np.ndarray, plan: Plan, rank: int, counters: list[int],
                     upload: Callable[[np.ndarray], int]) -> None:  # fmt: skip
    """Each program's counters (its range of every rank's counters: ``counters``, device addresses by
    rank) into its ``ml::Program`` row of rank ``rank``."""
    bases = [counter_bases(plan, r) for r in range(len(counters))]
    for q, row in enumerate(rows):
        mine = [c + 8 * bases[r][q] for r, c in enumerate(counters)]
        row["counters"] = mine[rank]
        row["rank_counters"] = upload(np.array(mine, np.uint64))

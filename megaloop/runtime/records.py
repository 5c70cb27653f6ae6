"""Task records (KernelOptions.task_records): one ``ml::TaskSlot`` per list position, laid out on the
host as megaloop/loop.cuh declares it (its static_asserts check the same arithmetic), so that a block
copies the slot of the task after next with one asynchronous copy of a known address instead of
three dependent loads (list entry, descriptor, then its waits and operand offsets)."""

from __future__ import annotations

import numpy as np

from megaloop.codegen import LoopProgram
from megaloop.codegen.abi import MAX_OPERANDS, TASK_DTYPE, WAIT_DTYPE


def slot_dtype(slot_waits: int) -> np.dtype:
    """``ml::TaskSlot`` with ``slot_waits`` waits: the task, its first waits, its op's operand offsets
    (at the next multiple of 8), its id, padded to 16 bytes (the copy's unit)."""
    waits_at = TASK_DTYPE.itemsize
    offsets_at = -(-(waits_at + slot_waits * WAIT_DTYPE.itemsize) // 8) * 8
    id_at = offsets_at + 8 * MAX_OPERANDS
    return np.dtype(
        {
            "names": ["task", "waits", "offsets", "id"],
            "formats": [TASK_DTYPE, (WAIT_DTYPE, (slot_waits,)), (np.int64, (MAX_OPERANDS,)), np.int32],
            "offsets": [0, waits_at, offsets_at, id_at],
            "itemsize": -(-(id_at + 4) // 16) * 16,
        }
    )


def task_records(program: LoopProgram, slot_waits: int) -> np.ndarray:
    """The slot of every list position of ``program`` (lists order, every processor's in turn); waits
    past ``slot_waits`` are left out (the kernel reads them from the wait table)."""
    out = np.zeros(len(program.lists), slot_dtype(slot_waits))
    if not len(out):
        return out
    ids = program.lists.astype(np.int64)
    tasks = program.tasks[ids]
    out["task"] = tasks
    out["id"] = ids
    out["offsets"] = program.operand_offsets.reshape(-1, MAX_OPERANDS)[tasks["op"]]
    for j in range(slot_waits):
        has = tasks["wait_count"] > j
        out["waits"][has, j] = program.waits[tasks["wait_begin"][has] + j]
    return out

"""The host <-> loop kernel ABI, described once: the structs both sides read (tasks, waits, mirrors,
the control block, the kernel's arguments), their bounds and the kernel's error codes.

From this description come the host's numpy dtypes (``TASK.dtype``, ...) and the C++ declarations of
megaloop/codegen/include/megaloop/abi.cuh, which also ``static_assert``s that the compiler lays every
field where numpy does: a layout the two sides disagree on fails the kernel's compile (every loop
kernel, and tests/test_abi.py in CI), not a run. After editing it, rewrite the header:

    python scripts/gen_abi.py
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

HEADER = Path(__file__).resolve().parent / "include" / "megaloop" / "abi.cuh"

MAX_DIMS = 6  # axes of a task's box
MAX_OPERANDS = 16  # a collective reads one operand per member: up to 15 ranks in a group


@dataclass(frozen=True)
class Field:
    """One member: its C++ type as declared, the host's numpy type of one element, and how many."""

    name: str
    ctype: str
    np_type: type
    count: int = 1
    doc: str = ""
    extent: str = ""  # the count as C++ spells it (a constant's name), if not the number


def i32(name: str, doc: str = "", count: int = 1, extent: str = "") -> Field:
    return Field(name, "int", np.int32, count, doc, extent)


def u64(name: str, doc: str = "", ctype: str = "u64") -> Field:
    return Field(name, ctype, np.uint64, 1, doc)


def i64(name: str, doc: str = "", ctype: str = "i64", count: int = 1) -> Field:
    return Field(name, ctype, np.int64, count, doc)


def ptr(name: str, ctype: str, doc: str = "") -> Field:
    """A device address: a pointer in C++, a u64 on the host."""
    return Field(name, ctype, np.uint64, 1, doc)


@dataclass(frozen=True)
class Struct:
    name: str
    doc: str
    fields: tuple[Field, ...]

    @property
    def dtype(self) -> np.dtype:
        """The host's layout: C's rules (each field at a multiple of its alignment), as numpy's align."""
        fields = [(f.name, f.np_type, (f.count,)) if f.count > 1 else (f.name, f.np_type) for f in self.fields]
        return np.dtype(fields, align=True)


TASK = Struct(
    "Task",
    "One tile task (megaloop/codegen/kernel.py fills a table of them per rank).",
    (
        i32("sig", "which generated tile function runs it"),
        i32("op", "plan op id (operand offsets, profiler names)"),
        i32("wait_begin", "its waits: waits[wait_begin .. wait_begin + wait_count)"),
        i32("wait_count"),
        i32("counter", "incremented when it finishes; -1: no task waits on it, so none is"),
        i32("remote", "1: other ranks wait on that counter, so it is released at system scope"),
        i32("mirror_begin", "... and mirrored: mirrors[mirror_begin .. + mirror_count) are bumped too"),
        i32("mirror_count"),
        i32("tile", "a pushing all_reduce's tile: its slot in the inbox (megaloop/exchange.cuh)"),
        i32("ring_first", "a weight-ring tile: its first chunk in its processor's ring list; -1: none"),
        i32("lo", "the box it writes (its tile), in its op's output index space", MAX_DIMS, "MAX_DIMS"),
        i32("hi", "", MAX_DIMS, "MAX_DIMS"),
    ),
)
WAIT = Struct(
    "Wait",
    "A task's wait: until counter >= per_iteration * (k + 1 - lag) in iteration k.",
    (
        i32("counter"),
        i32("per_iteration", "how many tasks signal the counter each iteration"),
        i32("lag", "0: this iteration's work; 1: the previous iteration's"),
        i32("rank", "whose counter (another rank's: released at system scope)"),
        i32("mirror", "another rank's counter: this rank's slot mirroring it (polled here); -1: none"),
    ),
)
MIRROR = Struct(
    "Mirror",
    "A peer's mirror of a counter: slot `counter` of rank `rank`'s counters (megaloop/codegen/kernel.py\n"
    "mirror_counters): the task that bumps the counter bumps the mirror too, and the peer polls its own\n"
    "memory instead of this rank's across NVLink.",
    (i32("rank"), i32("counter")),
)
RING_CHUNK = Struct(
    "RingChunk",
    "Whole rows of a parameter that the weight ring copies into one shared-memory slot\n"
    "(megaloop/ring.cuh): `rows` rows of `row_bytes`, `stride` bytes apart, from arena byte `src`.",
    (i64("src"), i64("stride"), i32("rows"), i32("row_bytes")),
)
PROGRAM = Struct(
    "Program",
    "One program's tables (megaloop/plan/programs.py): a block that starts an iteration of another program\n"
    "than its last copies these into its Args (megaloop/loop_body.cuh).",
    (
        ptr("tasks", "const Task*"),
        ptr("waits", "const Wait*"),
        ptr("list_begin", "const int*"),
        ptr("lists", "const int*"),
        ptr("operand_offsets", "const i64*"),
        ptr("counters", "u64*", "the program's own counters"),
        ptr("rank_counters", "u64* const*", "every rank's counters of this program"),
        ptr("mirrors", "const Mirror*"),
        ptr("ring_chunks", "const RingChunk*"),
        ptr("ring_begin", "const int*"),
        ptr("records", "const TaskSlot*", "null, or a task slot per list position (KernelOptions.task_records)"),
    ),
)
CONTROL = Struct(
    "Control",
    "Host <-> kernel: lives in mapped pinned host memory (each block's finished iterations follow it).",
    (
        u64("requested", "host: iterations asked for so far (only ever grows)", "volatile u64"),
        u64("host_ns", "host: its clock, read with requested in one load (KernelOptions.round_trip_stamps)",
            "volatile u64"),
        u64("stop", "host: 1 = leave the loop", "volatile u64"),
        u64("error", "kernel: 0, or an error code (Error)", "volatile u64"),
        i64("info", "kernel: what went wrong (megaloop/loop.cuh fail, megaloop/runtime/report.py)", "volatile i64", 8),
        u64("program", "host: which program the iterations asked for run (written before requested)", "volatile u64"),
        u64("done", "kernel: iterations every block finished (KernelOptions.completion_word)", "volatile u64"),
    ),
)
ARGS = Struct(
    "Args",
    "The loop kernel's one argument, uploaded by megaloop/runtime/loop.py.",
    (
        ptr("arena", "char*"),
        ptr("tasks", "const Task*"),
        ptr("waits", "const Wait*"),
        ptr("list_begin", "const int*", "processor p runs lists[list_begin[p] .. list_begin[p + 1])"),
        ptr("lists", "const int*"),
        ptr("operand_offsets", "const i64*", "per op: MAX_OPERANDS byte offsets into the arena"),
        ptr("counters", "u64*"),
        ptr("abort", "u64*", "device flag: nonzero once any block gave up"),
        ptr("doorbell", "u64*", "device copy of the doorbell: [0] iterations granted, [1] stop, [2] program (block 0)"),
        ptr("progress", "volatile u64*", "mapped host memory: iterations each block has finished"),
        ptr("control", "Control*"),
        ptr(
            "profile",
            "u64*",
            "null, or globaltimer pairs for the first profile_iterations: (start, end) per task, "
            "then STAMP_WORDS per block (KernelOptions.round_trip_stamps)",
        ),
        u64("timeout_ns"),
        i32("profile_iterations"),
        i32("n_tasks"),
        ptr("arenas", "char* const*", "every rank's arena (peer memory), indexed by rank; arenas[rank] == arena"),
        ptr("rank_counters", "u64* const*", "every rank's counters, indexed by rank"),
        i32("rank"),
        i32("world"),
        ptr("mirrors", "const Mirror*", "the peers' mirror counters the tasks bump (Task::mirror_begin)"),
        ptr("ring_chunks", "const RingChunk*", "processor p's weight ring copies ring_chunks[ring_begin[p] ..]"),
        ptr("ring_begin", "const int*", "... up to ring_begin[p + 1], in task order, every iteration"),
        ptr("programs", "const Program*", "every program's tables (the fields above: program 0's)"),
        i32("n_programs"),
        ptr("records", "const TaskSlot*", "null, or a task slot per list position (KernelOptions.task_records)"),
    ),
)
STRUCTS = (TASK, WAIT, MIRROR, RING_CHUNK, PROGRAM, CONTROL, ARGS)
TASK_DTYPE, WAIT_DTYPE, MIRROR_DTYPE, ARGS_DTYPE = TASK.dtype, WAIT.dtype, MIRROR.dtype, ARGS.dtype
PROGRAM_DTYPE = PROGRAM.dtype
RING_CHUNK_DTYPE = RING_CHUNK.dtype
# Control.error's values (megaloop/runtime/report.py reads them)
ERRORS = {"OK": 0, "WATCHDOG": 1, "DATA": 2}
OK, WATCHDOG, DATA = ERRORS["OK"], ERRORS["WATCHDOG"], ERRORS["DATA"]


def word(s: Struct, name: str) -> int:
    """The index of a u64 field among a struct's 8-byte words (the host reads Control as u64s)."""
    offset = s.dtype.fields[name][1]
    assert offset % 8 == 0, f"{s.name}.{name} is not on a word"
    return offset // 8


def _comment(text: str, indent: str = "") -> list[str]:
    return [f"{indent}// {line}" for line in text.splitlines()]


def struct_text(s: Struct) -> str:
    lines = [*_comment(s.doc), f"struct {s.name} {{"]
    for f in s.fields:
        extent = f"[{f.extent or f.count}]" if f.count > 1 else ""
        decl = f"    {f.ctype} {f.name}{extent};"
        lines.append(f"{decl}  // {f.doc}" if f.doc else decl)
    return "\n".join([*lines, "};"])


def assert_text(s: Struct) -> str:
    """static_asserts that the compiler lays ``s`` out as the host's numpy dtype does."""
    dt, where = s.dtype, "on the host (megaloop/codegen/abi.py)"
    lines = [f'static_assert(sizeof({s.name}) == {dt.itemsize}, "ml::{s.name}: {dt.itemsize} bytes {where}");']
    for f in s.fields:
        sub, at = dt.fields[f.name][:2]
        lines.append(
            f"static_assert(ML_OFFSETOF({s.name}, {f.name}) == {at} && sizeof({s.name}::{f.name}) == "
            f'{sub.itemsize}, "ml::{s.name}::{f.name}: at byte {at}, {sub.itemsize} bytes {where}");'
        )
    return "\n".join(lines)


# offsetof as a constant expression (NVRTC has no <cstddef>): __builtin_offsetof where the front end has
# it, EDG's __INTADDR__ where it does not (NVRTC 13.0)
OFFSETOF = """#ifndef ML_OFFSETOF
#if defined(__has_builtin)
#if __has_builtin(__builtin_offsetof)
#define ML_OFFSETOF(T, m) __builtin_offsetof(T, m)
#endif
#endif
#endif
#ifndef ML_OFFSETOF
#define ML_OFFSETOF(T, m) ((unsigned long long)__INTADDR__(&(((T*)0)->m)))
#endif
"""


def definitions(structs: tuple[Struct, ...] = STRUCTS) -> str:
    """The C++ declarations (in namespace ml, after megaloop/types.cuh): bounds, structs, error codes."""
    errors = ", ".join(f"{k} = {v}" for k, v in ERRORS.items())
    parts = [
        f"constexpr int MAX_DIMS = {MAX_DIMS};\nconstexpr int MAX_OPERANDS = {MAX_OPERANDS};\n"
        'static_assert(sizeof(void*) == 8, "the host passes device addresses as u64");\n'
        "struct TaskSlot;  // megaloop/loop.cuh: a task's slot, as the host lays it out (runtime/records.py)\n",
        *[f"{struct_text(s)}\n{assert_text(s)}\n" for s in structs],
        f"enum Error : u64 {{ {errors} }};\n",
    ]
    return "\n".join(parts)


def render() -> str:
    """The text of megaloop/abi.cuh."""
    return (
        "// GENERATED by megaloop/codegen/abi.py (python scripts/gen_abi.py): do not edit by hand\n"
        "// (tests/test_abi.py checks it is current). The structs the host and the loop kernel share, each\n"
        "// followed by static_asserts that the compiler lays it out as the host's numpy dtype does.\n"
        '#pragma once\n#include "megaloop/types.cuh"\n\n'
        f"{OFFSETOF}\nnamespace ml {{\n\n"
        f"{definitions()}\n}}  // namespace ml\n"
    )

"""One rank's plan -> the loop kernel's CUDA C++ source and the tables it walks.

The source has one function per distinct op signature (each op's template: megaloop/codegen/templates.py,
named by its OpDef's ``lowering``), a dispatch switch,
and the loop itself; everything that differs between ops of one signature (where their operands
live) and everything per task (its box, its waits, its counter) is data, uploaded with the plan:

- ``tasks``: per task, its signature, op, waits, counter and output box (``ml::Task``);
- ``waits``: (counter, signalers per iteration, lag) triples (``ml::Wait``);
- ``list_begin``/``lists``: each processor's task ids in order;
- ``operand_offsets``: per op, the arena byte offset of each operand (inputs, then outputs).

``generate(plan)`` is pure and deterministic: the same plan gives byte-identical source, which keys
the compile cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from megaloop.codegen.abi import MAX_DIMS, MAX_OPERANDS, MIRROR_DTYPE, RING_CHUNK_DTYPE, TASK_DTYPE, WAIT_DTYPE
from megaloop.codegen.emit import Operand
from megaloop.codegen.exchange import member_inbox_offsets
from megaloop.codegen.templates import TEMPLATES, Lowered, RingStream, TileCall
from megaloop.codegen.tidy import tidy
from megaloop.errors import GraphBuildError
from megaloop.frontend.opdef import REGISTRY
from megaloop.frontend.shapes import format_shape
from megaloop.plan.model import KernelOptions, Plan, RankPlan
from megaloop.plan.rendezvous import inboxes


@dataclass
class LoopProgram:
    """Everything the runtime needs for one rank: the source and the tables (the first program's;
    ``others``: each other program's, ``plan.others`` order)."""

    source: str
    tasks: np.ndarray  # TASK_DTYPE
    waits: np.ndarray  # WAIT_DTYPE
    list_begin: np.ndarray  # int32, processors + 1
    lists: np.ndarray  # int32
    operand_offsets: np.ndarray  # int64, (ops, MAX_OPERANDS)
    mirrors: np.ndarray  # MIRROR_DTYPE: the peers' mirror counters the tasks bump (Task.mirror_begin/count)
    counters: int  # counter slots: the plan's counters, then the mirrors of peers' counters (counter_slots)
    threads: int
    shared_bytes: int  # dynamic shared memory per block (split-key attention, tensor-core operand stages, row rings)
    processors: int
    op_names: list[str]
    signatures: list[str]  # one comment line per signature
    ring_chunks: np.ndarray  # RING_CHUNK_DTYPE: the weight ring's copies, processor by processor
    ring_begin: np.ndarray  # int32, processors + 1
    others: list[LoopProgram] = field(default_factory=list)  # the plan's other programs' tables (same source)


def _operand(rp: RankPlan, tid: int) -> Operand:
    t = rp.tensors[tid]
    return Operand(t.dtype, t.shape, t.strides)


def _describe(rp: RankPlan, op_id: int) -> str:
    op = rp.ops[op_id]
    outs = ", ".join(f"{rp.tensors[t].dtype.short}{format_shape(rp.tensors[t].shape)}" for t in op.outputs)
    ins = ", ".join(f"{rp.tensors[t].dtype.short}{format_shape(rp.tensors[t].shape)}" for t in op.inputs)
    return f"{op.op} {op.name}: {outs} <- {ins}"


def mirror_counters(plan: Plan) -> list[dict[tuple[int, int], int]]:
    """Per rank r: (rank p, counter c) -> the slot of r's counters that mirrors p's counter c, for every
    counter of another rank that r's tasks wait on; slots after r's own counters, in (p, c) order.

    Why: a wait on a peer's counter polled it across NVLink, each poll a round trip; now every task
    that signals c on p also adds 1 to the mirror in r's memory (a posted write after its release), and
    r polls its own memory. The mirror's value is the counter's at every point r can see (same
    increments, each after the counter's own), so the plan's waits, targets and verification are
    unchanged; the watchdog still names p's counter."""
    mirrors: list[dict[tuple[int, int], int]] = []
    for r, rp in enumerate(plan.ranks):
        peer_counters = sorted({(w.rank, w.counter) for t in rp.tasks for w in t.waits if w.rank != r})
        mirrors.append({pc: len(rp.counters) + k for k, pc in enumerate(peer_counters)})
    return mirrors


def counter_slots(plan: Plan, rank: int) -> int:
    """u64 counters rank ``rank`` allocates: its plan's counters, then its mirrors of peers' counters."""
    return len(plan.ranks[rank].counters) + len(mirror_counters(plan)[rank])


def generate(plan: Plan, rank: int = 0, mirrors: bool = True) -> LoopProgram:
    """The loop kernel of rank ``rank``: one source for every program of the plan (megaloop/plan/
    programs.py), their tables in ``others``. ``mirrors=False``: waits on other ranks' counters poll
    them across the peer link instead of a mirror here (for GPUs without native peer atomics, where
    the producers' remote increments of the mirrors could be lost); every rank of a job must agree."""
    programs = plan.programs
    pushed = [inboxes(p, rank) for p in programs]  # pushing all_reduces (megaloop/plan/rendezvous.py)
    if len(programs) > 1 and any(pushed):
        raise GraphBuildError(
            "codegen: several programs with pushing all_reduces: their inboxes would share the arena's end; "
            "plan those programs with all_reduce tiles that pull (tiles={'all_reduce': {'push': 0}})"
        )
    options = plan.options
    ring_bytes = options.weight_ring_slot_bytes if options.weight_ring_slots and plan.arch == "sm_90" else 0
    lowered = [_lower(p, rank, box, ring_bytes) for p, box in zip(programs, pushed)]
    shared = max((low.shared_bytes for lows in lowered for low in lows), default=0)
    ring_layout = None
    # (a kernel of several programs too: its loader walks each grant's program's chunks)
    with_loader = options.weight_ring_loader > 0
    if any(low.ring for lows in lowered for low in lows):
        offset = -(-shared // 128) * 128
        # a slot's full barrier and pending phase; with the loader warp its empty barrier too
        slot = ring_bytes + (20 if with_loader else 12)
        room = (plan.shared_memory or 0) - RING_STATIC_RESERVE - offset
        slots = min(options.weight_ring_slots, max(room, 0) // slot)  # as many as fit, at most the option's
        if slots >= max(min(options.weight_ring_slots, MIN_RING_SLOTS), 1):
            ring_layout = (slots, ring_bytes, offset)
            shared = offset + slots * slot
        else:  # no room beside the other tiles' shared memory: the ring stays out of this kernel
            lowered = [_lower(p, rank, box, 0) for p, box in zip(programs, pushed)]
            shared = max((low.shared_bytes for lows in lowered for low in lows), default=0)
    functions: list[str] = []
    comments: list[str] = []
    bodies: dict[str, int] = {}
    kernel = (bodies, functions, comments)
    tables = [_tables(p, rank, mirrors, lows, box, kernel) for p, lows, box in zip(programs, lowered, pushed)]
    loader = ring_layout is not None and with_loader  # a warp beside the tiles' warps
    threads = plan.warps * 32 + (32 if loader else 0)
    source = _source(functions, threads, plan.warps * 32, plan.ranks[rank].graph.name,
                     sum(len(t.tasks) for t in tables), plan.options, ring_layout, len(programs), loader)  # fmt: skip
    for t in tables:
        t.source, t.threads, t.shared_bytes, t.signatures = source, threads, shared, comments
    first = tables[0]
    first.others = tables[1:]
    return first


def _tables(plan: Plan, rank: int, mirrors: bool, lowered: list[Lowered], pushed: dict,
            kernel: tuple[dict[str, int], list[str], list[str]]) -> LoopProgram:  # fmt: skip
    """One program's tables (its tile functions added to the kernel's ``kernel`` = bodies, functions,
    comments); the source and the kernel-wide sizes are filled in by ``generate``."""
    rp = plan.ranks[rank]
    bodies, functions, comments = kernel
    rings = {op: low.ring for op, low in enumerate(lowered) if low.ring}
    signature_of_op: list[int] = []
    slots_of: dict[int, list[tuple[int, int]]] = {}  # op reading other ranks -> (rank, tensor id) per slot
    for op, low in zip(rp.ops, lowered):
        _add_function(low.body, rp, op.id, bodies, functions, comments, signature_of_op)
        if low.slots is not None:
            slots_of[op.id] = low.slots
    tasks = np.zeros(len(rp.tasks), TASK_DTYPE)
    waits: list[tuple[int, int, int, int, int]] = []
    signalers = [{c: len(ts) for c, ts in r.signalers().items()} for r in plan.ranks]
    all_mirrors = mirror_counters(plan)
    mine = all_mirrors[rank] if mirrors else {}
    remote: set[int] = set()  # my counters other ranks wait on
    mirrored_by: dict[int, list[tuple[int, int]]] = {}  # my counter -> (peer rank, its mirror slot)
    for r, slots in enumerate(all_mirrors):
        for (p, c), slot in slots.items():
            if p == rank:
                remote.add(c)
                if mirrors:
                    mirrored_by.setdefault(c, []).append((r, slot))
    bumps: list[tuple[int, int]] = []
    # a counter no task waits on is never bumped: its release is ~0.5 us on a chain's path
    waited = remote | {w.counter for t in rp.tasks for w in t.waits if w.rank == rank}
    for t in rp.tasks:
        if len(t.writes) != 1:
            raise GraphBuildError(f"codegen: {rp.task_name(t)} writes {len(t.writes)} boxes; tiles write exactly one")
        box = t.writes[0].box
        if len(box.lo) > MAX_DIMS:
            raise GraphBuildError(f"codegen: {rp.task_name(t)} has a {len(box.lo)}-D tile; at most {MAX_DIMS} axes")
        row = tasks[t.id]
        row["sig"], row["op"] = signature_of_op[t.op], t.op
        row["counter"] = t.signal if t.signal in waited else -1
        peers = mirrored_by.get(t.signal, [])
        row["remote"] = int(t.signal in remote)  # other ranks wait on it: released at system scope
        row["mirror_begin"], row["mirror_count"] = len(bumps), len(peers)  # ... and bumped in their mirrors
        bumps.extend(peers)
        row["wait_begin"], row["wait_count"] = len(waits), len(t.waits)
        for w in t.waits:
            mirror = mine.get((w.rank, w.counter), -1) if w.rank != rank else -1
            waits.append((w.counter, signalers[w.rank][w.counter], w.lag, w.rank, mirror))
        row["tile"] = t.coords[0] if t.op in pushed and t.coords else 0  # its slot in the inbox
        row["ring_first"] = -1
        row["lo"][: len(box.lo)] = box.lo
        row["hi"][: len(box.hi)] = box.hi
        row["hi"][len(box.hi) :] = 1
    offsets = np.zeros((max(len(rp.ops), 1), MAX_OPERANDS), np.int64)
    member_boxes: list[dict] | None = None  # every rank's inboxes, once a pushing op needs its members'
    for op in rp.ops:
        ranked = slots_of.get(op.id, [(rank, tid) for tid in op.inputs + op.outputs])
        slots = [(m, plan.ranks[m], tid) for m, tid in ranked]
        for k, (_, owner, tid) in enumerate(slots):
            t = owner.tensors[tid]
            offsets[op.id, k] = owner.buffers[t.buffer].offset + t.offset * t.dtype.itemsize
        if op.id in pushed:  # x, out, then every member's inbox (in its own arena)
            if member_boxes is None:
                member_boxes = [inboxes(plan, m) for m in range(plan.world_size)]
            inbox_offsets = member_inbox_offsets(plan, rank, op.id, member_boxes)
            offsets[op.id, 2 : 2 + len(inbox_offsets)] = inbox_offsets
    list_begin = np.zeros(plan.processors + 1, np.int32)
    lists: list[int] = []
    for p in range(plan.processors):
        lst = rp.processors[p] if p < len(rp.processors) else []
        lists.extend(lst)
        list_begin[p + 1] = len(lists)
    ring_chunks, ring_begin = _ring_chunks(rp, plan.processors, tasks, offsets, rings)
    return LoopProgram(
        "",
        tasks,
        np.array(waits, WAIT_DTYPE),
        list_begin,
        np.array(lists, np.int32),
        offsets,
        np.array(bumps, MIRROR_DTYPE),
        len(rp.counters) + len(all_mirrors[rank]),  # counter_slots, from the mirrors at hand
        0,
        0,
        plan.processors,
        [op.name for op in rp.ops],
        [],
        ring_chunks,
        ring_begin,
    )


RING_STATIC_RESERVE = 8 * 1024  # the loop kernel's static shared memory, beside the ring
MIN_RING_SLOTS = 4  # fewer slots than this stream too little ahead to pay for the ring's waits


def _lower(plan: Plan, rank: int, pushed: dict, ring_bytes: int) -> list[Lowered]:
    """Each op's template applied (megaloop/codegen/templates.py), in op order."""
    rp = plan.ranks[rank]
    extent: dict[int, tuple[int, int]] = {}  # op -> its largest tile (rows of all its batch indices, cols)
    largest: dict[int, int] = {}  # op -> elements of its largest tile (the box it writes)
    for t in rp.tasks:
        if t.writes:
            box = t.writes[0].box
            largest[t.op] = max(largest.get(t.op, 0), box.size)
            rows, cols = extent.get(t.op, (0, 0))
            width = box.hi[-1] - box.lo[-1] if box.hi else 1
            extent[t.op] = (max(rows, box.size // max(width, 1)), max(cols, width))
    lowered = []
    for op in rp.ops:
        opdef = REGISTRY[op.op]
        if opdef.lowering is None or opdef.lowering.template not in TEMPLATES:
            raise GraphBuildError(
                f"codegen: {op.op} {op.name} cannot run in the loop kernel yet (it has no CUDA tile "
                "template: OpDef.lowering names one of megaloop.codegen.templates.TEMPLATES)"
            )
        if len(op.inputs) + len(op.outputs) > MAX_OPERANDS:
            raise GraphBuildError(f"codegen: {op.op} {op.name} has more than {MAX_OPERANDS} operands")
        ins = [_operand(rp, t) for t in op.inputs]
        outs = [_operand(rp, t) for t in op.outputs]
        call = TileCall(
            plan, rank, op, opdef, ins, outs, largest.get(op.id, 0), extent.get(op.id, (0, 0)), pushed.get(op.id),
            ring_bytes,
        )
        lowered.append(TEMPLATES[opdef.lowering.template](call))
    return lowered


def _ring_chunks(
    rp: RankPlan, processors: int, tasks: np.ndarray, offsets: np.ndarray, rings: dict[int, tuple[RingStream, ...]]
) -> tuple[np.ndarray, np.ndarray]:
    """The weight ring's copies (megaloop/ring.cuh): each processor's ring tiles in list order, each
    tile's rows (its box's columns) in chunks of ``per_chunk``; sets each ring tile's ``ring_first``."""
    chunks: list[tuple[int, int, int, int]] = []
    begin = np.zeros(processors + 1, np.int32)
    for p in range(processors):
        first = len(chunks)
        for tid in rp.processors[p] if p < len(rp.processors) else []:
            streams = rings.get(int(tasks[tid]["op"]))
            if not streams:
                continue
            box = rp.tasks[tid].writes[0].box
            lo, hi = box.lo[-1], box.hi[-1]
            tasks[tid]["ring_first"] = len(chunks) - first
            for ring in streams:  # (a tile of two weights: all of the first's chunks, then the second's)
                base = int(offsets[tasks[tid]["op"], ring.operand]) + lo * ring.stride
                for c in range(lo, hi, ring.per_chunk):
                    rows = min(ring.per_chunk, hi - c)
                    chunks.append((base + (c - lo) * ring.stride, ring.stride, rows, ring.row_bytes))
        begin[p + 1] = len(chunks)
    return np.array(chunks, RING_CHUNK_DTYPE), begin


def _add_function(
    body: list[str],
    rp: RankPlan,
    op_id: int,
    bodies: dict[str, int],
    functions: list[str],
    comments: list[str],
    signature_of_op: list[int],
) -> None:
    """One tile function per distinct body: ops of one signature share it."""
    text = "\n".join("    " + line for line in tidy(body))
    if text not in bodies:
        bodies[text] = len(functions)
        sig = len(functions)
        comments.append(f"sig_{sig}: {_describe(rp, op_id)}")
        # Tile functions are calls (one copy of each in the instruction cache), except where a call
        # would cost more: ptxas serialises every wgmma (waits after each) when one lives in a callee.
        inline = "__forceinline__" if "ml::wgmma_tile" in text else "__noinline__"
        functions.append(
            f"// {comments[-1]}\n__device__ {inline} void sig_{sig}(const ml::Args& a, "
            f"const ml::Task& t, int tid, const ml::i64* off, ml::u64 k, int proc) {{\n{text}\n}}\n"
        )
    signature_of_op.append(bodies[text])


# the loop's own cost (megaloop/loop.cuh): each option's macro, written only where it differs from
# the default (a kernel built with the defaults keeps its text, and its cache entry)
LOOP_COST_MACROS = {
    "round_trip_stamps": "ML_ROUND_TRIP_STAMPS",
    "task_records": "ML_TASK_RECORDS",
    "completion_word": "ML_COMPLETION_WORD",
    "doorbell_reads": "ML_DOORBELL_READS",
}


def loop_cost_defines(options: KernelOptions) -> str:
    default = KernelOptions()
    return "".join(
        f"#define {macro} {getattr(options, name)}\n"
        for name, macro in LOOP_COST_MACROS.items()
        if getattr(options, name) != getattr(default, name)
    )


def _source(
    functions: list[str],
    threads: int,
    compute_threads: int,
    name: str,
    n_tasks: int,
    options: KernelOptions,
    ring: tuple[int, int, int] | None,
    programs: int = 1,
    loader: bool = False,
) -> str:
    cases = "\n".join(f"        case {i}: sig_{i}(a, t, tid, off, k, proc); break;" for i in range(len(functions)))
    # (only where a tile uses it: other kernels keep their text)
    include = '#include "megaloop/sample.cuh"\n' if any("ml::smp::" in f for f in functions) else ""
    slot = f"#define ML_SLOT_WAITS {options.slot_waits}\n#define ML_POLL_SLEEP_NS {options.poll_sleep_ns}\n"
    if programs > 1:  # (a kernel of one program keeps its text)
        slot += f"#define ML_PROGRAMS {programs}\n"
    slot += loop_cost_defines(options)
    hooks = "ml::NoRing"
    if ring is not None:  # the weight ring (megaloop/ring.cuh): its slots, slot bytes and offset
        slot += "".join(f"#define ML_RING_{n} {v}\n" for n, v in zip(("SLOTS", "SLOT_BYTES", "OFFSET"), ring))
        include += '#include "megaloop/ring.cuh"\n'
        hooks = "ml::WeightRing"
        if loader:  # its copies issued by a warp of their own (megaloop/ring_loader.cuh)
            slot += f"#define ML_RING_LOADER {options.weight_ring_loader}\n"
            slot += f"#define ML_RING_IN_FLIGHT {options.weight_ring_loader_bytes}\n"
            slot += f"#define ML_COMPUTE_THREADS {compute_threads}\n"
            include += '#include "megaloop/ring_loader.cuh"\n'
            hooks = "ml::LoaderRing"
    return f"""// megaloop loop kernel for graph {name!r}: {n_tasks} tasks, {len(functions)} tile functions.
// Generated by megaloop.codegen.kernel; the header library is megaloop/codegen/include/megaloop.
{slot}#include "megaloop/loop.cuh"
#include "megaloop/loop_body.cuh"
#include "megaloop/math.cuh"
#include "megaloop/vec.cuh"
#include "megaloop/mma.cuh"
#include "megaloop/wgmma.cuh"
#include "megaloop/attention.cuh"
#include "megaloop/exchange.cuh"
#include "megaloop/tiles.cuh"
{include}
{chr(10).join(functions)}
__device__ __forceinline__ void run_task(const ml::Args& a, const ml::TaskSlot& s, ml::u64 k, int proc) {{
    const ml::Task& t = s.task;
    const ml::i64* off = s.offsets;
    const int tid = s.id;
    switch (t.sig) {{
{cases}
        default: break;
    }}
}}

extern "C" __global__ void __launch_bounds__({threads}, 1) megaloop_loop(const ml::Args* args) {{
    ml::loop_body<{hooks}>(args, [](const ml::Args& a, const ml::TaskSlot& s, ml::u64 k, int proc) {{
        run_task(a, s, k, proc);
    }});
}}
"""

"""Several programs in one loop kernel: plans of different graphs over the same states and
parameters, one arena, the host picking which program a run runs (docs/runtime.md, "Several
programs in one kernel").

    plan = make_programs({"mixed": step_graph, "decode_1": one_row_graph}, processors=132)  # plan/cache.py
    plan.programs          # [the "mixed" plan, the "decode_1" plan]: each a whole Plan of its own

Each program is planned alone (make_plan), then its buffers are moved (``share_arena``) so that
every state and parameter of a name has one place for all programs, every program's other pinned
buffers (constants, inputs, outputs) bytes of their own, and each program's scratch pool starts at
one offset after them: only one program runs at a time, so their intermediates share those bytes.
Moving keeps each program's own layout (pinned buffers stay apart, scratch keeps its relative
offsets), so what its verification found still holds; ``check_programs`` checks the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict

import numpy as np

from megaloop.errors import GraphBuildError, PlanError
from megaloop.plan import memory
from megaloop.plan.bytes import overlapping_pairs
from megaloop.plan.model import BUFFER_KINDS, Plan, RankPlan

SHARED_KINDS = ("parameter", "state")  # one copy in the arena, whichever program runs
MAX_PROGRAMS = 16  # the loop kernel keeps each program's iteration count in shared memory


def join_programs(plans: Sequence[Plan]) -> Plan:
    """The first of ``plans`` with the rest as its others, their buffers moved into one arena."""
    first, *rest = plans
    first.others = list(rest)
    for p in rest:
        p.others = []
    share_arena(first)
    check_programs(first)
    return first


def _shared_keys(rp: RankPlan) -> dict[int, tuple[str, str]]:
    """Buffer id -> (kind, graph name) of the rank's states and parameters: what programs share."""
    out = {}
    for kind, tensors in (("state", rp.graph.states), ("parameter", rp.graph.parameters)):
        for name, t in tensors.items():
            tid = rp.tensor_of.get(t)
            if tid is not None:
                out[rp.tensors[tid].buffer] = (kind, name)
    return out


def share_arena(plan: Plan) -> None:
    """Move every program's buffers into one arena per rank (module docstring)."""
    programs = plan.programs
    _check_settings(programs, GraphBuildError)
    if len(programs) == 1:
        return
    for r in range(plan.world_size):
        ranks = [p.ranks[r] for p in programs]
        placed: dict[tuple[str, str], tuple[int, int, str]] = {}  # key -> (offset, nbytes, program)
        moved: list[dict[int, int]] = [{} for _ in ranks]
        at = 0
        for kind in BUFFER_KINDS:
            if kind == "scratch":
                continue
            for q, rp in enumerate(ranks):
                keys = _shared_keys(rp)
                for b in rp.buffers:
                    if b.kind != kind:
                        continue
                    key = keys.get(b.id)
                    if key is not None and key in placed:
                        offset, nbytes, first = placed[key]
                        if nbytes != b.nbytes:
                            raise GraphBuildError(
                                f"programs: {key[0]} {key[1]!r} has {b.nbytes} bytes in program {programs[q].name!r} "
                                f"but {nbytes} in {first!r}: programs share states and parameters by name, so "
                                "their shapes and dtypes must agree"
                            )
                        moved[q][b.id] = offset
                        continue
                    moved[q][b.id] = at
                    if key is not None:
                        placed[key] = (at, b.nbytes, programs[q].name)
                    at += memory.align(b.nbytes)
        pool = at
        scratch = max(rp.memory.scratch_bytes if rp.memory is not None else 0 for rp in ranks)
        for q, rp in enumerate(ranks):
            start = _pool_start(rp)
            for b in rp.buffers:
                b.offset = moved[q][b.id] if b.kind != "scratch" else pool + b.offset - start
            rp.arena_bytes = pool + scratch
            if rp.memory is not None:
                rp.memory = memory.Layout({b.id: b.offset for b in rp.buffers}, rp.arena_bytes,
                                          rp.memory.scratch_bytes, rp.memory.scratch_unshared,
                                          dict(rp.memory.region_bytes))  # fmt: skip


def _pool_start(rp: RankPlan) -> int:
    scratch = [b.offset for b in rp.buffers if b.kind == "scratch"]
    return min(scratch) if scratch else 0


def _check_settings(programs: list[Plan], error: type) -> None:
    first = programs[0]
    names = [p.name for p in programs]
    if len(set(names)) != len(names):
        raise error(f"programs: names must differ, got {names}")
    for p in programs[1:]:
        for what, mine, theirs in (
            ("arch", p.arch, first.arch),
            ("processors", p.processors, first.processors),
            ("warps", p.warps, first.warps),
            ("shared_memory", p.shared_memory, first.shared_memory),
            ("ranks", p.world_size, first.world_size),
            ("options", asdict(p.options), asdict(first.options)),
            ("fusion", p.fusion.to_dict(), first.fusion.to_dict()),
        ):
            if mine != theirs:
                raise error(
                    f"programs: program {p.name!r} was planned with {what} {mine}, {first.name!r} with {theirs}: "
                    "one loop kernel runs them, so plan them with the same settings"
                )
        if p.others:
            raise error(f"programs: program {p.name!r} holds programs of its own; only the first plan holds others")


def check_programs(plan: Plan) -> None:
    """Raise PlanError unless the programs fit one loop kernel: the same settings, one arena size a
    rank, each state and parameter at one place (same bytes) in all, and no other byte of a program
    shared with another program's buffer except scratch with scratch."""
    programs = plan.programs
    _check_settings(programs, PlanError)
    if len(programs) == 1:
        return
    for r in range(plan.world_size):
        ranks = [p.ranks[r] for p in programs]
        sizes = {rp.arena_bytes for rp in ranks}
        if len(sizes) != 1:
            raise PlanError(f"programs: rank {r}'s arena has sizes {sorted(sizes)}; one arena holds every program")
        rows = []  # (start, end, program, buffer)
        for q, rp in enumerate(ranks):
            keys = _shared_keys(rp)
            rows += [(b.offset, b.offset + b.nbytes, q, b, keys.get(b.id)) for b in rp.buffers if b.nbytes]
        if not rows:
            continue
        starts = np.array([x[0] for x in rows], np.int64)
        ends = np.array([x[1] for x in rows], np.int64)
        for i, j in zip(*overlapping_pairs(starts, ends)):
            a, b = rows[int(i)], rows[int(j)]
            if a[2] == b[2]:
                continue  # within a program: its own verification
            if a[3].kind == "scratch" and b[3].kind == "scratch":
                continue
            if a[4] is not None and a[4] == b[4] and a[:2] == b[:2]:
                continue  # one state or parameter, one place
            raise PlanError(
                f"programs: rank {r}: {a[3].kind} {a[3].name!r} of program {programs[a[2]].name!r} and "
                f"{b[3].kind} {b[3].name!r} of {programs[b[2]].name!r} share bytes [{max(a[0], b[0])}, "
                f"{min(a[1], b[1])}); only a state or parameter of one name (same place, same size) or two "
                "programs' scratch may"
            )

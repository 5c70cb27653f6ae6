"""The plan interpreter: runs a plan's tile tasks on numpy, the way the loop kernel runs them on a GPU.

Every rank has one arena of bytes, laid out by the plan and poisoned (0xFF: NaN in every float dtype)
before the host writes parameters, constants, inputs and the initial state into it. Each processor
walks its task list, iteration after iteration; a task may start once its waits are satisfied. At
each step a seeded random choice among the processors that can proceed picks the next one to run,
weighted by a random speed per processor, so that a run explores an arbitrary legal interleaving.

A task reads only the boxes it declares: its op's numpy reference sees operands that hold the
arena's bytes inside those boxes and NaN elsewhere, and only the boxes it declares as written are
stored back. Before the reference, the op's data rules (``OpDef.check_data``: ids, cache positions,
lengths in range) run on the values inside the declared boxes and raise the DataError ``evaluate``
raises, naming the task. Every byte remembers which op wrote it last and in which iteration; a read of bytes that
hold the wrong version (not yet written this iteration, already overwritten by a later op or a later
iteration, or never written) stops the run with an error naming the task, the tensor and the
version found. Multi-rank plans run all ranks together; collectives read the peers' arenas.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from megaloop.dtypes import round_to
from megaloop.errors import DataError, DeadlockError, EvaluationError, InterpreterError
from megaloop.frontend.opdef import REGISTRY
from megaloop.frontend.tiling import Box
from megaloop.frontend.values import coerce
from megaloop.plan.bytes import box_runs
from megaloop.plan.model import Access, Plan, PlanTensor, Task
from megaloop.plan.rendezvous import meetings
from megaloop.plan.tasks import op_node, peer_operand
from megaloop.reference.evaluate import Evaluation

NEVER = -2  # version of a byte nobody wrote
HOST = -1  # version of a byte the host wrote before the run


class _Rank:
    def __init__(self, plan: Plan, r: int) -> None:
        rp = plan.ranks[r]
        self.rp = rp
        try:
            self.arena = np.full(rp.arena_bytes, 0xFF, np.uint8)
            self.iteration = np.full(rp.arena_bytes, NEVER, np.int32)
            self.writer = np.full(rp.arena_bytes, -1, np.int32)  # op id; -1 for the host
        except (MemoryError, ValueError):
            raise InterpreterError(
                f"the plan interpreter cannot hold rank {r}'s arena of {rp.arena_bytes} bytes (and 8 bytes of "
                "bookkeeping for each) in this machine's memory"
            ) from None
        self.counters = np.zeros(len(rp.counters), np.int64)
        # which op produces each tensor's storage this iteration (None: host-written source)
        made_by: dict[int, int] = {}
        for op in rp.ops:
            for t in op.outputs:
                made_by[t] = op.id
        root_of = {t: rp.tensor_of[g.base] for g, t in rp.tensor_of.items()}
        self.producer = {t: made_by.get(root_of.get(t, t)) for t in range(len(rp.tensors))}
        for op in rp.ops:  # plan-made copies: their output tensors have no graph tensor
            for t in op.outputs:
                self.producer[t] = op.id

    def view(self, t: PlanTensor) -> np.ndarray:
        buf = self.rp.buffers[t.buffer]
        item = t.dtype.itemsize
        return np.ndarray(
            t.shape,
            dtype=t.dtype.np,
            buffer=self.arena,
            offset=buf.offset + t.offset * item,
            strides=tuple(s * item for s in t.strides),
        )

    def byte_index(self, t: PlanTensor, box: Any) -> np.ndarray:
        runs = box_runs(box, t.strides, t.offset, t.dtype.itemsize, self.rp.buffers[t.buffer].offset)
        return np.concatenate([np.arange(a, b) for a, b in runs]) if len(runs) else np.empty(0, np.int64)


def _host_write(rank: _Rank, tensor_id: int, values: np.ndarray) -> None:
    t = rank.rp.tensors[tensor_id]
    rank.view(t)[...] = values
    idx = rank.byte_index(t, Box.full(t.shape))
    rank.iteration[idx] = HOST
    rank.writer[idx] = -1


def run_plan(
    plan: Plan,
    inputs: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
    params: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
    state: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
    *,
    iterations: int = 1,
    seed: int = 0,
    program: int | str = 0,
) -> Any:
    """Run ``plan`` for ``iterations`` iterations under a random legal interleaving chosen by ``seed``;
    ``program``: which of its programs (``plan.programs``, by index or name).

    Arguments and result are those of ``megaloop.evaluate``: one mapping (and one Evaluation) per rank
    for multi-rank plans."""
    try:
        plan = plan.program(program)
    except KeyError as e:
        raise EvaluationError(f"run_plan: {e.args[0]}") from None
    single = plan.world_size == 1
    n = plan.world_size

    def per_rank(arg: Any, what: str) -> list[Mapping[str, Any]]:
        if arg is None:
            return [{} for _ in range(n)]
        if single and isinstance(arg, Mapping):
            return [arg]
        if isinstance(arg, Mapping) or len(arg) != n:
            raise EvaluationError(f"{what}: pass one mapping per rank ({n} ranks)")
        return list(arg)

    if not isinstance(iterations, int) or iterations < 1:
        raise EvaluationError(f"iterations must be an int >= 1, got {iterations!r}")
    ins, prs, sts = per_rank(inputs, "inputs"), per_rank(params, "params"), per_rank(state, "state")
    ranks = [_Rank(plan, r) for r in range(n)]
    for r, rank in enumerate(ranks):
        _load_host_values(rank, ins[r], prs[r], sts[r])
    _Machine(plan, ranks, np.random.default_rng(seed)).run(iterations)
    results = []
    for rank in ranks:
        g = rank.rp.graph
        outputs = {name: np.array(rank.view(rank.rp.tensors[tid]), copy=True) for name, tid in rank.rp.outputs.items()}
        states = {
            name: np.array(rank.view(rank.rp.tensors[rank.rp.tensor_of[t]]), copy=True) for name, t in g.states.items()
        }
        results.append(Evaluation(outputs, states))
    return results[0] if single else results


def _load_host_values(
    rank: _Rank, inputs: Mapping[str, Any], params: Mapping[str, Any], state: Mapping[str, Any]
) -> None:
    g = rank.rp.graph
    for kind, given, table in (("input", inputs, g.inputs), ("parameter", params, g.parameters)):
        missing = [k for k in table if k not in given]
        extra = [k for k in given if k not in table]
        if missing or extra:
            raise EvaluationError(f"rank {g.rank}: {kind}s missing {missing}, unknown {extra}")
        for name, t in table.items():
            _host_write(rank, rank.rp.tensor_of[t], coerce(given[name], t, f"{kind} {name!r}"))
    for t in g.constants:
        _host_write(rank, rank.rp.tensor_of[t], t.node.attrs["value"])
    for name, t in g.states.items():
        if name in state:
            values = coerce(state[name], t, f"state {name!r}")
        elif "init" in t.node.attrs:
            values = t.node.attrs["init"]
        else:
            values = np.zeros(t.shape, t.dtype.np)
        _host_write(rank, rank.rp.tensor_of[t], values)
    unknown = [k for k in state if k not in g.states]
    if unknown:
        raise EvaluationError(f"rank {g.rank}: unknown state {unknown}")


class _Machine:
    def __init__(self, plan: Plan, ranks: list[_Rank], rng: np.random.Generator) -> None:
        self.plan, self.ranks, self.rng = plan, ranks, rng
        self.procs = [(r, p) for r, rank in enumerate(ranks) for p, lst in enumerate(rank.rp.processors) if lst]
        self.speed = rng.lognormal(0.0, 1.5, len(self.procs))  # some processors far faster than others
        self.signalers = [{c: len(ts) for c, ts in rank.rp.signalers().items()} for rank in ranks]
        self.done = [np.zeros(len(rank.rp.tasks), np.int64) for rank in ranks]  # iterations each task finished
        # per rank and state buffer: the tasks that write it, with the bytes they may write
        self.state_writers: list[dict[int, list[tuple[int, np.ndarray]]]] = []
        for rank in ranks:
            table: dict[int, list[tuple[int, np.ndarray]]] = {}
            for t in rank.rp.tasks:
                for acc in t.writes:
                    if acc.rank != rank.rp.rank:  # a pushing send's store: into the recv's output, not a state
                        continue
                    tensor = rank.rp.tensors[acc.tensor]
                    if rank.rp.buffers[tensor.buffer].kind == "state":
                        table.setdefault(tensor.buffer, []).append((t.id, rank.byte_index(tensor, acc.box)))
            self.state_writers.append(table)
        self.meetings = meetings(plan)  # pushing all_reduce tiles (megaloop.plan.rendezvous)
        self.meeting_of = {member: (m, j) for m, group in enumerate(self.meetings) for j, member in enumerate(group)}
        self.arrived: dict[tuple[int, int], dict[int, tuple[int, int, Task, np.ndarray]]] = {}

    def run(self, iterations: int) -> None:
        """Event-driven: a processor is either ready or parked on the first counter it still waits
        for, and is looked at again only when that counter moves. A pushing all_reduce's tile
        (``megaloop.plan.rendezvous``) hands over its box when it starts and finishes only once the same
        tile of every member has started: until then its processor is parked at the meeting."""
        pos = [[0, 0] for _ in self.procs]  # (iteration, index) per processor
        ready: list[int] = []
        parked: dict[tuple[int, int], list[int]] = {}
        left = len(self.procs)

        def place(i: int) -> None:
            blocker = self._blocker(i, pos[i])
            if blocker is None:
                ready.append(i)
            else:
                parked.setdefault(blocker, []).append(i)

        def finish(i: int, task: Task) -> None:
            nonlocal left
            r, p = self.procs[i]
            rank = self.ranks[r]
            self.done[r][task.id] += 1
            rank.counters[task.signal] += 1
            k, idx = pos[i][0], pos[i][1] + 1
            if idx == len(rank.rp.processors[p]):
                k, idx = k + 1, 0
            pos[i] = [k, idx]
            if k == iterations:
                left -= 1
            else:
                place(i)
            for waiting in parked.pop((r, task.signal), ()):
                place(waiting)

        for i in range(len(self.procs)):
            place(i)
        while left:
            if not ready:
                self._deadlock([i for i in range(len(self.procs)) if pos[i][0] < iterations], pos)
            speeds = self.speed[ready]
            j = int(self.rng.choice(len(ready), p=speeds / speeds.sum()))
            i = ready.pop(j)
            r, p = self.procs[i]
            k = pos[i][0]
            rank = self.ranks[r]
            task = rank.rp.tasks[rank.rp.processors[p][pos[i][1]]]
            if (r, task.id) in self.meeting_of:
                for member, member_task in self._arrive(i, r, task, k):
                    finish(member, member_task)
                continue
            self._execute(r, task, k)
            finish(i, task)

    def _arrive(self, i: int, r: int, task: Task, k: int) -> list[tuple[int, Task]]:
        """Member r's tile starts: it hands over its box of x. Once every member's has, all of them
        sum what was handed over and finish; returns those (processor, task) pairs, else nothing."""
        meeting, j = self.meeting_of[(r, task.id)]
        rank = self.ranks[r]
        op = rank.rp.ops[task.op]
        for acc in task.reads:
            self._check_read(r, task, acc, k)
        here = self.arrived.setdefault((meeting, k), {})
        here[j] = (i, r, task, self._operand(r, task, acc_rank=r, tensor=op.inputs[0]))
        group = self.meetings[meeting]
        if len(here) < len(group):
            return []
        del self.arrived[(meeting, k)]
        handed = [here[m][3] for m in range(len(group))]
        finished = []
        for m in range(len(group)):
            i_m, r_m, task_m, _ = here[m]
            op_m = self.ranks[r_m].rp.ops[task_m.op]
            try:
                result = REGISTRY[op_m.op].reference(handed, op_m.attrs)[m]
            except DataError as e:
                raise DataError(f"{op_m.op} task {self.plan.task_label(r_m, task_m.id)} (iteration {k}): {e}") from None
            self._store(r_m, task_m, k, [result])
            finished.append((i_m, task_m))
        return finished

    def _blocker(self, i: int, at: list[int]) -> tuple[int, int] | None:
        """The first (rank, counter) the processor's next task still waits for, or None if it can run."""
        r, p = self.procs[i]
        rank = self.ranks[r]
        task = rank.rp.tasks[rank.rp.processors[p][at[1]]]
        for w in task.waits:
            if self.ranks[w.rank].counters[w.counter] < self._target(w, at[0]):
                return (w.rank, w.counter)
        return None

    def _target(self, w: Any, k: int) -> int:
        return self.signalers[w.rank].get(w.counter, 0) * max(0, k + 1 - w.lag)

    def _deadlock(self, active: list[int], pos: list[list[int]]) -> None:
        lines = []
        for i in active[:8]:
            r, p = self.procs[i]
            rank = self.ranks[r]
            task = rank.rp.tasks[rank.rp.processors[p][pos[i][1]]]
            waits = [
                f"counter {w.counter} of rank {w.rank} at {self.ranks[w.rank].counters[w.counter]} < "
                f"{self._target(w, pos[i][0])}"
                for w in task.waits
                if self.ranks[w.rank].counters[w.counter] < self._target(w, pos[i][0])
            ]
            at = self.meeting_of.get((r, task.id))
            if at is not None and at[1] in self.arrived.get((at[0], pos[i][0]), {}):
                absent = [
                    self.plan.task_label(rm, tm)
                    for j, (rm, tm) in enumerate(self.meetings[at[0]])
                    if j not in self.arrived[(at[0], pos[i][0])]
                ]
                waits = [f"the pushed boxes of {', '.join(absent)}"]
            lines.append(f"{self.plan.task_label(r, task.id)} (iteration {pos[i][0]}) waits for {', '.join(waits)}")
        raise DeadlockError("the plan interpreter cannot make progress:\n  " + "\n  ".join(lines))

    def _execute(self, r: int, task: Task, k: int) -> None:
        rank = self.ranks[r]
        rp = rank.rp
        op = rp.ops[task.op]
        opdef = REGISTRY[op.op]
        for acc in task.reads:
            self._check_read(r, task, acc, k)
        node = op_node(rp, op)
        try:
            if opdef.kind == "collective":
                group = node.attrs["group"]
                members = [
                    self._operand(r, task, acc_rank=m, tensor=peer_operand(self.plan, r, node, 0, m)) for m in group
                ]
                results = [opdef.reference(members, op.attrs)[group.index(r)]]
            elif op.op == "recv":
                src = node.attrs["src"]
                results = [self._operand(r, task, acc_rank=src, tensor=task.reads[0].tensor)]
            elif op.op == "send":  # a pushing send: its chunk of x, stored into the recv's output
                results = [self._operand(r, task, acc_rank=r, tensor=op.inputs[0])]
            else:
                operands = [self._operand(r, task, acc_rank=r, tensor=t) for t in op.inputs]
                if opdef.check_data is not None:  # on the values inside the declared boxes
                    opdef.check_data(operands, op.attrs, [self._declared(r, task, t) for t in op.inputs])
                out = opdef.reference(operands, op.attrs)
                results = out if isinstance(out, list) else [out]
        except DataError as e:
            raise DataError(f"{op.op} task {self.plan.task_label(r, task.id)} (iteration {k}): {e}") from None
        self._store(r, task, k, results)

    def _store(self, r: int, task: Task, k: int, results: list[Any]) -> None:
        """Write the task's declared boxes of its op's ``results`` (one per output)."""
        op = self.ranks[r].rp.ops[task.op]
        for acc in task.writes:
            owner = self.ranks[acc.rank]  # another rank's: a pushing send storing into the recv's output
            t = owner.rp.tensors[acc.tensor]
            result = results[0] if acc.rank != r else results[op.outputs.index(acc.tensor)]
            # only the box is rounded: elsewhere the op computed on poison (an int32 poison cast to
            # float16 overflows, a warning the tests turn into an error)
            owner.view(t)[acc.box.slices] = round_to(np.asarray(result)[acc.box.slices], t.dtype)
            idx = owner.byte_index(t, acc.box)
            owner.iteration[idx] = k
            # on that rank the bytes are the recv's: what its readers expect to find
            owner.writer[idx] = op.id if acc.rank == r else owner.producer[acc.tensor]

    def _operand(self, r: int, task: Task, acc_rank: int, tensor: int) -> np.ndarray:
        """The operand as the task may see it: declared boxes from the arena, NaN (or garbage) elsewhere."""
        owner = self.ranks[acc_rank]
        t = owner.rp.tensors[tensor]
        if t.dtype.is_float:
            out = np.full(t.shape, np.nan, dtype=t.dtype.np)
        elif t.dtype.is_bool:
            out = np.ones(t.shape, dtype=bool)
        else:
            out = np.full(t.shape, np.iinfo(t.dtype.np).min, dtype=t.dtype.np)
        view = owner.view(t)
        for acc in task.reads:
            if acc.rank == acc_rank and acc.tensor == tensor:
                out[acc.box.slices] = view[acc.box.slices]
        return out

    def _declared(self, r: int, task: Task, tensor: int) -> np.ndarray:
        """Which elements of this rank's ``tensor`` the task declares it reads (real values there)."""
        t = self.ranks[r].rp.tensors[tensor]
        mask = np.zeros(t.shape, bool)
        for acc in task.reads:
            if acc.rank == r and acc.tensor == tensor:
                mask[acc.box.slices] = True
        return mask

    def _check_read(self, r: int, task: Task, acc: Access, k: int) -> None:
        owner = self.ranks[acc.rank]
        t = owner.rp.tensors[acc.tensor]
        idx = owner.byte_index(t, acc.box)
        it, who = owner.iteration[idx], owner.writer[idx]
        producer = owner.producer.get(acc.tensor)
        kind = owner.rp.buffers[t.buffer].kind
        if producer is not None:
            bad = (it != k) | (who != producer)
            expect = f"written by {owner.rp.ops[producer].name} in iteration {k}"
        elif kind == "state":
            bad = (it >= k) | (it == NEVER)
            expect = "the state's value from before this iteration"
            for writer, written in self.state_writers[acc.rank].get(t.buffer, ()):
                if self.done[acc.rank][writer] < k and np.intersect1d(idx, written).size:
                    raise InterpreterError(
                        f"{self.plan.task_label(r, task.id)} (iteration {k}) reads state {t.name!r} of rank "
                        f"{acc.rank}, box {acc.box}, before {self.plan.task_label(acc.rank, writer)} finished "
                        f"iteration {k - 1}, which writes those bytes: it would see a stale value"
                    )
        else:
            bad = it != HOST
            expect = "written by the host before the run"
        if np.any(bad):
            j = int(np.argmax(bad))
            found = (
                "never written"
                if it[j] == NEVER
                else "written by the host"
                if it[j] == HOST
                else f"written by {owner.rp.ops[who[j]].name} in iteration {it[j]}"
            )
            buf = owner.rp.buffers[t.buffer]
            raise InterpreterError(
                f"{self.plan.task_label(r, task.id)} (iteration {k}) reads {t.name!r} of rank {acc.rank}, "
                f"box {acc.box}: byte {int(idx[j]) - buf.offset} of buffer {buf.name!r} was {found}; expected {expect}"
            )

"""``make_plan``: graphs (one per rank) -> a verified plan.

Steps, each in its own module: lower the graphs into plan ops and tensors (here: storage sharing for
views, in-place ops and state updates), place buffers in each rank's arena (``memory``), split ops into
tile tasks (``tasks``), find conflicting accesses (``hazards``), schedule tasks onto processors
(``schedule``), derive counters and waits (``deps``), and verify the result (``verify``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from megaloop.errors import DeadlockError, GraphBuildError
from megaloop.frontend.graph import Graph
from megaloop.frontend.opdef import REGISTRY
from megaloop.frontend.tensor import Tensor
from megaloop.parallel.ranks import RankMatching, match_ranks
from megaloop.plan import memory
from megaloop.plan.deps import Layout, derive_waits, hb_order
from megaloop.plan.hazards import build_access_table, find_orderings, task_bases
from megaloop.plan.model import Buffer, Counter, Plan, PlanOp, PlanTensor, RankPlan, Wait
from megaloop.plan.schedule import list_schedule
from megaloop.plan.tasks import make_tasks, peer_operand

SOURCE_KINDS = {"input": "input", "parameter": "parameter", "constant": "constant", "state": "state"}


def make_plan(
    graphs: Graph | Sequence[Graph],
    *,
    processors: int = 132,
    arch: str = "sm_90",
    tiles: dict[str, dict[str, int]] | None = None,
    warps: int = 8,
    shared_memory: int = 227 * 1024,
    reuse: bool = True,
    scratch_budget: int = memory.SCRATCH_BUDGET,
    verify: bool = True,
) -> Plan:
    """Plan one graph, or one graph per rank (rank order), for ``processors`` thread blocks per GPU.

    ``tiles`` overrides tile parameters by node name (``"layers.0.attn.matmul_10"``) or op name
    (``"matmul"``), the node name winning: ``tiles={"matmul": {"block_m": 64}}``. Intermediates share
    memory only when they would need more than ``scratch_budget`` bytes otherwise (``reuse=False``:
    never); see ``megaloop.plan.memory``."""
    glist = [graphs] if isinstance(graphs, Graph) else list(graphs)
    if not isinstance(processors, int) or processors < 1:
        raise GraphBuildError(f"plan: processors must be an int >= 1, got {processors!r}")
    matching = match_ranks(glist)
    tiles = {k: dict(v) for k, v in (tiles or {}).items()}
    ranks = [_lower(g, r, matching, arch, tiles) for r, g in enumerate(glist)]
    plan = Plan(
        arch=arch,
        processors=processors,
        warps=warps,
        shared_memory=shared_memory,
        ranks=ranks,
        overrides=tiles,
        matching=matching,
    )
    _check_overrides(plan, tiles)
    _place_buffers(plan, reuse, scratch_budget)
    make_tasks(plan)
    schedule_and_link(plan)
    if verify:
        from megaloop.plan.verify import verify_plan

        verify_plan(plan)
    return plan


def _check_overrides(plan: Plan, tiles: dict[str, dict[str, int]]) -> None:
    known = {op.name for rp in plan.ranks for op in rp.ops} | {n for n, o in REGISTRY.items() if o.tiling}
    unknown = sorted(set(tiles) - known)
    if unknown:
        raise GraphBuildError(
            f"plan: tile overrides for {unknown} name neither an op with tiles nor a node of the graph"
        )


def tile_params(node_name: str, op_name: str, arch: str, tiles: dict[str, dict[str, int]]) -> dict[str, int]:
    tiling = REGISTRY[op_name].tiling
    merged = {**tiles.get(op_name, {}), **tiles.get(node_name, {})}
    return tiling.resolve(f"{op_name} {node_name}", arch, merged)


def _lower(graph: Graph, rank: int, matching: RankMatching, arch: str, tiles: dict[str, dict[str, int]]) -> RankPlan:
    """Plan ops (in sequential order) and tensors of one rank; every tensor still points at the
    tensor that owns its storage through ``buffer`` (resolved to real buffers by _place_buffers)."""
    seq_of = {(r, n): i for i, (r, n) in enumerate(matching.order)}
    tensors: list[PlanTensor] = []
    tensor_of: dict[Tensor, int] = {}
    for node in graph.topological_order():
        for t in node.outputs:
            tensor_of[t] = len(tensors)
            tensors.append(PlanTensor(len(tensors), t.name, t.dtype, t.shape, -1, t.strides, t.offset))
    owner = {tid: tid for tid in range(len(tensors))}  # root tensor -> tensor owning its storage
    for t, tid in tensor_of.items():
        if t.is_view:
            owner[tid] = tensor_of[t.base]
        elif t.node.op.inplace_operand is not None:
            owner[tid] = owner[tensor_of[t.node.inputs[t.node.op.inplace_operand].base]]
    ops: list[PlanOp] = []
    for r, node in matching.order:
        if r != rank or node.op.tiling is None:
            continue
        ops.append(
            PlanOp(
                len(ops),
                node.name,
                node.op.name,
                node.id,
                [tensor_of[t] for t in node.inputs],
                [tensor_of[t] for t in node.outputs],
                dict(node.attrs),
                tile_params(node.name, node.op.name, arch, tiles),
                seq_of[(rank, node)],
            )
        )
    rp = RankPlan(rank, graph, tensors, [], ops, [], [], [], 0, tensor_of, owner)
    _lower_state_updates(rp, len(matching.order), arch, tiles)
    return rp


def _storage(rp: RankPlan, tid: int) -> int:
    return rp.owner[tid]


def _lower_state_updates(rp: RankPlan, end_seq: int, arch: str, tiles: dict[str, dict[str, int]]) -> None:
    """A state's next value is written straight into the state's buffer when that is safe (its producer
    comes after every reader of the old value); otherwise a copy op at the end of the iteration does it."""
    graph = rp.graph
    producer_seq = {op.outputs[k]: op.seq for op in rp.ops for k in range(len(op.outputs))}
    for name, value in graph.state_updates.items():
        state_tid = rp.tensor_of[graph.states[name]]
        vid = rp.tensor_of[value]
        if _storage(rp, vid) == _storage(rp, state_tid):
            continue  # an in-place op (kv_cache_update) already wrote it there
        readers = [op.seq for op in rp.ops if any(_storage(rp, t) == state_tid for t in op.inputs)]
        aliasable = (
            not value.is_view
            and value.node.op.kind in ("compute", "collective", "p2p")
            and value.node.op.inplace_operand is None
            and sum(1 for v in graph.state_updates.values() if v is value) == 1
            and all(s < producer_seq[vid] for s in readers)
        )
        if aliasable:
            for tid, own in list(rp.owner.items()):
                if own == vid:
                    rp.owner[tid] = state_tid
            continue
        state_t = graph.states[name]
        nxt = PlanTensor(len(rp.tensors), f"{name}:next", state_t.dtype, state_t.shape, -1, state_t.strides, 0)
        rp.tensors.append(nxt)
        rp.owner[nxt.id] = state_tid
        op_name = f"assign:{name}"
        params = REGISTRY["copy"].tiling.resolve(op_name, arch, {**tiles.get("copy", {}), **tiles.get(op_name, {})})
        rp.ops.append(PlanOp(len(rp.ops), op_name, "copy", None, [vid], [nxt.id], {}, params, end_seq + len(rp.ops)))


def _place_buffers(plan: Plan, reuse: bool, budget: int) -> None:
    # sequential positions of every op that reads a storage, on any rank (collectives read peers)
    readers: list[dict[int, list[int]]] = [{} for _ in plan.ranks]
    writers: list[dict[int, list[int]]] = [{} for _ in plan.ranks]
    remote: list[set[int]] = [set() for _ in plan.ranks]
    for r, rp in enumerate(plan.ranks):
        for op in rp.ops:
            for t in op.inputs:
                readers[r].setdefault(_storage(rp, t), []).append(op.seq)
            for t in op.outputs:
                writers[r].setdefault(_storage(rp, t), []).append(op.seq)
            for peer, tid in _remote_reads(plan, r, op):
                readers[peer].setdefault(_storage(plan.ranks[peer], tid), []).append(op.seq)
                remote[peer].add(_storage(plan.ranks[peer], tid))
    for r, rp in enumerate(plan.ranks):
        outputs = {_storage(rp, rp.tensor_of[t]) for t in rp.graph.outputs.values()}
        roots = sorted(set(rp.owner.values()))
        node_of = {i: t.node for t, i in rp.tensor_of.items()}
        requests, buffers = [], {}
        for b, own in enumerate(roots):
            t = rp.tensors[own]
            node = node_of.get(own)
            if node is not None and node.op.kind == "source":
                kind = SOURCE_KINDS[node.op.name]
            else:
                kind = "output" if own in outputs else "scratch"
            nbytes = t.dtype.itemsize * _span(t.shape)
            seqs_w, seqs_r = writers[r].get(own, []), readers[r].get(own, [])
            first = min(seqs_w + seqs_r, default=0)
            last = max(seqs_w + seqs_r, default=first)
            requests.append(memory.Request(b, kind, nbytes, first, last))
            buffers[own] = Buffer(b, t.name, kind, -1, nbytes, t.shape, own in remote[r])
        layout = memory.place(requests, reuse, budget)
        for buf in buffers.values():
            buf.offset = layout.offsets[buf.id]
        rp.buffers = [buffers[own] for own in roots]
        rp.arena_bytes = layout.arena_bytes
        rp.memory = layout
        for t in rp.tensors:
            t.buffer = buffers[_storage(rp, t.id)].id


def _span(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _remote_reads(plan: Plan, rank: int, op: PlanOp) -> list[tuple[int, int]]:
    """(peer rank, tensor id) pairs that ``op`` reads on other ranks (collectives and recv)."""
    rp = plan.ranks[rank]
    if op.node is None:
        return []
    node = rp.graph.nodes[op.node]
    out = []
    if node.op.kind == "collective":
        for m in node.attrs["group"]:
            if m != rank:
                out.append((m, peer_operand(plan, rank, node, 0, m)))
    elif node.op.name == "recv":
        out.append((node.attrs["src"], peer_operand(plan, rank, node, -1, node.attrs["src"])))
    return out


def schedule_and_link(plan: Plan) -> None:
    """Place tasks on processors and give them counters and waits (used by make_plan and rederive)."""
    base = task_bases(plan)
    flat = [(r, t) for r, rp in enumerate(plan.ranks) for t in rp.tasks]
    seq = [plan.ranks[r].ops[t.op].seq for r, t in flat]
    req0, req1 = requirements(plan, base, seq)
    order = sorted(range(len(flat)), key=lambda g: (seq[g], g))
    position = {g: i for i, g in enumerate(order)}
    sched = list_schedule(
        [flat[g][0] for g in order],
        [flat[g][1].cost_ns for g in order],
        [[position[a] for a in req0[g]] for g in order],
        plan.processors,
        plan.world_size,
    )
    for r, rp in enumerate(plan.ranks):
        rp.processors = [[flat[order[i]][1].id for i in lst] for lst in sched.lists[r]]
    plan.estimated_ns = sched.makespan_ns
    link(plan, req0, req1)


def requirements(plan: Plan, base: list[int], seq: list[int]) -> tuple[list[list[int]], list[list[int]]]:
    """req0[c]: tasks that must finish before c in the same iteration; req1[c]: tasks whose previous
    iteration must finish before c (see ``hazards``)."""
    orderings = find_orderings(plan, build_access_table(plan), np.asarray(seq, np.int64))
    if orderings.overlapping_writers:
        a, b, owner, buf = orderings.overlapping_writers[0]
        raise GraphBuildError(
            f"plan: {_label(plan, base, a)} and {_label(plan, base, b)} of one op both write "
            f"{plan.ranks[owner].buffers[buf].name!r}; the op's tiling is wrong"
        )
    out = []
    for lag in (0, 1):
        sel = orderings.lag == lag
        before, after = orderings.before[sel], orderings.after[sel]
        order = np.argsort(after, kind="stable")
        bounds = np.searchsorted(after[order], np.arange(len(seq) + 1))
        grouped = before[order].tolist()
        out.append([grouped[bounds[i] : bounds[i + 1]] for i in range(len(seq))])
    return out[0], out[1]


def _label(plan: Plan, base: list[int], gid: int) -> str:
    r = max(i for i, b in enumerate(base) if b <= gid)
    return plan.task_label(r, gid - base[r])


def link(plan: Plan, req0: list[list[int]], req1: list[list[int]]) -> None:
    """Counters (one per task) and the irredundant waits that cover the requirements."""
    base = task_bases(plan)
    n = base[-1] + len(plan.ranks[-1].tasks)
    proc_base = [r * plan.processors for r in range(plan.world_size)]
    proc = np.zeros(n, np.int64)
    index = np.zeros(n, np.int64)
    lists: list[list[int]] = []
    for r, rp in enumerate(plan.ranks):
        for p, lst in enumerate(rp.processors):
            lists.append([base[r] + t for t in lst])
            for i, t in enumerate(lst):
                proc[base[r] + t] = proc_base[r] + p
                index[base[r] + t] = i
    layout = Layout(proc, index, lists)
    order = hb_order(layout, req0)
    if order is None:
        raise DeadlockError(
            "plan: the processors' task orders deadlock: some task is placed before a task it "
            "depends on, on the same processor or across a cycle of processors"
        )
    waits = derive_waits(layout, req0, req1, order)
    for r, rp in enumerate(plan.ranks):
        rp.counters = [Counter(t.id, f"done {rp.task_name(t)}") for t in rp.tasks]
        for t in rp.tasks:
            t.signal = t.id
            gw = waits[base[r] + t.id]
            owners = np.searchsorted(base, [a for a, _ in gw], side="right") - 1 if gw else []
            t.waits = [Wait(int(o), a - base[o], lag) for (a, lag), o in zip(gw, owners)]

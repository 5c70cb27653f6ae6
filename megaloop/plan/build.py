"""``make_plan``: graphs (one per rank) -> a verified plan.

Steps, each in its own module: lower the graphs into plan ops and tensors (here: storage sharing for
views, in-place ops and state updates), place buffers in each rank's arena (``memory``), split ops into
tile tasks (``tasks``), find conflicting accesses (``hazards``), schedule tasks onto processors
(``schedule``), derive counters and waits (``deps``), and verify the result (``verify``).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from megaloop.errors import DeadlockError, GraphBuildError
from megaloop.frontend.graph import Graph, require_results
from megaloop.frontend.opdef import REGISTRY
from megaloop.frontend.shapes import contiguous_strides
from megaloop.frontend.tensor import Tensor
from megaloop.frontend.tiling import (
    ARCHS,
    LARGEST_SM_COUNT,
    MAX_WARPS,
    SHARED_MEMORY_PER_BLOCK,
    max_resident_processors,
)
from megaloop.frontend.validate import MAX_ARENA_BYTES
from megaloop.fuse import FuseOptions, fuse
from megaloop.parallel.ranks import RankMatching, match_ranks
from megaloop.plan import memory
from megaloop.plan.deps import Groups, Layout, deadlock_cycle, derive_waits, hb_order
from megaloop.plan.hazards import Hazards, Orderings, build_access_table, find_orderings, task_bases, task_name
from megaloop.plan.model import Buffer, Counter, KernelOptions, Plan, PlanOp, PlanTensor, RankPlan, Wait
from megaloop.plan.rendezvous import meetings
from megaloop.plan.schedule import Gates, list_schedule
from megaloop.plan.tasks import make_tasks, peer_operand, peer_output
from megaloop.plan.verify import verify_plan

SOURCE_KINDS = {"input": "input", "parameter": "parameter", "constant": "constant", "state": "state"}


def make_plan(
    graphs: Graph | Sequence[Graph],
    *,
    processors: int = 132,
    arch: str = "sm_90",
    tiles: dict[str, dict[str, int]] | None = None,
    warps: int = 8,
    shared_memory: int | None = None,
    reuse: bool = True,
    scratch_budget: int = memory.SCRATCH_BUDGET,
    verify: bool = True,
    options: KernelOptions | None = None,
    fusion: FuseOptions | None = None,
) -> Plan:
    """Plan one graph, or one graph per rank (rank order), for ``processors`` thread blocks per GPU.

    ``tiles`` overrides tile parameters by node name (``"layers.0.attn.matmul_10"``) or op name
    (``"matmul"``), the node name winning: ``tiles={"matmul": {"block_m": 64}}``. Intermediates share
    memory only when they would need more than ``scratch_budget`` bytes otherwise (``reuse=False``:
    never); see ``megaloop.plan.memory``. ``shared_memory`` (bytes per processor) defaults to the
    architecture's limit. ``options`` (megaloop.plan.KernelOptions) say how the loop kernel is built.
    ``fusion`` (megaloop.FuseOptions; default: every rule) says which graph rewrites (megaloop.fuse)
    each rank's graph gets first: the plan's graphs are the rewritten ones, the given ones unchanged."""
    with collector_paused():
        return _make_plan(
            graphs, processors, arch, tiles, warps, shared_memory, reuse, scratch_budget, verify, options, fusion
        )


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cycle collector off while planning (or reading a plan): the millions of tuples and
    tasks a large plan allocates would trigger full collections over the whole heap (seconds on an 8B
    model); what is left in cycles is collected once it is back on."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def _make_plan(
    graphs: Graph | Sequence[Graph],
    processors: int,
    arch: str,
    tiles: dict[str, dict[str, int]] | None,
    warps: int,
    shared_memory: int | None,
    reuse: bool,
    scratch_budget: int,
    verify: bool,
    options: KernelOptions | None,
    fusion: FuseOptions | None,
) -> Plan:
    glist = [graphs] if isinstance(graphs, Graph) else list(graphs)
    if shared_memory is None and arch in SHARED_MEMORY_PER_BLOCK:
        shared_memory = SHARED_MEMORY_PER_BLOCK[arch]
    check_settings(arch, processors, warps, shared_memory, GraphBuildError, "plan")
    if isinstance(scratch_budget, bool) or not isinstance(scratch_budget, int) or scratch_budget < 0:
        raise GraphBuildError(f"plan: scratch_budget must be an int >= 0 (bytes), got {scratch_budget!r}")
    options = KernelOptions() if options is None else options
    if not isinstance(options, KernelOptions):
        raise GraphBuildError(f"plan: options must be a megaloop.plan.KernelOptions, got {type(options).__name__}")
    options.check(GraphBuildError, "plan: options")
    fusion = FuseOptions() if fusion is None else fusion
    if not isinstance(fusion, FuseOptions):
        raise GraphBuildError(f"plan: fusion must be a megaloop.FuseOptions, got {type(fusion).__name__}")
    tiles = _check_tiles(tiles)
    if not glist or not all(isinstance(g, Graph) for g in glist):
        raise GraphBuildError(f"plan: expected a Graph or a list of rank Graphs, got {graphs!r:.80}")
    require_results(glist, "plan")
    glist = [fuse(g, fusion) for g in glist]
    matching = match_ranks(glist)
    ranks = [lower_rank(g, r, matching, arch, tiles) for r, g in enumerate(glist)]
    number_ops(ranks)
    plan = Plan(
        arch=arch,
        processors=processors,
        warps=warps,
        shared_memory=shared_memory,
        ranks=ranks,
        overrides=tiles,
        options=options,
        fusion=fusion,
        matching=matching,
    )
    _check_overrides(plan, tiles)
    place_buffers(plan, reuse, scratch_budget)
    make_tasks(plan)
    hazards = schedule_and_link(plan)
    if verify:
        verify_plan(plan, hazards)  # linking changed no access: the orderings still hold
    return plan


def check_settings(arch: str, processors: Any, warps: Any, shared_memory: Any, error: type, where: str) -> None:
    """The plan-wide settings make_plan takes and a loaded plan carries."""
    if not isinstance(arch, str) or arch not in ARCHS:
        raise error(f"{where}: unknown architecture {arch!r}; megaloop plans for {', '.join(ARCHS)}")
    for name, value, low, high in (
        ("warps", warps, 1, MAX_WARPS),
        ("shared_memory", shared_memory, 0, SHARED_MEMORY_PER_BLOCK[arch]),
        ("processors", processors, 1, None),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
            bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
            raise error(f"{where}: {name} must be an int {bound} on {arch}, got {value!r}")
    most = max_resident_processors(arch, warps)
    if processors > most:
        raise error(
            f"{where}: processors is {processors}, but no {arch} GPU keeps more than {most} thread blocks of {warps} "
            f"warps resident at once ({LARGEST_SM_COUNT[arch]} SMs x {most // LARGEST_SM_COUNT[arch]}), and every "
            f"processor of a loop kernel must be resident; plan with processors <= {most} (one per SM is typical: "
            "megaloop.runtime.gpus() gives the SM count)"
        )


def _check_tiles(tiles: Any) -> dict[str, dict[str, int]]:
    if tiles is None:
        return {}
    if not isinstance(tiles, dict) or not all(isinstance(k, str) and isinstance(v, dict) for k, v in tiles.items()):
        raise GraphBuildError(
            f"plan: tiles must map op or node names to parameter dicts, e.g. {{'matmul': {{'block_m': 64}}}}; "
            f"got {tiles!r:.120}"
        )
    return {k: dict(v) for k, v in tiles.items()}


def _check_overrides(plan: Plan, tiles: dict[str, dict[str, int]]) -> None:
    known = {op.name for rp in plan.ranks for op in rp.ops} | {n for n, o in REGISTRY.items() if o.tiling}
    unknown = sorted(set(tiles) - known)
    if unknown:
        raise GraphBuildError(
            f"plan: tile overrides for {unknown} name neither an op with tiles nor a node of the graph (as fused: "
            "a node the fuse stage replaced is gone; name its fused op's node, or plan with fusion= that keeps it)"
        )


def tile_params(node_name: str, op_name: str, arch: str, tiles: dict[str, dict[str, int]]) -> dict[str, int]:
    tiling = REGISTRY[op_name].tiling
    merged = {**tiles.get(op_name, {}), **tiles.get(node_name, {})}
    return tiling.resolve(f"{op_name} {node_name}", arch, merged)


def recv_pushes(transfer: Any, arch: str, tiles: dict[str, dict[str, int]]) -> bool:
    """Whether a transfer's recv pushes (its tile parameter push): then its send has the tiles, which
    store into the recv's output on the destination rank."""
    return bool(tile_params(transfer.recv.name, "recv", arch, tiles)["push"])


def lower_rank(
    graph: Graph, rank: int, matching: RankMatching, arch: str, tiles: dict[str, dict[str, int]]
) -> RankPlan:
    """Plan ops and tensors of one rank; every tensor still points at the tensor that owns its storage
    through ``owner`` (resolved to real buffers by place_buffers). Op ``seq`` values are sort keys
    here (``number_ops`` makes them positions once every rank is lowered)."""
    index_of = {(r, n): i for i, (r, n) in enumerate(matching.order)}
    tensors: list[PlanTensor] = []
    tensor_of: dict[Tensor, int] = {}
    for node in graph.topological_order():
        for t in node.outputs:
            tensor_of[t] = len(tensors)
            tensors.append(PlanTensor(len(tensors), t.name, t.dtype, t.shape, -1, t.strides, t.offset))
    owner = {tid: tid for tid in range(len(tensors))}  # root tensor -> tensor owning its storage
    for t, tid in tensor_of.items():
        if t.is_view:
            owner[tid] = owner[tensor_of[t.base]]  # (the base may live in a state: an in-place result)
        elif t.node.op.inplace_operand is not None:
            owner[tid] = owner[tensor_of[t.node.inputs[t.node.op.inplace_operand].base]]
    ops: list[PlanOp] = []
    for r, node in matching.order:
        if r != rank or node.op.tiling is None:
            continue
        if node.op.kind == "compute" and not any(t.size for t in node.outputs):
            continue  # an empty result: nothing to compute (docs/ops.md, zero-size axes)
        if node.op.name == "send" and not recv_pushes(matching.transfer_of[node], arch, tiles):
            continue  # the recv pulls: the send has nothing to do
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
                (index_of[(rank, node)], 0, 0),  # type: ignore[arg-type]  # a sort key until number_ops
            )
        )
    rp = RankPlan(rank, graph, tensors, [], ops, [], [], [], 0, tensor_of, owner)
    copies = _Copies(rp, arch, tiles)
    _lower_state_updates(rp, matching, index_of, copies)
    _snapshot_outputs(rp, index_of, copies)
    return rp


class _Copies:
    """Plan-made copy ops (state updates, staged values, output snapshots) and their fresh tensors."""

    def __init__(self, rp: RankPlan, arch: str, tiles: dict[str, dict[str, int]]) -> None:
        self.rp, self.arch, self.tiles = rp, arch, tiles

    def add(self, name: str, src: int, key: tuple[int, ...], into: int | None = None) -> int:
        """Copy tensor ``src`` at sort key ``key`` into a fresh contiguous tensor, or into the storage of
        tensor ``into`` (same shape, its layout); returns the written tensor's id."""
        rp = self.rp
        like = rp.tensors[src if into is None else into]
        strides = contiguous_strides(like.shape) if into is None else like.strides
        dst = PlanTensor(len(rp.tensors), name, like.dtype, like.shape, -1, strides, 0 if into is None else like.offset)
        rp.tensors.append(dst)
        rp.owner[dst.id] = dst.id if into is None else rp.owner[into]
        params = REGISTRY["copy"].tiling.resolve(
            name, self.arch, {**self.tiles.get("copy", {}), **self.tiles.get(name, {})}
        )
        op = PlanOp(len(rp.ops), name, "copy", None, [src], [dst.id], {}, params, key)  # type: ignore[arg-type]
        rp.ops.append(op)
        return dst.id


def _lower_state_updates(rp: RankPlan, matching: RankMatching, index_of: dict, copies: _Copies) -> None:
    """Give every assigned state its next value, all states changing together at the end of the iteration.

    - The result of an in-place op on the state (kv_cache_update) is there already.
    - A fresh value computed after every read of the old state (on any rank) is written straight into the
      state's storage ("aliased"): no copy.
    - Otherwise a copy at the end of the iteration writes it. A value that lives in a state's storage (the
      old value of a state, or a view of one: swaps, delay lines, ``s[::-1]``) is first copied aside right
      after it is made, so that every end copy reads what the graph meant, whatever the others write.
    """
    graph = rp.graph
    end = len(matching.order)
    updated = {rp.owner[rp.tensor_of[graph.states[name]]] for name in graph.state_updates}
    pending = []
    for name, value in graph.state_updates.items():
        state_tid = rp.tensor_of[graph.states[name]]
        vid = rp.tensor_of[value]
        if not value.is_view and value.node.op.inplace_operand is not None and rp.owner[vid] == state_tid:
            continue  # the in-place op wrote it there
        pending.append((name, state_tid, vid, value))
    # every read of each updated storage's old value, as sort keys
    reads: dict[int, list[tuple[int, ...]]] = {s: [] for s in updated}
    for op in rp.ops:
        for t in op.inputs:
            if rp.owner[t] in reads:
                reads[rp.owner[t]].append(op.seq)  # type: ignore[arg-type]
    for key, storage in _remote_reads_of(rp, matching, index_of):
        if storage in reads:
            reads[storage].append(key)
    staged = {vid for _, _, vid, _ in pending if rp.owner[vid] in updated}
    for _, _, vid, value in pending:
        if vid in staged:
            reads[rp.owner[vid]].append((index_of[(rp.rank, value.node)], 1, 0))
    for t in rp.graph.outputs.values():  # snapshots of old values (see _snapshot_outputs)
        tid = rp.tensor_of[t]
        if rp.owner[tid] in reads:
            reads[rp.owner[tid]].append((index_of[(rp.rank, t.node)], 2, 0))
    uses = {}
    for _, _, vid, _ in pending:
        uses[vid] = uses.get(vid, 0) + 1
    for k, (name, state_tid, vid, value) in enumerate(pending):
        made = (index_of[(rp.rank, value.node)], 0, 0)
        aliasable = (
            not value.is_view
            and value.node.op.tiling is not None
            and value.node.op.inplace_operand is None
            and uses[vid] == 1
            and rp.owner[vid] == vid
            and vid not in staged
            and all(key < made for key in reads[state_tid])
            # a pushed recv's value is stored by its send, earlier in the order than the recv
            and not (
                value.node.op.name == "recv"
                and recv_pushes(matching.transfer_of[value.node], copies.arch, copies.tiles)
            )
        )
        if aliasable:
            for tid, own in list(rp.owner.items()):
                if own == vid:
                    rp.owner[tid] = state_tid
            continue
        src = vid
        if vid in staged:
            src = copies.add(f"stage:{name}", vid, (index_of[(rp.rank, value.node)], 1, k))
        copies.add(f"assign:{name}", src, (end, rp.rank, k), into=state_tid)


def _remote_reads_of(rp: RankPlan, matching: RankMatching, index_of: dict) -> list[tuple[tuple[int, ...], int]]:
    """(sort key, storage) of every read of this rank's tensors by other ranks: the recv of a send, the
    other members of a collective (they read operand 0 of this rank's member)."""
    out = []
    for tr in matching.transfers:
        if tr.src == rp.rank:
            out.append(((index_of[(tr.dst, tr.recv)], 0, 0), rp.owner[rp.tensor_of[tr.send.inputs[0]]]))
    for c in matching.collectives:
        if rp.rank in c.group:
            mine = c.nodes[c.group.index(rp.rank)]
            storage = rp.owner[rp.tensor_of[mine.inputs[0]]]
            for m, node in zip(c.group, c.nodes):
                if m != rp.rank:
                    out.append(((index_of[(m, node)], 0, 0), storage))
    return out


def _snapshot_outputs(rp: RankPlan, index_of: dict, copies: _Copies) -> None:
    """The host reads outputs after the iteration; an output whose storage is written again later in the
    iteration (the old value of an updated state, a value overwritten in place) is copied aside right
    after it is made. ``rp.outputs`` maps output names to the tensors the host reads."""
    writes: dict[int, list[tuple[int, ...]]] = {}
    made_at: dict[int, tuple[int, ...]] = {}
    for op in rp.ops:
        for t in op.outputs:
            writes.setdefault(rp.owner[t], []).append(op.seq)  # type: ignore[arg-type]
            made_at[t] = op.seq  # type: ignore[assignment]
    snapshot: dict[int, int] = {}
    for name, t in rp.graph.outputs.items():
        tid = rp.tensor_of[t]
        root = rp.tensor_of[t.base]
        version = made_at.get(root, (index_of[(rp.rank, t.base.node)], 0, 0))
        if any(key > version for key in writes.get(rp.owner[tid], [])):
            if tid not in snapshot:
                snapshot[tid] = copies.add(f"output:{name}", tid, (index_of[(rp.rank, t.node)], 2, len(snapshot)))
            rp.outputs[name] = snapshot[tid]
        else:
            rp.outputs[name] = tid


def number_ops(ranks: list[RankPlan]) -> None:
    """Sort keys -> positions 0, 1, ... of the whole program (all ranks); each rank's ops in that order."""
    keys = sorted({op.seq for rp in ranks for op in rp.ops})  # type: ignore[type-var]
    position = {k: i for i, k in enumerate(keys)}
    for rp in ranks:
        rp.ops.sort(key=lambda op: op.seq)  # type: ignore[arg-type, return-value]
        for i, op in enumerate(rp.ops):
            op.id = i
            op.seq = position[op.seq]


def place_buffers(plan: Plan, reuse: bool, budget: int) -> None:
    # sequential positions of every op that reads a storage, on any rank (collectives read peers)
    readers: list[dict[int, list[int]]] = [{} for _ in plan.ranks]
    writers: list[dict[int, list[int]]] = [{} for _ in plan.ranks]
    remote: list[set[int]] = [set() for _ in plan.ranks]
    for r, rp in enumerate(plan.ranks):
        for op in rp.ops:
            for t in op.inputs:
                readers[r].setdefault(rp.owner[t], []).append(op.seq)
            for t in op.outputs:
                writers[r].setdefault(rp.owner[t], []).append(op.seq)
            for peer, tid in _remote_reads(plan, r, op):
                readers[peer].setdefault(plan.ranks[peer].owner[tid], []).append(op.seq)
                remote[peer].add(plan.ranks[peer].owner[tid])
            if op.op == "send":  # a pushing send writes the recv's output on its rank, from here on
                peer, tid = peer_output(plan, rp.graph.nodes[op.node])  # type: ignore[index]
                writers[peer].setdefault(plan.ranks[peer].owner[tid], []).append(op.seq)
                remote[peer].add(plan.ranks[peer].owner[tid])
    for r, rp in enumerate(plan.ranks):
        outputs = {rp.owner[t] for t in rp.outputs.values()}
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
        if layout.arena_bytes > MAX_ARENA_BYTES:
            raise GraphBuildError(
                f"plan: rank {r} needs an arena of {layout.arena_bytes} bytes, above the 2^48 bytes a megaloop plan "
                "addresses; shrink the model or split it over more ranks"
            )
        for buf in buffers.values():
            buf.offset = layout.offsets[buf.id]
        rp.buffers = [buffers[own] for own in roots]
        rp.arena_bytes = layout.arena_bytes
        rp.memory = layout
        for t in rp.tensors:
            t.buffer = buffers[rp.owner[t.id]].id


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
    elif node.op.name == "recv" and not op.tile.get("push"):  # pushed: the send writes here instead
        out.append((node.attrs["src"], peer_operand(plan, rank, node, -1, node.attrs["src"])))
    return out


def schedule_and_link(plan: Plan) -> Hazards:
    """Place tasks on processors and give them counters and waits (used by make_plan and rederive);
    returns the access table and orderings they were derived from."""
    base = task_bases(plan)
    flat = [(r, t) for r, rp in enumerate(plan.ranks) for t in rp.tasks]
    seq = [plan.ranks[r].ops[t.op].seq for r, t in flat]
    hazards = Hazards(table := build_access_table(plan), find_orderings(plan, table, np.asarray(seq, np.int64)))
    req0, req1, groups = requirements(plan, base, seq, hazards.orderings)
    key = [(s, g, 0) for g, s in enumerate(seq)]
    met = [[base[r] + t for r, t in group] for group in meetings(plan)]
    for gids in met:  # a meeting's tiles next to each other (megaloop.plan.rendezvous)
        first = min(seq[g] for g in gids)
        for j, g in enumerate(gids):
            key[g] = (first, flat[g][1].coords[0] if flat[g][1].coords else 0, j)
    order = sorted(range(len(flat)), key=lambda g: key[g])
    position = {g: i for i, g in enumerate(order)}
    at = np.empty(len(order), np.int64)
    at[order] = np.arange(len(order))
    same = groups.lag == 0
    gates = Gates(
        [at[groups.tasks(s)].tolist() for s in range(len(groups.start) - 1)],
        list(zip(groups.before[same].tolist(), groups.after[same].tolist())),
    )
    sched = list_schedule(
        [flat[g][0] for g in order],
        [flat[g][1].cost_ns for g in order],
        [[position[a] for a in req0[g]] for g in order],
        plan.processors,
        plan.world_size,
        [sorted(position[g] for g in gids) for gids in met],  # ... and placed together
        gates,
    )
    for r, rp in enumerate(plan.ranks):
        rp.processors = [[flat[order[i]][1].id for i in lst] for lst in sched.lists[r]]
    plan.estimated_ns = sched.makespan_ns
    link(plan, req0, req1, groups)
    return hazards


def requirements(
    plan: Plan, base: list[int], seq: list[int], orderings: Orderings | None = None
) -> tuple[list[list[int]], list[list[int]], Groups]:
    """req0[c]: tasks that must finish before c in the same iteration; req1[c]: tasks whose previous
    iteration must finish before c (see ``hazards``); and the groups of buffers sharing bytes, kept
    whole; from ``orderings`` when they were found."""
    if orderings is None:
        orderings = find_orderings(plan, build_access_table(plan), np.asarray(seq, np.int64))
    if orderings.overlapping_writers:
        a, b, owner, buf = orderings.overlapping_writers[0]
        raise GraphBuildError(
            f"plan: {task_name(plan, base, a)} and {task_name(plan, base, b)} of one op both write "
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
    return out[0], out[1], orderings.reuse.groups


def link(plan: Plan, req0: list[list[int]], req1: list[list[int]], groups: Groups | None = None) -> None:
    """Counters (one per task) and the irredundant waits that cover the requirements (and ``groups``)."""
    base = task_bases(plan)
    proc_base = [r * plan.processors for r in range(plan.world_size)]
    layout = plan_layout(plan)
    proc, index = layout.proc, layout.index
    groups = Groups.none() if groups is None else groups
    order = hb_order(layout, req0, groups)
    if order is None:
        cycle = deadlock_cycle(layout, req0, groups)
        owner = np.searchsorted(base, cycle, side="right") - 1

        def where(g: int, r: int) -> str:
            return f"{plan.task_label(r, g - base[r])} (processor {proc[g] - proc_base[r]}, position {index[g]})"

        steps = [where(g, int(r)) for g, r in zip(cycle, owner)]
        raise DeadlockError(
            "plan: the processors' task orders deadlock: each of these tasks must wait for the one before it "
            "(it comes later on the same processor or needs its result) and the first for the last: "
            + " -> ".join(steps)
            + "; move a task after what it depends on"
        )
    waits = derive_waits(layout, req0, req1, order, groups)
    owner = np.searchsorted(np.asarray(base), waits.producer, side="right") - 1
    flat = list(map(Wait, owner.tolist(), (waits.producer - np.asarray(base)[owner]).tolist(), waits.lag.tolist()))
    start = waits.start.tolist()
    for r, rp in enumerate(plan.ranks):
        rp.counters = [Counter(t.id, f"done {rp.task_name(t)}") for t in rp.tasks]
        for t in rp.tasks:
            t.signal = t.id
            t.waits = flat[start[base[r] + t.id] : start[base[r] + t.id + 1]]


def plan_layout(plan: Plan) -> Layout:
    """The processor lists of all ranks as one ``Layout`` of global tasks (rank r's processors
    numbered from ``r * plan.processors``)."""
    base = task_bases(plan)
    n = base[-1] + len(plan.ranks[-1].tasks)
    proc = np.zeros(n, np.int64)
    index = np.zeros(n, np.int64)
    lists: list[list[int]] = []
    for r, rp in enumerate(plan.ranks):
        for p, lst in enumerate(rp.processors):
            lists.append([base[r] + t for t in lst])
            gids = np.asarray(lists[-1], np.int64)
            proc[gids] = r * plan.processors + p
            index[gids] = np.arange(len(lst))
    return Layout(proc, index, lists)

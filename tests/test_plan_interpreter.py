"""The plan interpreter against the graph-level reference: every op, the Llama-style block and the
collectives, under 20 random interleavings each, for 1..4 iterations, on 1, 7 and 132 processors.
Tiles are made small so that every op splits into several tasks that can race.

Results must be bitwise equal: a tile computes exactly what the op's reference computes for its
outputs, from exactly the values the graph evaluation would use."""

from __future__ import annotations

import numpy as np
import pytest

import megaloop as ml
from megaloop.frontend.opdef import REGISTRY
from megaloop.models import LlamaConfig, build_llama, random_parameters
from megaloop.plan import Plan, make_plan
from megaloop.reference.interpreter import run_plan
from tests.helpers import tp_mlp
from tests.op_table import ROWS, Row, build_row

SEEDS = 20
PROCESSORS = (1, 7, 132)
SMALL = {"elements": 24, "block_m": 4, "block_n": 8, "q_block": 4}


def small_tiles(graphs: list[ml.Graph]) -> dict[str, dict[str, int]]:
    """Tiny tiles for every op in the graphs, so that each op makes several tasks."""
    out = {}
    for g in graphs:
        for node in g.nodes:
            if node.op.tiling is not None:
                out[node.op.name] = {k: v for k, v in SMALL.items() if k in node.op.tiling.params}
    if any(g.state_updates for g in graphs):
        out.setdefault("copy", {"elements": SMALL["elements"]})
    return out


def same(a: ml.Evaluation, b: ml.Evaluation, what: str) -> None:
    for name in b.outputs:
        assert a.outputs[name].tobytes() == b.outputs[name].tobytes(), f"{what}: output {name} differs"
    for name in b.state:
        assert a.state[name].tobytes() == b.state[name].tobytes(), f"{what}: state {name} differs"


def check_plan(plan: Plan, graphs, inputs, params=None, state=None, seeds: int = SEEDS, what: str = "") -> None:
    refs = {}
    for seed in range(seeds):
        iterations = 1 + seed % 4
        if iterations not in refs:
            refs[iterations] = ml.evaluate(graphs, inputs, params, state, iterations=iterations)
        got = run_plan(plan, inputs, params, state, iterations=iterations, seed=seed)
        ref = refs[iterations]
        if isinstance(ref, list):
            for r, (a, b) in enumerate(zip(got, ref)):
                same(a, b, f"{what} rank {r} seed {seed} iterations {iterations}")
        else:
            same(got, ref, f"{what} seed {seed} iterations {iterations}")


OP_ROWS = {}
for _row in ROWS:  # one row per op variant, the dtype rotating through the row's list
    OP_ROWS[_row.id] = (_row, _row.dtypes[len(OP_ROWS) % len(_row.dtypes)])


MAX_TASKS = 48  # enough tasks to race, few enough that 60 interpreted runs stay quick


def small_case(row: Row, dtype: str) -> tuple:
    """The first draw of a row whose ops make between 2 and MAX_TASKS tasks with small tiles."""
    from megaloop.frontend.tiling import TileContext

    for seed in range(4, 200):
        g, feeds, state, _, _, _ = build_row(row, dtype, seed=seed)
        tiles = small_tiles([g])
        ctx = TileContext(0, 1, 7)
        count = sum(
            len(n.op.tiling.make(n, n.op.tiling.resolve(n.op.name, "sm_90", tiles.get(n.op.name)), ctx))
            for n in g.nodes
            if n.op.tiling is not None
        )
        if count <= MAX_TASKS and (count >= 2 or not any(n.op.tiling for n in g.nodes) or seed > 40):
            return g, feeds, state, tiles
    raise AssertionError(f"{row.id}: no small draw found")


@pytest.mark.parametrize("processors", PROCESSORS)
@pytest.mark.parametrize("row_id", list(OP_ROWS))
def test_every_op_through_the_plan(row_id: str, processors: int) -> None:
    row, dtype = OP_ROWS[row_id]
    g, feeds, state, tiles = small_case(row, dtype)
    plan = make_plan(g, processors=processors, tiles=tiles)
    check_plan(plan, g, feeds, state=state, what=f"{row.id} [{dtype}] P={processors}")


def test_op_rows_reach_every_op_with_tasks() -> None:
    with_tasks = {
        name
        for name, op in REGISTRY.items()
        if op.tiling is not None and op.kind != "collective" and name not in ("recv", "send")  # test_push_send_recv
    }
    assert with_tasks <= {row.op for row, _ in OP_ROWS.values()}


@pytest.mark.parametrize("processors", PROCESSORS)
def test_llama_block_through_the_plan(processors: int) -> None:
    cfg = LlamaConfig(hidden=32, heads=4, kv_heads=2, intermediate=48, layers=2, max_seq=12, vocab=40)
    prefill, decode = build_llama(cfg, 2, 3, "prefill"), build_llama(cfg, 2, 1, "decode")
    params = random_parameters(cfg, seed=5)
    rng = np.random.default_rng(6)
    for graph, tokens, pos in (
        (prefill, rng.integers(0, 40, (2, 3)), np.tile(np.arange(3), (2, 1))),
        (decode, rng.integers(0, 40, (2, 1)), np.array([[3], [5]])),
    ):
        plan = make_plan(graph, processors=processors, tiles=small_tiles([graph]))
        check_plan(plan, graph, {"tokens": tokens, "positions": pos}, params, what=f"{graph.name} P={processors}")


def test_decode_loop_feeds_its_own_token_back() -> None:
    """Several iterations of a graph whose state is both read early and written late."""
    g = ml.Graph("loop")
    tok = g.state("token", (2,), ml.int64, init=[1, 3])
    step = g.state("step", (2, 1), ml.int64)
    table = g.parameter("table", (6, 8), ml.float32)
    h = ml.embedding(table, tok) + step.astype("float32")
    g.assign(step, step + 1)
    g.assign(tok, ml.argmax(ml.softmax(h @ table.T), axis=-1))
    g.output("h", h)
    params = {"table": np.random.default_rng(0).standard_normal((6, 8))}
    for processors in PROCESSORS:
        plan = make_plan(g, processors=processors, tiles=small_tiles([g]))
        check_plan(plan, g, {}, params, what=f"loop P={processors}")


def collective_program(g: ml.Graph) -> None:
    r, n = g.rank, g.world_size
    x = g.input("x", (3, 4 * n), ml.float32)
    total = ml.all_reduce(ml.relu(x))
    biggest = ml.all_reduce(x, "max")
    gathered = ml.all_gather(total[:, :2], axis=0)
    piece = ml.reduce_scatter(ml.exp(x * 0.1), axis=1)
    ml.send(piece + 1.0, (r + 1) % n, tag=3)
    got = ml.recv(g, (r - 1) % n, piece.shape, piece.dtype, tag=3)
    g.output("gathered", gathered)
    g.output("biggest", biggest)
    g.output("got", got * 2.0)


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("processors", PROCESSORS)
def test_collectives_through_the_plan(world: int, processors: int) -> None:
    graphs = ml.spmd(collective_program, world)
    rng = np.random.default_rng(world)
    feeds = [{"x": rng.standard_normal((3, 4 * world))} for _ in range(world)]
    plan = make_plan(graphs, processors=processors, tiles=small_tiles(graphs))
    check_plan(plan, graphs, feeds, what=f"world {world} P={processors}")


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_tp_mlp_through_the_plan(world: int) -> None:
    """Megatron-style tensor-parallel MLP: column-parallel then row-parallel matmul, all-reduce."""
    graphs, x, params = tp_mlp(world, tokens=5, hidden=16, ffn=8 * world, scale=0.2, seed=1)
    for processors in PROCESSORS:
        plan = make_plan(graphs, processors=processors, tiles=small_tiles(graphs))
        check_plan(plan, graphs, [{"x": x}] * world, params, what=f"tp mlp P={processors}")


def test_memory_reuse_through_the_plan() -> None:
    """With sharing forced (budget 0, any size), tensors with disjoint lifetimes share bytes and the
    extra write-after-read orderings keep results exact."""
    from megaloop.plan import memory

    cfg = LlamaConfig(hidden=32, heads=4, kv_heads=2, intermediate=48, layers=2, max_seq=8, vocab=40)
    g = build_llama(cfg, 1, 4)
    params = random_parameters(cfg, seed=2)
    feeds = {"tokens": np.arange(4)[None], "positions": np.arange(4)[None]}
    old = memory.REUSE_MIN_BYTES
    memory.REUSE_MIN_BYTES = 0
    try:
        plan = make_plan(g, processors=7, tiles=small_tiles([g]), scratch_budget=0)
    finally:
        memory.REUSE_MIN_BYTES = old
    layout = plan.ranks[0].memory
    assert layout.scratch_bytes < layout.scratch_unshared, "expected buffers to share bytes"
    check_plan(plan, g, feeds, params, what="reuse")

"""The static schedule (megaloop/plan/schedule.py): placement by depth, meetings placed as one unit,
and the cost model's L2 term for matmul tiles."""

from __future__ import annotations

import math

import pytest

import megaloop as ml
from megaloop.errors import DeadlockError
from megaloop.frontend.opdef import REGISTRY
from megaloop.frontend.tiling import TileContext
from megaloop.plan import make_plan
from megaloop.plan.schedule import RATES, list_schedule


def _swiglu(tokens: int, hidden: int, inner: int) -> ml.Graph:
    g = ml.Graph("swiglu")
    h = g.input("h", (tokens, hidden), ml.bfloat16)
    wg = g.parameter("gate", (inner, hidden), ml.bfloat16)
    wu = g.parameter("up", (inner, hidden), ml.bfloat16)
    g.output("y", ml.silu(ml.linear(h, wg)) * ml.linear(h, wu))
    return g


def test_an_independent_op_is_not_queued_behind_tasks_that_wait() -> None:
    # In program order silu(gate) comes before the up projection; its tasks wait for the gate's tiles.
    # Placed by depth, no processor runs a silu task before an up-projection tile it could have run.
    plan = make_plan(_swiglu(512, 1024, 2816), processors=16, fusion=ml.FuseOptions.none())  # (silu and mul apart)
    rp = plan.ranks[0]
    op_name = {op.id: op.name for op in rp.ops}
    matmuls = sorted(op.id for op in rp.ops if op.op == "matmul")
    up, silu = matmuls[1], next(op.id for op in rp.ops if op.op == "silu")
    mixed = 0
    for p, lst in enumerate(rp.processors):
        ops = [rp.tasks[t].op for t in lst]
        if up in ops and silu in ops:
            mixed += 1
            first_silu, last_up = ops.index(silu), len(ops) - 1 - ops[::-1].index(up)
            assert last_up < first_silu, (
                f"processor {p} runs {op_name[silu]} task {first_silu} before {op_name[up]} tile {last_up}: "
                f"{[op_name[o] for o in ops]}"
            )
    assert mixed, "no processor runs both ops: the test checks nothing"


def test_a_meeting_is_placed_as_one_unit() -> None:
    # two ranks, one processor each: tasks 0 and 3 form a meeting, so rank 1 runs 3 before 1
    sched = list_schedule([0, 1, 0, 1], [1.0, 1.0, 1.0, 1.0], [[], [], [], []], 1, 2, [[0, 3]])
    assert sched.lists == [[[0, 2]], [[3, 1]]]
    plain = list_schedule([0, 1, 0, 1], [1.0, 1.0, 1.0, 1.0], [[], [], [], []], 1, 2)
    assert plain.lists == [[[0, 2]], [[1, 3]]]


def test_meetings_that_wait_on_each_other_are_refused() -> None:
    # meeting {0, 3} needs 1 (3's producer) and meeting {1, 2} needs 0 (2's producer): neither can start
    with pytest.raises(DeadlockError, match="depends on itself"):
        list_schedule([0, 0, 1, 1], [1.0] * 4, [[], [], [0], [1]], 1, 2, [[0, 3], [1, 2]])


def test_placement_follows_depth_not_position() -> None:
    # 0 -> 2 (depth 1); 1 and 3 have no producers (depth 0): 3 goes before 2 on the one processor
    sched = list_schedule([0, 0, 0, 0], [1.0, 1.0, 1.0, 1.0], [[], [], [0], []], 1, 1)
    assert sched.lists == [[[0, 1, 3, 2]]]


def test_matmul_tiles_are_costed_at_l2_operand_feed_and_their_hbm_share() -> None:
    # a 512-token projection: 128 x 128 tiles (narrowed from 256 to fill the processors) stream their
    # A and B blocks from L2; each block comes from HBM once, shared by its row's or column's tiles
    tokens, hidden, out = 512, 4096, 4096
    g = ml.Graph("proj")
    h = g.input("h", (tokens, hidden), ml.bfloat16)
    g.output("y", ml.linear(h, g.parameter("w", (out, hidden), ml.bfloat16)))
    plan = make_plan(g, processors=132)
    rp = plan.ranks[0]
    tiles = [t for t in rp.tasks if rp.ops[t.op].op == "matmul"]
    box = tiles[0].writes[0].box
    bm, bn = box.hi[0] - box.lo[0], box.hi[1] - box.lo[1]
    assert (bm, bn) == (128, 128) and len(tiles) == 128
    rates = RATES["sm_90"]
    streamed = (bm + bn) * hidden * 2
    want = rates.task_overhead_ns + streamed / (rates.l2 / 132) * 1e9
    for t in tiles:
        assert math.isclose(t.cost_ns, want, rel_tol=1e-9), f"{rp.task_name(t)}: {t.cost_ns} ns, expected {want}"
    # bytes: what the boxes touch (the plan file's field, unchanged by the cost model)
    assert all(t.bytes == streamed + bm * bn * 2 for t in tiles), f"{tiles[0].bytes} bytes"
    # from HBM only its share: (1 MB of A over 32 column tiles + 1 MB of B over 4 row tiles + C) at 4.2 TB/s
    hbm = bm * hidden * 2 // (out // bn) + bn * hidden * 2 // (tokens // bm) + bm * bn * 2
    assert hbm / (rates.hbm / 132) < streamed / (rates.l2 / 132), "the HBM share should not be what bounds it"


def test_a_weight_shared_by_every_batch_index_is_counted_once() -> None:
    # (8, 512, 1024) @ (1024, 1024): one weight block serves the row tiles of all 8 batch indices
    g = ml.Graph("batched")
    h = g.input("h", (8, 512, 1024), ml.bfloat16)
    g.output("y", ml.linear(h, g.parameter("w", (1024, 1024), ml.bfloat16)))
    tiling = REGISTRY["matmul"].tiling
    node = g.outputs["y"].node
    tiles = tiling.make(node, tiling.resolve("matmul", "sm_90", {}), TileContext(0, 1, 132))
    hbm_b = sum(t.streamed_once for t in tiles) - 8 * 512 * 1024 * 2  # all of A, once
    assert hbm_b == 1024 * 1024 * 2, f"weights counted {hbm_b / (1024 * 1024 * 2):.2f} times"


def test_a_decode_matmul_is_costed_at_its_weights_from_hbm() -> None:
    # one row: every weight block is read by one tile only, from HBM, which is slower than L2
    g = ml.Graph("decode")
    h = g.input("h", (1, 4096), ml.bfloat16)
    g.output("y", ml.linear(h, g.parameter("w", (4096, 4096), ml.bfloat16)))
    plan = make_plan(g, processors=132)
    rp = plan.ranks[0]
    rates = RATES["sm_90"]
    tiles = [t for t in rp.tasks if rp.ops[t.op].op == "matmul"]
    for t in tiles:
        weights, a_row = t.reads[1].box.size * 2, 4096 * 2  # the row of A is shared by every tile
        hbm = t.bytes - a_row + a_row // len(tiles)
        assert hbm >= weights
        want = rates.task_overhead_ns + hbm / (rates.hbm / 132) * 1e9
        assert math.isclose(t.cost_ns, want, rel_tol=1e-9), f"{rp.task_name(t)}: {t.cost_ns} ns, expected {want}"

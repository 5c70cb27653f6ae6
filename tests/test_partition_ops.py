"""Every placement rule of the registry, table-driven from tests/op_table/: each strategy of each
op, on 2, 3, 4 and 8 ranks (uneven pieces wherever a size does not divide), the partitioned program
on the reference backend against PyTorch float64, within the op's tolerance widened by the partial
sums a strategy leaves (each rank's partial result is rounded to the dtype before they are added)."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

import megaloop as ml
from megaloop.frontend.opdef import REGISTRY
from megaloop.frontend.placement import Partial
from megaloop.parallel.choose import random_choice, strategies_for
from megaloop.parallel.partition import Partition
from megaloop.parallel.shard import Part, shard
from tests.helpers import assert_close, to_torch64
from tests.op_table import ROWS, TESTED_ELSEWHERE, build_row
from tests.test_op_table import DRAWS

MEMBERS = (2, 3, 4, 8)
SPLIT_ELSEWHERE = {  # sources and collectives: tests/test_partition.py splits programs with them
    **{op: "test_partition.py" for op in ("input", "parameter", "constant", "state")},
    **{op: "test_partition.py" for op in ("all_reduce", "all_gather", "reduce_scatter", "send", "recv")},
}


def _strategy_count(row, dtype: str, members: int, seed: int) -> int:
    g = build_row(row, dtype, seed)[0]
    node = next((n for n in g.nodes if n.op.name == row.op), None)
    if node is None:  # (e.g. a cast to the dtype x already has: no node)
        return 1
    return len(strategies_for(node, members, [None] * len(node.inputs), shared=False))


def _through_views(t):
    """The source a tensor is made of through views and copies, and those nodes."""
    views = set()
    while t.node.op.kind == "view" or t.node.op.name == "copy":
        views.add(t.node)
        t = t.node.inputs[0]
    return t, views


def run_split(row, dtype: str, members: int, seed: int, which: int) -> str:
    """The row's program with its op's ``which``-th strategy (others at random) on ``members`` ranks."""
    g, feeds, state, arrays, outs, sample = build_row(row, dtype, seed)
    part = Part.whole(g)
    picked: list[str] = []
    node = next((n for n in g.nodes if n.op.name == row.op), None)
    want, fixed, chain = None, {}, set()
    if node is not None:
        mine = strategies_for(node, members, [None] * len(node.inputs), shared=False)
        want = mine[which % len(mine)]
        for t, p in zip(node.inputs, want.inputs):
            if isinstance(p, Partial):  # handed in as partial sums: the value on rank 0, zeros elsewhere
                source, views = _through_views(t)
                fixed[source] = p
                chain |= views

    def prefer(n, options):
        if n in chain:  # the views between a partial source and the op keep it partial
            return [s for s in options if all(isinstance(p, Partial) for p in s.outputs)]
        if n is not node or picked:
            return options
        found = [s for s in options if (s.inputs, s.outputs) == (want.inputs, want.outputs)]
        if found:
            picked.append(want.label)
        return found

    choice = random_choice(part, members, np.random.default_rng(seed), prefer=prefer, fixed=fixed)
    assert node is None or picked, f"{row.id}: strategy {which} ({want.label}) never ran"
    partials = sum(isinstance(p, Partial) for s in choice.strategies.values() for p in s.outputs)
    split = Partition(g, shard(part, members, choice, ranks=list(range(members)), world_size=members))
    results = ml.evaluate(split.graphs, split.shard_inputs(feeds), None, split.shard_state(state))
    got = split.gather_outputs(results)
    with torch.no_grad():
        ref = row.ref(*[to_torch64(a) for a in arrays], dtype=dtype, **sample.kw)
    refs = ref if isinstance(ref, tuple) else (ref,)
    accuracy = REGISTRY[row.op].accuracy
    scale = None
    if row.cancels or partials:
        with torch.no_grad():
            absref = row.ref(*[to_torch64(a).abs() for a in arrays], dtype=dtype, **sample.kw)
        absref = absref[0] if isinstance(absref, tuple) else absref
        scale = float(absref.abs().max()) if absref.dtype.is_floating_point else None
    for k, (t, r) in enumerate(zip(outs, refs)):
        what = f"{row.id} [{dtype}] on {members} ranks, seed {seed}, strategy {picked}, shapes {sample.shapes}"
        r64 = r.double() if r.dtype.is_floating_point else r
        # each rank's partial result is rounded to the dtype before the ranks' values are added: at most
        # half an ulp of each, and the partials' magnitudes are bounded by the op on |operands| (scale)
        atol = members * t.dtype.eps * scale if partials and scale and t.dtype.is_float else 0.0
        assert_close(got[f"y{k}"], r64.numpy(), t.dtype, accuracy, row.reduce_len(sample), what, scale, atol)
    return picked[0] if picked else ""


CASES = [(row, m) for row in ROWS if row.op not in TESTED_ELSEWHERE for m in MEMBERS]


@pytest.mark.parametrize("row,members", CASES, ids=[f"{r.id}-{m}" for r, m in CASES])
def test_every_strategy_matches_the_single_device_op(row, members: int) -> None:
    dtype = row.dtypes[MEMBERS.index(members) % len(row.dtypes)]
    base = zlib.crc32(f"{row.id}-{dtype}".encode())  # test_op_table's draws (whose references hold)
    count = _strategy_count(row, dtype, members, base)
    for which in range(count):
        run_split(row, dtype, members, base + which % DRAWS, which)


def test_every_op_has_a_placement_rule_and_a_split_test() -> None:
    without = sorted(name for name, op in REGISTRY.items() if op.placement is None)
    assert not without, f"ops without a placement rule (OpDef.placement): {without}"
    covered = {row.op for row in ROWS} | set(SPLIT_ELSEWHERE)
    missing = sorted(set(REGISTRY) - covered)
    assert not missing, f"ops whose placement rule no test splits: {missing}"


def test_a_wrong_rule_is_caught() -> None:
    """A rule that claims a softmax can be cut along its normalised axis must fail the table test."""
    row = next(r for r in ROWS if r.op == "softmax")
    op = REGISTRY["softmax"]
    from megaloop.frontend.ops import _placements

    saved = op.placement
    object.__setattr__(op, "placement", _placements.rule(_placements.aligned_dims))
    try:
        with pytest.raises(AssertionError, match="out of tolerance"):
            for seed in range(20):
                for which in range(4):
                    run_split(row, "float32", 2, seed, which)
    finally:
        object.__setattr__(op, "placement", saved)

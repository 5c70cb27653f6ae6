"""The skinny matmul experiment emit_matmul.SKINNY_A_SHARED_BYTES (0, off, by default): A's rows copied
into shared memory first (ml::mma_skinny_shared_a), 16 units of B in flight a warp. Off: the kernels
are what they were; on: which ops take it, where A lies in shared memory (after the partial sums,
before staged weights), no spills, and on a GPU the same bits as the default kernel."""

from __future__ import annotations

import re

import numpy as np
import pytest

import megaloop as ml
import megaloop.codegen.emit_matmul as emit_matmul
from bench.llama_layer import dependent_decode_graph, layer_config
from megaloop.codegen import generate
from megaloop.plan import make_plan
from megaloop.runtime.compile import spills
from megaloop.runtime.device import gpus


def decode_source(hidden: int, sequences: int = 1, tiles=None):
    g = dependent_decode_graph(layer_config(hidden, 1), np.zeros((sequences, 1, hidden), np.float32), "auto")
    return generate(make_plan(g, processors=132, tiles=tiles))


@pytest.fixture
def shared_a(monkeypatch):
    monkeypatch.setattr(emit_matmul, "SKINNY_A_SHARED_BYTES", 64 * 1024)


def calls(src: str) -> list[tuple[int, int, int]]:
    """(K slices, A's byte offset, A's row pitch in elements) of every mma_skinny_shared_a call."""
    found = re.findall(
        r"mma_skinny_shared_a<ml::bf16, (\d+), \d+, \w+>\(.*?reinterpret_cast<char\*>\(ml_smem4\) \+ (\d+)\), (\d+)\);",
        src,
    )
    return [tuple(map(int, f)) for f in found]


def test_off_by_default() -> None:
    assert "mma_skinny_shared_a<" not in decode_source(2048).source


def test_where_a_lies_and_which_ops_take_it(shared_a) -> None:
    prog = decode_source(2048, 4)
    found = calls(prog.source)
    assert len(found) == 5  # tile functions: q; k and v; o; gate and up; down
    for slices, offset, pitch in found:
        assert offset % 128 == 0 and offset >= 4 * 64 * 8  # after the partial sums (groups + 7 warps)
        assert (2 * pitch) % 128 == 64 and 2 * pitch >= 64 * slices  # padded rows of K = 32 slices
        assert prog.shared_bytes >= offset + 4 * 2 * pitch  # room for the tile's 4 rows
    assert spills(prog.source) == {}
    # hidden 4096, 4 sequences: down's 4 rows of 11008 values (88 KB) are past 64 KB: from global memory
    big = decode_source(4096, 4).source
    assert len(calls(big)) == len(calls(decode_source(4096, 1).source)) - 1


def test_b_is_in_flight_while_a_is_copied(shared_a) -> None:
    """What ptxas made of it: each streaming tile issues its 16 loads of B before it waits for A's copies
    (issued after the copies in the source, ptxas had moved them past the wait: a whole trip to L2
    before B's first load). Counted in the machine code: the loads between a barrier and the wait for
    cp.async copies that precedes the next barrier."""
    from megaloop.runtime.compile import compile_cubin
    from tests.helpers import sass

    code = sass(compile_cubin(decode_source(2048).source, "sm_90a", use_cache=False)).splitlines()
    ahead = []
    for n, line in enumerate(code):
        if "DEPBAR.LE SB0" in line and any("BAR.SYNC" in x for x in code[n + 1 : n + 3]):
            start = max(m for m in range(n) if "BAR.SYNC" in code[m])
            ahead.append(sum("LDG.E.128" in x for x in code[start:n]))
    assert sorted(ahead)[-5:] == [16] * 5, ahead  # the 5 tile functions that stream their weights


def test_staged_weights_lie_after_a(shared_a) -> None:
    src = decode_source(2048, 1, {"matmul": {"stage_weights": 1}}).source
    for sig in re.findall(r"void stage_(\d+)\(", src):
        stage = src[src.index(f"void stage_{sig}(") :]
        tile = src[src.index(f"void sig_{sig}(") :]
        b_offset = int(re.search(r"ml_smem4\) \+ (\d+), \d+, ", stage).group(1))
        (_, a_offset, pitch), *_ = calls(tile[: tile.index("\n}\n")])
        assert b_offset >= a_offset + 2 * pitch  # one row of A (one sequence)
        assert "ml::stage_wait" in tile[: tile.index("\n}\n")]


@pytest.mark.gpu
@pytest.mark.skipif(not gpus()[0], reason="no GPU: " + gpus()[1])
@pytest.mark.parametrize("sequences", [1, 4])
def test_same_bits_as_the_default_kernel(sequences: int, monkeypatch) -> None:
    """A from shared memory feeds the same fragments to the same mma sequence: the same bits as A from
    global memory (the hidden-2048 decode layer, 1 and 4 sequences: 46.6 KB of dynamic shared memory,
    the launch that needed the opt-in), and close to the CPU reference."""
    from megaloop.runtime.loop import LoopKernel
    from tests.helpers import decode_layer_case

    g, params, feeds = decode_layer_case(sequences)
    with LoopKernel(make_plan(g, processors=132), params) as k:
        want = k.run(feeds)["hidden"]
    monkeypatch.setattr(emit_matmul, "SKINNY_A_SHARED_BYTES", 64 * 1024)
    plan = make_plan(g, processors=132)
    assert "mma_skinny_shared_a<" in generate(plan).source
    with LoopKernel(plan, params) as k:
        got = k.run(feeds)["hidden"]
    assert np.array_equal(got, want), f"worst {np.max(np.abs(got.astype(float) - want.astype(float)))}"
    ref = ml.evaluate(g, feeds, params).outputs["hidden"].astype(np.float64)
    rel = np.linalg.norm(got.astype(np.float64) - ref) / np.linalg.norm(ref)
    assert rel < 1e-2, f"relative L2 difference {rel:.2e} from the CPU reference"

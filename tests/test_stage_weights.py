"""The matmul tile switch stage_weights (off by default; not yet run on a GPU): decode tiles whose block
of weights fits in shared memory have it copied there by the copy engine (warp 2) while the task waits
for its producers (megaloop/stage.cuh). What the generator emits and where, that kernels without the
switch are unchanged, that they compile without spills, and the watchdog's message; the GPU check is
test_gpu.py's test_staged_weights_decode_matches_the_reference."""

from __future__ import annotations

import re

import numpy as np
import pytest

from bench.llama_layer import dependent_decode_graph, layer_config
from megaloop.codegen import generate
from megaloop.codegen.emit_matmul import WGMMA_STATIC_RESERVE
from megaloop.frontend.tiling import SHARED_MEMORY_PER_BLOCK
from megaloop.plan import make_plan
from megaloop.runtime.compile import CompileError, compile_cubin, spills
from megaloop.runtime.loop import CONTROL_WORDS, ERROR, INFO, LoopKernel, LoopKernelError

STAGED = {"matmul": {"stage_weights": 1}}


def decode_plan(hidden: int, sequences: int = 1, tiles=None, arch: str = "sm_90"):
    cfg = layer_config(hidden, 1)
    g = dependent_decode_graph(cfg, np.zeros((sequences, 1, hidden), np.float32), "auto")
    return make_plan(g, processors=132, tiles=tiles, arch=arch)


def staged_ops(src: str) -> list[str]:
    """Names of the ops whose tile functions wait for staged weights."""
    names = []
    for m in re.finditer(r"// sig_(\d+): matmul (\S+):", src):
        body = src[m.end() : src.index("\n}\n", m.end())]
        if "ml::stage_wait" in body:
            names.append(m.group(2).split(".")[-1])
    return names


def test_off_by_default_and_kernels_unchanged() -> None:
    src = generate(decode_plan(2048)).source
    assert "stage" not in src.replace("kv_cache_update", "")  # no barrier, no stage function, no issue
    assert generate(decode_plan(2048, tiles={"matmul": {"stage_weights": 0}})).source == src


def test_stages_the_tiles_whose_weights_fit() -> None:
    """Hidden 2048: q, k, v (24 columns x 4 KB rows), o (16) and down (16 x 11 KB) fit in shared memory,
    gate and up (88 columns) do not; hidden 4096: none does."""
    plan = decode_plan(2048, tiles=STAGED)
    prog = generate(plan)
    assert staged_ops(prog.source) == ["matmul_10", "matmul_14", "matmul_28", "matmul_37"]  # k, v share sig_3
    assert prog.shared_bytes + WGMMA_STATIC_RESERVE <= SHARED_MEMORY_PER_BLOCK["sm_90"]
    # every staged signature has its stage function under the very same guard as its tile
    for sig in re.findall(r"void stage_(\d+)\(", prog.source):
        stage = prog.source[prog.source.index(f"void stage_{sig}(") :]
        tile = prog.source[prog.source.index(f"void sig_{sig}(") :]
        guard = re.search(r"\n    if \((.*)\) \{  // the tile takes the skinny path", stage).group(1)
        assert f"if ({guard}) {{  // at most 8 rows" in tile, sig
        # rows padded to 64 bytes past a multiple of 128 (bank-conflict-free 16-byte loads), after the partial sums
        offset, pitch, row = map(int, re.search(r"ml_smem4\) \+ (\d+), (\d+), .*, (\d+)\);", stage).groups())
        assert pitch % 128 == 64 and pitch >= row and offset % 128 == 0 and offset >= 4 * 64 * 9
        # the tile reads B where the copies put it: same offset, rows pitch / 2 elements apart, no L2 policy
        call = re.search(
            r"mma_skinny<[^>]*, false>\(in0 \+ ab, \d+, nr, reinterpret_cast<const ml::bf16\*>\("
            r"reinterpret_cast<const char\*>\(ml_smem4\) \+ (\d+)\), (\d+), ncols",
            tile,
        )
        assert call and (int(call.group(1)), int(call.group(2))) == (offset, pitch // 2), sig
        width = int(re.search(r"t\.hi\[2\] - t\.lo\[2\] <= (\d+)", guard).group(1))
        assert prog.shared_bytes >= offset + width * pitch  # the kernel asks for room for the widest tile
    assert staged_ops(generate(decode_plan(4096, 1, STAGED)).source) == []


def test_four_sequences_and_other_architectures() -> None:
    assert len(staged_ops(generate(decode_plan(2048, 4, STAGED)).source)) == 4
    assert "stage" not in generate(decode_plan(2048, 1, STAGED, "sm_80")).source.replace("kv_cache_update", "")


def test_staged_kernel_compiles_without_spills_and_only_for_hopper() -> None:
    """Every thread fences its shared-memory stores before the barrier that ends a task (a proxy fence
    orders only its own thread's accesses); a GPU without the copy engine is refused, naming the switch."""
    src = generate(decode_plan(2048, tiles=STAGED)).source
    assert "ml::stage_fence();" in src[src.index("run_task(a, s, k, proc);") :]
    assert spills(src) == {}
    assert compile_cubin(src, "sm_90a", use_cache=False)[:4] == b"\x7fELF"
    with pytest.raises(CompileError, match="stage_weights"):
        compile_cubin(src, "sm_80", use_cache=False)


def test_watchdog_names_the_task_whose_weights_never_landed() -> None:
    plan = decode_plan(2048, tiles=STAGED)
    rp = plan.ranks[0]
    task = next(t for t in rp.tasks if rp.ops[t.op].name.endswith("matmul_28"))
    k = LoopKernel.__new__(LoopKernel)  # no GPU: only the error report
    k.plan, k.rp, k.rank, k.timeout_s = plan, rp, 0, 2.0
    k._halt = lambda: None
    k.control = np.zeros(CONTROL_WORDS, np.uint64)
    k.control[ERROR] = 1
    k.control[INFO : INFO + 8] = np.array([7, task.id, task.op, -3, 0, 0, 5, 0], np.int64).astype(np.uint64)
    with pytest.raises(LoopKernelError, match=r"processor 7 .* iteration 5 in .*matmul_28.*never landed"):
        k._raise_kernel_error()

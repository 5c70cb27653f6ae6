"""The loop's own cost without a GPU (KernelOptions task_records, completion_word, doorbell_reads,
round_trip_stamps; docs/runtime.md, "The loop's own cost"): the options are saved in the plan and
switch only their macros, every one compiles, the task records hold what the tables say in the
layout the kernel declares, the round trip's parts are recovered from stamps, and the host's wait
on the completion word. Their GPU tests: tests/test_gpu_loop_cost.py."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from bench.loop_overhead import parts_of, tiny_graph
from megaloop.codegen import generate
from megaloop.codegen.abi import MAX_OPERANDS
from megaloop.codegen.kernel import LOOP_COST_MACROS
from megaloop.errors import GraphBuildError, PlanFormatError
from megaloop.models import LlamaConfig, build_llama
from megaloop.plan import KernelOptions, make_plan
from megaloop.plan.cache import make_programs
from megaloop.plan.format import plan_from_dict, plan_to_dict
from megaloop.runtime import resident
from megaloop.runtime.compile import compile_cubin
from megaloop.runtime.loop import DONE, STOP, LoopKernel
from megaloop.runtime.records import slot_dtype, task_records
from megaloop.runtime.stamps import STAMP_FIELDS
from tests.fake_driver import FakeDriver, install

TINY = LlamaConfig(hidden=64, heads=4, kv_heads=2, intermediate=96, layers=1, max_seq=8, vocab=50)
ALL = KernelOptions(task_records=1, completion_word=1, doorbell_reads=4, round_trip_stamps=1)


def test_the_options_are_saved_in_the_plan_and_switch_only_their_macros() -> None:
    base = generate(make_plan(tiny_graph(), processors=2)).source
    assert not any(macro in base for macro in LOOP_COST_MACROS.values()), "the defaults changed the kernel's text"
    plan = make_plan(tiny_graph(), processors=2, options=ALL)
    source = generate(plan).source
    for name, macro in LOOP_COST_MACROS.items():
        assert f"#define {macro} {getattr(ALL, name)}\n" in source, macro
    assert source.replace("".join(f"#define {m} {getattr(ALL, n)}\n" for n, m in LOOP_COST_MACROS.items()), "") == base
    data = plan_to_dict(plan)
    assert plan_from_dict(data).options == ALL
    with pytest.raises(GraphBuildError, match=r"doorbell_reads: must be an int in \[0, 4\], got 9"):
        make_plan(tiny_graph(), processors=2, options=KernelOptions(doorbell_reads=9))
    data["options"]["task_records"] = 2
    with pytest.raises(PlanFormatError, match=r"task_records: must be an int in \[0, 1\], got 2"):
        plan_from_dict(data)


@pytest.mark.parametrize(
    ("arch", "options", "programs"),
    [
        ("sm_90a", ALL, False),  # a decode step with the weight ring
        ("sm_90a", dataclasses.replace(ALL, weight_ring_loader=1), False),  # its loader warp
        ("sm_80", ALL, True),  # a kernel of several programs (the switch refills the records)
        ("sm_90a", ALL, True),  # ... with the weight ring and its loader warp
    ],
)
def test_every_option_compiles(arch: str, options: KernelOptions, programs: bool) -> None:
    decode = build_llama(TINY, 1, 1, "decode")
    if programs:
        plan = make_programs({"decode": decode, "prefill": build_llama(TINY, 1, 4, "prefill")},
                             processors=16, arch=arch.removesuffix("a"), options=options)  # fmt: skip
    else:
        plan = make_plan(decode, processors=16, arch="sm_90", options=options)
    source = generate(plan).source
    assert ("ml::LoaderRing" in source) == (arch == "sm_90a" and options.weight_ring_loader > 0), "the loader warp"
    assert compile_cubin(source, arch, use_cache=False)[:4] == b"\x7fELF"


def test_task_records_hold_each_list_positions_task_waits_and_offsets() -> None:
    plan = make_plan(build_llama(TINY, 1, 1, "decode"), processors=8, options=KernelOptions(slot_waits=2))
    program = generate(plan)
    records = task_records(program, 2)
    assert len(records) == len(program.lists) and records.dtype.itemsize % 16 == 0
    assert any(t["wait_count"] > 2 for t in program.tasks), "no task with more waits than the slot holds"
    for pos, tid in enumerate(program.lists):
        r, t = records[pos], program.tasks[tid]
        assert r["id"] == tid and r["task"].tobytes() == t.tobytes(), pos
        assert list(r["offsets"]) == list(program.operand_offsets.reshape(-1, MAX_OPERANDS)[t["op"]]), pos
        for j in range(2):
            want = program.waits[t["wait_begin"] + j].tobytes() if j < t["wait_count"] else bytes(20)
            assert r["waits"][j].tobytes() == want, (pos, j)


@pytest.mark.parametrize("slot_waits", [1, 5, 16, 17])
def test_the_records_layout_is_the_kernels_task_slot(slot_waits: int) -> None:
    d = slot_dtype(slot_waits)
    checks = [("sizeof(ml::TaskSlot)", d.itemsize)] + [
        (f"ML_OFFSETOF(ml::TaskSlot, {name})", d.fields[name][1]) for name in ("task", "waits", "offsets", "id")
    ]
    source = f'#define ML_SLOT_WAITS {slot_waits}\n#include "megaloop/loop.cuh"\n' + "".join(
        f'static_assert({expr} == {value}, "{expr} != {value} (megaloop/runtime/records.py)");\n'
        for expr, value in checks
    )
    source += 'extern "C" __global__ void layout_check() {}\n'
    assert compile_cubin(source, "sm_80", use_cache=False)[:4] == b"\x7fELF"


def test_the_round_trip_parts_are_recovered_from_stamps() -> None:
    """Synthetic trips on two clocks 5 ms apart, the host's word read at a read's midpoint: every part
    comes back as laid out, and they add up to the host's total."""
    rng = np.random.default_rng(0)
    trips, blocks, offset, period = 50, 3, 5_000_000, 200.0
    f = {n: i for i, n in enumerate(STAMP_FIELDS)}
    host = np.zeros((trips, 4), np.int64)
    stamps = np.zeros((trips, blocks, len(STAMP_FIELDS)), np.int64)
    tasks = np.zeros((trips, 3, 2), np.int64)
    for i in range(trips):
        h0 = 10_000 * i + int(rng.integers(0, 50))
        host[i, :2] = h0, h0 + 800  # start() 0.8 us
        issued = h0 + 800 + 600 + offset  # (GPU clock) the read that sees it issued 0.6 us after the write
        seen = issued + 1000  # a 1 us read: served at its midpoint, 1.1 us after the write
        stamps[i, 0, f["issued"]], stamps[i, 0, f["seen"]] = issued, seen
        stamps[i, 0, f["host"]] = h0 + 800 + 1100 - int(period / 2)  # the word, half a loop period stale
        stamps[i, 0, f["published"]] = seen + 100
        stamps[i, 1:, f["seen"]] = seen + 400
        tasks[i] = [[seen + 500, seen + 900], [seen + 900, seen + 1300], [seen + 1300, seen + 1700]]
        stamps[i, :, f["done"]] = seen + 1800
        stamps[i, :, f["reported"]] = seen + 1800 + np.array([50, 300, 100])
        host[i, 2] = seen + 2100 + 700 - offset  # seen by the host 0.7 us after the report was issued
        host[i, 3] = host[i, 2] + 150
    parts = parts_of(host, stamps, tasks, period)
    want = {
        "host_start_call (start() after the clock, the doorbell write inside)": 0.8,
        "doorbell_written_to_block0_sees_it": 1.6,
        "block0_publishes_grant": 0.1,
        "grant_published_to_first_task_start": 0.4,
        "tasks_first_start_to_last_end": 1.2,
        "last_task_end_to_last_block_done": 0.1,
        "last_block_done_to_report_issued": 0.3,
        "report_issued_to_host_sees_it": 0.7,
        "host_wait_returns": 0.15,
    }
    for name, value in want.items():
        assert parts[name] == pytest.approx(value, abs=0.002), (name, parts[name])
    assert parts["sum_of_medians"] == pytest.approx(parts["host_total"], abs=0.01)
    assert parts["detail: block0_doorbell_read_trip"] == pytest.approx(1.0)


def test_the_hosts_wait_reads_the_completion_word(monkeypatch, tmp_path) -> None:
    """On the fake driver (it reports every block's progress and the completion word): the wait and the
    iterations completed go by the word; a kernel without the option ignores it."""
    monkeypatch.setenv("MEGALOOP_CACHE", str(tmp_path))
    monkeypatch.setattr(resident, "_entries", {})
    monkeypatch.setattr(resident, "_deferred", [])
    fake = install(monkeypatch, FakeDriver(gpus=1))
    try:
        with LoopKernel(make_plan(tiny_graph(), processors=4, options=KernelOptions(completion_word=1))) as k:
            k.run({}, iterations=3)
            assert k.completed() == 3 and k.finished()
            k.control[STOP] = 1  # the fake's blocks leave: the words stay as set below
            assert fake.kernels[-1].left.wait(5)
            k.start(2)
            k.progress[:] = 5
            assert not k.finished(), "finished by the blocks' progress, not the completion word"
            k.control[DONE] = 5
            assert k.finished() and k.completed() == 5
        with LoopKernel(make_plan(tiny_graph(), processors=4)) as k:
            k.run({}, iterations=2)
            assert k.completed() == 2 and k.finished()
    finally:
        resident.stop_everything()

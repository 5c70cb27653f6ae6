"""The host <-> kernel ABI (megaloop/codegen/abi.py): the header is generated from the description, the
compiler agrees with the host's numpy layout (its static_asserts, through NVRTC), and a layout the two
sides disagree on is refused at compile time."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import megaloop as ml
from megaloop.codegen import abi, generate
from megaloop.plan import make_plan
from megaloop.runtime import loop
from megaloop.runtime.compile import ARCHS, CompileError, compile_cubin

PROBE = '\nextern "C" __global__ void probe() {}\n'


def test_header_is_current() -> None:
    assert abi.HEADER.read_text() == abi.render(), "run: python scripts/gen_abi.py"


@pytest.mark.parametrize("arch", ARCHS)
def test_header_compiles_with_its_layout_checks(arch: str) -> None:
    src = '#include "megaloop/abi.cuh"\n' + PROBE
    assert "ML_OFFSETOF(Args, mirrors) == 136" in abi.render()  # the checks are in it
    assert compile_cubin(src, arch, use_cache=False)[:4] == b"\x7fELF"


def test_loop_kernel_tables_use_the_abi() -> None:
    g = ml.Graph("abi")
    x = g.input("x", (4, 8), "float32")
    g.output("y", ml.relu(x) + 1.0)
    prog = generate(make_plan(g, processors=2))
    assert prog.tasks.dtype == abi.TASK.dtype and prog.waits.dtype == abi.WAIT.dtype
    assert prog.mirrors.dtype == abi.MIRROR.dtype
    assert prog.operand_offsets.shape[1] == abi.MAX_OPERANDS
    assert loop.ARGS_DTYPE == abi.ARGS.dtype and loop.CONTROL_WORDS == 14
    # host_ns right after requested: block 0 reads both in one 16-byte load (megaloop/loop.cuh read_doorbell)
    assert (loop.REQUESTED, loop.HOST_NS, loop.STOP, loop.ERROR, loop.INFO, loop.PROGRAM, loop.DONE) == (
        0, 1, 2, 3, 4, 12, 13)
    assert prog.others == []


def test_a_hand_edited_header_is_refused() -> None:
    """Two fields of ml::Wait swapped in the C++ only: the compile names the field the host misplaces."""
    text = abi.render()
    a, b = "    int counter;\n    int per_iteration;", "    int per_iteration;\n    int counter;"
    assert text.count(a) == 1
    with pytest.raises(CompileError, match=r"ml::Wait::counter: at byte 0"):
        compile_cubin(text.replace("#pragma once\n", "").replace(a, b) + PROBE, "sm_80", use_cache=False)


def test_a_description_whose_sides_disagree_is_refused() -> None:
    """A field declared int in C++ but int64 on the host: numpy puts the next one 4 bytes later."""
    wait = abi.WAIT
    lag = dataclasses.replace(wait.fields[2], np_type=np.int64)  # C++ still "int"
    wrong = dataclasses.replace(wait, fields=(*wait.fields[:2], lag, *wait.fields[3:]))
    assert wrong.dtype.fields["rank"][1] != wait.dtype.fields["rank"][1]
    src = '#include "megaloop/abi.cuh"\nnamespace ml { namespace wrong {\n' + abi.definitions((wrong,)) + "\n} }"
    with pytest.raises(CompileError, match=r"ml::Wait::lag: at byte 8, 8 bytes"):
        compile_cubin(src + PROBE, "sm_80", use_cache=False)

"""The host <-> kernel ABI (megaloop/codegen/abi.py) against the layouts kept by hand before it: numpy
field by field, and C++ through NVRTC (the old structs of megaloop/loop.cuh beside the generated ones)."""

from __future__ import annotations

import numpy as np
import pytest

from megaloop.codegen import abi, kernel
from megaloop.runtime import loop
from megaloop.runtime.compile import compile_cubin

OLD = {"Task": kernel.TASK_DTYPE, "Wait": kernel.WAIT_DTYPE, "Mirror": kernel.MIRROR_DTYPE, "Args": loop.ARGS_DTYPE}


def layout(dt: np.dtype) -> list[tuple[str, int, str, tuple[int, ...]]]:
    return [(name, dt.fields[name][1], dt.fields[name][0].base.str, dt.fields[name][0].shape) for name in dt.names]


@pytest.mark.parametrize("name", sorted(OLD))
def test_numpy_layouts_are_the_old_ones(name: str) -> None:
    new = {s.name: s for s in abi.STRUCTS}[name].dtype
    assert layout(new) == layout(OLD[name])
    assert new.itemsize == OLD[name].itemsize


def test_control_words_are_the_old_ones() -> None:
    assert abi.CONTROL.dtype.itemsize // 8 == loop.CONTROL_WORDS
    words = [abi.word(abi.CONTROL, n) for n in ("requested", "stop", "error", "info")]
    assert words == [loop.REQUESTED, loop.STOP, loop.ERROR, loop.INFO]
    assert (abi.MAX_DIMS, abi.MAX_OPERANDS) == (kernel.MAX_DIMS, kernel.MAX_OPERANDS)


def test_cxx_layouts_are_the_old_ones() -> None:
    """The generated structs (namespace ml::generated) field for field where loop.cuh's (ml::) are."""
    checks = []
    for s in abi.STRUCTS:
        checks.append(f'static_assert(sizeof(ml::{s.name}) == sizeof(ml::generated::{s.name}), "{s.name}");')
        for f in s.fields:
            checks.append(
                f"static_assert(__builtin_offsetof(ml::{s.name}, {f.name}) == "
                f'__builtin_offsetof(ml::generated::{s.name}, {f.name}), "{s.name}::{f.name}");'
            )
    src = (
        '#include "megaloop/loop.cuh"\nnamespace ml { namespace generated {\n'
        + abi.definitions()
        + "\n} }\n"
        + "\n".join(checks)
        + '\nextern "C" __global__ void probe() {}\n'
    )
    assert compile_cubin(src, "sm_80", use_cache=False)[:4] == b"\x7fELF"

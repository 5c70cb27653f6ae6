"""The optimizer's tiles without a GPU: the generated tile functions of megaloop/optim.cuh (the in-place
updates, over megaloop/elementwise.cuh) and megaloop/optim_norm.cuh (square_sum, lr_schedule) run on
the CPU through g++ (the shims of tests/test_rope_kv_codegen.py and tests/test_sample_codegen.py stand
in for the CUDA headers), on the tasks the op's tiling makes, against the numpy reference within the
op's accuracy; the updates leave their state alone on iterations that do not update; square_sum gives
the same bits whatever the box's layout (a fixed order of folds)."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import megaloop as ml
from megaloop.codegen import emit_optim
from megaloop.codegen.emit import Operand
from megaloop.frontend.opdef import REGISTRY
from megaloop.frontend.tiling import Box, TileContext
from megaloop.runtime.compile import INCLUDE
from tests.helpers import assert_close
from tests.test_rope_kv_codegen import SHIM as ELEMENTWISE_SHIM
from tests.test_sample_codegen import build_tile, run_generated

needs_cxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs a host C++ compiler (g++)")

TILE = r"""
#include "megaloop/optim.cuh"
void tile(const ml::Args& a, const ml::Task& t, int tid, const ml::i64* off) {
BODY
}
// every task of the op, each by one block of `threads` threads taken one after another (the update tiles
// never synchronise the block)
extern "C" void run(char* arena, const int* lo, const int* hi, int tasks, const long long* off, int threads,
                    long long* info) {
    const ml::Args a{arena, info};
    blockDim.x = threads;
    for (int k = 0; k < tasks; ++k) {
        ml::Task t{};
        memcpy(t.lo, lo + k * ml::MAX_DIMS, sizeof t.lo);
        memcpy(t.hi, hi + k * ml::MAX_DIMS, sizeof t.hi);
        for (int x = 0; x < threads; ++x) { threadIdx.x = x; tile(a, t, k, off); }
    }
}
"""


def operand_of(a: np.ndarray, dtype: str) -> Operand:
    strides = tuple(int(np.prod(a.shape[d + 1 :])) for d in range(a.ndim))
    return Operand(ml.as_dtype(dtype), a.shape, strides)


def run_update(tmp_path: Path, body: list[str], arrays: list[np.ndarray], boxes: list[Box]) -> np.ndarray:
    """Run the tile ``body`` over ``arrays`` (its operands, contiguous; the output is operand 0's storage)."""
    stub = tmp_path / "stub" / "megaloop"
    stub.mkdir(parents=True, exist_ok=True)
    (stub / "loop.cuh").write_text(ELEMENTWISE_SHIM)
    (stub / "vec.cuh").write_text("#pragma once\n")
    k = len(list(tmp_path.glob("*.so")))
    src, lib = tmp_path / f"tile{k}.cpp", tmp_path / f"tile{k}.so"
    src.write_text(TILE.replace("BODY", "\n".join("    " + line for line in body)))
    subprocess.run(
        ["g++", "-std=c++17", "-O1", "-ffp-contract=off", "-shared", "-fPIC", "-I", str(stub.parent)]
        + ["-I", str(INCLUDE), "-o", str(lib), str(src)],
        check=True,
        capture_output=True,
    )
    offsets, at = [], 64
    for a in arrays:
        offsets.append(at)
        at += -(-max(1, a.nbytes) // 64) * 64 + 64
    arena = np.zeros(at, np.uint8)
    for a, o in zip(arrays, offsets):
        arena[o : o + a.nbytes] = np.ascontiguousarray(a).view(np.uint8).ravel()
    offsets.append(offsets[0])  # the output: in place on operand 0
    lo, hi = np.zeros((len(boxes), 6), np.int32), np.ones((len(boxes), 6), np.int32)
    for j, box in enumerate(boxes):
        lo[j, : len(box.lo)], hi[j, : len(box.hi)] = box.lo, box.hi
    info = np.zeros(9, np.int64)
    off = np.array(offsets, np.int64)
    fn = ctypes.CDLL(str(lib)).run
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    fn(arena.ctypes.data, lo.ctypes.data, hi.ctypes.data, len(boxes), off.ctypes.data, 64, info.ctypes.data)
    assert info[0] == 0, info
    out = arrays[0]
    return arena[offsets[0] : offsets[0] + out.nbytes].view(out.dtype).reshape(out.shape).copy()


# (op, builder, operand dtypes, value kinds: n normal, p positive, s positive 0-d, c the counter)
UPDATES = {
    "grad_accumulate": (lambda g, o, c: ml.grad_accumulate(o[0], o[1], c, accumulate=2), "nn"),
    "adam_moment": (lambda g, o, c: ml.adam_moment(o[0], o[1], c, beta=0.95, square=True, scale=o[2]), "pns"),
    "adamw_update": (lambda g, o, c: ml.adamw_update(o[0], o[1], o[2], c, lr=o[3], weight_decay=0.1), "nnps"),
    "sgd_momentum": (
        lambda g, o, c: ml.sgd_momentum(
            o[0], o[1], o[2], c, momentum=0.9, dampening=0.1, weight_decay=0.01, scale=o[3]
        ),
        "nnns",
    ),
    "sgd_update": (
        lambda g, o, c: ml.sgd_update(
            o[0], o[1], c, lr=o[3], buf=o[2], momentum=0.9, nesterov=True, weight_decay=0.01, scale=o[4]
        ),
        "nnnss",
    ),
}


def update_case(op: str, dtype: str, shape: tuple[int, ...], counter: int, rng: np.random.Generator):
    """A graph of one update op (operand 0 a state of ``dtype`` where the op allows it, float32 else),
    its node, and its operands' values (the counter last)."""
    build, kinds = UPDATES[op]
    g = ml.Graph(op)
    tensors, values = [], []
    for k, kind in enumerate(kinds):
        s = () if kind == "s" else shape
        dt = (
            dtype
            if (k == 0 and op in ("adamw_update", "sgd_update")) or (k == 1 and op != "adamw_update")
            else "float32"
        )
        x = rng.standard_normal(s) if kind == "n" else rng.uniform(0.1, 2.0, s)
        values.append(ml.dtypes.round_to(x, ml.as_dtype(dt)))
        tensors.append(g.state(f"s{k}", s, dt) if k == 0 else g.input(f"x{k}", s, dt))
    c = g.input("c", (), "int64")
    out = build(g, tensors, c)
    g.output("y", out)
    values.append(np.array(counter, np.int64))
    return g, out.node, values


@needs_cxx
@pytest.mark.parametrize("op", list(UPDATES))
def test_update_tiles_run_on_the_cpu(op: str, tmp_path: Path) -> None:
    rng = np.random.default_rng(len(op))
    for dtype, shape, counter in [("float32", (37, 24), 3), ("bfloat16", (5, 3, 7), 5), ("float16", (40,), 0)]:
        g, node, values = update_case(op, dtype, shape, counter, rng)
        feeds = {f"x{k}": v for k, v in enumerate(values[:-1]) if k} | {"c": values[-1]}
        want = ml.evaluate(g, feeds, state={"s0": values[0]}).outputs["y"]
        ins = [operand_of(v, n.dtype.name) for v, n in zip(values, node.inputs)]
        out = operand_of(values[0], node.outputs[0].dtype.name)
        opdef = REGISTRY[op]
        constants = opdef.lowering.expression(node.attrs)
        body = emit_optim.update(op, {**node.attrs, "codegen": {"elements": 4096, "threads": 64}}, constants, ins, out)
        tiles = opdef.tiling.make(
            node, {"elements": 64, "waves": 8, "balance": 0, "split_small": 0, "split_full": 0}, TileContext(0, 1, 4)
        )
        got = run_update(tmp_path, body, [v.copy() for v in values], [t.writes[0].box for t in tiles])
        assert_close(got, want, node.outputs[0].dtype, opdef.accuracy, 1, f"{op} {dtype} {shape}")
        # an iteration that does not update (counter 0 of a cycle of 2) leaves the state's bits alone
        if op != "grad_accumulate":
            idle = node.attrs | {"accumulate": 2}
            body = emit_optim.update(op, idle, opdef.lowering.expression(idle), ins, out)
            vals = [v.copy() for v in values[:-1]] + [np.array(0, np.int64)]
            same = run_update(tmp_path, body, vals, [Box.full(shape)])
            assert np.array_equal(same.view(np.uint8), values[0].view(np.uint8)), op


def square_sum_case(shape, strides, splits, rng):
    x = ml.dtypes.round_to(rng.standard_normal(shape), ml.bfloat16)
    g = ml.Graph("norm")
    g.output("y", ml.square_sum(g.input("x", shape, "bfloat16"), splits))
    return x, ml.evaluate(g, {"x": x}).outputs["y"], Operand(ml.bfloat16, shape, strides)


@needs_cxx
def test_square_sum_tile_runs_on_the_cpu(tmp_path: Path) -> None:
    """Contiguous and transposed gradients, ranges one a task and several, against the float64 sums."""
    header = (INCLUDE / "megaloop" / "optim_norm.cuh").read_text()
    rng = np.random.default_rng(3)
    for shape, strides, splits in [((50, 33), (33, 1), 7), ((50, 33), (1, 50), 5), ((1000,), (1,), 3), ((), (), 1)]:
        x, want, xo = square_sum_case(shape, strides, splits, rng)
        out = Operand(ml.float32, (splits,), (1,))
        lib = build_tile(emit_optim.square_sum({"splits": splits}, xo, out), tmp_path, header=header)
        runs = []
        for boxes in ([Box((i,), (i + 1,)) for i in range(splits)], [Box((0,), (splits,))]):
            got, info = run_generated(lib, [x], [strides], (splits,), boxes, threads=64, out_dtype=np.float32)
            assert info[0] == 0, info
            per = -(-(shape[0] if shape else 1) // splits) * int(np.prod(shape[1:]))
            assert_close(got, want, ml.float32, REGISTRY["square_sum"].accuracy, per, f"square_sum {shape} {strides}")
            runs.append(got)
        assert np.array_equal(runs[0], runs[1]), "a range's sum depends on the task that holds it"


@needs_cxx
def test_lr_schedule_tile_gives_the_references_bits(tmp_path: Path) -> None:
    header = (INCLUDE / "megaloop" / "optim_norm.cuh").read_text()
    for kind in ("cosine", "linear", "constant"):
        attrs = {"lr": 3e-4, "min_lr": 2e-5, "warmup": 3, "total": 17, "kind": kind, "accumulate": 2}
        constants = REGISTRY["lr_schedule"].lowering.expression(attrs)
        scalar = Operand(ml.int64, (), ())
        body = emit_optim.lr_schedule(constants, scalar, Operand(ml.float32, (), ()))
        lib = build_tile(body, tmp_path, header=header)
        g = ml.Graph("lr")
        g.output("y", ml.lr_schedule(g.input("c", (), "int64"), **attrs))
        for c in range(0, 45, 3):
            got, info = run_generated(lib, [np.array(c, np.int64)], [()], (), [Box((), ())], 32, out_dtype=np.float32)
            want = ml.evaluate(g, {"c": np.array(c)}).outputs["y"]
            assert info[0] == 0 and got == want, f"{kind} counter {c}: {got} vs {want}"

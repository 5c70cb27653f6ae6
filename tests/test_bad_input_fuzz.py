"""Fuzzers that assert only megaloop errors come out: builders called with random (mostly bad) arguments
on random graphs, byte-flipped, truncated and field-mutated plan files, and byte-flipped, truncated and
header-mutated safetensors files. Seeded; well over 1000 cases each, a few seconds in all."""

from __future__ import annotations

import copy
import inspect
import json
import math
import os
import random
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import megaloop as ml
import megaloop.frontend.ops as ops
from tests.bad_input import deadline
from tests.random_graphs import random_graph


@pytest.fixture
def scratch(tmp_path: Path) -> Iterator[Path]:
    """A folder in memory (/dev/shm) where there is one: the fuzzers write thousands of small files."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        yield tmp_path
        return
    folder = Path(tempfile.mkdtemp(dir=shm, prefix="megaloop-fuzz-"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


BUILDERS = [name for name in ops.__all__ if name != "sources"]
WEIRD: list[Any] = [
    None, True, False, 0, 1, 2, -1, -7, 3, 2**31, 2**64, 10**30, 0.5, -2.5, math.nan, math.inf, -math.inf, 1e39,
    "", "x", "sum", "float16", "neox", (), (0,), (1, 2), (2, -1), (-1,), [0, 1], [1.5], [None], {2, 3}, {"a": 1},
    {"type": "linear", "factor": 2.0}, {"type": "llama3"}, np.ones(3), np.int64(2), np.float32(1.0), np.bool_(True),
    object(), b"ab", slice(0, 1), Ellipsis, ml.float32, ml.int64, ml.bfloat16,
]  # fmt: skip


def _draw(rng: random.Random, tensors: list[ml.Tensor], foreign: ml.Tensor, g: ml.Graph) -> Any:
    roll = rng.random()
    if roll < 0.45:
        return rng.choice(tensors)
    if roll < 0.5:
        return foreign
    if roll < 0.53:
        return g
    if roll < 0.6:
        return [rng.choice(tensors) for _ in range(rng.randrange(4))]
    return rng.choice(WEIRD)


def _graph(rng: random.Random) -> tuple[ml.Graph, list[ml.Tensor]]:
    world = rng.choice([1, 1, 2])
    g = ml.Graph("fuzz", rank=rng.randrange(world), world_size=world)
    random_graph(np.random.default_rng(rng.randrange(2**32)), g, "a.")
    extra = [
        g.input("ids", (3,), ml.int64),
        g.input("pos", (1, 2), ml.int64),
        g.input("q", (1, 2, 2, 4), ml.bfloat16),
        g.state("cache", (1, 2, 8, 4), ml.bfloat16),
        g.input("flag", (2, 4), ml.bool_),
    ]
    return g, [t for n in g.nodes for t in n.outputs] + extra


def _call(rng: random.Random, g: ml.Graph, tensors: list[ml.Tensor], foreign: ml.Tensor) -> None:
    kind = rng.random()
    if kind < 0.7:
        fn = getattr(ml, rng.choice(BUILDERS))
        names = [p for p in inspect.signature(fn).parameters if p not in ("args", "kwargs")]
        args = [_draw(rng, tensors, foreign, g) for _ in range(rng.randrange(5))]
        kwargs = {rng.choice(names): _draw(rng, tensors, foreign, g) for _ in range(rng.randrange(3)) if names}
        fn(*args, **kwargs)
    elif kind < 0.85:
        x = rng.choice(tensors)
        method, low, high = rng.choice([("reshape", 0, 3), ("permute", 0, 3), ("transpose", 0, 2), ("squeeze", 0, 1),
                                        ("unsqueeze", 1, 1), ("astype", 1, 1), ("sum", 0, 2), ("__getitem__", 1, 1),
                                        ("__add__", 1, 1), ("__mul__", 1, 1), ("__matmul__", 1, 1), ("__pow__", 1, 1),
                                        ("__truediv__", 1, 1), ("__lt__", 1, 1), ("__neg__", 0, 0)])  # fmt: skip
        getattr(x, method)(*[_draw(rng, tensors, foreign, g) for _ in range(rng.randint(low, high))])
    else:
        method, arity = rng.choice([("input", 3), ("parameter", 3), ("state", 3), ("constant", 2), ("output", 2),
                                    ("assign", 2), ("scope", 1)])  # fmt: skip
        args = [_draw(rng, tensors, foreign, g) for _ in range(arity)]
        if method == "scope":
            with g.scope(*args):
                pass
        else:
            getattr(g, method)(*args)


def test_builders_with_random_arguments_raise_only_megaloop_errors() -> None:
    rng = random.Random(23)
    foreign = ml.Graph("other").input("o", (2, 4), ml.float32)
    cases = refused = 0
    with deadline(60, "builder fuzzing"):
        for _ in range(60):
            g, tensors = _graph(rng)
            for _ in range(60):
                before = len(g.nodes)
                try:
                    _call(rng, g, tensors, foreign)
                except ml.MegaloopError:
                    refused += 1
                    assert len(g.nodes) == before, "a refused call left nodes behind"
                except Exception as e:
                    raise AssertionError(f"case {cases}: a non-megaloop {type(e).__name__}: {e}") from e
                cases += 1
            g.validate()
    assert cases >= 3600 and refused > cases // 2, (cases, refused)


# ---- plan files ---------------------------------------------------------------------------------------


def _small_plan() -> Any:
    from megaloop.plan import make_plan

    g = ml.Graph("f")
    x = g.input("x", (4, 8), ml.float32)
    c = g.state("c", (1, 1, 4, 8), ml.float32)
    y = ml.rmsnorm(ml.linear(x, g.parameter("w", (8, 8), ml.float32)), eps=1e-5)
    ml.kv_cache_update(c, y.reshape(1, 1, 4, 8), g.input("p", (1, 4), ml.int64))
    g.output("y", ml.softmax(y, axis=-1) + g.constant([1.0] * 8))
    return make_plan(g, processors=3, tiles={"matmul": {"block_m": 2}})


FEEDS = {"x": np.ones((4, 8)), "p": [[0, 1, 2, 3]]}
PLAN_VALUES: list[Any] = [
    None, True, False, 0, -1, 1, 2, 7, 10**20, -(10**20), 1.5, math.nan, "", "x", "sum", [], [0], [1, 2], {},
    {"tuple": [1]}, {"dtype": "float32"}, {"dtype": "nope"}, {"array": [1], "dtype": "int32", "shape": [1]}, 2**31,
    2**63,
]  # fmt: skip


def _paths(obj: Any, path: tuple = ()) -> list[tuple]:
    out = [path]
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else []
    for k, v in items:
        out += _paths(v, (*path, k))
    return out


def _mutate(rng: random.Random, text: bytes, paths: list[tuple]) -> dict:
    d = json.loads(text)  # a fresh copy, faster than deepcopy
    path = rng.choice(paths[1:])
    parent = d
    for k in path[:-1]:
        parent = parent[k]
    roll, old = rng.random(), parent[path[-1]]
    if roll < 0.2:
        del parent[path[-1]]
    elif roll < 0.4 and isinstance(old, int) and not isinstance(old, bool):
        parent[path[-1]] = old + rng.choice([-2, -1, 1, 5])
    elif roll < 0.5 and isinstance(old, list) and old:
        old.append(copy.deepcopy(rng.choice(old)))
    else:
        parent[path[-1]] = copy.deepcopy(rng.choice(PLAN_VALUES))
    return d


def _loads_or_refuses(load: Any, what: str) -> Any:
    try:
        return load()
    except ml.MegaloopError:
        return None
    except Exception as e:
        raise AssertionError(f"{what}: a non-megaloop {type(e).__name__}: {e}") from e


def test_mutated_plan_files_raise_only_megaloop_errors(scratch: Path) -> None:
    from megaloop.plan import Plan
    from megaloop.plan.format import plan_from_dict, plan_to_dict
    from megaloop.reference.interpreter import run_plan

    data = plan_to_dict(_small_plan())
    text = json.dumps(data).encode()
    paths = _paths(data)
    rng = random.Random(7)
    loaded = 0
    with deadline(60, "plan file fuzzing"):
        for i in range(1200):  # fields: each mutated plan is refused, or it loads and runs
            plan = _loads_or_refuses(lambda: plan_from_dict(_mutate(rng, text, paths)), f"field case {i}")
            if plan is not None:
                loaded += 1
                run = lambda plan=plan: run_plan(plan, FEEDS, {"w": np.eye(8)})
                _loads_or_refuses(run, f"running field case {i}")
        for i in range(1200):  # bytes: flipped, truncated, inserted
            raw = bytearray(text)
            roll = rng.random()
            if roll < 0.5:
                for _ in range(rng.randrange(1, 4)):
                    raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
            elif roll < 0.8:
                del raw[rng.randrange(len(raw)) :]
            else:
                at = rng.randrange(len(raw))
                raw[at:at] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 6)))
            (scratch / "p.json").write_bytes(bytes(raw))
            _loads_or_refuses(lambda: Plan.load(scratch / "p.json"), f"byte case {i}")
    assert 0 < loaded < 1200, loaded


# ---- safetensors --------------------------------------------------------------------------------------

ST_VALUES: list[Any] = [
    None, True, 0, -1, 1, 10**30, 1.5, "F32", "BF16", "I64", "X", [], [0], [0, 10**30], [5, 2], [-1, 4], {}, [1, 2, 3],
    ["a"], 2**63, [0, 0], [3, 4], [48, 52],
]  # fmt: skip


def _header_mutation(rng: random.Random, header: dict) -> dict:
    h = copy.deepcopy(header)
    name = rng.choice(list(h))
    roll = rng.random()
    if roll < 0.15:
        h[name] = copy.deepcopy(rng.choice(ST_VALUES))
    elif roll < 0.3:
        h[rng.choice(["__metadata__", "zz"])] = copy.deepcopy(rng.choice(ST_VALUES))
    elif isinstance(h[name], dict):
        key = rng.choice(["dtype", "shape", "data_offsets", "extra"])
        if rng.random() < 0.3:
            h[name].pop(key, None)
        else:
            h[name][key] = copy.deepcopy(rng.choice(ST_VALUES))
    return h


def test_damaged_safetensors_files_raise_only_megaloop_errors(scratch: Path) -> None:
    from megaloop.models import write_safetensors
    from megaloop.models.checkpoint import read_safetensors

    path, bad = scratch / "m.safetensors", scratch / "bad.safetensors"
    write_safetensors(path, {
        "a": np.arange(12, dtype=np.float32).reshape(3, 4),
        "b": np.ones((2,), ml_dtypes.bfloat16),
        "c": np.zeros((1, 2, 2), np.float16),
    })  # fmt: skip
    orig = path.read_bytes()
    n = int.from_bytes(orig[:8], "little")
    header, data = json.loads(orig[8 : 8 + n]), orig[8 + n :]
    rng = random.Random(11)
    read = 0

    def attempt(raw: bytes, what: str) -> None:
        nonlocal read
        bad.write_bytes(raw)
        tensors = _loads_or_refuses(lambda: read_safetensors(bad), what)
        if tensors is not None:  # what reads must be usable: every byte inside the file
            read += 1
            for v in tensors.values():
                np.asarray(v, dtype=np.float64 if v.dtype.kind == "f" or v.dtype == ml_dtypes.bfloat16 else None).sum()

    with deadline(60, "safetensors fuzzing"):
        for i in range(1100):
            raw = bytearray(orig)
            for _ in range(rng.randrange(1, 4)):
                raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
            attempt(bytes(raw), f"flip case {i}")
        for i in range(1100):
            attempt(orig[: rng.randrange(len(orig))], f"truncation case {i}")
        for i in range(1100):
            length = rng.choice([rng.randrange(2**64), rng.randrange(n + 64), 0, n - 1, n + 1])
            attempt(length.to_bytes(8, "little") + orig[8:], f"length case {i}")
        for i in range(1100):
            text = json.dumps(_header_mutation(rng, header)).encode()
            attempt(len(text).to_bytes(8, "little") + text + data, f"header case {i}")
    assert read > 100, read


@pytest.mark.parametrize("seed", range(2))
def test_damaged_index_files_raise_only_megaloop_errors(scratch: Path, seed: int) -> None:
    from megaloop.models import write_safetensors
    from megaloop.models.checkpoint import read_index

    write_safetensors(scratch / "a.safetensors", {"x": np.ones(2, np.float32)})
    index = json.dumps({"metadata": {"total_size": 8}, "weight_map": {"x": "a.safetensors"}}).encode()
    rng = random.Random(seed)
    for i in range(600):
        raw = bytearray(index)
        if rng.random() < 0.6:
            raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        else:
            del raw[rng.randrange(len(raw)) :]
        (scratch / "i.json").write_bytes(bytes(raw))
        _loads_or_refuses(lambda: read_index(scratch / "i.json"), f"index case {i}")

"""Plans of identical graphs, cached on disk as compiled kernels are (megaloop/runtime/compile.py).

Planning a Llama-3.1-8B-sized generator takes tens of seconds; the plan of the same graph with the
same settings is the same plan, so it is kept. An entry's key hashes the graph's content (its JSON,
the one plan files embed: ops, shapes, attributes, names), the planning settings, the plan format's
version, megaloop's version and the source of the code that makes plans (frontend, parallel, fuse, plan):
a change to the planner makes new entries rather than reusing stale ones. Entries are written
atomically and carry a digest of their bytes; one that is unreadable or damaged is planned again
and overwritten. They are pickles, not plan JSON, which an 8B model's prefill plan reads back from
many times slower (its schema checks and tiling re-derivation); like the kernel cache, the folder
holds what this user's megaloop wrote and runs. The folder, its size cap and least-recently-used
eviction are megaloop/diskcache.py's.

    plan, hit = load_or_make_plan(graph, processors=132, arch="sm_90")
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import tempfile
import zlib
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from megaloop import diskcache
from megaloop.dtypes import DType, as_dtype
from megaloop.errors import GraphBuildError
from megaloop.frontend.graph import Graph
from megaloop.frontend.opdef import REGISTRY, OpDef
from megaloop.frontend.serialize import graph_to_dict
from megaloop.plan.build import collector_paused, make_plan
from megaloop.plan.model import FORMAT, VERSION, Plan, Task, Wait
from megaloop.plan.programs import MAX_PROGRAMS, join_programs

PACKAGE = Path(__file__).resolve().parent.parent
PLANNER_SOURCES = ("frontend", "parallel", "fuse", "plan", "dtypes.py", "errors.py", "__init__.py")
HEADER = b"megaloop plan cache, zlib, sha256 "  # (a pickle compresses ~27x: a 1B step's 23 MB to 0.8)


PLANS = diskcache.PLANS  # entries <key>.plan


def plan_cache_dir() -> Path:
    """``$MEGALOOP_CACHE/plans`` (default ``~/.cache/megaloop/plans``), beside the kernel cache; made
    if need be (CacheError when it cannot be, naming the variable)."""
    return diskcache.folder(PLANS)


@cache
def planner_digest() -> str:
    """A hash of megaloop's version and of the source files plans are made by."""
    h = hashlib.sha256()
    for name in PLANNER_SOURCES:
        path = PACKAGE / name
        for file in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            h.update(str(file.relative_to(PACKAGE)).encode())
            h.update(file.read_bytes())
    return h.hexdigest()


def plan_key(graphs: Graph | Sequence[Graph], settings: dict[str, Any]) -> str:
    """The cache key of planning ``graphs`` with ``make_plan``'s keyword ``settings``."""
    glist = [graphs] if isinstance(graphs, Graph) else list(graphs)
    h = hashlib.sha256()
    h.update(f"{FORMAT} {VERSION} {planner_digest()}\0".encode())
    h.update(json.dumps(settings, sort_keys=True, default=repr).encode() + b"\0")
    for g in glist:
        h.update(json.dumps(graph_to_dict(g), sort_keys=True, separators=(",", ":")).encode() + b"\0")
    return h.hexdigest()


def load_or_make_plan(graphs: Graph | Sequence[Graph], *, use_cache: bool = True, **settings: Any) -> tuple[Plan, bool]:
    """``make_plan(graphs, **settings)``, or the same plan from the cache; and whether it was."""
    if not use_cache:
        return make_plan(graphs, **settings), False
    path = plan_cache_dir() / f"{plan_key(graphs, {k: v for k, v in settings.items() if k != 'verify'})}.plan"
    plan = _read(path)
    if plan is not None:
        diskcache.touch(path)  # used now: the last to be evicted
        return plan, True
    plan = make_plan(graphs, **settings)
    _write(path, plan)
    return plan, False


def _op(name: str) -> OpDef:
    return REGISTRY[name]


class _Pickler(pickle.Pickler):
    """Ops and dtypes by name: the loaded plan's nodes refer to the registry's own OpDefs (code
    compares them by identity), never to copies. A dispatch table, not ``persistent_id``: that
    would be a Python call for each of a large plan's millions of objects."""

    def __init__(self, file: Any) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.dispatch_table = {
            OpDef: lambda op: (_op, (op.name,)),
            DType: lambda dt: (as_dtype, (dt.name,)),
            Task: _pack_task,
        }


def _pack_task(t: Task) -> tuple[Any, tuple[dict[str, Any], bytes]]:
    """A task with its waits as one array's bytes: pickling each Wait tuple took seconds for the
    8B prefill's 1.17M of them."""
    state = {k: v for k, v in t.__dict__.items() if k != "waits"}
    return _task, (state, np.array(t.waits, np.int64).reshape(-1, 3).tobytes())


def _task(state: dict[str, Any], waits: bytes) -> Task:
    t = Task.__new__(Task)
    t.__dict__.update(state)
    t.waits = list(map(Wait._make, np.frombuffer(waits, np.int64).reshape(-1, 3).tolist()))
    return t


class _Unpickler(pickle.Unpickler):
    pass


def _read(path: Path) -> Plan | None:
    try:
        data = path.read_bytes()
    except OSError:
        return None
    head, _, body = data.partition(b"\n")
    if head != HEADER + hashlib.sha256(body).hexdigest().encode():
        path.unlink(missing_ok=True)  # damaged or not ours: plan again
        return None
    try:
        with collector_paused():
            plan = _Unpickler(io.BytesIO(zlib.decompress(body))).load()
    except Exception:  # anything unpickling can raise: the entry is of no use
        path.unlink(missing_ok=True)
        return None
    return plan if isinstance(plan, Plan) else None


def _write(path: Path, plan: Plan) -> None:
    """Atomically (temporary file + rename), then the cache trimmed to its size cap. A failed write
    (a full disk) only costs planning again; a folder that cannot be written is a CacheError."""
    buffer = io.BytesIO()
    with collector_paused():
        _Pickler(buffer).dump(plan)
    body = zlib.compress(buffer.getvalue(), 1)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(HEADER + hashlib.sha256(body).hexdigest().encode() + b"\n" + body)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except PermissionError as e:
        raise diskcache.cache_error(f"cannot write in {path.parent} ({e.strerror or e})") from None
    except OSError:
        return
    diskcache.evict(keep=path)


def make_programs(programs: Mapping[str, Graph | Sequence[Graph]], *, use_cache: bool = False,
                  **settings: Any) -> Plan:  # fmt: skip
    """One plan holding a program per entry of ``programs`` (name -> a graph, or one graph per rank),
    each planned with make_plan's keyword ``settings``; the first is the plan returned, the others
    its ``others``. ``use_cache``: each program from the plan cache (megaloop/plan/cache.py)."""
    if not isinstance(programs, Mapping) or not programs:
        raise GraphBuildError(f"make_programs: expected a dict of program name -> graph(s), got {programs!r:.80}")
    if len(programs) > MAX_PROGRAMS:
        raise GraphBuildError(f"make_programs: {len(programs)} programs; a loop kernel holds at most {MAX_PROGRAMS}")
    plans = []
    for name, graphs in programs.items():
        if not isinstance(name, str) or not name:
            raise GraphBuildError(f"make_programs: program names must be non-empty strings, got {name!r}")
        if use_cache:
            plan, _ = load_or_make_plan(graphs, use_cache=True, **settings)
        else:
            plan = make_plan(graphs, **settings)
        plan.name = name
        plans.append(plan)
    return join_programs(plans)

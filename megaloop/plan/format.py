"""Plans as versioned JSON (``docs/plan-format.md``): save, load with a schema check that names the
offending field, and ``rederive`` after hand edits (new tile sizes, reordered task lists)."""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from megaloop.dtypes import as_dtype
from megaloop.errors import MegaloopError, PlanError, PlanFormatError
from megaloop.frontend.opdef import REGISTRY
from megaloop.frontend.serialize import graph_from_dict, graph_to_dict
from megaloop.frontend.tiling import Box
from megaloop.frontend.validate import MAX_ARENA_BYTES
from megaloop.fuse.options import FuseOptions
from megaloop.parallel.ranks import match_ranks
from megaloop.plan.build import check_settings
from megaloop.plan.edit import check_structure, check_tasks_match_tiles, rederive_plan
from megaloop.plan.model import (
    ABSENT_OPTIONS,
    BUFFER_KINDS,
    FORMAT,
    VERSION,
    Access,
    Buffer,
    Counter,
    KernelOptions,
    Plan,
    PlanOp,
    PlanTensor,
    RankPlan,
    Task,
    Wait,
)
from megaloop.plan.verify import verify_plan


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "version": VERSION,
        "arch": plan.arch,
        "processors": plan.processors,
        "warps": plan.warps,
        "shared_memory": plan.shared_memory,
        "overrides": plan.overrides,
        "options": dataclasses.asdict(plan.options),
        "fusion": plan.fusion.to_dict(),
        "estimated_ns": plan.estimated_ns,
        "ranks": [_rank_to_dict(rp) for rp in plan.ranks],
        "name": plan.name,
        "others": [plan_to_dict(p) for p in plan.others],
    }


def _access(a: Access) -> list[Any]:
    return [a.tensor, a.rank, list(a.box.lo), list(a.box.hi)]


def _rank_to_dict(rp: RankPlan) -> dict[str, Any]:
    return {
        "rank": rp.rank,
        "graph": graph_to_dict(rp.graph),
        "arena_bytes": rp.arena_bytes,
        "buffers": [
            {
                "id": b.id,
                "name": b.name,
                "kind": b.kind,
                "offset": b.offset,
                "nbytes": b.nbytes,
                "shape": list(b.shape),
                "peer": b.peer,
            }
            for b in rp.buffers
        ],
        "tensors": [
            {
                "id": t.id,
                "name": t.name,
                "dtype": t.dtype.name,
                "shape": list(t.shape),
                "buffer": t.buffer,
                "strides": list(t.strides),
                "offset": t.offset,
            }
            for t in rp.tensors
        ],
        "ops": [
            {
                "id": o.id,
                "name": o.name,
                "op": o.op,
                "node": o.node,
                "inputs": o.inputs,
                "outputs": o.outputs,
                "tile": o.tile,
                "seq": o.seq,
            }
            for o in rp.ops
        ],
        "tasks": [
            {
                "id": t.id,
                "name": rp.task_name(t),
                "op": t.op,
                "coords": list(t.coords),
                "reads": [_access(a) for a in t.reads],
                "writes": [_access(a) for a in t.writes],
                "flops": t.flops,
                "bytes": t.bytes,
                "cost_ns": t.cost_ns,
                "signal": t.signal,
                "waits": [[w.rank, w.counter, w.lag] for w in t.waits],
            }
            for t in rp.tasks
        ],
        "counters": [{"id": c.id, "name": c.name} for c in rp.counters],
        "processors": rp.processors,
    }


def save(plan: Plan, path: str | os.PathLike, *, overwrite: bool = True) -> None:
    """Write atomically: a crash mid-write never leaves a truncated plan behind. ``overwrite=False``
    refuses to replace an existing file. Errors (PlanError) name the file and what to do."""
    try:
        path = Path(path)
    except TypeError:
        raise PlanError(f"plan.save: path must be a file name, got {type(path).__name__} {path!r:.60}") from None
    if not path.parent.is_dir():
        raise PlanError(f"plan.save: cannot write {path}: the folder {path.parent} does not exist; create it first")
    if path.is_dir():
        raise PlanError(f"plan.save: {path} is a folder; give a file name, e.g. {path / 'plan.json'}")
    if not overwrite and path.exists():
        raise PlanError(f"plan.save: {path} exists; pass overwrite=True to replace it")
    text = json.dumps(plan_to_dict(plan), indent=1)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    except OSError as e:
        raise PlanError(f"plan.save: cannot write {path}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes the file private; a plan is an ordinary file
        if overwrite:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)  # fails if the file appeared meanwhile: never replaces it
            Path(tmp).unlink()
    except FileExistsError:
        Path(tmp).unlink(missing_ok=True)
        raise PlanError(f"plan.save: {path} exists; pass overwrite=True to replace it") from None
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise PlanError(f"plan.save: cannot write {path}: {e.strerror or e}") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load(path: str | os.PathLike, *, rederive: bool = False, verify: bool = True) -> Plan:
    """Read a plan file. With ``rederive=True`` the tasks are regenerated from each op's (possibly
    edited) tile parameters and counters and waits are derived again for the (possibly edited)
    processor lists; otherwise the file must already be consistent. Either way it is verified.
    Every problem is a PlanError naming the file (and the field: ``plan.ranks[0].tasks[3].waits``)."""
    data = _read_json(path)
    try:
        return plan_from_dict(data, rederive=rederive, verify=verify)
    except PlanError as e:
        raise type(e)(f"{path}: {e}") from None


def _read_json(path: Any) -> Any:
    try:
        raw = Path(path).read_bytes()
    except TypeError:
        raise PlanFormatError(f"Plan.load: path must be a file name, got {type(path).__name__} {path!r:.60}") from None
    except FileNotFoundError:
        raise PlanFormatError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise PlanFormatError(f"{path}: is a folder, not a plan file") from None
    except OSError as e:
        raise PlanFormatError(f"{path}: cannot read it ({e.strerror or e})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PlanFormatError(
            f"{path}: not a plan file: byte {e.start} is not UTF-8 text (a plan is JSON written by plan.save)"
        ) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise PlanFormatError(f"{path}: not JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    except RecursionError:
        raise PlanFormatError(f"{path}: not a plan file: JSON nested too deeply") from None


class _Reader:
    """Typed field access that names the path of what is wrong."""

    def __init__(self, obj: Any, path: str) -> None:
        self.obj, self.path = obj, path

    def get(self, key: str | int, kind: type | tuple[type, ...], *, minimum: int | None = None) -> Any:
        where = f"{self.path}.{key}" if isinstance(key, str) else f"{self.path}[{key}]"
        try:
            value = self.obj[key]
        except (KeyError, IndexError, TypeError):
            raise PlanFormatError(f"{where}: missing") from None
        if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
            raise PlanFormatError(f"{where}: expected {_kind_name(kind)}, got a bool")
        if not isinstance(value, kind):
            raise PlanFormatError(f"{where}: expected {_kind_name(kind)}, got {type(value).__name__} {value!r:.60}")
        if minimum is not None and value < minimum:
            raise PlanFormatError(f"{where}: must be >= {minimum}, got {value}")
        return value

    def at(self, key: str | int, kind: type = dict) -> _Reader:
        value = self.get(key, kind)
        return _Reader(value, f"{self.path}.{key}" if isinstance(key, str) else f"{self.path}[{key}]")

    def items(self, key: str) -> list[_Reader]:
        lst = self.get(key, list)
        return [_Reader(v, f"{self.path}.{key}[{i}]") for i, v in enumerate(lst)]

    def ints(self, key: str | int, *, minimum: int | None = None) -> list[int]:
        lst = self.get(key, list)
        where = f"{self.path}.{key}" if isinstance(key, str) else f"{self.path}[{key}]"
        for i, v in enumerate(lst):
            if isinstance(v, bool) or not isinstance(v, int) or (minimum is not None and v < minimum):
                raise PlanFormatError(
                    f"{where}[{i}]: expected an int{f' >= {minimum}' if minimum is not None else ''}, got {v!r:.40}"
                )
        return lst


def _kind_name(kind: type | tuple[type, ...]) -> str:
    names = {
        int: "an int",
        str: "a string",
        list: "a list",
        dict: "an object",
        float: "a number",
        bool: "a bool",
        type(None): "null",
    }
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def plan_from_dict(data: dict[str, Any], *, rederive: bool = False, verify: bool = True) -> Plan:
    """A plan from its JSON form, checked field by field (PlanFormatError naming the field), then
    structurally against its graphs, re-derived if asked, and verified."""
    try:
        return _plan_from_dict(data, rederive, verify)
    except MegaloopError:
        raise
    except (RecursionError, MemoryError):
        raise PlanFormatError("plan: too large or too deeply nested to be a plan") from None
    except Exception as e:  # a combination of fields no check above anticipated: still the file's fault
        raise PlanFormatError(
            f"plan: its fields do not fit together ({type(e).__name__}: {e}); was it edited by hand? "
            "(if megaloop wrote it as it is, this is a megaloop bug: please report it)"
        ) from e


def _plan_from_dict(data: dict[str, Any], rederive: bool, verify: bool, path: str = "plan") -> Plan:
    if not isinstance(data, dict):
        raise PlanFormatError(f"plan: expected a JSON object, got {type(data).__name__}")
    root = _Reader(data, path)
    if root.get("format", str) != FORMAT:
        raise PlanFormatError(f"plan.format: expected {FORMAT!r}, got {data.get('format')!r}")
    version = root.get("version", int)
    if version != VERSION:
        raise PlanFormatError(
            f"plan.version: this megaloop reads version {VERSION}, the file is version {version}"
            + (" (made by an older megaloop; plan its graph again)" if version < VERSION else "")
        )
    plan = Plan(
        arch=root.get("arch", str),
        processors=root.get("processors", int, minimum=1),
        warps=root.get("warps", int, minimum=1),
        shared_memory=root.get("shared_memory", int, minimum=0),
        ranks=[],
        overrides=root.get("overrides", dict),
        options=_options(root.at("options")),
        fusion=_fusion(root.at("fusion")),
        estimated_ns=float(root.get("estimated_ns", (int, float))),
    )
    check_settings(plan.arch, plan.processors, plan.warps, plan.shared_memory, PlanFormatError, "plan")
    ranks = root.items("ranks")
    if not ranks:
        raise PlanFormatError("plan.ranks: a plan needs at least one rank")
    for r, rr in enumerate(ranks):
        plan.ranks.append(_rank_from(rr, r))
    try:
        plan.matching = match_ranks([rp.graph for rp in plan.ranks])
    except MegaloopError as e:
        raise PlanFormatError(f"plan.ranks[*].graph: the graphs do not fit together: {e}") from None
    _link_graph_tensors(plan)
    check_structure(plan)
    if rederive:
        plan = rederive_plan(plan)
    else:
        check_tasks_match_tiles(plan)
    plan.name = root.get("name", str)
    others = root.items("others")
    if path != "plan" and others:
        raise PlanFormatError(f"{path}.others: only the first program holds the others")
    plan.others = [_plan_from_dict(o.obj, rederive, False, o.path) for o in others]
    if verify:
        verify_plan(plan)
    return plan


def _options(r: _Reader) -> KernelOptions:
    fields = [f.name for f in dataclasses.fields(KernelOptions)]
    unknown = sorted(set(r.obj) - set(fields))
    if unknown:
        raise PlanFormatError(f"{r.path}: unknown option {unknown[0]!r}; the options are {fields}")
    # an option a plan file lacks came later: its kernel was built without it
    present = {name: r.get(name, int) for name in fields if name in r.obj}
    options = KernelOptions(**{**ABSENT_OPTIONS, **present})
    options.check(PlanFormatError, r.path)
    return options


def _fusion(r: _Reader) -> FuseOptions:
    unknown = sorted(set(r.obj) - {"enabled", "off", "on"})
    if unknown:
        raise PlanFormatError(f"{r.path}: unknown field {unknown[0]!r}; fusion has 'enabled', 'off' and 'on'")
    names = {}
    for key in ("off", "on"):
        names[key] = r.get(key, list)
        if not all(isinstance(name, str) for name in names[key]):
            raise PlanFormatError(f"{r.path}.{key}: expected a list of rule names, got {names[key]!r:.80}")
    fusion = FuseOptions(r.get("enabled", bool), tuple(names["off"]), tuple(names["on"]))
    fusion.check(PlanFormatError, r.path)
    return fusion


def _rank_from(rr: _Reader, r: int) -> RankPlan:
    if rr.get("rank", int) != r:
        raise PlanFormatError(f"{rr.path}.rank: expected {r} (ranks are listed in order)")
    try:
        graph = graph_from_dict(rr.get("graph", dict))
    except MegaloopError as e:
        raise PlanFormatError(f"{rr.path}.graph: {e}") from None
    buffers = []
    for i, b in enumerate(rr.items("buffers")):
        kind = b.get("kind", str)
        if kind not in BUFFER_KINDS:
            raise PlanFormatError(f"{b.path}.kind: expected one of {BUFFER_KINDS}, got {kind!r}")
        _check_id(b, i)
        buffers.append(
            Buffer(
                i,
                b.get("name", str),
                kind,
                b.get("offset", int, minimum=0),
                b.get("nbytes", int, minimum=0),
                tuple(b.ints("shape", minimum=1)),
                b.get("peer", bool),
            )
        )
    tensors = []
    for i, t in enumerate(rr.items("tensors")):
        _check_id(t, i)
        try:
            dtype = as_dtype(t.get("dtype", str))
        except MegaloopError as e:
            raise PlanFormatError(f"{t.path}.dtype: {e}") from None
        shape = tuple(t.ints("shape", minimum=1))
        strides = tuple(t.ints("strides"))
        if len(strides) != len(shape):
            raise PlanFormatError(f"{t.path}.strides: needs one stride per axis ({len(shape)})")
        buf = t.get("buffer", int, minimum=0)
        if buf >= len(buffers):
            raise PlanFormatError(f"{t.path}.buffer: buffer {buf} does not exist ({len(buffers)} buffers)")
        tensors.append(PlanTensor(i, t.get("name", str), dtype, shape, buf, strides, t.get("offset", int)))
    ops = []
    for i, o in enumerate(rr.items("ops")):
        _check_id(o, i)
        node = o.get("node", (int, type(None)))
        for key in ("inputs", "outputs"):
            for tid in o.ints(key, minimum=0):
                if tid >= len(tensors):
                    raise PlanFormatError(f"{o.path}.{key}: tensor {tid} does not exist")
        tile = o.get("tile", dict)
        opdef = REGISTRY.get(o.get("op", str))
        for k, v in tile.items():
            lo = opdef.tiling.minimum(k) if opdef is not None and opdef.tiling is not None else 1
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise PlanFormatError(f"{o.path}.tile.{k}: expected an int >= {lo}, got {v!r}")
        if node is not None and not 0 <= node < len(graph.nodes):
            raise PlanFormatError(f"{o.path}.node: graph node {node} does not exist")
        attrs = dict(graph.nodes[node].attrs) if node is not None else {}
        ops.append(
            PlanOp(
                i,
                o.get("name", str),
                o.get("op", str),
                node,
                o.ints("inputs"),
                o.ints("outputs"),
                attrs,
                dict(tile),
                o.get("seq", int, minimum=0),
            )
        )
    counters = []
    for i, c in enumerate(rr.items("counters")):
        _check_id(c, i)
        counters.append(Counter(i, c.get("name", str)))
    tasks = []
    for i, t in enumerate(rr.items("tasks")):
        _check_id(t, i)
        op = t.get("op", int, minimum=0)
        if op >= len(ops):
            raise PlanFormatError(f"{t.path}.op: op {op} does not exist")
        waits = []
        for w in t.items("waits"):
            rank, counter, lag = (w.get(k, int, minimum=0) for k in range(3))
            waits.append(Wait(rank, counter, lag))
        tasks.append(
            Task(
                i,
                op,
                tuple(t.ints("coords")),
                _accesses(t, "reads"),
                _accesses(t, "writes"),
                t.get("flops", int, minimum=0),
                t.get("bytes", int, minimum=0),
                float(t.get("cost_ns", (int, float), minimum=0)),
                t.get("signal", int, minimum=0),
                waits,
            )
        )
    lists = _Reader(rr.get("processors", list), f"{rr.path}.processors")
    processors = [lists.ints(p, minimum=0) for p in range(len(lists.obj))]
    arena = rr.get("arena_bytes", int, minimum=0)
    if arena > MAX_ARENA_BYTES:
        raise PlanFormatError(f"{rr.path}.arena_bytes: {arena} is above the 2^48 bytes a megaloop plan addresses")
    return RankPlan(r, graph, tensors, buffers, ops, tasks, counters, processors, arena)


def _check_id(item: _Reader, expected: int) -> None:
    if item.get("id", int) != expected:
        raise PlanFormatError(f"{item.path}.id: expected {expected} (entries are listed in id order)")


def _accesses(t: _Reader, key: str) -> list[Access]:
    out = []
    for a in t.items(key):
        tensor, rank = a.get(0, int, minimum=0), a.get(1, int, minimum=0)
        lo, hi = tuple(a.ints(2, minimum=0)), tuple(a.ints(3, minimum=0))
        if len(lo) != len(hi):
            raise PlanFormatError(f"{a.path}: box bounds {list(lo)} and {list(hi)} differ in length")
        out.append(Access(tensor, Box(lo, hi), rank))
    return out


def _link_graph_tensors(plan: Plan) -> None:
    """Graph tensors get the plan tensor ids they had when planned (same traversal as planning)."""
    for r, rp in enumerate(plan.ranks):
        i = 0
        for node in rp.graph.topological_order():
            for t in node.outputs:
                if i >= len(rp.tensors) or rp.tensors[i].shape != t.shape or rp.tensors[i].dtype != t.dtype:
                    raise PlanFormatError(
                        f"plan.ranks[{r}].tensors[{i}]: does not match graph tensor {t.name!r} "
                        f"({t.dtype.short}{list(t.shape)})"
                    )
                rp.tensor_of[t] = i
                i += 1

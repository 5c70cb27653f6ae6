"""Bad files: plan files (reading and writing), safetensors checkpoints and their index, and the
``megaloop`` command's options. Each row: what to do in a fresh folder, the error, words it must say."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import megaloop as ml
from megaloop.errors import CheckpointError, DeadlockError, PlanError, PlanFormatError
from tests.bad_input import Case, CliFailure, check, check_cli, cli, graph, params


@functools.cache
def _plan_dict() -> str:
    from megaloop.plan import make_plan
    from megaloop.plan.format import plan_to_dict

    g = graph("small")
    x = g.input("x", (8, 8), ml.float32)
    y = ml.matmul(x, g.parameter("w", (8, 8), ml.float32))
    q = y.reshape(1, 1, 8, 8)
    g.output("y", ml.softmax(ml.attention(q, q, q, causal=True), axis=-1) + ml.exp(x).reshape(1, 1, 8, 8))
    return json.dumps(plan_to_dict(make_plan(g, processors=2, tiles={"exp": {"elements": 16}})))


def _node(d: dict, op: str) -> dict:
    return next(n for n in d["ranks"][0]["graph"]["nodes"] if n["op"] == op)


def _load_edited(tmp: Path, edit, *, rederive: bool = False) -> None:
    from megaloop.plan import Plan

    d = json.loads(_plan_dict())
    edit(d)
    (tmp / "edited.json").write_text(json.dumps(d))
    Plan.load(tmp / "edited.json", rederive=rederive)


def _load_bytes(tmp: Path, data: bytes) -> None:
    from megaloop.plan import Plan

    (tmp / "p.json").write_bytes(data)
    Plan.load(tmp / "p.json")


def _load(path) -> None:
    from megaloop.plan import Plan

    Plan.load(path)


def _save(tmp: Path, where, **kw) -> None:
    from megaloop.plan.format import plan_from_dict

    plan_from_dict(json.loads(_plan_dict())).save(where(tmp), **kw)


def _reorder(d: dict) -> None:
    lists = d["ranks"][0]["processors"]
    d["ranks"][0]["processors"] = [[t for lst in lists for t in lst][::-1], []]


def _attr(op: str, key: str, value):
    return lambda d: _node(d, op)["attrs"].__setitem__(key, value)


def _existing(tmp: Path) -> Path:
    (tmp / "keep.json").write_text("mine")
    return tmp / "keep.json"


def P(id, call, error, *words, found=False):  # a table row
    return Case(id, call, error, words, found)


PLAN_FILES = [
    P("load-missing-file", lambda t: _load(t / "nope.json"), PlanFormatError, "nope.json", "no such file", found=True),
    P("load-a-folder", lambda t: _load(t), PlanFormatError, "folder", found=True),
    P("load-non-utf8", lambda t: _load_bytes(t, b"\xff\xfe\x00{}"), PlanFormatError, "UTF-8", "p.json", found=True),
    P("load-empty-file", lambda t: _load_bytes(t, b""), PlanFormatError, "not JSON"),
    P("load-truncated", lambda t: _load_bytes(t, _plan_dict()[:500].encode()), PlanFormatError, "not JSON", "line"),
    P("load-a-json-list", lambda t: _load_bytes(t, b"[1, 2]"), PlanFormatError, "JSON object"),
    P("load-a-json-number", lambda t: _load_bytes(t, b"7"), PlanFormatError, "JSON object"),
    P("load-not-a-plan", lambda t: _load_bytes(t, b'{"hello": 1}'), PlanFormatError, "plan.format"),
    P("load-deep-json", lambda t: _load_bytes(t, b"[" * 100000 + b"]" * 100000), PlanFormatError, "p.json"),
    P("load-path-none", lambda t: _load(None), PlanFormatError, "path"),
    P("load-version-99", lambda t: _load_edited(t, lambda d: d.update(version=99)), PlanFormatError, "version"),
    P("load-processors-a-string", lambda t: _load_edited(t, lambda d: d.update(processors="x")), PlanFormatError),
    P(
        "load-processors-10^9",
        lambda t: _load_edited(t, lambda d: d.update(processors=10**9)),
        PlanFormatError,
        "resident",
    ),
    P(
        "attrs-causal-a-string",
        lambda t: _load_edited(t, _attr("attention", "causal", "false")),
        PlanFormatError,
        "attrs.causal",
        "true or false",
        found=True,
    ),
    P(
        "attrs-transpose-a-number",
        lambda t: _load_edited(t, _attr("matmul", "transpose_a", 1)),
        PlanFormatError,
        "transpose_a",
    ),
    P(
        "attrs-axis-a-string",
        lambda t: _load_edited(t, _attr("softmax", "axis", "0")),
        PlanFormatError,
        "axis",
        "an int",
    ),
    P("attrs-axis-huge", lambda t: _load_edited(t, _attr("softmax", "axis", 99)), PlanFormatError, "axis 99"),
    P("attrs-scale-a-list", lambda t: _load_edited(t, _attr("attention", "scale", [1])), PlanFormatError, "scale"),
    P("attrs-window-zero", lambda t: _load_edited(t, _attr("attention", "window", 0)), PlanFormatError, "window"),
    P("attrs-unknown", lambda t: _load_edited(t, _attr("exp", "fast", True)), PlanFormatError, "no attribute 'fast'"),
    P(
        "attrs-causal-missing",
        lambda t: _load_edited(t, lambda d: _node(d, "attention")["attrs"].pop("causal")),
        PlanFormatError,
        "attrs.causal",
        "needs the attribute 'causal'",
    ),
    P(
        "attrs-dtype-unknown",
        lambda t: _load_edited(t, _attr("input", "dtype", {"dtype": "float99"})),
        PlanFormatError,
        "float99",
    ),
    P("attrs-shape-a-list", lambda t: _load_edited(t, _attr("input", "shape", [8, 8])), PlanFormatError, "shape"),
    P("attrs-shape-negative", lambda t: _load_edited(t, _attr("input", "shape", {"tuple": [-8, 8]})), PlanFormatError),
    P("attrs-name-with-space", lambda t: _load_edited(t, _attr("input", "name", "a b")), PlanFormatError, "name"),
    P(
        "attrs-bad-encoding",
        lambda t: _load_edited(t, _attr("reshape", "shape", {"tuple": 5})),
        PlanFormatError,
        "encoding",
    ),
    P(
        "attrs-not-an-object",
        lambda t: _load_edited(t, lambda d: _node(d, "exp").__setitem__("attrs", [])),
        PlanFormatError,
        "attrs",
    ),
    P(
        "node-unknown-op",
        lambda t: _load_edited(t, lambda d: _node(d, "exp").__setitem__("op", "sinh")),
        PlanFormatError,
        "unknown op",
    ),
    P(
        "node-forward-input",
        lambda t: _load_edited(t, lambda d: _node(d, "exp")["inputs"].__setitem__(0, [99, 0])),
        PlanFormatError,
        "no earlier node",
    ),
    P(
        "node-input-not-a-pair",
        lambda t: _load_edited(t, lambda d: _node(d, "exp")["inputs"].__setitem__(0, 3)),
        PlanFormatError,
        "[node id, output index]",
    ),
    P(
        "node-label-a-number",
        lambda t: _load_edited(t, lambda d: _node(d, "exp").__setitem__("label", 3)),
        PlanFormatError,
        "label",
    ),
    P(
        "graph-output-missing-node",
        lambda t: _load_edited(t, lambda d: d["ranks"][0]["graph"]["outputs"].update(z=[99, 0])),
        PlanFormatError,
        "outputs.z",
    ),
    P(
        "graph-update-unknown-state",
        lambda t: _load_edited(t, lambda d: d["ranks"][0]["graph"]["state_updates"].update(s=[0, 0])),
        PlanFormatError,
        "no state 's'",
    ),
    P(
        "graph-nodes-a-dict",
        lambda t: _load_edited(t, lambda d: d["ranks"][0]["graph"].update(nodes={})),
        PlanFormatError,
        "nodes",
    ),
    P(
        "graph-rank-wrong",
        lambda t: _load_edited(t, lambda d: d["ranks"][0]["graph"].update(rank=3)),
        PlanFormatError,
        "rank",
    ),
    P(
        "tile-negative",
        lambda t: _load_edited(t, lambda d: d["ranks"][0]["ops"][0]["tile"].update(block_m=-1)),
        PlanFormatError,
        "tile.block_m",
    ),
    P(
        "task-box-a-string",
        lambda t: _load_edited(t, lambda d: d["ranks"][0]["tasks"][0]["reads"][0].__setitem__(2, "x")),
        PlanFormatError,
        "reads[0][2]",
    ),
    P(
        "task-op-missing",
        lambda t: _load_edited(t, lambda d: d["ranks"][0]["tasks"][0].update(op=999)),
        PlanFormatError,
        "op 999",
    ),
    P(
        "task-listed-twice",
        lambda t: _load_edited(t, lambda d: d["ranks"][0]["processors"][1].append(0)),
        PlanError,
        "twice",
    ),
    P(
        "buffer-offset-overlaps",
        lambda t: _load_edited(t, lambda d: [b.update(offset=0) for b in d["ranks"][0]["buffers"]]),
        PlanError,
        "",
    ),
    P("arena-too-small", lambda t: _load_edited(t, lambda d: d["ranks"][0].update(arena_bytes=8)), PlanError, "arena"),
    P(
        "rederive-reordered-task",
        lambda t: _load_edited(t, _reorder, rederive=True),
        DeadlockError,
        "edited.json",
        "processor 0",
        "position",
        found=True,
    ),
    P(
        "save-missing-folder",
        lambda t: _save(t, lambda t: t / "missing" / "dir" / "p.json"),
        PlanError,
        "does not exist",
        found=True,
    ),
    P("save-into-a-folder", lambda t: _save(t, lambda t: t), PlanError, "is a folder"),
    P("save-no-overwrite", lambda t: _save(t, _existing, overwrite=False), PlanError, "exists", "overwrite=True"),
    P("save-path-none", lambda t: _save(t, lambda t: None), PlanError, "path"),
]

# ---- safetensors ---------------------------------------------------------------------------------------


def _tensors():
    return {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones((2,), ml_dtypes.bfloat16)}


def _header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _file(tmp: Path, edit=None, raw=None, whole=None) -> Path:
    """The two-tensor file; ``edit`` changes its header in place, ``whole`` replaces it, ``raw`` the bytes."""
    from megaloop.models import write_safetensors

    path = tmp / "model.safetensors"
    write_safetensors(path, _tensors())
    if edit is not None or whole is not None:
        header, data = _header(path)
        if edit is not None:
            edit(header)
        text = json.dumps(header if whole is None else whole).encode()
        path.write_bytes(len(text).to_bytes(8, "little") + text + data)
    if raw is not None:
        path.write_bytes(raw(path.read_bytes()))
    return path


def _read(tmp: Path, edit=None, raw=None, whole=None) -> None:
    from megaloop.models.checkpoint import read_safetensors

    for v in read_safetensors(_file(tmp, edit, raw, whole)).values():
        np.asarray(v).sum()


def _set(name: str, key: str, value):
    return lambda h: h[name].__setitem__(key, value)


def _drop(name: str, key: str):
    return lambda h: h[name].__delitem__(key)


def _header_end(raw: bytes) -> int:
    return 8 + int.from_bytes(raw[:8], "little")


def _index(tmp: Path, text: bytes) -> None:
    from megaloop.models.checkpoint import read_index

    _file(tmp)
    (tmp / "model.safetensors.index.json").write_bytes(text)
    read_index(tmp / "model.safetensors.index.json")


def _load_folder(tmp: Path, index: bytes) -> None:
    from megaloop.models import load_llama

    (tmp / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 8,
                "num_attention_heads": 2,
                "intermediate_size": 16,
                "num_hidden_layers": 1,
                "vocab_size": 10,
            }
        )
    )
    _file(tmp)
    (tmp / "model.safetensors.index.json").write_bytes(index)
    load_llama(tmp)


C = CheckpointError
CHECKPOINTS = [
    P(
        "st-absurd-header-length",
        lambda t: _read(t, raw=lambda b: (2**60).to_bytes(8, "little") + b[8:]),
        C,
        "header length",
        found=True,
    ),
    P(
        "st-header-length-past-end",
        lambda t: _read(t, raw=lambda b: (len(b)).to_bytes(8, "little") + b[8:]),
        C,
        "header length",
    ),
    P(
        "st-truncated-after-header",
        lambda t: _read(t, raw=lambda b: b[: _header_end(b)]),
        C,
        "outside",
        "damaged",
        found=True,
    ),
    P("st-truncated-in-data", lambda t: _read(t, raw=lambda b: b[:-3]), C, "damaged"),
    P("st-truncated-in-header", lambda t: _read(t, raw=lambda b: b[:20]), C, "model.safetensors"),
    P("st-seven-bytes", lambda t: _read(t, raw=lambda b: b[:7]), C, "too short"),
    P("st-empty-file", lambda t: _read(t, raw=lambda b: b""), C, "too short"),
    P("st-header-a-list", lambda t: _read(t, whole=[1, 2]), C, "list", found=True),
    P("st-header-a-number", lambda t: _read(t, whole=5), C, "not an object"),
    P("st-header-not-utf8", lambda t: _read(t, raw=lambda b: b[:8] + b"\xff" + b[9:]), C, "UTF-8"),
    P("st-header-not-json", lambda t: _read(t, raw=lambda b: b[:8] + b"x" + b[9:]), C, "not JSON"),
    P("st-no-data-offsets", lambda t: _read(t, edit=_drop("a", "data_offsets")), C, "'a'", "data_offsets", found=True),
    P("st-no-dtype", lambda t: _read(t, edit=_drop("a", "dtype")), C, "dtype"),
    P("st-no-shape", lambda t: _read(t, edit=_drop("b", "shape")), C, "'b'", "shape"),
    P("st-entry-a-string", lambda t: _read(t, edit=_set_entry("a", "F32")), C, "'a'", "not an object"),
    P("st-dtype-unknown", lambda t: _read(t, edit=_set("a", "dtype", "F128")), C, "F128"),
    P("st-dtype-a-number", lambda t: _read(t, edit=_set("a", "dtype", 4)), C, "dtype"),
    P("st-shape-floats", lambda t: _read(t, edit=_set("a", "shape", [3.0, 4])), C, "shape must be a list of ints"),
    P("st-shape-negative", lambda t: _read(t, edit=_set("a", "shape", [-3, -4])), C, "shape"),
    P("st-shape-a-string", lambda t: _read(t, edit=_set("a", "shape", "34")), C, "shape"),
    P("st-shape-mismatch", lambda t: _read(t, edit=_set("a", "shape", [4, 4])), C, "needs 64 bytes"),
    P("st-offsets-three", lambda t: _read(t, edit=_set("a", "data_offsets", [0, 24, 48])), C, "[begin, end]"),
    P("st-offsets-reversed", lambda t: _read(t, edit=_set("a", "data_offsets", [48, 0])), C, "begin after"),
    P("st-offsets-past-data", lambda t: _read(t, edit=_set("b", "data_offsets", [48, 10**12])), C, "outside"),
    P("st-offsets-negative", lambda t: _read(t, edit=_set("a", "data_offsets", [-4, 44])), C, "data_offsets"),
    P("st-offsets-floats", lambda t: _read(t, edit=_set("a", "data_offsets", [0.0, 48.0])), C, "data_offsets"),
    P("st-offsets-overlap", lambda t: _read(t, edit=_overlap), C, "overlap"),
    P("st-metadata-a-list", lambda t: _read(t, edit=lambda h: h.update(__metadata__=[1])), C, "__metadata__"),
    P("st-missing-file", lambda t: _read_path(t / "none.safetensors"), C, "none.safetensors"),
    P("st-a-folder", lambda t: _read_path(t), C, "readable"),
    P("index-no-weight-map", lambda t: _index(t, b'{"metadata": {}}'), C, "weight_map", found=True),
    P("index-not-json", lambda t: _index(t, b"{weight_map"), C, "not JSON", found=True),
    P("index-a-list", lambda t: _index(t, b"[]"), C, "weight_map"),
    P("index-not-utf8", lambda t: _index(t, b"\xff\xfe"), C, "not JSON"),
    P("index-map-a-list", lambda t: _index(t, b'{"weight_map": ["model.safetensors"]}'), C, "weight_map"),
    P("index-file-a-number", lambda t: _index(t, b'{"weight_map": {"a": 3}}'), C, "weight_map['a']"),
    P("index-file-missing", lambda t: _index(t, b'{"weight_map": {"a": "gone.safetensors"}}'), C, "gone.safetensors"),
    P("index-file-escapes", lambda t: _index(t, b'{"weight_map": {"a": "../model.safetensors"}}'), C, "in the folder"),
    P("index-file-absolute", lambda t: _index(t, b'{"weight_map": {"a": "/etc/passwd"}}'), C, "in the folder"),
    P("load-llama-index-not-json", lambda t: _load_folder(t, b"not json"), C, "index"),
    P("load-llama-index-no-map", lambda t: _load_folder(t, b"{}"), C, "weight_map"),
]


def _set_entry(name: str, value):
    return lambda h: h.__setitem__(name, value)


def _overlap(h: dict) -> None:
    h["b"]["data_offsets"] = [44, 48]


def _read_path(path: Path) -> None:
    from megaloop.models.checkpoint import read_safetensors

    read_safetensors(path)


# ---- the command line -----------------------------------------------------------------------------------


def _with_trace(tmp: Path) -> None:
    (tmp / "prof").mkdir()
    (tmp / "prof" / "trace.json").write_text("my trace")
    try:
        cli("profile", "--estimate", "--out", str(tmp / "prof"))()
    finally:
        assert (tmp / "prof" / "trace.json").read_text() == "my trace", "the trace was overwritten"


def _save_missing(tmp: Path) -> None:
    try:
        cli("plan", "--save", str(tmp / "missing" / "dir" / "p.json"))()
    except CliFailure as e:
        assert "planned" not in str(e), "the plan was built before the path was checked"
        raise


def L(id, argv, *words, found=False):  # a table row
    return Case(id, lambda t: cli(*argv, cwd=t)(), CliFailure, words, found)


COMMANDS = [
    L("demo-decode-zero", ["demo", "--decode", "0"], "--decode", ">= 1", found=True),
    L("demo-decode-negative", ["demo", "--decode", "-3"], "--decode", found=True),
    L("demo-decode-a-word", ["demo", "--decode", "many"], "--decode"),
    L("demo-hidden-zero", ["demo", "--hidden", "0"], "--hidden"),
    L("demo-heads-a-float", ["demo", "--heads", "2.5"], "--heads"),
    L("demo-batch-negative", ["demo", "--batch", "-1"], "--batch"),
    L("demo-prompt-zero", ["demo", "--prompt", "0"], "--prompt"),
    L("demo-vocab-zero", ["demo", "--vocab", "0"], "--vocab"),
    L("demo-seed-negative", ["demo", "--seed", "-1"], "--seed"),
    L("demo-dtype-int", ["demo", "--dtype", "int32"], "--dtype"),
    L("demo-backend-tpu", ["demo", "--backend", "tpu"], "--backend"),
    L("demo-indivisible-heads", ["demo", "--hidden", "30", "--heads", "4", "--backend", "cpu"], "divisible"),
    L("profile-iterations-zero", ["profile", "--estimate", "--iterations", "0"], "--iterations", found=True),
    L("profile-processors-zero", ["profile", "--estimate", "--processors", "0"], "--processors", found=True),
    L("profile-tokens-zero", ["profile", "--tokens", "0"], "--tokens"),
    L("profile-batch-a-word", ["profile", "--batch", "two"], "--batch"),
    L("profile-tile-garbage", ["profile", "--estimate", "--tile", "garbage"], "megaloop profile", "NAME:PARAM=INT"),
    L("profile-processors-huge", ["profile", "--estimate", "--processors", "99999"], "resident"),
    L("plan-processors-zero", ["plan", "--processors", "0"], "--processors"),
    L("plan-processors-huge", ["plan", "--processors", "100000"], "resident"),
    L("plan-tokens-zero", ["plan", "--tokens", "0"], "--tokens"),
    L("plan-batch-negative", ["plan", "--batch", "-4"], "--batch"),
    L("plan-preset-unknown", ["plan", "--preset", "gpt5"], "--preset"),
    L("plan-arch-unknown", ["plan", "--arch", "sm_70"], "--arch"),
    L("plan-tile-garbage", ["plan", "--tile", "matmul"], "NAME:PARAM=INT"),
    L("plan-tile-zero", ["plan", "--tile", "matmul:block_m=0"], "block_m"),
    L("plan-tile-unknown", ["plan", "--tile", "matmul:nope=2"], "nope"),
    L("plan-fusion-unknown", ["plan", "--fusion", "norms"], "--fusion 'norms'", "unknown rule", "swiglu_linear"),
    L("profile-fusion-mixed", ["profile", "--estimate", "--fusion", "silu_mul,-split_k_linear"], "either name the"),
    L("plan-save-a-folder", ["plan", "--save", "."], "folder"),
    L("unknown-command", ["fly"], "invalid choice"),
    L("no-command", [], "required"),
    Case("plan-save-missing-folder", _save_missing, CliFailure, ("does not exist",), found=True),
    Case("profile-keeps-an-existing-trace", _with_trace, CliFailure, ("exists", "--force"), found=True),
]


def _save_existing(tmp: Path) -> None:
    (tmp / "p.json").write_text("mine")
    try:
        cli("plan", "--save", "p.json", cwd=tmp)()
    finally:
        assert (tmp / "p.json").read_text() == "mine", "the file was overwritten"


def _profile_out_a_file(tmp: Path) -> None:
    (tmp / "out").write_text("x")
    cli("profile", "--estimate", "--out", str(tmp / "out"))()


COMMANDS += [
    Case("plan-save-keeps-an-existing-file", _save_existing, CliFailure, ("exists", "--force")),
    Case("profile-out-a-file", _profile_out_a_file, CliFailure, ("is a file",)),
]


def _bind(c: Case, tmp: Path) -> Case:
    return Case(c.id, functools.partial(c.call, tmp), c.error, c.words, c.found)


@pytest.mark.parametrize("c", params([*PLAN_FILES, *CHECKPOINTS]))
def test_bad_file(c: Case, tmp_path: Path) -> None:
    check(_bind(c, tmp_path))


@pytest.mark.parametrize("c", params(COMMANDS))
def test_bad_command_line(c: Case, tmp_path: Path) -> None:
    check_cli(_bind(c, tmp_path))


def test_every_node_attribute_is_declared_by_its_op() -> None:
    """Plan files check node attributes against OpDef.attrs: every attribute a builder makes must be
    declared there (or plans of that op would not load). Op-table rows, Llama graphs, collectives."""
    from megaloop.models import LlamaConfig, build_llama, build_llama_generator
    from tests.op_table import ROWS, build_row

    graphs = [build_row(row, row.dtypes[0], 0)[0] for row in ROWS]
    cfg = LlamaConfig(hidden=64, heads=4, kv_heads=2, intermediate=96, layers=1, vocab=300, max_seq=256,
                      rope_scaling={"type": "linear", "factor": 2.0})  # fmt: skip
    graphs += [build_llama(cfg, 1, 1), build_llama(cfg, 2, 4), build_llama_generator(cfg, 1)]

    def ranks(g: ml.Graph) -> None:
        x = g.input("x", (4, 8), ml.float32)
        ml.send(x, 1 - g.rank)
        s = g.state("s", (2,), ml.float32, init=[1.0, 2.0])
        g.assign(s, s + g.constant([1.0, 2.0]))
        y = ml.all_reduce(x) + ml.all_gather(x, 1)[:, :8] + ml.reduce_scatter(x, 1).reshape(8, 2).reshape(4, 4)[:, :1]
        g.output("y", y + ml.recv(g, 1 - g.rank, (4, 8), ml.float32))

    graphs += ml.spmd(ranks, 2)
    seen = {n.op.name for g in graphs for n in g.nodes}
    problems = {
        f"{n.op.name}: {n.op.attr_problem(n.attrs)}" for g in graphs for n in g.nodes if n.op.attr_problem(n.attrs)
    }
    assert not problems, sorted(problems)
    assert len(seen) >= len(ml.REGISTRY) - 2, sorted(set(ml.REGISTRY) - seen)  # all but a few helpers' ops

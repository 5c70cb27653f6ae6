"""Plan files: save and load round trip, hand edits (tile sizes, task orders) that still verify and
run, and malformed files that fail with an error naming the field."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

import megaloop as ml
from megaloop import errors
from megaloop.models import LlamaConfig, build_llama, random_parameters
from megaloop.plan import Plan, make_plan
from megaloop.plan.format import plan_from_dict, plan_to_dict
from megaloop.reference.interpreter import run_plan

CFG = LlamaConfig(hidden=32, heads=4, kv_heads=2, intermediate=48, layers=1, max_seq=8, vocab=40)


@pytest.fixture(scope="module")
def setup():
    g = build_llama(CFG, 2, 3)
    params = random_parameters(CFG, seed=1)
    feeds = {"tokens": np.array([[1, 2, 3], [4, 5, 6]]), "positions": np.tile(np.arange(3), (2, 1))}
    plan = make_plan(g, processors=5, tiles={"matmul": {"block_m": 2, "block_n": 8}, "add": {"elements": 32}})
    ref = ml.evaluate(g, feeds, params, iterations=2)
    return g, plan, params, feeds, ref


def matches(plan: Plan, params, feeds, ref) -> None:
    for seed in range(3):
        out = run_plan(plan, feeds, params, iterations=2, seed=seed)
        assert out.outputs["logits"].tobytes() == ref.outputs["logits"].tobytes()


def test_round_trip(setup, tmp_path) -> None:
    _, plan, params, feeds, ref = setup
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = Plan.load(path)
    assert json.dumps(plan_to_dict(loaded), sort_keys=True) == json.dumps(plan_to_dict(plan), sort_keys=True)
    matches(loaded, params, feeds, ref)
    text = path.read_text()
    assert '"format": "megaloop-plan"' in text and "layers.0.attn.matmul" in text


def test_the_fusion_options_travel_in_the_file(setup, tmp_path) -> None:
    """The rewrites that made the plan's graph (FuseOptions) are saved with it and read back."""
    g, _, params, feeds, ref = setup
    fusion = ml.FuseOptions(off=("rmsnorm_linear", "norm_residual"))
    plan = make_plan(g, processors=5, fusion=fusion)
    assert [n.op.name for n in plan.ranks[0].graph.nodes].count("rmsnorm") == 3  # (each norm a stage)
    plan.save(tmp_path / "fusion.json")
    loaded = Plan.load(tmp_path / "fusion.json")
    assert loaded.fusion == fusion and json.loads((tmp_path / "fusion.json").read_text())["fusion"] == {
        "enabled": True,
        "off": ["norm_residual", "rmsnorm_linear"],
        "on": [],
    }
    matches(loaded, params, feeds, ref)


def test_edited_tile_size(setup, tmp_path) -> None:
    _, plan, params, feeds, ref = setup
    data = plan_to_dict(plan)
    op = next(o for o in data["ranks"][0]["ops"] if o["op"] == "matmul")
    op["tile"] = {"block_m": 1, "block_n": 4}
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    with pytest.raises(errors.PlanFormatError, match=rf"ops\[{op['id']}\] \({op['name']}\).*rederive=True"):
        Plan.load(path)
    edited = Plan.load(path, rederive=True)
    new_op = edited.ranks[0].ops[op["id"]]
    assert new_op.tile == {
        "block_m": 1,
        "block_n": 4,
        "tensor_cores": 1,
        "skinny_mma": 1,
        "fold_batch": 0,
        "share": 0,
        "wgmma": 1,
    }  # left out: defaults, but the switches that change the tasks as plans were made before them
    assert sum(1 for t in edited.ranks[0].tasks if t.op == op["id"]) > sum(
        1 for t in plan.ranks[0].tasks if t.op == op["id"]
    )
    matches(edited, params, feeds, ref)
    edited.save(tmp_path / "again.json")
    matches(Plan.load(tmp_path / "again.json"), params, feeds, ref)  # consistent now: no rederive needed


def test_reordered_tasks(setup, tmp_path) -> None:
    _, plan, params, feeds, ref = setup
    data = plan_to_dict(plan)
    lists = data["ranks"][0]["processors"]
    # move the last task of the busiest processor to the front of the idlest one, and reverse the
    # order of a run of independent tasks (same op) on another
    busiest = max(range(len(lists)), key=lambda p: len(lists[p]))
    idlest = min(range(len(lists)), key=lambda p: len(lists[p]))
    moved = lists[busiest].pop()
    lists[idlest].append(moved)
    ops = {t["id"]: t["op"] for t in data["ranks"][0]["tasks"]}
    lst = lists[busiest]
    i = next(i for i in range(len(lst) - 1) if ops[lst[i]] == ops[lst[i + 1]])
    lst[i], lst[i + 1] = lst[i + 1], lst[i]
    path = tmp_path / "reordered.json"
    path.write_text(json.dumps(data))
    edited = Plan.load(path, rederive=True)
    assert edited.ranks[0].processors[idlest][-1] == moved
    matches(edited, params, feeds, ref)


def test_impossible_order_is_refused(setup) -> None:
    _, plan, _, _, _ = setup
    data = plan_to_dict(plan)
    lists = data["ranks"][0]["processors"]
    everything = [t for lst in lists for t in lst]
    data["ranks"][0]["processors"] = [list(reversed(everything))] + [[] for _ in lists[1:]]  # consumers first
    with pytest.raises(errors.DeadlockError, match="deadlock"):
        plan_from_dict(data, rederive=True)


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda d: d.pop("version"), r"plan\.version: missing"),
        (lambda d: d.update(version=99), r"plan\.version: this megaloop reads version 5"),
        (lambda d: d.pop("fusion"), r"plan\.fusion: missing"),
        (lambda d: d["fusion"].update(off=["fold"]), r"plan\.fusion\.off: unknown rule 'fold'; the rules are"),
        (lambda d: d["fusion"].update(enabled="yes"), r"plan\.fusion\.enabled: expected a bool, got str"),
        (lambda d: d.update(format="other"), r"plan\.format"),
        (lambda d: d.update(processors="many"), r"plan\.processors: expected an int, got str"),
        (lambda d: d["ranks"][0]["buffers"][0].update(kind="heap"), r"plan\.ranks\[0\]\.buffers\[0\]\.kind"),
        (lambda d: d["ranks"][0]["tensors"][2].update(buffer=10**6), r"plan\.ranks\[0\]\.tensors\[2\]\.buffer"),
        (lambda d: d["ranks"][0]["tasks"][1].update(id=7), r"plan\.ranks\[0\]\.tasks\[1\]\.id: expected 1"),
        (
            lambda d: d["ranks"][0]["tasks"][3]["waits"].append([0, 0, -1]),
            r"plan\.ranks\[0\]\.tasks\[3\]\.waits\[\d+\]\[2\]: must be >= 0",
        ),
        (lambda d: d["ranks"][0]["tasks"][0]["reads"].append([0, 0, [0], [1, 2]]), r"box bounds"),
        (
            lambda d: d["ranks"][0]["ops"][0].update(tile={"elements": 0}),
            r"ops\[0\]\.tile\.elements: expected an int >= 1",
        ),
        (lambda d: d["ranks"][0]["processors"].append(["x"]), r"plan\.ranks\[0\]\.processors\[\d+\]\[0\]"),
        (lambda d: d["ranks"][0].pop("graph"), r"plan\.ranks\[0\]\.graph: missing"),
        # what the graph determines is not editable: a changed op order, node, view or buffer shape
        (lambda d: d["ranks"][0]["ops"][1].update(seq=0), r"plan\.ranks\[0\]\.ops\[1\]: .* not editable"),
        (lambda d: d["ranks"][0]["ops"][0].update(node=None), r"plan\.ranks\[0\]\.ops\[0\]: .* not editable"),
        (lambda d: d["ranks"][0]["tensors"][0].update(offset=3), r"plan\.ranks\[0\]\.tensors\[0\]: .* not editable"),
        (
            lambda d: d["ranks"][0]["buffers"][-1].update(shape=[1]),
            r"plan\.ranks\[0\]\.buffers\[\d+\]: .* not editable",
        ),
        (lambda d: d.update(warps=0), r"plan\.warps: must be >= 1"),
        (lambda d: d.update(warps=64), r"warps must be an int in \[1, 32\]"),
    ],
)
def test_malformed_plans_name_the_field(setup, edit, field) -> None:
    _, plan, _, _, _ = setup
    data = copy.deepcopy(plan_to_dict(plan))
    edit(data)
    with pytest.raises(errors.PlanFormatError, match=field):
        plan_from_dict(data)


def test_top_level_must_be_an_object() -> None:
    with pytest.raises(errors.PlanFormatError, match="expected a JSON object, got list"):
        plan_from_dict([1, 2])


def test_stats_survive_save_and_load(setup, tmp_path) -> None:
    _, plan, _, _, _ = setup
    plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json").stats() == plan.stats()


def test_not_json(tmp_path) -> None:
    path = tmp_path / "bad.json"
    path.write_text("{ not json")
    with pytest.raises(errors.PlanFormatError, match="not JSON"):
        Plan.load(path)


def test_stats(setup) -> None:
    _, plan, _, _, _ = setup
    (s,) = plan.stats()
    assert s.tasks == len(plan.ranks[0].tasks) and s.waits == sum(len(t.waits) for t in plan.ranks[0].tasks)
    assert 0 < s.critical_path_ns <= s.makespan_ns + 1e-6
    assert 0 < s.load_balance <= 1
    assert s.arena_bytes >= sum(s.region_bytes.values())
    assert s.region_bytes["parameter"] == sum(
        int(np.prod(v)) * 2 for v in CFG.parameter_shapes().values()
    ) or s.region_bytes["parameter"] >= sum(int(np.prod(v)) * 2 for v in CFG.parameter_shapes().values())


def test_files_saved_before_balanced_tiles_load_as_they_were(tmp_path) -> None:
    """Ops whose tiles grow to fill the processors' last round (the tile switch ``balance``, on by
    default) load from files without the switch as they were made then: exactly ``elements`` a task."""
    g = ml.Graph("balance")
    x = g.input("x", (11, 4096), ml.float32)
    g.output("y", ml.softmax(x, -1))
    exact = make_plan(g, processors=3, tiles={"softmax": {"elements": 4096, "balance": 0}})
    grown = make_plan(g, processors=3, tiles={"softmax": {"elements": 4096}})
    assert len(exact.ranks[0].tasks) == 11 and len(grown.ranks[0].tasks) == 6  # 1 row a task; 2 (2 rounds, not 4)
    data = plan_to_dict(exact)
    op = next(o for o in data["ranks"][0]["ops"] if o["op"] == "softmax")
    del op["tile"]["balance"]  # as saved before the switch existed
    loaded = plan_from_dict(data)
    assert loaded.ranks[0].ops[op["id"]].tile["balance"] == 0 and len(loaded.ranks[0].tasks) == 11
    feeds = {"x": np.random.default_rng(0).standard_normal((11, 4096)).astype(np.float32)}
    want = ml.evaluate(g, feeds).outputs["y"]
    assert run_plan(loaded, feeds).outputs["y"].tobytes() == want.tobytes()


def test_norms_saved_before_the_residual_operand_still_generate(tmp_path) -> None:
    """Norm nodes of files saved before rmsnorm / layernorm took a residual list no residual as absent
    (rmsnorm(x, w) had no ``absent``): they load, their kernels generate and compile (a helper's review
    found the generator indexing a residual past the inputs), and they compute what they did."""
    from megaloop.codegen.kernel import generate
    from megaloop.frontend.ops._build import apply
    from megaloop.frontend.ops.normalization import LAYERNORM, RMSNORM
    from megaloop.plan.format import load, save
    from megaloop.runtime.compile import spills

    g = ml.Graph("old-norms")
    x = g.input("x", (3, 2048), ml.bfloat16)
    w = g.parameter("w", (2048,), ml.bfloat16)
    b = g.parameter("b", (2048,), ml.bfloat16)
    g.output("rms", apply(RMSNORM, [x, w], eps=1e-6))  # the attributes such files hold
    g.output("ln", apply(LAYERNORM, [x, w, b], eps=1e-5))
    g.output("ln_bias", apply(LAYERNORM, [x, b], eps=1e-5, absent=(1,)))
    g.output("rms_plain", apply(RMSNORM, [x], eps=1e-6, absent=(1,)))
    save(make_plan(g, processors=4), tmp_path / "old.json")
    plan = load(tmp_path / "old.json")
    source = generate(plan).source
    assert "add_rounded" not in source and spills(source) == {}
    rng = np.random.default_rng(4)
    feeds = {"x": ml.dtypes.round_to(rng.standard_normal((3, 2048)), ml.bfloat16)}
    params = {k: ml.dtypes.round_to(rng.standard_normal(2048), ml.bfloat16) for k in ("w", "b")}
    got = run_plan(plan, feeds, params, seed=2).outputs
    want = {
        "rms": ml.evaluate(_one(lambda g, x, w, b: ml.rmsnorm(x, w, eps=1e-6)), feeds, params).outputs["y"],
        "ln": ml.evaluate(_one(lambda g, x, w, b: ml.layernorm(x, w, b, eps=1e-5)), feeds, params).outputs["y"],
        "ln_bias": ml.evaluate(_one(lambda g, x, w, b: ml.layernorm(x, bias=b, eps=1e-5)), feeds, params).outputs["y"],
        "rms_plain": ml.evaluate(_one(lambda g, x, w, b: ml.rmsnorm(x, eps=1e-6)), feeds, params).outputs["y"],
    }
    for name, value in want.items():
        assert got[name].tobytes() == value.tobytes(), name


def _one(build) -> ml.Graph:
    """A graph of one norm of x [3, 2048] with parameters w and b (bf16), output y."""
    g = ml.Graph("one")
    x = g.input("x", (3, 2048), ml.bfloat16)
    w, b = g.parameter("w", (2048,), ml.bfloat16), g.parameter("b", (2048,), ml.bfloat16)
    g.output("y", build(g, x, w, b))
    return g

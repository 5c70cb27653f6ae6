"""ml.parallelize on whole programs: a tiny Llama (prefill, decode, the self-feeding generator) under
every strategy, planned and run on the N-rank plan interpreter in random interleavings against the
single-device program; device parallelism; dropped exchanges caught; bad input refused clearly."""

from __future__ import annotations

import numpy as np
import pytest

import megaloop as ml
from megaloop.errors import CollectiveMismatchError, GraphBuildError
from megaloop.models import LlamaConfig, build_llama, build_llama_generator, random_parameters
from megaloop.plan import make_plan
from megaloop.reference.interpreter import run_plan
from tests.helpers import worst_error_text

STRATEGIES = [
    ("tp2", 2, "tp"),
    ("tp4", 4, "tp"),
    ("tp8", 8, "tp"),
    ("pp2", 2, "pp"),
    ("pp4", 4, "pp"),
    ("dp2", 2, "dp"),
    ("tp2xpp2", ml.Mesh((2, 2), ("pp", "tp")), {"pp": "pp", "tp": "tp"}),
    ("dp2xtp2", ml.Mesh((2, 2), ("dp", "tp")), {"dp": "dp", "tp": "tp"}),
]
INTERLEAVINGS = 20


def _config(dtype: str) -> LlamaConfig:
    return LlamaConfig(hidden=64, heads=8, kv_heads=4, intermediate=96, layers=2, vocab=50, max_seq=16, dtype=dtype)


def _program(kind: str, dtype: str, seed: int):
    cfg = _config(dtype)
    rng = np.random.default_rng(seed)
    if kind == "prefill":
        feeds = {"tokens": rng.integers(0, 50, (2, 5)), "positions": np.tile(np.arange(5), (2, 1))}
        return build_llama(cfg, 2, 5), feeds, {}, 1
    if kind == "decode":
        cache = {
            f"model.layers.{i}.self_attn.{k}_cache": rng.standard_normal((2, 4, 16, 8)) for i in range(2) for k in "kv"
        }
        feeds = {"tokens": rng.integers(0, 50, (2, 1)), "positions": np.array([[6], [9]])}
        return build_llama(cfg, 2, 1), feeds, cache, 1
    state = {"token": rng.integers(0, 50, (2, 1)), "position": np.array([[0], [2]])}
    return build_llama_generator(cfg, 2), {}, state, 3


def _relative(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["prefill", "decode", "generator"])
@pytest.mark.parametrize("label,devices,strategy", STRATEGIES, ids=[s[0] for s in STRATEGIES])
def test_llama_split_matches_one_device(label, devices, strategy, kind: str, dtype: str) -> None:
    g, feeds, state, iterations = _program(kind, dtype, seed=len(label) + len(kind))
    params = random_parameters(_config(dtype), seed=3)
    ref = ml.evaluate(g, feeds, params, state, iterations=iterations)
    split = ml.parallelize(g, devices, strategy)
    assert split.world_size == (devices if isinstance(devices, int) else devices.size)
    plan = make_plan(split.graphs, processors=2)  # (few processors: few tasks, a quick interpreter)
    first = None
    for seed in range(INTERLEAVINGS):
        results = run_plan(
            plan,
            split.shard_inputs(feeds),
            split.shard_parameters(params),
            split.shard_state(state),
            iterations=iterations,
            seed=seed,
        )
        got = {**split.gather_outputs(results), **split.gather_state([r.state for r in results])}
        if first is None:
            first = got
            _replicas_agree(split, results)
            # fp32: the split only reorders sums (partial sums added in rank order); bf16: each rank's
            # partial result is rounded once more before the sum, a few ulps of bf16 (docs/partition.md)
            limit = 1e-5 if dtype == "float32" else 2e-2
            for name, want in [*ref.outputs.items(), *ref.state.items()]:
                if want.dtype.kind in "iu":
                    continue
                err = _relative(got[name], want)
                assert err <= limit, f"{label} {kind} {dtype} {name}: relative error {err:.2e} > {limit}; " + (
                    worst_error_text(got[name], want)
                )
            if kind == "generator" and dtype == "float32":
                assert np.array_equal(got["token"], ref.state["token"]), f"{label}: greedy tokens differ"
        else:
            for name, value in got.items():
                assert np.array_equal(value, first[name]), f"{label} {kind}: {name} differs between interleavings"


def _replicas_agree(split, results) -> None:
    """Every rank holding the same piece of an output holds bitwise the same values."""
    seen: dict = {}
    for part, res in zip(split.parts, results):
        for local, (name, box) in part.outputs.items():
            value = res.outputs[local]
            if (name, box) in seen:
                assert np.array_equal(seen[(name, box)], value), f"output {name} {box} differs between ranks"
            seen[(name, box)] = value


def test_tensor_parallel_is_the_megatron_pattern() -> None:
    """Column- then row-parallel projections, heads split, one all-reduce per block, weights cut."""
    cfg = LlamaConfig(hidden=256, heads=8, kv_heads=8, intermediate=512, layers=2, vocab=64, max_seq=32)
    split = ml.parallelize(build_llama(cfg, 1, 1), 4, "tp")
    g = split.graphs[0]
    reduces = [n for n in g.nodes if n.op.name == "all_reduce"]
    assert len(reduces) == 2 * cfg.layers, f"expected one all-reduce per block, got {[n.name for n in reduces]}"
    q = g.parameters["model.layers.0.self_attn.q_proj.weight"]
    o = g.parameters["model.layers.0.self_attn.o_proj.weight"]
    assert q.shape == (cfg.hidden // 4, cfg.hidden) and o.shape == (cfg.hidden, cfg.hidden // 4)
    text = split.describe()
    assert "column-parallel" in text and "row-parallel" in text and "all_reduce" in text


def test_parameters_are_views_of_the_checkpoint() -> None:
    cfg = _config("float32")
    params = random_parameters(cfg, 0)
    split = ml.parallelize(build_llama(cfg, 1, 1), 2, "tp")
    for rank_params in split.shard_parameters(params):
        for name, value in rank_params.items():
            original = params[name.split("@")[0]]
            assert np.shares_memory(value, original), f"{name} was copied"


def test_device_parallel_runs_the_branches_side_by_side() -> None:
    """Luminal's example: b = op1(a); c = op2(a); d = b + c, op1 and op2 on two devices at once."""
    g = ml.Graph("branches")
    a = g.input("a", (64, 1024), ml.float32)
    w1 = g.parameter("w1", (1024, 1024), ml.float32)
    w2 = g.parameter("w2", (1024, 1024), ml.float32)
    b = ml.tanh(a @ w1)
    c = ml.sigmoid(a @ w2)
    g.output("d", b + c)
    split = ml.parallelize(g, 2, "device")
    mm = [{n.name for n in gr.nodes if n.op.name == "matmul"} for gr in split.graphs]
    assert all(len(m) == 1 for m in mm), f"each device should run one branch's matmul: {mm}"
    plan = make_plan(split.graphs, processors=8)
    from megaloop.plan.stats import estimated_times

    times = estimated_times(plan)
    spans = []
    for r, rp in enumerate(plan.ranks):
        ids = [t.id for t in rp.tasks if rp.ops[t.op].op == "matmul"]
        spans.append((times[r][ids, 0].min(), times[r][ids, 1].max()))
    assert spans[0][0] < spans[1][1] and spans[1][0] < spans[0][1], f"the branches do not overlap: {spans}"
    rng = np.random.default_rng(0)
    feeds = {"a": rng.standard_normal((64, 1024))}
    params = {"w1": rng.standard_normal((1024, 1024)) * 0.03, "w2": rng.standard_normal((1024, 1024)) * 0.03}
    want = ml.evaluate(g, feeds, params).outputs["d"]
    res = run_plan(plan, split.shard_inputs(feeds), split.shard_parameters(params), seed=1)
    got = split.gather_outputs(res)["d"]
    assert np.array_equal(got, want), worst_error_text(got, want)


def _drop(graph: ml.Graph, node) -> None:
    graph.replace_uses(node.outputs[0], node.inputs[0])
    graph.nodes.remove(node)
    for i, n in enumerate(graph.nodes):
        n.id = i


@pytest.mark.parametrize("strategy,devices", [("tp", 2), ("pp", 2)])
def test_a_dropped_exchange_is_caught(strategy: str, devices: int) -> None:
    """Every collective and transfer the partitioner inserted matters: dropping one on one rank is
    refused (the ranks no longer match), dropping it everywhere changes the result."""
    g, feeds, state, _ = _program("decode", "float32", seed=5)
    params = random_parameters(_config("float32"), seed=3)
    want = ml.evaluate(g, feeds, params, state).outputs["logits"]
    count = len([n for n in ml.parallelize(g, devices, strategy).graphs[0].nodes if n.op.kind in ("collective", "p2p")])
    assert count > 0
    for k in range(count):
        split = ml.parallelize(g, devices, strategy)
        exchanges = [[n for n in gr.nodes if n.op.kind in ("collective", "p2p")] for gr in split.graphs]
        victim = exchanges[0][k]
        if victim.op.kind == "collective":
            _drop(split.graphs[0], victim)
            with pytest.raises(CollectiveMismatchError):
                ml.parallel.match_ranks(split.graphs)
            for gr, ex in zip(split.graphs[1:], exchanges[1:]):
                _drop(gr, ex[k])
            res = ml.evaluate(
                split.graphs, split.shard_inputs(feeds), split.shard_parameters(params), split.shard_state(state)
            )
            got = split.gather_outputs(res)["logits"]
            assert not np.allclose(got, want, rtol=1e-4, atol=1e-4), f"dropping {victim.name} changed nothing"
        elif victim.op.name == "send":
            split.graphs[0].nodes.remove(victim)
            with pytest.raises(CollectiveMismatchError):
                ml.parallel.match_ranks(split.graphs)


def test_bad_input_is_refused_clearly() -> None:
    cfg = LlamaConfig(hidden=64, heads=4, kv_heads=2, intermediate=96, layers=1, vocab=50, max_seq=16)
    g = build_llama(cfg, 1, 1)  # (plain: norms of their own to pin)
    with pytest.raises(GraphBuildError, match=r"k_cache.*cannot hold"):
        ml.parallelize(g, 4, "tp", layout={"model.layers.0.self_attn.k_cache": ml.Shard(1)})
    norm = next(n for n in g.nodes if n.op.name == "rmsnorm")
    with pytest.raises(GraphBuildError, match=rf"rmsnorm {norm.name}.*pinned to sharded on axis 2"):
        ml.parallelize(g, 2, "tp", layout={norm.name: ml.Shard(2)})
    with pytest.raises(GraphBuildError, match=r"largest: .*weight"):
        ml.parallelize(g, 2, "tp", memory_per_device=1000)
    with pytest.raises(GraphBuildError, match="axes"):
        ml.parallelize(g, ml.Mesh((2, 2), ("a", "b")), {"pp": "pp"})
    with pytest.raises(GraphBuildError, match="one kind per axis"):
        ml.parallelize(g, ml.Mesh((2, 2), ("x", "y")), "tp")
    with pytest.raises(GraphBuildError, match="no tensor"):
        ml.parallelize(g, 2, "tp", layout={"no.such.weight": ml.Replicate()})
    with pytest.raises(GraphBuildError, match="single-device"):
        ml.parallelize(ml.spmd(lambda gr: gr.output("y", ml.all_reduce(gr.input("x", (4,), "float32"))), 2)[0], 2)
    with pytest.raises(GraphBuildError, match="batch"):
        ml.parallelize(g, 2, "dp")


def test_a_pin_is_honoured() -> None:
    cfg = _config("float32")
    g = build_llama(cfg, 1, 1)
    split = ml.parallelize(g, 2, "tp", layout={"lm_head.weight": ml.Replicate()})
    assert split.graphs[0].parameters["lm_head.weight"].shape == (cfg.vocab, cfg.hidden)
    split = ml.parallelize(g, 2, "tp", layout={"lm_head.weight": ml.Shard(1)})
    assert split.graphs[1].parameters["lm_head.weight"].shape == (cfg.vocab, cfg.hidden // 2)


def test_auto_compares_candidates_and_keeps_the_fastest() -> None:
    cfg = LlamaConfig(hidden=512, heads=8, kv_heads=8, intermediate=1024, layers=4, vocab=1000, max_seq=64)
    split = ml.parallelize(build_llama(cfg, 2, 1), 4)
    labels = [c.plan.label for c in split.candidates]
    assert {"tp4", "pp4 (2 micro-batches)", "dp2 x tp2", "device4"} <= set(labels), labels
    best = min(c.predicted.step_us for c in split.candidates if c.predicted is not None and not c.error)
    assert split.predicted.step_us == best
    assert "(chosen)" in split.describe()


def test_sixteen_ranks_over_two_nodes() -> None:
    """A 16-rank plan (two nodes of eight: pipeline across the nodes, tensor parallel inside each) of a
    small model on the CPU interpreter, against the single-device program (docs/multinode.md)."""
    cfg = LlamaConfig(hidden=64, heads=8, kv_heads=8, intermediate=128, layers=2, vocab=64, max_seq=16, dtype="float32")
    g = build_llama(cfg, 2, 1)
    mesh = ml.Mesh((2, 8), ("node", "gpu"))
    machine = ml.parallel.Machine(devices_per_node=8)
    split = ml.parallelize(g, mesh, {"node": "pp", "gpu": "tp"}, machine=machine)
    assert split.world_size == 16
    sends = [n for gr in split.graphs for n in gr.nodes if n.op.name == "send"]
    assert sends and all(n.graph.rank < 8 <= n.attrs["dst"] for n in sends), "stages should cross between the nodes"
    rng = np.random.default_rng(2)
    feeds = {"tokens": rng.integers(0, 64, (2, 1)), "positions": np.array([[0], [3]])}
    params = random_parameters(cfg, seed=4)
    want = ml.evaluate(g, feeds, params).outputs["logits"]
    plan = make_plan(split.graphs, processors=2)
    got = split.gather_outputs(run_plan(plan, split.shard_inputs(feeds), split.shard_parameters(params), seed=7))
    assert _relative(got["logits"], want) < 1e-5, worst_error_text(got["logits"], want)


def test_the_cost_model_predicts_the_committed_measurements() -> None:
    """bench/cost_model.py's cases (the single-GPU layers, GEMMs, memory-bound ops, all-reduces on two
    GPUs, as measured on an H200 and committed in bench/results) within the errors docs/partition.md
    reports: the single-GPU ones within 15% (issue 21's target), none beyond 25%, the mean within 10%."""
    from bench import cost_model
    from megaloop.parallel.predict import predict_step

    errors = {}
    for name, make, measured in cost_model.cases():
        if name.startswith("1B") or name.startswith("TP MLP"):
            continue  # (16-layer graphs: slow to build here; the benchmark's table has them)
        errors[name] = predict_step(make(), ml.parallel.H200)["step_us"] / measured - 1
    one_gpu = {name: e for name, e in errors.items() if "GPUs" not in name}
    assert len(one_gpu) >= 10 and max(abs(e) for e in one_gpu.values()) <= 0.15, one_gpu
    assert max(abs(e) for e in errors.values()) <= 0.25, errors
    assert np.mean([abs(e) for e in errors.values()]) <= 0.10, errors


def _mlp(x_shape=(4, 8), reuse: bool = False) -> ml.Graph:
    g = ml.Graph("mlp")
    x = g.input("x", x_shape, ml.float32)
    w = g.parameter("w", (x_shape[-1], x_shape[-1]), ml.float32)
    y = ml.tanh(x @ w)
    g.output("y", ml.tanh(ml.tanh(y @ w) @ w) if reuse else y)
    return g


def _run(split, feeds, params) -> dict:
    return split.gather_outputs(ml.evaluate(split.graphs, split.shard_inputs(feeds), split.shard_parameters(params)))


def test_review_fixes_pins() -> None:
    """Pins that cannot be honoured are errors, never ignored nor silently wrong."""
    g = _mlp()
    with pytest.raises(GraphBuildError, match="never as partial sums"):
        ml.parallelize(g, 2, "tp", layout={"w": ml.Partial()})
    with pytest.raises(GraphBuildError, match="data parallelism keeps it"):
        ml.parallelize(g, 2, "dp", layout={"w": ml.Shard(0)})
    with pytest.raises(GraphBuildError, match="cuts no tensors"):
        ml.parallelize(g, 2, "pp", layout={"w": ml.Shard(0)})
    with pytest.raises(GraphBuildError, match="only device parallelism"):
        ml.parallelize(g, 2, "tp", layout={"w": ml.OnDevice(1)})
    split = ml.parallelize(g, 2, "device", layout={"w": ml.OnDevice(1)})
    assert "w" in split.graphs[1].parameters and "w" not in split.graphs[0].parameters


def test_review_fixes_micro_batches_share_the_weights() -> None:
    cfg = LlamaConfig(hidden=64, heads=8, kv_heads=8, intermediate=128, layers=4, vocab=100, max_seq=16)
    g = build_llama(cfg, 4, 1)
    whole = sum(t.nbytes for t in g.parameters.values())
    for m in (1, 2, 4):
        split = ml.parallelize(g, 2, "pp", micro_batches=m)
        held = sum(t.nbytes for gr in split.graphs for t in gr.parameters.values())
        assert held == whole, f"{m} micro-batches: the ranks hold {held} bytes of parameters, the model {whole}"


def test_review_fixes_uneven_data_parallel_times_tensor_parallel() -> None:
    g = ml.Graph("odd")
    x = g.input("x", (3, 256), ml.float32)
    w = g.parameter("w", (256, 2048), ml.float32)
    w2 = g.parameter("w2", (2048, 256), ml.float32)
    h = ml.tanh(x @ w)
    g.output("y", ml.tanh(ml.sum(h, axis=0, keepdims=True) @ w2))
    g.output("z", h * 2.0)
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((3, 256))}
    params = {"w": rng.standard_normal((256, 2048)) * 0.05, "w2": rng.standard_normal((2048, 256)) * 0.02}
    want = ml.evaluate(g, feeds, params).outputs
    split = ml.parallelize(g, ml.Mesh((2, 2), ("dp", "tp")), {"dp": "dp", "tp": "tp"})
    got = _run(split, feeds, params)
    for name in want:
        assert _relative(got[name], want[name]) < 1e-5, name


def test_review_fixes_memory_counts_a_piece_once() -> None:
    g = _mlp((4, 1024), reuse=True)  # a 4 MiB weight read three times
    split = ml.parallelize(g, 2, "tp", memory_per_device=5 * 2**20)
    assert max(split.predicted.memory_bytes) <= 5 * 2**20
    with pytest.raises(ml.errors.PartitionMemoryError, match=r"MiB.*largest: w"):
        ml.parallelize(g, 2, "tp", memory_per_device=2**20)


def test_review_fixes_names_meshes_batches_and_arguments() -> None:
    g = ml.Graph("names")
    x = g.input("x", (4, 64), ml.float32)
    w = g.parameter("w", (64, 64), ml.float32)
    w1 = g.parameter("w@1", (64, 64), ml.float32)
    g.output("y", ml.tanh(ml.tanh(ml.tanh(x @ w) @ w) @ w1))
    ml.parallelize(g, 2, "tp")  # the partitioner's own names never collide with the program's
    small = build_llama(_config("float32"), 2, 1)
    assert ml.parallelize(small, ml.Mesh((2, 2, 2), ("a", "b", "c"))).world_size == 8
    order = ml.Graph("order")
    t = order.input("temperature", (1,), ml.float32)  # declared first: not the batch
    x = order.input("x", (8, 64), ml.float32)
    keys = order.input("keys", (16, 64), ml.float32)
    order.output("y", ml.softmax((x @ ml.transpose(keys)) / t))
    split = ml.parallelize(order, 2, "dp")
    assert split.graphs[0].inputs["x"].shape == (4, 64) and split.graphs[0].inputs["keys"].shape == (16, 64)
    for kw, words in [
        ({"micro_batches": 2.5}, "micro_batches"),
        ({"micro_batches": 0}, "micro_batches"),
        ({"memory_per_device": "1G"}, "memory_per_device"),
    ]:
        with pytest.raises(GraphBuildError, match=words):
            ml.parallelize(small, 2, "pp", **kw)
    with pytest.raises(GraphBuildError, match="no pp axis"):
        ml.parallelize(small, 2, "tp", micro_batches=2)
    with pytest.raises(GraphBuildError, match="no kind for mesh axis 'gpu'"):
        ml.parallelize(small, ml.Mesh((2, 2), ("node", "gpu")), {"node": "pp"})
    with pytest.raises(GraphBuildError, match="never cuts the batch"):
        ml.parallelize(small, 2, "tp", layout={"model.layers.0.self_attn.k_cache": ml.Shard(0)})

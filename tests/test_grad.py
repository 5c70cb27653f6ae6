"""megaloop.grad: a tiny model of each Llama family (loss and every parameter's gradient) against the
same model in transformers with PyTorch autograd (float64), on the numpy reference and through the
plan interpreter; the cross-entropy loss; gradients summed over a tensor's uses; collectives and
transfers over two ranks against one device; refusal of an op without a rule; the backward's plan
compiled with NVRTC."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import megaloop as ml
from megaloop import errors
from megaloop.models import build_llama_gradients, load_llama
from megaloop.plan import make_plan
from megaloop.reference.interpreter import run_plan
from tests.hf_models import make_model

BATCH, TOKENS = 2, 8
F32_EPS = float(np.finfo(np.float32).eps)
# float32 against float64: a few roundings a layer on each of the backward's products and norms, about
# 1e-6 of the gradient's largest magnitude measured; 64 eps (7.6e-6) leaves room for other draws
ULPS = 64.0


def assert_gradient(got: np.ndarray, ref: np.ndarray, what: str, ulps: float = ULPS, eps: float = F32_EPS) -> None:
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != {ref.shape}"
    err = np.abs(got.astype(np.float64) - ref)
    scale = float(np.max(np.abs(ref), initial=0.0))
    worst = np.unravel_index(int(np.argmax(err)), err.shape) if err.size else ()
    assert err[worst] <= ulps * eps * max(scale, 1e-30), (
        f"{what}: off by {err[worst]:.3e} at {tuple(int(i) for i in worst)} (got {got[worst]:.7g}, reference "
        f"{ref[worst]:.7g}); allowed {ulps} eps x {scale:.3e}"
    )


def batch(vocab: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (BATCH, TOKENS))
    targets = rng.integers(0, vocab, (BATCH, TOKENS))
    targets[0, :3] = -100  # padding: ignored by the mean
    return ids, targets


def torch_loss_and_gradients(model, ids: np.ndarray, targets: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
    model = model.double()
    model.zero_grad()
    logits = model(torch.from_numpy(ids)).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.from_numpy(targets).reshape(-1))
    loss.backward()
    return float(loss.detach()), {n: p.grad.numpy() for n, p in model.named_parameters()}


@pytest.fixture(scope="module", params=["llama", "llama3-tied", "mistral-window", "qwen2", "qwen3"])
def family(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    model = make_model(request.param, folder)
    cfg, params = load_llama(folder, dtype="float32", max_seq=TOKENS)
    ids, targets = batch(cfg.vocab)
    return request.param, cfg, params, ids, targets, torch_loss_and_gradients(model, ids, targets)


def test_every_gradient_of_a_tiny_model_matches_transformers(family) -> None:
    name, cfg, params, ids, targets, (ref_loss, ref_grads) = family
    g = build_llama_gradients(cfg, BATCH, TOKENS)
    got = ml.evaluate(g, {"tokens": ids, "targets": targets}, params).outputs
    assert abs(float(got["loss"]) - ref_loss) <= 16 * F32_EPS * abs(ref_loss), (name, got["loss"], ref_loss)
    names = {k.removeprefix("grad.") for k in got if k.startswith("grad.")}
    assert names == set(ref_grads), f"{name}: gradients of {sorted(names ^ set(ref_grads))} missing on one side"
    for key, ref in ref_grads.items():
        assert_gradient(got[f"grad.{key}"], ref, f"{name} {key}")


@pytest.mark.parametrize("name,seed", [("llama", 0), ("qwen3", 1)])
def test_gradients_through_the_plan_interpreter_match_the_reference(name: str, seed: int, tmp_path) -> None:
    """The backward planned and run in a random legal order of its tasks, on poisoned buffers."""
    make_model(name, tmp_path)
    cfg, params = load_llama(tmp_path, dtype="float32", max_seq=TOKENS)
    ids, targets = batch(cfg.vocab)
    g = build_llama_gradients(cfg, BATCH, TOKENS)
    feeds = {"tokens": ids, "targets": targets}
    want = ml.evaluate(g, feeds, params).outputs
    got = run_plan(make_plan(g, processors=7), feeds, params, seed=seed).outputs
    for key, ref in want.items():
        assert_gradient(got[key], ref.astype(np.float64), f"{name} {key} (planned)", ulps=8.0)


def test_runs_are_bitwise_identical() -> None:
    cfg = ml.models.LlamaConfig(hidden=32, heads=4, kv_heads=2, intermediate=48, layers=1, max_seq=4, vocab=40)
    params = ml.models.random_parameters(cfg, 3)
    g = build_llama_gradients(cfg, 1, 4)
    ids, targets = np.arange(4).reshape(1, 4), np.arange(1, 5).reshape(1, 4)
    plan = make_plan(g, processors=5)
    first = run_plan(plan, {"tokens": ids, "targets": targets}, params, seed=1).outputs
    second = run_plan(plan, {"tokens": ids, "targets": targets}, params, seed=2).outputs
    for key in first:
        assert np.array_equal(first[key], second[key], equal_nan=True), key


# ---- the loss ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cross_entropy_mean_and_gradient_match_torch(dtype: str) -> None:
    rng = np.random.default_rng(5)
    logits = ml.dtypes.round_to(rng.standard_normal((3, 5, 50)) * 4, ml.as_dtype(dtype))
    targets = rng.integers(0, 50, (3, 5))
    targets[1] = 7  # a row of the ignored id: left out of the mean
    g = ml.Graph("ce")
    x = g.input("x", logits.shape, dtype)
    loss = ml.cross_entropy(x, g.input("t", targets.shape, "int64"), ignore_index=7)
    g.output("loss", loss)
    g.output("dx", ml.grad(g, loss, [x])[0])
    got = ml.evaluate(g, {"x": logits, "t": targets}).outputs
    tx = torch.from_numpy(logits.astype(np.float64)).requires_grad_(True)
    ref = F.cross_entropy(tx.reshape(-1, 50), torch.from_numpy(targets).reshape(-1), ignore_index=7)
    ref.backward()
    assert abs(float(got["loss"]) - float(ref.detach())) <= 16 * F32_EPS * abs(float(ref.detach()))
    assert got["dx"].dtype == logits.dtype
    assert_gradient(got["dx"], tx.grad.numpy(), f"cross_entropy gradient [{dtype}]", 4.0, ml.as_dtype(dtype).eps)
    assert not np.any(got["dx"][1].astype(np.float32)), "an ignored row takes no gradient"


def test_cross_entropy_of_only_ignored_targets_is_zero_not_nan() -> None:
    g = ml.Graph("ce")
    x = g.input("x", (2, 6), "float32")
    loss = ml.cross_entropy(x, g.constant(np.full((2,), -100), "int64"))
    g.output("loss", loss)
    g.output("dx", ml.grad(g, loss, [x])[0])
    got = ml.evaluate(g, {"x": np.ones((2, 6), np.float32)}).outputs
    assert float(got["loss"]) == 0.0 and not np.any(got["dx"])


def test_a_target_outside_the_vocabulary_is_a_data_error() -> None:
    g = ml.Graph("ce")
    g.output("loss", ml.cross_entropy(g.input("x", (2, 6), "float32"), g.input("t", (2,), "int64")))
    with pytest.raises(errors.DataError, match="target 6 at index"):
        ml.evaluate(g, {"x": np.zeros((2, 6), np.float32), "t": np.array([1, 6])})


# ---- the machinery ---------------------------------------------------------------------------------


def test_a_tensor_used_several_times_sums_its_gradients() -> None:
    g = ml.Graph("uses")
    x = g.input("x", (4,), "float32")
    y = ml.sum(x * x + ml.exp(x) + x)  # d/dx = 2x + e^x + 1
    g.output("dx", ml.grad(g, y, [x])[0])
    v = np.linspace(-1, 1, 4).astype(np.float32)
    got = ml.evaluate(g, {"x": v}).outputs["dx"]
    assert_gradient(got, 2 * v.astype(np.float64) + np.exp(v.astype(np.float64)) + 1, "x used three times", 4.0)


def test_a_tensor_the_loss_does_not_depend_on_gets_zeros() -> None:
    g = ml.Graph("unused")
    x, w = g.input("x", (3,), "float32"), g.parameter("w", (3,), "float32")
    grads = ml.grad(g, ml.sum(x * x), [x, w])
    g.output("dw", grads[1])
    assert not np.any(ml.evaluate(g, {"x": np.ones(3, np.float32)}, {"w": np.ones(3, np.float32)}).outputs["dw"])


def test_an_op_without_a_rule_is_refused_by_name() -> None:
    g = ml.Graph("fused")
    x = g.input("x", (4, 32), "float32")
    w = g.parameter("w", (16, 32), "float32")
    with g.scope("block"):
        y = ml.rmsnorm_linear(x, w, g.parameter("n", (32,), "float32"))
    with pytest.raises(
        errors.GraphBuildError, match=r"rmsnorm_linear block\.rmsnorm_linear_\d+ has no vector-Jacobian"
    ):
        ml.grad(g, ml.sum(y), [w])


def test_bad_arguments_are_named() -> None:
    g = ml.Graph("args")
    x = g.input("x", (3,), "float32")
    with pytest.raises(errors.ShapeError, match="not one element"):
        ml.grad(g, x * 2.0, [x])
    with pytest.raises(errors.DtypeError, match="only float tensors"):
        ml.grad(g, ml.sum(x), [g.input("i", (3,), "int64")])
    with pytest.raises(errors.GraphBuildError, match="no collective or recv"):
        ml.grad(g, None, [x])
    g = ml.Graph("seeded")
    x = g.input("x", (3,), "float32")
    seeded = ml.grad(g, x * 2.0, [x], seed=g.input("s", (3,), "float32"))[0]
    g.output("dx", seeded)
    got = ml.evaluate(g, {"x": np.ones(3, np.float32), "s": np.array([1, 2, 3], np.float32)}).outputs["dx"]
    assert np.array_equal(got, [2, 4, 6])


# ---- several ranks ---------------------------------------------------------------------------------


def mlp_loss(g: ml.Graph, x: ml.Tensor, w1: ml.Tensor, w2: ml.Tensor, reduce: bool) -> ml.Tensor:
    y = ml.linear(ml.silu(ml.linear(x, w1)), w2)
    return ml.sum(ml.all_reduce(y) if reduce else y)


def test_tensor_parallel_gradients_equal_one_devices() -> None:
    """Each rank holds half of w1's rows and w2's columns; the all_reduce's rule is an all_reduce. Every
    rank computes the same loss, so each seeds it with 1/2 (the ranks' losses are summed)."""
    rng = np.random.default_rng(0)
    xv, w1v, w2v = (rng.standard_normal(s).astype(np.float32) * 0.5 for s in ((3, 8), (6, 8), (8, 6)))
    one = ml.Graph("one")
    x, w1, w2 = (
        one.input("x", (3, 8), "float32"),
        one.parameter("w1", (6, 8), "float32"),
        one.parameter("w2", (8, 6), "float32"),
    )
    for name, t in zip(("w1", "w2"), ml.grad(one, mlp_loss(one, x, w1, w2, False), [w1, w2])):
        one.output(name, t)
    want = ml.evaluate(one, {"x": xv}, {"w1": w1v, "w2": w2v}).outputs
    graphs, params = [], []
    for r in range(2):
        g = ml.Graph("tp", rank=r, world_size=2)
        x, w1, w2 = (
            g.input("x", (3, 8), "float32"),
            g.parameter("w1", (3, 8), "float32"),
            g.parameter("w2", (8, 3), "float32"),
        )
        for name, t in zip(("w1", "w2"), ml.grad(g, mlp_loss(g, x, w1, w2, True), [w1, w2], seed=0.5)):
            g.output(name, t)
        graphs.append(g)
        params.append({"w1": w1v[3 * r : 3 * r + 3], "w2": w2v[:, 3 * r : 3 * r + 3]})
    got = ml.evaluate(graphs, [{"x": xv}] * 2, params)
    for r in range(2):
        assert_gradient(got[r].outputs["w1"], want["w1"][3 * r : 3 * r + 3].astype(np.float64), f"rank {r} w1")
        assert_gradient(got[r].outputs["w2"], want["w2"][:, 3 * r : 3 * r + 3].astype(np.float64), f"rank {r} w2")


def test_all_gather_and_reduce_scatter_are_each_others_rules() -> None:
    """sum over ranks of sum(all_gather(x_r) * c_r) has gradient (sum_r c_r)'s piece r: a reduce_scatter;
    sum over ranks of sum(reduce_scatter(x_r) * c_r) has gradient all of the c's: an all_gather."""
    rng = np.random.default_rng(1)
    c = [rng.standard_normal(4).astype(np.float32) for _ in range(2)]
    d = [rng.standard_normal(2).astype(np.float32) for _ in range(2)]
    graphs = []
    for r in range(2):
        g = ml.Graph("ag", rank=r, world_size=2)
        x, y = g.input("x", (2,), "float32"), g.input("y", (4,), "float32")
        loss = ml.sum(ml.all_gather(x) * g.constant(c[r])) + ml.sum(ml.reduce_scatter(y) * g.constant(d[r]))
        dx, dy = ml.grad(g, loss, [x, y])
        g.output("dx", dx)
        g.output("dy", dy)
        graphs.append(g)
    got = ml.evaluate(graphs, [{"x": np.ones(2, np.float32), "y": np.ones(4, np.float32)}] * 2)
    for r in range(2):
        assert np.allclose(got[r].outputs["dx"], (c[0] + c[1])[2 * r : 2 * r + 2], rtol=1e-6)
        assert np.allclose(got[r].outputs["dy"], np.concatenate(d), rtol=1e-6)


def test_a_pipeline_of_two_stages_sends_gradients_back() -> None:
    """Stage 0 sends its activation to stage 1, which has the loss; stage 0 (loss=None) receives the
    activation's gradient from stage 1 under the same tag."""
    rng = np.random.default_rng(2)
    xv, w0v, w1v = (rng.standard_normal(s).astype(np.float32) * 0.5 for s in ((4, 6), (5, 6), (3, 5)))
    one = ml.Graph("one")
    x, w0, w1 = (
        one.input("x", (4, 6), "float32"),
        one.parameter("w0", (5, 6), "float32"),
        one.parameter("w1", (3, 5), "float32"),
    )
    loss = ml.sum(ml.tanh(ml.linear(ml.tanh(ml.linear(x, w0)), w1)))
    for name, t in zip(("w0", "w1"), ml.grad(one, loss, [w0, w1])):
        one.output(name, t)
    want = ml.evaluate(one, {"x": xv}, {"w0": w0v, "w1": w1v}).outputs
    first, second = ml.Graph("s0", rank=0, world_size=2), ml.Graph("s1", rank=1, world_size=2)
    x, w0 = first.input("x", (4, 6), "float32"), first.parameter("w0", (5, 6), "float32")
    ml.send(ml.tanh(ml.linear(x, w0)), 1, tag=3)
    first.output("w0", ml.grad(first, None, [w0])[0])
    w1 = second.parameter("w1", (3, 5), "float32")
    h = ml.recv(second, 0, (4, 5), "float32", tag=3)
    second.output("w1", ml.grad(second, ml.sum(ml.tanh(ml.linear(h, w1))), [w1])[0])
    got = ml.evaluate([first, second], [{"x": xv}, {}], [{"w0": w0v}, {"w1": w1v}])
    assert_gradient(got[0].outputs["w0"], want["w0"].astype(np.float64), "stage 0's w0")
    assert_gradient(got[1].outputs["w1"], want["w1"].astype(np.float64), "stage 1's w1")


# ---- the loop kernel ---------------------------------------------------------------------------------


def test_the_training_graph_plans_and_compiles_with_nvrtc() -> None:
    """A bf16 model's forward, loss and backward in one loop kernel for sm_90a (no GPU needed)."""
    from megaloop.codegen import generate
    from megaloop.runtime.compile import compile_cubin

    cfg = ml.models.LlamaConfig(
        hidden=64, heads=4, kv_heads=2, intermediate=128, layers=1, max_seq=16, vocab=64, sliding_window=8
    )
    plan = make_plan(build_llama_gradients(cfg, 2, 16), processors=16)
    ops = {op.op for op in plan.ranks[0].ops}
    assert {"cross_entropy", "cross_entropy_grad", "matmul", "attention_grad"} <= ops
    assert compile_cubin(generate(plan).source, "sm_90a", use_cache=False)[:4] == b"\x7fELF"

"""The benchmarks' dependent-step graphs (bench/): each step's input is the previous step's output
through a state the last op writes in place, so the timed steps cannot overlap. These tests check
that the plans really have no copy in the chain and that the graphs compute what the benchmarks
claim (the CPU plan interpreter, against independent numpy / build_llama references)."""

from __future__ import annotations

import numpy as np
import pytest

import megaloop as ml
from bench import collectives, llama_layer, tp_mlp
from megaloop.models import LlamaConfig, build_llama, random_parameters
from megaloop.plan import make_plan
from megaloop.reference.interpreter import run_plan


def bf16(x: np.ndarray) -> np.ndarray:
    return ml.dtypes.round_to(x, ml.bfloat16).astype(np.float64)


@pytest.mark.parametrize("world", [2, 3])
def test_all_reduce_chain_feeds_itself_without_copies(world: int) -> None:
    n, depth = 96, 3
    plan = make_plan(collectives.chain_graphs(n, depth, world), processors=4)
    for rp in plan.ranks:
        assert [op.op for op in rp.ops] == ["all_reduce"] * depth, [op.name for op in rp.ops]
    results = run_plan(plan, iterations=2, seed=5)
    # as documented for all_reduce: float32 sums in rank order, rounded to bf16 once per all-reduce
    # (after the first, every rank holds the same y: the sum is world copies of it)
    acc = np.zeros(n, np.float32)
    for r in range(world):
        acc = acc + bf16(collectives.rank_data(r, n)).astype(np.float32)
    want = bf16(acc)
    for _ in range(2 * depth - 1):
        acc = np.zeros(n, np.float32)
        for _ in range(world):
            acc = acc + want.astype(np.float32)
        want = bf16(acc)
    for r, ev in enumerate(results):
        got = ev.outputs["y"].astype(np.float64)
        worst = np.max(np.abs(got - want))
        assert np.array_equal(got, want), f"rank {r}: worst mismatch {worst} after two iterations"


@pytest.mark.parametrize("push", [1, 0])
def test_send_recv_swap_chain_returns_each_ranks_data(push: int) -> None:
    # bench/collectives.hop_seconds checks this on the GPUs: an even chain of swaps gives each rank its
    # own data back, an odd one the other's
    for depth in (4, 3):
        plan = make_plan(collectives.swap_graphs(96, depth), processors=4, tiles={"recv": {"push": push}})
        for iterations in (1, 2):
            results = run_plan(plan, iterations=iterations, seed=3)
            for r, ev in enumerate(results):
                holder = r if iterations * depth % 2 == 0 else 1 - r
                want = bf16(collectives.rank_data(holder, 96))
                assert np.array_equal(ev.outputs["y"].astype(np.float64), want), f"depth {depth} x{iterations} rank {r}"


def test_tp_mlp_steps_feed_themselves_without_copies() -> None:
    x = np.random.default_rng(0).standard_normal((8, tp_mlp.HIDDEN), dtype=np.float32)
    for part in ("fused", "compute", "comm"):
        plan = tp_mlp.plan_of(8, part, x)  # asserts no "assign:x" copy
        kinds = [op.op for op in plan.ranks[0].ops]
        assert kinds.count("all_reduce") == {"fused": 1, "compute": 0, "comm": 2}[part], kinds
    fixed = tp_mlp.plan_of(8, "fused", x, fixed_input=True)
    assert "x" in fixed.ranks[0].graph.inputs


def test_dependent_llama_decode_is_build_llamas_step_fed_back() -> None:
    cfg = LlamaConfig(hidden=256, heads=2, kv_heads=1, intermediate=512, layers=1, max_seq=40, vocab=None)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 1, cfg.hidden)).astype(np.float32)
    params = random_parameters(cfg, seed=1)
    pos = np.array([[37]])
    plan = make_plan(llama_layer.dependent_decode_graph(cfg, x, "auto"), processors=8)
    assert not any(op.name.startswith("assign:") for op in plan.ranks[0].ops), "the step copies its state"
    got = run_plan(plan, {"positions": pos}, params, iterations=2, seed=2)
    # independent reference: build_llama's step, run twice by hand with its output fed back (the cache
    # slot at position 37 is rewritten by the second step, as in the dependent graph)
    step = build_llama(cfg, 1, 1)
    first = ml.evaluate(step, {"hidden": x, "positions": pos}, params)
    second = ml.evaluate(step, {"hidden": first.outputs["hidden"], "positions": pos}, params, state=first.state)
    want = second.outputs["hidden"]
    worst = np.max(np.abs(got.outputs["hidden"].astype(np.float64) - want.astype(np.float64)))
    assert np.array_equal(got.outputs["hidden"], want), f"worst mismatch {worst}"


@pytest.mark.parametrize("sequences", [1, 4])
def test_the_benchmarks_torch_layer_is_the_same_layer(sequences: int) -> None:
    """bench/llama_layer.py times PyTorch's layer against megaloop's: both must compute the same layer.
    On the CPU: a 24-token prefill, then a decode step over the keys it cached, bf16 torch against the
    graph's reference evaluation (float32 accumulation, rounded to bf16 an op)."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    cfg = llama_layer.layer_config(256, 1)
    params = random_parameters(cfg, seed=4)
    rng = np.random.default_rng(5)
    layer = llama_layer.TorchLayer(cfg, {k: v for k, v in params.items() if "layers" in k}, sequences, "cpu")
    final = torch.tensor(params["model.norm.weight"], dtype=torch.bfloat16)
    state = None
    for start, tokens in ((0, 24), (24, 1)):
        x = rng.standard_normal((sequences, tokens, cfg.hidden)).astype(np.float32)
        pos = np.tile(np.arange(start, start + tokens), (sequences, 1))
        ref = ml.evaluate(build_llama(cfg, sequences, tokens), {"hidden": x, "positions": pos}, params, state=state)
        state, want = ref.state, ref.outputs["hidden"].astype(np.float64)
        with torch.no_grad():
            y = layer(torch.tensor(x, dtype=torch.bfloat16), start)
            got = F.rms_norm(y, (cfg.hidden,), final, cfg.rms_eps).double().numpy()
        # both round to bf16 after every op (torch in its own order): a few bf16 ulps of the outputs
        tol = 8 * 2.0**-8 * np.abs(want).max()
        worst = np.max(np.abs(got - want))
        assert worst <= tol, f"{tokens} tokens from {start}: worst mismatch {worst} > {tol}"

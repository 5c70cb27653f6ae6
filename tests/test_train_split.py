"""ml.parallelize_training: a tiny float32 Llama trained 3 steps, split over ranks (DP2, ZeRO-1/2 over
2, TP2, PP2 with 4 micro-batches in 1F1B, PP2 x TP2, recomputation), against the same steps on one
device (losses, gradient norms, every updated weight; the one-device step itself is checked against
PyTorch by tests/test_grad.py and tests/test_optim.py); the plan interpreter bitwise run to run; the
memory account (ZeRO's optimizer state 1/N a rank); the cost model's choice under memory limits and
the refusal of one nothing fits; the ranks' kernels compiled with NVRTC for sm_90a.

Tolerances: the loss within 64 float32 eps of its value (reassociated sums over ranks); weights:
AdamW normalises each element's step to about lr, so an element whose gradient is a near-cancelling
sum (summed in another order by the split) may move by a fraction of lr more or less: 2^-10 lr a
step allowed (measured: at most 5e-4 lr); SGD (linear in the gradients) within 64 eps of the weights'
magnitude a step."""

from __future__ import annotations

import numpy as np
import pytest

import megaloop as ml
import megaloop.frontend.ops as ops
from megaloop import errors
from megaloop.models.llama import _model
from megaloop.plan import make_plan
from megaloop.reference.interpreter import run_plan

CFG = ml.models.LlamaConfig(
    hidden=32, heads=4, kv_heads=2, intermediate=48, layers=2, max_seq=8, vocab=64, dtype="float32"
)
BATCH, TOKENS, STEPS, LR = 4, 8, 3, 1e-2
F32_EPS = float(np.finfo(np.float32).eps)
ADAMW = ml.optim.OptimizerSpec("adamw", lr=LR, weight_decay=0.1)
SGD = ml.optim.OptimizerSpec("sgd", lr=0.5, momentum=0.9, max_norm=100.0)


def forward() -> ml.Graph:
    g = ml.Graph("llama-train")
    ids = g.input("tokens", (BATCH, TOKENS), "int64")
    targets = g.input("targets", (BATCH, TOKENS), "int64")
    positions = g.constant(np.tile(np.arange(TOKENS), (BATCH, 1)), "int64", name="positions")
    logits = _model(g, CFG, ids, positions, None)
    with g.scope("loss"):
        g.output("loss", ops.cross_entropy(logits, targets))
    return g


def batches() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(STEPS):
        targets = rng.integers(0, CFG.vocab, (BATCH, TOKENS))
        targets[0, :5] = -100  # padding: the mean is over the other targets of all ranks
        targets[3, :2] = -100
        out.append({"tokens": rng.integers(0, CFG.vocab, (BATCH, TOKENS)), "targets": targets})
    return out


WEIGHTS = {k: np.asarray(v, np.float32) for k, v in ml.models.random_parameters(CFG, 3).items()}


def train(split: ml.TrainingSplit, runner=None) -> tuple[list[float], list[float], dict[str, np.ndarray]]:
    """Losses, gradient norms (0 without clipping) and the weights after STEPS steps."""
    states = split.initial_state(WEIGHTS)
    losses, norms = [], []
    for step, feed in enumerate(batches()):
        if runner is None:
            res = ml.evaluate(split.graphs, split.shard_inputs(feed), None, states)
            res = res if isinstance(res, list) else [res]
        else:
            res = runner(split.shard_inputs(feed), states, step)
        out = split.gather_outputs(res)
        losses.append(float(out["loss"]))
        norms.append(float(out.get("train.grad_norm", 0.0)))
        states = [r.state for r in res]
    return losses, norms, split.gather_weights(states)


@pytest.fixture(scope="module")
def one_device():
    g = forward()
    return {name: train(ml.parallelize_training(g, "loss", spec)) for name, spec in (("adamw", ADAMW), ("sgd", SGD))}


def compare(got, want, what: str, sgd: bool) -> None:
    losses, norms, weights = got
    ref_losses, ref_norms, ref_weights = want
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    norm_err = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(norms, ref_norms))
    worst, name = 0.0, ""
    for key, ref in ref_weights.items():
        err = float(np.max(np.abs(weights[key].astype(np.float64) - ref)))
        bound = STEPS * (64 * F32_EPS * float(np.max(np.abs(ref))) if sgd else LR * 2**-10)
        if err / bound > worst:
            worst, name = err / bound, key
    print(
        f"{what}: losses {losses} vs {ref_losses}; worst loss error {loss_err:.2e} relative, grad norm "
        f"{norm_err:.2e}, worst weight {name} at {worst:.3f} of its tolerance"
    )
    assert loss_err <= 64 * F32_EPS, f"{what}: losses {losses} against one device's {ref_losses}"
    assert norm_err <= 64 * F32_EPS, f"{what}: gradient norms {norms} against one device's {ref_norms}"
    assert worst <= 1.0, f"{what}: weight {name} off by {worst:.2f}x the tolerance"


CASES = [
    ("dp", 2, "adamw", {}),
    ("zero1", 2, "adamw", {}),
    ("zero2", 2, "adamw", {}),
    ("tp", 2, "adamw", {}),
    ("pp", 2, "adamw", {"micro_batches": 4}),
    ("pp2xtp2", 4, "adamw", {"micro_batches": 4}),
    ("dp", 2, "sgd", {"recompute": True}),
    ("zero2_2xtp2", 4, "sgd", {}),
    ("pp", 2, "sgd", {"micro_batches": 2, "recompute": True}),
]


@pytest.mark.parametrize(
    ("strategy", "devices", "opt", "kw"),
    CASES,
    ids=[f"{c[0]}-{c[2]}" + ("-recompute" if c[3].get("recompute") else "") for c in CASES],
)
def test_a_split_trains_like_one_device(one_device, strategy, devices, opt, kw) -> None:
    spec = ADAMW if opt == "adamw" else SGD
    split = ml.parallelize_training(forward(), "loss", spec, devices=devices, strategy=strategy, **kw)
    assert split.world_size == devices
    compare(train(split), one_device[opt], f"{split.summary()}", opt == "sgd")


def test_the_plan_interpreter_runs_the_ranks_bitwise_alike_run_to_run(one_device) -> None:
    """PP2 (1F1B gates) and ZeRO-2: planned, run in random legal orders of their tasks; two runs of
    different orders give the same bits, and match one device's steps."""
    for strategy, kw in (("pp", {"micro_batches": 2}), ("zero2", {})):
        split = ml.parallelize_training(forward(), "loss", ADAMW, devices=2, strategy=strategy, **kw)
        plan = make_plan(split.graphs, processors=4)
        runs = [
            train(split, lambda feeds, states, step, s=seed, p=plan: run_plan(p, feeds, None, states, seed=s + step))
            for seed in (1, 7)
        ]
        assert runs[0][0] == runs[1][0], strategy
        for key in runs[0][2]:
            assert np.array_equal(runs[0][2][key], runs[1][2][key]), f"{strategy} {key} differs run to run"
        compare(runs[0], one_device["adamw"], f"{strategy} on the plan interpreter", False)


def test_zero_keeps_a_share_of_the_optimizer_state_on_each_rank() -> None:
    one = ml.parallelize_training(forward(), "loss", ADAMW)
    dp = ml.parallelize_training(forward(), "loss", ADAMW, devices=2, strategy="dp")
    """Moments and float32 master weights: 1/N a rank (a float32 model has no master on one device:
    its weights are; a shard's master is the rank's float32 copy of its piece)."""
    counter = 8  # the step counter every rank keeps whole
    full = one.memory[0].optimizer - counter + one.memory[0].parameters  # moments + float32 master
    for stage in (1, 2):
        z = ml.parallelize_training(forward(), "loss", ADAMW, devices=2, strategy=f"zero{stage}")
        for r, m in enumerate(z.memory):
            print(
                f"zero{stage} rank {r}: optimizer {m.optimizer} B of one device's {full + counter}, "
                f"gradients {m.gradients}"
            )
            assert (m.optimizer - counter) <= full / 2 + 3 * 4 * len(z.buckets), (stage, r, m)  # (padding)
            assert m.parameters == one.memory[0].parameters
        grads = [m.gradients for m in z.memory]
        assert (
            all(x <= dp.memory[0].gradients / 2 + 64 for x in grads)
            if stage == 2
            else grads == [dp.memory[0].gradients] * 2
        )
    assert [m.optimizer for m in dp.memory] == [one.memory[0].optimizer] * 2


def test_the_cost_models_choice_changes_with_the_memory_limit() -> None:
    g = forward()
    free = ml.parallelize_training(g, "loss", ADAMW, devices=2)
    limit = free.peak_bytes - 1
    tight = ml.parallelize_training(g, "loss", ADAMW, devices=2, memory_per_device=limit)
    print(free.describe().split("\n\n")[1], "\n->", tight.summary())
    assert tight.options.strategy != free.options.strategy
    assert tight.peak_bytes <= limit < free.peak_bytes
    assert "does not fit" in tight.describe()


def test_a_memory_limit_nothing_fits_is_refused_naming_what_does_not_fit() -> None:
    with pytest.raises(errors.PartitionMemoryError, match=r"(?s)too little.*parameters.*optimizer states.*largest is"):
        ml.parallelize_training(forward(), "loss", ADAMW, devices=2, memory_per_device=50_000)
    with pytest.raises(errors.PartitionMemoryError, match="dp2 needs"):
        ml.parallelize_training(forward(), "loss", ADAMW, devices=2, strategy="dp", memory_per_device=200_000)


def test_bad_arguments_are_named() -> None:
    g = forward()
    with pytest.raises(errors.GraphBuildError, match="not one of"):
        ml.parallelize_training(g, "loss", ADAMW, devices=2, strategy="fsdp")
    with pytest.raises(errors.GraphBuildError, match="no output 'los'"):
        ml.parallelize_training(g, "los", ADAMW, devices=2)
    with pytest.raises(errors.GraphBuildError, match="OptimizerSpec"):
        ml.parallelize_training(g, "loss", {"lr": 1.0}, devices=2)
    with pytest.raises(errors.GraphBuildError, match="uses 4 devices"):
        ml.parallelize_training(g, "loss", ADAMW, devices=2, strategy="pp2xtp2")


def test_options_round_trip_and_1f1b_orders_the_chains() -> None:
    split = ml.parallelize_training(forward(), "loss", SGD, devices=2, strategy="pp", micro_batches=4)
    d = split.options.as_dict()
    assert d["axes"] == [["pp", 2]] and d["micro_batches"] == 4 and d["optimizer"]["kind"] == "sgd"
    assert ml.optim.OptimizerSpec.from_dict(d["optimizer"]) == SGD
    # stage 0 keeps 2 chains in flight: chain 2's embedding waits for a backward node
    g = split.graphs[0]
    embeds = [n for n in g.nodes if n.op.name == "embedding" and any(t.node.op.name == "input" for t in n.inputs)]
    assert len(embeds) == 4
    late = embeds[2].outputs[0]
    users = [n for n in g.nodes if late in n.inputs]
    gated = [u for u in users if u.op.name == "where" and u.scope.startswith("pipeline_1f1b")]
    assert gated, "chain 2's forward on stage 0 is not held for chain 0's backward"
    assert any("1F1B" in n for n in split.notes)


def test_the_ranks_kernels_compile_with_nvrtc() -> None:
    """Each rank's training step planned (ZeRO-2, PP2 in 1F1B, TP2); the kernels of ZeRO-2's rank 0
    (reduce-scatter, shard update, all-gather) and of the pipeline's last stage (recvs, loss, sends
    back, the gates) compiled for sm_90a (no GPU needed; two kernels: NVRTC takes ~40 s each here)."""
    from megaloop.codegen import generate
    from megaloop.runtime.compile import compile_many

    cfg = ml.models.LlamaConfig(hidden=64, heads=4, kv_heads=2, intermediate=128, layers=2, max_seq=16, vocab=64)
    g = ml.Graph("llama-train")
    ids, targets = g.input("tokens", (4, 16), "int64"), g.input("targets", (4, 16), "int64")
    logits = _model(g, cfg, ids, g.constant(np.tile(np.arange(16), (4, 1)), "int64", name="positions"), None)
    g.output("loss", ops.cross_entropy(logits, targets))
    sources = []
    for strategy, kw in (("zero2", {}), ("pp", {"micro_batches": 2}), ("tp", {})):
        split = ml.parallelize_training(g, "loss", ADAMW, devices=2, strategy=strategy, **kw)
        plan = make_plan(split.graphs, processors=16)
        if strategy != "tp":
            sources.append(generate(plan, 0 if strategy == "zero2" else 1).source)
    cubins = compile_many(sources, "sm_90a")
    assert all(c[:4] == b"\x7fELF" for c in cubins)

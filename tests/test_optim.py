"""Optimizers in the loop kernel (megaloop.optim; ops in megaloop/frontend/ops/optim.py, optim_norm.py)
against PyTorch as the independent reference: torch.optim.AdamW and SGD, torch.nn.utils.clip_grad_norm_,
transformers' warmup schedules (LambdaLRs) and gradient accumulation done the usual way (grads summed
over micro-batches, divided by their number). Several steps on random parameters and gradients, float32
and bfloat16 parameters with float32 master weights, on the numpy reference and through the plan
interpreter (random legal orders, several iterations of one plan: the step counter advancing in state);
plans verified and their kernels compiled with NVRTC (no GPU needed).

Tolerances: each optimizer step does a handful of float32 roundings on each side (torch's arithmetic in
float32, the reference in float64 rounded once), so after step s a value may differ by about 4 (s + 1)
float32 ulps of its magnitude (the moments' and the parameters'); a 16-bit parameter is its master
rounded, so within one ulp of its own dtype of torch's master rounded."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from transformers import (
    get_constant_schedule_with_warmup,
    get_cosine_with_min_lr_schedule_with_warmup,
    get_linear_schedule_with_warmup,
)

import megaloop as ml
from megaloop.codegen import generate
from megaloop.plan import make_plan
from megaloop.reference.interpreter import run_plan
from megaloop.runtime.compile import compile_cubin

SHAPES = [(48, 40), (96,), (7, 3, 5), ()]
F32_EPS = float(np.finfo(np.float32).eps)


def graph_with(shapes, dtype: str, grad_dtype: str, attach, name: str = "train"):
    """A graph whose parameters p0.. (states of ``dtype``) take gradients g0.. (inputs of ``grad_dtype``)
    through ``attach(graph, params, grads)``; the graph outputs the optimizer's lr (and norm)."""
    g = ml.Graph(name)
    params = {f"p{i}": g.state(f"p{i}", s, dtype) for i, s in enumerate(shapes)}
    grads = {f"p{i}": g.input(f"g{i}", s, grad_dtype) for i, s in enumerate(shapes)}
    opt = attach(g, params, grads)
    g.output("lr", opt.lr)
    if opt.grad_norm is not None:
        g.output("norm", opt.grad_norm)
    return g, opt


def draw(rng: np.random.Generator, shapes, dtype: str, scale: float = 1.0) -> list[np.ndarray]:
    return [ml.dtypes.round_to(rng.standard_normal(s) * scale, ml.as_dtype(dtype)) for s in shapes]


def f32(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float64)


def check(what: str, ours, ref, ulps: float, eps: float = F32_EPS) -> None:
    """|ours - ref| <= ulps * eps * (|ref| + mean |ref|), the worst element printed."""
    ours, ref = f32(ours), f32(ref)
    assert ours.shape == ref.shape, f"{what}: shape {ours.shape} vs {ref.shape}"
    bound = ulps * eps * (np.abs(ref) + np.mean(np.abs(ref)) + 1e-30)
    err = np.abs(ours - ref)
    worst = np.unravel_index(np.argmax(err / bound), err.shape) if err.size else ()
    ratio = float((err / bound)[worst]) if err.size else 0.0
    print(f"{what}: worst error {float(err[worst]) if err.size else 0:.3g} = {ratio:.3f} of the tolerance")
    assert ratio <= 1.0, f"{what}: at {worst} ours {ours[worst]} torch {ref[worst]} (error {ratio:.2f}x the tolerance)"


def torch_params(values: list[np.ndarray]) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.tensor(f32(v), dtype=torch.float32)) for v in values]


def run_steps(g, opt, weights, grads_per_step, *, interpret: bool = False, seed: int = 0, master=None):
    """Our states after each step (the gradients fed as inputs), on the reference or the interpreter;
    ``master``: the float32 values of 16-bit ``weights``."""
    init = opt.initial_state(dict(enumerate_params(weights if master is None else master)))
    state = {**{f"p{i}": w for i, w in enumerate(weights)}, **init}
    plan = make_plan(g, processors=5) if interpret else None
    out = []
    for k, grads in enumerate(grads_per_step):
        feeds = {f"g{i}": x for i, x in enumerate(grads)}
        r = run_plan(plan, feeds, state=state, seed=seed + k) if interpret else ml.evaluate(g, feeds, state=state)
        state = r.state
        out.append((r.state, r.outputs))
    return out


def enumerate_params(weights):
    return ((f"p{i}", w) for i, w in enumerate(weights))


# ---- AdamW ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("interpret", [False, True], ids=["reference", "plan-interpreter"])
def test_adamw_matches_torch(dtype: str, interpret: bool) -> None:
    """AdamW with weight decay and a warmup-cosine schedule, 5 steps; 16-bit parameters keep float32
    master weights, their gradients in bfloat16 (mixed precision)."""
    rng = np.random.default_rng(1)
    total, warmup, lr, min_lr = 8, 2, 1e-2, 1e-3
    sched = ml.optim.Schedule(total=total, warmup=warmup, min_lr=min_lr)
    attach = lambda g, p, gr: ml.optim.adamw(
        g, p, gr, lr=lr, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, schedule=sched
    )
    g, opt = graph_with(SHAPES, dtype, dtype, attach)
    assert set(opt.masters) == ({"p0", "p1", "p2", "p3"} if dtype == "bfloat16" else set())
    master = draw(rng, SHAPES, "float32")
    weights = [ml.dtypes.round_to(w, ml.as_dtype(dtype)) for w in master]
    steps = [draw(rng, SHAPES, dtype, 0.5) for _ in range(5)]
    init = opt.initial_state(dict(enumerate_params(master)))
    state = {**{f"p{i}": w for i, w in enumerate(weights)}, **init}
    plan = make_plan(g, processors=5) if interpret else None

    tp = torch_params(master)
    topt = torch.optim.AdamW(tp, lr=lr, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    tsched = get_cosine_with_min_lr_schedule_with_warmup(topt, warmup, total, min_lr=min_lr)
    for s, grads in enumerate(steps):
        expected_lr = topt.param_groups[0]["lr"]
        feeds = {f"g{i}": x for i, x in enumerate(grads)}
        r = run_plan(plan, feeds, state=state, seed=s) if interpret else ml.evaluate(g, feeds, state=state)
        state = r.state
        for p, x in zip(tp, grads):
            p.grad = torch.tensor(f32(x), dtype=torch.float32)
        topt.step()
        tsched.step()
        check(f"step {s} lr", r.outputs["lr"], expected_lr, 1)
        for i, p in enumerate(tp):
            ts = topt.state[p]
            held = state[f"optim.master.p{i}"] if dtype == "bfloat16" else state[f"p{i}"]
            check(f"step {s} p{i}", held, p.detach().numpy(), 4 * (s + 1))
            check(f"step {s} m{i}", state[f"optim.m.p{i}"], ts["exp_avg"].numpy(), 4 * (s + 1))
            check(f"step {s} v{i}", state[f"optim.v.p{i}"], ts["exp_avg_sq"].numpy(), 4 * (s + 1))
            if dtype == "bfloat16":  # the forward's copy: the master rounded, within a bf16 ulp of torch's
                assert np.array_equal(f32(state[f"p{i}"]), f32(ml.dtypes.round_to(held, ml.bfloat16)))
                check(f"step {s} p{i} bf16", state[f"p{i}"], p.detach().numpy(), 1, float(ml.bfloat16.eps))
    assert int(state["optim.step"]) == len(steps)


def test_iterations_of_one_plan_are_optimizer_steps() -> None:
    """iterations=N on the reference and the plan interpreter: N steps with the same gradients, no host
    work between them, bit for bit the N separate runs."""
    rng = np.random.default_rng(2)
    attach = lambda g, p, gr: ml.optim.adamw(g, p, gr, lr=3e-3, schedule=ml.optim.Schedule(total=10, warmup=1))
    g, opt = graph_with(SHAPES[:2], "bfloat16", "bfloat16", attach)
    master = draw(rng, SHAPES[:2], "float32")
    state = {**{f"p{i}": ml.dtypes.round_to(w, ml.bfloat16) for i, w in enumerate(master)}}
    state.update(opt.initial_state(dict(enumerate_params(master))))
    feeds = {f"g{i}": x for i, x in enumerate(draw(rng, SHAPES[:2], "bfloat16"))}
    once = ml.evaluate(g, feeds, state=state, iterations=4).state
    stepwise = state
    for _ in range(4):
        stepwise = ml.evaluate(g, feeds, state=stepwise).state
    plan = make_plan(g, processors=7)
    for seed in (0, 1):
        interpreted = run_plan(plan, feeds, state=state, iterations=4, seed=seed).state
        for name in once:
            assert np.array_equal(once[name], stepwise[name]), name
            assert np.array_equal(once[name], interpreted[name]), f"{name} (interleaving {seed})"
    assert int(once["optim.step"]) == 4
    tp = torch_params(master)
    topt = torch.optim.AdamW(tp, lr=3e-3)
    tsched = torch.optim.lr_scheduler.LambdaLR(
        topt, lambda s: s if s < 1 else 0.5 * (1 + math.cos(math.pi * min(1.0, (s - 1) / 9)))
    )
    for _ in range(4):
        for p, i in zip(tp, range(2)):
            p.grad = torch.tensor(f32(feeds[f"g{i}"]), dtype=torch.float32)
        topt.step()
        tsched.step()
    for i, p in enumerate(tp):
        check(f"p{i} after 4 iterations", once[f"optim.master.p{i}"], p.detach().numpy(), 16)


# ---- SGD ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "momentum,nesterov,dampening,decay",
    [(0.0, False, 0.0, 0.0), (0.0, False, 0.0, 0.05), (0.9, False, 0.0, 0.01), (0.9, True, 0.0, 0.01)]
    + [(0.8, False, 0.3, 0.0)],
)
def test_sgd_matches_torch(momentum: float, nesterov: bool, dampening: float, decay: float) -> None:
    rng = np.random.default_rng(3)
    attach = lambda g, p, gr: ml.optim.sgd(
        g, p, gr, lr=0.05, momentum=momentum, nesterov=nesterov, dampening=dampening, weight_decay=decay
    )
    g, opt = graph_with(SHAPES, "float32", "float32", attach)
    weights = draw(rng, SHAPES, "float32")
    steps = [draw(rng, SHAPES, "float32") for _ in range(4)]
    settings = {"momentum": momentum, "nesterov": nesterov, "dampening": dampening, "weight_decay": decay}
    for interpret in (False, True):
        results = run_steps(g, opt, weights, steps, interpret=interpret)
        tp = torch_params(weights)
        topt = torch.optim.SGD(tp, lr=0.05, **settings)
        for s, (grads, (state, _)) in enumerate(zip(steps, results)):
            for p, x in zip(tp, grads):
                p.grad = torch.tensor(f32(x), dtype=torch.float32)
            topt.step()
            for i, p in enumerate(tp):
                check(f"step {s} p{i} (interpreter {interpret})", state[f"p{i}"], p.detach().numpy(), 4 * (s + 1))
                if momentum:
                    buf = topt.state[p]["momentum_buffer"].numpy()
                    check(f"step {s} buf{i}", state[f"optim.momentum.p{i}"], buf, 4 * (s + 1))


# ---- clipping, accumulation, schedules ----------------------------------------------------------------------


@pytest.mark.parametrize("max_norm", [0.5, 1e6], ids=["clipped", "not-clipped"])
def test_global_norm_clipping_matches_clip_grad_norm(max_norm: float) -> None:
    """The norm over every gradient (large ones in many ranges of rows, tiled over the processors) and
    the scale it gives, as torch.nn.utils.clip_grad_norm_ then SGD."""
    shapes = [(300, 257), (5,), (64, 2, 3), ()]  # 300 rows: square_sum splits it into ranges
    rng = np.random.default_rng(4)
    attach = lambda g, p, gr: ml.optim.sgd(g, p, gr, lr=0.1, max_norm=max_norm)
    g, opt = graph_with(shapes, "float32", "bfloat16", attach)
    splits = [n.attrs["splits"] for n in g.nodes if n.op.name == "square_sum"]
    assert splits[0] > 1, splits
    weights = draw(rng, shapes, "float32")
    steps = [draw(rng, shapes, "bfloat16") for _ in range(2)]
    for interpret in (False, True):
        results = run_steps(g, opt, weights, steps, interpret=interpret)
        tp = torch_params(weights)
        topt = torch.optim.SGD(tp, lr=0.1)
        for s, (grads, (state, outputs)) in enumerate(zip(steps, results)):
            for p, x in zip(tp, grads):
                p.grad = torch.tensor(f32(x), dtype=torch.float32)
            norm = torch.nn.utils.clip_grad_norm_(tp, max_norm)
            topt.step()
            n = sum(int(np.prod(x)) for x in shapes)
            check(f"step {s} norm", outputs["norm"], norm.item(), 2 * math.sqrt(n))
            for i, p in enumerate(tp):
                check(f"step {s} p{i}", state[f"p{i}"], p.detach().numpy(), 8 * (s + 1) * math.sqrt(n) ** 0.5)


def test_gradient_accumulation_matches_summed_micro_batches() -> None:
    """accumulate=3 with clipping and AdamW: 9 iterations (micro-batches, each its own gradients) are 3
    updates of the mean gradient; the parameters stay as they are between updates."""
    rng = np.random.default_rng(5)
    k = 3
    shapes = SHAPES[:3]
    attach = lambda g, p, gr: ml.optim.adamw(g, p, gr, lr=1e-2, max_norm=2.0, accumulate=k)
    g, opt = graph_with(shapes, "bfloat16", "bfloat16", attach)
    master = draw(rng, shapes, "float32")
    weights = [ml.dtypes.round_to(w, ml.bfloat16) for w in master]
    micro = [draw(rng, shapes, "bfloat16") for _ in range(3 * k)]
    results = run_steps(g, opt, weights, micro, interpret=True, seed=7, master=master)
    state0 = {f"optim.master.p{i}": w for i, w in enumerate(master)}
    tp = torch_params(master)
    topt = torch.optim.AdamW(tp, lr=1e-2)
    for j, grads in enumerate(micro):
        for p, x in zip(tp, grads):
            t = torch.tensor(f32(x), dtype=torch.float32)
            p.grad = t if p.grad is None else p.grad + t
        state, outputs = results[j]
        if (j + 1) % k:
            for i in range(len(shapes)):  # between updates: as before
                before = results[j - 1][0] if j else state0
                assert np.array_equal(state[f"optim.master.p{i}"], before[f"optim.master.p{i}"])
            continue
        for p in tp:
            p.grad /= k
        norm = torch.nn.utils.clip_grad_norm_(tp, 2.0)
        topt.step()
        topt.zero_grad(set_to_none=True)
        update = (j + 1) // k
        check(f"update {update} norm", outputs["norm"], norm.item(), 64)
        for i, p in enumerate(tp):
            check(f"update {update} p{i}", state[f"optim.master.p{i}"], p.detach().numpy(), 8 * update)
            check(f"update {update} m{i}", state[f"optim.m.p{i}"], topt.state[p]["exp_avg"].numpy(), 8 * update)


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
def test_lr_schedule_matches_transformers_schedules(kind: str) -> None:
    """lr_schedule's value for counters 0..total+3 (and with accumulation, each update's micro-batches)
    against transformers' LambdaLR schedules; past the end the cosine and linear ones stay at min_lr."""
    lr, warmup, total = 3e-4, 4, 20
    min_lr = 3e-5 if kind == "cosine" else 0.0
    model = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    make = {
        "cosine": lambda o: get_cosine_with_min_lr_schedule_with_warmup(o, warmup, total, min_lr=min_lr),
        "linear": lambda o: get_linear_schedule_with_warmup(o, warmup, total),
        "constant": lambda o: get_constant_schedule_with_warmup(o, warmup),
    }[kind]
    sched = make(model)
    expected = []
    for _ in range(total + 1):
        expected.append(model.param_groups[0]["lr"])
        model.step()
        sched.step()
    expected += [min_lr if kind != "constant" else lr] * 3
    for k in (1, 2):
        g = ml.Graph("lr")
        c = g.input("c", (), "int64")
        g.output("lr", ml.lr_schedule(c, lr=lr, total=total, warmup=warmup, min_lr=min_lr, kind=kind, accumulate=k))
        plan = make_plan(g, processors=2)
        for s, want in enumerate(expected):
            for micro in range(k):
                counter = np.array(s * k + micro, np.int64)
                got = ml.evaluate(g, {"c": counter}).outputs["lr"]
                assert got == np.float32(want), f"{kind}: update {s} micro-batch {micro}: {got} vs {want}"
                if s % 7 == 0:
                    assert run_plan(plan, {"c": counter}).outputs["lr"] == got


# ---- plans and kernels --------------------------------------------------------------------------------------


def full_step_graph(dtype: str) -> ml.Graph:
    """An AdamW step with clipping, accumulation and a schedule, and an SGD step beside it; a transposed
    gradient's norm (square_sum's strided path)."""
    shapes = [(64, 48), (48,), (3, 5, 7), ()]

    def attach(g, p, gr):
        sched = ml.optim.Schedule(total=100, warmup=10, min_lr=1e-5)
        return ml.optim.adamw(g, p, gr, lr=1e-3, schedule=sched, max_norm=1.0, accumulate=2)

    g, _ = graph_with(shapes, dtype, dtype, attach)
    params = {f"q{i}": g.state(f"q{i}", s, "float32") for i, s in enumerate(shapes)}
    grads = {f"q{i}": g.input(f"h{i}", s, "float32") for i, s in enumerate(shapes)}
    ml.optim.sgd(g, params, grads, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4, prefix="sgd")
    g.output("transposed_norm", ml.square_sum(grads["q0"].mT, 5))
    return g


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_training_step_plans_verify_and_compile(dtype: str) -> None:
    """The plan verifies (make_plan runs the verifier), updates write their states in place (no copies
    but the counter's), and the kernel compiles for sm_90a and sm_80 with the optimizer's tiles."""
    g = full_step_graph(dtype)
    plan = make_plan(g, processors=16)
    copies = [op.name for op in plan.ranks[0].ops if op.op == "copy"]
    assert copies == ["assign:optim.step", "assign:sgd.step"], copies
    src = generate(plan).source
    for call in ("adam_moment<", "adamw_update<", "grad_accumulate<", "sgd_momentum<", "sgd_update<", "square_sum<"):
        assert f"ml::opt::{call}" in src, call
    assert "ml::opt::lr_schedule(" in src
    assert re.search(r"ml::opt::square_sum<48, 10, false, ml::opt::Dims<64>>", src)  # (the strided path)
    for arch in ("sm_90a", "sm_80") if dtype == "bfloat16" else ("sm_90a",):  # (float16: the op table's kernels)
        assert compile_cubin(src, arch, use_cache=False)[:4] == b"\x7fELF"


def test_errors_name_the_op_and_what_to_do() -> None:
    g = ml.Graph("bad")
    p = g.state("p", (4,), "float32")
    x = g.input("x", (4,), "float32")
    c = g.state("c", (), "int64")
    with pytest.raises(ml.errors.GraphBuildError, match="adam_moment: state must be a graph state"):
        ml.adam_moment(x, x, c, beta=0.9)
    with pytest.raises(ml.errors.DtypeError, match="counter must be an int64"):
        ml.adam_moment(p, x, g.state("c32", (), "int32"), beta=0.9)
    with pytest.raises(ml.errors.ShapeError, match="grad must be of shape"):
        ml.adam_moment(p, g.input("y", (5,), "float32"), c, beta=0.9)
    with pytest.raises(ml.errors.GraphBuildError, match=r"beta is 1\.5"):
        ml.adam_moment(p, x, c, beta=1.5)
    with pytest.raises(ml.errors.GraphBuildError, match="must be a state of graph"):
        ml.optim.adamw(g, {"x": x}, {"x": x}, lr=1e-3)
    with pytest.raises(ml.errors.GraphBuildError, match="same names"):
        ml.optim.sgd(g, {"p": p}, {"q": x}, lr=1e-3)
    ml.adam_moment(p, x, c, beta=0.9)
    with pytest.raises(ml.errors.GraphBuildError, match="already receives"):
        ml.adamw_update(p, p, p, c, lr=1e-3)
    h = ml.Graph("negative")
    q, cc = h.state("q", (4,), "float32"), h.input("c", (), "int64")
    ml.adam_moment(q, h.input("x", (4,), "float32"), cc, beta=0.9)
    with pytest.raises(ml.errors.DataError, match="step counter is -1"):
        ml.evaluate(h, {"x": np.ones(4), "c": np.array(-1)})


def test_weight_decay_by_parameter_matches_torch_param_groups() -> None:
    """No decay for 1-D parameters (norms, biases), as torch users make param groups."""
    rng = np.random.default_rng(6)
    shapes = [(12, 8), (8,)]
    decay = {"p0": 0.1, "p1": 0.0}
    g, opt = graph_with(
        shapes, "float32", "float32", lambda g, p, gr: ml.optim.adamw(g, p, gr, lr=0.05, weight_decay=decay)
    )
    weights = draw(rng, shapes, "float32")
    steps = [draw(rng, shapes, "float32") for _ in range(3)]
    results = run_steps(g, opt, weights, steps)
    tp = torch_params(weights)
    topt = torch.optim.AdamW(
        [{"params": [tp[0]], "weight_decay": 0.1}, {"params": [tp[1]], "weight_decay": 0.0}], lr=0.05
    )
    for s, (grads, (state, _)) in enumerate(zip(steps, results)):
        for p, x in zip(tp, grads):
            p.grad = torch.tensor(f32(x), dtype=torch.float32)
        topt.step()
        for i, p in enumerate(tp):
            check(f"step {s} p{i}", state[f"p{i}"], p.detach().numpy(), 4 * (s + 1))
    with pytest.raises(ml.errors.GraphBuildError, match="missing \\['p1'\\]"):
        graph_with(
            shapes, "float32", "float32", lambda g, p, gr: ml.optim.adamw(g, p, gr, lr=0.1, weight_decay={"p0": 0.1})
        )

"""The elementwise_chain rule and fused_elementwise (megaloop/fuse/rules/elementwise_chain.py, megaloop/
frontend/ops/fused_elementwise.py) without a GPU: random trees of elementwise ops over float, bfloat16,
int and bool values (numbers among the operands, broadcast operands, casts) fused, then checked bit for
bit against the plain graph on the reference and in the plan interpreter's random orders; where the
rule must not take a node; the generated kernels compile for sm_90a and sm_80; a serving step's
bookkeeping fused into fewer ops. On a GPU (marked): the loop kernel's bits against the plain graph."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

import megaloop as ml
from megaloop.codegen import generate
from megaloop.plan import make_plan
from megaloop.reference.interpreter import run_plan
from megaloop.runtime.compile import compile_cubin

ON = ml.FuseOptions(on=("elementwise_chain",))


def ops_of(g: ml.Graph) -> Counter:
    return Counter(n.op.name for n in g.nodes if n.op.kind != "source")


def random_tree(seed: int, steps: int = 9) -> ml.Graph:
    """Inputs of each kind, then ``steps`` random elementwise ops over what is there, the last value (and
    now and then another) an output."""
    rng = np.random.default_rng(seed)
    g = ml.Graph(f"tree{seed}")
    pools: dict[str, list[ml.Tensor]] = {
        "float32": [g.input("f", (4, 6), "float32"), g.input("fr", (4, 1), "float32")],
        "bfloat16": [g.input("h", (4, 6), "bfloat16")],
        "int64": [g.input("i", (4, 6), "int64"), g.input("ic", (1, 6), "int64")],
        "bool": [g.input("m", (4, 6), "bool")],
    }
    last = None
    for _ in range(steps):
        kind = str(rng.choice(["arith", "compare", "logic", "where", "cast", "number"]))
        if kind == "logic":
            a, b = (pools["bool"][int(rng.integers(len(pools["bool"])))] for _ in range(2))
            out, dt = (ml.logical_and if rng.random() < 0.5 else ml.logical_or)(a, b), "bool"
        elif kind == "where":
            dt = str(rng.choice(["float32", "int64", "bfloat16"]))
            c = pools["bool"][int(rng.integers(len(pools["bool"])))]
            out = ml.where(c, pools[dt][int(rng.integers(len(pools[dt])))], pools[dt][-1])
        elif kind == "cast":
            src = str(rng.choice(["float32", "int64", "bool", "bfloat16"]))
            dt = str(rng.choice(["float32", "bfloat16", "bool"] + (["int64"] if src != "float32" else [])))
            if src == "bfloat16" and dt == "int64":
                dt = "float32"
            out = ml.cast(pools[src][int(rng.integers(len(pools[src])))], dt)
        else:
            dt = str(rng.choice(["float32", "int64", "bfloat16"]))
            a = pools[dt][int(rng.integers(len(pools[dt])))]
            b = pools[dt][int(rng.integers(len(pools[dt])))] if kind != "number" else (3 if dt == "int64" else 0.7)
            if kind == "compare":
                out, dt = (ml.less if rng.random() < 0.5 else ml.equal)(a, b), "bool"
            else:
                fn = [ml.add, ml.sub, ml.mul, ml.maximum, ml.minimum][int(rng.integers(5))]
                out = fn(a, b)
        pools[dt].append(out)
        last = out
        if rng.random() < 0.15:
            g.output(f"o{len(g.outputs)}", out)
    g.output("last", last)
    return g


def feeds(g: ml.Graph, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, t in g.inputs.items():
        if t.dtype.is_bool:
            out[name] = rng.random(t.shape) < 0.5
        elif t.dtype.is_int:
            out[name] = rng.integers(-3, 4, t.shape)
        else:
            out[name] = rng.integers(-4, 5, t.shape) * 0.37 + rng.standard_normal(t.shape) * 0.01
    return out


@pytest.mark.parametrize("seed", range(16))
def test_random_trees_fuse_bit_for_bit(seed: int) -> None:
    plain = random_tree(seed)
    fused = ml.fuse(plain, ON)
    before, after = ops_of(plain), ops_of(fused)
    print(f"ops {sum(before.values())} -> {sum(after.values())} ({after['fused_elementwise']} fused)")
    assert sum(after.values()) <= sum(before.values())
    inputs = feeds(plain, seed + 100)
    want, got = ml.evaluate(plain, inputs), ml.evaluate(fused, inputs)
    for name in want.outputs:
        assert got.outputs[name].tobytes() == want.outputs[name].tobytes(), name
    plan = make_plan(plain, processors=3, fusion=ON)
    for order in range(2):
        ran = run_plan(plan, inputs, {}, {}, seed=order)
        for name in want.outputs:
            assert ran.outputs[name].tobytes() == want.outputs[name].tobytes(), f"plan, order {order}: {name}"


def test_the_trees_fuse_somewhere() -> None:
    """Across the random trees the rule takes many ops (values read twice stay results of their own)."""
    before = after = 0
    for seed in range(16):
        plain = random_tree(seed)
        before += sum(ops_of(plain).values())
        after += sum(ops_of(ml.fuse(plain, ON)).values())
    print(f"ops over 16 trees: {before} -> {after}")
    assert before - after >= 20


def chain(kept: bool = False, shared: bool = False, broadcast: bool = False, split: bool = False) -> ml.Graph:
    g = ml.Graph("chain")
    x, n = g.input("x", (4, 6), "float32"), g.input("n", (4, 1) if broadcast else (4, 6), "float32")
    u = ml.maximum(n * 2.0, 0.0)  # (4, 1) where broadcast: the root's shape is not its
    y = ml.add(x, u)
    if kept:
        g.output("u", u)
    if split:  # (u read by two trees: each of them an output)
        g.output("z", ml.mul(x, u))
    g.output("y", y if not shared else y + ml.exp(u))
    return g


@pytest.mark.parametrize(
    "graph,fused_ops",
    [(chain(), 1), (chain(kept=True), 2), (chain(shared=True), 1), (chain(broadcast=True), 2), (chain(split=True), 3)],
    ids=["chain", "intermediate-kept", "intermediate-shared", "intermediate-broadcast", "intermediate-in-two-trees"],
)  # fmt: skip
def test_what_the_rule_takes(graph: ml.Graph, fused_ops: int) -> None:
    """A chain is one op, an intermediate read by two ops of the tree too (computed once in it); one read
    as an output, by two trees, or of another shape than its reader's, stays an op's result (a root of
    its own)."""
    fused = ml.fuse(graph, ON)
    assert sum(ops_of(fused).values()) == fused_ops, ops_of(fused)
    inputs = feeds(graph, 1)
    want, got = ml.evaluate(graph, inputs), ml.evaluate(fused, inputs)
    assert all(got.outputs[k].tobytes() == want.outputs[k].tobytes() for k in want.outputs)


def test_off_by_default() -> None:
    g = chain()
    assert ml.fuse(g).nodes == g.nodes or not ops_of(ml.fuse(g))["fused_elementwise"]


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_kernels_compile(arch: str) -> None:
    """Trees of up to 8 operands (the lambda's a .. h), in packs and element by element."""
    for seed in (3, 7):
        plan = make_plan(random_tree(seed, steps=14), processors=4, fusion=ON, arch=arch.removesuffix("a"))
        source = generate(plan).source
        assert "ml::stored<" in source or "fused_elementwise" in source
        assert compile_cubin(source, arch)


def test_the_serving_steps_bookkeeping_takes_fewer_ops() -> None:
    """The decode step of one slot (megaloop/serving/step.py, a tiny model): its elementwise ops over the
    slots fused into fewer, the step's values bit for bit through the plan interpreter."""
    from megaloop.models import LlamaConfig
    from megaloop.serving.step import StepShape, build_serving_programs

    cfg = LlamaConfig(vocab=64, hidden=32, intermediate=64, layers=1, heads=4, kv_heads=2, max_seq=32)
    shape = StepShape(slots=2, chunk=4, page_size=4, pages=16, max_seq=32)
    g = build_serving_programs(cfg, shape, (), (2,))["decode_2"]
    before, after = ops_of(g), ops_of(ml.fuse(g, ON))
    elementwise = sum(n for op, n in before.items() if op in ("less", "equal", "logical_and", "cast", "mul", "where"))
    print(f"ops {sum(before.values())} -> {sum(after.values())}; {elementwise} small elementwise ops before")
    assert sum(after.values()) <= sum(before.values()) - 8


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(6))
def test_the_loop_kernel_gives_the_plain_graphs_bits(seed: int) -> None:
    """GPU: the fused trees' kernel (ml::stored between steps, up to 8 operands) against the plain graph's
    reference, bit for bit."""
    from megaloop.runtime.device import gpus
    from megaloop.runtime.loop import LoopKernel

    found, reason = gpus()
    if not found:
        pytest.skip(f"no GPU: {reason}")
    plain = random_tree(seed, steps=14)
    inputs = feeds(plain, seed)
    want = ml.evaluate(plain, inputs)
    with LoopKernel(make_plan(plain, processors=found[0].sm_count, fusion=ON)) as kernel:
        got = kernel.run(inputs)
    for name in want.outputs:
        assert got[name].tobytes() == want.outputs[name].tobytes(), name


def test_the_rule_runs_after_every_other() -> None:
    """Other rules' patterns hold elementwise ops (silu_mul, norm_residual, rope's positions): they go first."""
    from megaloop.fuse import ordered_rules

    assert [r.name for r in ordered_rules()][-1] == "elementwise_chain"

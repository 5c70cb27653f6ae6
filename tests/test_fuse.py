"""The fuse stage (megaloop/fuse): each rule on small graphs built from plain ops, where it must fire and
where it must not (another reader of a value it would drop, too many rows for a decode-only fusion,
positions that differ, ...). Every rewrite is checked against the unfused reference: ``ml.evaluate``
of the plain graph and of the fused one bit for bit (the two rules that change roundings within a
tolerance of the dtype instead, and bit for bit in float32 where that holds), and the plan interpreter
of the plan ``make_plan`` fuses (random legal task orders) bit for bit against the fused graph.
FuseOptions: parsing, the plan option, errors. The Llama models: tests/test_fuse_llama.py."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest

import megaloop as ml
from megaloop.errors import GraphBuildError
from megaloop.fuse import RULES, ordered_rules
from megaloop.plan import make_plan
from megaloop.reference.interpreter import run_plan
from tests.helpers import random_values
from tests.test_plan_interpreter import small_tiles


def ops_of(g: ml.Graph) -> Counter:
    return Counter(n.op.name for n in g.nodes if n.op.kind != "source")


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[ml.Graph, ml.DType], None]  # adds inputs, ops and outputs to the graph
    rule: str  # the rule the case is about
    fires: bool
    changes: dict[str, int]  # op -> count in the fused graph minus in the plain one, where it fires
    also: tuple[str, ...] = ()  # the other rules that run with it

    @property
    def options(self) -> ml.FuseOptions:
        return ml.FuseOptions.only(self.rule, *self.also)


def _x(g: ml.Graph, dt: ml.DType, rows: int = 1, batch: int = 1, k: int = 64, name: str = "x") -> ml.Tensor:
    return g.input(name, (batch, rows, k), dt)


def _w(g: ml.Graph, dt: ml.DType, name: str, n: int = 48, k: int = 64) -> ml.Tensor:
    return g.parameter(name, (n, k), dt)


def residual_norm(share: bool = False, scalar: bool = False, layer: bool = False, broadcast: bool = False):
    def build(g: ml.Graph, dt: ml.DType) -> None:
        x, u = _x(g, dt, 3), _x(g, dt, 3, name="u")
        if broadcast:
            u = g.input("b", (64,), dt)
        s = x + 0.5 if scalar else x + u
        if layer:
            y = ml.layernorm(s, g.parameter("w", (64,), dt), g.parameter("b0", (64,), dt), eps=1e-5)
        else:
            y = ml.rmsnorm(s, g.parameter("w", (64,), dt), eps=1e-5)
        g.output("y", y)
        if share:  # the stream goes on: the add stays beside the norm
            g.output("stream", s * 2.0)

    return build


def norm_linear(rows: int = 1, batch: int = 1, other_reader: bool = False, weight: bool = True, residual=False):
    def build(g: ml.Graph, dt: ml.DType) -> None:
        x = _x(g, dt, rows, batch)
        r = _x(g, dt, rows, batch, name="r") if residual else None
        h = ml.rmsnorm(x, g.parameter("n", (64,), dt) if weight else None, eps=1e-5, residual=r)
        for i in range(3):
            g.output(f"y{i}", ml.linear(h, _w(g, dt, f"w{i}", 32 + 16 * i)))
        if other_reader:
            g.output("h", h * 2.0)

    return build


def swiglu(rows: int = 1, normed: bool = False, gate_read: bool = False, bias: bool = False, silu_mul: bool = True):
    def build(g: ml.Graph, dt: ml.DType) -> None:
        x = _x(g, dt, rows)
        if normed:
            x = ml.rmsnorm(x, g.parameter("n", (64,), dt), eps=1e-5)
        bg = g.parameter("bg", (48,), dt) if bias else None
        gate, up = ml.linear(x, _w(g, dt, "wg"), bg), ml.linear(x, _w(g, dt, "wu"))
        y = ml.silu_mul(gate, up) if silu_mul else ml.silu(gate) * up
        g.output("y", ml.linear(y, _w(g, dt, "wd", 64, 48)))
        if gate_read:
            g.output("gate", gate)

    return build


def silu_times(order: int = 0, shared: bool = False):
    def build(g: ml.Graph, dt: ml.DType) -> None:
        a, b = _x(g, dt, 3, name="a"), _x(g, dt, 3, name="b")
        s = ml.silu(a)
        g.output("y", s * b if order == 0 else b * s)
        if shared:
            g.output("s", s)

    return build


def decode_attention(
    tokens: int = 1,
    splits: int | None = 3,
    shift: int = 0,
    read_k: bool = False,
    lengths: bool = False,
):
    """q, k rotated at the positions, the caches written there, attention over them (plain)."""

    def build(g: ml.Graph, dt: ml.DType) -> None:
        b, hq, hkv, d, slots = 2, 4, 2, 16, 12
        pos = g.input("pos", (b, tokens), "int64")
        q = g.input("q", (b, hq, tokens, d), dt)
        k = g.input("k", (b, hkv, tokens, d), dt)
        v = g.input("v", (b, hkv, tokens, d), dt)
        rpos = (pos + shift if shift else pos).reshape(b, 1, tokens)
        kc, vc = (g.state(n, (b, hkv, slots, d), dt) for n in ("kc", "vc"))
        k_roped = ml.rope(k, rpos, theta=500.0)
        k_all = ml.kv_cache_update(kc, k_roped, pos)
        v_all = ml.kv_cache_update(vc, v, pos)
        extra = {"kv_lengths": g.input("len", (b,), "int64")} if lengths else {}
        o = ml.attention(
            ml.rope(q, pos.reshape(b, 1, tokens), theta=500.0), k_all, v_all, causal=True, q_positions=pos,
            kv_splits=splits, **extra,
        )  # fmt: skip
        g.output("o", ml.linear(o.transpose(1, 2).reshape(b, tokens, hq * d), _w(g, dt, "wo", 32, hq * d)))
        if read_k:
            g.output("k_roped", k_roped)

    return build


def paged_write(shift: int = 0, read_k: bool = False, clamp: bool = True):
    """k rotated at each row's position (clamped at 0, as a serving step builds it) and written into a
    paged pool, v written, attention over both (plain)."""

    def build(g: ml.Graph, dt: ml.DType) -> None:
        t, hkv, d = 3, 2, 16
        pos, slot = g.input("pos", (1, t), "int64"), g.input("slot", (1, t), "int64")
        table = g.state("table", (1, 4), "int64")
        q = g.input("q", (1, 2 * hkv, t, d), dt)
        k, v = g.input("k", (1, hkv, t, d), dt), g.input("v", (1, hkv, t, d), dt)
        rpos = ml.maximum(pos, 0) if clamp else pos
        k_roped = ml.rope(k, (rpos + shift if shift else rpos).reshape(1, 1, t), theta=500.0)
        kp, vp = (g.state(n, (4, hkv, 4, d), dt) for n in ("kp", "vp"))
        k_all = ml.paged_kv_cache_update(kp, k_roped, table, slot, pos)
        v_all = ml.paged_kv_cache_update(vp, v, table, slot, pos)
        g.output("o", ml.paged_attention(q, k_all, v_all, table, slot, pos))
        if read_k:
            g.output("k_roped", k_roped)

    return build


def small_ops(single: bool = False):
    """A serving step's bookkeeping in miniature: comparisons, logic, a cast and a where over [S, 1]."""

    def build(g: ml.Graph, dt: ml.DType) -> None:
        length, limit = g.input("length", (3, 1), "int64"), g.input("limit", (3, 1), "int64")
        x = g.input("x", (3, 1), dt)
        if single:
            g.output("y", ml.less(length, limit))
            return
        active = ml.logical_and(ml.less(length, limit), ml.equal(limit - length, 1))
        g.output("y", ml.where(active, ml.cast(x, "float32") * 2.0, -1.0))

    return build


def split_products(rows: int = 32, n: int = 64, k: int = 1024, batch: int = 1):
    def build(g: ml.Graph, dt: ml.DType) -> None:
        x = _x(g, dt, rows, batch, k)
        g.output("y", ml.linear(x, _w(g, dt, "w", n, k), g.parameter("bias", (n,), dt)))

    return build


def empty_operand(concat: bool = False):
    """A sum over an empty axis (its zeros no data decides), or a concat with an empty piece."""

    def build(g: ml.Graph, dt: ml.DType) -> None:
        x = g.input("x", (3, 0), dt)
        y = ml.concat([x, g.input("y", (3, 2), dt)], 1) if concat else ml.sum(x, 1)
        g.output("y", y * 2.0)

    return build


PAGED_CHANGES = {"rope": -1, "paged_kv_cache_update": -1, "rope_paged_kv_cache_update": 1}
CASES = [
    Case("residual", residual_norm(), "norm_residual", True, {"add": -1}),
    Case("residual-kept-add", residual_norm(share=True), "norm_residual", True, {}),
    Case("residual-layernorm", residual_norm(layer=True), "norm_residual", True, {"add": -1}),
    Case("residual-not-scalar", residual_norm(scalar=True), "norm_residual", False, {}),
    Case("residual-not-broadcast", residual_norm(broadcast=True), "norm_residual", False, {}),
    Case("norm-linear", norm_linear(), "rmsnorm_linear", True, {"rmsnorm": -1, "matmul": -3, "rmsnorm_linear": 3}),
    Case("norm-linear-residual", norm_linear(residual=True), "rmsnorm_linear", True, {"rmsnorm_linear": 3}),
    Case("norm-linear-4-rows", norm_linear(rows=4), "rmsnorm_linear", True, {"rmsnorm_linear": 3}),
    Case("norm-linear-not-5-rows", norm_linear(rows=5), "rmsnorm_linear", False, {}),
    Case("norm-linear-not-2-sequences", norm_linear(batch=2), "rmsnorm_linear", False, {}),
    Case("norm-linear-not-other-reader", norm_linear(other_reader=True), "rmsnorm_linear", False, {}),
    Case("norm-linear-not-unweighted", norm_linear(weight=False), "rmsnorm_linear", False, {}),
    Case("swiglu", swiglu(), "swiglu_linear", True, {"silu_mul": -1, "matmul": -2, "swiglu_linear": 1}),
    Case("swiglu-normed", swiglu(normed=True), "swiglu_linear", True, {"rmsnorm": -1}, ("rmsnorm_linear",)),
    Case("swiglu-silu-times-up", swiglu(silu_mul=False), "swiglu_linear", True, {"silu": -1}, ("silu_mul",)),
    Case("swiglu-not-gate-read", swiglu(gate_read=True), "swiglu_linear", False, {}),
    Case("swiglu-not-bias", swiglu(bias=True), "swiglu_linear", False, {}),
    Case("swiglu-not-many-rows", swiglu(rows=16), "swiglu_linear", False, {}),
    Case("silu-mul", silu_times(), "silu_mul", True, {"silu": -1, "mul": -1, "silu_mul": 1}),
    Case("silu-mul-other-order", silu_times(order=1), "silu_mul", True, {"silu_mul": 1}),
    Case("silu-mul-not-shared", silu_times(shared=True), "silu_mul", False, {}),
    Case("rope-cache", decode_attention(splits=None), "rope_kv_cache_update", True, {"rope_kv_cache_update": 1}),
    Case("rope-cache-not-prefill", decode_attention(tokens=3, splits=None), "rope_kv_cache_update", False, {}),
    Case("rope-cache-not-read-k", decode_attention(splits=None, read_k=True), "rope_kv_cache_update", False, {}),
    Case("append", decode_attention(), "attention_append", True, {"rope": -2, "rope_kv_cache_update": 1}),
    Case("append-not-unsplit", decode_attention(splits=None), "attention_append", False, {}),
    Case("append-not-shifted", decode_attention(shift=1), "attention_append", False, {}),
    Case("append-not-lengths", decode_attention(lengths=True), "attention_append", False, {}),
    Case("rope-paged", paged_write(), "rope_paged_kv_cache_update", True, PAGED_CHANGES),
    Case("rope-paged-unclamped", paged_write(clamp=False), "rope_paged_kv_cache_update", True, PAGED_CHANGES),
    Case("rope-paged-not-shifted", paged_write(shift=1), "rope_paged_kv_cache_update", False, {}),
    Case("rope-paged-not-read-k", paged_write(read_k=True), "rope_paged_kv_cache_update", False, {}),
    Case("elementwise-chain", small_ops(), "elementwise_chain", True, {"fused_elementwise": 1, "less": -1}),
    Case("elementwise-chain-not-one-op", small_ops(single=True), "elementwise_chain", False, {}),
    Case("split-k", split_products(), "split_k_linear", True, {"sum": 1}),
    Case("split-k-two-sequences", split_products(batch=2), "split_k_linear", True, {"sum": 1}),
    Case("split-k-not-decode", split_products(rows=1), "split_k_linear", False, {}),
    Case("split-k-not-wide", split_products(n=8192, k=1024, rows=64), "split_k_linear", False, {}),
    Case("split-k-not-short-k", split_products(k=512), "split_k_linear", False, {}),
    Case("empty-sum", empty_operand(), "empty_inputs", True, {"sum": -1}),
    Case("empty-piece-of-concat", empty_operand(concat=True), "empty_inputs", False, {}),
]


def _feeds(g: ml.Graph, dt: ml.DType, rng: np.random.Generator) -> tuple[dict, dict]:
    inputs = {}
    for name, t in g.inputs.items():
        if t.dtype.is_int:
            rows = t.shape[0]
            inputs[name] = (
                np.array([5, 11], np.int64)[:rows, None] + np.arange(t.shape[-1]) * 0
                if name == "pos" and t.shape[-1] == 1
                else np.tile(np.arange(t.shape[-1]) + 2, (rows, 1)).astype(np.int64)
            )
            if name == "len":
                inputs[name] = np.array([12, 9], np.int64)
            if name == "slot":  # (every row of a paged write in slot 0)
                inputs[name] = np.zeros(t.shape, np.int64)
        else:
            inputs[name] = random_values(rng, t.shape, t.dtype)
    params = {n: random_values(rng, t.shape, t.dtype) * (0.2 if t.ndim == 2 else 1.0) for n, t in g.parameters.items()}
    return inputs, params


def _plain(case: Case, dt: ml.DType) -> ml.Graph:
    g = ml.Graph(case.name)
    case.build(g, dt)
    return g


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_each_rule_fires_where_it_should_and_keeps_the_values(case: Case, dtype: str) -> None:
    dt = ml.as_dtype(dtype)
    plain = _plain(case, dt)
    before = [n.op.name for n in plain.nodes]
    fused = ml.fuse(plain, case.options)
    assert [n.op.name for n in plain.nodes] == before, "fuse changed the graph it was given"
    delta = ops_of(fused)
    delta.subtract(ops_of(plain))
    if not case.fires:
        assert fused is plain, f"{case.rule} fired: {dict(delta)}"
        return
    assert fused is not plain and all(delta[op] == n for op, n in case.changes.items()), dict(delta)
    inputs, params = _feeds(plain, dt, np.random.default_rng(7))
    state = {n: random_values(np.random.default_rng(8), t.shape, t.dtype) for n, t in plain.states.items()}
    if "table" in state:  # (a paged pool's table: its pages in order)
        state["table"] = np.arange(state["table"].size).reshape(state["table"].shape)
    want = ml.evaluate(plain, inputs, params, state)
    got = ml.evaluate(fused, inputs, params, state)
    for name in want.outputs:
        a, b = got.outputs[name].astype(np.float64), want.outputs[name].astype(np.float64)
        exact = not any(RULES[r].differs for r in (case.rule, *case.also) if r != "silu_mul" or dtype != "float32")
        if exact:
            assert got.outputs[name].tobytes() == want.outputs[name].tobytes(), f"{name}: worst {np.abs(a - b).max()}"
        else:  # a rounding more or fewer, carried through a product over K (split-K: float32 sums reordered)
            k = plain.inputs["x"].shape[-1] if case.rule == "split_k_linear" else 64
            worst, bound = np.abs(a - b).max(), 4 * dt.eps * np.sqrt(k) * np.abs(b).max()
            assert worst <= bound, f"{name}: worst difference {worst:.3e} above {bound:.3e} ({dtype}, K {k})"
    for name in want.state:
        assert got.state[name].tobytes() == want.state[name].tobytes(), f"state {name} differs"
    tiles = {} if case.rule == "split_k_linear" else small_tiles([fused])  # (K of 1024: default tiles, fewer tasks)
    plan = make_plan(plain, processors=4, tiles=tiles, fusion=case.options)
    assert ops_of(plan.ranks[0].graph) == ops_of(fused)
    for seed in range(2):  # the plan interpreter in random legal orders: the fused graph's values
        ran = run_plan(plan, inputs, params, state, seed=seed)
        for name in got.outputs:
            assert ran.outputs[name].tobytes() == got.outputs[name].tobytes(), f"plan, seed {seed}: {name}"


def test_every_rule_has_cases_that_fire_and_cases_that_do_not() -> None:
    for rule in ordered_rules():
        fired = {c.fires for c in CASES if c.rule == rule.name}
        assert fired == {True, False}, f"{rule.name}: cases that fire: {fired}"


def test_the_rules_that_change_roundings_say_so() -> None:
    """All rewrites keep the plain ops' values bit for bit but these two, which say how they differ."""
    assert {r.name for r in ordered_rules() if r.differs} == {"silu_mul", "split_k_linear"}


def test_rules_compose_and_fusing_twice_changes_nothing() -> None:
    """The norm inside swiglu_linear (rmsnorm_linear's takes_norm after swiglu_linear) with its residual
    (norm_residual first), and silu * mul (silu_mul before swiglu_linear); a fused graph fuses to itself."""
    g = ml.Graph("mlp")
    x, u = _x(g, ml.bfloat16), _x(g, ml.bfloat16, name="u")
    h = ml.rmsnorm(x + u, g.parameter("n", (64,), ml.bfloat16), eps=1e-5)
    gate, up = ml.linear(h, _w(g, ml.bfloat16, "wg")), ml.linear(h, _w(g, ml.bfloat16, "wu"))
    g.output("y", ml.silu(gate) * up)
    fused = ml.fuse(g)
    (node,) = [n for n in fused.nodes if n.op.kind != "source"]
    assert node.op.name == "swiglu_linear" and [t.name for t in node.inputs] == ["x", "wg", "wu", "n", "u"]
    assert ml.fuse(fused) is fused
    assert ml.fuse(g, ml.FuseOptions.none()) is g


def test_fused_nodes_take_the_place_and_scope_of_what_they_replace() -> None:
    g = ml.Graph("order")
    x = _x(g, ml.float32)
    with g.scope("first"):
        a = ml.linear(ml.rmsnorm(x, g.parameter("n", (64,), ml.float32), eps=1e-5), _w(g, ml.float32, "w1"))
    with g.scope("second"):
        b = ml.relu(a)
    g.output("y", b)
    fused = ml.fuse(g)
    assert [(n.op.name, n.scope) for n in fused.nodes if n.op.kind != "source"] == [
        ("rmsnorm_linear", "first"),
        ("relu", "second"),
    ]
    assert len({n.name for n in fused.nodes}) == len(fused.nodes)  # (names stay unique)


def test_rules_off_by_default_run_when_named(monkeypatch) -> None:
    """A rule registered with default=False (an experiment) runs only when asked for: on=..., "+name"."""
    monkeypatch.setitem(RULES, "split_k_linear", dataclasses.replace(RULES["split_k_linear"], default=False))
    assert not ml.FuseOptions().applies("split_k_linear")
    for options in (
        ml.FuseOptions(on=("split_k_linear",)),
        ml.FuseOptions.parse("+split_k_linear,-silu_mul"),
        ml.FuseOptions.only("split_k_linear"),
        ml.FuseOptions().adding("split_k_linear"),
    ):
        assert options.applies("split_k_linear"), options
    assert not ml.FuseOptions(on=("split_k_linear",)).without("split_k_linear").applies("split_k_linear")
    assert not ml.FuseOptions(enabled=False, on=("split_k_linear",)).applies("split_k_linear")


def test_fuse_options_parse_and_refuse_unknown_rules() -> None:
    every = [r.name for r in ordered_rules()]
    assert ml.FuseOptions.parse("all") == ml.FuseOptions.parse("") == ml.FuseOptions()
    assert ml.FuseOptions.parse("none") == ml.FuseOptions.none() and not ml.FuseOptions.none().applies("silu_mul")
    assert ml.FuseOptions.parse("-split_k_linear, -attention_append").off == ("attention_append", "split_k_linear")
    only = ml.FuseOptions.parse("rmsnorm_linear,swiglu_linear")
    assert [n for n in every if only.applies(n)] == ["swiglu_linear", "rmsnorm_linear"]
    assert ml.FuseOptions().without("silu_mul") == ml.FuseOptions(off=("silu_mul",))
    with pytest.raises(GraphBuildError, match=r"unknown rule 'norms'; the rules are attention_append, "):
        ml.FuseOptions.parse("norms")
    with pytest.raises(GraphBuildError, match=r"either name the rules to run or, each with a leading '-' or '\+'"):
        ml.FuseOptions.parse("silu_mul,-split_k_linear")
    with pytest.raises(GraphBuildError, match=r"fuse: options\.off: unknown rule 'fold'"):
        ml.fuse(ml.Graph("g"), ml.FuseOptions(off=("fold",)))
    g = ml.Graph("g")
    g.output("y", g.input("x", (2,), ml.float32) * 2.0)
    with pytest.raises(GraphBuildError, match=r"plan: fusion must be a megaloop\.FuseOptions, got str"):
        make_plan(g, fusion="all")  # type: ignore[arg-type]
    with pytest.raises(GraphBuildError, match="a list of rule names, got the string"):
        ml.FuseOptions(off="silu_mul")  # type: ignore[arg-type]


def test_a_tile_override_of_a_node_the_stage_replaced_says_so() -> None:
    g = _plain(CASES[5], ml.float32)  # rmsnorm and three products of one row: rmsnorm_linear
    name = next(n.name for n in g.nodes if n.op.name == "matmul")
    with pytest.raises(GraphBuildError, match=r"name neither an op .* the fuse stage replaced is gone"):
        make_plan(g, tiles={name: {"block_n": 16}})
    plan = make_plan(g, tiles={name: {"block_n": 16}}, fusion=ml.FuseOptions(off=("rmsnorm_linear",)))
    assert any(op.name == name and op.tile["block_n"] == 16 for op in plan.ranks[0].ops)

"""Splits that divide the work (issue 35): each rank's graphs hold only its share of the parameters,
the states and the work (checked on the rank graphs' shapes and bytes), the results stay those of
one device on the plan interpreter (pp and dp bitwise, tp float32 within 1e-5), and describe() and
auto say what a split divides and whether it beats one device."""

from __future__ import annotations

import re

import numpy as np
import pytest

import megaloop as ml
from megaloop.models import LlamaConfig, build_llama, build_llama_generator, random_parameters
from megaloop.models.llama import build_llama_prefill
from megaloop.plan import make_plan
from megaloop.reference.interpreter import run_plan
from tests.helpers import worst_error_text

TP_TOL = 1e-5  # float32: tp only reorders sums (docs/partition.md)


def _tiny(**kw) -> LlamaConfig:
    base = dict(hidden=64, heads=4, kv_heads=2, intermediate=96, layers=4, vocab=80, max_seq=16, dtype="float32")
    return LlamaConfig(**{**base, **kw})


def _check(split, g, feeds, params, state=None, iterations=1, exact=True, interleavings=3) -> None:
    """The split's outputs and states on the plan interpreter against one device's ml.evaluate:
    bitwise (``exact``) or within TP_TOL relative."""
    want = ml.evaluate(g, feeds, params, state or {}, iterations=iterations)
    plan = make_plan(split.graphs, processors=2)
    for seed in range(interleavings):
        ranks = run_plan(
            plan, split.shard_inputs(feeds), split.shard_parameters(params), split.shard_state(state or {}),
            iterations=iterations, seed=seed,
        )  # fmt: skip
        ranks = ranks if isinstance(ranks, list) else [ranks]  # (one rank: one Evaluation)
        got = {**split.gather_outputs(ranks), **split.gather_state([r.state for r in ranks])}
        for name, ref in [*want.outputs.items(), *want.state.items()]:
            if exact or ref.dtype.kind in "iub":
                assert np.array_equal(got[name], ref), f"{split.plan.label} {name}: " + worst_error_text(got[name], ref)
            else:
                err = np.abs(got[name].astype(np.float64) - ref).max() / max(np.abs(ref).max(), 1e-30)
                assert err <= TP_TOL, f"{split.plan.label} {name}: {err:.2e}; " + worst_error_text(got[name], ref)


def _matmul_rows(g: ml.Graph) -> int:
    """Rows the rank's products make (every matmul-like op's output rows, over its batch axes)."""
    names = ("matmul", "rmsnorm_linear", "swiglu_linear")
    return sum(int(np.prod(n.outputs[0].shape[:-1])) for n in g.nodes if n.op.name in names)


def _pieces(split, kind: str) -> list[dict[str, list]]:
    """Per rank: for each original source name of ``kind``, the boxes of the pieces the rank holds."""
    out = []
    for part in split.parts:
        mine: dict[str, list] = {}
        for info in part.sources.values():
            if info.kind == kind:
                mine.setdefault(info.name, []).append(info.box)
        out.append(mine)
    return out


def _bytes(g: ml.Graph, kind: str) -> int:
    return sum(t.nbytes for t in (g.parameters if kind == "parameter" else g.states).values())


# ---- dp: the prefill's sequences ---------------------------------------------------------------------


def test_dp_prefill_cuts_every_sequence_tensor() -> None:
    """generate's prefill (build_llama_prefill: tokens, positions, caches and ``last``) under dp2: each
    rank gets half the sequences of every input and cache and makes half the rows of every product
    (main cut only ``last`` and ran the whole prefill on both ranks); no exchange; bitwise one device's."""
    cfg = _tiny()
    g = build_llama_prefill(cfg, 2, 6)
    split = ml.parallelize(g, 2, "dp")
    for rank in split.graphs:
        assert {k: v.shape[0] for k, v in rank.inputs.items()} == {"tokens": 1, "positions": 1, "last": 1}
        assert all(v.shape[0] == 1 for v in rank.states.values()), {k: v.shape for k, v in rank.states.items()}
        assert 2 * _bytes(rank, "state") == _bytes(g, "state")
        assert 2 * _matmul_rows(rank) == _matmul_rows(g), (_matmul_rows(rank), _matmul_rows(g))
        assert not [n for n in rank.nodes if n.op.kind == "collective"]
    assert "data parallel over 2: by sequences" in split.describe()
    rng = np.random.default_rng(0)
    feeds = {
        "tokens": rng.integers(0, 80, (2, 6)),
        "positions": np.tile(np.arange(6), (2, 1)),
        "last": np.array([5, 2]),
    }
    _check(split, g, feeds, random_parameters(cfg, 1))
    # the caches pinned by the sequence: what dp does anyway, accepted
    pinned = ml.parallelize(g, 2, "dp", layout={"model.layers.0.self_attn.k_cache": ml.Shard(0), "tokens": ml.Shard(0)})
    assert pinned.graphs[0].states["model.layers.0.self_attn.k_cache"].shape[0] == 1


def test_generate_dp_splits_the_prefill_by_sequences() -> None:
    """What ``generate --strategy dp`` builds (generation.split.Split): the prefill's ranks hold half
    the sequences, its split line says so and shows the one-device prediction beside the split's."""
    from megaloop.generation.split import Split

    cfg = _tiny()
    params = random_parameters(cfg, 0)
    split = Split(build_llama_prefill(cfg, 4, 5), build_llama_generator(cfg, 4), params, 2, "dp")
    for rank in split.prefill.graphs:
        assert rank.inputs["tokens"].shape == (2, 5) and 2 * _matmul_rows(rank) == _matmul_rows(split.prefill.original)
    line = split.summary()
    assert re.search(r"prefill dp2 \(data parallel over 2: by sequences\), [\d.]+ us a step predicted against "
                     r"[\d.]+ us on one device", line), line  # fmt: skip


# ---- pp: balanced stages ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["generator", "prefill"])
def test_pp_stages_hold_half_the_layers(kind: str) -> None:
    """pp2 of the self-feeding generator and of the prefill: each stage holds about half the layers
    (parameters, caches, products; main put everything before the argmax on rank 0), the results
    bitwise one device's over several iterations."""
    cfg = _tiny()
    rng = np.random.default_rng(1)
    if kind == "generator":
        g, feeds, state, iterations = (
            build_llama_generator(cfg, 1),
            {},
            {"token": np.array([[3]]), "position": np.array([[2]])},
            3,
        )
    else:
        g, state, iterations = build_llama_prefill(cfg, 1, 6), {}, 1
        feeds = {"tokens": rng.integers(0, 80, (1, 6)), "positions": np.arange(6)[None], "last": np.array([4])}
    split = ml.parallelize(g, 2, "pp")
    layers = [{int(m) for name in r.parameters for m in re.findall(r"layers\.(\d+)\.", name)} for r in split.graphs]
    assert layers == [{0, 1}, {2, 3}], layers
    caches = [{int(m) for name in r.states for m in re.findall(r"layers\.(\d+)\.", name)} for r in split.graphs]
    assert caches == layers, caches
    for rank in split.graphs:
        assert 0.3 <= _bytes(rank, "parameter") / _bytes(g, "parameter") <= 0.7
        assert 0.3 <= _matmul_rows(rank) / _matmul_rows(g) <= 0.7
    assert "pipeline over 2: by layers" in split.describe()
    _check(split, g, feeds, random_parameters(cfg, 2), state, iterations)


def test_pp_of_a_1b_generator_fits_a_memory_cap_a_balanced_split_meets() -> None:
    """Planning only: a Llama-3.2-1B-shaped generator (2.36 GiB on one device, tied embeddings) under
    2 GiB a device: pp2 fits, each stage with its half of the layers (main refused: it put every
    layer on rank 0)."""
    cfg = LlamaConfig(hidden=2048, heads=32, kv_heads=8, intermediate=8192, layers=16, vocab=128256, max_seq=2048,
                      head_dim=64, tie_word_embeddings=True)  # fmt: skip
    g = build_llama_generator(cfg, 1)
    assert _bytes(g, "parameter") + _bytes(g, "state") > 2 * 2**30
    split = ml.parallelize(g, 2, "pp", memory_per_device=2 * 2**30)
    assert max(split.predicted.memory_bytes) <= 2 * 2**30
    layers = [{int(m) for name in r.parameters for m in re.findall(r"layers\.(\d+)\.", name)} for r in split.graphs]
    assert not layers[0] & layers[1] and layers[0] | layers[1] == set(range(16))
    assert all(6 <= len(x) <= 10 for x in layers), layers


# ---- tp: a parameter once a rank, heads that line up ----------------------------------------------------


@pytest.mark.parametrize("build", ["decode", "generator", "prefill"])
def test_tied_embeddings_are_stored_once_a_rank(build: str) -> None:
    """The LM head tied to the embedding under tp2: each rank holds one piece of the table, half of it
    (main: the whole table and a vocabulary half); every parameter is held once a rank."""
    cfg = _tiny(tie_word_embeddings=True, layers=2)
    g = {"decode": lambda: build_llama(cfg, 1, 1), "generator": lambda: build_llama_generator(cfg, 1),
         "prefill": lambda: build_llama_prefill(cfg, 1, 5)}[build]()  # fmt: skip
    split = ml.parallelize(g, 2, "tp")
    table = g.parameters["model.embed_tokens.weight"]
    for r, held in enumerate(_pieces(split, "parameter")):
        assert all(len(boxes) == 1 for boxes in held.values()), {k: v for k, v in held.items() if len(v) > 1}
        mine = [t for t in split.graphs[r].parameters.values() if t.name.startswith("model.embed_tokens")]
        assert len(mine) == 1 and 2 * mine[0].nbytes == table.nbytes, [(t.name, t.shape) for t in mine]
    rng = np.random.default_rng(3)
    params = random_parameters(cfg, 4)
    if build == "decode":
        cache = {
            f"model.layers.{i}.self_attn.{k}_cache": rng.standard_normal((1, 2, 16, 16)) for i in range(2) for k in "kv"
        }
        _check(split, g, {"tokens": np.array([[7]]), "positions": np.array([[5]])}, params, cache, exact=False)
    elif build == "generator":
        state = {"token": np.array([[11]]), "position": np.array([[1]])}
        _check(split, g, {}, params, state, iterations=3, exact=False)
    else:
        feeds = {"tokens": rng.integers(0, 80, (1, 5)), "positions": np.arange(5)[None], "last": np.array([4])}
        _check(split, g, feeds, params, exact=False)


@pytest.mark.parametrize("tokens", [1, 6], ids=["decode", "prefill"])
def test_tp2_of_9_heads_over_3_kv_heads_splits_them_6_and_3(tokens: int) -> None:
    """A SmolLM2-135M-shaped attention (9 query heads, 3 kv heads) under forced tp2: rank 0 runs 6 query
    heads on 2 kv heads' caches, rank 1 3 on 1, nothing gathered back (main gathered q/k/v on the
    decode step and ran attention and every cache whole on both ranks); float32 within 1e-5."""
    cfg = LlamaConfig(
        hidden=144, heads=9, kv_heads=3, intermediate=96, layers=2, vocab=80, max_seq=128, dtype="float32"
    )
    g = build_llama(cfg, 1, tokens)
    split = ml.parallelize(g, 2, "tp")
    for rank, (q_heads, kv_heads) in zip(split.graphs, [(6, 2), (3, 1)]):
        attn = [n for n in rank.nodes if n.op.name in ("attention", "attention_partial")]
        assert attn and all(n.inputs[0].shape[1] == q_heads for n in attn), [n.inputs[0].shape for n in attn]
        caches = {k: v.shape for k, v in rank.states.items()}
        assert all(shape[1] == kv_heads for shape in caches.values()), caches
        assert not [n for n in rank.nodes if n.op.name == "all_gather"], "q, k or v gathered back"
    assert sum(_bytes(r, "state") for r in split.graphs) == _bytes(g, "state")
    rng = np.random.default_rng(5)
    cache = {
        f"model.layers.{i}.self_attn.{k}_cache": rng.standard_normal((1, 3, 128, 16)) for i in range(2) for k in "kv"
    }
    feeds = {"tokens": rng.integers(0, 80, (1, tokens)), "positions": np.arange(9, 9 + tokens)[None]}
    _check(split, g, feeds, random_parameters(cfg, 6), cache, exact=False)


# ---- auto and what describe says ----------------------------------------------------------------------


def test_auto_keeps_one_device_when_no_split_is_predicted_faster() -> None:
    """A tiny prefill (every op a few tiles: a split only adds exchanges and handovers): auto returns
    the program on one device and says why; main picked pp2, predicted slower than one device."""
    g = build_llama_prefill(_tiny(), 1, 8)
    split = ml.parallelize(g, 2)
    labels = {c.plan.label: c.predicted.step_us for c in split.candidates if c.predicted is not None}
    assert split.world_size == 1 and split.graphs == [g], split.summary()
    assert labels["1 device"] <= min(labels.values())
    text = split.describe()
    assert "one device, the program unsplit" in text and "no split over 2 devices is predicted faster" in text
    assert split.summary().startswith("one device, no split predicted faster")
    params = random_parameters(_tiny(), 0)
    feeds = {"tokens": np.ones((1, 8), np.int64), "positions": np.arange(8)[None], "last": np.array([7])}
    _check(split, g, feeds, params, interleavings=1)


def test_auto_picks_a_split_that_divides_when_it_pays() -> None:
    """Planning only: a 4-sequence prefill of a wider model, where dividing pays: auto's pick is
    predicted faster than one device and every candidate it considered, and its ranks each do at
    most 60% of one device's work."""
    from megaloop.parallel.describe import work_shares

    cfg = LlamaConfig(hidden=1024, heads=16, kv_heads=4, intermediate=4096, layers=2, vocab=32000, max_seq=256)
    split = ml.parallelize(build_llama_prefill(cfg, 4, 256), 2)
    steps = [c.predicted.step_us for c in split.candidates if c.predicted is not None]
    assert split.world_size == 2 and split.predicted.step_us == min(steps) < split.one_device.step_us
    assert max(work_shares(split)) <= 0.6, work_shares(split)
    head = split.describe().splitlines()
    assert re.search(r"predicted [\d.]+ us a step \(one device: [\d.]+ us\)", head[1]), head[1]
    assert head[2].startswith("  work a rank, of one device's: "), head[2]


def test_describe_says_by_weights_or_by_positions() -> None:
    """tp of a decode step cuts weights; of a long norm-and-activation program over token rows it cuts
    positions (sequence parallel), and describe says which (main called both "tensor parallel")."""
    decode = ml.parallelize(build_llama(_tiny(), 1, 1), 2, "tp")
    assert "tensor parallel over 2: by weights)" in decode.describe().splitlines()[0]
    g = ml.Graph("rows")
    x = g.input("x", (1, 4096, 512), ml.float32)
    w = g.parameter("w", (512,), ml.float32)
    g.output("y", ml.tanh(ml.rmsnorm(x, w)))
    rows = ml.parallelize(g, 2, "tp")
    assert "tensor parallel over 2: by positions)" in rows.describe().splitlines()[0], rows.describe()
    assert rows.graphs[0].inputs["x"].shape == (1, 2048, 512)
    # a weight kept whole on every rank (pinned), its columns' products divided: "by features", not weights
    g = ml.Graph("wide")
    x = g.input("x", (8, 64), ml.float32)
    w = g.parameter("w", (64, 4096), ml.float32)
    g.output("y", ml.tanh(x @ w))
    wide = ml.parallelize(g, 2, "tp", layout={"w": ml.Replicate()})
    assert all(r.parameters["w"].shape == (64, 4096) for r in wide.graphs)
    assert "tensor parallel over 2: by features)" in wide.describe().splitlines()[0], wide.describe()

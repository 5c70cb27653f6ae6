"""Generation on the fast CPU path (``backend="cpu"``) against the CPU reference (``ml.evaluate``,
``backend="reference"``), its definition: every family's tiny model that transformers saved, as its
prefill and generator graphs (logits within float32 / bfloat16 tolerance, the worst printed; greedy
tokens equal), then Generator's text, batched and sampled, the KV caches handed over in place, and
the progress line of a long prefill."""

from __future__ import annotations

import importlib.util
import re
import sys
from dataclasses import replace

import numpy as np
import pytest

import megaloop as ml
from megaloop.errors import EvaluationError
from megaloop.generation import GenerationError
from megaloop.generation.backends import CpuBackend, ReferenceBackend, prefill_products
from megaloop.generation.progress import Progress
from megaloop.models import load_llama
from megaloop.models.llama import build_llama_generator, build_llama_prefill
from megaloop.models.tiny import make_tiny_checkpoint
from megaloop.reference.fast import ComputeWeights, FastGraph, choose_products
from tests.hf_models import FAMILIES, make_model

# the one inexact op (attention, BLAS sums) differs from the reference by float32 reassociation: a few
# float32 ulps after two layers; in bfloat16 a difference shows only where a value rounds the other way
TOLERANCE = {"float32": 1e-5, "bfloat16": 4 * 2.0**-8}
STEPS = 16


def worst(got: np.ndarray, want: np.ndarray, what: str) -> float:
    """max |got - want| / max |want|, printed with where it is."""
    g, w = got.astype(np.float64), want.astype(np.float64)
    err = np.abs(g - w)
    at = np.unravel_index(int(err.argmax()), err.shape)
    rel = float(err[at] / max(np.abs(w).max(), 1e-30))
    print(f"{what}: worst {rel:.2e} at {at} (fast {g[at]:.6g}, reference {w[at]:.6g})")
    return rel


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    make_model(request.param, folder)
    return request.param, folder


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_family_on_the_fast_path_equals_the_reference(family, dtype: str) -> None:
    """Two prompts of different lengths through the prefill, then STEPS greedy steps of the generator
    (its caches from the prefill): logits within TOLERANCE, the caches too, the tokens equal."""
    name, folder = family
    cfg, params = load_llama(folder, dtype=dtype, max_seq=32)
    rng = np.random.default_rng(3)
    lengths = [9, 5]
    tokens = rng.integers(0, cfg.vocab, (2, 9))
    feeds = {"tokens": tokens, "positions": np.tile(np.arange(9), (2, 1)), "last": np.array(lengths) - 1}
    prefill, generator = build_llama_prefill(cfg, 2, 9), build_llama_generator(cfg, 2, eos_ids=())
    want = ml.evaluate(prefill, feeds, params)
    weights = ComputeWeights(params)
    fast_prefill, fast_generator = FastGraph(prefill, weights, verify=True), FastGraph(generator, weights, verify=True)
    got = fast_prefill.run(feeds)
    tol = TOLERANCE[dtype]
    assert worst(got["logits"], want.outputs["logits"], f"{name} {dtype} prefill logits") <= tol
    for cache, value in want.state.items():
        assert worst(fast_prefill.read_state([cache])[cache], value, f"{name} {dtype} {cache}") <= tol
    first = want.outputs["logits"][:, 0].astype(np.float32).argmax(-1)
    assert np.array_equal(got["logits"][:, 0].astype(np.float32).argmax(-1), first)
    start = {"token": first[:, None], "position": np.array(lengths)[:, None], "stop": np.full((2, 1), 32)}
    fast_generator.set_state(fast_prefill.state, adopt=True)
    fast_generator.set_state(start)
    ref = ml.evaluate(generator, {}, params, {**want.state, **start}, iterations=STEPS)
    out = fast_generator.run(iterations=STEPS)
    assert worst(out["logits"], ref.outputs["logits"], f"{name} {dtype} step {STEPS} logits") <= tol
    history = fast_generator.read_state(["generated", "token", "position"])
    for key in history:
        assert np.array_equal(history[key], ref.state[key]), f"{name} {dtype}: {key} differs after {STEPS} steps"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


def test_generator_text_on_the_cpu_equals_the_reference(tiny) -> None:
    """Generator(backend="cpu") with numpy's products against backend="reference": a batch of two
    prompts, greedy and sampled with a seed, then a second call (weights converted once: no convert
    phase again)."""
    fast = ml.Generator(tiny, backend="cpu", progress=False, cpu_products="numpy")
    ref = ml.Generator(tiny, backend="reference", progress=False)
    prompts = ["Once upon a loop", "A kernel"]
    for kw in ({}, {"temperature": 0.8, "top_p": 0.9, "seed": 7}):
        got, want = fast.generate(prompts, max_new_tokens=12, **kw), ref.generate(prompts, max_new_tokens=12, **kw)
        assert [c.tokens for c in got] == [c.tokens for c in want], kw
        assert got.texts == want.texts
    assert got.stats.backend == "the CPU (numpy and BLAS)" and want.stats.backend == "the CPU reference (numpy)"
    first = fast.generate("Hi", max_new_tokens=3).stats
    assert "convert" not in first.setup, first.setup  # converted by the first call, kept by the Generator


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_torch_products_stay_within_the_contract(family, dtype: str) -> None:
    """products="torch": a prefill's products of bfloat16 weights (rows >= TORCH_ROWS, split-K ranges
    of a weight included) by torch's bfloat16 kernels: logits within TOLERANCE of the reference's."""
    pytest.importorskip("torch")
    name, folder = family
    cfg, params = load_llama(folder, dtype=dtype, max_seq=40)
    tokens = np.random.default_rng(4).integers(0, cfg.vocab, (2, 20))
    feeds = {"tokens": tokens, "positions": np.tile(np.arange(20), (2, 1)), "last": np.array([19, 12])}
    graph = build_llama_prefill(cfg, 2, 20)
    want = ml.evaluate(graph, feeds, params)
    weights = ComputeWeights(params, products="torch")
    got = FastGraph(graph, weights, products="torch", verify=True).run(feeds)
    up = "model.layers.0.mlp.up_proj.weight"
    assert weights.get(up, graph.parameters[up], torch=True).bf16 is not None
    assert weights.get(up, graph.parameters[up]).__class__ is np.ndarray  # (numpy's graphs: no twin)
    assert worst(got["logits"], want.outputs["logits"], f"{name} torch products") <= TOLERANCE[dtype]


def test_the_products_choice_is_explicit(tiny) -> None:
    """auto: torch's products for a bfloat16 prefill's weights of TORCH_MIN_WEIGHT values or more (a
    tiny model's stay numpy's), where this machine allows torch's; "torch": every bfloat16 matrix;
    never for decode; float32: numpy's."""
    from megaloop.frontend.ops._fast import TORCH_MIN_WEIGHT

    assert choose_products("numpy") == "numpy" and choose_products("auto") in ("numpy", "torch")
    cfg, params = load_llama(tiny)
    graph = build_llama_prefill(cfg, 1, 8)
    assert cfg.dtype == ml.bfloat16 and max(t.size for t in graph.parameters.values()) < TORCH_MIN_WEIGHT
    assert prefill_products(ComputeWeights(params, "numpy"), cfg, graph) == "numpy"
    if importlib.util.find_spec("torch") is not None:
        assert prefill_products(ComputeWeights(params, "torch"), cfg, graph) == "torch"
    auto = ComputeWeights(params, "auto")
    assert prefill_products(auto, cfg, graph) == "numpy"
    g = ml.Graph("big")
    big, small = g.parameter("big", (512, TORCH_MIN_WEIGHT // 512), ml.bfloat16), g.parameter("s", (8, 8), ml.bfloat16)
    g.output("y", ml.matmul(g.input("x", (16, big.shape[1]), ml.bfloat16), big, transpose_b=True))
    g.output("z", ml.matmul(g.input("u", (16, 8), ml.bfloat16), small))
    assert auto.twinned(big) and not auto.twinned(small) and ComputeWeights({}, "torch").twinned(small)
    assert not auto.twinned(g.parameter("f", big.shape, ml.float32))
    assert prefill_products(auto, cfg, g) == auto.products  # (torch where this machine allows it)
    assert prefill_products(auto, replace(cfg, dtype=ml.float32), g) == "numpy"
    with pytest.raises(EvaluationError, match="products must be one of"):
        choose_products("blas")
    with pytest.raises(GenerationError, match="cpu_products must be one of"):
        ml.Generator("/nonexistent", cpu_products="mkl")


def test_the_generator_imports_torch_while_it_sets_up(tiny, monkeypatch) -> None:
    """A bfloat16 model on the CPU with torch's products allowed, or a float32 one whose prefill may run in
    torch form (activations "auto" where products are not numpy's): torch's import starts in a thread when
    the model loads (ComputeWeights.import_torch_early), and the prefill waits for it (torch())."""
    pytest.importorskip("torch")
    started = []
    monkeypatch.setattr(ComputeWeights, "import_torch_early", lambda self: started.append(self.products))
    ml.Generator(tiny, backend="cpu", progress=False, cpu_products="torch")
    ml.Generator(tiny, backend="cpu", progress=False, cpu_products="numpy")
    ml.Generator(tiny, backend="cpu", progress=False, cpu_products="torch", dtype="float32")
    assert started == ["torch", "numpy", "torch"]  # (float32: its prefill may run in torch form)
    monkeypatch.undo()
    weights = ComputeWeights({}, "torch")
    weights.import_torch_early()
    assert weights._importing is not None and weights.torch() is sys.modules["torch"]
    assert not weights._importing.is_alive()


def test_the_caches_go_from_prefill_to_generator_without_a_copy(tiny) -> None:
    cfg, params = load_llama(tiny, max_seq=24)
    kw = {"sampling": False, "eos_ids": (), "progress": Progress(False)}
    backend, reference = CpuBackend(cfg, params, 1, 4, **kw), ReferenceBackend(cfg, params, 1, 4, **kw)
    feeds = {"tokens": np.array([[3, 5, 7, 9]]), "positions": np.arange(4)[None], "last": np.array([3])}
    start = {"token": np.array([[11]]), "position": np.array([[4]]), "stop": np.array([[20]])}
    for b in (backend, reference):
        b.setup_prefill()
        b.prefill(feeds)
    caches = {k: v for k, v in backend.runs[0].state.items()}
    backend.setup_generator(start)
    reference.setup_generator(start)
    for name, buffer in caches.items():
        assert backend.runs[1].state[name] is buffer, f"{name} was copied"
        assert backend.runs[0].state[name] is not buffer, "the prefill must not write into the generator's caches"
    for _ in range(3):
        got, want = backend.advance(2), reference.advance(2)
        for key in want:
            assert np.array_equal(got[key], want[key]), key


def test_a_long_prefill_shows_a_progress_line(tiny, capsys) -> None:
    """A bar on stderr counting the prefill's ops, once the prefill has taken a while (here: at once)."""
    cfg, params = load_llama(tiny, max_seq=40)
    progress = Progress(True)
    progress.delay = 0.0
    backend = CpuBackend(cfg, params, 1, 32, sampling=False, eos_ids=(), progress=progress)
    backend.setup_prefill()
    tokens = np.arange(32)[None] % cfg.vocab
    backend.prefill({"tokens": tokens, "positions": np.arange(32)[None], "last": np.array([31])})
    err = capsys.readouterr().err
    ops = len(backend.runs[0].nodes)
    assert re.search(rf"prefill\s*:.*\d+/{ops} \[", err), err[-400:]
    assert "prefill" not in progress.seconds  # not a setup phase: the stats count it as the prefill


def test_the_cli_shows_a_long_prefills_progress_on_stderr_but_not_with_q(tiny, capsys, monkeypatch) -> None:
    """`megaloop generate` in a terminal: the prefill's bar on stderr once the prefill has taken
    Progress.delay (here 0), nothing of it on stdout, and none with -q."""
    from megaloop.cli import main

    monkeypatch.setattr(Progress, "delay", 0.0)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # (capsys's stderr, as a terminal would be)
    run = ["generate", "--model", str(tiny), "--prompt", "Once upon a loop " * 8, "--backend", "cpu",
           "--max-new-tokens", "2"]  # fmt: skip
    assert main(run) == 0
    out, err = capsys.readouterr()
    assert re.search(r"prefill\s*:.*\d+/\d+ \[", err), err[-400:]
    assert not re.search(r"prefill\s*:", out), out
    assert main([*run, "-q"]) == 0
    out, err = capsys.readouterr()
    assert not re.search(r"prefill\s*:", err) and out.strip(), (out, err[-400:])

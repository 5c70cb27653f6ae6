"""The fast CPU path in torch form (FastGraph(activations="torch"): values between ops as torch tensors
of their dtype, each op's ``Fast.torch`` kernel where it has one) against ml.evaluate, its definition:
every op-table row whose op has a torch kernel, in every dtype it lists, within twice the op's accuracy
contract (the worst mismatch printed); the kernels' fallbacks (a query that sees no key, positions a
cache update cannot copy as one run); every family's tiny model's prefill (logits within the dtype's
tolerance) and the Generator's greedy tokens, equal to transformers'."""

from __future__ import annotations

import zlib
from dataclasses import replace

import numpy as np
import pytest

import megaloop as ml
from megaloop.errors import DataError, EvaluationError
from megaloop.frontend.opdef import REGISTRY
from megaloop.frontend.ops import _torch
from megaloop.generation import GenerationError
from megaloop.generation.backends import CpuBackend, prefill_activations
from megaloop.models import LlamaConfig, load_llama
from megaloop.models.llama import build_llama_prefill
from megaloop.reference.fast import ComputeWeights, FastGraph, choose_activations
from tests.helpers import assert_close, to_f64
from tests.hf_models import FAMILIES, make_model
from tests.op_table import ROWS, Row, build_row

torch = pytest.importorskip("torch")

DRAWS = 2
# a prefill's logits after two layers: bfloat16's rounding of every op (torch's bfloat16 products sum
# in another order, its attention's probabilities are rounded) a value or two the other way
TOLERANCE = {"float32": 1e-5, "bfloat16": 4 * 2.0**-8}


def _torch_rows() -> list[tuple[Row, str]]:
    def has_kernel(name: str) -> bool:
        fast = REGISTRY[name].fast
        return fast is not None and fast.torch is not None

    return [(row, dt) for row in ROWS if has_kernel(row.op) for dt in row.dtypes]


CASES = _torch_rows()


def run_torch(graph: ml.Graph, feeds: dict, params: dict, state: dict | None = None) -> tuple[dict, dict]:
    run = FastGraph(graph, ComputeWeights(params, activations="torch"), activations="torch", verify=True)
    run.reset(state)
    return run.run(feeds), run.read_state()


def check_row(row: Row, dtype: str, seed: int) -> None:
    g, feeds, state, _, outs, sample = build_row(row, dtype, seed)
    want = ml.evaluate(g, feeds, state=state)
    outputs, states = run_torch(g, feeds, {}, state)
    acc = REGISTRY[row.op].accuracy
    doubled = type(acc)(ulps=2 * acc.ulps, per_reduction=acc.per_reduction)
    what = f"{row.id} [{dtype}] seed {seed} shapes {sample.shapes} kw {sample.kw}"
    for k, t in enumerate(outs):
        ref = to_f64(want.outputs[f"y{k}"])
        assert_close(outputs[f"y{k}"], ref, t.dtype, doubled, row.reduce_len(sample), f"{what} output {k}")
    for name, value in want.state.items():
        assert_close(states[name], to_f64(value), g.states[name].dtype, doubled, row.reduce_len(sample), name)


@pytest.mark.parametrize("row,dtype", CASES, ids=[f"{r.id}-{d}" for r, d in CASES])
def test_op_in_torch_form_stays_within_its_contract(row: Row, dtype: str) -> None:
    base = zlib.crc32(f"torch-{row.id}-{dtype}".encode())
    for draw in range(DRAWS):
        check_row(row, dtype, base + draw)


def test_the_prefills_ops_have_torch_kernels() -> None:
    """The ops of a Llama prefill that carry its time (docs/generate.md) run torch's kernels."""
    for name in ("matmul", "rmsnorm", "rmsnorm_linear", "rope", "attention", "kv_cache_update", "add", "silu_mul",
                 "reshape", "permute", "copy", "embedding"):  # fmt: skip
        assert REGISTRY[name].fast.torch is not None, name


def _attention_graph(tq: int, tk: int, dtype: str, **kw) -> ml.Graph:
    g = ml.Graph("attn")
    q = g.input("q", (2, 4, tq, 8), dtype)
    k, v = g.input("k", (2, 2, tk, 8), dtype), g.input("v", (2, 2, tk, 8), dtype)
    pos = g.input("qpos", (2, tq), "int64") if kw.pop("positions", False) else None
    g.output("y", ml.attention(q, k, v, q_positions=pos, **kw))
    return g


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_attention_in_torch_form_masks_as_the_reference(dtype: str) -> None:
    """A padded batch's positions (a general mask), a prompt after a cached prefix, a sliding window,
    and a query that sees no key (the numpy kernel: zeros, where torch's would be NaN)."""
    rng = np.random.default_rng(5)
    qkv = {n: rng.standard_normal(s).astype(np.float32) for n, s in (("q", (2, 4, 6, 8)), ("k", (2, 2, 10, 8)),
                                                                     ("v", (2, 2, 10, 8)))}  # fmt: skip
    cases = [
        ({"causal": True, "positions": True}, {"qpos": np.array([[0, 1, 2, 3, 4, 5], [4, 5, 6, 7, 8, 9]])}),
        ({"causal": True, "window": 3, "positions": True}, {"qpos": np.array([[2, 3, 4, 5, 6, 7]] * 2)}),
        ({"causal": True, "positions": True}, {"qpos": np.array([[-1, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5]])}),
        ({"causal": False}, {}),
    ]
    for kw, extra in cases:
        g = _attention_graph(6, 10, dtype, **kw)
        feeds = {n: a.astype(g.inputs[n].dtype.np) for n, a in qkv.items()} | extra
        want = ml.evaluate(g, feeds).outputs["y"]
        got = run_torch(g, feeds, {})[0]["y"]
        assert_close(got, to_f64(want), g.outputs["y"].dtype, REGISTRY["attention"].accuracy, 10, f"{kw} {extra}")
        assert np.isfinite(to_f64(got)).all(), kw


def test_a_cache_update_in_torch_form_writes_the_state_in_place() -> None:
    """A run of positions is copied into the state's buffer; others (out of order, skipped with
    ignore_negative) go through write_slots; a position past the cache is refused naming the op."""
    g = ml.Graph("cache")
    cache = g.state("cache", (2, 2, 8, 4), "bfloat16")
    new, pos = g.input("new", (2, 2, 3, 4), "bfloat16"), g.input("pos", (2, 3), "int64")
    ml.kv_cache_update(cache, new, pos)  # (the state's next value)
    run = FastGraph(g, ComputeWeights({}, activations="torch"), activations="torch", verify=True)
    buffer = run.state["cache"]
    rng = np.random.default_rng(6)
    for positions in ([[0, 1, 2], [5, 6, 7]], [[2, 0, 1], [7, 3, 4]]):
        feeds = {"new": rng.standard_normal((2, 2, 3, 4)).astype(ml.bfloat16.np), "pos": np.array(positions)}
        before = run.read_state()
        run.run(feeds)
        want = ml.evaluate(g, feeds, state=before).state["cache"]
        assert run.state["cache"] is buffer  # (in place: the state's own memory)
        np.testing.assert_array_equal(to_f64(run.read_state()["cache"]), to_f64(want))
    with pytest.raises(DataError, match="kv_cache_update"):
        run.run({"new": feeds["new"], "pos": np.array([[6, 7, 8], [0, 1, 2]])})


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    make_model(request.param, folder)
    return request.param, folder


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_familys_prefill_in_torch_form_stays_within_tolerance(family, dtype: str) -> None:
    """Two prompts of different lengths (the CPU backend's graph: no split-K), logits and caches within
    TOLERANCE of the reference's (the worst printed)."""
    name, folder = family
    cfg, params = load_llama(folder, dtype=dtype, max_seq=40)
    tokens = np.random.default_rng(7).integers(0, cfg.vocab, (2, 20))
    feeds = {"tokens": tokens, "positions": np.tile(np.arange(20), (2, 1)), "last": np.array([19, 12])}
    graph = ml.fuse(build_llama_prefill(cfg, 2, 20), CpuBackend.fusion)
    want = ml.evaluate(graph, feeds, params)
    run = FastGraph(graph, ComputeWeights(params, activations="torch"), activations="torch", verify=True)
    first = run.run(feeds)["logits"]
    run.reset()
    packed = run.prepare()  # (bfloat16: each linear layer's weight packed for oneDNN; float32: none)
    assert (packed > 0) == (dtype == "bfloat16" and _torch.onednn_linear() is not None), packed
    got, states = run.run(feeds), run.read_state()
    for what, g, w in [
        ("first logits", first, want.outputs["logits"]),
        ("logits", got["logits"], want.outputs["logits"]),
    ] + [(n, states[n], want.state[n]) for n in list(want.state)[:2]]:
        g64, w64 = to_f64(g), to_f64(w)
        err = np.abs(g64 - w64)
        at = np.unravel_index(int(err.argmax()), err.shape)
        rel = float(err[at] / max(np.abs(w64).max(), 1e-30))
        print(f"{name} {dtype} {what}: worst {rel:.2e} at {at} (torch {g64[at]:.6g}, reference {w64[at]:.6g})")
        assert rel <= TOLERANCE[dtype], (name, dtype, what, rel)


def test_greedy_tokens_in_torch_form_equal_transformers(family) -> None:
    """The Generator with cpu_activations="torch" (float32): 16 greedy tokens after a 20-token prompt
    equal transformers' generate on the same checkpoint."""
    import transformers

    name, folder = family
    prompt = [0, *np.random.default_rng(8).integers(1, 96, 19).tolist()]  # (id 0: pad_token_id, kept by the mask)
    gen = ml.Generator(folder, backend="cpu", dtype="float32", progress=False, eos_token_ids=(),
                       cpu_activations="torch")  # fmt: skip
    got = gen.generate(prompt, max_new_tokens=16)
    assert "the prefill by torch" in got.stats.backend
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                             eos_token_id=None, pad_token_id=0)  # fmt: skip
    assert got[0].tokens == out[0, len(prompt) :].tolist(), name


def test_the_activations_choice_is_explicit(tmp_path) -> None:
    """auto: torch form for a prefill of TORCH_ROWS rows or more with a weight of TORCH_MIN_WEIGHT
    values or more (a float32 model's; a bfloat16 one's where its products are torch's), never where
    the products are asked to be numpy's; "torch": always; "numpy": never; other values refused."""
    from megaloop.frontend.ops._fast import TORCH_MIN_WEIGHT, TORCH_ROWS

    assert choose_activations("auto", "numpy") == "numpy" and choose_activations("auto", "auto") == "torch"
    assert choose_activations("numpy", "torch") == "numpy" and choose_activations("torch", "numpy") == "torch"
    with pytest.raises(EvaluationError, match="activations must be one of"):
        choose_activations("mkl", "auto")
    with pytest.raises(GenerationError, match="cpu_activations must be one of"):
        ml.Generator("/nonexistent", cpu_activations="mkl")
    cfg = LlamaConfig(hidden=64, heads=4, kv_heads=2, intermediate=128, layers=1, max_seq=64, vocab=100,
                         dtype=ml.float32)  # fmt: skip
    tiny = build_llama_prefill(cfg, 1, 16)
    big = replace(cfg, hidden=512, intermediate=2 * TORCH_MIN_WEIGHT // 512)
    large = build_llama_prefill(big, 1, 16)
    auto = ComputeWeights({}, "auto", "auto")
    assert prefill_activations(auto, cfg, tiny, 16) == "numpy"  # (a tiny model: numpy's faster)
    assert prefill_activations(auto, big, large, 16) == "torch"
    assert prefill_activations(auto, big, large, TORCH_ROWS - 1) == "numpy"
    assert prefill_activations(ComputeWeights({}, "numpy", "auto"), big, large, 16) == "numpy"
    assert prefill_activations(ComputeWeights({}, "numpy", "torch"), cfg, tiny, 1) == "torch"
    bf16 = replace(big, dtype=ml.bfloat16)
    assert prefill_activations(auto, bf16, large, 16) == ("torch" if auto.products == "torch" else "numpy")


@pytest.mark.parametrize("activations", ["numpy", "torch"])
def test_a_run_drops_each_value_after_its_last_reader(activations: str) -> None:
    """Every intermediate value is dropped once, after the last step that reads it (its memory reused by
    later results instead of the heap growing through a run); parameters, inputs, states and outputs
    are never dropped; the results are those of a graph run with nothing dropped."""
    cfg = LlamaConfig(hidden=64, heads=4, kv_heads=2, intermediate=128, layers=2, max_seq=32, vocab=100)
    graph = build_llama_prefill(cfg, 1, 16)
    rng = np.random.default_rng(9)
    params = {n: (0.1 * rng.standard_normal(t.shape)).astype(t.dtype.np) for n, t in graph.parameters.items()}
    run = FastGraph(graph, ComputeWeights(params, activations=activations), activations=activations)
    kept = {*run._fixed, *run._inputs.values(), *run._states.values(), *run._updates.values()}
    kept.update(slot for slot, _ in run._outputs.values())
    dropped = [slot for step in run._dead for slot in step]
    assert len(dropped) == len(set(dropped)) and not kept & set(dropped)
    assert set(dropped) | kept == set(range(run._size))
    for i, step in enumerate(run._dead):
        later = {j for _, ins, _ in run._steps[i + 1 :] for j in ins}
        assert not later & set(step), f"step {i} drops a value a later step reads"
    feeds = {"tokens": rng.integers(0, 100, (1, 16)), "positions": np.arange(16)[None], "last": np.array([15])}
    got = run.run(feeds)["logits"]
    run.reset()
    run._dead = [[] for _ in run._steps]
    np.testing.assert_array_equal(got, run.run(feeds)["logits"])


def test_a_bfloat16_prefill_packs_its_weights_ahead_once(tmp_path) -> None:
    """torch form, bfloat16: the linear weights are packed for oneDNN on the weights' ``ahead`` thread
    (no setup phase before the prefill), each before its product's first run, once a backend; both
    calls give the same tokens, and a prefill packed ahead gives the bits of one packed in setup."""
    from megaloop.models.tiny import make_tiny_checkpoint

    folder = make_tiny_checkpoint(tmp_path)
    gen = ml.Generator(folder, backend="cpu", progress=False, eos_token_ids=(), cpu_activations="torch")
    prompt = [1, 5, 9, 2, 7, 3, 8, 4, 6]
    first = gen.generate(prompt, max_new_tokens=4)
    (backend,) = gen._backends.values()
    prefill, jobs = backend.runs[0], dict(gen.params.ahead._jobs)
    again = gen.generate(prompt, max_new_tokens=4)
    assert "the prefill by torch" in first.stats.backend
    assert "pack" not in first.stats.setup and "pack" not in again.stats.setup, first.stats.setup
    packs = [k for k in jobs if k[0] is prefill.key]
    assert len(packs) == len(prefill._prepares) and (len(packs) > 0) == (_torch.onednn_linear() is not None)
    assert gen.params.ahead._jobs == jobs and gen.params.pending() == 0  # (nothing packed again)
    assert first[0].tokens == again[0].tokens
    cfg, params = load_llama(folder, max_seq=16)
    graph = build_llama_prefill(cfg, 1, len(prompt))
    feeds = {"tokens": np.array([prompt]), "positions": np.arange(len(prompt))[None], "last": np.array([8])}
    runs = [FastGraph(graph, ComputeWeights(params, activations="torch"), activations="torch") for _ in "ab"]
    assert runs[0].prepare() == runs[1].prepare_ahead()
    got = [run.run(feeds)["logits"] for run in runs]
    assert np.array_equal(got[0].view(np.uint16), got[1].view(np.uint16))

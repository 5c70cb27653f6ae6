"""Work the CPU path makes ahead, on one background thread (megaloop.reference.ahead): the decode's
float32 weights and the prefill's packed weights made while the prefill runs. The jobs run in order
(urgent ones first), a wait for a job not started runs it in the caller, an error surfaces by the
job's name in every wait for it and no wait hangs; the graphs read a weight only once its job is
done, and the results are those of the weights converted before anything runs."""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest

import megaloop as ml
from megaloop.errors import EvaluationError, InternalError
from megaloop.generation.backends import CpuBackend
from megaloop.generation.progress import Progress
from megaloop.models import LlamaConfig
from megaloop.models.llama import build_llama_generator, build_llama_prefill
from megaloop.reference.ahead import Ahead
from megaloop.reference.fast import ComputeWeights, FastGraph

CFG = LlamaConfig(hidden=64, heads=4, kv_heads=2, intermediate=128, layers=2, max_seq=32, vocab=100)


def _params(dtype: str, seed: int = 3) -> dict[str, np.ndarray]:
    graph = build_llama_prefill(CFG, 1, 12)
    rng = np.random.default_rng(seed)
    store = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
    return {n: (0.2 * rng.standard_normal(t.shape)).astype(store) for n, t in graph.parameters.items()}


def _feeds(tokens: int = 12) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    return {"tokens": rng.integers(0, CFG.vocab, (1, tokens)), "positions": np.arange(tokens)[None],
            "last": np.array([tokens - 1])}  # fmt: skip


def test_jobs_run_in_order_urgent_first_and_a_wait_runs_a_queued_job_itself() -> None:
    ahead, ran, gate = Ahead("test-ahead"), [], threading.Event()
    ahead.submit("block", "a job that waits for the test", lambda: (gate.wait(10), ran.append("block")))
    while ahead._jobs["block"].state == "queued":  # (the worker busy with it: the rest queue behind)
        time.sleep(0.001)
    for k in ("a", "b", "c"):
        ahead.submit(k, f"job {k}", lambda k=k: ran.append((k, threading.current_thread().name)))
    ahead.submit("urgent", "an urgent job", lambda: ran.append("urgent"), urgent=True)
    ahead.submit("a", "job a again", lambda: ran.append("twice"))  # (a key submitted before: left as it is)
    ahead.wait("c")  # (queued behind the blocked worker: run here, at once)
    assert ran == [("c", threading.current_thread().name)] and ahead.has("a") and not ahead.has("c")
    gate.set()
    while ahead.pending():
        time.sleep(0.001)
    assert ran[1:] == ["block", "urgent", ("a", "test-ahead"), ("b", "test-ahead")], ran
    assert ahead.pending() == 0 and not ahead.has("b")
    ahead.wait("never submitted")  # (nothing to wait for)


@pytest.mark.skipif(sys.platform != "linux", reason="a thread's own niceness is Linux's")
def test_a_nice_worker_runs_at_a_lower_priority_than_its_caller() -> None:
    ahead, seen = Ahead("test-nice", nice=10), []
    ahead.submit("x", "job x", lambda: seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
    while ahead.pending():
        time.sleep(0.001)
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert seen == [min(19, mine + 10)] and os.getpriority(os.PRIO_PROCESS, 0) == mine  # (the caller's unchanged)


def test_an_error_in_a_job_surfaces_by_name_in_every_wait() -> None:
    ahead = Ahead()

    def broken() -> None:
        raise ValueError("bad bytes")

    ahead.submit("x", "parameter 'layers.0.wq' (its float32 copy)", broken)
    ahead.submit("y", "parameter 'norm' (its float32 copy)", lambda: (_ for _ in ()).throw(EvaluationError("norm!")))
    for _ in range(2):
        with pytest.raises(EvaluationError, match=r"parameter 'layers.0.wq' \(its float32 copy\): ValueError: bad"):
            ahead.wait("x")
    with pytest.raises(EvaluationError, match=r"^norm!$"):  # (megaloop's own errors as they are)
        ahead.wait("y")


def test_a_wait_never_hangs_on_a_worker_that_is_gone() -> None:
    ahead, gate = Ahead(), threading.Event()
    ahead.poll_s = 0.01
    ahead.submit("x", "job x", lambda: gate.wait(10))
    while ahead._jobs["x"].state == "queued":
        time.sleep(0.001)
    ahead._thread = threading.Thread(target=lambda: None)  # (as if the worker had ended mid-job)
    t0 = time.perf_counter()
    with pytest.raises(InternalError, match=r"job x: the thread .* ended before it was done"):
        ahead.wait("x")
    gate.set()
    assert time.perf_counter() - t0 < 5


def test_a_parameter_queued_ahead_is_read_only_once_converted() -> None:
    """get() of a weight whose conversion is on the thread waits for it: the array it returns is the
    finished one (the stored values as float32, bit for bit); where the worker has not started it,
    the caller converts it; a conversion that fails names the parameter."""
    params = _params("bfloat16")
    graph = build_llama_prefill(CFG, 1, 12)
    weights, gate = ComputeWeights(params), threading.Event()
    weights.ahead.submit("hold", "a job that holds the worker", lambda: gate.wait(10), urgent=True)
    items = list(graph.parameters.items())
    slow = weights._convert

    def convert(name, t):  # (slow and checked: nobody reads the result before it is stored)
        time.sleep(0.002)
        return slow(name, t)

    weights._convert = convert
    assert weights.convert_ahead(items) == len(items) and weights.convert_ahead(items) == 0
    assert not weights.ready(*items[0]) and weights.ready(*items[0], torch_form=True)
    name, t = items[-1]
    got = weights.get(name, t)  # (not started: converted here)
    assert np.array_equal(got.view(np.uint32), params[name].astype(np.float32).view(np.uint32))
    gate.set()
    for name, t in items:
        got = weights.get(name, t)
        assert got.dtype == np.float32 and not got.flags.writeable
        assert np.array_equal(got.view(np.uint32), params[name].astype(np.float32).view(np.uint32)), name
    bad = dict(params, **{items[1][0]: np.full(items[1][1].shape, 3.4e38, np.float32)})
    weights = ComputeWeights(bad)
    weights.convert_ahead(items[1:2])
    with pytest.raises(EvaluationError, match=f"parameter '{items[1][0]}'.*overflows bfloat16"):
        weights.get(*items[1])


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_cpu_backend_makes_its_weights_ahead_and_gives_the_same_tokens(dtype: str) -> None:
    """CpuBackend in torch form: the prefill makes no float32 copy of a bfloat16 checkpoint's weights
    (it reads their bits), a float32 model's are converted ahead in the prefill's order, the decode's
    copies ahead too; the greedy tokens equal those of the same backend with every weight converted
    (and packed) before anything runs, and the decode graph reads the finished float32 copies."""
    torch = pytest.importorskip("torch")
    cfg = CFG if dtype == "bfloat16" else replace(CFG, dtype=ml.float32)
    params, tokens = _params("bfloat16"), []
    for ahead in (True, False):
        weights = ComputeWeights(params, "auto", "torch")
        if not ahead:  # (the weights converted first, as before: the reference for the tokens)
            for g in (build_llama_prefill(cfg, 1, 12), build_llama_generator(cfg, 1)):
                for n, t in g.parameters.items():
                    weights.get(n, t)
        backend = CpuBackend(cfg, weights, 1, 12, sampling=False, eos_ids=(), progress=Progress(False))
        assert backend.activations == "torch"
        backend.setup_prefill()
        assert backend.runs[1] is None  # (the decode's graph made after the prefill, on its finished weights)
        if dtype == "bfloat16":  # (the prefill reads the checkpoint's bits: no float32 copy waited for)
            name, t = next((n, t) for n, t in backend.prefill_graph.parameters.items() if t.ndim == 2)
            bits = weights.torch_form(name, t).view(torch.int16).numpy()
            assert np.shares_memory(bits, params[name].view(np.int16)), name
        logits = backend.prefill(_feeds())
        first = int(logits[0, -1].argmax())
        position = np.array([[12]])
        backend.setup_generator({"token": np.array([[first]]), "position": position, "stop": position + 6})
        history = backend.advance(6)
        tokens.append([first, *history["generated"][0, 13:19].tolist()])
        decode = backend.runs[1]
        assert not decode._later and all(v is not None for v in decode._fixed.values())  # (all fetched)
        for n, t in backend.generator.parameters.items():
            want = params[n].astype(np.float32)
            assert np.array_equal(weights.get(n, t).view(np.uint32), want.view(np.uint32)), n
        assert weights.pending() == 0
    assert tokens[0] == tokens[1], tokens


def test_a_bfloat16_prefill_in_torch_form_copies_no_weight() -> None:
    """A bfloat16 checkpoint's weights in torch form are its own memory: building and running the
    prefill makes no float32 copy (the decode's are made ahead, after)."""
    torch = pytest.importorskip("torch")
    params = _params("bfloat16")
    weights = ComputeWeights(params, activations="torch")
    run = FastGraph(build_llama_prefill(CFG, 1, 12), weights, activations="torch")
    run.run(_feeds())
    assert weights.nbytes == 0 and weights.pending() == 0
    name = next(iter(params))
    assert np.shares_memory(weights.torch_form(name, run.graph.parameters[name]).view(torch.int16)
                            .numpy(), params[name].view(np.int16))  # fmt: skip


def test_a_read_only_float32_weight_is_not_copied() -> None:
    """A memory-mapped (read-only) float32 weight is its own compute form; a writable array handed in
    is copied (its owner may change it later)."""
    graph = build_llama_prefill(replace(CFG, dtype=ml.float32), 1, 4)
    name, t = next(iter(graph.parameters.items()))
    stored = np.ones(t.shape, np.float32)
    writable = ComputeWeights({name: stored}).get(name, t)
    stored.setflags(write=False)
    assert not np.shares_memory(writable, stored)
    assert np.shares_memory(ComputeWeights({name: stored}).get(name, t), stored)


def test_a_conversion_that_fails_ahead_stops_the_prefill_by_name() -> None:
    """A float32 model's weight converted on the thread while the prefill runs: its error (a value
    float32 cannot hold) is raised by the prefill's first reader of it, naming it, without hanging."""
    pytest.importorskip("torch")
    cfg = replace(CFG, dtype=ml.float32)
    params = _params("float32")
    name = "model.layers.1.mlp.down_proj.weight"
    params[name] = np.full(params[name].shape, 1e39)  # (float64: overflows float32)
    weights = ComputeWeights(params, "auto", "torch")
    backend = CpuBackend(cfg, weights, 1, 12, sampling=False, eos_ids=(), progress=Progress(False))
    backend.setup_prefill()
    t0 = time.perf_counter()
    with pytest.raises(EvaluationError, match=f"parameter '{name}'.*overflows float32"):
        backend.prefill(_feeds())
    assert time.perf_counter() - t0 < 30


def test_a_finished_job_keeps_nothing_alive() -> None:
    """A done job drops its function (and so the graph its closure holds): a prefill's FastGraph and
    its packed weights are freed with their backend."""
    import gc
    import weakref

    ahead = Ahead()

    class Graph:
        pass

    graph = Graph()
    ahead.submit(("g", 0), "a graph's job", lambda g=graph: g)
    ahead.wait(("g", 0))
    gone = weakref.ref(graph)
    del graph
    gc.collect()
    assert gone() is None

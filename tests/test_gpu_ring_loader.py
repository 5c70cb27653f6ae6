"""The weight ring's loader warp (KernelOptions.weight_ring_loader, megaloop/ring_loader.cuh) on the GPU
(skipped without one). Its tiles are the default kernel's, only their copies are issued by another
warp, so every output is the default kernel's bit for bit: bench/llama_layer's decode layers (and the
reference within tolerance, as tests/test_gpu.py checks the ring), 100 runs bitwise, the Llama-3.2-1B
shaped generator's tokens and caches, iterations granted together or one by one, both issue orders,
caps and ring depths that make the loader wait on each, and the watchdog with the loader warp
running. CPU side:
tests/test_ring_loader.py."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

import megaloop as ml
from megaloop.codegen import generate
from megaloop.models import LlamaConfig, build_llama, random_parameters
from megaloop.plan import KernelOptions, make_plan
from megaloop.runtime.device import gpus

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpus()[0], reason="no GPU: " + gpus()[1])]

LOADER = KernelOptions(weight_ring_loader=1)
# in order and the oldest free slot first, at the default cap; a cap of one slot (the loader waits for
# every copy); 2 slots (it waits for the consumers)
VARIANTS = {
    "in_order": LOADER,
    "free_first": KernelOptions(weight_ring_loader=2),
    "cap16k": KernelOptions(weight_ring_loader=2, weight_ring_loader_bytes=16384),
    "slots2": KernelOptions(weight_ring_loader=1, weight_ring_slots=2, weight_ring_loader_bytes=65536),
}


def loop_kernel(plan, params=None, state=None, **kw):
    from megaloop.runtime.loop import LoopKernel

    return LoopKernel(plan, params, state, **kw)


def _has_loader(plan) -> None:
    prog = generate(plan)
    assert prog.threads == 32 * plan.warps + 32 and "ml::LoaderRing" in prog.source, "no loader warp in the kernel"


def _close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    g, w = got.astype(np.float64), want.astype(np.float64)
    d = np.abs(g - w)
    tol = 0.05 * (np.abs(w) + np.sqrt(np.mean(w**2)) + 1e-3)
    assert np.all(d <= tol), f"{what}: max difference {d.max():.3e}"


@pytest.mark.parametrize(
    "hidden,sequences,variants",
    [(2048, 1, tuple(VARIANTS)), (4096, 1, ("in_order", "free_first"))],  # (4 sequences: no ring tiles)
)
def test_decode_layers_with_the_loader_are_the_default_kernels_bits(hidden: int, sequences: int, variants) -> None:
    """bench/llama_layer.py's decode layer (the ring's q/k/v, o, gate/up and down tiles) with the
    variants: the default kernel's output bit for bit, and the CPU reference's within tolerance."""
    from bench.llama_layer import CONTEXT, layer_config

    cfg = layer_config(hidden, 1)
    params = random_parameters(cfg, seed=0)
    rng = np.random.default_rng(hidden + sequences)
    feeds = {
        "hidden": rng.standard_normal((sequences, 1, hidden)).astype(np.float32),
        "positions": np.full((sequences, 1), CONTEXT),
    }
    g = build_llama(cfg, sequences, 1)
    with loop_kernel(make_plan(g, processors=132), params) as k:
        base = k.run(feeds)["hidden"]
    _close(base, ml.evaluate(g, feeds, params).outputs["hidden"], f"default, hidden {hidden} x{sequences}")
    for name in variants:
        plan = make_plan(g, processors=132, options=VARIANTS[name])
        _has_loader(plan)
        with loop_kernel(plan, params) as k:
            got = k.run(feeds)["hidden"]
            again = k.run(feeds, iterations=3)["hidden"]
        assert np.array_equal(got, base), f"{name}: not the default kernel's bits (hidden {hidden} x{sequences})"
        assert np.array_equal(again, base), f"{name}: three iterations in one run differ"


def test_hundred_runs_with_the_loader_are_bitwise_identical() -> None:
    from bench.llama_layer import CONTEXT, layer_config

    cfg = layer_config(2048, 1)
    params = random_parameters(cfg, seed=1)
    feeds = {"hidden": np.random.default_rng(5).standard_normal((1, 1, 2048)).astype(np.float32)}
    feeds["positions"] = np.full((1, 1), CONTEXT)
    plan = make_plan(build_llama(cfg, 1, 1), processors=132, options=LOADER)
    _has_loader(plan)
    with loop_kernel(plan, params) as k:
        first = k.run(feeds)["hidden"].tobytes()
        for run in range(99):
            assert k.run(feeds)["hidden"].tobytes() == first, f"run {run + 2} differs"


def test_the_1b_shaped_generator_with_the_loader_gives_the_default_tokens_and_caches() -> None:
    """bench/generate's greedy step at the Llama-3.2-1B widths (two layers, the full vocabulary): 24
    steps granted at once (the loader runs across iterations) and 8 granted one by one (it waits for
    each grant) give the default kernel's tokens and caches bit for bit; the first new token is the
    CPU reference's (bf16: a near tie may part later ones; generated[p] is the token fed at p)."""
    from megaloop.cli import PRESETS
    from megaloop.models import build_llama_generator

    cfg = dataclasses.replace(PRESETS["llama3.2-1b"], layers=2, max_seq=128)
    params = random_parameters(cfg, seed=0)
    g = build_llama_generator(cfg, 1, kv_splits="auto")
    start = {"token": np.array([[17]]), "position": np.array([[40]])}
    states = {}
    for name, options in {"default": KernelOptions(), "in_order": LOADER, "free_first": VARIANTS["free_first"]}.items():
        plan = make_plan(g, processors=132, options=options)
        if name != "default":
            _has_loader(plan)
        with loop_kernel(plan, params, start) as k:
            k.run({}, iterations=24)
            for _ in range(8):
                k.run({}, iterations=1)
            states[name] = k.state()
    base = states.pop("default")
    for name, state in states.items():
        for key, value in base.items():
            assert np.array_equal(state[key], value), f"{name}: state {key} differs from the default kernel's"
    ref = ml.evaluate(g, {}, params, start, iterations=2)
    want = ref.state["generated"][0, 0, 40:42]
    assert np.array_equal(base["generated"][0, 0, 40:42], want), (base["generated"][0, 0, 40:48], want)


def test_watchdog_with_the_loader_names_the_stuck_wait_and_the_kernel_stops() -> None:
    """A wait no counter will satisfy, with the loader warp filling the ring meanwhile: the watchdog
    names it (the loader leaves with the block, its copies landed), the next kernel runs, and a
    loader kernel told to stop between runs stops at once."""
    from megaloop.runtime.loop import LoopKernelError

    cfg = LlamaConfig(hidden=256, heads=4, kv_heads=2, intermediate=512, layers=1, max_seq=8, vocab=64)
    plan = make_plan(build_llama(cfg, 1, 1), processors=16, options=LOADER)
    _has_loader(plan)
    params = random_parameters(cfg)
    program = generate(plan)
    first = int(np.flatnonzero(program.waits["lag"] == 0)[-1])  # late in the step: the ring full by then
    program.waits["per_iteration"][first] = 1_000_000
    feeds = {"tokens": [[3]], "positions": [[0]]}
    stuck = r"watchdog: rank 0 processor \d+ waited more than 0.5 s .* counter \d+ \(done"
    with pytest.raises(LoopKernelError, match=stuck):
        with loop_kernel(plan, params, timeout_s=0.5, program=program) as k:
            k.run(feeds)
    t0 = time.perf_counter()
    with loop_kernel(plan, params) as k:
        out = k.run(feeds)
        out2 = k.run(feeds)
    assert time.perf_counter() - t0 < 60, "the loader kernel did not stop"
    assert np.isfinite(out["logits"].astype(np.float32)).all()
    assert np.array_equal(out["logits"], out2["logits"])

"""megaloop.Engine and ``megaloop serve`` on the loop kernel (skipped without a GPU): the step resident,
8 requests of mixed prompt lengths arriving at different steps, each completion equal to the prompt's
generated alone by the Generator on the GPU (greedy and sampled, float32), the page pool checked
after every run and empty at the end, the same tokens on a second run and on the CPU reference; the
paged ops against the reference; the HTTP server on it. The CPU side of all of it:
tests/test_serving_engine.py, tests/test_paged_ops.py, tests/test_serve_http.py."""

from __future__ import annotations

import time

import numpy as np
import pytest

import megaloop as ml
from megaloop.models.tiny import make_tiny_checkpoint
from megaloop.plan import make_plan
from megaloop.runtime.device import gpus
from megaloop.serving.engine import Engine
from tests.test_paged_ops import case, feeds, step_graph
from tests.test_serving_engine import ARRIVALS, LENGTHS, MAX_TOKENS, arrive, prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpus()[0], reason="no GPU: " + gpus()[1])]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


def sampled(i: int, n: int) -> dict:
    return {"max_tokens": n, "temperature": 0.9, "top_k": [0, 40][i % 2], "top_p": [1.0, 0.9][i % 3 > 0],
            "seed": 1000 + 7 * i}  # fmt: skip


def alone(gen: ml.Generator, ps: list, settings: list[dict]) -> list[list[int]]:
    """Each prompt generated alone by the Generator (before the engine's kernel is resident: a module
    cannot load while one is)."""
    out = []
    for p, s in zip(ps, settings):
        kw = {k: v for k, v in s.items() if k != "max_tokens"}
        out.append(gen.generate(p, max_new_tokens=s["max_tokens"], **kw)[0].tokens)
    return out


@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_the_loop_kernel_serves_each_prompt_as_it_is_generated_alone(tiny, kind: str) -> None:
    gen = ml.Generator(tiny, backend="gpu", max_seq=128, dtype="float32")
    ps = prompts(gen)
    settings = [{"max_tokens": n} if kind == "greedy" else sampled(i, n) for i, n in enumerate(MAX_TOKENS)]
    want = alone(gen, ps, settings)
    e = Engine(gen, backend="gpu", max_slots=6, chunk=8, page_size=8, check_pages=True)
    assert e.backend_name == "gpu", e.reason
    t0 = time.perf_counter()
    requests = arrive(e, list(zip(ps, settings)), ARRIVALS)
    got = [r.result(300).tokens for r in requests]
    print(f"{e.steps} steps, {time.perf_counter() - t0:.2f} s, on {e.description}")
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"request {i} ({LENGTHS[i]} prompt tokens, {settings[i]}): {g} != {w}"
    assert e.runs["mixed"] and any(e.runs[f"decode_{r}"] for r in (1, 2, 4, 6)), f"runs switched programs: {e.runs}"
    again = [r.result(300).tokens for r in [e.submit(p, **s) for p, s in zip(ps, settings)]]
    assert again == got, "the same requests again (all at once this time): the same tokens"
    e.close()
    assert e.slots.pages.all_free()


def test_the_loop_kernels_tokens_are_the_cpu_references(tiny) -> None:
    gen = ml.Generator(tiny, backend="cpu", max_seq=128, dtype="float32")
    ps = prompts(gen)
    cpu = Engine(gen, backend="cpu", max_slots=4, chunk=8, page_size=8)
    want = [c.tokens for c in cpu.generate(ps, max_tokens=12, temperature=0.8, seed=5)]
    cpu.close()
    e = Engine(gen, backend="gpu", max_slots=4, chunk=8, page_size=8)
    got = [c.tokens for c in e.generate(ps, max_tokens=12, temperature=0.8, seed=5)]
    e.close()
    assert got == want


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_paged_ops_on_the_gpu_match_the_reference(dtype: str) -> None:
    from megaloop.runtime.loop import LoopKernel

    c = case(dtype, slots=4, per_slot=6, page=16, hkv=2, group=4, d=64, rows=40, window=None, seed=3)
    g = step_graph(c)
    inputs, state = feeds(c)
    want = ml.evaluate(g, inputs, state=state)
    plan = make_plan(g, processors=gpus()[0][0].sm_count, arch=gpus()[0][0].plan_arch)
    with LoopKernel(plan, state=state) as k:
        out = k.run(inputs)
        pools = k.state(["k_pool", "v_pool"])
    for name in ("k_pool", "v_pool"):
        assert np.array_equal(pools[name].view(np.uint8), want.state[name].view(np.uint8)), name
    ref = want.outputs["o"].astype(np.float32)
    err = np.abs(out["o"].astype(np.float32) - ref).max() / (np.abs(ref).max() + 1e-30)
    eps = 2.0**-23 if dtype == "float32" else 2.0**-8
    print(f"paged attention on the GPU: worst {err / eps:.2f} ulps of {dtype} (of the largest output)")
    assert err <= 8 * eps


def test_the_server_on_the_loop_kernel(tiny) -> None:
    pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from tests.test_serve_http import MODEL, Server

    gen = ml.Generator(tiny, backend="gpu", max_seq=128, dtype="float32")
    want = gen.generate("Once upon a loop", max_new_tokens=16)[0].text
    s = Server(Engine(gen, backend="gpu", max_slots=8, chunk=8, page_size=8))
    try:
        c = s.client()
        kw = {"model": MODEL, "prompt": "Once upon a loop", "max_tokens": 16, "temperature": 0}
        assert c.completions.create(**kw).choices[0].text == want
        assert "".join(ch.choices[0].text for ch in c.completions.create(**kw, stream=True)) == want
    finally:
        s.stop()


@pytest.mark.parametrize("strategy", ["tp", "pp"])
def test_the_step_split_over_two_ranks_on_the_gpu(tiny, strategy: str) -> None:
    """Two loop kernels (on two GPUs where there are, else sharing one): the CPU reference's tokens."""
    gen = ml.Generator(tiny, backend="cpu", max_seq=128, dtype="float32")
    ps = prompts(gen)[2:6]
    cpu = Engine(gen, backend="cpu", max_slots=3, chunk=8, page_size=8)
    want = [c.tokens for c in cpu.generate(ps, max_tokens=10, temperature=0.8, seed=3)]
    cpu.close()
    e = Engine(gen, backend="gpu", max_slots=3, chunk=8, page_size=8, devices=2, strategy=strategy, check_pages=True)
    print(e.description)
    got = [c.tokens for c in e.generate(ps, max_tokens=10, temperature=0.8, seed=3)]
    e.close()
    assert got == want

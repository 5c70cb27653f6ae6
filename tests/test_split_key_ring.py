"""The split-key attention experiment emit_attention.SPLIT_KEY_STEPS (1, the one-step prefetch, by
default): several steps of keys in flight as a ring of 32-bit words, each slot reloaded after its step
used it. What ptxas makes of it (no repacking of fresh loads, which serialised the ring of bf16 packs
tried at e02e999), no spills, and on a GPU the same bits as the one-step kernel."""

from __future__ import annotations

import re

import numpy as np
import pytest

import megaloop as ml
import megaloop.codegen.emit_attention as emit_attention
from bench.llama_layer import CONTEXT, dependent_decode_graph, layer_config
from megaloop.codegen import generate
from megaloop.plan import make_plan
from megaloop.runtime.compile import compile_cubin, spills
from megaloop.runtime.device import gpus


def decode_source(sequences: int = 1) -> str:
    g = dependent_decode_graph(layer_config(2048, 1), np.zeros((sequences, 1, 2048), np.float32), "auto")
    return generate(make_plan(g, processors=132)).source


def attention_machine_code(src: str) -> str:
    """The machine code of the attention_partial tile function (nvdisasm prints each function apart)."""
    from tests.helpers import sass

    sig = re.search(r"// sig_(\d+): attention_partial ", src).group(1)
    code = sass(compile_cubin(src, "sm_90a", use_cache=False))
    start = re.search(rf"\.type\s+\S*sig_{sig}R\S*,@function", code).end()
    end = code.find(".type", start)
    return code[start:end]


def test_one_step_by_default() -> None:
    src = decode_source()
    assert "loaded a step ahead" in src and "constexpr int PF" not in src


@pytest.mark.parametrize("steps", [4, 8])
def test_the_ring_keeps_its_loads_in_flight(steps: int, monkeypatch) -> None:
    """No PRMT in the tile function: nothing repacks a slot between its load and its use (the one-step
    loop repacks each step's packs at the end of the step before, waiting for them there)."""
    one_step = attention_machine_code(decode_source())
    assert "PRMT" in one_step
    monkeypatch.setattr(emit_attention, "SPLIT_KEY_STEPS", steps)
    src = decode_source(4)
    assert f"constexpr int PF = {steps};" in src
    assert spills(src) == {}
    code = attention_machine_code(src)
    assert "PRMT" not in code
    assert code.count("LD.E.128") >= 2 * steps  # the ring's first steps of keys and values, then its reloads


@pytest.mark.gpu
@pytest.mark.skipif(not gpus()[0], reason="no GPU: " + gpus()[1])
@pytest.mark.parametrize("sequences", [1, 4])
def test_same_bits_as_one_step(sequences: int, monkeypatch) -> None:
    """The same keys in the same order through the same arithmetic: the same bits as the one-step
    kernel, and close to the CPU reference. The caches hold random keys and values (a step reading the
    wrong row changes the result) and the sequences sit at different positions (full, short and empty
    key ranges of the tiles' splits)."""
    from megaloop.runtime.loop import LoopKernel
    from tests.helpers import decode_layer_case

    g, params, feeds = decode_layer_case(sequences, [[CONTEXT], [3], [100], [0]][:sequences])
    rng = np.random.default_rng(sequences + 100)
    state = {n: ml.dtypes.round_to(rng.standard_normal(t.shape), t.dtype) for n, t in g.states.items()}
    with LoopKernel(make_plan(g, processors=132), params, state) as k:
        want = k.run(feeds)["hidden"]
    monkeypatch.setattr(emit_attention, "SPLIT_KEY_STEPS", 4)
    plan = make_plan(g, processors=132)
    assert "constexpr int PF = 4;" in generate(plan).source
    with LoopKernel(plan, params, state) as k:
        got = k.run(feeds)["hidden"]
    assert np.array_equal(got, want), f"worst {np.max(np.abs(got.astype(float) - want.astype(float)))}"
    ref = ml.evaluate(g, feeds, params, state).outputs["hidden"].astype(np.float64)
    rel = np.linalg.norm(got.astype(np.float64) - ref) / np.linalg.norm(ref)
    assert rel < 1e-2, f"relative L2 difference {rel:.2e} from the CPU reference"

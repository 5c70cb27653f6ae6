"""The training step's forward, loss and backward in the loop kernel on a GPU, against the numpy
reference: a tiny Llama in float32 and in bfloat16 (the lead runs these; they skip without a GPU)."""

from __future__ import annotations

import numpy as np
import pytest

import megaloop as ml
from megaloop.models import LlamaConfig, build_llama_gradients, random_parameters
from megaloop.plan import make_plan
from megaloop.runtime.device import gpus

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpus()[0], reason="no GPU: " + gpus()[1])]


@pytest.mark.parametrize("dtype,ulps", [("float32", 64.0), ("bfloat16", 8.0)])
def test_training_graph_on_the_gpu_matches_the_reference(dtype: str, ulps: float) -> None:
    from megaloop.runtime.loop import LoopKernel

    cfg = LlamaConfig(hidden=128, heads=4, kv_heads=2, intermediate=256, layers=2, max_seq=64, vocab=256, dtype=dtype)
    params = random_parameters(cfg, 0)
    g = build_llama_gradients(cfg, 2, 64)
    rng = np.random.default_rng(0)
    feeds = {"tokens": rng.integers(0, 256, (2, 64)), "targets": rng.integers(0, 256, (2, 64))}
    feeds["targets"][0, :5] = -100
    want = ml.evaluate(g, feeds, params).outputs
    with LoopKernel(make_plan(g, processors=132), params) as kernel:
        got = kernel.run(feeds)
    eps = ml.as_dtype(dtype).eps
    for key, ref in want.items():
        ref64, out = ref.astype(np.float64), got[key].astype(np.float64)
        scale = float(np.max(np.abs(ref64)))
        err = float(np.max(np.abs(out - ref64)))
        assert err <= ulps * eps * max(scale, 1e-30), f"{key} [{dtype}]: max error {err:.3e}, scale {scale:.3e}"

"""sample on a real GPU (skipped without one): the loop kernel's tokens are the CPU reference's bit for
bit over many rows, vocabulary sizes up to Llama 3's, every dtype, temperatures, top-k, top-p and min-p
settings, ties and NaN rows; the same inputs give the same tokens run after run; a bad parameter is a
data error; the sampling Llama generator draws the reference's tokens. (The CPU runs the same tile
function through g++: tests/test_sample_codegen.py.)"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import megaloop as ml
from megaloop.models import LlamaConfig, build_llama_generator, random_parameters
from megaloop.plan import make_plan
from megaloop.runtime.device import gpus
from tests.test_sample_codegen import draw_case

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpus()[0], reason="no GPU: " + gpus()[1])]

CASES = [  # (rows, vocabulary, dtype)
    ((64,), 1, "float32"),
    ((64,), 7, "bfloat16"),
    ((32, 2), 300, "float16"),
    ((48,), 1000, "float32"),
    ((16,), 32000, "bfloat16"),
    ((8, 1), 128256, "bfloat16"),
    ((8,), 128256, "float32"),
    ((), 50257, "float16"),
]


def cases_graph(draws: int, seed: int) -> tuple[ml.Graph, dict, list]:
    """Every case ``draws`` times in one graph, its feeds (logits with NaN and infinite rows, parameters
    of every kind: tests/test_sample_codegen.draw_case) and the output names."""
    rng = np.random.default_rng(seed)
    g = ml.Graph("sample-gpu")
    feeds, names = {}, []
    for c, (rows, n, dtype) in enumerate(CASES):
        for d in range(draws):
            key = f"c{c}d{d}"
            x, params = draw_case(rng, rows, n, dtype)
            if rows and d == 0:
                flat = x.reshape(-1, n)
                flat[0, n // 2] = np.nan
                flat[1 % flat.shape[0], n - 1] = np.inf
            ins = [g.input(f"{key}.x", x.shape, dtype)]
            feeds[f"{key}.x"] = x
            for (name, dt), v in zip(
                (("s", "int64"), ("o", "int64"), ("t", "float32"), ("k", "int64"), ("p", "float32"), ("q", "float32")),
                params,
            ):
                ins.append(g.input(f"{key}.{name}", rows, dt))
                feeds[f"{key}.{name}"] = v
            g.output(key, ml.sample(*ins))
            names.append(key)
    return g, feeds, names


@pytest.mark.parametrize("warps", [8, 4])
def test_gpu_tokens_are_the_references_bit_for_bit(warps: int) -> None:
    from megaloop.runtime.loop import LoopKernel

    g, feeds, names = cases_graph(draws=3, seed=warps)
    want = ml.evaluate(g, feeds).outputs
    with LoopKernel(make_plan(g, processors=132, warps=warps)) as k:
        got = k.run(feeds)
        again = k.run(feeds)
    bad = [n for n in names if not np.array_equal(got[n], want[n])]
    assert not bad, "\n".join(f"{n}: gpu {got[n].ravel()[:8]} reference {want[n].ravel()[:8]}" for n in bad[:10])
    assert all(np.array_equal(got[n], again[n]) for n in names)


def test_a_bad_parameter_stops_the_kernel_with_a_data_error() -> None:
    from megaloop.runtime.loop import LoopKernel

    g = ml.Graph("bad-sample")
    x = g.input("x", (4, 100), "float32")
    t = g.input("t", (4,), "float32")
    g.output("token", ml.sample(x, g.input("s", (4,), "int64"), g.input("o", (4,), "int64"), t))
    feeds = {"x": np.zeros((4, 100)), "s": np.arange(4), "o": np.zeros(4, np.int64), "t": [1.0, 1.0, -1.0, 1.0]}
    with LoopKernel(make_plan(g, processors=8)) as k:
        with pytest.raises(ml.errors.DataError, match=r"sample .*: row 2 .* out of range"):
            k.run(feeds)


def test_sampling_generator_on_the_gpu_draws_the_references_tokens() -> None:
    """A Llama-shaped generator with the vocabulary split over tiles, four sequences (greedy, temperature,
    top-k, top-p, an end-of-sequence id and a stop position), 24 steps. Each step from the GPU's state is
    also run by the reference: the logits agree within the model dtype's rounding, and each token is the reference's
    or, where that noise moved a draw across a boundary, the sampler's bit for bit on the GPU's logits."""
    import torch

    from megaloop.runtime.loop import LoopKernel
    from tests.sample_ref import sample_ref

    cfg = LlamaConfig(hidden=256, heads=8, kv_heads=2, intermediate=688, layers=2, max_seq=40, vocab=5000)
    params = random_parameters(cfg, seed=5)
    gen = build_llama_generator(cfg, 4, sampling=True, eos_ids=(17,))
    state = {
        "token": np.array([[1], [2], [3], [4]]),
        "position": np.zeros((4, 1), np.int64),
        "stop": np.array([[40], [40], [11], [40]]),
        "temperature": np.array([[0.0], [1.0], [0.8], [1.5]], np.float32),
        "top_k": np.array([[0], [0], [20], [0]]),
        "top_p": np.array([[1.0], [1.0], [1.0], [0.9]], np.float32),
        "seed": np.array([[1], [2], [3], [4]]),
    }
    same = moved = 0
    worst = 0.0
    tol = 4 * float(ml_dtypes.finfo(cfg.dtype.np).eps)  # a few roundings of the model's dtype, of the largest logit
    with LoopKernel(make_plan(gen, processors=132), params, state) as k:
        for step in range(24):
            before = k.state()
            logits = k.run({}, iterations=1)["logits"]
            after = k.state()
            ref = ml.evaluate(gen, {}, params, before, iterations=1)
            want = ref.outputs["logits"].astype(np.float64)
            worst = max(worst, float(np.abs(logits - want).max() / np.abs(want).max()))
            assert worst <= tol, f"step {step}: the logits are {worst:.2e} (relative) from the reference's"
            for name in ("generated", "position"):
                assert np.array_equal(after[name], ref.state[name]), (step, name)
            changed = after["token"] != ref.state["token"]
            same += int(np.count_nonzero(~changed))
            for b in np.flatnonzero(changed):
                drawn = sample_ref(
                    torch.as_tensor(logits[b, 0].astype(np.float32)),  # bfloat16 to float32: exact
                    *(torch.as_tensor(before[n][b, 0]) for n in ("seed", "position")),
                    *(torch.as_tensor(before[n][b, 0]) for n in ("temperature", "top_k", "top_p")),
                )
                assert int(drawn) == int(after["token"][b, 0]), (step, b, int(drawn), after["token"][b, 0])
                moved += 1
    print(f"24 steps x 4 rows: {same} tokens the reference's, {moved} moved by logit noise {worst:.1e} of {tol:.1e}")
    assert moved <= 24, f"{moved} of 96 draws moved by rounding noise: more than noise explains"


def test_penalize_on_the_gpu_is_the_references_bit_for_bit() -> None:
    """penalize (repetition, presence, frequency) over Llama 3's vocabulary and a small odd one, every
    logit dtype, then a split sample of the penalised logits with min-p: the GPU's values and tokens the
    reference's; a repetition penalty of 0 stops the kernel with a data error naming penalize."""
    from megaloop.runtime.loop import LoopKernel
    from tests.test_sample_penalty import random_penalties

    rng = np.random.default_rng(17)
    g = ml.Graph("penalize-gpu")
    feeds, names = {}, []
    for c, (shape, dtype) in enumerate([((4, 1, 128256), "bfloat16"), ((3, 333), "float32"), ((2, 1000), "float16")]):
        rows = shape[:-1]
        values = random_penalties(rng, shape, dtype)
        ins = [g.input(f"{c}.{k}", v.shape, {"c": "int32", "m": "bool"}.get(k, dtype if k == "x" else "float32"))
               for k, v in values.items()]  # fmt: skip
        feeds.update({f"{c}.{k}": v for k, v in values.items()})
        y = ml.penalize(*ins)
        g.output(f"y{c}", y)
        seed, offset = g.input(f"{c}.s", rows, "int64"), g.input(f"{c}.o", rows, "int64")
        feeds[f"{c}.s"], feeds[f"{c}.o"] = rng.integers(0, 2**62, rows), rng.integers(0, 2**20, rows)
        g.output(f"t{c}", ml.sample(y, seed, offset, 0.8, 40, 0.95, 0.02, splits=126 if shape[-1] > 5000 else None))
        names += [f"y{c}", f"t{c}"]
    want = ml.evaluate(g, feeds).outputs
    with LoopKernel(make_plan(g, processors=132)) as k:
        got = k.run(feeds)
        bad = [n for n in names if not np.array_equal(got[n], want[n], equal_nan=True)]
        assert not bad, {n: np.argwhere(got[n] != want[n])[:4].tolist() for n in bad}
        feeds["1.r"] = feeds["1.r"].copy()
        feeds["1.r"][2] = 0.0
        with pytest.raises(ml.errors.DataError, match=r"penalize .*: row 2 .* repetition penalty not > 0"):
            k.run(feeds)

"""``penalize`` (repetition, presence and frequency penalties) on the CPU: the reference against
transformers' RepetitionPenaltyLogitsProcessor and OpenAI's formula written out in torch (bit for bit,
float32), greedy choices as transformers makes them, the distribution of ``sample`` after it against
softmax of the penalised logits (chi-square), the plan interpreter, the errors; the generated tile
compiles for sm_80 and sm_90a and, through g++ (tests/test_sample_codegen.py's shim), gives the
reference's bits over broadcast and strided operands and stops on bad values. On a GPU:
tests/test_sample_gpu.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import megaloop as ml
from megaloop.codegen import generate
from megaloop.codegen.emit_sample import PENALTY_KIND, tile
from megaloop.errors import DataError, DtypeError, GraphBuildError, ShapeError
from megaloop.frontend.ops.sample_penalty import penalized
from megaloop.frontend.tiling import Box
from megaloop.plan import make_plan
from megaloop.reference.interpreter import run_plan
from megaloop.runtime.compile import compile_cubin
from tests.test_sample import DRAWS, P_VALUE, chi_square_p_value
from tests.test_sample_codegen import build_tile, contiguous, needs_cxx, operand, run_generated

F32 = np.float32


def penalty_graph(shape: tuple[int, ...], dtype: str = "float32", count_dtype: str = "int32") -> ml.Graph:
    rows = shape[:-1]
    g = ml.Graph("penalize")
    ins = [g.input("x", shape, dtype), g.input("c", shape, count_dtype), g.input("m", shape, "bool")]
    ins += [g.input(k, rows, "float32") for k in ("r", "p", "f")]
    g.output("y", ml.penalize(*ins))
    return g


def random_penalties(rng: np.random.Generator, shape: tuple[int, ...], dtype: str = "float32") -> dict:
    rows = shape[:-1]
    return {
        "x": ml.dtypes.round_to(rng.standard_normal(shape) * 3, ml.as_dtype(dtype)),
        "c": rng.choice([0, 0, 0, 1, 2, 7], shape).astype(np.int32),
        "m": rng.random(shape) < 0.2,
        "r": rng.choice(np.array([1.0, 1.05, 1.3, 0.7, 2.0], F32), rows),
        "p": rng.choice(np.array([0.0, 0.5, -0.3, 1.7], F32), rows),
        "f": rng.choice(np.array([0.0, 0.25, -0.1, 2.0], F32), rows),
    }


def openai_torch(x, counts, in_prompt, rep, pres, freq) -> torch.Tensor:
    """An independent writing: transformers' repetition rule on the prompt's and generated tokens, then
    OpenAI's mu - c * frequency - (c > 0) * presence, in torch float32 (vLLM's order of operations)."""
    x, c = torch.as_tensor(x, dtype=torch.float32), torch.as_tensor(counts, dtype=torch.int64)
    rep, pres, freq = (torch.as_tensor(v, dtype=torch.float32)[..., None] for v in (rep, pres, freq))
    seen = torch.as_tensor(in_prompt) | (c > 0)
    x = torch.where(seen, torch.where(x < 0, x * rep, x / rep), x)
    x = x - freq * c.to(torch.float32)
    return x - pres * (c > 0).to(torch.float32)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_reference_is_transformers_and_openai_bit_for_bit(dtype: str) -> None:
    rng = np.random.default_rng(len(dtype))
    shape = (3, 2, 500)
    feeds = random_penalties(rng, shape, dtype)
    feeds["x"].reshape(-1)[:3] = [np.inf, -np.inf, 0.0]
    got = ml.evaluate(penalty_graph(shape, dtype), feeds).outputs["y"]
    assert got.dtype == np.float32
    x32 = feeds["x"].astype(np.float32)
    want = openai_torch(x32, feeds["c"], feeds["m"], feeds["r"], feeds["p"], feeds["f"]).numpy()
    assert np.array_equal(got, want, equal_nan=True), np.argwhere(got != want)[:5]
    assert np.array_equal(got, penalized(x32, feeds["c"], feeds["m"], *(feeds[k][..., None] for k in "rpf")))


def test_repetition_alone_is_transformers_processor() -> None:
    """RepetitionPenaltyLogitsProcessor on the ids of prompt + generated text, against penalize with
    those ids as the prompt mask (repetition counts each token once, however often it came)."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    rng = np.random.default_rng(1)
    vocab, batch = 300, 4
    ids = torch.as_tensor(rng.integers(0, vocab, (batch, 40)))
    scores = torch.as_tensor(rng.standard_normal((batch, vocab)) * 4, dtype=torch.float32)
    scores[0, ids[0, 0]] = scores[0].max() + 0.1  # a seen token the likeliest: the penalty moves the argmax
    for penalty in (1.05, 1.3, 0.8):
        want = RepetitionPenaltyLogitsProcessor(penalty)(ids, scores.clone()).numpy()
        mask = np.zeros((batch, vocab), bool)
        np.put_along_axis(mask, ids.numpy(), True, axis=1)
        feeds = {"x": scores.numpy(), "c": np.zeros((batch, vocab), np.int32), "m": mask}
        feeds.update(r=np.full(batch, penalty, F32), p=np.zeros(batch, F32), f=np.zeros(batch, F32))
        got = ml.evaluate(penalty_graph((batch, vocab)), feeds).outputs["y"]
        assert np.array_equal(got, want), (penalty, np.abs(got - want).max())
        # the greedy choice transformers makes with the penalty, which a strong penalty changes
        assert np.array_equal(got.argmax(-1), want.argmax(-1))
        if penalty == 1.3:
            assert (got.argmax(-1) != scores.numpy().argmax(-1)).any()


def test_penalties_off_leave_the_logits_as_they_are() -> None:
    rng = np.random.default_rng(2)
    feeds = random_penalties(rng, (4, 300), "bfloat16")
    feeds.update(r=np.ones(4, F32), p=np.zeros(4, F32), f=np.zeros(4, F32))
    got = ml.evaluate(penalty_graph((4, 300), "bfloat16"), feeds).outputs["y"]
    assert np.array_equal(got, feeds["x"].astype(np.float32))


@pytest.mark.parametrize(
    "rep,pres,freq,t",
    [(1.5, 0.0, 0.0, 1.0), (1.0, 0.8, 0.0, 1.0), (1.0, 0.0, 0.6, 0.7), (1.3, 0.4, 0.3, 1.5), (0.8, -0.5, 0.0, 1.0)],
)
def test_sample_after_penalize_follows_softmax_of_the_penalised_logits(rep, pres, freq, t, capsys) -> None:
    """Draws of ml.sample(penalize(...)) against softmax(penalised / T) computed in float64 from the
    definition written out here (chi-square, as tests/test_sample.py): the penalties really move the
    distribution (against the unpenalised one, the same test fails)."""
    x = np.array([2.0, 1.5, -1.0, 0.7, 0.0, -0.3, 1.0, 0.5, -2.0, 0.25], F32)
    counts = np.array([3, 0, 1, 0, 2, 0, 1, 0, 0, 0], np.int32)
    prompt = np.array([0, 1, 0, 0, 0, 0, 0, 1, 1, 0], bool)
    n = len(x)
    g = ml.Graph("penalized-draws")
    logits, c, m = g.input("x", (DRAWS, n), "float32"), g.input("c", (n,), "int32"), g.input("m", (n,), "bool")
    offset = g.input("o", (DRAWS,), "int64")
    g.output("token", ml.sample(ml.penalize(logits, c, m, rep, pres, freq), 5, offset, t))
    feeds = {"x": np.broadcast_to(x, (DRAWS, n)), "c": counts, "m": prompt, "o": np.arange(DRAWS)}
    drawn = np.bincount(ml.evaluate(g, feeds).outputs["token"], minlength=n)
    z = x.astype(np.float64)
    seen = prompt | (counts > 0)
    z = np.where(seen, np.where(z < 0, z * rep, z / rep), z) - freq * counts - pres * (counts > 0)
    q = np.exp((z - z.max()) / t)
    q /= q.sum()
    keep = DRAWS * q >= 20
    obs, exp = np.append(drawn[keep], drawn[~keep].sum()), np.append(q[keep], q[~keep].sum())
    if exp[-1] * DRAWS < 20:
        obs, exp = np.append(obs[:-2], obs[-2:].sum()), np.append(exp[:-2], exp[-2:].sum())
    stat, pv = chi_square_p_value(obs, exp)
    with capsys.disabled():
        print(f"\nrepetition {rep} presence {pres} frequency {freq} T {t}: chi-square {stat:.1f}, p-value {pv:.3g}")
    assert pv > P_VALUE, (stat, pv)
    plain = np.exp((x - x.max()) / t)
    plain = plain / plain.sum()
    _, unpenalised = chi_square_p_value(drawn, plain)
    assert unpenalised < P_VALUE, "the penalties did not change the draws"


def test_the_plan_interpreter_gives_the_references_values() -> None:
    rng = np.random.default_rng(3)
    shape = (2, 1, 3000)
    g = penalty_graph(shape, "bfloat16")
    feeds = random_penalties(rng, shape, "bfloat16")
    want = ml.evaluate(g, feeds).outputs["y"]
    plan = make_plan(g, processors=6)
    for seed in range(2):
        assert np.array_equal(run_plan(plan, feeds, seed=seed).outputs["y"], want)


def test_errors_name_the_operand_and_the_value() -> None:
    g = ml.Graph("bad")
    x = g.input("x", (2, 50), "float32")
    c = g.input("c", (2, 50), "int32")
    with pytest.raises(DtypeError, match="counts must be int32 or int64"):
        ml.penalize(x, g.input("cf", (2, 50), "float32"))
    with pytest.raises(DtypeError, match="prompt_mask must be bool"):
        ml.penalize(x, c, g.input("mi", (2, 50), "int32"))
    with pytest.raises(ShapeError, match=r"counts has shape \[3,50\], which does not broadcast"):
        ml.penalize(x, g.input("c3", (3, 50), "int32"))
    with pytest.raises(GraphBuildError, match="repetition must be > 0"):
        ml.penalize(x, c, None, 0.0)
    shape = (2, 50)
    base = random_penalties(np.random.default_rng(4), shape)
    for key, value in (("r", [1.0, 0.0]), ("r", [np.inf, 1.0]), ("p", [0.0, np.nan]), ("f", [np.inf, 0.0])):
        with pytest.raises(DataError, match=r"penalize: at \(\d, 0\) the count"):
            ml.evaluate(penalty_graph(shape), {**base, key: np.array(value, F32)})
    with pytest.raises(DataError, match=r"penalize: at \(1, 7\) the count is -1"):
        c_bad = base["c"].copy()
        c_bad[1, 7] = -1
        ml.evaluate(penalty_graph(shape), {**base, "c": c_bad})


# ---- the generated tile -----------------------------------------------------------------------------------


def test_penalize_kernels_compile() -> None:
    g = ml.Graph("penalize-kernels")
    x = g.input("x", (2, 1, 128256), "bfloat16")
    c, m = g.input("c", (2, 1, 128256), "int32"), g.input("m", (2, 1, 128256), "bool")
    rows = [g.input(k, (2, 1), "float32") for k in "rpf"]
    g.output("tokens", ml.sample(ml.penalize(x, c, m, *rows), 0, g.input("o", (2, 1), "int64"), 0.7, splits=126))
    src = generate(make_plan(g, processors=16)).source
    assert src.count("ml::smp::penalize_tile<2, 1, 128256>(") == 1
    for arch in ("sm_90a", "sm_80"):
        assert compile_cubin(src, arch, use_cache=False)[:4] == b"\x7fELF"


@needs_cxx
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_generated_tile_gives_the_references_bits_on_the_cpu(layout: str, tmp_path: Path) -> None:
    rows, n = (3, 2), 333
    shape = (*rows, n)
    x_strides = contiguous(shape) if layout == "contiguous" else (1, 3, 6)  # the vocabulary axis outermost
    ins = [operand("bfloat16", shape, x_strides), operand("int32", shape), operand("bool", shape)]
    ins += [operand("float32", (*rows, 1)) for _ in range(3)]
    lib = build_tile(tile("penalize", {}, ins, operand("float32", shape)), tmp_path)
    rng = np.random.default_rng(9)
    for _ in range(3):
        feeds = random_penalties(rng, shape, "bfloat16")
        feeds["x"].reshape(-1)[:2] = [np.inf, np.nan]
        arrays = [feeds["x"], feeds["c"], feeds["m"], *(feeds[k][..., None] for k in "rpf")]
        strides = [x_strides] + [contiguous(a.shape) for a in arrays[1:]]
        boxes = [Box((r, 0, lo), (r + 1, 2, min(n, lo + 100))) for r in range(3) for lo in (0, 100, 200, 300)]
        got, info = run_generated(lib, arrays, strides, shape, boxes, threads=64, out_dtype=np.float32)
        assert info[0] == 0, info
        want = ml.evaluate(penalty_graph(shape, "bfloat16"), feeds).outputs["y"]
        assert np.array_equal(got, want, equal_nan=True), np.argwhere(got != want)[:5]
    feeds["f"] = np.array([[0.0, 0.0], [0.0, np.inf], [0.0, 0.0]], F32)
    arrays[5] = feeds["f"][..., None]
    _, info = run_generated(lib, arrays, strides, shape, boxes, threads=64, out_dtype=np.float32)
    assert info[0] == 2 and info[4] == 3 and info[6] == PENALTY_KIND, info  # DATA, row (1, 1) = 3, the kind

"""``sample`` on the CPU: its arithmetic (Philox's published answers, the 2^f polynomial over every
float32 of a dense grid, the weights against float64 exp within the documented bound), the reference
against an independent implementation of the definition (tests/sample_ref.py), the distribution
against softmax(logits / T) by a chi-square test that a biased sampler fails, top-k / top-p never
drawing outside their sets (ties at the boundary included), temperature 0 as argmax, seeds, the plan
interpreter's random orders, and the errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import megaloop as ml
from megaloop.errors import DataError, DtypeError, GraphBuildError, NonFiniteError, ShapeError
from megaloop.frontend.ops import _sampling
from megaloop.frontend.ops._sampling import EXP2_COEFFS, exp2_poly, order_keys, philox4x32_10, weights
from megaloop.plan import make_plan
from megaloop.reference.interpreter import run_plan
from tests.sample_ref import sample_ref

F32 = np.float32


# ---- the arithmetic --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "counter,key,want",
    [  # Random123's known-answer vectors (kat_vectors) for Philox4x32-10
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        (
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            (0xA4093822, 0x299F31D0),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
        ),
    ],
)
def test_philox_gives_the_published_answers(counter, key, want) -> None:
    got = philox4x32_10(tuple(np.uint64(c) for c in counter), tuple(np.uint64(k) for k in key))
    assert tuple(int(v) for v in got) == want


def test_exp2_polynomial_is_within_1_5_ulps_on_0_1() -> None:
    """Every 61st float32 of [0, 1] and all of [0.996, 1] and [0, 2^-100]: |P(f) / 2^f - 1| <= 1.46 * 2^-24;
    P(0) = 1 and P(1) = 2 exactly, so the largest logit weighs 2^40 and no weight reaches 2^41."""
    one = int(np.array(1.0, F32).view(np.int32))
    bits = np.concatenate([np.arange(0, one + 1, 61), np.arange(one - 2**15, one + 1), np.arange(0, 2**16)])
    f = bits.astype(np.int32).view(F32)
    p = exp2_poly(f)
    rel = np.abs(p.astype(np.float64) / np.exp2(f.astype(np.float64)) - 1)
    assert rel.max() <= 1.46 * 2.0**-24, rel.max() / 2.0**-24
    assert exp2_poly(np.array([0.0], F32))[0] == 1.0 and exp2_poly(np.array([1.0], F32))[0] == 2.0
    assert p.max() <= 2.0
    assert len(EXP2_COEFFS) == 6 and all(c.dtype == F32 for c in EXP2_COEFFS)


def test_weights_are_exp_within_the_documented_bound(capsys) -> None:
    """w_i / 2^40 = 2^(e_i) (1 + err): |err| <= 1.5e-7 + |e_i| 2^-22 + 2^-40 / 2^(e_i), e_i the exact
    log2-weight (x_i - m) log2(e) / T; weights of e_i < -40 - |e_i| 2^-22 are 0, of e_i > -40 + ... not."""
    rng = np.random.default_rng(0)
    worst = 0.0
    for t in (0.05, 0.7, 1.0, 2.5, 1000.0):
        x = (rng.standard_normal((64, 4096)) * 6).astype(F32)
        m = x.max(-1)
        w = weights(x, m, _sampling.LOG2E / np.full(64, t, F32))
        e = (x.astype(np.float64) - m[:, None]) / t / math.log(2)
        slack = np.abs(e) * 2.0**-22
        live = e > -40 + slack
        assert np.all(w[e < -40 - slack] == 0) and np.all(w[live] > 0)
        e = np.where(live, e, 0.0)
        bound = 1.5e-7 + slack + 2.0 ** (-40 - e)
        err = np.abs(w.astype(np.float64) / 2.0 ** (40 + e) - 1)
        assert np.all(err[live] <= bound[live]), float((err[live] / bound[live]).max())
        near = live & (e > -6)  # tokens within a factor 2^-6 of the largest: within 2.5e-6
        worst = max(worst, float(err[near].max()))
        assert np.all(w[np.arange(64), x.argmax(-1)] == 2**40)
    assert worst < 2.5e-6
    with capsys.disabled():
        print(f"\nweights of tokens within 2^-6 of the largest: worst relative error {worst:.2e}")


def test_keys_order_as_the_values_and_zero_has_one_key() -> None:
    v = np.array([-np.inf, -3e38, -1.5, -1e-45, -0.0, 0.0, 1e-45, 2.0, 3e38, np.inf], F32)
    k = order_keys(v)
    assert np.all(np.diff(k.astype(np.int64)[[0, 1, 2, 3, 5, 6, 7, 8, 9]]) > 0)
    assert k[4] == k[5]


# ---- the reference against the independent implementation ---------------------------------------------


def graph_of(shape: tuple[int, ...], dtype: str, params_shape: tuple[int, ...] | None = None) -> ml.Graph:
    g = ml.Graph("sample")
    rows = shape[:-1]
    ps = rows if params_shape is None else params_shape
    x = g.input("x", shape, dtype)
    seed = g.input("seed", ps, "int64")
    offset = g.input("offset", rows, "int64")
    temperature, top_k, top_p = g.input("t", ps, "float32"), g.input("k", ps, "int64"), g.input("p", ps, "float32")
    g.output("token", ml.sample(x, seed, offset, temperature, top_k, top_p, g.input("q", ps, "float32")))
    return g


def random_feeds(rng: np.random.Generator, shape, dtype: str, params_shape=None) -> dict[str, np.ndarray]:
    rows, n = shape[:-1], shape[-1]
    ps = rows if params_shape is None else params_shape
    kind = rng.integers(0, 3)
    if kind == 0:
        x = rng.integers(-4, 4, shape).astype(np.float64)  # ties everywhere
    elif kind == 1:
        x = rng.standard_normal(shape) * rng.choice([0.1, 3.0, 30.0])
    else:
        x = np.log(rng.dirichlet(np.full(n, 0.3), size=rows)) if rows else np.log(rng.dirichlet(np.full(n, 0.3)))
    return {
        "x": ml.dtypes.round_to(x, ml.as_dtype(dtype)),
        "seed": rng.integers(-(2**63), 2**63 - 1, ps, dtype=np.int64),
        "offset": rng.integers(0, 2**40, rows, dtype=np.int64),
        "t": rng.choice(np.array([0.0, 1e-3, 0.3, 1.0, 2.0, 50.0], F32), ps),
        "k": rng.choice(np.array([0, 1, 2, 5, n - 1, n, n + 7]), ps).astype(np.int64),
        "p": rng.choice(np.array([1.0, 0.999, 0.9, 0.5, 0.2, 1e-9], F32), ps),
        "q": rng.choice(np.array([0.0, 0.0, 0.0, 1e-5, 0.05, 0.5, 1.0], F32), ps),
    }


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_reference_is_the_independent_implementation(dtype: str) -> None:
    rng = np.random.default_rng(len(dtype))
    for case in range(40):
        shape = (int(rng.integers(1, 5)), int(rng.choice([1, 3, 10, 64, 513])))
        feeds = random_feeds(rng, shape, dtype)
        got = ml.evaluate(graph_of(shape, dtype), feeds).outputs["token"]
        want = sample_ref(
            torch.from_numpy(feeds["x"].astype(np.float64)),
            *(
                torch.from_numpy(feeds[k].astype(np.float64 if feeds[k].dtype.kind == "f" else np.int64))
                for k in ("seed", "offset", "t", "k", "p", "q")
            ),
        ).numpy()
        assert np.array_equal(got, want), f"case {case}: {got} != {want}, feeds {feeds}"


def test_plan_interpreter_gives_the_references_tokens_in_any_order() -> None:
    rng = np.random.default_rng(11)
    for shape, params_shape, dtype in [
        ((3, 5, 700), (3, 1), "bfloat16"),
        ((9, 33), (), "float32"),
        ((2, 1), None, "float16"),
    ]:
        g = graph_of(shape, dtype, params_shape if params_shape is not None else None)
        feeds = random_feeds(rng, shape, dtype, params_shape)
        want = ml.evaluate(g, feeds).outputs["token"]
        plan = make_plan(g, processors=4)
        for seed in range(3):
            assert np.array_equal(run_plan(plan, feeds, seed=seed).outputs["token"], want), (shape, seed)


# ---- what a user relies on ---------------------------------------------------------------------------------


def tokens(x: np.ndarray, *, seed=0, offset=None, t=1.0, k=0, p=1.0, q=0.0, dtype: str = "float32") -> np.ndarray:
    """The reference's tokens for rows ``x`` [rows, n] (offsets 0.. by default)."""
    rows = x.shape[0]
    g = graph_of(x.shape, dtype)
    feeds = {
        "x": ml.dtypes.round_to(x, ml.as_dtype(dtype)),
        "seed": np.broadcast_to(np.asarray(seed, np.int64), (rows,)).copy(),
        "offset": np.arange(rows, dtype=np.int64) if offset is None else np.asarray(offset, np.int64),
        "t": np.full(rows, t, F32),
        "k": np.full(rows, k, np.int64),
        "p": np.full(rows, p, F32),
        "q": np.full(rows, q, F32),
    }
    return ml.evaluate(g, feeds).outputs["token"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_temperature_zero_is_argmax(dtype: str) -> None:
    rng = np.random.default_rng(5)
    x = rng.integers(-3, 3, (64, 300)).astype(np.float64)  # ties: the first largest
    x[3, 17] = np.nan  # the first NaN wins, as in argmax
    x[4, 250] = np.inf
    x[5] = -np.inf  # no finite maximum: index 0
    x[6, [9, 200]] = np.nan
    rounded = ml.dtypes.round_to(x, ml.as_dtype(dtype))
    g = ml.Graph("argmax")
    g.output("i", ml.argmax(g.input("x", x.shape, dtype), -1))
    want = ml.evaluate(g, {"x": rounded}).outputs["i"]
    assert np.array_equal(tokens(x, t=0.0, k=7, p=0.5, dtype=dtype), want)
    assert np.array_equal(tokens(x, t=1e-40, dtype=dtype), want)  # subnormal temperatures too
    # rows without a finite maximum give the argmax at any temperature
    assert list(tokens(x[3:7], t=1.0, dtype=dtype)) == list(want[3:7]) == [17, 250, 0, 9]


def test_same_seed_same_tokens_other_seeds_differ() -> None:
    rng = np.random.default_rng(6)
    x = rng.standard_normal((200, 1000)) * 0.5  # flat: many likely tokens
    a = tokens(x, seed=1234)
    assert np.array_equal(a, tokens(x, seed=1234))
    b, c = tokens(x, seed=1235), tokens(x, seed=-1234)
    assert (a != b).mean() > 0.9 and (a != c).mean() > 0.9
    assert (a != tokens(x, seed=1234, offset=np.arange(200) + 1)).mean() > 0.9  # the offset moves the draw
    # a row's token is its own seed's and offset's, whatever the rows around it
    assert tokens(x[17:18], seed=1234, offset=[17])[0] == a[17]


# ---- the distribution --------------------------------------------------------------------------------------

P_VALUE = 1e-6  # a correct sampler fails with this probability (the draws are fixed: it passes or fails always)


def chi_square_p_value(counts: np.ndarray, probs: np.ndarray) -> tuple[float, float]:
    """Pearson's statistic of observed ``counts`` against ``probs`` and its p-value under chi-square
    with (categories - 1) degrees of freedom (the regularised upper incomplete gamma function)."""
    n = counts.sum()
    expected = n * probs
    assert expected.min() >= 20, "merge rare categories first: the chi-square law needs enough per category"
    stat = float(((counts - expected) ** 2 / expected).sum())
    dof = len(counts) - 1
    p = float(
        torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64))
    )
    return stat, p


def softmax(x: np.ndarray, t: float, keep: np.ndarray | None = None) -> np.ndarray:
    z = x.astype(np.float64) / t
    q = np.exp(z - z.max())
    if keep is not None:
        q = np.where(keep, q, 0.0)
    return q / q.sum()


DRAWS = 200_000
LOGITS = np.array([2.0, 1.5, 1.5, 0.7, 0.0, -0.3, -1.0, 0.5, 1.0, -0.5, 0.25, -2.0], F32)


def drawn_counts(x: np.ndarray, n: int = DRAWS, seed: int = 99, **kw) -> np.ndarray:
    got = tokens(np.broadcast_to(x, (n, len(x))), seed=seed, **kw)
    return np.bincount(got, minlength=len(x))


@pytest.mark.parametrize(
    "t,k,p,q,keep",
    [
        (1.0, 0, 1.0, 0.0, None),
        (0.6, 0, 1.0, 0.0, None),  # the rarest tokens' categories merged (too few expected draws each)
        (2.5, 0, 1.0, 0.0, None),
        (1.0, 3, 1.0, 0.0, [0, 1, 2]),  # the 3rd largest logit is 1.5, tied with the 2nd
        (1.0, 2, 1.0, 0.0, [0, 1, 2]),  # k = 2 keeps both 1.5s: ties at the boundary stay
        (1.0, 0, 0.5, 0.0, [0, 1, 2]),  # 2.0 alone weighs 0.22, with the two 1.5s 0.49 (< 0.5): with 1.0, 0.57
        (1.0, 5, 0.8, 0.0, [0, 1, 2, 8]),  # within the top 5, {2.0, 1.5, 1.5} weigh 0.78, with 1.0 0.91
        (1.0, 0, 1.0, 0.3, [0, 1, 2, 8]),  # min-p: e^(x - 2) >= 0.3 for x >= 0.80
        (2.5, 0, 1.0, 0.3, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]),  # after the temperature: x >= 2 + 2.5 ln 0.3 = -1.01
        (1.0, 5, 0.95, 0.45, [0, 1, 2]),  # top-k, top-p (keeps 5), then min-p (x >= 1.20)
        (1.0, 0, 0.5, 0.01, [0, 1, 2]),  # top-p's set is smaller than min-p's: top-p decides
    ],
)
def test_the_distribution_is_softmax_over_the_kept_tokens(t, k, p, q, keep, capsys) -> None:
    """Pearson's chi-square over DRAWS draws (offsets 0..DRAWS-1), categories with fewer than 20
    expected draws merged. Why the bound holds: the sampler's own law differs from softmax by a
    relative 1e-5 at most (the weights' quantisation), a non-centrality of DRAWS * (1e-5)^2 = 2e-5 in
    the statistic, so under a correct sampler it is chi-square(categories - 1) up to that, and a
    p-value below P_VALUE fails the test. The kept set: top-k, then top-p of top-k's mass, then min-p
    of the temperature's distribution (transformers' order)."""
    x = LOGITS
    kept = np.ones(len(x), bool)
    if k or p < 1 or q > 0:  # the expected set from the float64 definition, written out here
        kth = np.sort(x)[::-1][k - 1] if k else -np.inf
        in_k = x >= kth
        qk = softmax(x, t, in_k)
        thresholds = sorted(set(x[in_k].tolist()), reverse=True)
        floor = next(v for v in thresholds if qk[x >= v].sum() >= p) if p < 1 else kth
        kept = (x >= floor) & (np.exp((x.astype(np.float64) - x.max()) / t) >= q)
        assert set(np.flatnonzero(kept).tolist()) == set(keep), (np.flatnonzero(kept), keep)
    counts = drawn_counts(x, seed=int(100 * t + 10 * k + 1000 * p + 10000 * q), t=t, k=k, p=p, q=q)
    probs = softmax(x, t, kept)
    assert counts[~kept].sum() == 0, f"drawn outside the kept set: {counts}"
    cats = np.flatnonzero(kept & (DRAWS * probs >= 20))
    rest = np.setdiff1d(np.flatnonzero(kept), cats)
    obs = np.append(counts[cats], counts[rest].sum()) if rest.size else counts[cats]
    exp = np.append(probs[cats], probs[rest].sum()) if rest.size else probs[cats]
    if rest.size and DRAWS * exp[-1] < 20:  # the merged tail still too rare: fold it into the last category
        obs, exp = np.append(obs[:-2], obs[-2:].sum()), np.append(exp[:-2], exp[-2:].sum())
    stat, pv = chi_square_p_value(obs, exp)
    with capsys.disabled():
        print(f"\nT={t} k={k} p={p} min_p={q}: chi-square {stat:.1f} over {len(obs) - 1} degrees of freedom, "
              f"p-value {pv:.3g}")  # fmt: skip
    assert pv > P_VALUE, f"the draws do not follow softmax(logits / T): chi-square {stat:.1f}, p-value {pv:.3g}"


@pytest.mark.parametrize("factor", [1.05, 0.95])
def test_the_chi_square_test_fails_a_biased_sampler(factor: float, monkeypatch) -> None:
    """The same test on a sampler whose weight of the likeliest token is off by 5 %: a p-value far below
    P_VALUE (a non-centrality of DRAWS * q0 * 0.05^2 * (1 - q0) = 91 in the statistic, q0 = 0.24)."""
    real = _sampling.weights

    def biased(x, m, c):
        w = real(x, m, c)
        w[:, 0] = (w[:, 0].astype(np.float64) * factor).astype(np.uint64)
        return w

    monkeypatch.setattr(_sampling, "weights", biased)
    counts = drawn_counts(LOGITS, t=1.0)
    stat, pv = chi_square_p_value(counts, softmax(LOGITS, 1.0))
    assert pv < P_VALUE * 1e-3, (stat, pv)


def test_top_k_and_top_p_never_draw_outside_their_sets() -> None:
    """Many draws of rows built with ties at the boundaries; every draw inside the set the definition keeps
    (computed here from sorted logits and float64 softmax, boundaries chosen far from rounding), and every
    token of the set drawn at least once."""
    rng = np.random.default_rng(8)
    n = 40
    for case in range(30):
        x = rng.integers(-6, 6, n).astype(F32) * F32(0.5)  # many ties
        t = float(rng.choice([0.5, 1.0, 3.0]))
        k = int(rng.integers(1, n))
        z = np.sort(x)[::-1]
        in_k = x >= z[k - 1]
        q = softmax(x, t, in_k)
        levels = sorted(set(x[in_k].tolist()), reverse=True)
        mass = [q[x >= v].sum() for v in levels]
        # a top_p halfway between two tie groups' cumulative masses: no rounding can move the boundary
        g = int(rng.integers(0, len(levels)))
        p = (mass[g] + (mass[g - 1] if g else 0.0)) / 2 if mass[g] - (mass[g - 1] if g else 0.0) > 1e-3 else 1.0
        kept = in_k & (x >= levels[g]) if p < 1 else in_k
        got = tokens(np.broadcast_to(x, (4000, n)), seed=case, t=t, k=k, p=p)
        drawn = np.bincount(got, minlength=n) > 0
        assert not np.any(drawn & ~kept), f"case {case}: drawn outside the kept set {np.flatnonzero(drawn & ~kept)}"
        rare = 4000 * softmax(x, t, kept) < 30  # tokens too unlikely to be seen in 4000 draws
        assert np.all(drawn | ~kept | rare), f"case {case}: kept tokens never drawn {np.flatnonzero(kept & ~drawn)}"


def test_min_p_keeps_the_tokens_at_least_that_likely_relative_to_the_top() -> None:
    """min_p 1 keeps the largest logit's tie group alone; a min_p just above or below a token's ratio
    to the likeliest (far from the weights' quantisation) drops or keeps it."""
    x = np.array([1.0, 3.0, 2.0, 3.0, 0.0, 3.0], F32)
    assert set(tokens(np.broadcast_to(x, (3000, 6)), q=1.0).tolist()) == {1, 3, 5}
    ratio = math.exp(-1.0)  # token 2's probability over a 3.0's
    assert set(tokens(np.broadcast_to(x, (3000, 6)), q=ratio * 1.001).tolist()) == {1, 3, 5}
    assert set(tokens(np.broadcast_to(x, (3000, 6)), q=ratio * 0.999).tolist()) == {1, 2, 3, 5}
    assert set(tokens(np.broadcast_to(x, (3000, 6)), t=2.0, q=math.exp(-0.5) * 0.999).tolist()) == {1, 2, 3, 5}


def test_top_p_of_a_tie_keeps_the_whole_group_and_tiny_top_p_keeps_the_top() -> None:
    x = np.array([1.0, 3.0, 2.0, 3.0, 0.0, 3.0], F32)
    for p in (1e-9, 0.01, 0.3):  # the three 3.0s weigh 0.87: any top_p up to that keeps exactly them
        got = set(tokens(np.broadcast_to(x, (3000, 6)), p=p).tolist())
        assert got == {1, 3, 5}, (p, got)
    assert set(tokens(np.broadcast_to(x, (3000, 6)), p=0.9).tolist()) == {1, 2, 3, 5}
    assert set(tokens(np.broadcast_to(x, (3000, 6)), k=1).tolist()) == {1, 3, 5}  # k = 1 with a tied top


# ---- errors ---------------------------------------------------------------------------------------------------


def test_bad_parameters_are_data_errors() -> None:
    x = np.zeros((2, 10), F32)
    bads = ({"t": -1.0}, {"t": np.inf}, {"t": np.nan}, {"k": -1}, {"p": 0.0}, {"p": 1.5}, {"p": np.nan}, {"q": -0.5})
    for bad in (*bads, {"q": 1.01}, {"q": np.nan}):
        kw = {"t": 1.0, "k": 0, "p": 1.0, "q": 0.0, **bad}
        with pytest.raises(DataError, match=r"sample: row \(0,\) has temperature"):
            tokens(x, **kw)


def test_build_errors_name_the_operand() -> None:
    g = ml.Graph("bad")
    x = g.input("x", (4, 100), "bfloat16")
    s, o = g.input("s", (4,), "int64"), g.input("o", (4,), "int64")
    with pytest.raises(DtypeError, match="sample takes floating"):
        ml.sample(g.input("i", (4, 100), "int32"), s, o)
    with pytest.raises(DtypeError, match="temperature must be float32, got bfloat16"):
        ml.sample(x, s, o, g.input("t", (4,), "bfloat16"))
    with pytest.raises(ShapeError, match=r"top_k has shape \[3\], which does not broadcast to the rows \[4\]"):
        ml.sample(x, s, o, 1.0, g.input("k", (3,), "int64"))
    with pytest.raises(ShapeError, match="would draw the same random number"):
        ml.sample(x, 7, g.input("o1", (1,), "int64"))
    with pytest.raises(ShapeError, match="vocabulary axis"):
        ml.sample(g.input("v", (), "float32"), 0, 0)
    with pytest.raises(GraphBuildError, match=r"top_p must be in \(0, 1\]"):
        ml.sample(x, s, o, 1.0, 0, 0.0)
    with pytest.raises(GraphBuildError, match="top_k must be a megaloop Tensor or an int"):
        ml.sample(x, s, o, 1.0, 2.5)
    with pytest.raises(NonFiniteError):
        ml.sample(x, s, o, float("nan"))
    # a Python number is a constant; one row's tensors need no broadcast at all
    y = ml.sample(g.input("one", (1, 1, 50), "float16"), 3, 4, 0.7, 5, 0.9)
    assert y.shape == (1, 1) and y.dtype == ml.int64


def test_sample_tokens_on_host_arrays_is_the_op() -> None:
    from megaloop.frontend.ops.sample import sample_tokens

    rng = np.random.default_rng(12)
    shape = (3, 2, 77)
    feeds = random_feeds(rng, shape, "bfloat16")
    want = ml.evaluate(graph_of(shape, "bfloat16"), feeds).outputs["token"]
    got = sample_tokens(feeds["x"], feeds["seed"], feeds["offset"], feeds["t"], feeds["k"], feeds["p"], feeds["q"])
    assert np.array_equal(got, want)
    assert sample_tokens(np.array([0.0, 5.0, 1.0]), 0, 0, 0.0).item() == 1  # numbers broadcast; 0-d rows
    with pytest.raises(DataError, match="top_p"):
        sample_tokens(np.zeros((2, 4)), [0, 1], 0, 1.0, 0, 2.0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_split_sample_is_sample_in_any_order(dtype: str, monkeypatch) -> None:
    """ml.sample(..., splits=S) (argmax_partial, sample_partial, sample_combine) gives sample's tokens,
    through the reference and the plan interpreter's random orders, where the candidates settle the
    thresholds and where the combine computes the row whole (both taken here)."""
    from megaloop.frontend.ops import sample_split

    paths = [0, 0]
    real = sample_split.combine_row

    def counted(*a):
        token = real(*a)
        paths[token is None] += 1
        return token

    monkeypatch.setattr(sample_split, "combine_row", counted)
    rng = np.random.default_rng(21)
    for case in range(16):
        n = int(rng.choice([40, 700, 3000]))
        shape = (int(rng.integers(1, 4)), n)
        feeds = random_feeds(rng, shape, dtype)
        if case % 4 == 0:  # a language model's: a few likely tokens over a long tail
            feeds["x"] = ml.dtypes.round_to(
                rng.standard_normal(shape) * 2 + (rng.random(shape) < 0.01) * 8, ml.as_dtype(dtype)
            )
        g = ml.Graph("split")
        x = g.input("x", shape, dtype)
        ins = [g.input(k, feeds[k].shape, feeds[k].dtype.name) for k in ("seed", "offset", "t", "k", "p", "q")]
        splits = int(rng.integers(2, 12))
        g.output("token", ml.sample(x, *ins, splits=splits))
        assert [n.op.name for n in g.nodes][-3:] == ["argmax_partial", "sample_partial", "sample_combine"]
        want = ml.evaluate(graph_of(shape, dtype), feeds).outputs["token"]
        assert np.array_equal(ml.evaluate(g, feeds).outputs["token"], want), (case, splits)
        planned = run_plan(make_plan(g, processors=int(rng.integers(2, 9))), feeds, seed=case)
        assert np.array_equal(planned.outputs["token"], want), (case, splits)
    assert paths[0] and paths[1], f"settled by the candidates / computed whole: {paths}"


def test_the_split_halves_build_on_their_own() -> None:
    g = ml.Graph("halves")
    x = g.input("x", (2, 300), "float32")
    s, o, t = g.input("s", (2,), "int64"), g.input("o", (2,), "int64"), g.input("t", (2,), "float32")
    k, p, q = g.input("k", (2,), "int64"), g.input("p", (2,), "float32"), g.input("q", (2,), "float32")
    summary = ml.sample_partial(x, t, splits=4)
    assert summary.shape == (2, 4, 66) and summary.dtype == ml.int64
    g.output("halves", ml.sample_combine(x, summary, s, o, t, k, p, q))
    g.output("whole", ml.sample(x, s, o, t, k, p, q, splits=4))
    feeds = random_feeds(np.random.default_rng(4), (2, 300), "float32")
    feeds = {
        "x": feeds["x"],
        "s": feeds["seed"],
        "o": feeds["offset"],
        "t": feeds["t"],
        "k": feeds["k"],
        "p": feeds["p"],
        "q": feeds["q"],
    }
    out = ml.evaluate(g, feeds).outputs
    assert np.array_equal(out["halves"], out["whole"])
    with pytest.raises(GraphBuildError, match="summary must be sample_partial's output"):
        ml.sample_combine(g.input("y", (2, 300), "float32"), summary, s, o, t, k, p)
    with pytest.raises(GraphBuildError, match="splits must be an int >= 1"):
        ml.sample(x, s, o, splits=0)


def test_split_min_p_settles_from_the_candidates_or_computes_the_row_whole(monkeypatch) -> None:
    """min-p alone (no top-k, top-p): where nothing at or below the candidates' bound is likely enough
    (a few likely tokens over a long tail), the combine draws from the candidates; where the bound's own
    weight reaches min-p's (a flat row), it computes the row whole. Both give sample's tokens."""
    from megaloop.frontend.ops import sample_split

    paths: list[bool] = []
    real = sample_split.combine_row
    monkeypatch.setattr(sample_split, "combine_row", lambda *a: paths.append((t := real(*a)) is None) or t)
    rng = np.random.default_rng(31)
    n, rows = 3000, 64
    peaked = rng.standard_normal((rows, n)) + (rng.random((rows, n)) < 0.003) * 9
    flat = rng.standard_normal((rows, n)) * 0.01
    for x, whole in ((peaked, False), (flat, True)):
        paths.clear()
        feeds = {"x": x.astype(F32), "seed": np.arange(rows), "offset": np.zeros(rows, np.int64)}
        feeds.update(t=np.ones(rows, F32), k=np.zeros(rows, np.int64), p=np.ones(rows, F32), q=np.full(rows, 0.1, F32))
        g = ml.Graph("split-min-p")
        ins = [g.input(k, v.shape, v.dtype.name) for k, v in feeds.items()]
        g.output("token", ml.sample(*ins, splits=10))
        want = ml.evaluate(graph_of((rows, n), "float32"), feeds).outputs["token"]
        assert np.array_equal(ml.evaluate(g, feeds).outputs["token"], want)
        assert paths and all(p == whole for p in paths), (whole, paths)
        if not whole:  # and min-p mattered: without it other tokens come
            assert not np.array_equal(tokens(x, seed=np.arange(rows), offset=np.zeros(rows)), want)

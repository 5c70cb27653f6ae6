"""Generation split over devices (``Generator(devices=N, strategy=...)``, ``megaloop generate
--devices N``; megaloop/generation/split.py) on the CPU reference as N ranks, against the one-device
run and transformers, float32.

What is guaranteed and tested: pp and dp compute every value as one device does (the logits are
bitwise equal on the reference), so greedy and seeded sampled tokens are equal; tp reorders sums
(logits within 1e-5 relative), so a token may differ only where the one-device logits leave less
than the tolerance between the two best (greedy) or a nudge of the logits by it changes the draw
(sampling), and the sequences part there. The GPU case (two ranks on one GPU) is marked gpu."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

import megaloop as ml
from megaloop.cli import main
from megaloop.frontend.ops.sample import sample_tokens
from megaloop.generation import GenerationError
from megaloop.generation.backends import first_tokens
from megaloop.models import LlamaConfig, build_llama, random_parameters
from megaloop.models.tiny import make_tiny_checkpoint
from megaloop.runtime.device import gpus

PROMPTS = ["Hi", "Once upon a loop, a kernel", "A loop kernel is one program that"]
NEW = 12
SPLIT_TOL = 1e-5  # tp's relative logits difference (float32 reassociation, docs/partition.md)
MARGIN = 1e-4  # a token may differ where the logits leave less than this (relative to their scale)
SAMPLING = {"temperature": 0.9, "top_k": 30, "top_p": 0.95}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def one(tiny):
    return ml.Generator(tiny, backend="cpu", dtype="float32", eos_token_ids=(), progress=False)


def split_generator(folder, strategy: str, devices: int = 2, **kw) -> ml.Generator:
    return ml.Generator(
        folder, backend="cpu", dtype="float32", eos_token_ids=(), progress=False, devices=devices, strategy=strategy,
        **kw,
    )  # fmt: skip


def logits_along(cfg, params, seq: list[int], strategy: str | None = None, devices: int = 2) -> np.ndarray:
    """The logits [len(seq), vocab] at every position of ``seq`` (one prefill step of build_llama),
    on one device or split by ``strategy`` (dp: of a batch of ``devices`` copies of it)."""
    n, batch = len(seq), devices if strategy == "dp" else 1
    g = build_llama(dataclasses.replace(cfg, max_seq=n), batch, n)
    feeds = {"tokens": np.array([seq] * batch), "positions": np.tile(np.arange(n), (batch, 1))}
    if strategy is None:
        return ml.evaluate(g, feeds, params).outputs["logits"][0]
    split = ml.parallelize(g, devices, strategy)
    ranks = ml.evaluate(split.graphs, split.shard_inputs(feeds), split.shard_parameters(params))
    return split.gather_outputs(ranks)["logits"][0]


def relative(got: np.ndarray, want: np.ndarray, what: str) -> float:
    err = np.abs(got.astype(np.float64) - want)
    at = np.unravel_index(int(err.argmax()), err.shape)
    rel = float(err[at] / np.abs(want).max())
    print(f"{what}: worst relative difference {rel:.2e} at {at} ({got[at]:.7g} against {want[at]:.7g})")
    return rel


def greedy_fragile(row: np.ndarray, tol: float) -> bool:
    top = np.sort(row.astype(np.float64))[-2:]
    return bool(top[1] - top[0] <= tol)


def draw_fragile(row: np.ndarray, seed: int, offset: int, tol: float) -> bool:
    """Whether nudging the logits by ``tol`` (up, down, and 8 random ways) changes the drawn token."""
    rng = np.random.default_rng(offset)
    nudges = [0.0, tol, -tol, *(tol * rng.uniform(-1, 1, (8, row.size)))]
    picks = {int(sample_tokens((row + d).astype(np.float32), seed, offset, **SAMPLING)) for d in nudges}
    return len(picks) > 1


def check_tokens(
    got: list[int], want: list[int], prompt: list[int], ref: np.ndarray, what: str, seed: int | None = None
) -> None:
    """``got`` equals ``want`` up to the first token whose logits (``ref``, along prompt + want) leave
    no margin of MARGIN (greedy; or, with ``seed``, for the draw); there the sequences may part."""
    assert len(got) == len(want), f"{what}: {len(got)} tokens against {len(want)}"
    tol = MARGIN * float(np.abs(ref).max())
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            offset = len(prompt) - 1 + i
            row = ref[offset]
            fragile = greedy_fragile(row, tol) if seed is None else draw_fragile(row, seed, offset, tol)
            assert fragile, (
                f"{what}: token {i} is {a}, one device made {b}, though the logits leave a margin larger than the "
                "split's difference"
            )
            print(f"{what}: the sequences part at token {i}, where the logits leave no margin")
            return


CASES = [("tp", 3), ("pp", 3), ("dp", 3), ("auto", 3), ("auto", 1)]


@pytest.mark.parametrize(("strategy", "batch"), CASES, ids=[f"{s}-batch{b}" for s, b in CASES])
def test_split_greedy_tokens_match_one_device(tiny, one, strategy: str, batch: int) -> None:
    """tp2, pp2, dp2 (3 prompts over 2 devices: uneven) and auto on the tiny checkpoint (auto picks per
    graph, the caches cut again between them; a graph this small is predicted fastest on one device,
    and auto says so)."""
    prompts = PROMPTS[:batch]
    want = one.generate(prompts, max_new_tokens=NEW)
    got = split_generator(tiny, strategy).generate(prompts, max_new_tokens=NEW)
    print(got.stats.summary(), got.stats.split, sep="\n")
    assert got.stats.split.startswith(f"split over 2 devices ({strategy}): prefill ")
    if strategy != "auto":
        assert "as 2 ranks" in got.stats.backend
        assert f"prefill {strategy}2" in got.stats.split and f"generator {strategy}2" in got.stats.split
        assert got.stats.split.count("us on one device") == 2, "each graph's prediction beside one device's"
    else:
        picks = re.findall(r"(?:prefill|generator) (one device|\w+2)", got.stats.split)
        assert len(picks) == 2, got.stats.split
        ranks = ["1 rank" if p == "one device" else "2 ranks" for p in picks]
        want_backend = ranks[0] if ranks[0] == ranks[1] else f"{ranks[0]} for the prefill, {ranks[1][0]} for"
        assert f"as {want_backend}" in got.stats.backend, (got.stats.backend, picks)
        assert all("no split predicted faster" in got.stats.split for p in picks if p == "one device")
    for b, (w, g) in enumerate(zip(want, got)):
        seq = w.prompt_tokens + w.tokens
        ref = logits_along(one.cfg, one.params, seq)
        mine = logits_along(one.cfg, one.params, seq, strategy if strategy != "auto" else "tp")
        assert relative(mine, ref, f"{strategy} prompt {b}") <= SPLIT_TOL
        if strategy in ("pp", "dp"):
            assert np.array_equal(mine, ref), f"{strategy}: the reference's logits should be bitwise one device's"
            assert g.tokens == w.tokens, f"{strategy} prompt {b}: {g.tokens} against one device's {w.tokens}"
        check_tokens(g.tokens, w.tokens, w.prompt_tokens, ref, f"{strategy} prompt {b}")
        assert g.finish_reason == w.finish_reason == "length"


@pytest.mark.parametrize("strategy", ["tp", "pp", "dp"])
def test_seeded_sampling_matches_one_device(tiny, one, strategy: str) -> None:
    """The same seed gives the same draws split or not: exactly for pp and dp (the same logits), for tp
    wherever nudging the logits by the tolerance does not change the draw."""
    kw = {**SAMPLING, "seed": 11, "max_new_tokens": NEW}
    want = one.generate(PROMPTS, **kw)
    got = split_generator(tiny, strategy).generate(PROMPTS, **kw)
    assert [w.tokens for w in want] != [one.generate(PROMPTS, **{**kw, "seed": 12})[i].tokens for i in range(3)]
    for b, (w, g) in enumerate(zip(want, got)):
        if strategy in ("pp", "dp"):
            assert g.tokens == w.tokens, f"{strategy} prompt {b}: sampled {g.tokens}, one device {w.tokens}"
            continue
        ref = logits_along(one.cfg, one.params, w.prompt_tokens + w.tokens)
        check_tokens(g.tokens, w.tokens, w.prompt_tokens, ref, f"{strategy} sampled prompt {b}", seed=11 + b)


def split_tokens(backend, prompt: list[int], new: int, sampling: dict | None) -> list[int]:
    """A backend's tokens for one prompt, driven as Generator drives it (prefill, first token, generator)."""
    n = len(prompt)
    logits = backend.prefill({"tokens": np.array([prompt]), "positions": np.arange(n)[None], "last": np.array([n - 1])})
    first = first_tokens(logits, [n], sampling)
    backend.setup_generator({"token": first[:, None], "position": np.array([[n]]), "stop": np.array([[n + new - 1]]),
                             **(sampling or {})})  # fmt: skip
    history = backend.advance(new - 1)
    made = history["generated"][0, 0, n : int(history["position"][0, 0]), 0].astype(np.int64).tolist()
    return [*made, int(history["token"][0, 0])]


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_a_vocabulary_cut_lm_head_picks_what_one_device_picks(sampled: bool) -> None:
    """A head wide enough for tp to cut by vocabulary (4096 rows, column-parallel: each logit made
    whole on one rank, then gathered for the split argmax or the draw): the tokens one device's."""
    from megaloop.generation.backends import CpuBackend
    from megaloop.generation.progress import Progress
    from megaloop.generation.split import SplitCpuBackend

    cfg = LlamaConfig(
        hidden=64, heads=4, kv_heads=2, intermediate=128, layers=2, vocab=4096, max_seq=20, dtype="float32"
    )
    params = random_parameters(cfg, seed=5)
    prompt = np.random.default_rng(2).integers(0, cfg.vocab, 6).tolist()
    sampling = {k: np.array([[v]], np.float32 if k != "top_k" else np.int64) for k, v in SAMPLING.items()}
    sampling = {**sampling, "seed": np.array([[11]])} if sampled else None
    kw = {"sampling": sampled, "eos_ids": (), "progress": Progress(False)}
    split = SplitCpuBackend(cfg, params, 1, len(prompt), devices=2, strategy="tp", **kw)
    head = [line for line in split.split.generator.describe().splitlines() if "lm_head.weight: f32" in line]
    assert head and "cut along axis 0" in head[0] and "column-parallel" in head[0], head
    want = split_tokens(CpuBackend(cfg, params, 1, len(prompt), **kw), prompt, 12, sampling)
    got = split_tokens(split, prompt, 12, sampling)
    ref = logits_along(cfg, params, prompt + want)
    check_tokens(
        got, want, prompt, ref, f"vocabulary-cut head, {'sampled' if sampled else 'greedy'}", 11 if sampled else None
    )


def test_transformers_saved_llama_split_matches_transformers(tmp_path) -> None:
    """A tiny Llama that transformers made and saved: the split logits within float32 tolerance of
    transformers', and the greedy tokens of tp2 and auto equal to transformers' generate where its
    logits leave a margin."""
    from tests.hf_models import make_model, torch

    model = make_model("llama", tmp_path)
    prompt = [0, *np.random.default_rng(1).integers(0, 96, 6).tolist()]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
            pad_token_id=0,
        )  # fmt: skip
        want = out[0, len(prompt) :].tolist()
        ref = model(out[:, :-1]).logits[0].double().numpy()
    for strategy in ("tp", "auto"):
        gen = split_generator(tmp_path, strategy)
        got = gen.generate(prompt, max_new_tokens=NEW)
        print(got.stats.split)
        mine = logits_along(gen.cfg, gen.params, prompt + want, "tp")
        assert relative(mine[:-1], ref, f"{strategy} against transformers") <= SPLIT_TOL
        check_tokens(got[0].tokens, want, prompt, ref, f"{strategy} against transformers")


def test_bad_devices_are_named(tiny, one) -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(GenerationError, match=rf"devices must be an int >= 1.*got {bad!r}"):
            split_generator(tiny, "tp", devices=bad)
    with pytest.raises(GenerationError, match=r"devices 4 with strategy 'tp'.* 2 key/value|has 2, so at most 2"):
        split_generator(tiny, "tp", devices=4)
    with pytest.raises(GenerationError, match=r"strategy must be one of .*got 'mp'"):
        split_generator(tiny, "mp")
    dp = split_generator(tiny, "dp")
    with pytest.raises(GenerationError, match=r"devices 2 with strategy 'dp'.*a batch of 1 prompt cannot fill 2"):
        dp.generate(PROMPTS[0], max_new_tokens=2)
    assert len(dp.generate(PROMPTS[:2], max_new_tokens=2)) == 2  # two prompts do


def test_the_command_line_splits_and_says_how(tiny, one, capsys) -> None:
    args = ["generate", "--model", str(tiny), "--prompt", PROMPTS[1], "--max-new-tokens", "8", "--backend", "cpu",
            "--dtype", "float32", "--no-progress"]  # fmt: skip
    assert main(args) == 0
    alone = capsys.readouterr().out
    assert main([*args, "--devices", "2", "--strategy", "pp"]) == 0
    out, err = capsys.readouterr()
    assert out == alone  # pp: the same logits, the same text
    assert "split over 2 devices (pp): prefill pp2 (pipeline over 2: by layers), " in err, err
    pp = r"generator pp2 \(pipeline over 2: by layers\), [\d.]+ us a step predicted against [\d.]+ us on one device"
    assert re.search(pp, err), err
    assert main([*args, "--devices", "4", "--strategy", "tp"]) == 2
    assert "devices 4 with strategy 'tp'" in capsys.readouterr().err
    for bad in ("0", "-2", "two"):
        with pytest.raises(SystemExit):
            main([*args, "--devices", bad])
        assert f"--devices: expected an integer >= 1, got '{bad}'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*args, "--devices", "2", "--strategy", "mp"])
    assert "invalid choice: 'mp'" in capsys.readouterr().err


def test_the_split_plans_run_on_the_plan_interpreter(one) -> None:
    """The ranks' plans (what the loop kernels run), on the N-rank plan interpreter: the generator's
    tokens equal ml.evaluate's of the same rank graphs, bitwise, over a few interleavings."""
    from megaloop.generation.split import Split
    from megaloop.models.llama import build_llama_generator, build_llama_prefill
    from megaloop.plan import make_plan
    from megaloop.reference.interpreter import run_plan

    cfg = dataclasses.replace(one.cfg, max_seq=12)
    split = Split(build_llama_prefill(cfg, 1, 4), build_llama_generator(cfg, 1), one.params, 2, "tp")
    start = {"token": np.array([[5]]), "position": np.array([[4]]), "stop": np.array([[11]])}
    state = split.generator_state({}, start)
    g = split.generator
    want = ml.evaluate(g.graphs, [{}] * 2, split.params[1], state, iterations=4)
    plan = make_plan(g.graphs, processors=2)
    for seed in range(3):
        got = run_plan(plan, None, split.params[1], state, iterations=4, seed=seed)
        for name in ("token", "position", "generated"):
            a, b = split.history([r.state for r in got])[name], split.history([r.state for r in want])[name]
            assert np.array_equal(a, b), f"interleaving {seed}: {name} differs from ml.evaluate's"


@pytest.mark.gpu
@pytest.mark.skipif(not gpus()[0], reason="no GPU: " + gpus()[1])
@pytest.mark.parametrize("strategy", ["tp", "pp", "dp", "auto"])
def test_two_ranks_on_one_gpu_match_one_device(tiny, one, strategy: str) -> None:
    """devices=2 with one GPU: two loop kernels of half its SMs each (the runtime's ranks sharing a
    GPU, tests/test_gpu_shared.py), the tokens those of one device on the GPU (and the CPU
    reference) where the logits leave a margin. auto keeps the tiny model's graphs on one device
    (one loop kernel of every SM)."""
    kw = {"dtype": "float32", "eos_token_ids": (), "progress": False}
    alone = ml.Generator(tiny, backend="gpu", **kw).generate(PROMPTS, max_new_tokens=NEW)
    got = ml.Generator(tiny, backend="gpu", devices=2, strategy=strategy, **kw).generate(PROMPTS, max_new_tokens=NEW)
    print(got.stats.summary(), got.stats.split, sep="\n")
    assert ("1 loop kernel" if strategy == "auto" else "2 loop kernels") in got.stats.backend
    for b, (a, g) in enumerate(zip(alone, got)):
        ref = logits_along(one.cfg, one.params, a.prompt_tokens + a.tokens)
        check_tokens(g.tokens, a.tokens, a.prompt_tokens, ref, f"{strategy} on one GPU, prompt {b}")


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    """One fake GPU (tests/fake_driver.py: the runtime's host code runs, the kernels compute nothing),
    the kernels generated but not compiled (NVRTC's part is other tests')."""
    from megaloop.runtime import group, loop, resident
    from tests.fake_driver import FakeDriver, install

    image = b"\x7fELF not compiled"
    monkeypatch.setattr(group, "compile_many", lambda sources, arch, **kw: [image] * len(sources))
    monkeypatch.setattr(loop, "compile_and_load", lambda source, arch, load: (image, load(image)))
    monkeypatch.setenv("MEGALOOP_CACHE", str(tmp_path))
    monkeypatch.setattr(resident, "_entries", {})
    monkeypatch.setattr(resident, "_deferred", [])
    yield install(monkeypatch, FakeDriver(gpus=1))
    resident.stop_everything()


def test_the_gpu_backend_hands_each_rank_its_pieces(one, fake_gpu) -> None:
    """The GPU path's host side on a fake driver: two ranks on the one GPU, 66 SMs each, every rank's
    parameters and start state in its arena, and the history put back together from both ranks (the
    fake computes nothing, so it reads back what was handed in)."""
    from megaloop.generation.progress import Progress
    from megaloop.generation.split import SplitGpuBackend

    cfg, params = dataclasses.replace(one.cfg, max_seq=16), one.params
    backend = SplitGpuBackend(
        cfg, params, 2, 4, sampling=False, eos_ids=(), progress=Progress(False), plan_cache=False, devices=2,
        strategy="tp",
    )  # fmt: skip
    assert backend.devices == [[0, 0], [0, 0]] and all(p.processors == 66 for p in backend.plans)
    assert "2 loop kernels on 1 GPU (Fake H200, 2 ranks a GPU of 66 SMs each)" == backend.description
    try:
        backend.setup_prefill()
        feeds = {
            "tokens": np.ones((2, 4), np.int64),
            "positions": np.tile(np.arange(4), (2, 1)),
            "last": np.array([3, 1]),
        }
        assert backend.prefill(feeds).shape == (2, 1, cfg.vocab)
        start = {"token": np.array([[7], [9]]), "position": np.array([[4], [2]]), "stop": np.array([[9], [7]])}
        backend.setup_generator(start)
        assert [k.device for k in backend.group.kernels] == [0, 0] and len(fake_gpu.kernels) == 4
        whole = sum(v.nbytes for v in one.params.values())
        for k, mine in zip(backend.group.kernels, backend.split.params[1]):
            assert sum(v.nbytes for v in mine.values()) < whole  # tp: the rank holds pieces
            for name, value in mine.items():
                got = k._read(k.rp.tensor_of[k.rp.graph.parameters[name]])
                assert np.array_equal(got, value), f"rank {k.rank}: parameter {name} is not its piece"
        history = backend.advance(2)
        assert np.array_equal(history["token"], start["token"]) and np.array_equal(
            history["position"], start["position"]
        )
    finally:
        backend.close()
    assert backend.group is None and all(k.left.is_set() for k in fake_gpu.kernels)


def test_the_gpu_backend_runs_a_graph_auto_keeps_whole_as_one_kernel(one, fake_gpu) -> None:
    """auto keeps the tiny model's graphs on one device: one loop kernel of every SM a graph, the
    whole parameters, the history read back from it (the fake computes nothing)."""
    from megaloop.generation.progress import Progress
    from megaloop.generation.split import SplitGpuBackend

    cfg = dataclasses.replace(one.cfg, max_seq=16)
    backend = SplitGpuBackend(
        cfg, one.params, 1, 4, sampling=False, eos_ids=(), progress=Progress(False), plan_cache=False, devices=2,
        strategy="auto",
    )  # fmt: skip
    assert backend.split.ranks == (1, 1), backend.split.summary()
    assert backend.devices == [[0], [0]] and all(p.processors == 132 for p in backend.plans)
    assert backend.description == "1 loop kernel on 1 GPU (Fake H200)"
    try:
        backend.setup_prefill()
        feeds = {"tokens": np.ones((1, 4), np.int64), "positions": np.arange(4)[None], "last": np.array([3])}
        assert backend.prefill(feeds).shape == (1, 1, cfg.vocab)
        start = {"token": np.array([[7]]), "position": np.array([[4]]), "stop": np.array([[9]])}
        backend.setup_generator(start)
        assert len(backend.group.kernels) == 1
        assert set(backend.split.params[1][0]) == set(one.params)
        history = backend.advance(2)
        assert np.array_equal(history["token"], start["token"])
    finally:
        backend.close()

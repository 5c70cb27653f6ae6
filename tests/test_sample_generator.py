"""build_llama_generator with sampling and stop conditions, on the CPU reference and the plan
interpreter: the self-feeding loop draws the tokens that ml.sample gives step by step on the
reference's logits (same seeds, same tokens), finished sequences (an end-of-sequence token, a stop
position, the end of the cache) stay frozen while the others go on, and the interface's states."""

from __future__ import annotations

import numpy as np
import pytest

import megaloop as ml
from megaloop.codegen import emit
from megaloop.errors import GraphBuildError
from megaloop.frontend.tiling import Box
from megaloop.models import LlamaConfig, build_llama, build_llama_generator, random_parameters
from megaloop.plan import make_plan
from megaloop.reference.interpreter import run_plan
from tests.test_rope_kv_codegen import Arena, contiguous, needs_cxx, run_on_cpu

CFG = LlamaConfig(hidden=64, heads=4, kv_heads=2, intermediate=96, layers=2, max_seq=16, vocab=50)
BATCH, PROMPT = 3, 5
SAMPLING = {  # per sequence: one greedy, one plain temperature, one with top-k and top-p
    "temperature": np.array([[0.0], [1.3], [0.8]], np.float32),
    "top_k": np.array([[0], [0], [7]], np.int64),
    "top_p": np.array([[1.0], [1.0], [0.9]], np.float32),
    "seed": np.array([[11], [22], [-33]], np.int64),
}


def prefill() -> tuple[dict, dict, np.ndarray]:
    """(parameters, the caches after a prompt of PROMPT tokens, its last logits)."""
    params = random_parameters(CFG, seed=8)
    rng = np.random.default_rng(8)
    prompt = rng.integers(0, CFG.vocab, (BATCH, PROMPT))
    feeds = {"tokens": prompt, "positions": np.tile(np.arange(PROMPT), (BATCH, 1))}
    pre = ml.evaluate(build_llama(CFG, BATCH, PROMPT), feeds, params)
    return params, pre.state, pre.outputs["logits"][:, -1:]


def sample_step(logits: np.ndarray, position: np.ndarray) -> np.ndarray:
    """ml.sample on logits [BATCH, 1, vocab] with the sequences' parameters, offset = position."""
    g = ml.Graph("one-draw")
    x = g.input("logits", logits.shape, "bfloat16")
    ins = {k: g.input(k, v.shape, v.dtype.name) for k, v in SAMPLING.items()}
    pos = g.input("position", (BATCH, 1), "int64")
    g.output("token", ml.sample(x, ins["seed"], pos, ins["temperature"], ins["top_k"], ins["top_p"]))
    return ml.evaluate(g, {"logits": logits, "position": position, **SAMPLING}).outputs["token"]


def host_steps(params: dict, state: dict, first: np.ndarray, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """Host-driven decoding: one decode step per token, ml.sample on its logits. (tokens fed, last token)."""
    decode, token, fed = build_llama(CFG, BATCH, 1), first, []
    for i in range(steps):
        fed.append(token[:, 0])
        position = np.full((BATCH, 1), PROMPT + i)
        out = ml.evaluate(decode, {"tokens": token, "positions": position}, params, state)
        state, token = out.state, sample_step(out.outputs["logits"], position)
    return np.stack(fed, 1), token


def test_sampling_generator_draws_what_ml_sample_draws_step_by_step() -> None:
    params, state, last = prefill()
    first = sample_step(last, np.full((BATCH, 1), PROMPT - 1))  # the prompt's last position as the offset
    want, last_token = host_steps(params, state, first, 6)
    gen = build_llama_generator(CFG, BATCH, sampling=True, argmax_splits=3)
    start = {**state, **SAMPLING, "token": first, "position": np.full((BATCH, 1), PROMPT)}
    ref = ml.evaluate(gen, {}, params, start, iterations=6)
    got = ref.state["generated"][:, 0, PROMPT : PROMPT + 6, 0].astype(np.int64)
    assert np.array_equal(got, want), f"generator {got.tolist()} vs ml.sample step by step {want.tolist()}"
    assert np.array_equal(ref.state["token"], last_token) and (ref.state["position"] == PROMPT + 6).all()
    # the greedy sequence is the argmax's; the others really sample (not all argmax)
    assert len({tuple(r) for r in want}) == BATCH
    planned = run_plan(make_plan(gen, processors=5), {}, params, start, iterations=6, seed=4)
    assert planned.state["generated"].tobytes() == ref.state["generated"].tobytes()
    assert np.array_equal(planned.state["token"], ref.state["token"])
    # another seed for the sampled sequences gives other tokens
    other = ml.evaluate(gen, {}, params, {**start, "seed": SAMPLING["seed"] + 1}, iterations=6)
    assert np.array_equal(other.state["generated"][0], ref.state["generated"][0])  # greedy: unchanged
    assert not np.array_equal(other.state["generated"][1:], ref.state["generated"][1:])


@pytest.mark.parametrize("sampling", [False, True])
def test_finished_sequences_stay_frozen_while_the_others_go_on(sampling: bool) -> None:
    """Sequence 0 produces an end-of-sequence token after two steps, sequence 1 has a stop position
    three tokens on, sequence 2 runs to the end of the cache (max_seq) and past it without an error."""
    params, state, last = prefill()
    first = last.astype(np.float32).argmax(-1)
    start = {**state, "token": first, "position": np.full((BATCH, 1), PROMPT)}
    if sampling:
        start.update(SAMPLING)
    free = build_llama_generator(CFG, BATCH, sampling=sampling)
    run = ml.evaluate(free, {}, params, start, iterations=CFG.max_seq - PROMPT)
    free_tokens = run.state["generated"][:, 0, :, 0].astype(np.int64)
    eos = int(free_tokens[0, PROMPT + 2])  # what sequence 0 feeds at its third step
    assert eos not in free_tokens[0, PROMPT : PROMPT + 2]
    gen = build_llama_generator(CFG, BATCH, sampling=sampling, eos_ids=(eos, 49))
    sentinel = np.full((BATCH, 1, CFG.max_seq, 1), -7.0, np.float32)
    stop = np.array([[CFG.max_seq], [PROMPT + 3], [CFG.max_seq]])
    begin = {**start, "generated": sentinel, "stop": stop}
    steps = CFG.max_seq - PROMPT + 4  # past the cache's end
    for result in (
        ml.evaluate(gen, {}, params, begin, iterations=steps),
        run_plan(make_plan(gen, processors=6), {}, params, begin, iterations=steps, seed=1),
    ):
        got, position = result.state["generated"][:, 0, :, 0], result.state["position"][:, 0]
        ends = [PROMPT + 2, PROMPT + 3, CFG.max_seq]
        if 49 in free_tokens[2, PROMPT:] or 49 in free_tokens[1, PROMPT : PROMPT + 3]:
            pytest.skip("the other end-of-sequence id came up")
        assert list(position) == ends
        for b, end in enumerate(ends):
            assert np.array_equal(got[b, PROMPT:end], free_tokens[b, PROMPT:end]), b  # as if never stopped
            assert (got[b, end:] == -7.0).all() and (got[b, :PROMPT] == -7.0).all(), b  # nothing else written
        assert result.state["token"][0, 0] == eos  # the end-of-sequence token stays, unwritten
        assert result.state["token"][1, 0] == free_tokens[1, PROMPT + 3]  # the token at the stop position
        # a finished sequence's state no longer changes: one more iteration leaves it as it is
    again = ml.evaluate(gen, {}, params, result.state, iterations=1)
    for name in ("token", "position", "generated"):
        assert np.array_equal(again.state[name], result.state[name]), name


def test_the_interface_states() -> None:
    gen = build_llama_generator(CFG, 2, sampling=True, eos_ids=[3])
    want = {
        "token": ("int64", (2, 1)),
        "position": ("int64", (2, 1)),
        "generated": ("float32", (2, 1, CFG.max_seq, 1)),
        "stop": ("int64", (2, 1)),
        "temperature": ("float32", (2, 1)),
        "top_k": ("int64", (2, 1)),
        "top_p": ("float32", (2, 1)),
        "seed": ("int64", (2, 1)),
    }
    for name, (dtype, shape) in want.items():
        t = gen.states[name]
        assert (t.dtype.name, t.shape) == (dtype, shape), name
    init = {n: gen.states[n].node.attrs.get("init") for n in ("stop", "temperature", "top_p", "seed")}
    assert (init["stop"] == CFG.max_seq).all() and (init["temperature"] == 1).all() and (init["top_p"] == 1).all()
    assert init["seed"].ravel().tolist() == [0, 1]  # rows draw apart until the host sets their seeds
    greedy = build_llama_generator(CFG, 2)
    assert "stop" in greedy.states and "seed" not in greedy.states
    assert not any(n.op.name == "sample" for n in greedy.nodes)
    with pytest.raises(GraphBuildError, match=r"eos_ids must be token ids in \[0, 50\)"):
        build_llama_generator(CFG, 2, eos_ids=[50])


@needs_cxx
@pytest.mark.parametrize("misalign", [0, 4])  # the batched path, and the per-element loop
def test_generated_history_update_skips_negative_positions(misalign: int, tmp_path) -> None:
    """kv_cache_update(..., ignore_negative=True)'s generated tile on the CPU (g++, tests/
    test_rope_kv_codegen.py's shim): rows at -1 write nothing, the others land; a position past the
    cache is still reported."""
    cache, new, pos = (
        contiguous("float32", (3, 1, 16, 4)),
        contiguous("float32", (3, 1, 1, 4)),
        contiguous("int64", (3, 1)),
    )
    body = emit.kv_update("kv_cache_update", {"ignore_negative": True}, cache, new, pos, cache)
    boxes = [Box((b, 0, 0, 0), (b + 1, 1, 16, 4)) for b in range(3)]
    for pv, error in ((np.array([[5], [-1], [15]]), 0), (np.array([[-1], [16], [2]]), 2)):
        arena = Arena([cache, new, pos, cache], misalign, alias={3: 0})
        arena.write(0, np.full(cache.shape, -7.0, np.float32))
        arena.write(1, np.arange(12, dtype=np.float32).reshape(new.shape))
        arena.write(2, pv)
        before = arena.bytes.copy()
        info = run_on_cpu(body, tmp_path, arena.bytes, arena.offsets, boxes)
        assert info[0] == error
        got = arena.read(3)
        want = np.full(cache.shape, -7.0, np.float32)
        for b, p in enumerate(pv[:, 0]):
            if 0 <= p < 16:
                want[b, 0, p] = np.arange(12, dtype=np.float32).reshape(new.shape)[b, 0, 0]
        assert np.array_equal(got, want), (pv.tolist(), got[:, 0, :, 0])
        expected = before.copy()
        arena.write(3, got, expected)
        assert np.array_equal(arena.bytes, expected), "a write outside the cache's elements"


def test_stopping_costs_the_greedy_generator_six_small_tasks_and_no_copy() -> None:
    """sampling=False without eos ids: the stop state adds less, minimum and four wheres (one a [batch, 1]
    tile after the argmax, on the path to the next step) and no plan-made copy on the token's way."""
    from collections import Counter

    gen = build_llama_generator(CFG, 2, argmax_splits=3)
    counts = Counter(n.op.name for n in gen.nodes)
    assert (counts["less"], counts["minimum"], counts["where"]) == (1, 1, 4)
    assert "sample" not in counts and "sample_combine" not in counts
    plan = make_plan(gen, processors=8)
    assert [op.name for op in plan.ranks[0].ops if op.op == "copy"] == ["assign:position"]  # as before the stop
    token = gen.state_updates["token"]
    assert token.node.op.name == "where" and token.node.inputs[1].node.op.name == "argmax_combine"


PENALTIES = {  # per sequence: greedy with a repetition penalty, sampled with all three, min-p with repetition
    "repetition_penalty": np.array([[1.3], [1.1], [2.0]], np.float32),
    "presence_penalty": np.array([[0.0], [0.6], [0.0]], np.float32),
    "frequency_penalty": np.array([[0.0], [0.4], [0.0]], np.float32),
    "min_p": np.array([[0.0], [0.0], [0.05]], np.float32),
}


def test_penalties_and_logprobs_in_the_loop_are_the_host_steps() -> None:
    """The generator with penalties and top-3 log-probabilities against host-driven steps: each step's
    logits penalised by the definition with the counts of the tokens generated so far and the prompt's
    tokens, then ml.sample's draw (min-p included); the recorded log-probabilities are torch's
    log_softmax of the step's logits (the chosen token's and the top 3, in order) within float32
    rounding; the counts are the generated tokens'; the plan interpreter gives the same bits."""
    import torch

    from megaloop.frontend.ops.sample import sample_tokens
    from megaloop.frontend.ops.sample_penalty import penalized
    from megaloop.models.decoding import Decoding

    params, state, _ = prefill()
    rng = np.random.default_rng(8)
    prompt = rng.integers(0, CFG.vocab, (BATCH, PROMPT))  # prefill()'s prompt
    mask = np.zeros((BATCH, 1, CFG.vocab), bool)
    np.put_along_axis(mask[:, 0], prompt, True, axis=1)
    settings = {**SAMPLING, **PENALTIES}
    row = lambda name, b: settings[name][b, 0]
    first = np.array([[int(prompt[b, -1])] for b in range(BATCH)])  # a token of the prompt, to be penalised
    steps = 6
    decode, token, fed, counts, recorded = build_llama(CFG, BATCH, 1), first, [], np.zeros((BATCH, CFG.vocab)), []
    for i in range(steps):
        fed.append(token[:, 0])
        counts[np.arange(BATCH), token[:, 0]] += 1
        position = np.full((BATCH, 1), PROMPT + i)
        out = ml.evaluate(decode, {"tokens": token, "positions": position}, params, state)
        state, logits = out.state, out.outputs["logits"][:, 0].astype(np.float32)
        scores = np.stack([
            penalized(logits[b], counts[b], mask[b, 0], *(row(n, b) for n in ("repetition_penalty", "presence_penalty",
                      "frequency_penalty"))) for b in range(BATCH)
        ])  # fmt: skip
        token = np.array([
            [int(sample_tokens(scores[b], row("seed", b), PROMPT + i, row("temperature", b), row("top_k", b),
                               row("top_p", b), row("min_p", b)))] for b in range(BATCH)
        ])  # fmt: skip
        recorded.append((torch.log_softmax(torch.as_tensor(logits), -1).numpy(), token[:, 0]))
    gen = build_llama_generator(CFG, BATCH, sampling=True, argmax_splits=3, decoding=Decoding(True, 3))
    start = {**prefill()[1], **settings, "prompt_tokens": mask, "token": first, "position": np.full((BATCH, 1), PROMPT)}
    ref = ml.evaluate(gen, {}, params, start, iterations=steps)
    got = ref.state["generated"][:, 0, PROMPT : PROMPT + steps, 0].astype(np.int64)
    assert np.array_equal(got, np.stack(fed, 1)), (got.tolist(), np.stack(fed, 1).tolist())
    assert np.array_equal(ref.state["token"], token)
    assert np.array_equal(ref.state["token_counts"][:, 0], counts)
    assert any(len(set(f)) < len(f) or f[0] in p for f, p in zip(np.stack(fed, 1).tolist(), prompt.tolist()))
    history = ref.state["logprobs"][:, 0, PROMPT : PROMPT + steps]
    worst = 0.0
    for i, (lp, chosen) in enumerate(recorded):
        for b in range(BATCH):
            entry = history[b, i]
            top = np.argsort(-lp[b], kind="stable")[:3]
            assert entry[1::2].astype(np.int64).tolist() == top.tolist(), (i, b, entry, top)
            want = np.array([lp[b, chosen[b]], *lp[b, top]])
            worst = max(worst, float(np.abs(entry[[0, 2, 4, 6]] - want).max()))
    assert worst <= 4e-6, f"logprobs {worst:.2e} from torch's log_softmax"
    planned = run_plan(make_plan(gen, processors=5), {}, params, start, iterations=steps, seed=2)
    for name in ("generated", "token", "token_counts", "logprobs"):
        assert planned.state[name].tobytes() == ref.state[name].tobytes(), name
    plain = ml.evaluate(build_llama_generator(CFG, BATCH, sampling=True, argmax_splits=3), {}, params,
                        {k: v for k, v in start.items() if k in SAMPLING or k in state or k in ("token", "position")},
                        iterations=steps)  # fmt: skip
    assert not np.array_equal(plain.state["generated"], ref.state["generated"]), "the penalties changed nothing"

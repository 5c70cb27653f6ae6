"""megaloop.Engine on the CPU (docs/serving.md): 8 requests of mixed prompt lengths arriving at
different steps, each completion equal to the same prompt generated alone with megaloop's Generator
(greedy and sampled, token for token and text for text); the page pool's rules checked after every run
and every page back at the end; stops (end-of-sequence ids, stop strings, stop tokens), cancellation,
the queue's limit, refused requests, async streaming; the step graph planned (and verified) and run by
the plan interpreter bit for bit; a slot's logits bit for bit whatever the other slots do; the CPU's
fast step against the reference's."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

import megaloop as ml
from megaloop.errors import GraphBuildError
from megaloop.models import LlamaConfig
from megaloop.models.tiny import make_tiny_checkpoint
from megaloop.plan import make_plan
from megaloop.plan.cache import make_programs
from megaloop.reference.interpreter import run_plan
from megaloop.serving.backends import CpuStep, ReferenceStep, initial_state
from megaloop.serving.engine import Engine
from megaloop.serving.pages import PagePool
from megaloop.serving.requests import QueueFull, RequestError
from megaloop.serving.step import StepShape, build_serving_programs, build_serving_step

TEXT = (
    "A loop kernel is one program that stays on the GPU and runs every operator of a model. Each processor "
    "walks its own list of tasks and waits on counters instead of barriers. The host rings a doorbell, the "
    "kernel runs an iteration, and the doorbell rings again."
)
LENGTHS = [1, 2, 5, 9, 16, 23, 37, 50]  # prompt tokens: below, at and above the chunk, several chunks
MAX_TOKENS = [10, 14, 6, 12, 9, 16, 8, 11]
ARRIVALS = [0, 0, 0, 2, 5, 9, 14, 20]  # the engine's step at which each request is submitted


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def gen(tiny):
    return ml.Generator(tiny, backend="cpu", max_seq=128)


@pytest.fixture(scope="module")
def gen32(tiny):
    """float32: sampled draws compared with the Generator's (bfloat16 products of one row and of many
    round apart now and then, and a draw near a boundary follows: docs/serving.md)."""
    return ml.Generator(tiny, backend="cpu", max_seq=128, dtype="float32")


def prompts(gen: ml.Generator) -> list[list[int]]:
    ids = gen.tokenizer.encode(TEXT)
    assert len(ids) >= max(LENGTHS)
    return [ids[len(ids) - n :] for n in LENGTHS]


def engine(gen: ml.Generator, **kw) -> Engine:
    options = {"max_slots": 6, "chunk": 8, "page_size": 8, "check_pages": True, **kw}
    return Engine(gen, **options)


def arrive(e: Engine, items: list[tuple[object, dict]], arrivals: list[int]) -> list:
    """Submit each (prompt, settings) once the engine has run ``arrivals[i]`` steps."""
    requests = []
    for (prompt, settings), step in zip(items, arrivals):
        deadline = time.monotonic() + 60
        while e.steps < step and time.monotonic() < deadline:
            time.sleep(0.001)
        requests.append(e.submit(prompt, **settings))
    return requests


def close_and_check(e: Engine) -> None:
    e.close()
    assert e.slots.pages.all_free(), "every page back in the pool"
    assert not e.slots.live


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_greedy_completions_equal_each_prompt_alone(tiny, dtype: str) -> None:
    gen = ml.Generator(tiny, backend="cpu", max_seq=128, dtype=dtype)
    e = engine(gen)
    ps = prompts(gen)
    requests = arrive(e, [(p, {"max_tokens": n}) for p, n in zip(ps, MAX_TOKENS)], ARRIVALS)
    results = [r.result(120) for r in requests]
    assert e.steps > ARRIVALS[-1]
    assert e.runs["mixed"] and any(e.runs[f"decode_{r}"] for r in (1, 2, 4)), f"runs switched programs: {e.runs}"
    close_and_check(e)
    for i, (p, n, got) in enumerate(zip(ps, MAX_TOKENS, results)):
        alone = gen.generate(p, max_new_tokens=n)[0]
        assert got.tokens == alone.tokens, f"request {i} ({len(p)} prompt tokens): {got.tokens} != {alone.tokens}"
        assert (got.text, got.finish_reason, got.prompt_tokens) == (alone.text, alone.finish_reason, p)


def test_sampled_completions_equal_each_prompt_alone_with_its_seed(gen32) -> None:
    gen = gen32
    e = engine(gen, max_slots=4)  # (fewer slots than requests: some wait in the queue)
    settings = [{"max_tokens": n, "temperature": 0.9, "top_k": [0, 40][i % 2], "top_p": [1.0, 0.9][i % 3 > 0],
                 "min_p": [0.0, 0.05][i % 4 == 1], "seed": 1000 + 7 * i} for i, n in enumerate(MAX_TOKENS)]  # fmt: skip
    ps = prompts(gen)
    requests = arrive(e, list(zip(ps, settings)), ARRIVALS)
    results = [r.result(120) for r in requests]
    close_and_check(e)
    for i, (p, s, got) in enumerate(zip(ps, settings, results)):
        alone = gen.generate(p, max_new_tokens=s["max_tokens"], temperature=s["temperature"], top_k=s["top_k"],
                             top_p=s["top_p"], min_p=s["min_p"], seed=s["seed"])[0]  # fmt: skip
        assert got.tokens == alone.tokens, f"request {i} {s}: {got.tokens} != {alone.tokens}"
    # the same seeds again: the same tokens; other seeds: other tokens
    e = engine(gen)
    again = [e.submit(p, **s) for p, s in zip(ps[:3], settings[:3])]
    other = e.submit(ps[0], **{**settings[0], "seed": 5})
    assert [r.result(60).tokens for r in again] == [r.tokens for r in results[:3]]
    assert other.result(60).tokens != results[0].tokens
    close_and_check(e)


def test_stops_end_of_sequence_stop_strings_stop_tokens(tiny, gen) -> None:
    ps = prompts(gen)
    alone = gen.generate(ps[4], max_new_tokens=16)[0]
    eos = alone.tokens[5]
    first = alone.tokens.index(eos)
    with_eos = ml.Generator(tiny, backend="cpu", max_seq=128, eos_token_ids=[eos])
    e = engine(with_eos)
    got = e.submit(ps[4], max_tokens=16).result(60)
    want = with_eos.generate(ps[4], max_new_tokens=16)[0]
    assert got.tokens == want.tokens == alone.tokens[:first] and got.finish_reason == want.finish_reason == "stop"
    assert got.stop == want.stop == eos
    close_and_check(e)

    e = engine(gen)
    text = alone.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    r = e.submit(ps[4], max_tokens=16, stop=["never there", stop])
    deltas = list(r)
    got = r.result()
    assert got.text == text[: text.index(stop)] == "".join(d.text for d in deltas)
    assert got.finish_reason == "stop" and got.stop == stop and got.tokens == alone.tokens[: len(got.tokens)]
    assert gen.tokenizer.decode(got.tokens).startswith(got.text)
    r = e.submit(ps[4], max_tokens=16, stop_token_ids=[alone.tokens[3]])
    got = r.result(60)
    assert got.tokens == alone.tokens[: alone.tokens.index(alone.tokens[3])] and got.finish_reason == "stop"
    close_and_check(e)


def test_cancelling_frees_the_slot_and_leaves_the_others_alone(gen) -> None:
    e = engine(gen, max_slots=2)
    ps = prompts(gen)
    long_one = e.submit(ps[3], max_tokens=60)
    others = [e.submit(p, max_tokens=8) for p in ps[:3]]
    seen = []
    for delta in long_one:
        seen += delta.tokens
        if len(seen) >= 3:
            long_one.cancel()
    assert long_one.result().finish_reason == "cancelled" and 3 <= len(long_one.result().tokens) < 60
    queued = e.submit(ps[5], max_tokens=4)
    queued.cancel()  # (cancelled before or after it got a slot: either way it ends at once)
    assert queued.result(60).finish_reason in ("cancelled", "length")
    for p, r in zip(ps, others):
        assert r.result(60).tokens == gen.generate(p, max_new_tokens=8)[0].tokens
    close_and_check(e)


def test_the_queue_has_a_limit_and_bad_requests_name_their_field(gen) -> None:
    e = engine(gen, max_slots=1, max_queue=2)
    ps = prompts(gen)
    with pytest.raises(QueueFull, match=r"requests wait for a slot already \(max_queue 2\)"):
        for _ in range(4):
            e.submit(ps[7], max_tokens=30)
    for field, prompt, settings, words in [
        ("prompt", [1] * 130, {"max_tokens": 1}, "a prompt of 130 tokens and max_tokens 1 need 131 positions"),
        ("max_tokens", ps[0], {"max_tokens": 128}, "a slot holds 128 .max_seq."),
        ("max_tokens", ps[0], {"max_tokens": 0}, "max_tokens must be an int >= 1"),
        ("temperature", ps[0], {"temperature": -1.0}, "temperature must be a finite number >= 0"),
        ("top_p", ps[0], {"top_p": 0}, r"top_p must be a number in \(0, 1\]"),
        ("stop", ps[0], {"stop": [""]}, "stop must be a non-empty string"),
        ("prompt", [], {}, "the prompt is empty"),
        ("prompt", [10**6], {}, "outside the vocabulary"),
        ("min_p", ps[0], {"min_p": 1.5}, r"min_p must be a number in \[0, 1\]"),
        ("frequency_penalty", ps[0], {"frequency_penalty": 1.0}, "unknown settings"),
    ]:
        with pytest.raises(RequestError, match=words) as caught:
            e.submit(prompt, **settings)
        assert caught.value.field == field, (field, str(caught.value))
    close_and_check(e)
    with pytest.raises(ml.errors.MegaloopError, match="the engine is stopping"):
        e.submit(ps[0])


def test_async_streaming(gen32) -> None:
    gen = gen32
    ps = prompts(gen)
    e = engine(gen)

    async def consume(i: int) -> tuple[list[int], str, str]:
        r = e.submit(ps[i], max_tokens=MAX_TOKENS[i], temperature=0.7, seed=i)
        tokens, text = [], ""
        async for delta in r:
            tokens += delta.tokens
            text += delta.text
        return tokens, text, r.result().text

    async def run_all():
        return await asyncio.gather(*(consume(i) for i in range(5)))

    for i, (tokens, text, final) in enumerate(asyncio.run(run_all())):
        want = gen.generate(ps[i], max_new_tokens=MAX_TOKENS[i], temperature=0.7, seed=i)[0]
        assert tokens == want.tokens and text == final == want.text

    async def leave_early():
        r = e.submit(ps[2], max_tokens=40)
        async for _ in r:
            break  # the consumer leaves: the request is cancelled
        return r

    r = asyncio.run(leave_early())
    assert r.result(60).finish_reason == "cancelled"
    close_and_check(e)


def slot_states(shape: StepShape, graph: ml.Graph, requests: dict[int, tuple[list[int], int]]) -> dict:
    """The step's states with ``requests`` (slot -> (prompt, max_tokens)) admitted and paged."""
    st = initial_state(graph)
    pool = PagePool(shape.pages, shape.page_size, shape.slots, shape.pages_per_slot)
    for s, (prompt, n) in requests.items():
        st["sequence"][s, : len(prompt)] = prompt
        st["length"][s], st["limit"][s], st["temperature"][s] = len(prompt), len(prompt) + n, 0.0
        assert pool.reserve(s, len(prompt) + n) and pool.grow(s, len(prompt) + n)
    st["page_table"] = pool.table.copy()
    return st


def test_step_plan_is_verified_and_the_interpreter_gives_its_bits(gen) -> None:
    shape = StepShape(slots=3, chunk=4, page_size=4, pages=40, max_seq=48)
    g = build_serving_step(gen.cfg, shape, gen.eos_token_ids)
    ps = prompts(gen)
    st = slot_states(shape, g, {0: (ps[4], 5), 2: (ps[0], 6)})
    st["temperature"][2] = 0.8
    plan = make_plan(g, processors=12, arch="sm_90")  # make_plan verifies the plan it makes
    want = ml.evaluate(g, {}, gen.params, st, iterations=3)
    for seed in range(2):
        got = run_plan(plan, {}, gen.params, st, iterations=3, seed=seed)
        for name, value in want.state.items():
            assert np.array_equal(got.state[name].view(np.uint8), value.view(np.uint8)), f"state {name}, order {seed}"


def test_the_programs_plan_runs_a_switching_sequence_as_the_graphs_do(gen) -> None:
    """The engine's programs planned together (verified: each program and their one arena); the plan
    interpreter runs a sequence of runs that switches programs mid-sequence (prefill in the mixed
    step, then decode-only steps of 3 and 1 rows, the latter leaving a slot to wait) and gives the
    states ml.evaluate gives the same graphs in the same sequence, bit for bit."""
    shape = StepShape(slots=3, chunk=4, page_size=4, pages=40, max_seq=48)
    programs = build_serving_programs(gen.cfg, shape, gen.eos_token_ids, (1, 3))
    plan = make_programs(programs, processors=12, arch="sm_90")
    ps = prompts(gen)
    want = got = slot_states(shape, programs["mixed"], {0: (ps[2], 6), 2: (ps[0], 6)})
    want["temperature"][2] = 0.8
    for step, (name, n) in enumerate([("mixed", 2), ("decode_3", 2), ("decode_1", 1), ("mixed", 1), ("decode_3", 1)]):
        want = ml.evaluate(programs[name], {}, gen.params, want, iterations=n).state
        got = run_plan(plan, {}, gen.params, got, iterations=n, seed=step, program=name).state
        for key, value in want.items():
            assert np.array_equal(got[key].view(np.uint8), value.view(np.uint8)), f"run {step} ({name}): state {key}"
    # 6 tokens each; slot 2 (a 1-token prompt) waited in decode_1's run: one token fewer than it could
    assert want["length"].ravel().tolist() == [len(ps[2]) + 6, 0, 1 + 6], want["length"]


def test_a_decode_step_gives_the_mixed_steps_tokens(gen32) -> None:
    """After prefill, the decode-only steps (4 rows, and 2 rows for two slots) and the mixed step make
    the same tokens and lengths step by step (their logits within float32 products' last bits)."""
    shape = StepShape(slots=4, chunk=4, page_size=4, pages=64, max_seq=64)
    programs = build_serving_programs(gen32.cfg, shape, (), (2, 4), logits=True)
    ps = prompts(gen32)
    st = slot_states(shape, programs["mixed"], {1: (ps[3], 8), 3: (ps[1], 8)})
    st = ml.evaluate(programs["mixed"], {}, gen32.params, st, iterations=3).state
    assert ((st["length"] - st["cursor"])[[1, 3]] == 1).all(), "prefilled"
    states = {name: st for name in programs}
    for step in range(4):
        out = {name: ml.evaluate(g, {}, gen32.params, states[name]) for name, g in programs.items()}
        for name, o in out.items():
            states[name] = o.state
            for key in ("length", "cursor", "sequence"):
                assert np.array_equal(o.state[key], out["mixed"].state[key]), f"step {step}: {name}'s {key}"
            worst = float(np.max(np.abs(o.outputs["logits"][[1, 3]] - out["mixed"].outputs["logits"][[1, 3]])))
            assert worst <= 1e-4, f"step {step}: {name}'s logits differ by {worst}"


def test_a_slots_logits_are_the_same_bits_whatever_the_other_slots_do(gen) -> None:
    shape = StepShape(slots=4, chunk=4, page_size=4, pages=64, max_seq=64)
    g = build_serving_step(gen.cfg, shape, (), logits=True)
    ps = prompts(gen)
    mine = (ps[3], 6)

    def logits_made(requests: dict, slot: int) -> list[np.ndarray]:
        st, made = slot_states(shape, g, requests), []
        for _ in range(16):
            before = int(st["length"][slot, 0])
            out = ml.evaluate(g, {}, gen.params, st)
            st = out.state
            if int(st["length"][slot, 0]) > before:
                made.append(out.outputs["logits"][slot, 0])
        return made

    alone = logits_made({2: mine}, 2)
    crowded = logits_made({0: (ps[7], 8), 1: (ps[1], 10), 2: mine, 3: (ps[5], 4)}, 2)  # (its prefill slower)
    moved = logits_made({0: mine, 3: (ps[6], 5)}, 0)
    assert len(alone) == len(crowded) == len(moved) == 6
    for k, (a, b, c) in enumerate(zip(alone, crowded, moved)):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), f"token {k}: crowded"
        assert np.array_equal(a.view(np.uint8), c.view(np.uint8)), f"token {k}: another slot"


def test_the_page_pools_rules_catch_a_shared_page() -> None:
    pool = PagePool(pages=10, page_size=4, slots=3, per_slot=4)
    assert pool.reserve(0, 9) and pool.reserve(1, 8)  # 3 and 2 pages promised
    assert not pool.reserve(2, 24), "6 pages asked, 5 left"
    assert pool.grow(0, 5) and pool.grow(1, 8) and not pool.grow(1, 8)
    pool.check({0, 1})
    assert pool.available == 5 and pool.table[0, :2].tolist() == [0, 1] and pool.table[1, :2].tolist() == [2, 3]
    with pytest.raises(ml.errors.MegaloopError, match="slot 1 needs 1 more pages but has 0 reserved"):
        pool.grow(1, 9)
    pool.held[1].append(0)  # a page in two slots' tables
    pool.table[1, 2] = 0
    with pytest.raises(ml.errors.MegaloopError, match=r"page 0 is counted 2 times \(held by slots \[0, 1\]"):
        pool.check({0, 1})
    pool.held[1].pop()
    pool.table[1, 2] = -1
    pool.release(0)
    with pytest.raises(ml.errors.MegaloopError, match="free slot 1 still holds pages"):
        pool.check({0})
    pool.release(1)
    pool.check(set())
    assert pool.all_free()


def test_the_programs_kernel_compiles(gen) -> None:
    """The engine's loop kernel of two programs (the mixed step and a decode-only step: every op of
    them, the int embedding and the paged ops among them) under NVRTC, for sm_90a and sm_80; with the
    weight ring's loader warp (the default options), which walks each run's program's chunks."""
    from megaloop.codegen import generate
    from megaloop.runtime.compile import compile_cubin

    shape = StepShape(slots=2, chunk=4, page_size=4, pages=40, max_seq=64)
    programs = build_serving_programs(gen.cfg, shape, gen.eos_token_ids, (1,))
    program = generate(make_programs(programs, processors=16, arch="sm_90"))
    assert len(program.others) == 1 and "#define ML_PROGRAMS 2" in program.source
    assert "ml::LoaderRing" in program.source and program.threads == 288
    assert len(program.others[0].ring_chunks) > 0, "the decode-only step streams no weight through the ring"
    assert "ml::paged_attention<" in program.source
    for arch in ("sm_90a", "sm_80"):
        assert compile_cubin(program.source, arch, use_cache=False)[:4] == b"\x7fELF", arch


@pytest.mark.parametrize("strategy", ["tp", "pp"])
def test_the_step_split_over_two_devices(gen32, strategy: str) -> None:
    """Two ranks of the CPU reference (ml.parallelize of the step): the Generator's tokens for each
    prompt alone (pp computes what one device does; tp adds partial sums in rank order: float32)."""
    ps = prompts(gen32)[2:6]
    e = engine(gen32, max_slots=3, devices=2, strategy=strategy)
    assert "2 ranks" in e.description and strategy in e.description
    got = e.generate(ps, max_tokens=8, temperature=0.8, seed=3)
    close_and_check(e)
    for p, c in zip(ps, got):
        assert c.tokens == gen32.generate(p, max_new_tokens=8, temperature=0.8, seed=3)[0].tokens


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_cpu_step_is_the_references_within_attentions_contract(tiny, dtype: str) -> None:
    """CpuStep (the fast path) against ReferenceStep (ml.evaluate) over 12 steps of 3 slots, prefill
    chunks and decode: the same tokens and lengths, the page pools within attention's tolerance
    (float32 4e-6 relative to the pool's scale, bfloat16 a few bfloat16 steps of it: the BLAS order of
    sums), the pools written in place."""
    gen = ml.Generator(tiny, backend="cpu", max_seq=128, dtype=dtype)
    shape = StepShape(slots=3, chunk=4, page_size=4, pages=40, max_seq=48)
    g = build_serving_step(gen.cfg, shape, gen.eos_token_ids)
    ps = prompts(gen)
    st = slot_states(shape, g, {0: (ps[4], 9), 2: (ps[2], 10)})
    st["temperature"][2] = 0.8
    fast, ref = CpuStep(g, gen.params), ReferenceStep(g, gen.params)
    fast.write(st)
    ref.write(st)
    pools = [n for n in g.states if "pool" in n]
    buffer = fast.fast.state[pools[0]]
    worst = 0.0
    for step in range(12):
        fast.run(1)
        ref.run(1)
        for name, t in g.states.items():
            got, want = fast.read([name])[name], ref.read([name])[name]
            if not t.dtype.is_float:
                assert np.array_equal(got, want), f"step {step}: state {name}: {got} != {want}"
                continue
            g64, w64 = got.astype(np.float64), want.astype(np.float64)
            err = float(np.max(np.abs(g64 - w64), initial=0.0)) / max(1.0, float(np.max(np.abs(w64), initial=0.0)))
            worst = max(worst, err)
            assert err <= (4e-6 if dtype == "float32" else 4 * ml.bfloat16.eps), f"step {step}: {name}: {err:.2e}"
    assert fast.fast.state[pools[0]] is buffer, "the pool was copied, not written in place"
    assert int(fast.read(["length"])["length"][0, 0]) > len(ps[4]), "the step generated"
    print(f"worst relative difference of a float state: {worst:.2e}")


def test_the_engine_on_the_cpu_gives_the_references_completions(gen) -> None:
    ps = prompts(gen)[:4]
    results = {}
    for backend in ("cpu", "reference"):
        e = engine(gen, backend=backend, max_slots=4)
        assert e.step.name == backend
        requests = [e.submit(p, max_tokens=n) for p, n in zip(ps, MAX_TOKENS)]
        results[backend] = [r.result(120).tokens for r in requests]
        close_and_check(e)
    assert results["cpu"] == results["reference"]


@pytest.mark.parametrize(
    "variant",
    [{"attn_softcap": 5.0}, {"norms": "post"}, {"activation": "gelu_tanh"},
     {"rope_scaling": {"type": "longrope", "short_factor": (1.0,) * 4, "long_factor": (2.0,) * 4,
                       "original_max_position_embeddings": 8, "attention_factor": 1.0}}],
)  # fmt: skip
def test_the_step_refuses_the_layers_it_does_not_build(variant) -> None:
    """Gemma's, Phi-3's and OLMo 2's variants are built by the generation graphs only: the serving step
    refuses a model with them, naming them (never a step of another model)."""
    cfg = LlamaConfig(hidden=32, heads=4, kv_heads=2, intermediate=64, layers=1, vocab=40, max_seq=16,
                                **variant)  # fmt: skip
    with pytest.raises(GraphBuildError, match=rf"build_serving_step:.*{next(iter(variant))}.*megaloop generate"):
        build_serving_step(cfg, StepShape(slots=2, chunk=4, page_size=4, pages=8, max_seq=16))

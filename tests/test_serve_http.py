"""``megaloop serve`` with the official ``openai`` client as the real client, against servers started on
127.0.0.1 (in this process; one as the command, for the signals): completions and chat (text equal to
the Generator's for the prompt alone), streaming, stop strings, n, usage, disconnects (the request is
cancelled and its slot freed), the 400/404/429 paths, a bounded load test (64 concurrent streams: none
lost, none duplicated or crossed), and SIGTERM draining the running requests before it stops."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

import uvicorn  # noqa: E402

import megaloop as ml  # noqa: E402
from megaloop.models.tiny import make_tiny_checkpoint  # noqa: E402
from megaloop.serving.engine import Engine  # noqa: E402
from megaloop.serving.server import bound_socket, config, make_app  # noqa: E402

MODEL = "tiny"


class Server:
    """``engine`` served on a free port of 127.0.0.1 by uvicorn in a thread."""

    def __init__(self, engine: Engine, drain_timeout: float = 5.0) -> None:
        self.engine = engine
        sock = bound_socket("127.0.0.1", 0)
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.server = uvicorn.Server(config(make_app(engine, MODEL, drain_timeout=drain_timeout), "127.0.0.1",
                                            self.port, drain_timeout, "warning"))  # fmt: skip
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.01)

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key="unused", max_retries=0, **kw)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive()
        assert self.engine.slots.pages.all_free()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def gen(tiny):
    """float32: sampled answers are compared with the Generator's draws (docs/serving.md: bfloat16
    products of one row and of many may round apart)."""
    return ml.Generator(tiny, backend="cpu", max_seq=128, dtype="float32")


@pytest.fixture(scope="module")
def server(gen):
    s = Server(Engine(gen, max_slots=8, chunk=8, page_size=8, check_pages=True))
    yield s
    s.stop()


def recorded(engine: Engine) -> list:
    """The engine's requests from now on, as they are submitted."""
    seen, submit = [], engine.submit

    def record(*args, **kw):
        seen.append(submit(*args, **kw))
        return seen[-1]

    engine.submit = record  # type: ignore[method-assign]
    return seen


def test_models_and_health(server) -> None:
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    health = json.load(urllib.request.urlopen(f"http://127.0.0.1:{server.port}/health"))
    assert (
        health["status"] == "ok"
        and health["slots"] == 8
        and "the CPU (numpy and BLAS)" in health["device"]
        and health["backend"] == "cpu"
    )


def test_completions_are_the_generators(server, gen) -> None:
    c = server.client()
    r = c.completions.create(model=MODEL, prompt="Once upon a loop", max_tokens=10, temperature=0)
    want = gen.generate("Once upon a loop", max_new_tokens=10)[0]
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(want.prompt_tokens), 10)
    assert r.usage.total_tokens == len(want.prompt_tokens) + 10 and r.object == "text_completion"
    ids = gen.encode("A loop kernel")
    r = c.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0, echo=True)
    assert r.choices[0].text == gen.tokenizer.decode(ids) + gen.generate(ids, max_new_tokens=5)[0].text
    # n choices of a seeded request: seed, seed + 1 (as the Generator seeds a batch); several prompts
    r = c.completions.create(model=MODEL, prompt=["Hello", "Hi"], max_tokens=6, temperature=0.8, seed=11, n=2)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3] and r.usage.completion_tokens == 24
    for k, ch in enumerate(r.choices):
        prompt = ["Hello", "Hi"][k // 2]
        assert ch.text == gen.generate(prompt, max_new_tokens=6, temperature=0.8, seed=11 + k % 2)[0].text
    r = c.completions.create(model=MODEL, prompt="Hello", max_tokens=6, temperature=1.2, seed=2,
                             extra_body={"top_k": 50, "min_p": 0.05})  # fmt: skip
    assert r.choices[0].text == gen.generate("Hello", max_new_tokens=6, temperature=1.2, top_k=50, min_p=0.05,
                                             seed=2)[0].text  # fmt: skip


def test_chat_uses_the_chat_template(server, gen) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    r = server.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    want = gen.generate(messages, max_new_tokens=8)[0]
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want.text
    assert r.usage.prompt_tokens == len(want.prompt_tokens) and r.object == "chat.completion"
    parts = [{"type": "text", "text": "H"}, {"type": "text", "text": "i"}]
    r2 = server.client().chat.completions.create(
        model=MODEL, messages=[messages[0], {"role": "user", "content": parts}], max_completion_tokens=8, temperature=0
    )
    assert r2.choices[0].message.content == want.text


def test_streaming_gives_the_same_text_in_pieces(server, gen) -> None:
    c = server.client()
    pieces, finish = [], None
    for chunk in c.completions.create(model=MODEL, prompt="Once upon a loop", max_tokens=12, temperature=0,
                                      stream=True):  # fmt: skip
        pieces.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
    assert "".join(pieces) == gen.generate("Once upon a loop", max_new_tokens=12)[0].text and finish == "length"
    assert len([p for p in pieces if p]) >= 2, pieces  # (a piece a character: bytes of one wait for the rest)
    messages = [{"role": "user", "content": "Hello there"}]
    chunks = list(c.chat.completions.create(model=MODEL, messages=messages, max_tokens=9, temperature=0.7, seed=4,
                                            stream=True, stream_options={"include_usage": True}))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == gen.generate(messages, max_new_tokens=9, temperature=0.7, seed=4)[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9
    assert len({ch.id for ch in chunks}) == 1


def test_stop_strings(server, gen) -> None:
    want = gen.generate("Once upon a loop", max_new_tokens=16)[0].text
    stop = want[6:9]
    c = server.client()
    r = c.completions.create(model=MODEL, prompt="Once upon a loop", max_tokens=16, temperature=0, stop=stop)
    assert r.choices[0].text == want[: want.index(stop)] and r.choices[0].finish_reason == "stop"
    streamed = c.completions.create(model=MODEL, prompt="Once upon a loop", max_tokens=16, temperature=0,
                                    stop=["zzzz", stop], stream=True)  # fmt: skip
    assert "".join(ch.choices[0].text for ch in streamed) == want[: want.index(stop)]


def _slow(engine: Engine, seconds: float):
    """Each run of the engine's step takes ``seconds`` longer (a request then outlives its client)."""
    run = engine.step.run

    def slow(iterations: int, program: str = "mixed") -> None:
        time.sleep(seconds)
        run(iterations, program)

    engine.step.run = slow  # type: ignore[method-assign]
    return lambda: setattr(engine.step, "run", run)


def _wait_until(condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_client_that_disconnects_frees_its_slot(server) -> None:
    engine = server.engine
    restore = _slow(engine, 0.02)
    seen = recorded(engine)
    try:
        stream = server.client().completions.create(model=MODEL, prompt="Once upon a loop", max_tokens=100,
                                                    temperature=0, stream=True)  # fmt: skip
        for k, _ in enumerate(stream):
            if k == 2:
                break
        stream.close()  # the client goes away mid-stream
        _wait_until(lambda: seen and seen[0].done)
        assert seen[0].finish_reason == "cancelled" and len(seen[0].result().tokens) < 100
        # without streaming: the request is sent, then the socket closed before the answer
        body = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 100}).encode()
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)  # fmt: skip
            _wait_until(lambda: len(seen) == 2 and seen[1].status == "running")
        _wait_until(lambda: seen[1].done)
        assert seen[1].finish_reason == "cancelled" and len(seen[1].result().tokens) < 100
        _wait_until(lambda: engine.stats()["running"] == 0 and engine.slots.pages.all_free())
    finally:
        restore()
        del engine.submit


@pytest.mark.parametrize(
    "kind,body,param,words",
    [
        ("completions", {"prompt": "x", "temperature": -1}, "temperature", "greater than or equal to 0"),
        ("completions", {"prompt": "x", "top_p": 1.5}, "top_p", "less than or equal to 1"),
        ("completions", {"prompt": "x", "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
        ("completions", {"prompt": "x", "bogus": 1}, "bogus", "Extra inputs are not permitted"),
        ("completions", {"prompt": "x", "logprobs": 2}, "logprobs", "not supported"),
        ("completions", {"prompt": "x", "frequency_penalty": 0.5}, "frequency_penalty", "not supported"),
        ("completions", {"prompt": "x", "max_tokens": 500}, "max_tokens", "a slot holds 128"),
        ("completions", {"prompt": [], "max_tokens": 1}, "prompt", "prompt is empty"),
        ("completions", {"prompt": [999999]}, "prompt", "outside the vocabulary"),
        ("completions", {"max_tokens": 3}, "prompt", "Field required"),
        ("chat/completions", {"messages": []}, "messages", "at least 1 item"),
        ("chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, "messages", "roles system, user"),
        ("chat/completions", {"messages": [{"content": "x"}]}, "messages.0.role", "needs a role"),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
            "tools",
            "not supported",
        ),
        ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop": 3}, "stop", "valid string"),
    ],
)
def test_malformed_requests_get_400_naming_the_field(server, kind: str, body: dict, param: str, words: str) -> None:
    c = server.client()
    with pytest.raises(openai.BadRequestError) as caught:
        c.post(f"/{kind}", body={"model": MODEL, **body}, cast_to=object)
    error = caught.value.body
    assert caught.value.status_code == 400 and error["param"] == param and words in error["message"], error


def test_bad_json_and_an_unknown_model(server) -> None:
    req = urllib.request.Request(f"{server.url}/completions", data=b"{not json", method="POST",
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(req)
    assert caught.value.code == 400 and "JSON" in json.load(caught.value)["error"]["message"]
    with pytest.raises(openai.NotFoundError) as caught:
        server.client().completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert caught.value.body["param"] == "model" and caught.value.body["code"] == "model_not_found"


def test_requests_beyond_the_queue_get_429(gen) -> None:
    s = Server(Engine(gen, max_slots=1, chunk=8, page_size=8, max_queue=1))
    restore = _slow(s.engine, 0.02)
    try:

        async def one(client):
            try:
                await client.completions.create(model=MODEL, prompt="Hi", max_tokens=20, temperature=0)
                return 200
            except openai.RateLimitError as e:
                assert e.body["code"] == "queue_full" and "max_queue 1" in e.body["message"]
                return 429

        async def many():
            client = openai.AsyncOpenAI(base_url=s.url, api_key="unused", max_retries=0)
            return await asyncio.gather(*(one(client) for _ in range(5)))

        codes = asyncio.run(many())
        # all five come while the first runs (20 slow steps): at most one runs and one waits, the rest refused
        assert 1 <= codes.count(200) <= 2 and codes.count(429) == 5 - codes.count(200), codes
    finally:
        restore()
        s.stop()


def test_64_concurrent_streams_none_lost_or_crossed(server, gen) -> None:
    prompts = [f"request {i}:" for i in range(64)]
    want = {p: gen.generate(p, max_new_tokens=6)[0].text for p in prompts}

    async def stream(client, p):
        out, ids, finish = "", set(), None
        async for chunk in await client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0,
                                                           stream=True):  # fmt: skip
            out += chunk.choices[0].text
            ids.add(chunk.id)
            finish = chunk.choices[0].finish_reason or finish
        return p, out, ids, finish

    async def all_of_them():
        client = openai.AsyncOpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
        return await asyncio.gather(*(stream(client, p) for p in prompts))

    t0 = time.monotonic()
    results = asyncio.run(all_of_them())
    took = time.monotonic() - t0
    assert took < 90, f"64 streams took {took:.1f} s"
    assert sorted(p for p, *_ in results) == sorted(prompts), "every request answered once"
    ids = [next(iter(i)) for _, _, i, _ in results]
    assert all(len(i) == 1 for _, _, i, _ in results) and len(set(ids)) == 64, "one id a stream, none shared"
    for p, text, _, finish in results:
        assert text == want[p] and finish == "length", p
    _wait_until(lambda: server.engine.stats()["running"] == 0)


def test_the_command_drains_on_sigterm(tiny, tmp_path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(ml.__file__).parents[1]), *sys.path])}
    log = tmp_path / "serve.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "megaloop", "serve", "--model", str(tiny), "--port", str(port), "--backend", "cpu",
         "--max-seq", "128", "--max-slots", "2", "--no-progress"],
        stderr=log.open("w"), stdout=subprocess.DEVNULL, env=env,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=1)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        stream = client.completions.create(model=tiny.name, prompt="Once upon a loop", max_tokens=60, temperature=0,
                                           stream=True)  # fmt: skip
        text, finish = "", None
        for k, chunk in enumerate(stream):
            if k == 1:
                proc.send_signal(signal.SIGTERM)  # mid-stream: the stream still ends as it would have
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "length"
        assert proc.wait(60) == 0
        err = log.read_text()
        assert "running on the CPU (numpy and BLAS) (asked for)" in err, err
        assert "megaloop serve: stopped" in err
        with pytest.raises(OSError):
            urllib.request.urlopen(f"{url}/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_failed_step_is_a_500_and_health_says_so(gen) -> None:
    s = Server(Engine(gen, max_slots=2, chunk=8, page_size=8))

    def broken(iterations: int, program: str = "mixed") -> None:
        raise ml.errors.DataError("a step that fails (injected by the test)")

    s.engine.step.run = broken  # type: ignore[method-assign]
    try:
        with pytest.raises(openai.InternalServerError) as caught:
            s.client().completions.create(model=MODEL, prompt="Hi", max_tokens=3)
        assert "injected by the test" in caught.value.body["message"] and caught.value.body["type"] == "server_error"
        with pytest.raises(urllib.error.HTTPError) as health:
            urllib.request.urlopen(f"http://127.0.0.1:{s.port}/health")
        assert health.value.code == 503 and json.load(health.value)["status"] == "failed"
        with pytest.raises(openai.APIStatusError) as closed:
            s.client().completions.create(model=MODEL, prompt="Hi", max_tokens=3)
        assert closed.value.status_code == 503 and "failed" in closed.value.body["message"]
    finally:
        s.server.should_exit = True
        s.thread.join(30)

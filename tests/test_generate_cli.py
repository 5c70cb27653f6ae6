"""``megaloop generate`` as a command, on the CPU reference with the tiny checkpoint: --chat with
--system and a multi-turn --messages file, a batch file whose lines carry their own settings (bad lines
named by number and field, skipped only when asked), Ctrl-C during generate and plan (the text so far, a
newline, the timings, exit status 130, no traceback), exit statuses (usage 2, run 1), -q and -v."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import megaloop as ml
from megaloop.cli import main
from megaloop.generation import GenerationSettings
from megaloop.models.tiny import make_tiny_checkpoint

CHAT = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi!"},
        {"role": "user", "content": "What is a loop?"}]  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def gen(tiny):
    return ml.Generator(tiny, backend="cpu")


def run(tiny, *args: str) -> list[str]:
    return ["generate", "--model", str(tiny), "--backend", "cpu", "--max-new-tokens", "6", *args]


# ---- chat ---------------------------------------------------------------------------------------------------


def test_chat_with_a_system_prompt_and_a_conversation_file(tiny, gen, tmp_path, capsys) -> None:
    system = {"role": "system", "content": "Be brief."}
    assert main(run(tiny, "--prompt", "Hello", "--system", "Be brief.")) == 0
    want = gen.generate([system, {"role": "user", "content": "Hello"}], max_new_tokens=6)[0]
    assert capsys.readouterr().out == want.text + "\n"
    assert gen.encode("Hello", system="Be brief.") == gen.encode([system, {"role": "user", "content": "Hello"}])
    path = tmp_path / "chat.json"
    path.write_text(json.dumps(CHAT))
    assert main(run(tiny, "--messages", str(path), "--system", "Be brief.")) == 0
    assert capsys.readouterr().out == gen.generate([system, *CHAT], max_new_tokens=6)[0].text + "\n"
    path.write_text(json.dumps([system, *CHAT]))
    assert main(run(tiny, "--messages", str(path), "--system", "Other.")) == 2
    assert "begins with its own system message" in capsys.readouterr().err
    path.write_text(json.dumps([{"role": "user"}]))
    assert main(run(tiny, "--messages", str(path))) == 2
    assert "message 0 (user) has no string 'content'" in capsys.readouterr().err
    path.write_text("[{")
    assert main(run(tiny, "--messages", str(path))) == 2
    assert "is not a JSON conversation" in capsys.readouterr().err


# ---- batch files --------------------------------------------------------------------------------------------


def test_batch_file_lines_carry_their_own_settings(tiny, gen, tmp_path, capsys) -> None:
    lines = [
        "Hi",
        json.dumps({"prompt": "Once upon a loop", "temperature": 0.8, "seed": 3, "max_new_tokens": 4, "top_p": 0.9}),
        "",
        json.dumps({"messages": CHAT, "system": "Be brief.", "stop": ["never"], "n": 2, "temperature": 1.0}),
        json.dumps({"prompt": [5, 6, 7], "repetition_penalty": 1.5, "logprobs": 1}),
    ]
    path = tmp_path / "batch.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert main(run(tiny, "--batch-file", str(path), "--seed", "100")) == 0
    out = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [(o["line"], o["index"], o.get("sample")) for o in out] == [(1, 0, None), (2, 1, None), (4, 2, 0),
                                                                      (4, 2, 1), (5, 3, None)]  # fmt: skip
    assert out[0]["tokens"] == gen.generate("Hi", max_new_tokens=6)[0].tokens
    assert out[1]["tokens"] == gen.generate("Once upon a loop", temperature=0.8, seed=3, max_new_tokens=4,
                                            top_p=0.9)[0].tokens  # fmt: skip
    chat = [{"role": "system", "content": "Be brief."}, *CHAT]
    assert [o["tokens"] for o in out[2:4]] == [  # rows 2 and 3 of the batch: the call's seed + row
        c.tokens for c in gen.generate(chat, n=2, temperature=1.0, seed=102, max_new_tokens=6)
    ]
    assert out[4]["tokens"] == gen.generate([5, 6, 7], repetition_penalty=1.5, max_new_tokens=6)[0].tokens
    assert len(out[4]["logprobs"]) == 6 and "logprobs" not in out[0]


@pytest.mark.parametrize(
    "line,words",
    [
        ('{"prompt": "x", "temperature": -1}', ["line 2", "temperature must be a number >= 0"]),
        ('{"prompt": "x", "temprature": 1}', ["line 2", "unknown field 'temprature'"]),
        ('{"prompt": "x" "seed": 1}', ["line 2", "not valid JSON", "column 16"]),
        ('{"messages": [{"content": "x"}]}', ["line 2", "message 0 has no string 'role'"]),
        ('{"seed": 1}', ["line 2", "exactly one of 'prompt'"]),
        ('["x"]', None),  # not an object: a plain text prompt (it does not start with {)
    ],
)
def test_a_bad_batch_line_is_named_by_its_number_and_field(tiny, tmp_path, capsys, line, words) -> None:
    path = tmp_path / "batch.jsonl"
    path.write_text(f"Hi\n{line}\nA third prompt\n")
    code = main(run(tiny, "--batch-file", str(path), "--max-new-tokens", "2"))
    out, err = capsys.readouterr()
    if words is None:
        assert code == 0 and len(out.splitlines()) == 3
        return
    assert code == 2 and out == "" and "Traceback" not in err
    assert all(w in err for w in words) and str(path) in err, err
    assert main(run(tiny, "--batch-file", str(path), "--max-new-tokens", "2", "--skip-bad-lines")) == 0
    out, err = capsys.readouterr()
    assert [json.loads(x)["line"] for x in out.splitlines()] == [1, 3]
    assert "line 2" in err and "skipped" in err


def test_batch_file_bytes_that_are_not_utf8_name_the_line(tiny, tmp_path, capsys) -> None:
    path = tmp_path / "batch.txt"
    path.write_bytes(b"Hi\nok\nbad \xff byte\n")
    assert main(run(tiny, "--batch-file", str(path))) == 2
    assert "line 3: not UTF-8 text (byte 0xff at column 5)" in capsys.readouterr().err
    path.write_bytes(b"\n\n")
    assert main(run(tiny, "--batch-file", str(path))) == 2
    assert "holds no prompts" in capsys.readouterr().err
    assert main(run(tiny, "--batch-file", str(tmp_path / "missing.txt"))) == 2
    assert "cannot read the batch file" in capsys.readouterr().err


# ---- exit statuses, -q, -v ----------------------------------------------------------------------------------


def test_usage_errors_exit_2_and_run_errors_1(tiny, tmp_path, capsys, monkeypatch) -> None:
    assert main(run(tmp_path, "--prompt", "x")) == 2  # no checkpoint there
    with pytest.raises(SystemExit) as exit_status:  # argparse's own usage error
        main(run(tiny, "--prompt", "x", "--top-p", "0"))
    assert exit_status.value.code == 2
    assert main(run(tiny, "--prompt", "x", "--stop", "a", "--dtype", "float32", "--max-new-tokens", "99999")) == 2
    assert "need" in capsys.readouterr().err  # the context is too short: a usage error
    assert main(["plan", "--save", str(tmp_path / "no" / "plan.json")]) == 2
    assert "the folder" in capsys.readouterr().err
    from megaloop.runtime.report import LoopKernelError

    def fails(*a, **kw):
        raise LoopKernelError("the loop kernel reported error code 7")

    monkeypatch.setattr(ml.Generator, "generate", fails)
    assert main(run(tiny, "--prompt", "x")) == 1
    assert "LoopKernelError: the loop kernel reported error code 7" in capsys.readouterr().err


def test_quiet_prints_only_the_text_and_verbose_more(tiny, gen, capsys) -> None:
    assert main(run(tiny, "--prompt", "Hi", "-q", "--temperature", "1")) == 0
    out, err = capsys.readouterr()
    assert err == "" and out.endswith("\n") and len(out) > 1
    assert main(run(tiny, "--prompt", "Hi", "-v")) == 0
    out, err = capsys.readouterr()
    assert out == gen.generate("Hi", max_new_tokens=6)[0].text + "\n"
    assert "end-of-sequence tokens" in err and "sequence 0.0: 6 tokens, length" in err
    with pytest.raises(SystemExit) as exit_status:  # one or the other (argparse's usage error)
        main(run(tiny, "--prompt", "Hi", "-q", "-v"))
    assert exit_status.value.code == 2


# ---- Ctrl-C -------------------------------------------------------------------------------------------------


def interrupt(
    args: list[str], ready: str | None, after: float = 0.0, timeout: float = 120
) -> tuple[int, str, str, float]:
    """Run ``megaloop args``, send SIGINT ``after`` seconds once ``ready`` shows on its stdout or stderr
    ("": once it has printed anything on stdout; None: at once), and return the exit status, stdout,
    stderr and the seconds from the signal to the exit."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "megaloop", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)  # fmt: skip
    os.set_blocking(proc.stdout.fileno(), False)
    os.set_blocking(proc.stderr.fileno(), False)
    out, err = b"", b""
    deadline = time.monotonic() + timeout
    while ready is not None and ((ready.encode() not in out + err) if ready else not out):
        assert proc.poll() is None, (out, err)
        assert time.monotonic() < deadline, f"{ready!r} never came: {out[-500:]!r} {err[-2000:]!r}"
        time.sleep(0.05)
        out += proc.stdout.read() or b""
        err += proc.stderr.read() or b""
    time.sleep(after)
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    took = time.monotonic() - sent
    os.set_blocking(proc.stdout.fileno(), True)
    os.set_blocking(proc.stderr.fileno(), True)
    out += proc.stdout.read()
    err += proc.stderr.read()
    return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace"), took


def test_ctrl_c_during_generate_stops_cleanly(tiny) -> None:
    code, out, err, took = interrupt(
        ["generate", "--model", str(tiny), "--backend", "reference", "--prompt", "Once", "--max-new-tokens", "1500",
         "--temperature", "1", "--seed", "1"],
        ready="", after=0.5,  # some text out, the decode under way (the reference: the fast path may be done)
    )  # fmt: skip
    assert code == 130 and took < 10, (code, took, err)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert out.endswith("\n") and "interrupted after" in err and "decode steps" in err, err
    assert "seed 1 " in err


def test_ctrl_c_during_plan_stops_at_once(tmp_path) -> None:
    code, _, err, took = interrupt(["plan", "--preset", "llama3-8b"], ready="planning llama3-8b", after=1.0)
    assert code == 130 and took < 10, (code, took, err)
    assert "Traceback" not in err and "megaloop plan: interrupted" in err, err


def test_generate_reports_an_interrupted_result(gen, monkeypatch) -> None:
    """In the Python API Ctrl-C is GenerationInterrupted (a KeyboardInterrupt) with what was made."""
    from megaloop.generation import GenerationInterrupted
    from megaloop.generation.backends import CpuBackend

    real, calls = CpuBackend.advance, []

    def advance(self, n):
        calls.append(n)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(self, n)

    monkeypatch.setattr(CpuBackend, "advance", advance)
    with pytest.raises(GenerationInterrupted) as caught:
        gen.generate(["Hi", "Once upon"], max_new_tokens=20, settings=GenerationSettings(stop="zzz"))
    result = caught.value.result
    assert isinstance(caught.value, KeyboardInterrupt) and result.stats.interrupted
    assert [len(c.tokens) for c in result] == [3, 3] and {c.finish_reason for c in result} == {"interrupted"}
    assert "interrupted after 6 new tokens" in result.stats.summary()

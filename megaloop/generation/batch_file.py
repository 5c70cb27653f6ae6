"""``megaloop generate --batch-file``: one prompt a line, each a plain text or a JSON object with its own
settings, read into ``BatchLine``s; a line that cannot be served is named by its number (and field).

A line whose first non-blank character is ``{`` is a JSON object: ``prompt`` (a text, or a list of
token ids) or ``messages`` (a conversation: a list of {"role", "content"}), and optionally ``system``
(a system prompt: the text goes through the chat template), ``chat`` (true/false: the command's
--chat for this line) and any field of ``GenerationSettings`` (temperature, top_k, top_p, min_p,
repetition_penalty, presence_penalty, frequency_penalty, seed, max_new_tokens, stop, n, logprobs).
Any other line is the prompt text itself; blank lines are skipped.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megaloop.generation.requests import check_messages
from megaloop.generation.settings import FIELDS, GenerationError, GenerationSettings, settings_from

PROMPT_FIELDS = ("prompt", "messages", "system", "chat")


class BatchFileError(GenerationError):
    """A batch file line that cannot be served (the message names the file, the line and the field)."""


@dataclass(frozen=True)
class BatchLine:
    """One prompt of a batch file: its line number, the prompt (text, token ids or a conversation), its
    settings, and its own ``chat`` and ``system`` (None: the command's)."""

    line: int
    prompt: Any
    settings: GenerationSettings
    chat: bool | None = None
    system: str | None = None


def read_batch_file(
    data: bytes, name: str, skip_bad: bool = False, warn: Callable[[str], None] | None = None
) -> list[BatchLine]:
    """The prompts of a batch file's bytes (``name``: how messages call the file). A bad line is a
    BatchFileError, or with ``skip_bad`` a warning (``warn``) and left out."""
    out = []
    for number, raw in enumerate(data.split(b"\n"), start=1):
        try:
            item = _line(raw, f"{name} line {number}", number)
        except BatchFileError as e:
            if not skip_bad:
                raise
            if warn is not None:
                warn(f"{e}; skipped")
            continue
        if item is not None:
            out.append(item)
    if not out:
        raise BatchFileError(f"{name} holds no prompts (one a line: a text, or a JSON object with a prompt)")
    return out


def _line(raw: bytes, where: str, number: int) -> BatchLine | None:
    try:
        text = raw.decode("utf-8").removesuffix("\r")
    except UnicodeDecodeError as e:
        raise BatchFileError(f"{where}: not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1})") from None
    if not text.strip():
        return None
    if not text.lstrip().startswith("{"):
        return BatchLine(number, text, GenerationSettings())
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise BatchFileError(
            f"{where}: a line starting with {{ is a JSON object, but this one is not valid JSON ({e.msg} at column "
            f"{e.colno}); write a text prompt that starts with {{ as {{\"prompt\": \"...\"}}"
        ) from None
    if not isinstance(obj, dict):
        raise BatchFileError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    return _fields(obj, where, number)


def _fields(obj: dict, where: str, number: int) -> BatchLine:
    unknown = sorted(set(obj) - set(PROMPT_FIELDS) - set(FIELDS))
    if unknown:
        raise BatchFileError(f"{where}: unknown field {unknown[0]!r} (known: {', '.join(PROMPT_FIELDS + FIELDS)})")
    if ("prompt" in obj) == ("messages" in obj):
        raise BatchFileError(f"{where}: give exactly one of 'prompt' (a text or token ids) and 'messages'")
    if "prompt" in obj:
        prompt = obj["prompt"]
        ids = isinstance(prompt, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt)
        if not (isinstance(prompt, str) or (ids and prompt)):
            raise BatchFileError(f"{where}: field 'prompt' must be a text or a non-empty list of token ids")
    else:
        try:
            prompt = check_messages(obj["messages"], f"{where}: field 'messages'")
        except GenerationError as e:
            raise BatchFileError(str(e)) from None
    chat, system = obj.get("chat"), obj.get("system")
    if chat is not None and not isinstance(chat, bool):
        raise BatchFileError(f"{where}: field 'chat' must be true or false, got {chat!r}")
    if system is not None and not isinstance(system, str):
        raise BatchFileError(f"{where}: field 'system' must be a text, got {system!r:.40}")
    try:
        settings = settings_from({k: v for k, v in obj.items() if k in FIELDS}, where)
    except GenerationError as e:
        raise BatchFileError(str(e)) from None
    return BatchLine(number, prompt, settings, chat, system)


def read_file(path: str | Path, what: str) -> bytes:
    """A file's bytes ('-': stdin's); BatchFileError naming it where it cannot be read."""
    import sys

    try:
        return sys.stdin.buffer.read() if str(path) == "-" else Path(path).read_bytes()
    except OSError as e:
        raise BatchFileError(f"cannot read {what} {path}: {e.strerror or e}") from None

"""A ``generate`` call as rows of the generator's batch: each prompt's settings resolved
(megaloop.generation.settings), its n sequences, their seeds, and the generator's first states that
carry them (sampling, penalties, log-probabilities: megaloop.models.decoding)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from megaloop.generation.settings import (
    GenerationError,
    GenerationSettings,
    ModelDefaults,
    as_seed_word,
    draw_seed,
    resolve,
)
from megaloop.models.decoding import Decoding

ROLES_HINT = "a message is {'role': 'system' | 'user' | 'assistant' | ..., 'content': 'text'}"


@dataclass(frozen=True)
class Row:
    """One sequence of the batch: its prompt (index and ids), which of the prompt's n it is, its
    settings (every field set) and the seed it draws with (an int64 word; None: greedy)."""

    index: int
    sample: int
    ids: list[int]
    settings: GenerationSettings
    seed: int | None


@dataclass(frozen=True)
class Batch:
    """The rows, the generator they need (``sampling`` and ``decoding``), the seed the call drew or was
    given (None: greedy, or per-prompt seeds only), whether it was drawn, and the generation_config.json
    fields that decided a setting of some sequence (name -> how the file says it)."""

    rows: list[Row]
    sampling: bool
    decoding: Decoding
    seed: int | None
    seed_drawn: bool
    from_file: dict[str, str]

    @property
    def lengths(self) -> list[int]:
        return [len(r.ids) for r in self.rows]

    @property
    def new(self) -> list[int]:
        return [int(r.settings.max_new_tokens) for r in self.rows]


def build_batch(
    ids: list[list[int]],
    call: GenerationSettings,
    per_prompt: Sequence[GenerationSettings],
    prompt_seeds: Sequence[int] | None,
    defaults: ModelDefaults,
    context: int,
) -> Batch:
    """The rows of prompts ``ids``: settings from ``per_prompt[i]``, then ``call``, then ``defaults``;
    ``prompt_seeds``: one seed per prompt (``call.seed`` is then unset). A call seed S gives row r the
    seed S + r; a prompt's own seed s gives its j-th sequence s + j; a sampled call without any draws S.
    A max_new_tokens from the file's max_length stops at the ``context``."""
    resolved, from_file = [], {}
    for i, prompt in enumerate(ids):
        settings, decided = resolve([per_prompt[i], call], defaults, len(prompt))
        if "max_new_tokens" in decided and defaults.settings.max_new_tokens is None:  # from max_length
            settings = _replace(settings, max_new_tokens=max(1, min(settings.max_new_tokens, context - len(prompt))))
        resolved.append(settings)
        from_file.update({name: defaults.shown[name] for name in decided if name in defaults.shown})
    sampled = any(s.temperature > 0 for s in resolved)
    base, drawn = call.seed, False
    if sampled and base is None and prompt_seeds is None and any(s.seed is None for s in per_prompt):
        base, drawn = draw_seed(), True
    rows = []
    for i, (prompt, settings) in enumerate(zip(ids, resolved)):
        for j in range(int(settings.n)):
            own = per_prompt[i].seed
            if own is None and prompt_seeds is not None:
                own = prompt_seeds[i]
            seed = own + j if own is not None else (base + len(rows) if base is not None else None)
            word = as_seed_word(seed) if seed is not None and settings.temperature > 0 else None
            rows.append(Row(i, j, prompt, settings, word))
    penalties = any(
        s.repetition_penalty != 1 or s.presence_penalty != 0 or s.frequency_penalty != 0 for s in resolved
    )
    wanted = [s.logprobs for s in resolved if s.logprobs is not None]
    decoding = Decoding(penalties=penalties, logprobs=max(wanted) if wanted else None)
    return Batch(rows, sampled, decoding, base if sampled else None, drawn, from_file)


def _replace(settings: GenerationSettings, **values: Any) -> GenerationSettings:
    return GenerationSettings(**{**settings.__dict__, **values})


def start_states(batch: Batch, vocab: int) -> dict[str, np.ndarray]:
    """The generator's per-sequence states for the batch's settings (those its graph has are used)."""
    rows = batch.rows
    b = len(rows)
    col = lambda name, dt: np.array([getattr(r.settings, name) for r in rows], dt).reshape(b, 1)
    out: dict[str, np.ndarray] = {}
    if batch.sampling:
        out.update(
            temperature=col("temperature", np.float32), top_k=col("top_k", np.int64), top_p=col("top_p", np.float32),
            min_p=col("min_p", np.float32),
            seed=np.array([r.seed if r.seed is not None else 0 for r in rows], np.int64).reshape(b, 1),
        )  # fmt: skip
    if batch.decoding.penalties:
        mask = np.zeros((b, 1, vocab), bool)
        for k, r in enumerate(rows):
            mask[k, 0, r.ids] = True
        out.update(
            prompt_tokens=mask, token_counts=np.zeros((b, 1, vocab), np.int32),
            repetition_penalty=col("repetition_penalty", np.float32),
            presence_penalty=col("presence_penalty", np.float32),
            frequency_penalty=col("frequency_penalty", np.float32),
        )  # fmt: skip
    return out


def chat_messages(prompt: Any, system: str | None, where: str) -> list[dict]:
    """The conversation a chat prompt stands for: a text as one user message (after ``system``), or a
    list of messages checked (each a dict with a string role and content) with ``system`` put first
    (refused where the conversation has its own)."""
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    else:
        messages = check_messages(prompt, where)
    if system is not None:
        if not isinstance(system, str):
            raise GenerationError(f"{where}: system must be a string, got {type(system).__name__}")
        if messages and messages[0].get("role") == "system":
            raise GenerationError(
                f"{where}: the conversation begins with its own system message; give the system prompt once "
                "(drop the system argument, or that message)"
            )
        messages = [{"role": "system", "content": system}, *messages]
    return messages


def check_messages(messages: Any, where: str) -> list[dict]:
    """A conversation: a non-empty list of messages, each with a string ``role`` and a string (or null:
    tool calls) ``content``; GenerationError naming the message and the field otherwise."""
    if not isinstance(messages, list) or not messages:
        raise GenerationError(f"{where}: a conversation is a non-empty list of messages ({ROLES_HINT})")
    for k, m in enumerate(messages):
        if not isinstance(m, dict):
            raise GenerationError(f"{where}: message {k} is a {type(m).__name__}, not an object ({ROLES_HINT})")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise GenerationError(f"{where}: message {k} has no string 'role' ({ROLES_HINT})")
        if "content" not in m or not (m["content"] is None or isinstance(m["content"], str)):
            raise GenerationError(f"{where}: message {k} ({m['role']}) has no string 'content' ({ROLES_HINT})")
    return [dict(m) for m in messages]

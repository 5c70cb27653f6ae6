"""How each sequence is generated: ``GenerationSettings`` (every field optional), the checkpoint's
``generation_config.json`` defaults, and their resolution into one sequence's concrete settings.

A field's value comes from the first place that sets it: the prompt's own settings (a batch file's
line, ``Generator.generate(settings=[...])``), then the call's (``generate``'s arguments, the
command's flags), then generation_config.json, then megaloop's defaults (``BUILT_IN``: greedy, 128
new tokens, no penalties). generation_config.json is read as transformers reads it: ``do_sample``
false (or absent) means greedy, whatever its temperature; with ``do_sample`` true its temperature
(default 1.0), top_k, top_p and min_p; ``repetition_penalty`` applies greedy or not;
``max_new_tokens``, else ``max_length`` (prompt included); its ``eos_token_id`` list ends sequences
(megaloop.models.tokenizer). transformers' own defaults for what the file leaves out (top_k 50) are
not assumed: megaloop's are (top_k off).

Seeds: any integer, reduced mod 2^64 (the generator's seeds are 64-bit words); a sampled call
without one draws one (``Generator.generate`` reports it), so that repeating it with that seed gives
the same tokens bit for bit.
"""

from __future__ import annotations

import json
import math
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from megaloop.errors import MegaloopError
from megaloop.models.decoding import MAX_LOGPROBS


class GenerationError(MegaloopError, ValueError):
    """A generation request megaloop cannot serve as asked (prompt, lengths, settings)."""


@dataclass(frozen=True)
class GenerationSettings:
    """How to generate; None: not set here (a later source decides). ``stop``: strings that end a
    sequence where its text contains one (not included in the text); ``n``: sequences per prompt;
    ``logprobs``: the chosen tokens' log-probabilities and that many likeliest alternatives (0: the
    chosen ones only)."""

    max_new_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] | None = None
    n: int | None = None
    logprobs: int | None = None

    def checked(self, where: str) -> GenerationSettings:
        """The same settings with ``stop`` as a tuple, each set value checked; GenerationError naming
        ``where`` and the field otherwise."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = None if value is None else _CHECKS[f.name](value, f"{where}: {f.name}")
        return GenerationSettings(**out)

    def over(self, other: GenerationSettings) -> GenerationSettings:
        """These settings, with ``other``'s where these are not set."""
        return GenerationSettings(
            **{f.name: v if (v := getattr(self, f.name)) is not None else getattr(other, f.name) for f in fields(self)}
        )

    def set_fields(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


FIELDS = tuple(f.name for f in fields(GenerationSettings))

BUILT_IN = GenerationSettings(
    max_new_tokens=128, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
    presence_penalty=0.0, frequency_penalty=0.0, stop=(), n=1,
)  # fmt: skip


def _number(value: Any, what: str, ok: Any, rule: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
        raise GenerationError(f"{what} must be {rule}, got {value!r}")
    return float(value)


def _integer(value: Any, what: str, low: int, high: float = math.inf, rule: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise GenerationError(f"{what} must be {rule or f'an int >= {low}'}, got {value!r}")
    return int(value)


def _stop(value: Any, what: str) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) and s for s in items):
        raise GenerationError(f"{what} must be a non-empty string or a list of them, got {value!r:.80}")
    return tuple(dict.fromkeys(items))


def _seed(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise GenerationError(f"{what} must be an int (any size: it is reduced mod 2^64), got {value!r:.40}")
    return int(value)


_CHECKS: dict[str, Any] = {
    "max_new_tokens": lambda v, w: _integer(v, w, 1),
    "temperature": lambda v, w: _number(v, w, lambda x: x >= 0, "a number >= 0 (0: greedy)"),
    "top_k": lambda v, w: _integer(v, w, 0, rule="an int >= 0 (0: off)"),
    "top_p": lambda v, w: _number(v, w, lambda x: 0 < x <= 1, "a number in (0, 1] (1: off)"),
    "min_p": lambda v, w: _number(v, w, lambda x: 0 <= x <= 1, "a number in [0, 1] (0: off)"),
    "repetition_penalty": lambda v, w: _number(v, w, lambda x: x > 0, "a number > 0 (1: off)"),
    "presence_penalty": lambda v, w: _number(v, w, lambda x: True, "a finite number (0: off)"),
    "frequency_penalty": lambda v, w: _number(v, w, lambda x: True, "a finite number (0: off)"),
    "seed": _seed,
    "stop": _stop,
    "n": lambda v, w: _integer(v, w, 1),
    "logprobs": lambda v, w: _integer(v, w, 0, MAX_LOGPROBS, f"an int in [0, {MAX_LOGPROBS}]"),
}


def settings_from(values: Mapping[str, Any], where: str) -> GenerationSettings:
    """GenerationSettings of a mapping of field names (a batch file's line), checked; unknown names
    refused with the known ones."""
    unknown = sorted(set(values) - set(FIELDS))
    if unknown:
        raise GenerationError(f"{where}: unknown field {unknown[0]!r} (known: {', '.join(FIELDS)})")
    return GenerationSettings(**values).checked(where)


# ---- the checkpoint's defaults -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelDefaults:
    """What a checkpoint's generation_config.json sets: ``settings``, ``max_length`` (prompt included;
    used where max_new_tokens comes from nowhere else) and ``shown``: each field it decides, as the
    file says it (e.g. temperature -> "temperature 0.6 (do_sample true)")."""

    settings: GenerationSettings = GenerationSettings()
    max_length: int | None = None
    shown: dict[str, str] = field(default_factory=dict)


def read_generation_config(folder: Path) -> ModelDefaults:
    """The defaults of ``folder``/generation_config.json (none without the file)."""
    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        return ModelDefaults()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise GenerationError(f"{path}: not a readable JSON file ({e})") from None
    if not isinstance(data, dict):
        raise GenerationError(f"{path}: expected a JSON object, got {type(data).__name__}")
    where = str(path)
    values: dict[str, Any] = {}
    shown: dict[str, str] = {}
    sample = data.get("do_sample")
    if sample is not None and not isinstance(sample, bool):
        raise GenerationError(f"{where}: do_sample must be true or false, got {sample!r}")
    if sample:
        values["temperature"] = 1.0 if data.get("temperature") is None else data["temperature"]
        shown["temperature"] = f"temperature {values['temperature']} (do_sample true)"
    elif sample is False:
        values["temperature"] = 0.0
        shown["temperature"] = "greedy (do_sample false)"
    for name in ("top_k", "top_p", "min_p", "repetition_penalty", "max_new_tokens"):
        if data.get(name) is not None:
            values[name] = data[name]
            shown[name] = f"{name} {data[name]}"
    max_length = data.get("max_length")
    if max_length is not None:
        max_length = _integer(max_length, f"{where}: max_length", 1)
        if "max_new_tokens" not in values:
            shown["max_new_tokens"] = f"max_length {max_length}"
    return ModelDefaults(GenerationSettings(**values).checked(where), max_length, shown)


# ---- one sequence's settings ---------------------------------------------------------------------------------


def resolve(
    layers: Sequence[GenerationSettings], defaults: ModelDefaults, prompt_length: int
) -> tuple[GenerationSettings, set[str]]:
    """The settings of one prompt from ``layers`` (first wins), then the file's, then BUILT_IN; and the
    fields the file decided."""
    mine = GenerationSettings()
    for layer in layers:
        mine = mine.over(layer)
    from_file = {name for name in defaults.settings.set_fields() if getattr(mine, name) is None}
    out = mine.over(defaults.settings)
    if out.max_new_tokens is None and defaults.max_length is not None:
        out = replace(out, max_new_tokens=max(1, defaults.max_length - prompt_length))
        from_file.add("max_new_tokens")
    return out.over(BUILT_IN), from_file


def as_seed_word(seed: int) -> int:
    """``seed`` mod 2^64 as the int64 of the same 64 bits (int64 seeds are kept as they are)."""
    word = seed % 2**64
    return word - 2**64 if word >= 2**63 else word


def reduced(seed: int) -> bool:
    """Whether ``seed`` lies outside int64 and uint64 alike, so that mod 2^64 changes which number it is."""
    return not -(2**63) <= seed < 2**64


def draw_seed() -> int:
    """A fresh seed for a sampled call that gave none (printed, so that the run can be repeated)."""
    return secrets.randbits(63)

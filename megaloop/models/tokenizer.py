"""A checkpoint's tokenizer, read as transformers reads it, without transformers.

    tok = Tokenizer.from_folder("Llama-3.2-1B-Instruct")
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hi"}]), add_special_tokens=False)
    stream = tok.stream()
    text = "".join(stream.push(i) for i in ids) + stream.flush()

The vocabulary, normalizer, pre-tokenizer, post-processor (which special tokens an encoding gets)
and decoder come from ``tokenizer.json`` through the Hugging Face ``tokenizers`` library; as in
transformers 5, tokenizer_config.json's ``add_bos_token``/``add_eos_token`` do not override it. The
special tokens and the chat template come from ``tokenizer_config.json`` (and ``chat_template.jinja``,
``additional_chat_templates/``, ``special_tokens_map.json``), rendered with jinja2 in the sandboxed
environment transformers uses (trim_blocks, lstrip_blocks, loop controls, ``raise_exception``,
``strftime_now``, its ``tojson``). The stop tokens add ``generation_config.json``'s (and
config.json's) ``eos_token_id`` to the tokenizer's end-of-sequence token.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from megaloop.errors import CheckpointError, MegaloopError

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplateError(MegaloopError, ValueError):
    """A chat template raised an error (``raise_exception``) or could not be rendered."""


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


class Tokenizer:
    """Text <-> token ids and chat prompts for a checkpoint folder (``from_folder``)."""

    def __init__(
        self,
        backend: Any,
        config: Mapping[str, Any] | None = None,
        chat_templates: Mapping[str, str] | None = None,
        stop_ids: Iterable[int] = (),
    ) -> None:
        """``backend``: a ``tokenizers.Tokenizer``; ``config``: tokenizer_config.json's contents;
        ``chat_templates``: name -> jinja source ("default" is used unless another is asked for);
        ``stop_ids``: end-of-sequence ids besides the eos token's."""
        from tokenizers import AddedToken

        self.backend = backend
        self.config = dict(config or {})
        self.chat_templates = dict(chat_templates or {})
        self.special_tokens = {k: t for k in SPECIAL_TOKENS if (t := _token_text(self.config.get(k))) is not None}
        extra = self.config.get("extra_special_tokens") or self.config.get("additional_special_tokens") or []
        extra = [*(extra.values() if isinstance(extra, Mapping) else extra if isinstance(extra, list) else [])]
        # a model's own named tokens ("image_token": "<image>") are special tokens too
        named = (k for k in self.config if k.endswith("_token") and k not in SPECIAL_TOKENS)
        extra += [v for k in named if isinstance(v := self.config[k], str)]
        added = {t.content for t in backend.get_added_tokens_decoder().values()}
        # transformers makes every named special token an added special token of the backend
        wanted = [*self.special_tokens.values(), *(t for e in extra if (t := _token_text(e)) is not None)]
        missing = [t for t in dict.fromkeys(wanted) if t not in added]
        if missing:
            backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])
        eos = self.token_id(self.special_tokens.get("eos_token"))
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys([*stop_ids, *([eos] if eos is not None else [])]))
        self.bos_token_id: int | None = self.token_id(self.special_tokens.get("bos_token"))
        self._clean_up = bool(self.config.get("clean_up_tokenization_spaces")) and not self._is_bpe()

    # ---- loading -----------------------------------------------------------------------------------
    @classmethod
    def from_folder(cls, path: str | Path) -> Tokenizer:
        """The tokenizer of a Hugging Face model folder (tokenizer.json required)."""
        from tokenizers import Tokenizer as Backend

        folder = Path(path)
        file = folder / "tokenizer.json"
        if not file.is_file():
            raise CheckpointError(
                f"{folder}: no tokenizer.json (megaloop reads tokenizers in the Hugging Face tokenizers format; "
                "a sentencepiece-only tokenizer.model can be converted by saving it once with transformers)"
            )
        try:
            backend = Backend.from_file(str(file))
        except Exception as e:  # the library raises plain Exceptions for malformed files
            raise CheckpointError(f"{file}: not a tokenizer the tokenizers library can read ({e})") from None
        config = _read_json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").is_file() else {}
        legacy = folder / "special_tokens_map.json"
        if "added_tokens_decoder" not in config and legacy.is_file():  # older saves kept them apart
            config.update({k: v for k, v in _read_json(legacy).items() if k in SPECIAL_TOKENS})
        return cls(backend, config, _chat_templates(folder, config), checkpoint_stop_ids(folder))

    def _is_bpe(self) -> bool:
        return type(self.backend.model).__name__ == "BPE"

    # ---- text <-> ids ------------------------------------------------------------------------------
    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        """Tokens including the added ones."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"Tokenizer.encode: expected a str, got {type(text).__name__}")
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        return _clean_up(text) if self._clean_up else text

    def stream(self, skip_special_tokens: bool = True) -> StreamDecoder:
        """An incremental decoder: ``push(id)`` returns the text that id completes."""
        return StreamDecoder(self, skip_special_tokens)

    # ---- chat ------------------------------------------------------------------------------------
    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text for a conversation (a list of {"role", "content"} dicts), rendered as
        transformers' ``apply_chat_template(..., tokenize=False)`` does. Encode it with
        ``add_special_tokens=False``: the template writes the special tokens itself. ``template``
        names one of several templates (default: "tool_use" when tools are given, else "default")."""
        source = self._template(template, tools)
        if not isinstance(messages, list) or not messages:
            raise ChatTemplateError("apply_chat_template: messages must be a non-empty list of dicts")
        chat = []
        for m in messages:
            if not isinstance(m, Mapping):
                raise ChatTemplateError(f"apply_chat_template: a message must be a dict, got {type(m).__name__}")
            m = {k: v for k, v in m.items() if v is not None}  # as transformers: None means absent
            reasoning = next((m[k] for k in ("reasoning_content", "thinking", "reasoning") if k in m), None)
            if reasoning is not None:
                m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
            chat.append(m)
        values = {**self.special_tokens, **kwargs}
        try:
            return _compile(source).render(
                messages=chat, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt, **values
            )
        except ChatTemplateError:
            raise
        except Exception as e:  # jinja2's TemplateError and whatever the template's own code raised
            raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from None

    def _template(self, name: str | None, tools: Any) -> str:
        templates = self.chat_templates
        if not templates:
            raise ChatTemplateError(
                "this tokenizer has no chat template (tokenizer_config.json's chat_template, chat_template.jinja): "
                "give the prompt as plain text"
            )
        if name is None:
            name = "tool_use" if tools and "tool_use" in templates else "default"
        if name not in templates:
            raise ChatTemplateError(f"no chat template named {name!r}; this tokenizer has {sorted(templates)}")
        return templates[name]


class StreamDecoder:
    """Text as tokens arrive, never splitting a multi-byte character: ``push`` returns what became
    decodable (often "", e.g. the first bytes of an emoji), ``flush`` the rest at the end.
    The pushed texts and the flush add up to ``decode`` of all the ids."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        from tokenizers.decoders import DecodeStream

        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.ids: list[int] = []
        self.text = ""  # what push returned so far

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        piece = self._stream.step(self.tokenizer.backend, int(token_id)) or ""
        self.text += piece
        return piece

    def flush(self) -> str:
        """What is left: the bytes of an unfinished character (as the replacement character), or
        where the library's stream and the whole decode differ, the whole decode's end."""
        whole = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip)
        rest = whole[len(self.text) :] if whole.startswith(self.text) else ""
        self.text += rest
        return rest


def _clean_up(text: str) -> str:
    """transformers' clean_up_tokenization (spaces before punctuation and contractions); it applies
    it to WordPiece-style tokenizers only, not BPE."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                 (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):  # fmt: skip
        text = text.replace(a, b)
    return text


def _chat_templates(folder: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """name -> template: chat_template.jinja and additional_chat_templates/*.jinja (newer saves)
    win over tokenizer_config.json's chat_template (a string, or a list of {name, template})."""
    templates: dict[str, str] = {}
    inline = config.get("chat_template")
    if isinstance(inline, str):
        templates["default"] = inline
    elif isinstance(inline, list):
        for item in inline:
            if not isinstance(item, Mapping) or not isinstance(item.get("name"), str):
                raise CheckpointError(f"{folder}/tokenizer_config.json: chat_template entries need a name and template")
            templates[item["name"]] = str(item.get("template", ""))
    elif inline is not None:
        raise CheckpointError(f"{folder}/tokenizer_config.json: chat_template must be a string or a list")
    files = {}
    if (folder / "chat_template.jinja").is_file():
        files["default"] = folder / "chat_template.jinja"
    elif (folder / "chat_template.json").is_file():
        value = _read_json(folder / "chat_template.json").get("chat_template")
        if isinstance(value, str):
            templates = {"default": value}
    extra = folder / "additional_chat_templates"
    if extra.is_dir():
        files.update({p.name.removesuffix(".jinja"): p for p in sorted(extra.glob("*.jinja"))})
    if files:
        templates = {name: p.read_text(encoding="utf-8") for name, p in files.items()}
    return templates


def checkpoint_stop_ids(folder: Path) -> list[int]:
    """End-of-sequence ids of generation_config.json (transformers' generate stops at those) or,
    without one, config.json's."""
    out: list[int] = []
    for name in ("generation_config.json", "config.json"):
        if (folder / name).is_file():
            value = _read_json(folder / name).get("eos_token_id")
            values = value if isinstance(value, list) else [value]
            out += [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
            if name == "generation_config.json" and value is not None:
                break
    return out


_COMPILED: dict[str, Any] = {}


def _compile(source: str) -> Any:
    if source not in _COMPILED:
        _COMPILED[source] = _environment().from_string(source)
    return _COMPILED[source]


def _environment() -> Any:
    """jinja2 as transformers sets it up for chat templates (which are untrusted code: sandboxed)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """{% generation %}...{% endgeneration %}: marks the assistant's text; rendered as is."""

        tags = {"generation"}  # noqa: RUF012 - jinja2's interface

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise ChatTemplateError(f"the chat template refused the conversation: {message}")

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env

"""The OpenAI API's requests and answers as ``megaloop serve`` takes and gives them: the request bodies
(pydantic models: a field of the wrong type or range, or one OpenAI does not define, is a 400 naming
it), the settings they become, and the JSON of the answers and of their streamed chunks."""

from __future__ import annotations

import secrets
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from megaloop.generation.generator import Completion
from megaloop.serving.requests import RequestError

FINISH = {"stop": "stop", "length": "length", "cancelled": "abort", "error": "abort"}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Common(BaseModel):
    """The fields both endpoints take. Fields OpenAI defines that megaloop does not implement are
    accepted only at their neutral value (``refuse_unsupported``)."""

    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)  # (not OpenAI's: vLLM's and megaloop's extensions)
    min_p: float | None = Field(None, ge=0, le=1)
    n: int = Field(1, ge=1, le=16)
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def refuse_unsupported(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise RequestError(f"{name} is not supported by megaloop serve yet: leave it out or 0", name)
        if self.logit_bias:
            raise RequestError("logit_bias is not supported by megaloop serve yet", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options needs stream: true", "stream_options")

    def settings(self, max_tokens: int, index: int) -> dict[str, Any]:
        """The engine's settings for choice ``index``: OpenAI's defaults (temperature 1), a random seed
        where none is given, choice i of a seeded request seeded seed + i (the choices differ)."""
        seed = self.seed + index if self.seed is not None else secrets.randbits(63)
        if seed >= 2**63:
            seed -= 2**64
        return {
            "max_tokens": max_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": self.top_k or 0,
            "min_p": self.min_p or 0.0,
            "seed": seed,
            "stop": [self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            "stop_token_ids": list(self.stop_token_ids or []),
        }


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.logprobs is not None:
            raise RequestError("logprobs is not supported by megaloop serve yet", "logprobs")
        if self.best_of not in (None, 1, self.n):
            raise RequestError("best_of other than n is not supported by megaloop serve", "best_of")
        if self.suffix:
            raise RequestError("suffix is not supported by megaloop serve", "suffix")

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]  # type: ignore[list-item]
        if not p:
            raise RequestError("prompt is empty: give a string, token ids, or a list of either", "prompt")
        return list(p)  # type: ignore[arg-type]


class ChatRequest(_Common):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.logprobs or self.top_logprobs:
            raise RequestError("logprobs is not supported by megaloop serve yet", "logprobs")
        if self.tools:
            raise RequestError("tools are not supported by megaloop serve yet", "tools")
        if self.tool_choice not in (None, "none", "auto"):
            raise RequestError("tool_choice needs tools, which megaloop serve does not support yet", "tool_choice")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            raise RequestError("only the text response_format is supported", "response_format")

    def conversation(self) -> list[dict[str, Any]]:
        """The messages as the chat template takes them: content parts of type text joined."""
        out = []
        for i, m in enumerate(self.messages):
            if not isinstance(m.get("role"), str):
                raise RequestError(f"messages[{i}] needs a role (a string)", f"messages.{i}.role")
            content = m.get("content")
            if isinstance(content, list):
                texts = []
                for j, part in enumerate(content):
                    is_text = isinstance(part, dict) and part.get("type") == "text"
                    if not is_text or not isinstance(part.get("text"), str):
                        raise RequestError(
                            f"messages[{i}].content[{j}]: only text parts are supported", f"messages.{i}.content"
                        )
                    texts.append(part["text"])
                content = "".join(texts)
            elif content is not None and not isinstance(content, str):
                raise RequestError(f"messages[{i}].content must be a string or a list of text parts",
                                   f"messages.{i}.content")  # fmt: skip
            out.append({**m, "content": content})
        return out

    def max_new(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


# ---- answers ----------------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_body(rid: str, model: str, choices: list[tuple[str, Completion]], prompt_tokens: int) -> dict:
    """The answer of /v1/completions: a choice per (text, completion)."""
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": i, "text": text, "logprobs": None, "finish_reason": FINISH[c.finish_reason]}
            for i, (text, c) in enumerate(choices)
        ],
        "usage": usage(prompt_tokens, sum(len(c.tokens) for _, c in choices)),
    }


def chat_body(rid: str, model: str, choices: list[Completion], prompt_tokens: int) -> dict:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": i,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": None,
                "finish_reason": FINISH[c.finish_reason],
            }
            for i, c in enumerate(choices)
        ],
        "usage": usage(prompt_tokens, sum(len(c.tokens) for c in choices)),
    }


def chunk(kind: Literal["text_completion", "chat.completion.chunk"], rid: str, model: str, created: int,
          choice: dict | None, usage_: dict | None = None) -> dict:  # fmt: skip
    """One streamed chunk: a choice's delta (None: the usage chunk, with no choices)."""
    body: dict[str, Any] = {"id": rid, "object": kind, "created": created, "model": model}
    body["choices"] = [choice] if choice is not None else []
    if usage_ is not None:
        body["usage"] = usage_
    return body


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}

"""The host's side of a batch's sequences as their tokens come back from the generator: each cut at an
end-of-sequence token, at a stop string, at its max_new_tokens or at an interruption; its text streamed;
its log-probabilities collected. The results: ``Completion``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from megaloop.models.tokenizer import Tokenizer


@dataclass
class TokenLogprob:
    """A generated token's log-probability under the model (log_softmax of its logits, before
    penalties, temperature and truncation) and the ``top`` likeliest tokens' (id, log-probability),
    likeliest first (ties: the lower id first)."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Completion:
    """One sequence's result: its prompt's token ids, the generated ids (without the end-of-sequence
    token that stopped it), their text (cut before a stop string), and why it ended: "stop" (an
    end-of-sequence token, or a stop string: ``stop`` says which), "length" (max_new_tokens) or
    "interrupted". ``index``: its prompt's place in the call; ``sample``: which of the prompt's n
    sequences; ``seed``: the seed its draws used (None: greedy); ``logprobs``: one per token, where
    asked for."""

    prompt_tokens: list[int]
    tokens: list[int]
    text: str
    finish_reason: str
    index: int = 0
    sample: int = 0
    stop: str | int | None = None
    seed: int | None = None
    logprobs: list[TokenLogprob] | None = None


class StopMatcher:
    """Text in, text out, holding back what could still become one of ``stops`` (the longest end of the
    text that is the start of one); ``stopped``: the stop string found, after which nothing more comes
    out (the text out ends where it began)."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.pending = ""
        self.stopped: str | None = None

    def push(self, text: str) -> str:
        if self.stopped is not None:
            return ""
        buf = self.pending + text
        found = [(i, s) for s in self.stops if (i := buf.find(s)) >= 0]
        if found:
            at, self.stopped = min(found)
            self.pending = ""
            return buf[:at]
        keep = max((k for s in self.stops for k in range(min(len(s) - 1, len(buf)), 0, -1) if buf.endswith(s[:k])),
                   default=0)  # fmt: skip
        self.pending = buf[len(buf) - keep :]
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        rest, self.pending = self.pending, ""
        return "" if self.stopped is not None else rest


class Sequences:
    """The batch's tokens as they come. ``new[b]``: sequence b's max_new_tokens; ``stops[b]`` its stop
    strings; ``logprobs[b]``: collect its log-probabilities (None: no)."""

    def __init__(
        self,
        prompts: list[list[int]],
        new: Sequence[int],
        eos: Sequence[int],
        tokenizer: Tokenizer | None,
        on_text: Callable[[int, str], None] | None,
        stops: Sequence[Sequence[str]] | None = None,
        logprobs: Sequence[int | None] | None = None,
    ) -> None:
        self.prompts, self.new, self.eos = prompts, list(new), set(eos)
        count = len(prompts)
        self.tokens: list[list[int]] = [[] for _ in prompts]
        self.reason: list[str | None] = [None] * count
        self.stop: list[str | int | None] = [None] * count
        self.streams = [tokenizer.stream() for _ in prompts] if tokenizer is not None else None
        self.matchers = [StopMatcher(s) for s in (stops or [()] * count)]
        self.texts = [""] * count
        self.want_logprobs = list(logprobs or [None] * count)
        self.logprobs: list[list[TokenLogprob]] = [[] for _ in prompts]
        self.tokenizer, self.on_text = tokenizer, on_text

    def done(self) -> bool:
        return all(r is not None for r in self.reason)

    def steps_left(self) -> int:
        return max(n - len(t) for n, t, r in zip(self.new, self.tokens, self.reason) if r is None)

    def add(self, produced: np.ndarray, counts: np.ndarray, entries: np.ndarray | None = None) -> None:
        """Sequence b's next ``counts[b]`` tokens, ``produced[b, :counts[b]]``; ``entries[b, k]``: the
        logprobs record of token k (the generator's layout: chosen, then (id, logprob) pairs)."""
        for b, row in enumerate(produced):
            for k, token in enumerate(row[: counts[b]]):
                if self.reason[b] is not None:
                    break
                token = int(token)
                if token in self.eos:
                    self.reason[b], self.stop[b] = "stop", token
                    break
                self.tokens[b].append(token)
                if self.want_logprobs[b] is not None and entries is not None:
                    self.logprobs[b].append(_entry(token, entries[b, k], self.want_logprobs[b]))
                if self.streams is not None:
                    self._emit(b, self.streams[b].push(token))
                if self.reason[b] is None and len(self.tokens[b]) >= self.new[b]:
                    self.reason[b] = "length"

    def _emit(self, b: int, piece: str) -> None:
        text = self.matchers[b].push(piece)
        if self.matchers[b].stopped is not None and self.reason[b] in (None, "length"):
            self.reason[b], self.stop[b] = "stop", self.matchers[b].stopped
        if text:
            self.texts[b] += text
            if self.on_text is not None:
                self.on_text(b, text)

    def add_history(self, history: dict[str, np.ndarray], lengths: list[int]) -> None:
        """After generator iterations: sequence b has made generated[b, L_b:position_b] and then
        ``token`` (the next one it would feed), of which the tokens not seen yet are new; the token at
        position q has its logprobs record at q - 1."""
        generated = history["generated"][:, 0, :, 0].astype(np.int64)
        position, token = history["position"][:, 0].astype(np.int64), history["token"][:, 0].astype(np.int64)
        records = history.get("logprobs")
        rows, counts, entries = [], [], []
        for b, n in enumerate(lengths):
            if self.reason[b] is not None:  # (ended on the host: a stop string; the kernel may go on)
                rows.append([])
                counts.append(0)
                entries.append(np.zeros((0, 1 if records is None else records.shape[-1]), np.float32))
                continue
            made = [*generated[b, n : position[b]].tolist(), int(token[b])]
            seen = len(self.tokens[b]) + (self.reason[b] == "stop")
            rows.append(made[seen:])
            counts.append(len(made) - seen)
            if records is not None:
                entries.append(records[b, 0, n + seen - 1 : n + len(made) - 1])
        width = max(max(counts), 1)
        padded = np.array([r + [0] * (width - len(r)) for r in rows], np.int64)
        table = None
        if records is not None:
            table = np.zeros((len(rows), width, records.shape[-1]), np.float32)
            for b, e in enumerate(entries):
                table[b, : len(e)] = e
        self.add(padded, np.array(counts), table)

    def finish(self, interrupted: bool = False) -> list[Completion]:
        """The completions; the streams' last text (and what the stop matchers held back) goes out first."""
        out = []
        for b, prompt in enumerate(self.prompts):
            if self.streams is not None:
                if self.matchers[b].stopped is None:
                    self._emit(b, self.streams[b].flush())
                rest = self.matchers[b].flush()
                if rest:
                    self._emit_rest(b, rest)
            reason = self.reason[b] or ("interrupted" if interrupted else "length")
            logprobs = self.logprobs[b] if self.want_logprobs[b] is not None else None
            out.append(Completion(list(prompt), self.tokens[b], self.texts[b], reason, stop=self.stop[b],
                                  logprobs=logprobs))  # fmt: skip
        return out

    def _emit_rest(self, b: int, text: str) -> None:
        self.texts[b] += text
        if self.on_text is not None:
            self.on_text(b, text)


def _entry(token: int, record: np.ndarray, top: int) -> TokenLogprob:
    """A TokenLogprob from the generator's record (chosen, id_1, logprob_1, ...), its first ``top`` pairs."""
    pairs = [(int(record[1 + 2 * k]), float(record[2 + 2 * k])) for k in range(top)]
    return TokenLogprob(token, float(record[0]), pairs)


def host_logprobs(logits: np.ndarray, chosen: np.ndarray, top: int) -> np.ndarray:
    """The generator's logprobs records for rows of logits [rows, vocab] and their chosen tokens [rows],
    on the host (the first token's, from the prefill): log_softmax as the op's reference computes it,
    the top ``top`` by repeated argmax (ties: the lower id)."""
    from megaloop.frontend.ops.normalization import LOG_SOFTMAX

    lp = LOG_SOFTMAX.reference([np.asarray(logits, np.float32)], {"axis": -1}).astype(np.float32)
    rows = np.arange(lp.shape[0])
    out = np.zeros((lp.shape[0], 1 + 2 * top), np.float32)
    out[:, 0] = lp[rows, chosen]
    searched = lp.copy()
    for k in range(top):
        best = np.argmax(searched, axis=-1)
        out[:, 1 + 2 * k], out[:, 2 + 2 * k] = best, lp[rows, best]
        searched[rows, best] = -np.inf
    return out

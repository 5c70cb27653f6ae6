"""The self-feeding generator's choice of the next token from a step's logits (build_llama_generator):
the penalties, greedy or sampled, and the log-probabilities recorded, all graph ops of the loop kernel
with their per-sequence settings in states (the host writes them once, before the first iteration).

- ``penalties``: the logits go through ``ml.penalize`` first (transformers' repetition penalty, OpenAI's
  presence and frequency penalties, greedy or sampled alike). States: ``token_counts`` int32
  [batch, 1, vocab] (how often each token was generated: the generator adds the token it feeds each
  iteration, so the first one, from the prefill, counts too), ``prompt_tokens`` bool [batch, 1, vocab]
  (the prompt's tokens, for the repetition penalty), ``repetition_penalty`` (initially 1),
  ``presence_penalty`` and ``frequency_penalty`` (initially 0) float32 [batch, 1].
- ``sampling``: ``ml.sample`` with the states ``temperature``, ``top_k``, ``top_p``, ``min_p`` and
  ``seed`` [batch, 1] (the offset is the position of the logits' token); else the argmax.
- ``logprobs`` N (None: off): each step records, where it writes ``generated``, the chosen token's
  log-probability and the N likeliest tokens with theirs, in ``logprobs`` float32 [batch, 1, max_seq,
  1 + 2N]: (chosen, id_1, logprob_1, ..., id_N, logprob_N), ids as floats (exact below 2^24), the top
  ones in order (ties: the lower id first). The entry at position p is about the token that goes at
  p + 1. The log-probabilities are the model's: log_softmax of its logits, before penalties,
  temperature and truncation (as OpenAI's API and vLLM report them).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import megaloop.frontend.ops as ops
from megaloop.errors import GraphBuildError
from megaloop.frontend.graph import Graph
from megaloop.frontend.tensor import Tensor

MAX_LOGPROBS = 20  # top log-probabilities a step records, at most (OpenAI's limit)


@dataclass(frozen=True)
class Decoding:
    """What the generator does with a step's logits besides picking the next token: ``penalties``
    (ml.penalize before the choice) and ``logprobs`` (None, or N: the chosen token's and the top N
    log-probabilities recorded each step)."""

    penalties: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        n = self.logprobs
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_LOGPROBS):
            raise GraphBuildError(f"Decoding: logprobs must be None or an int in [0, {MAX_LOGPROBS}], got {n!r}")


PLAIN = Decoding()  # no penalties, no log-probabilities


def next_token(
    g: Graph,
    logits: Tensor,
    token: Tensor,
    position: Tensor,
    active: Tensor,
    written: Tensor,
    splits: int | None,
    sampling: bool,
    decoding: Decoding,
) -> Tensor:
    """The next token of each sequence, int64 [batch, 1], from ``logits`` [batch, 1, vocab] of the
    ``token`` fed at ``position`` (``active``: the sequence still generates; ``written``: where this
    step writes its history, -1 for none)."""
    batch, _, vocab = logits.shape
    scores = logits
    vocab_ids = None
    if decoding.penalties:
        vocab_ids = g.constant(np.arange(vocab, dtype=np.int64), name="vocab_ids")
        scores = _penalized(g, logits, token, active, vocab_ids)
    if sampling:
        chosen = _sampled_token(g, batch, scores, position, splits)
    else:
        chosen = ops.argmax(scores, axis=-1, splits=splits)
    if decoding.logprobs is not None:
        if vocab_ids is None:
            vocab_ids = g.constant(np.arange(vocab, dtype=np.int64), name="vocab_ids")
        _record_logprobs(g, logits, chosen, written, vocab_ids, decoding.logprobs, splits)
    return chosen


def _penalized(g: Graph, logits: Tensor, token: Tensor, active: Tensor, vocab_ids: Tensor) -> Tensor:
    """The logits through ml.penalize, the fed token counted first (a finished sequence's is not)."""
    batch, _, vocab = logits.shape
    rows = (batch, 1)
    counts = g.state("token_counts", (batch, 1, vocab), "int32")
    prompt = g.state("prompt_tokens", (batch, 1, vocab), "bool")
    repetition = g.state("repetition_penalty", rows, "float32", init=np.ones(rows, np.float32))
    presence = g.state("presence_penalty", rows, "float32")
    frequency = g.state("frequency_penalty", rows, "float32")
    fed = ops.where(active, token, -1).reshape(batch, 1, 1)
    counted = counts + ops.equal(vocab_ids, fed).astype("int32")
    g.assign(counts, counted)
    return ops.penalize(logits, counted, prompt, repetition, presence, frequency)


def _sampled_token(g: Graph, batch: int, logits: Tensor, position: Tensor, splits: int | None) -> Tensor:
    """The next token drawn by ``ml.sample`` (in ``splits`` ranges of the vocabulary) from the per-sequence
    sampling states: int64 [batch, 1]."""
    rows = (batch, 1)
    temperature = g.state("temperature", rows, "float32", init=np.ones(rows, np.float32))
    top_k = g.state("top_k", rows, "int64")
    top_p = g.state("top_p", rows, "float32", init=np.ones(rows, np.float32))
    min_p = g.state("min_p", rows, "float32")
    seed = g.state("seed", rows, "int64", init=np.arange(batch, dtype=np.int64)[:, None])  # rows apart
    return ops.sample(logits, seed, position, temperature, top_k, top_p, min_p, splits=splits)


def _record_logprobs(
    g: Graph, logits: Tensor, chosen: Tensor, written: Tensor, vocab_ids: Tensor, top: int, splits: int | None
) -> None:
    """The chosen token's log-probability and the ``top`` likeliest tokens' into the ``logprobs`` history
    at ``written``: the top ones one argmax at a time, each found one masked out of the next search."""
    batch, _, vocab = logits.shape
    max_seq = g.states["generated"].shape[2]
    history = g.state("logprobs", (batch, 1, max_seq, 1 + 2 * top), "float32")
    logprobs = ops.log_softmax(logits.astype("float32"), -1)
    table = logprobs.reshape(batch * vocab, 1)  # each row's values looked up by row * vocab + id
    row_start = g.constant(np.arange(batch, dtype=np.int64)[:, None] * vocab, name="logprob_rows")
    parts = [ops.embedding(table, chosen + row_start)]
    searched = logprobs
    gone = g.constant(-np.inf, "float32", name="masked_out", allow_nonfinite=True)
    for k in range(top):
        best = ops.argmax(searched, axis=-1, splits=splits)
        parts += [best.astype("float32").reshape(batch, 1, 1), ops.embedding(table, best + row_start)]
        if k + 1 < top:
            searched = ops.where(ops.equal(vocab_ids, best.reshape(batch, 1, 1)), gone, searched)
    record = ops.concat(parts, -1).reshape(batch, 1, 1, 1 + 2 * top)
    ops.kv_cache_update(history, record, written, ignore_negative=True)

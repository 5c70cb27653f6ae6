"""The serving step: one iteration advances every active slot of a fixed table of sequence slots by
its next rows (a chunk of its prompt, or the token it made last), over a paged KV cache, and makes
each slot's next token where its rows reached the end of what it knows (docs/serving.md).

The step has no inputs: the host admits a request by writing its slot's rows of the states between
runs, so that ``run(iterations=n)`` runs n steps with no host work between them. States (S slots,
L positions, M pages a slot, N pages):

- ``sequence`` int64 [S, L]: each slot's token ids, prompt then completion;
- ``length``, ``cursor``, ``limit`` int64 [S, 1]: tokens known, tokens in the cache, the length at
  which the slot stops (an end-of-sequence token lowers it to the length; 0: a free slot);
- ``temperature`` float32, ``top_k`` int64, ``top_p`` float32, ``min_p`` float32, ``seed`` int64
  [S, 1]: sampling (``ml.sample``'s parameters);
- ``page_table`` int64 [S, M]; per layer ``model.layers.{i}.self_attn.k_pool`` and ``v_pool``
  [N, kv_heads, page_size, head_dim].

Output: ``tokens`` int64 [S, 1], the token each slot drew in the last step (meaningful where it
made one).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

import megaloop.frontend.ops as ops
from megaloop.errors import GraphBuildError
from megaloop.frontend.graph import Graph
from megaloop.frontend.tensor import Tensor
from megaloop.models.llama import LlamaConfig, auto_argmax_splits, mlp_block

SLOT_STATES = ("sequence", "length", "cursor", "limit", "temperature", "top_k", "top_p", "min_p", "seed", "page_table")
PROGRESS = ("length", "cursor", "limit", "sequence")  # what the host reads after each run


@dataclass(frozen=True)
class StepShape:
    """The sizes fixed when the engine starts: ``slots`` (S), ``chunk`` (C, prompt tokens a slot feeds
    in one step at most), ``page_size`` (P), ``pages`` (N, in the pool), ``max_seq`` (L)."""

    slots: int
    chunk: int
    page_size: int
    pages: int
    max_seq: int

    def __post_init__(self) -> None:
        for name in ("slots", "chunk", "page_size", "pages", "max_seq"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise GraphBuildError(f"StepShape: {name} must be an int >= 1, got {value!r}")

    @property
    def rows(self) -> int:
        """Token rows of a step: every other slot decoding leaves a whole chunk for one prompt."""
        return self.slots + self.chunk - 1

    @property
    def pages_per_slot(self) -> int:
        return -(-self.max_seq // self.page_size)


@dataclass(frozen=True)
class Rows:
    """Where the step's T rows go: ``slots`` and ``positions`` int64 [1, T] (-1: an unused row),
    and per slot its rows' ``count`` and the ``last`` of them, int64 [S, 1]."""

    slots: Tensor
    positions: Tensor
    count: Tensor
    last: Tensor


def build_serving_step(cfg: LlamaConfig, shape: StepShape, eos_ids: Sequence[int] = (), name: str = "llama-serve",
                       logits: bool = False, decode_rows: int | None = None) -> Graph:  # fmt: skip
    """The step graph of ``cfg``'s model for ``shape`` (module docstring); ``eos_ids``: the tokens that
    end a sequence; ``logits``: also output each slot's last row's logits [S, 1, vocab].
    ``decode_rows`` R: the decode-only step instead, R rows for the first R slots that want one row
    (decoding, or a prompt's last token), in slot order; slots with more to feed wait."""
    _check_model(cfg, shape)
    eos = sorted({int(i) for i in eos_ids})
    if any(not 0 <= i < cfg.vocab for i in eos):
        raise GraphBuildError(f"build_serving_step: eos_ids {eos} must be token ids in [0, {cfg.vocab})")
    if decode_rows is not None and (isinstance(decode_rows, bool) or not isinstance(decode_rows, int)
                                    or not 1 <= decode_rows <= shape.slots):  # fmt: skip
        raise GraphBuildError(
            f"build_serving_step: decode_rows must be an int in [1, {shape.slots}], got {decode_rows!r}"
        )
    g = Graph(name)
    s, n = shape.slots, shape.max_seq
    col = (s, 1)
    length, cursor, limit = (g.state(k, col, "int64") for k in ("length", "cursor", "limit"))
    sequence = g.state("sequence", (s, n), "int64")
    table = g.state("page_table", (s, shape.pages_per_slot), "int64", init=np.full((s, shape.pages_per_slot), -1))
    with g.scope("rows"):
        if decode_rows is None:
            rows = _rows(g, shape, length, cursor, limit)
        else:
            rows = _decode_rows(g, shape, length, cursor, limit, decode_rows)
        ids = _row_tokens(sequence, rows, shape)
    hidden = _decoder(g, cfg, shape, ids, rows, table)
    t = rows.slots.shape[1]
    if decode_rows is None:
        with g.scope("head"):
            picked = ops.embedding(hidden.reshape(t, cfg.hidden), rows.last.reshape(s)).reshape(s, 1, cfg.hidden)
            scores = _head(g, cfg, picked)
        with g.scope("next"):
            token = _next_token(g, cfg, shape, scores, ops.maximum(cursor + rows.count - 1, 0))
    else:  # the head and the draw on the R rows, each with its slot's settings; then each slot's row's token
        with g.scope("head"):
            row_scores = _head(g, cfg, hidden.reshape(t, 1, cfg.hidden))
        with g.scope("next"):
            drawn = _next_token(g, cfg, shape, row_scores, ops.maximum(rows.positions, 0).reshape(t, 1),
                                rows.slots.reshape(t))  # fmt: skip
            token = ops.embedding(drawn, rows.last.reshape(s)).reshape(col)
            scores = ops.embedding(row_scores.reshape(t, cfg.vocab), rows.last.reshape(s)).reshape(s, 1, cfg.vocab)
    with g.scope("next"):
        _advance(g, shape, sequence, length, cursor, limit, rows, token, eos)
    g.output("tokens", token)
    if logits:
        g.output("logits", scores)
    return g


def decode_buckets(slots: int) -> tuple[int, ...]:
    """The decode-only steps' row counts an engine of ``slots`` slots builds: powers of two, then S."""
    out = []
    r = 1
    while r < slots:
        out.append(r)
        r *= 2
    return (*out, slots)


def build_serving_programs(cfg: LlamaConfig, shape: StepShape, eos_ids: Sequence[int] = (),
                           buckets: Sequence[int] = (), logits: bool = False) -> dict[str, Graph]:  # fmt: skip
    """The engine's programs over one set of states: "mixed" (the step of T rows), then "decode_R" for
    each R of ``buckets`` (the decode-only step of R rows), ascending."""
    out = {"mixed": build_serving_step(cfg, shape, eos_ids, "llama-serve", logits)}
    for r in sorted(set(buckets)):
        out[f"decode_{r}"] = build_serving_step(cfg, shape, eos_ids, f"llama-serve-decode-{r}", logits, r)
    return out


def _check_model(cfg: LlamaConfig, shape: StepShape) -> None:
    if not isinstance(cfg, LlamaConfig) or cfg.vocab is None:
        raise GraphBuildError("build_serving_step: cfg must be a LlamaConfig with a vocabulary (cfg.vocab)")
    longrope = cfg.rope_scaling is not None and cfg.rope_scaling["type"] == "longrope"
    if cfg.later_variants() or longrope:
        names = cfg.later_variants() + (["rope_scaling (longrope)"] if longrope else [])
        raise GraphBuildError(
            f"build_serving_step: the serving step builds the Llama, Mistral and Qwen layers; this model's {names} "
            "(Gemma 2/3, Phi-3, OLMo 2) are not part of it yet. Run the model with megaloop generate"
        )
    if shape.max_seq > cfg.max_seq:
        raise GraphBuildError(
            f"build_serving_step: max_seq {shape.max_seq} is past the model's context {cfg.max_seq} (cfg.max_seq)"
        )


def _rows(g: Graph, shape: StepShape, length: Tensor, cursor: Tensor, limit: Tensor) -> Rows:
    """Each active slot's rows this step: slots wanting one row (decoding, or a prompt's last token)
    first, one row each in slot order; then the prompts' chunks in slot order, cut to the rows left.
    Prefix sums over the slots are sums of products with a constant triangle (exact in int64)."""
    s, t = shape.slots, shape.rows
    active = ops.less(length, limit)
    want = ops.where(active, ops.minimum(length - cursor, shape.chunk), 0)  # [S, 1]
    single = ops.equal(want, 1)
    one = single.astype("int64")
    chunk = ops.where(single, 0, want)
    before = g.constant(np.tri(s, s, -1, dtype=np.int64).T, "int64", name="slots_before")  # [i, j]: i < j
    singles_before = ops.sum(one * before, 0, keepdims=True)  # [1, S]
    chunks_before = ops.sum(chunk * before, 0, keepdims=True)
    singles = ops.sum(one, 0, keepdims=True)  # [1, 1]
    fitted = ops.minimum(ops.maximum((t - singles) - chunks_before, 0), chunk.reshape(1, s))
    count = one.reshape(1, s) + fitted  # [1, S]
    start = ops.where(single.reshape(1, s), singles_before, singles + chunks_before)
    r = g.constant(np.arange(t, dtype=np.int64).reshape(t, 1), "int64", name="row_index")
    hit = ops.logical_and(ops.greater_equal(r, start), ops.less(r, start + count)).astype("int64")  # [T, S]
    used = ops.sum(hit, 1, keepdims=True)  # [T, 1]: 0 or 1
    slot_ids = g.constant(np.arange(s, dtype=np.int64).reshape(1, s), "int64", name="slot_index")
    row_slot = ops.sum(hit * slot_ids, 1, keepdims=True)
    row_offset = r - ops.sum(hit * start, 1, keepdims=True)
    row_cursor = ops.sum(hit * cursor.reshape(1, s), 1, keepdims=True)
    position = ops.where(ops.equal(used, 1), row_cursor + row_offset, -1)
    last = ops.where(ops.greater(count, 0), start + count - 1, 0)  # (a slot without rows: row 0, never used)
    return Rows(row_slot.reshape(1, t), position.reshape(1, t), count.reshape(s, 1), last.reshape(s, 1))


def _decode_rows(g: Graph, shape: StepShape, length: Tensor, cursor: Tensor, limit: Tensor, r: int) -> Rows:
    """Row i to the i-th slot that wants one row (decoding, or a prompt's last token), in slot order,
    for the first ``r`` of them; the other slots get no row (the host runs this step only when every
    active slot wants one row and at most ``r`` are active). The same prefix sum as ``_rows``."""
    s = shape.slots
    single = ops.logical_and(ops.less(length, limit), ops.equal(length - cursor, 1))  # [S, 1]
    before = g.constant(np.tri(s, s, -1, dtype=np.int64).T, "int64", name="slots_before")  # [i, j]: i < j
    rank = ops.sum(single.astype("int64") * before, 0, keepdims=True)  # [1, S]: its row, if it takes one
    takes = ops.logical_and(single.reshape(1, s), ops.less(rank, r))  # [1, S]
    index = g.constant(np.arange(r, dtype=np.int64).reshape(r, 1), "int64", name="row_index")
    hit = ops.logical_and(ops.equal(index, rank), takes).astype("int64")  # [R, S]
    used = ops.sum(hit, 1, keepdims=True)  # [R, 1]: 0 or 1
    slot_ids = g.constant(np.arange(s, dtype=np.int64).reshape(1, s), "int64", name="slot_index")
    row_slot = ops.sum(hit * slot_ids, 1, keepdims=True)
    row_cursor = ops.sum(hit * cursor.reshape(1, s), 1, keepdims=True)
    position = ops.where(ops.equal(used, 1), row_cursor, -1)
    last = ops.where(takes, rank, 0)  # (a slot without a row: row 0, never used)
    count = takes.astype("int64")
    return Rows(row_slot.reshape(1, r), position.reshape(1, r), count.reshape(s, 1), last.reshape(s, 1))


def _row_tokens(sequence: Tensor, rows: Rows, shape: StepShape) -> Tensor:
    """Row r's token: ``sequence[slot_r, position_r]``, a lookup in the sequences seen as one table."""
    s, n, t = shape.slots, shape.max_seq, rows.slots.shape[1]
    where_ = rows.slots * n + ops.maximum(rows.positions, 0)  # [1, T]
    return ops.embedding(sequence.reshape(s * n, 1), where_).reshape(1, t)


def _decoder(g: Graph, cfg: LlamaConfig, shape: StepShape, ids: Tensor, rows: Rows, table: Tensor) -> Tensor:
    """The embedding and the decoder layers on the step's rows: the residual stream [1, T, hidden]."""
    x = ops.embedding(g.parameter("model.embed_tokens.weight", (cfg.vocab, cfg.hidden), cfg.dtype), ids)
    rope_pos = ops.maximum(rows.positions, 0).reshape(1, 1, rows.positions.shape[1])  # (every layer's)
    update = None
    for layer in range(cfg.layers):
        p = f"model.layers.{layer}."
        stream = x
        if update is not None:
            with g.scope(f"layers.{layer - 1}"), g.scope("mlp"):
                stream = x + update
        with g.scope(f"layers.{layer}"):
            ln1 = g.parameter(p + "input_layernorm.weight", (cfg.hidden,), cfg.dtype)
            ln2 = g.parameter(p + "post_attention_layernorm.weight", (cfg.hidden,), cfg.dtype)
            with g.scope("attn"):
                normed = ops.rmsnorm(stream, ln1, eps=cfg.rms_eps)
                h = stream + _paged_attention_block(g, cfg, shape, normed, rows, table, rope_pos, layer)
            with g.scope("mlp"):
                x, update = h, mlp_block(g, cfg, ops.rmsnorm(h, ln2, eps=cfg.rms_eps), layer)
    return x if update is None else x + update


def _paged_attention_block(g: Graph, cfg: LlamaConfig, shape: StepShape, x: Tensor, rows: Rows, table: Tensor,
                           rope_pos: Tensor, layer: int) -> Tensor:  # fmt: skip
    """The Llama attention block (q/k/v projections, Qwen3's q/k norms, rope at each row's position:
    ``rope_pos`` [1, 1, T], unused rows at 0) with the keys and values written into, and read from, the
    layer's paged pools."""
    t, hd, p = rows.slots.shape[1], cfg.head_dim, f"model.layers.{layer}.self_attn."
    w = {name: g.parameter(p + name, s, cfg.dtype) for name, s in cfg.attention_shapes().items()}

    def heads(n: str, count: int) -> Tensor:  # [1, T, count * hd] -> [1, count, T, hd] (a view)
        y = ops.linear(x, w[f"{n}_proj.weight"], w.get(f"{n}_proj.bias")).reshape(1, t, count, hd)
        if f"{n}_norm.weight" in w:
            y = ops.rmsnorm(y, w[f"{n}_norm.weight"], eps=cfg.rms_eps)
        return y.transpose(1, 2)

    rope_args = {"theta": cfg.rope_theta, "scaling": cfg.rope_scaling}
    q = ops.rope(heads("q", cfg.heads), rope_pos, **rope_args)
    k = ops.rope(heads("k", cfg.kv_heads), rope_pos, **rope_args)
    v = heads("v", cfg.kv_heads)
    pool = (shape.pages, cfg.kv_heads, shape.page_size, hd)
    k_all = ops.paged_kv_cache_update(g.state(p + "k_pool", pool, cfg.dtype), k, table, rows.slots, rows.positions)
    v_all = ops.paged_kv_cache_update(g.state(p + "v_pool", pool, cfg.dtype), v, table, rows.slots, rows.positions)
    o = ops.paged_attention(q, k_all, v_all, table, rows.slots, rows.positions, window=cfg.window(layer))
    o = o.transpose(1, 2).reshape(1, t, cfg.heads * hd)
    return ops.linear(o, w["o_proj.weight"], w.get("o_proj.bias"))


def _head(g: Graph, cfg: LlamaConfig, x: Tensor) -> Tensor:
    """The final norm and the LM head (the embedding when tied): logits [S, 1, vocab]."""
    normed = ops.rmsnorm(x, g.parameter("model.norm.weight", (cfg.hidden,), cfg.dtype), eps=cfg.rms_eps)
    if cfg.tie_word_embeddings:
        return ops.linear(normed, g.parameters["model.embed_tokens.weight"])
    return ops.linear(normed, g.parameter("lm_head.weight", (cfg.vocab, cfg.hidden), cfg.dtype))


def _next_token(g: Graph, cfg: LlamaConfig, shape: StepShape, logits: Tensor, offset: Tensor,
                row_slots: Tensor | None = None) -> Tensor:  # fmt: skip
    """Each slot's draw from its last row's logits (``ml.sample``: temperature 0 is the argmax), at
    ``offset`` (that row's position), as the generator draws: int64 [S, 1]. ``row_slots`` [R]: the
    logits are R rows instead, each drawn with its slot's settings: int64 [R, 1]."""
    col = (shape.slots, 1)
    temperature = g.state("temperature", col, "float32", init=np.ones(col, np.float32))
    top_k = g.state("top_k", col, "int64")
    top_p = g.state("top_p", col, "float32", init=np.ones(col, np.float32))
    min_p = g.state("min_p", col, "float32")
    seed = g.state("seed", col, "int64", init=np.arange(shape.slots, dtype=np.int64).reshape(col))
    settings = [seed, temperature, top_k, top_p, min_p]
    if row_slots is not None:
        settings = [ops.embedding(x, row_slots) for x in settings]
    seed, temperature, top_k, top_p, min_p = settings
    splits = auto_argmax_splits(cfg)
    out = ops.sample(logits, seed, offset, temperature, top_k, top_p, min_p, splits=splits)
    return out.reshape(logits.shape[0], 1)


def _advance(g: Graph, shape: StepShape, sequence: Tensor, length: Tensor, cursor: Tensor, limit: Tensor,
             rows: Rows, token: Tensor, eos: list[int]) -> None:  # fmt: skip
    """A slot whose rows reached its length made ``token``: written at sequence[length], length + 1;
    an end-of-sequence token also sets the limit there. The cursor moves past the rows fed."""
    made = ops.logical_and(ops.less(length, limit), ops.equal(cursor + rows.count, length))
    at = g.constant(np.arange(shape.max_seq, dtype=np.int64).reshape(1, shape.max_seq), "int64", name="positions")
    g.assign(sequence, ops.where(ops.equal(at, ops.where(made, length, -1)), token, sequence))
    grown = length + made.astype("int64")
    if eos:
        hits = ops.equal(token, g.constant(np.array(eos, np.int64), name="eos_ids"))  # [S, E]
        ended = ops.logical_and(made, ops.greater(ops.sum(hits.astype("int64"), -1, keepdims=True), 0))
        g.assign(limit, ops.where(ended, grown, limit))
    g.assign(length, grown)
    g.assign(cursor, cursor + rows.count)


def pages_needed(positions: int, page_size: int) -> int:
    """Pages that hold ``positions`` positions."""
    return math.ceil(positions / page_size)

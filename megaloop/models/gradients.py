"""A Llama-family model's loss and its gradients as one graph (the training step before the optimizer).

The forward is ``build_llama``'s (its parameters named as the checkpoint's keys), on every position of
``tokens`` tokens a sequence; the loss is the mean cross-entropy of the next tokens (``targets``, with
``ignore_index`` for padding); ``megaloop.grad`` adds the backward. The KV caches the forward writes are
not read back between steps: each step is a whole sequence, attention's keys are its own.
"""

from __future__ import annotations

import numpy as np

import megaloop.frontend.ops as ops
from megaloop.errors import GraphBuildError
from megaloop.frontend.autodiff import grad
from megaloop.frontend.graph import Graph
from megaloop.frontend.tensor import Tensor
from megaloop.frontend.validate import as_int
from megaloop.models.llama import LlamaConfig, _model


def build_llama_gradients(
    cfg: LlamaConfig, batch: int, tokens: int, name: str = "llama-gradients", *, ignore_index: int = -100
) -> Graph:
    """Inputs: ``tokens`` and ``targets``, int64 [batch, tokens] (targets[b, i] the token after
    tokens[b, i], or ignore_index). Outputs: ``loss`` (float32 []), ``logits`` and ``grad.<parameter
    name>`` for every parameter, each of its parameter's shape and dtype."""
    if not isinstance(cfg, LlamaConfig) or cfg.vocab is None:
        raise GraphBuildError("build_llama_gradients: cfg must be a LlamaConfig with a vocabulary (cfg.vocab)")
    batch = as_int(batch, "build_llama_gradients: batch", minimum=1)
    tokens = as_int(tokens, "build_llama_gradients: tokens", minimum=1)
    if tokens > cfg.max_seq:
        raise GraphBuildError(f"build_llama_gradients: {tokens} tokens do not fit max_seq={cfg.max_seq}")
    g = Graph(name)
    ids = g.input("tokens", (batch, tokens), "int64")
    targets = g.input("targets", (batch, tokens), "int64")
    loss, logits = llama_loss(g, cfg, ids, targets, ignore_index=ignore_index)
    g.output("loss", loss)
    g.output("logits", logits)
    for key, value in grad(g, loss).items():
        g.output(f"grad.{key}", value)
    return g


def llama_loss(
    g: Graph, cfg: LlamaConfig, ids: Tensor, targets: Tensor, *, ignore_index: int = -100
) -> tuple[Tensor, Tensor]:
    """(the mean cross-entropy, the logits) of the model on ``ids`` [batch, tokens] (int, each row a
    sequence from position 0) against ``targets`` of that shape, built into ``g`` (the parameters
    named as the checkpoint's keys; the KV caches are states of cfg.max_seq positions)."""
    batch, tokens = ids.shape
    positions = g.constant(np.tile(np.arange(tokens, dtype=np.int64), (batch, 1)), "int64", name="positions")
    logits = _model(g, cfg, ids, positions, None)
    with g.scope("loss"):
        return ops.cross_entropy(logits, targets, ignore_index=ignore_index), logits

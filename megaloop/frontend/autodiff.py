"""Reverse-mode automatic differentiation on the graph: ``grad`` adds the backward of a graph to it.

Each op's vector-Jacobian rule lives with its OpDef (``OpDef.vjp``, written with the graph API), so the
backward is an ordinary graph that the planner, the reference, the interpreter and the GPU code
generator already run. The forward values a rule reads (activations, softmax statistics) are the
forward graph's own tensors; attention and the cross-entropy recompute what they need.

Over several ranks (one graph each, built alike), each rank calls ``grad`` on its graph; what is
differentiated is the sum of the ranks' losses (a rank with no loss of its own, a pipeline stage
before the last, passes ``loss=None``). Collectives and transfers always take part in the backward,
with zeros where no gradient reaches them, so the ranks' backward collectives match: all_reduce's
rule is all_reduce, all_gather's is reduce_scatter and back, a recv's is a send back to its source.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from megaloop.errors import DtypeError, GraphBuildError, ShapeError
from megaloop.frontend.graph import Graph, Node
from megaloop.frontend.opdef import VjpCall
from megaloop.frontend.ops import _grad
from megaloop.frontend.ops import elementwise as ew
from megaloop.frontend.ops.layout import copy
from megaloop.frontend.shapes import format_shape
from megaloop.frontend.tensor import Tensor

_EXCHANGES = ("collective", "p2p")


def grad(
    graph: Graph,
    loss: Tensor | None,
    wrt: Sequence[Tensor] | None = None,
    *,
    seed: float | Tensor | None = None,
) -> Any:
    """The gradients of ``loss`` with respect to ``wrt``, as tensors of ``graph`` (the backward is
    added to it). ``wrt``: a list of tensors (a list of gradients comes back, in that order) or None:
    every float parameter (a dict from parameter names to gradients). ``seed``: the gradient of the
    loss itself (default 1; a number, or a tensor of the loss's shape: needed for a non-scalar loss).
    A gradient has its tensor's shape and dtype; a tensor used more than once sums its gradients."""
    if not isinstance(graph, Graph):
        raise GraphBuildError(f"grad: graph must be a megaloop Graph, got {type(graph).__name__}")
    named = wrt is None
    targets = _targets(graph, wrt)
    cotangents: dict[Tensor, Tensor] = {}
    nodes = list(graph.nodes)  # the forward: the backward's nodes come after
    with graph.scope("grad"):
        if loss is not None:
            cotangents[loss] = _seed(graph, loss, seed)
        elif not any(n.op.kind in _EXCHANGES for n in nodes):
            raise GraphBuildError(
                f"grad: loss is None, but graph {graph.name!r} receives no gradient from another rank "
                "(it has no collective or recv); give the loss tensor"
            )
        live = _depends_on(nodes, targets)
        for node in reversed(nodes):
            _backward_node(node, cotangents, live)
    # (zeros materialised: a result is a tensor of its own, not a view of a one-element constant)
    grads = [cotangents[t] if t in cotangents else copy(_grad.zeros(t)) for t in targets]
    if named:
        return {t.node.attrs["name"]: g for t, g in zip(targets, grads)}
    return grads


def _targets(graph: Graph, wrt: Sequence[Tensor] | None) -> list[Tensor]:
    if wrt is None:
        found = [t for t in graph.parameters.values() if t.dtype.is_float]
        if not found:
            raise GraphBuildError(f"grad: graph {graph.name!r} has no float parameters; pass wrt=[tensors]")
        return found
    if isinstance(wrt, Tensor) or not isinstance(wrt, (list, tuple)):
        raise GraphBuildError(f"grad: wrt must be a list of tensors (or None: every parameter), got {wrt!r:.80}")
    for i, t in enumerate(wrt):
        if not isinstance(t, Tensor) or t.graph is not graph:
            raise GraphBuildError(f"grad: wrt[{i}] ({t!r:.60}) is not a tensor of graph {graph.name!r}")
        if not t.dtype.is_float:
            raise DtypeError(f"grad: wrt[{i}] {t!r} is {t.dtype.name}; only float tensors have gradients")
    return list(wrt)


def _seed(graph: Graph, loss: Tensor, seed: Any) -> Tensor:
    if not isinstance(loss, Tensor) or loss.graph is not graph:
        raise GraphBuildError(f"grad: loss ({loss!r:.60}) is not a tensor of graph {graph.name!r}")
    if not loss.dtype.is_float:
        raise DtypeError(f"grad: loss {loss!r} is {loss.dtype.name}; it must be a float tensor")
    if isinstance(seed, Tensor):
        if seed.graph is not graph or seed.shape != loss.shape or seed.dtype != loss.dtype:
            raise ShapeError(f"grad: seed {seed!r} must be a tensor of graph {graph.name!r} shaped like loss {loss!r}")
        return seed
    if seed is None and loss.size != 1:
        raise ShapeError(
            f"grad: loss {loss!r} has shape {format_shape(loss.shape)}, not one element; reduce it to a "
            "scalar (e.g. megaloop.mean) or pass seed=, the gradient of each of its elements"
        )
    value = 1.0 if seed is None else float(seed)
    return graph.constant(np.full(loss.shape or (1,), value).reshape(loss.shape), loss.dtype, name="grad_seed")


def _depends_on(nodes: list[Node], targets: list[Tensor]) -> set[Tensor]:
    """The float tensors whose values change with the targets' (the only ones gradients flow along); what
    a collective or a recv gives may change with another rank's targets."""
    live = set(targets)
    for n in nodes:
        if any(t in live for t in n.inputs) or (n.op.kind in _EXCHANGES and _float_exchange(n)):
            live.update(t for t in n.outputs if t.dtype.is_float)
    return live


def _backward_node(node: Node, cotangents: dict[Tensor, Tensor], live: set[Tensor]) -> None:
    exchange = node.op.kind in _EXCHANGES and _float_exchange(node)
    reached = [cotangents.get(t) for t in node.outputs]
    if not exchange and (all(c is None for c in reached) or not any(t in live for t in node.inputs)):
        return
    if node.op.vjp is None:
        raise GraphBuildError(
            f"grad: {node.op.name} {node.name} has no vector-Jacobian rule, and the gradient passes through it "
            f"(operands {', '.join(repr(t) for t in node.inputs)})",
        )
    call = VjpCall(node, reached, _grad.zeros, tuple(t in live for t in node.inputs))
    with node.graph.scope(node.scope) if node.scope else contextlib.nullcontext():
        grads = list(node.op.vjp(call))
    if len(grads) != len(node.inputs):
        raise GraphBuildError(
            f"grad: the rule of {node.op.name} gave {len(grads)} gradients for {len(node.inputs)} operands (a bug "
            "in that op's vjp)"
        )
    for x, g in zip(node.inputs, grads):
        if g is None or x not in live:
            continue
        if g.shape != x.shape or g.dtype != x.dtype:
            raise GraphBuildError(
                f"grad: the rule of {node.op.name} {node.name} gave a {g.dtype.short}{format_shape(g.shape)} gradient "
                f"for its operand {x!r} (a bug in that op's vjp)"
            )
        have = cotangents.get(x)
        cotangents[x] = g if have is None else ew.add(have, g)


def _float_exchange(node: Node) -> bool:
    """A collective or transfer of float values (every rank has it: it always takes part)."""
    values = node.outputs or node.inputs
    return all(t.dtype.is_float for t in values)


def gradient_outputs(graph: Graph, grads: Mapping[str, Tensor], prefix: str = "grad.") -> None:
    """Name each gradient a graph output, ``prefix`` + its parameter's name."""
    for name, g in grads.items():
        graph.output(prefix + name, g)

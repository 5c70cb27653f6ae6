"""The op set. Each module defines its ops once (OpDef + builder function); importing this package
registers all of them in ``megaloop.frontend.opdef.REGISTRY``.

Builders are the public API (``megaloop.matmul``, ``megaloop.softmax``, ...). Each one exported here
is wrapped by ``_guard``: the op rules check arguments and raise precise errors; arguments that do not
fit the builder's signature, or of a kind no rule anticipated, still fail as a megaloop error naming
the builder, the argument and the type its annotation asks for (``_arguments``); the original
exception stays attached as ``__cause__``.
"""

import functools as _functools
import inspect as _inspect
from collections.abc import Callable as _Callable
from typing import Any as _Any

from megaloop.errors import GraphBuildError as _GraphBuildError
from megaloop.errors import MegaloopError as _MegaloopError
from megaloop.frontend import sources
from megaloop.frontend.graph import Graph as _Graph
from megaloop.frontend.ops import elementwise as _elementwise
from megaloop.frontend.ops._arguments import argument_error as _argument_error
from megaloop.frontend.ops.argmax_split import argmax, argmax_combine, argmax_partial
from megaloop.frontend.ops.attention import kv_cache_update
from megaloop.frontend.ops.attention_grad import attention_grad
from megaloop.frontend.ops.attention_split import attention, attention_combine, attention_partial
from megaloop.frontend.ops.collective import all_gather, all_reduce, recv, reduce_scatter, send
from megaloop.frontend.ops.elementwise import *  # noqa: F403 - its __all__: the elementwise builders
from megaloop.frontend.ops.embedding import embedding, scatter_add
from megaloop.frontend.ops.fused_elementwise import fused_elementwise
from megaloop.frontend.ops.layout import (
    broadcast_to,
    concat,
    copy,
    getitem,
    permute,
    reshape,
    slice_,
    split,
    squeeze,
    transpose,
    unsqueeze,
)
from megaloop.frontend.ops.loss import cross_entropy, cross_entropy_grad
from megaloop.frontend.ops.matmul import linear, matmul
from megaloop.frontend.ops.norm_linear import rmsnorm_linear
from megaloop.frontend.ops.normalization import layernorm, log_softmax, rmsnorm, softmax
from megaloop.frontend.ops.optim import adam_moment, adamw_update, grad_accumulate, sgd_momentum, sgd_update
from megaloop.frontend.ops.optim_norm import lr_schedule, square_sum
from megaloop.frontend.ops.paged import paged_attention, paged_kv_cache_update
from megaloop.frontend.ops.reduce import max, mean, min, sum
from megaloop.frontend.ops.rope import inv_frequencies, rope
from megaloop.frontend.ops.rope_cache import rope_kv_cache_update
from megaloop.frontend.ops.rope_paged import rope_paged_kv_cache_update
from megaloop.frontend.ops.rope_table import rope_table
from megaloop.frontend.ops.sample_penalty import penalize
from megaloop.frontend.ops.sample_split import sample, sample_combine, sample_partial
from megaloop.frontend.ops.step_batch import step_batch
from megaloop.frontend.ops.swiglu import swiglu_linear
from megaloop.frontend.tensor import BUILDERS as _BUILDERS
from megaloop.frontend.tensor import Tensor as _Tensor

__all__ = [
    "adam_moment",
    "adamw_update",
    "all_gather",
    "all_reduce",
    "argmax",
    "argmax_combine",
    "argmax_partial",
    "attention",
    "attention_combine",
    "attention_grad",
    "attention_partial",
    "broadcast_to",
    "concat",
    "copy",
    "cross_entropy",
    "cross_entropy_grad",
    "embedding",
    "fused_elementwise",
    "getitem",
    "grad_accumulate",
    "inv_frequencies",
    "kv_cache_update",
    "layernorm",
    "linear",
    "log_softmax",
    "lr_schedule",
    "matmul",
    "max",
    "mean",
    "min",
    "paged_attention",
    "paged_kv_cache_update",
    "penalize",
    "permute",
    "recv",
    "reduce_scatter",
    "reshape",
    "rmsnorm",
    "rmsnorm_linear",
    "rope",
    "rope_kv_cache_update",
    "rope_paged_kv_cache_update",
    "rope_table",
    "sample",
    "sample_combine",
    "sample_partial",
    "scatter_add",
    "send",
    "sgd_momentum",
    "sgd_update",
    "slice_",
    "softmax",
    "sources",
    "split",
    "square_sum",
    "squeeze",
    "step_batch",
    "sum",
    "swiglu_linear",
    "transpose",
    "unsqueeze",
]
__all__ += _elementwise.__all__  # (its builders: an op added there needs no line here)


def _guard(name: str, fn: _Callable[..., _Any]) -> _Callable[..., _Any]:
    signature = _inspect.signature(fn)

    @_functools.wraps(fn)
    def guarded(*args: _Any, **kwargs: _Any) -> _Any:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as e:
            raise _GraphBuildError(f"{name}: {e}; megaloop.{name} takes {name}{signature}") from None
        graphs = _graphs_of(bound.arguments.values())
        saved = [(g, len(g.nodes), len(g.constants), dict(g.state_updates)) for g in graphs]
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            for g, nodes, constants, updates in saved:  # a builder that fails part-way leaves no node behind
                del g.nodes[nodes:], g.constants[constants:]
                g.state_updates = updates
            if isinstance(e, _MegaloopError):
                raise
            raise _GraphBuildError(_argument_error(name, fn, signature, bound, e)) from e

    return guarded


def _graphs_of(values: _Any) -> list[_Any]:
    """The graphs a builder's arguments belong to (tensors, lists of them, a Graph itself)."""
    found: dict[int, _Any] = {}
    for v in values:
        for item in v if isinstance(v, (list, tuple)) else (v,):
            g = item.graph if isinstance(item, _Tensor) else item if isinstance(item, _Graph) else None
            if g is not None:
                found[id(g)] = g
    return list(found.values())


for _name in __all__:
    if _name != "sources":
        globals()[_name] = _guard(_name, globals()[_name])
# Tensor's operators and methods (x + y, x.reshape(...)) call the guarded builders
vars(_BUILDERS).update({_name: globals()[_name] for _name in __all__ if _name != "sources"})

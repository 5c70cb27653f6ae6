"""megaloop: run a whole deep-learning program as one persistent loop kernel per GPU.

    import megaloop as ml
    g = ml.Graph("mlp")
    x = g.input("x", (8, 512), ml.bfloat16)
    w = g.parameter("w", (512, 512), ml.bfloat16)
    g.output("y", ml.relu(x @ w))
    print(g)
    ml.evaluate(g, {"x": ...}, {"w": ...}).outputs["y"]

Layers, in pipeline order (each imports only the ones before it): dtypes/errors -> frontend (graph,
tensors, op set) -> models, optim, parallel, fuse (graph rewrites) -> plan -> codegen, reference -> runtime -> cli.
"""

from megaloop import errors, optim
from megaloop.dtypes import (
    ALL_DTYPES,
    FLOAT_DTYPES,
    DType,
    as_dtype,
    bfloat16,
    bool_,
    float16,
    float32,
    int32,
    int64,
)
from megaloop.errors import MegaloopError
from megaloop.frontend import REGISTRY, Graph, OpDef, Tensor
from megaloop.frontend.autodiff import grad
from megaloop.frontend.ops import *  # noqa: F403 - the op builders are the public API
from megaloop.frontend.ops import __all__ as _ops_all
from megaloop.fuse import FuseOptions, fuse
from megaloop.parallel import (
    Mesh,
    OnDevice,
    Partial,
    Partition,
    Replicate,
    Shard,
    match_ranks,
    parallelize,
    parallelize_training,
    spmd,
)
from megaloop.reference import Evaluation, evaluate

__version__ = "0.1.0"


def __getattr__(name: str):
    """``megaloop.Generator`` (and its result types), ``megaloop.Engine`` and ``megaloop.Trainer`` (with
    its settings), imported when first used: they bring in the runtime, the tokenizer and jinja2, which
    building and evaluating graphs do not need."""
    if name in ("Generator", "GenerationResult", "Completion", "GenerationSettings", "GenerationInterrupted"):
        import megaloop.generation

        return getattr(megaloop.generation, name)
    if name in ("Trainer", "TrainSettings", "TrainResult", "OptimizerSettings"):
        import megaloop.training.trainer

        return getattr(megaloop.training.trainer, name)
    if name == "Engine":
        import megaloop.serving.engine

        return megaloop.serving.engine.Engine
    raise AttributeError(f"module 'megaloop' has no attribute {name!r}")


__all__ = [
    "ALL_DTYPES",
    "FLOAT_DTYPES",
    "REGISTRY",
    "DType",
    "Evaluation",
    "FuseOptions",
    "Graph",
    "MegaloopError",
    "Mesh",
    "OnDevice",
    "OpDef",
    "Partial",
    "Partition",
    "Replicate",
    "Shard",
    "Tensor",
    "as_dtype",
    "bfloat16",
    "bool_",
    "errors",
    "evaluate",
    "float16",
    "float32",
    "fuse",
    "grad",
    "int32",
    "int64",
    "match_ranks",
    "optim",
    "parallelize",
    "parallelize_training",
    "spmd",
    *_ops_all,
]

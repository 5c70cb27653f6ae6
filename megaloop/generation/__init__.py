"""Text generation from a Hugging Face checkpoint folder (``Generator``) and the commands that wrap
it (``megaloop generate``, ``megaloop make-tiny-checkpoint``). Uses models (checkpoint, tokenizer),
plan, codegen, reference and runtime: it is the last layer before the command line."""

from megaloop.generation.generator import (
    Completion,
    GenerationError,
    GenerationInterrupted,
    GenerationResult,
    GenerationStats,
    Generator,
)
from megaloop.generation.sequences import TokenLogprob
from megaloop.generation.settings import GenerationSettings

__all__ = [
    "Completion",
    "GenerationError",
    "GenerationInterrupted",
    "GenerationResult",
    "GenerationSettings",
    "GenerationStats",
    "Generator",
    "TokenLogprob",
]

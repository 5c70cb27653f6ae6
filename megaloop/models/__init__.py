"""Models built with the graph API (Llama-family decoders), their Hugging Face checkpoints (configs of
the Llama, Mistral, Qwen2, Qwen3, Gemma 2/3, Phi-3 and OLMo 2 families: docs/models.md), tokenizers
and chat templates."""

from megaloop.models.checkpoint import load_llama, read_safetensors, write_safetensors
from megaloop.models.gradients import build_llama_gradients, llama_loss
from megaloop.models.llama import (
    LlamaConfig,
    build_llama,
    build_llama_generator,
    build_llama_prefill,
    random_parameters,
)
from megaloop.models.tiny import make_tiny_checkpoint
from megaloop.models.tokenizer import Tokenizer

__all__ = [
    "LlamaConfig",
    "Tokenizer",
    "build_llama",
    "build_llama_generator",
    "build_llama_gradients",
    "build_llama_prefill",
    "llama_loss",
    "load_llama",
    "make_tiny_checkpoint",
    "random_parameters",
    "read_safetensors",
    "write_safetensors",
]

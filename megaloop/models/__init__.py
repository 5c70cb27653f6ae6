"""Models built with the graph API (Llama-family today), and their Hugging Face checkpoints."""

from megaloop.models.checkpoint import load_llama, read_safetensors, write_safetensors
from megaloop.models.llama import LlamaConfig, build_llama, build_llama_generator, random_parameters

__all__ = [
    "LlamaConfig",
    "build_llama",
    "build_llama_generator",
    "load_llama",
    "random_parameters",
    "read_safetensors",
    "write_safetensors",
]

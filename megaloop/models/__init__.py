"""Models built with the graph API (Llama-family today)."""

from megaloop.models.llama import LlamaConfig, build_llama, build_llama_generator, random_parameters

__all__ = ["LlamaConfig", "build_llama", "build_llama_generator", "random_parameters"]

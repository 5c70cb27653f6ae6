"""Codegen: a verified plan -> one readable CUDA C++ loop kernel per GPU, built on the header library
in ``include/megaloop`` (types, math, the loop machinery); ``generate(plan)`` returns the source and the
tables the kernel walks."""

from megaloop.codegen.kernel import LoopProgram, generate

__all__ = ["LoopProgram", "generate"]

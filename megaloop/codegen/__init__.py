"""Codegen: a verified plan -> one readable CUDA C++ loop kernel per GPU plus the header library of
tile implementations (*.cuh). Not built yet (third issue of the first tranche); element types come
from ``megaloop.dtypes.DType.c_type``."""

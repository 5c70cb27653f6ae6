"""The element types megaloop tensors can hold, and how they map to numpy, C++ and tolerances.

float16 and bfloat16 are storage types: ops compute in float32 and round once to the output dtype
(``compute_np``). bfloat16 is numpy's ``ml_dtypes.bfloat16``; beware that numpy reductions on it
accumulate in bfloat16 unless told otherwise, which is why every reference casts to ``compute_np``
first.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from megaloop.errors import DtypeError


@dataclass(frozen=True)
class DType:
    name: str  # canonical name, as in "bfloat16"
    short: str  # compact name used in summaries and generated code, as in "bf16"
    kind: str  # "float", "int" or "bool"
    itemsize: int  # bytes per element
    c_type: str  # element type in generated CUDA C++
    np_type: type  # numpy scalar type used to store values of this dtype

    @property
    def np(self) -> np.dtype:
        return np.dtype(self.np_type)

    @property
    def is_float(self) -> bool:
        return self.kind == "float"

    @property
    def is_int(self) -> bool:
        return self.kind == "int"

    @property
    def is_bool(self) -> bool:
        return self.kind == "bool"

    @property
    def compute_np(self) -> np.dtype:
        """The numpy dtype arithmetic on this dtype is carried out in (float32 for all floats)."""
        if self.is_float:
            return np.dtype(np.float32)
        return self.np

    @property
    def eps(self) -> float:
        """Distance from 1.0 to the next representable value (floats only)."""
        if not self.is_float:
            raise DtypeError(f"dtype {self.name} has no machine epsilon: it is not a floating type")
        return float(ml_dtypes.finfo(self.np_type).eps)

    def __repr__(self) -> str:
        return f"megaloop.{self.name}"

    def __str__(self) -> str:
        return self.short


float32 = DType("float32", "f32", "float", 4, "float", np.float32)
float16 = DType("float16", "f16", "float", 2, "__half", np.float16)
bfloat16 = DType("bfloat16", "bf16", "float", 2, "__nv_bfloat16", ml_dtypes.bfloat16)
int32 = DType("int32", "i32", "int", 4, "int32_t", np.int32)
int64 = DType("int64", "i64", "int", 8, "int64_t", np.int64)
bool_ = DType("bool", "bool", "bool", 1, "bool", np.bool_)

ALL_DTYPES: tuple[DType, ...] = (float32, float16, bfloat16, int32, int64, bool_)
FLOAT_DTYPES: tuple[DType, ...] = (float32, float16, bfloat16)

_BY_NAME: dict[str, DType] = {}
for _dt in ALL_DTYPES:
    for _alias in (_dt.name, _dt.short):
        _BY_NAME[_alias] = _dt
_BY_NAME.update({"half": float16, "float": float32, "fp32": float32, "fp16": float16, "bool_": bool_})


def as_dtype(value: object) -> DType:
    """Turn a DType, a name ("bf16", "bfloat16"), a numpy dtype or a torch dtype into a DType."""
    if isinstance(value, DType):
        return value
    if isinstance(value, str):
        key = value.removeprefix("torch.").lower()
        if key in _BY_NAME:
            return _BY_NAME[key]
        raise DtypeError(f"unknown dtype name {value!r}; known: {', '.join(d.name for d in ALL_DTYPES)}")
    if type(value).__module__ == "torch":  # a torch.dtype, without importing torch
        return as_dtype(str(value))
    try:
        npd = np.dtype(value)  # type: ignore[call-overload]
    except Exception:  # numpy refuses it (TypeError, or ValueError for objects with an odd .dtype)
        npd = None
    if npd is not None:
        for dt in ALL_DTYPES:
            if dt.np == npd:
                return dt
    raise DtypeError(f"megaloop has no dtype for {value!r}; use one of {', '.join(d.name for d in ALL_DTYPES)}")


def to_numpy(value: object) -> np.ndarray:
    """Arrays, nested lists, numbers and CPU/GPU torch tensors (bfloat16 too) as numpy arrays.
    Ragged nested lists raise ValueError."""
    if type(value).__module__.startswith("torch"):
        t = value.detach().cpu()  # type: ignore[attr-defined]
        if str(t.dtype) == "torch.bfloat16":  # numpy has no bfloat16: move the bits
            import torch

            return t.view(torch.int16).numpy().view(bfloat16.np)
        return t.numpy()
    return np.asarray(value)


def round_to(array: np.ndarray, dtype: DType) -> np.ndarray:
    """Round an array to ``dtype``. float64 and integers go through float32 first on their way to a
    16-bit float, as a float32 accumulator (and torch, and ml_dtypes) would."""
    array = np.asarray(array)
    if dtype.is_float and dtype.itemsize == 2 and array.dtype == np.float64:
        array = array.astype(np.float32)
    return array.astype(dtype.np, copy=False)

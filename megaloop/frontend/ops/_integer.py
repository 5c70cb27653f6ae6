"""numpy's rules for pow, floor_divide and remainder on integers (megaloop/frontend/ops/elementwise.py
defines the ops): warnings silenced (a zero divisor, an overflow: numpy's values are the ops'), and a
negative integer exponent refused, at build time or as a data error."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from megaloop import dtypes
from megaloop.errors import DataError, GraphBuildError
from megaloop.frontend.opdef import OpCall, first_bad


def quietly(fn: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    """numpy's ``fn`` without its warnings (a zero divisor, an integer overflow): its values are the op's."""

    def run(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            return fn(a, b)

    return run


def power(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """numpy's power; an integer exponent below 0 is refused before (check_power_data), so one here is
    a value no task computes with (the plan interpreter's poison): taken as 0."""
    if b.dtype.kind in "iu":
        b = np.maximum(b, 0)
    return quietly(np.power)(a, b)


def check_power(call: OpCall, dtype: dtypes.DType) -> None:
    exponent = call.attrs.get("scalars", {}).get(1)
    if dtype.is_int and exponent is not None and exponent < 0:
        raise call.error(
            GraphBuildError,
            f"an integer tensor to the negative power {exponent}: numpy refuses it (integers to negative "
            "integer powers are not allowed)",
            hint="cast the base to a float dtype first",
        )


def check_power_data(arrays: list[np.ndarray], attrs: dict[str, Any], known: Any) -> None:
    """An integer exponent tensor must hold no negative value (numpy's ValueError)."""
    if 1 in attrs.get("scalars", {}) or arrays[-1].dtype.kind not in "iu":
        return
    exponent, real = arrays[-1], known[-1]
    where = first_bad(exponent < 0, real)
    if where is not None:
        raise DataError(
            f"pow: exponent{list(where)} is {int(exponent[where])}: integers to negative integer powers are "
            "not allowed (numpy's rule); cast the base to a float dtype"
        )

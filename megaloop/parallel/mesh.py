"""``Mesh``: a named grid of devices. Rank r is the device at the row-major coordinates of r, so the
last axis varies fastest: in ``Mesh((2, 4), ("pp", "tp"))`` ranks 0-3 are the first pipeline stage,
and each stage's four tensor-parallel ranks are consecutive (on one node, when a node has 4 or 8)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from megaloop.errors import GraphBuildError

AXIS_KINDS = ("tp", "pp", "dp")


@dataclass(frozen=True, init=False)
class Mesh:
    shape: tuple[int, ...]
    names: tuple[str, ...]

    def __init__(self, shape: int | Sequence[int], names: Sequence[str] | None = None) -> None:
        dims = (shape,) if isinstance(shape, int) else tuple(shape)
        if not dims or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in dims):
            raise GraphBuildError(f"Mesh: shape must be ints >= 1, got {shape!r}")
        names = (
            tuple(names)
            if names is not None
            else (("tp",) if len(dims) == 1 else tuple(f"axis{i}" for i in range(len(dims))))
        )
        if len(names) != len(dims) or len(set(names)) != len(names) or not all(isinstance(n, str) and n for n in names):
            raise GraphBuildError(f"Mesh: give one distinct name per axis: shape {dims} with names {names!r}")
        object.__setattr__(self, "shape", dims)
        object.__setattr__(self, "names", names)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def axis(self, name: str) -> int:
        if name not in self.names:
            raise GraphBuildError(f"Mesh: no axis {name!r}; the mesh's axes are {list(self.names)}")
        return self.names.index(name)

    def stride(self, name: str) -> int:
        """How far apart in rank numbers neighbours along the axis are."""
        return math.prod(self.shape[self.axis(name) + 1 :])

    def coords(self, rank: int) -> tuple[int, ...]:
        out = []
        for size in reversed(self.shape):
            out.append(rank % size)
            rank //= size
        return tuple(reversed(out))

    def rank(self, coords: Sequence[int]) -> int:
        r = 0
        for c, size in zip(coords, self.shape):
            r = r * size + c
        return r

    def __str__(self) -> str:
        return " x ".join(f"{n}={s}" for n, s in zip(self.names, self.shape))


def as_mesh(devices: int | Mesh) -> Mesh:
    if isinstance(devices, Mesh):
        return devices
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise GraphBuildError(f"parallelize: devices must be an int >= 1 or a megaloop.Mesh, got {devices!r}")
    return Mesh((devices,), ("tp",))

"""``Tensor``: a value in a graph under construction (shape, dtype, layout), with numpy-like sugar.

A Tensor holds no data. Its layout says where its elements live inside its storage: a tensor made
by a compute op owns a contiguous storage; a view (reshape/transpose/slice/broadcast) points into the
storage of the tensor it was made from (``base``) with its own strides and offset, in elements.

``==`` and ``!=`` keep Python's identity meaning (so tensors work as dict keys); use
``megaloop.equal`` / ``megaloop.not_equal`` for elementwise comparison.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from megaloop.dtypes import DType
from megaloop.errors import GraphBuildError
from megaloop.frontend.shapes import Shape, contiguous_strides, format_shape, is_contiguous, numel

if TYPE_CHECKING:
    from megaloop.frontend.graph import Graph, Node


# The op builders Tensor's operators and methods call (x + y is megaloop.add(x, y)), by name. The op
# modules build on Tensor, so megaloop/frontend/ops/__init__.py fills this in rather than this module
# importing them.
BUILDERS = SimpleNamespace()


class Tensor:
    __slots__ = ("_base", "dtype", "graph", "index", "node", "offset", "shape", "strides")

    def __init__(
        self,
        graph: Graph,
        node: Node,
        index: int,
        shape: Shape,
        dtype: DType,
        base: Tensor | None = None,
        strides: Shape | None = None,
        offset: int = 0,
    ) -> None:
        self.graph = graph
        self.node = node
        self.index = index
        self.shape = tuple(shape)
        self.dtype = dtype
        self._base = base
        self.strides = tuple(strides) if strides is not None else contiguous_strides(self.shape)
        self.offset = offset

    # ---- facts -------------------------------------------------------------------------------
    @property
    def base(self) -> Tensor:
        """The tensor that owns the storage this one lives in (itself unless it is a view)."""
        return self._base if self._base is not None else self

    @property
    def is_view(self) -> bool:
        return self._base is not None

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return numel(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def is_contiguous(self) -> bool:
        """Dense row-major elements (a slice of rows may be contiguous at a non-zero offset)."""
        return is_contiguous(self.shape, self.strides)

    @property
    def name(self) -> str:
        """The producing node's name, with ``:i`` for outputs after the first."""
        return self.node.name if self.index == 0 else f"{self.node.name}:{self.index}"

    @property
    def ref(self) -> str:
        """Short id used in summaries: ``%12`` (or ``%12:1`` for a second output)."""
        return f"%{self.node.id}" if self.index == 0 else f"%{self.node.id}:{self.index}"

    def __repr__(self) -> str:
        layout = "" if not self.is_view else f" view of {self.base.ref} strides={self.strides}"
        if self.is_view and self.offset:
            layout += f" offset={self.offset}"
        return f"Tensor({self.ref} {self.name!r} {self.dtype.short}{format_shape(self.shape)}{layout})"

    def __bool__(self) -> bool:
        raise GraphBuildError(
            f"the truth value of {self!r} is unknown while the graph is built (a Tensor holds no data); "
            "use megaloop.where(cond, a, b) for data-dependent choices"
        )

    def __iter__(self):  # without this, Python would try __getitem__ with 0, 1, 2, ... forever
        raise GraphBuildError(f"cannot iterate over {self!r}; use megaloop.split(x, n, axis) or index it explicitly")

    def __len__(self) -> int:
        if not self.shape:
            raise GraphBuildError(f"len() of a 0-d tensor {self!r}")
        return self.shape[0]

    __hash__ = object.__hash__
    __array_ufunc__ = None  # numpy defers to our reflected operators: np.float32(2) * x works

    def __floordiv__(self, other: Any) -> Tensor:
        return BUILDERS.floor_divide(self, other)

    def __rfloordiv__(self, other: Any) -> Tensor:
        return BUILDERS.floor_divide(other, self)

    def __mod__(self, other: Any) -> Tensor:
        return BUILDERS.remainder(self, other)

    def __rmod__(self, other: Any) -> Tensor:
        return BUILDERS.remainder(other, self)

    # ---- arithmetic (each one is an op from megaloop.frontend.ops) ----------------------------
    def __add__(self, other: Any) -> Tensor:
        return BUILDERS.add(self, other)

    def __radd__(self, other: Any) -> Tensor:
        return BUILDERS.add(other, self)

    def __sub__(self, other: Any) -> Tensor:
        return BUILDERS.sub(self, other)

    def __rsub__(self, other: Any) -> Tensor:
        return BUILDERS.sub(other, self)

    def __mul__(self, other: Any) -> Tensor:
        return BUILDERS.mul(self, other)

    def __rmul__(self, other: Any) -> Tensor:
        return BUILDERS.mul(other, self)

    def __truediv__(self, other: Any) -> Tensor:
        return BUILDERS.div(self, other)

    def __rtruediv__(self, other: Any) -> Tensor:
        return BUILDERS.div(other, self)

    def __pow__(self, other: Any) -> Tensor:
        return BUILDERS.pow(self, other)

    def __rpow__(self, other: Any) -> Tensor:
        return BUILDERS.pow(other, self)

    def __matmul__(self, other: Tensor) -> Tensor:
        return BUILDERS.matmul(self, other)

    def __neg__(self) -> Tensor:
        return BUILDERS.neg(self)

    def __abs__(self) -> Tensor:
        return BUILDERS.abs(self)

    def __lt__(self, other: Any) -> Tensor:
        return BUILDERS.less(self, other)

    def __le__(self, other: Any) -> Tensor:
        return BUILDERS.less_equal(self, other)

    def __gt__(self, other: Any) -> Tensor:
        return BUILDERS.greater(self, other)

    def __ge__(self, other: Any) -> Tensor:
        return BUILDERS.greater_equal(self, other)

    def __and__(self, other: Any) -> Tensor:
        return BUILDERS.logical_and(self, other)

    def __or__(self, other: Any) -> Tensor:
        return BUILDERS.logical_or(self, other)

    def __invert__(self) -> Tensor:
        return BUILDERS.logical_not(self)

    def __getitem__(self, index: Any) -> Tensor:
        return BUILDERS.getitem(self, index)

    # ---- methods mirroring the free functions --------------------------------------------------
    def astype(self, dtype: Any) -> Tensor:
        return BUILDERS.cast(self, dtype)

    def reshape(self, *shape: Any) -> Tensor:
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        return BUILDERS.reshape(self, shape)

    def transpose(self, axis0: int = -2, axis1: int = -1) -> Tensor:
        return BUILDERS.transpose(self, axis0, axis1)

    def permute(self, *axes: Any) -> Tensor:
        if len(axes) == 1 and isinstance(axes[0], (tuple, list)):
            axes = tuple(axes[0])
        return BUILDERS.permute(self, axes)

    @property
    def T(self) -> Tensor:
        """All axes reversed, as in numpy."""
        return BUILDERS.permute(self, tuple(range(self.ndim - 1, -1, -1)))

    @property
    def mT(self) -> Tensor:
        """The last two axes swapped (matrix transpose of a batch)."""
        return BUILDERS.transpose(self, -2, -1)

    def unsqueeze(self, axis: int) -> Tensor:
        return BUILDERS.unsqueeze(self, axis)

    def squeeze(self, axis: int | tuple[int, ...] | None = None) -> Tensor:
        return BUILDERS.squeeze(self, axis)

    def broadcast_to(self, shape: Shape) -> Tensor:
        return BUILDERS.broadcast_to(self, shape)

    def sum(self, axis: Any = None, keepdims: bool = False) -> Tensor:
        return BUILDERS.sum(self, axis, keepdims=keepdims)

    def mean(self, axis: Any = None, keepdims: bool = False) -> Tensor:
        return BUILDERS.mean(self, axis, keepdims=keepdims)

    def max(self, axis: Any = None, keepdims: bool = False) -> Tensor:
        return BUILDERS.max(self, axis, keepdims=keepdims)

    def min(self, axis: Any = None, keepdims: bool = False) -> Tensor:
        return BUILDERS.min(self, axis, keepdims=keepdims)

    def argmax(self, axis: int | None = None, keepdims: bool = False) -> Tensor:
        return BUILDERS.argmax(self, axis, keepdims=keepdims)

    def copy(self) -> Tensor:
        return BUILDERS.copy(self)

"""The one place an op is defined: ``OpDef``, and the registry every other layer reads.

An ``OpDef`` holds everything about an op that does not depend on where it runs: its operands,
its shape/dtype rule (``infer``), its numpy reference (the executable spec, run by the reference
backend), its accuracy contract (used by the tests), and its documentation. Later layers derive
their tables from the registry (opcode enums, profiler names, test tables) instead of copying it.

Kinds of op, which decide how the reference backend and later the planner treat them:

- ``source``: no operands; the value comes from outside (inputs, parameters, state, constants).
- ``compute``: a pure function of its operands, producing new contiguous tensors.
- ``view``: output 0 is a different view (shape/strides/offset) of operand 0's storage; no data moves
  when the layout allows it. The numpy reference still defines the values; the evaluator checks
  that the view's declared layout yields the same values.
- ``collective``: every rank of a group takes part; the reference maps all members' operands to all
  members' outputs at once.
- ``p2p``: a point-to-point send or receive between two ranks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from megaloop.dtypes import DType
from megaloop.errors import AxisError, GraphBuildError
from megaloop.frontend.placement import PlacementRule
from megaloop.frontend.shapes import Shape, format_shape, normalize_axes, normalize_axis
from megaloop.frontend.tiling import Tiling

if TYPE_CHECKING:
    from megaloop.frontend.tensor import Tensor

KINDS = ("source", "compute", "view", "collective", "p2p")


@dataclass(frozen=True)
class ViewSpec:
    """Where a view lives inside its operand's storage: strides and offset in elements of the
    storage (root) tensor, not of the operand, so views of views need no chain walking."""

    strides: Shape
    offset: int


@dataclass(frozen=True)
class OutSpec:
    """One output of an op as its shape rule declares it."""

    shape: Shape
    dtype: DType
    view: ViewSpec | None = None  # set by view ops whose output aliases operand 0's storage


@dataclass(frozen=True)
class Accuracy:
    """How far an implementation may stray from the float64 truth, in units of the output dtype's
    epsilon, relative to ``|truth| + scale`` where scale is the largest magnitude in the output.
    ``per_reduction`` adds ``sqrt(n)`` ulps for ops that sum n products (matmul, norms)."""

    ulps: float = 1.0
    per_reduction: bool = False


@dataclass(frozen=True)
class Lowering:
    """How the loop kernel runs one tile of the op: the name of its tile template (a key of
    megaloop.codegen.templates.TEMPLATES, which emits the tile function, says what shared memory it
    needs and which plan facts it reads) and, for elementwise ops, the C++ expression over the operands
    ``a``, ``b``, ``c`` in their compute type (float, long long or bool), written with megaloop/math.cuh;
    a callable gets the node's attributes. The op's tiling (processors, cost) is ``OpDef.tiling``."""

    template: str
    expr: str | Callable[[dict[str, Any]], str] = ""

    def expression(self, attrs: dict[str, Any]) -> str:
        return self.expr(attrs) if callable(self.expr) else self.expr


@dataclass(frozen=True)
class Fast:
    """A faster CPU implementation of an op, for graphs run many times (megaloop.reference.fast).
    ``make(node)`` runs once per node and returns ``run(operands) -> outputs`` (a list): operands and
    outputs in their *compute form* (float tensors as float32 arrays holding values of their dtype,
    others as they are), each output already rounded to its dtype. ``exact``: the reference's bits
    with numpy's products (else within the op's accuracy contract, e.g. a BLAS order of sums; torch's
    bfloat16 products, where a graph is prepared for them, are within matmul's). ``checks_data``: run
    checks the operands' values itself (else the executor calls ``check_data`` first). ``torch``: like
    ``make``, for operands and outputs in torch form (megaloop.frontend.ops._torch), or None where the
    node's attributes need ``make``'s kernel (an op without one runs that, its operands converted)."""

    make: Callable[[Any], Callable[[list[np.ndarray]], list[np.ndarray]]]
    exact: bool = True
    checks_data: bool = False
    torch: Callable[[Any], Callable[[list[Any]], list[Any]] | None] | None = None


@dataclass(frozen=True)
class OpDef:
    name: str
    kind: str
    category: str  # grouping for docs and test tables: "elementwise", "reduction", ...
    doc: str
    operands: tuple[str, ...]  # operand names; a leading "*" marks a variadic list ("*tensors")
    infer: Callable[[OpCall], Sequence[OutSpec]]
    reference: Callable[..., Any] | None
    accuracy: Accuracy = field(default_factory=Accuracy)
    inplace_operand: int | None = None  # output 0 overwrites this operand's storage (state updates)
    tiling: Tiling | None = None  # how it splits into tile tasks; None: no tasks (sources, views, send)
    lowering: Lowering | None = None  # how the loop kernel runs a tile (None: not on the GPU yet)
    # how its operands' and outputs' placements over a group of devices go together (its strategies);
    # None: the partitioner cannot split it (megaloop/frontend/placement.py)
    placement: PlacementRule | None = None
    # rules on the operands' values (ids, positions, lengths in range): check_data(arrays, attrs, known)
    # raises DataError; known[i] is None (every value of operand i is real) or a bool mask of the values
    # that are (the plan interpreter's tasks see only their declared boxes). The reference runs after it
    # and clamps what it indexes with, so the poison outside a task's boxes stays harmless.
    check_data: Callable[[list[np.ndarray], dict[str, Any], Sequence[np.ndarray | None]], None] | None = None
    # the attributes a node of this op may carry: name -> a kind of ATTR_KINDS, or a tuple of the allowed
    # values; what a graph read from a plan file is checked against before its shape rules run
    attrs: Mapping[str, str | tuple[Any, ...]] = field(default_factory=dict)
    # those of them a node may leave out (every reader has a default); the others it must carry
    optional_attrs: frozenset[str] = frozenset()
    # its vector-Jacobian product, written with the graph API: vjp(call: VjpCall) gives one gradient per
    # tensor operand (None: none flows there, e.g. ids); None: the op cannot be differentiated
    # (megaloop/frontend/autodiff.py refuses it by name)
    vjp: Callable[[VjpCall], Sequence[Tensor | None]] | None = None
    fast: Fast | None = None  # a faster CPU implementation (Fast); None: the reference runs there too

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"op {self.name}: kind must be one of {KINDS}, got {self.kind!r}")
        for key, kind in self.attrs.items():
            if not isinstance(kind, tuple) and kind not in ATTR_KINDS:
                raise ValueError(f"op {self.name}: attribute {key!r} has unknown kind {kind!r}")
        if not self.optional_attrs <= set(self.attrs):
            raise ValueError(f"op {self.name}: optional_attrs {sorted(self.optional_attrs)} are not all attributes")

    def attr_problem(self, attrs: Mapping[str, Any]) -> str | None:
        """What is wrong with a node's attributes (unknown or missing names, values of the wrong kind), or
        None."""
        for key in self.attrs:
            if key not in attrs and key not in self.optional_attrs:
                return f"{key}: {self.name} needs the attribute {key!r}; it is missing"
        for key, value in attrs.items():
            kind = self.attrs.get(key)
            if kind is None:
                known = ", ".join(sorted(self.attrs)) or "none"
                return f"{key}: {self.name} has no attribute {key!r} (its attributes: {known})"
            if isinstance(kind, tuple):
                if not any(type(value) is type(c) and value == c for c in kind):
                    return f"{key}: expected one of {list(kind)}, got {value!r:.60}"
                continue
            check, expected = ATTR_KINDS[kind]
            if not check(value):
                return f"{key}: expected {expected}, got {type(value).__name__} {value!r:.60}"
        return None

    def operand_name(self, index: int) -> str:
        if len(self.operands) == 1 and self.operands[0].startswith("*"):
            return f"{self.operands[0][1:]}[{index}]"
        if index < len(self.operands):
            return self.operands[index]
        return f"operand {index}"

    def __repr__(self) -> str:
        return f"OpDef({self.name})"


REGISTRY: dict[str, OpDef] = {}


def _int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _number(v: Any) -> bool:
    return _int(v) or (isinstance(v, (float, np.floating)) and math.isfinite(v))


def _ints(v: Any, low: int | None = None) -> bool:
    return isinstance(v, tuple) and all(_int(x) and (low is None or x >= low) for x in v)


def _scaling(v: Any) -> bool:
    if v is None:
        return True
    return isinstance(v, dict) and all(
        isinstance(k, str) and (_number(x) or isinstance(x, str) or (isinstance(x, tuple) and all(map(_number, x))))
        for k, x in v.items()
    )


def _is_dtype(v: Any) -> bool:
    return isinstance(v, DType)


# kinds of attribute value: (check, what a wrong value is told it should be)
ATTR_KINDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "bool": (lambda v: isinstance(v, (bool, np.bool_)), "true or false"),
    "int": (_int, "an int"),
    "count": (lambda v: _int(v) and v >= 1, "an int >= 1"),
    "count?": (lambda v: v is None or (_int(v) and v >= 1), "null or an int >= 1"),
    "rank": (lambda v: _int(v) and v >= 0, "an int >= 0"),
    "number": (_number, "a finite number"),
    "number?": (lambda v: v is None or _number(v), "null or a finite number"),
    "name": (lambda v: isinstance(v, str) and bool(v) and not any(c.isspace() for c in v), "a name (no spaces)"),
    "ints": (_ints, "a tuple of ints"),
    "shape": (lambda v: _ints(v, 0), "a tuple of ints >= 0"),
    "axes": (lambda v: v is None or _int(v) or _ints(v), "null, an int or a tuple of ints"),
    "ranks?": (lambda v: v is None or _ints(v, 0), "null or a tuple of ranks"),
    "bounds": (lambda v: isinstance(v, tuple) and all(x is None or _int(x) for x in v), "a tuple of ints or nulls"),
    "dtype": (_is_dtype, "a dtype"),
    "array": (lambda v: isinstance(v, np.ndarray), "an array"),
    "scalars": (
        lambda v: isinstance(v, dict) and all(_int(k) and k >= 0 and _number(x) for k, x in v.items()),
        "a dict from operand slots to finite numbers",
    ),
    "scaling": (_scaling, "null or a dict from names to numbers (or tuples of numbers)"),
    "steps": (
        lambda v: isinstance(v, list)
        and all(isinstance(s, dict) and set(s) == {"op", "attrs", "args", "dtype"} for s in v),
        "a list of steps {op, attrs, args, dtype} (megaloop/frontend/ops/fused_elementwise.py)",
    ),
}


def first_bad(bad: np.ndarray, known: np.ndarray | None) -> tuple[int, ...] | None:
    """Index of the first True of ``bad`` among the real values (``known``; None: all), or None."""
    if known is not None:
        bad = bad & known
    if not np.any(bad):
        return None
    return tuple(int(i) for i in np.argwhere(bad)[0])


def register(op: OpDef) -> OpDef:
    if op.name in REGISTRY:
        raise ValueError(f"op {op.name!r} is defined twice; each op has exactly one definition")
    REGISTRY[op.name] = op
    return op


def describe(t: Tensor) -> str:
    return f"{t.dtype.short}{format_shape(t.shape)}"


class OpCall:
    """What a shape rule sees: the op, its operands (Tensors, read-only) and its attributes, plus
    ``error`` to build a megaloop error that names all of them."""

    def __init__(
        self, op: OpDef, operands: Sequence[Tensor], attrs: dict[str, Any], where: str, graph: Any = None
    ) -> None:
        self.op = op
        self.graph = graph  # the Graph the node is added to (ops without operands need it)
        self.operands = tuple(operands)
        self.attrs = attrs
        self.where = where

    def shape(self, i: int) -> Shape:
        return self.operands[i].shape

    def dtype(self, i: int) -> DType:
        return self.operands[i].dtype

    def name(self, i: int) -> str:
        """Name of the i-th tensor operand. Slots taken by Python numbers (attrs["scalars"]) or left
        out (attrs["absent"], e.g. an optional weight) are skipped."""
        skipped = set(self.attrs.get("scalars", ())) | set(self.attrs.get("absent", ()))
        if skipped:
            i = [s for s in range(len(self.op.operands)) if s not in skipped][i]
        return self.op.operand_name(i)

    def axis(self, axis: Any, ndim: int) -> int:
        """``axis`` normalised into range(ndim), or an AxisError naming this op."""
        try:
            return normalize_axis(axis, ndim)
        except ValueError as e:
            raise self.error(AxisError, str(e)) from None

    def axes(self, axes: Any, ndim: int) -> tuple[int, ...]:
        """``axes`` (int, tuple or None for all) as sorted distinct axes, or an AxisError naming this op."""
        try:
            return normalize_axes(axes, ndim)
        except ValueError as e:
            raise self.error(AxisError, str(e)) from None

    def error(self, cls: type[GraphBuildError], message: str, hint: str = "") -> GraphBuildError:
        """``raise call.error(ShapeError, "rule broken ...", hint="what to do")``."""
        parts = [f"{self.op.name}: {message}"]
        if self.operands:
            ops = ", ".join(f"{self.name(i)}: {describe(t)}" for i, t in enumerate(self.operands))
            parts.append(f"operands: {ops}")
        if self.where:
            parts.append(f"at: {self.where}")
        if hint:
            parts.append(f"hint: {hint}")
        return cls("\n  ".join(parts))


class VjpCall:
    """What a vector-Jacobian rule sees: the forward node (its operands, outputs and attributes, all
    tensors of the graph the backward is added to) and the cotangent of each output (None: no
    gradient reaches that output; ``cotangent(i)`` gives zeros then)."""

    def __init__(
        self,
        node: Any,
        cotangents: Sequence[Tensor | None],
        zeros: Callable[[Tensor], Tensor],
        needs: Sequence[bool],
    ) -> None:
        self.node = node
        self.cotangents = tuple(cotangents)
        self._zeros = zeros
        self.needs = tuple(needs)  # per operand: whether its gradient is wanted (rules may skip the others)

    @property
    def inputs(self) -> tuple[Tensor, ...]:
        return self.node.inputs

    @property
    def outputs(self) -> tuple[Tensor, ...]:
        return self.node.outputs

    @property
    def attrs(self) -> dict[str, Any]:
        return self.node.attrs

    @property
    def graph(self) -> Any:
        return self.node.graph

    def cotangent(self, i: int = 0) -> Tensor:
        """The gradient reaching output ``i``, zeros of its shape where none does."""
        g = self.cotangents[i]
        return g if g is not None else self._zeros(self.outputs[i])


def attrs_repr(attrs: dict[str, Any]) -> str:
    items = []
    for k, v in attrs.items():
        if isinstance(v, np.ndarray):
            v = f"array{format_shape(v.shape)}"
        items.append(f"{k}={v}")
    return ", ".join(items)

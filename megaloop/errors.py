"""Every error megaloop raises on purpose.

Errors are written for the person who built the graph: they name the op (and its place in the
model when a scope was set), the operand, the shapes and dtypes involved, and the rule that was
broken, then say what to do. Each class also derives from the builtin exception a Python user would
expect (ValueError, TypeError, IndexError), so ``except ValueError`` keeps working.
"""

from __future__ import annotations


class MegaloopError(Exception):
    """Base class of every error megaloop raises deliberately."""


class GraphBuildError(MegaloopError, ValueError):
    """The graph being built breaks a rule; raised at the call that broke it."""


class ShapeError(GraphBuildError):
    """Operand shapes do not satisfy the op's shape rule."""


class BroadcastError(ShapeError):
    """Operand shapes cannot be broadcast together under numpy's rules."""


class AxisError(GraphBuildError, IndexError):
    """An axis argument is out of range or repeated."""


class DtypeError(GraphBuildError, TypeError):
    """Operand dtypes do not satisfy the op's dtype rule (megaloop never promotes implicitly)."""


class RankError(GraphBuildError):
    """A rank, group or world size is unknown or inconsistent."""


class CycleError(GraphBuildError):
    """The data flow (within one rank or across ranks) contains a cycle."""


class NonFiniteError(GraphBuildError):
    """A constant or scalar argument holds NaN or infinity where the op forbids it."""


class PartitionMemoryError(GraphBuildError):
    """A partition needs more memory a device than memory_per_device allows."""


class CollectiveMismatchError(GraphBuildError):
    """Ranks disagree about a collective or a send/recv pair (kind, shape, dtype, order)."""


class EvaluationError(MegaloopError, ValueError):
    """Arrays handed to an evaluation do not match the graph (names, shapes, dtypes)."""


class DataError(MegaloopError, ValueError):
    """The values themselves break an op's rule (e.g. a token id outside the embedding table)."""


class InternalError(MegaloopError, AssertionError):
    """A megaloop invariant failed: this is a bug in megaloop, please report it with the graph."""


class PlanError(MegaloopError, ValueError):
    """A plan cannot run as it is: it is malformed, or it would race or deadlock."""


class PlanFormatError(PlanError):
    """A plan file does not follow the format (the message names the field)."""


class RaceError(PlanError):
    """Two tasks access overlapping bytes, one writing, with no happens-before order between them."""


class DeadlockError(PlanError):
    """The processors' task orders and waits can block each other forever."""


class UsageError(MegaloopError, ValueError):
    """A command asked for something it cannot do as written: a flag's value, a file it names (the
    message is the whole line the command prints; it exits with status 2)."""


class CheckpointError(MegaloopError, ValueError):
    """A model checkpoint that cannot be read or does not fit the model (names the file and tensor)."""


class CacheError(MegaloopError, OSError):
    """megaloop's on-disk cache (megaloop/diskcache.py) cannot be used as configured: its location is a
    file or not writable, its size cap is malformed, or clearing it would touch files not its own."""


class InterpreterError(MegaloopError, RuntimeError):
    """The plan interpreter saw a task read memory that holds the wrong version (or nothing yet)."""

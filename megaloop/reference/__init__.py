"""Reference backend: numpy execution that defines what every op means.

Today: graph-level evaluation of one rank or N simulated ranks (``evaluate``). Next: the plan
interpreter, which runs a plan's tile tasks in random legal orders on poisoned buffers."""

from megaloop.dtypes import to_numpy
from megaloop.reference.evaluate import Evaluation, evaluate

__all__ = ["Evaluation", "evaluate", "to_numpy"]

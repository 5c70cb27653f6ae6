"""Frontend: the graph builder, tensors, and the op set (each op defined once)."""

from megaloop.frontend import ops  # registers every op (REGISTRY) and gives Tensor its operators
from megaloop.frontend.graph import Graph, Node
from megaloop.frontend.opdef import REGISTRY, Accuracy, OpDef
from megaloop.frontend.tensor import Tensor

__all__ = ["REGISTRY", "Accuracy", "Graph", "Node", "OpDef", "Tensor", "ops"]

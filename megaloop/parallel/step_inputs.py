"""A split program's inputs kept on its ranks for many steps: each rank's input becomes a state
holding that input's piece for every step, ``data.<input>`` [steps, *piece], and the rank reads
step s's piece with ``step_batch`` by a step counter it keeps (a state it adds 1 to each iteration).

So a run of many iterations needs no host work between them (a training loop's token windows,
uploaded once): the partitioner cut the inputs (a data-parallel rank's sequences, a pipeline
stage's micro-batches), and each rank keeps exactly its pieces of every step's inputs. The values
are cut from one device's by the partition's own boxes (``StepInputs.state``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import megaloop.frontend.ops as ops
from megaloop.errors import EvaluationError, GraphBuildError
from megaloop.frontend.tensor import Tensor
from megaloop.frontend.validate import as_int
from megaloop.parallel.partition import Partition
from megaloop.parallel.shard import Box, Part

PREFIX = "data."


@dataclass
class StepInputs:
    """What ``inputs_by_step`` made: the counter state's name, the steps held, and for each rank its
    data states by name -> (the original input's name, the piece it holds)."""

    partition: Partition
    steps: int
    counter: str
    ranks: list[dict[str, tuple[str, Box]]] = field(default_factory=list)

    def state(self, values: Mapping[str, Any]) -> list[dict[str, np.ndarray]]:
        """Each rank's data states from one device's inputs for every step: ``values[name]`` is
        [steps, *the input's shape]; the counter starts at 0."""
        inputs = self.partition.original.inputs
        missing, unknown = sorted(set(inputs) - set(values)), sorted(set(values) - set(inputs))
        if missing or unknown:
            raise EvaluationError(f"step inputs: values missing for {missing}, unknown {unknown}")
        for name, t in inputs.items():
            shape = np.shape(values[name])
            if shape != (self.steps, *t.shape):
                raise EvaluationError(
                    f"step inputs: {name!r} has shape {list(shape)}; expected [{self.steps}, "
                    f"{', '.join(map(str, t.shape))}] (the input for each of the {self.steps} steps)"
                )
        out = []
        for table in self.ranks:
            mine = {self.counter: np.zeros((), np.int64)}
            for state, (name, box) in table.items():
                value = np.asarray(values[name])
                mine[state] = np.ascontiguousarray(
                    value[(slice(None), *(slice(lo, hi) for lo, hi in box))], inputs[name].dtype.np
                )
            out.append(mine)
        return out


def inputs_by_step(partition: Partition, steps: int, counter: str = "step") -> StepInputs:
    """Turn every rank's inputs into data states read by the step counter (module docstring), in
    place; ``steps``: how many steps' inputs a rank holds (step s reads s mod ``steps``)."""
    steps = as_int(steps, "inputs_by_step: steps", minimum=1)
    made = StepInputs(partition, steps, counter)
    for part in partition.parts:
        made.ranks.append(_resident(part, steps, counter))
    for g in partition.graphs:
        g.validate()
    return made


def _resident(part: Part, steps: int, counter: str) -> dict[str, tuple[str, Box]]:
    g = part.graph
    if counter in g.states or counter in g.inputs:
        raise GraphBuildError(f"inputs_by_step: rank {g.rank} already has a tensor named {counter!r}")
    first = len(g.nodes)
    step = g.state(counter, (), "int64")
    swap: dict[Tensor, Tensor] = {}
    table: dict[str, tuple[str, Box]] = {}
    for node, info in list(part.sources.items()):
        if info.kind != "input":
            continue
        t, local = node.outputs[0], node.attrs["name"]
        if PREFIX + local in g.states:
            raise GraphBuildError(f"inputs_by_step: rank {g.rank} already has a state named {PREFIX + local!r}")
        data = g.state(PREFIX + local, (steps, *t.shape), t.dtype)
        with g.scope("data"):
            swap[t] = ops.step_batch(data, step)
        table[PREFIX + local] = (info.name, info.box)
        del part.sources[node]
        del g.inputs[local]
    with g.scope("train"):
        g.assign(step, step + 1)
    new = g.nodes[first:]
    for n in g.nodes[:first]:
        if any(x in swap for x in n.inputs):
            n.inputs = tuple(swap.get(x, x) for x in n.inputs)
    for tbl in (g.outputs, g.state_updates):
        for k, v in tbl.items():
            tbl[k] = swap.get(v, v)
    gone = {t.node for t in swap}
    g.reorder([*new, *(n for n in g.nodes[:first] if n not in gone)])
    return table

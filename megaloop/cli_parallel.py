"""``megaloop plan --devices N`` / ``--mesh AxB``: the partitioner from the command line."""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from typing import Any

from megaloop.errors import GraphBuildError
from megaloop.frontend.graph import Graph
from megaloop.fuse import FuseOptions, fuse
from megaloop.parallel import H200, Mesh, parallelize


def parse_mesh(text: str) -> Mesh:
    """``2x8``: two nodes of eight devices (axes "node" and "gpu"); ``8``: one node of eight."""
    try:
        dims = tuple(int(x) for x in text.lower().split("x"))
    except ValueError:
        raise GraphBuildError(f"--mesh: {text!r} is not a mesh like 2x8 (nodes x GPUs a node)") from None
    if len(dims) == 1:
        return Mesh(dims, ("gpu",))
    if len(dims) == 2:
        return Mesh(dims, ("node", "gpu"))
    return Mesh(dims, tuple(f"axis{i}" for i in range(len(dims))))


def parse_strategy(text: str) -> Any:
    if "=" not in text:
        return text
    out = {}
    for item in text.split(","):
        axis, _, kind = item.partition("=")
        if not axis or not kind:
            raise GraphBuildError(f"--strategy: {item!r} should be AXIS=KIND, e.g. node=pp,gpu=tp")
        out[axis.strip()] = kind.strip()
    return out


def partition_for_cli(graph: Graph, args: argparse.Namespace, fusion: FuseOptions | None = None) -> list[Graph]:
    mesh = parse_mesh(args.mesh) if args.mesh else None
    if mesh is not None and args.devices is not None and mesh.size != args.devices:
        raise GraphBuildError(f"--mesh {args.mesh} has {mesh.size} devices but --devices says {args.devices}")
    devices = mesh if mesh is not None else args.devices
    machine = H200 if mesh is None or len(mesh.shape) < 2 else replace(H200, devices_per_node=mesh.shape[-1])
    strategy = parse_strategy(args.strategy)
    if isinstance(strategy, str) and mesh is not None and len(mesh.shape) > 1 and strategy != "auto":
        strategy = {name: strategy for name in mesh.names}
    t0 = time.perf_counter()
    partition = parallelize(fuse(graph, fusion), devices, strategy, machine=machine)  # (fused first: docs/fuse.md)
    print(f"partitioned in {time.perf_counter() - t0:.1f} s")
    print(partition.describe())
    print()
    return partition.graphs

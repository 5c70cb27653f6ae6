"""Parallel: programs over several ranks. ``parallelize`` splits a single-device graph over a mesh of
devices (tensor, pipeline, data and device parallelism, chosen by a cost model); ``spmd`` builds one
graph per rank by hand; ``match_ranks`` pairs collectives and transfers across ranks."""

from megaloop.frontend.placement import OnDevice, Partial, Placement, Replicate, Shard
from megaloop.parallel.cost import H200, Link, Machine
from megaloop.parallel.mesh import Mesh
from megaloop.parallel.parallelize import parallelize
from megaloop.parallel.partition import Partition, Prediction
from megaloop.parallel.ranks import Collective, RankMatching, Transfer, match_ranks, spmd
from megaloop.parallel.train_split import MemoryAccount, TrainingSplit
from megaloop.parallel.training import TrainingOptions, parallelize_training

__all__ = [
    "H200",
    "Collective",
    "Link",
    "Machine",
    "MemoryAccount",
    "Mesh",
    "OnDevice",
    "Partial",
    "Partition",
    "Placement",
    "Prediction",
    "RankMatching",
    "Replicate",
    "Shard",
    "TrainingOptions",
    "TrainingSplit",
    "Transfer",
    "match_ranks",
    "parallelize",
    "parallelize_training",
    "spmd",
]

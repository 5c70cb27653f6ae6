"""Parallel: programs over several ranks. Today: building one graph per rank (``spmd``) and matching
collectives and transfers across ranks (``match_ranks``). Next: splitting a single-device graph over
a device mesh (tensor / pipeline / data parallel) with the collectives inserted."""

from megaloop.parallel.ranks import Collective, RankMatching, Transfer, match_ranks, spmd

__all__ = ["Collective", "RankMatching", "Transfer", "match_ranks", "spmd"]

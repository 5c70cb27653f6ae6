"""Activation recomputation."""

from __future__ import annotations

from megaloop.frontend.graph import Graph


def recompute_layers(g: Graph) -> None:
    return None

"""Fusion: graph rewrites between the frontend and the plan. Each fused op declares, in its own module
of megaloop/fuse/rules/, the pattern of plain ops it replaces and when; ``fuse`` makes them, and
``make_plan`` calls it on every graph it plans (``FuseOptions``, saved in the plan, say which
rewrites run). Model builders build plain graphs. docs/fuse.md."""

from megaloop.fuse.options import FuseOptions
from megaloop.fuse.rewrite import fuse
from megaloop.fuse.rule import RULES, Rule, ordered_rules

__all__ = ["RULES", "FuseOptions", "Rule", "fuse", "ordered_rules"]

"""``Rule``: one graph rewrite, declared by the module of the fused op it makes (megaloop/fuse/rules/),
and the registry those modules fill. Adding a fused op's rewrite is adding one module there: the
folder is read whole (``load_rules``), no list names the rules."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megaloop.frontend.graph import Node
    from megaloop.fuse.rewrite import Rewriter


@dataclass(frozen=True)
class Rule:
    """A pattern of plain ops that one fused op (or op form) replaces.

    ``fire(node, rw)`` looks at ``node`` (an op named in ``roots``, where the pattern ends), checks
    the pattern and its conditions, and only then makes the change through ``rw`` (megaloop.fuse.
    rewrite.Rewriter) and returns True; else it changes nothing and returns False. ``after``: rules
    whose rewrites must be made first (their result is this rule's pattern, or must not be taken by
    it). ``differs``: "" when the rewrite gives the plain ops' values bit for bit, else how it does not.
    ``default``: whether it runs unless turned off (False: only when FuseOptions name it in ``on``, for a
    fused op not yet measured on the GPU). ``last``: it runs after every rule that is not (it takes what
    the others leave, e.g. the plain ops their patterns did not hold).
    """

    name: str  # what FuseOptions call it
    makes: str  # the registry op it makes (documentation, tests: its OpDef must exist)
    roots: tuple[str, ...]
    doc: str
    fire: Callable[[Node, Rewriter], bool]
    after: tuple[str, ...] = ()
    differs: str = ""
    default: bool = True
    last: bool = False


RULES: dict[str, Rule] = {}


def register_rule(rule: Rule) -> Rule:
    if rule.name in RULES:
        raise ValueError(f"fusion rule {rule.name!r} is defined twice; each rule has exactly one definition")
    RULES[rule.name] = rule
    return rule


_loaded = False


def load_rules() -> None:
    """Import every module of megaloop/fuse/rules (each registers its rules) once."""
    global _loaded
    if _loaded:
        return
    package = importlib.import_module("megaloop.fuse.rules")
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        importlib.import_module(f"{package.__name__}.{info.name}")
    _loaded = True


def ordered_rules() -> list[Rule]:
    """Every rule, each after the rules it names in ``after`` (otherwise by name), the ``last`` ones last."""
    load_rules()
    done: list[Rule] = []
    placed: set[str] = set()
    pending = sorted(RULES.values(), key=lambda r: r.name)
    for r in pending:
        unknown = set(r.after) - set(RULES)
        if unknown:
            raise ValueError(f"fusion rule {r.name!r} runs after {sorted(unknown)}, which no module defines")
    while pending:
        firsts = [r for r in pending if not r.last]
        ready = [r for r in firsts or pending if set(r.after) <= placed]
        if not ready:
            raise ValueError(f"fusion rules {[r.name for r in pending]} each wait for another ('after' has a cycle)")
        done.append(ready[0])
        placed.add(ready[0].name)
        pending.remove(ready[0])
    return done


def rule_names() -> list[str]:
    """The registered rules' names, in the order they run."""
    return [r.name for r in ordered_rules()]

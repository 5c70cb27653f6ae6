"""``FuseOptions``: which graph rewrites ``make_plan`` applies (megaloop.fuse). They travel in the
plan (its "fusion" entry, docs/plan-format.md), so a plan file says which rewrites made its graph."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megaloop.errors import GraphBuildError
from megaloop.fuse.rule import RULES, load_rules, rule_names


@dataclass(frozen=True)
class FuseOptions:
    """The rules of ``megaloop.fuse.RULES`` that run by default, but those named in ``off``, and the
    rules that run only when asked for (``Rule.default`` False: not measured yet) named in ``on``;
    ``enabled=False``: none (the graph planned exactly as built). Rule names are those of docs/fuse.md
    (``rmsnorm_linear``, ``swiglu_linear``, ``attention_append``, ``split_k_linear``, ...)."""

    enabled: bool = True
    off: tuple[str, ...] = ()
    on: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("off", "on"):
            names = getattr(self, name)
            if isinstance(names, str):
                raise GraphBuildError(f"FuseOptions.{name}: a list of rule names, got the string {names!r}")
            object.__setattr__(self, name, tuple(sorted(set(names))))

    @classmethod
    def none(cls) -> FuseOptions:
        """No rewrite: the graph planned as it was built."""
        return cls(enabled=False)

    @classmethod
    def only(cls, *names: str) -> FuseOptions:
        """Just the rules ``names`` (each checked against the registered rules)."""
        known = rule_names()
        _check_names(names, known, "FuseOptions.only")
        return cls(off=tuple(n for n in known if n not in names), on=tuple(n for n in names if not RULES[n].default))

    def without(self, *names: str) -> FuseOptions:
        """These options with the rules ``names`` off too."""
        return FuseOptions(self.enabled, (*self.off, *names), tuple(n for n in self.on if n not in names))

    def adding(self, *names: str) -> FuseOptions:
        """These options with the rules ``names`` on too (those off by default included)."""
        return FuseOptions(self.enabled, tuple(n for n in self.off if n not in names), (*self.on, *names))

    @classmethod
    def parse(cls, text: str) -> FuseOptions:
        """Command-line form: "all" (or ""): the default rules; "none"; "-split_k_linear,+name"
        (the default rules, less or more those); "rmsnorm_linear,swiglu_linear" (only those)."""
        names = [n.strip() for n in str(text).split(",") if n.strip()]
        if names in ([], ["all"]):
            return cls()
        if names == ["none"]:
            return cls.none()
        signed = [n for n in names if n[0] in "+-"]
        if signed and len(signed) != len(names):
            raise GraphBuildError(
                f"fusion {text!r}: either name the rules to run or, each with a leading '-' or '+', the rules to "
                "leave out of the default ones or add to them"
            )
        if not signed:
            return cls.only(*names)
        off, on = [n[1:] for n in names if n[0] == "-"], [n[1:] for n in names if n[0] == "+"]
        _check_names(off + on, rule_names(), f"fusion {text!r}")
        return cls(off=tuple(off), on=tuple(on))

    def applies(self, name: str) -> bool:
        load_rules()
        rule = RULES.get(name)
        return self.enabled and name not in self.off and (name in self.on or (rule is not None and rule.default))

    def check(self, error: type, where: str) -> None:
        """Raise ``error`` naming the field unless ``enabled`` is a bool and ``off`` and ``on`` name known
        rules."""
        if not isinstance(self.enabled, bool):
            raise error(f"{where}.enabled: must be true or false, got {self.enabled!r}")
        for name in ("off", "on"):
            try:
                _check_names(getattr(self, name), rule_names(), f"{where}.{name}")
            except GraphBuildError as e:
                raise error(str(e)) from None

    def to_dict(self) -> dict[str, Any]:
        return {"enabled": self.enabled, "off": list(self.off), "on": list(self.on)}


def _check_names(names: Any, known: list[str], where: str) -> None:
    bad = [n for n in names if not isinstance(n, str) or n not in known]
    if bad:
        raise GraphBuildError(f"{where}: unknown rule {bad[0]!r}; the rules are {', '.join(known)}")

"""``FuseOptions``: which graph rewrites ``make_plan`` applies (megaloop.fuse). They travel in the
plan (its "fusion" entry, docs/plan-format.md), so a plan file says which rewrites made its graph."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megaloop.errors import GraphBuildError
from megaloop.fuse.rule import rule_names


@dataclass(frozen=True)
class FuseOptions:
    """Every rule of ``megaloop.fuse.RULES`` but those named in ``off``; ``enabled=False``: none (the
    graph planned exactly as built). Rule names are those of docs/fuse.md (``rmsnorm_linear``,
    ``swiglu_linear``, ``attention_append``, ``split_k_linear``, ...)."""

    enabled: bool = True
    off: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.off, str):
            raise GraphBuildError(f"FuseOptions.off: a list of rule names, got the string {self.off!r}")
        object.__setattr__(self, "off", tuple(sorted(set(self.off))))

    @classmethod
    def none(cls) -> FuseOptions:
        """No rewrite: the graph planned as it was built."""
        return cls(enabled=False)

    @classmethod
    def only(cls, *names: str) -> FuseOptions:
        """Just the rules ``names`` (each checked against the registered rules)."""
        known = rule_names()
        _check_names(names, known, "FuseOptions.only")
        return cls(off=tuple(n for n in known if n not in names))

    def without(self, *names: str) -> FuseOptions:
        """These options with the rules ``names`` off too."""
        return FuseOptions(self.enabled, (*self.off, *names))

    @classmethod
    def parse(cls, text: str) -> FuseOptions:
        """Command-line form: "all" (or ""), "none", "-split_k_linear,-attention_append" (all but
        those), or "rmsnorm_linear,swiglu_linear" (only those)."""
        names = [n.strip() for n in str(text).split(",") if n.strip()]
        if names in ([], ["all"]):
            return cls()
        if names == ["none"]:
            return cls.none()
        dropped = [n[1:] for n in names if n.startswith("-")]
        if dropped and len(dropped) != len(names):
            raise GraphBuildError(
                f"fusion {text!r}: either name the rules to run or, each with a leading '-', the rules to leave out"
            )
        if dropped:
            _check_names(dropped, rule_names(), f"fusion {text!r}")
            return cls(off=tuple(dropped))
        return cls.only(*names)

    def applies(self, name: str) -> bool:
        return self.enabled and name not in self.off

    def check(self, error: type, where: str) -> None:
        """Raise ``error`` naming the field unless ``enabled`` is a bool and ``off`` names known rules."""
        if not isinstance(self.enabled, bool):
            raise error(f"{where}.enabled: must be true or false, got {self.enabled!r}")
        try:
            _check_names(self.off, rule_names(), f"{where}.off")
        except GraphBuildError as e:
            raise error(str(e)) from None

    def to_dict(self) -> dict[str, Any]:
        return {"enabled": self.enabled, "off": list(self.off)}


def _check_names(names: Any, known: list[str], where: str) -> None:
    bad = [n for n in names if not isinstance(n, str) or n not in known]
    if bad:
        raise GraphBuildError(f"{where}: unknown rule {bad[0]!r}; the rules are {', '.join(known)}")

"""``OptimizerSpec``: an optimizer's settings as a value (kind and keyword arguments), so that whoever
builds a training step (megaloop.parallel.training, for every rank of a split) can attach the same
optimizer, serialize the settings and show them, with no graph at hand yet."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from megaloop.errors import GraphBuildError
from megaloop.frontend.graph import Graph
from megaloop.frontend.tensor import Tensor
from megaloop.optim.attach import NormOver, Optimizer, Schedule, adamw, sgd

KINDS = {"adamw": adamw, "sgd": sgd}
# what each kind takes besides graph, params and grads (its signature's keywords)
OPTIONS = {
    "adamw": ("lr", "betas", "eps", "weight_decay", "schedule", "max_norm", "accumulate", "master", "prefix"),
    "sgd": (
        "lr",
        *("momentum", "dampening", "nesterov", "weight_decay", "schedule", "max_norm", "accumulate", "master"),
        "prefix",
    ),
}


@dataclass(frozen=True)
class OptimizerSpec:
    """``OptimizerSpec("adamw", lr=3e-4, weight_decay=0.1, max_norm=1.0)``: what ``ml.optim.adamw`` or
    ``ml.optim.sgd`` would be called with. ``as_dict`` / ``from_dict`` round-trip it through JSON."""

    kind: str
    options: tuple[tuple[str, Any], ...]

    def __init__(self, kind: str, **options: Any) -> None:
        if kind not in KINDS:
            raise GraphBuildError(f"OptimizerSpec: kind must be one of {sorted(KINDS)}, got {kind!r}")
        unknown = sorted(set(options) - set(OPTIONS[kind]))
        if unknown:
            raise GraphBuildError(f"OptimizerSpec: {kind} takes no {unknown}; it takes {list(OPTIONS[kind])}")
        if "lr" not in options:
            raise GraphBuildError(f"OptimizerSpec: {kind} needs lr=")
        if isinstance(options.get("schedule"), Mapping):
            options["schedule"] = Schedule(**options["schedule"])
        if isinstance(options.get("betas"), list):
            options["betas"] = tuple(options["betas"])
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "options", tuple(sorted(options.items())))

    def get(self, name: str, default: Any = None) -> Any:
        return dict(self.options).get(name, default)

    def attach(
        self,
        graph: Graph,
        params: Mapping[str, Tensor] | Sequence[Tensor],
        grads: Mapping[str, Tensor] | Sequence[Tensor],
        *,
        weight_decay: Any = None,
        norm_over: NormOver | None = None,
    ) -> Optimizer:
        """The optimizer added to ``graph``; ``weight_decay`` (one a parameter) stands in for the spec's
        where given (a split step's flat shards take their parameters' decay)."""
        kw = dict(self.options)
        if weight_decay is not None:
            kw["weight_decay"] = weight_decay
        return KINDS[self.kind](graph, params, grads, norm_over=norm_over, **kw)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind}
        for k, v in self.options:
            out[k] = v.__dict__ if isinstance(v, Schedule) else list(v) if isinstance(v, tuple) else v
        return out

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> OptimizerSpec:
        d = dict(d)
        return OptimizerSpec(d.pop("kind"), **d)

    def __repr__(self) -> str:
        return f"OptimizerSpec({self.kind!r}, " + ", ".join(f"{k}={v!r}" for k, v in self.options) + ")"

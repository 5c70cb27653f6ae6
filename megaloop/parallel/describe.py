"""``Partition.describe``: where every parameter and op of the single-device graph went, and why, in
words. Lines that repeat for every layer of a model (names that differ only in layer numbers and node
ids) are said once, with ``*`` for the layer and how many there are."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from megaloop.frontend.placement import Partial, Replicate, Shard

_LAYER = re.compile(r"\.(\d+)\.")
_ID = re.compile(r"_\d+$")
_GENERIC_IN_TEXT = re.compile(r"[\w.]*\.\d+\.[\w.]*_\d+|\b[a-z_]+_\d+\b")
KIND_WORDS = {"tp": "tensor parallel", "dp": "data parallel", "pp": "pipeline", "device": "device parallel"}


def _generic(name: str) -> str:
    return _ID.sub("", _LAYER.sub(".*.", name))


def _grouped(lines: Iterable[tuple[str, str]]) -> list[str]:
    """(name, text) pairs: consecutive names alike but for layer numbers and ids become one line."""
    out: list[tuple[str, str, int]] = []
    index: dict[tuple[str, str], int] = {}
    for name, text in lines:
        key = (_generic(name), _GENERIC_IN_TEXT.sub(lambda m: _generic(m.group(0)), text))
        if key in index:
            g, t, k = out[index[key]]
            out[index[key]] = (g, t, k + 1)
        else:
            index[key] = len(out)
            out.append((key[0], key[1], 1))
    return [f"  {g}: {t}" + (f" (x{k})" if k > 1 else "") for g, t, k in out]


def describe(partition: Any) -> str:
    p = partition
    plan = p.plan
    lines = [_headline(p)]
    lines += [f"  note: {n}" for n in p.notes]
    if p.candidates:
        lines += ["", "Candidates the cost model compared:", _candidate_table(p)]
    lines += ["", "Parameters:"]
    lines += _grouped(_parameter_lines(p))
    if p.decisions:
        lines += ["", "Ops (how each runs on its group):"]
        lines += _grouped(_op_lines(p))
    if any(p.exchanges.values()):
        lines += ["", "Exchanges inserted (each step of each rank):"]
        lines += _grouped(_exchange_lines(p))
    if p.stage_of and plan is not None:
        lines += ["", "Stages:"]
        lines += _stage_lines(p)
    return "\n".join(lines)


def _headline(p: Any) -> str:
    plan, pred = p.plan, p.predicted
    kinds = (
        ", ".join(f"{KIND_WORDS.get(k, k)} over {s}" for k, s in zip(plan.kinds, plan.mesh.shape) if s > 1)
        if plan
        else ""
    )
    head = f"Partition of {p.original.name!r} over {p.world_size} device(s)"
    if plan is not None:
        head += f": {plan.label}" + (f" ({kinds})" if kinds else "")
    if pred is not None:
        head += (
            f"\n  predicted {pred.step_us:.1f} us a step, {pred.exchanged_bytes / 2**20:.2f} MiB exchanged a step, "
            f"at most {max(pred.memory_bytes) / 2**30:.3f} GiB a device"
        )
    return head


def _candidate_table(p: Any) -> str:
    rows = [("candidate", "step (us)", "exchanged (MiB)", "memory/device (GiB)")]
    for c in p.candidates:
        chosen = " (chosen)" if c.plan == p.plan else ""
        if c.predicted is None:
            rows.append((c.plan.label + chosen, "-", "-", c.error[:60]))
        else:
            rows.append(
                (
                    c.plan.label + chosen,
                    f"{c.predicted.step_us:.1f}",
                    f"{c.predicted.exchanged_bytes / 2**20:.2f}",
                    f"{max(c.predicted.memory_bytes) / 2**30:.3f}" + (f"  {c.error}" if c.error else ""),
                )
            )
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  " + "  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows)


def _parameter_lines(p: Any) -> Iterable[tuple[str, str]]:
    consumers: dict[str, Any] = {}
    for node in p.original.nodes:
        for t in node.inputs:
            if t.node.op.name == "parameter":
                consumers.setdefault(t.node.attrs["name"], node)
    for name, t in p.original.parameters.items():
        boxes = {}
        for part in p.parts:
            for info in part.sources.values():
                if info.kind == "parameter" and info.name == name:
                    boxes.setdefault(part.graph.rank, []).append(info.box)
        text = _where(t.shape, boxes, p.world_size)
        user = consumers.get(name)
        if user is not None:
            why = _strategy_words(p, user)
            if why:
                text += f"; {user.op.name} {user.name} runs {why}"
        yield name, f"{t.dtype.short}{list(t.shape)} {text}"


def _where(shape: tuple[int, ...], boxes: dict[int, list], world: int) -> str:
    ranks = sorted(boxes)
    pieces = {tuple(b) for bs in boxes.values() for b in bs}
    who = "every rank" if len(ranks) == world else f"ranks {_ranges(ranks)}"
    if len(pieces) == 1:
        return f"whole on {who}"
    axes = [a for a in range(len(shape)) if len({b[a] for b in pieces}) > 1]
    cut = ", ".join(f"axis {a} ({len({b[a] for b in pieces})} pieces)" for a in axes)
    return f"cut along {cut} over {who}"


def _ranges(ranks: list[int]) -> str:
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(f"{start}" if start == r else f"{start}-{r}")
            start = None
    return ", ".join(out)


def _strategy_words(p: Any, node: Any) -> str:
    words = []
    for kind, chosen in p.decisions.items():
        s = chosen.get(node)
        if s is not None and s.label != "replicated":
            words.append(f"{s.label} ({kind})")
    return ", ".join(words) or ("whole on its devices" if p.decisions else "")


def _op_lines(p: Any) -> Iterable[tuple[str, str]]:
    for node in p.original.nodes:
        if node.op.kind in ("source", "view"):
            continue
        words = []
        for kind, chosen in p.decisions.items():
            s = chosen.get(node)
            if s is None:
                continue
            outs = ", ".join(_placement_words(x) for x in s.outputs)
            words.append(f"{kind}: {s.label} -> {outs}")
        if words:
            yield node.name, f"{node.op.name}; " + "; ".join(words)


def _placement_words(x: Any) -> str:
    if isinstance(x, Replicate):
        return "whole"
    if isinstance(x, Shard):
        return f"cut on axis {x.axis}"
    if isinstance(x, Partial):
        return f"partial {x.op}s"
    return str(x)


def _exchange_lines(p: Any) -> Iterable[tuple[str, str]]:
    for kind, found in p.exchanges.items():
        for producer, step, source, target, consumer in found:
            why = f" for {consumer.op.name} {consumer.name}" if consumer is not None else " (a state update or output)"
            yield (
                producer.name,
                (
                    f"{step} over {kind}: {producer.op.name}'s {_placement_words(source)} value made "
                    f"{_placement_words(target)}{why}"
                ),
            )


def _stage_lines(p: Any) -> list[str]:
    by_stage: dict[int, list[Any]] = {}
    for node in p.original.nodes:
        if node.op.kind not in ("source", "view") and node in p.stage_of:
            by_stage.setdefault(p.stage_of[node], []).append(node)
    lines = []
    for s in sorted(by_stage):
        nodes = by_stage[s]
        scopes = sorted(
            {n.scope.split(".")[1] if n.scope.startswith("layers.") else n.scope or "(top)" for n in nodes},
            key=lambda x: (not x.isdigit(), int(x) if x.isdigit() else 0, x),
        )
        layers = [x for x in scopes if x.isdigit()]
        other = [x for x in scopes if not x.isdigit()]
        what = (f"layers {layers[0]}-{layers[-1]}" if len(layers) > 1 else f"layer {layers[0]}") if layers else ""
        what = ", ".join(filter(None, [what, *other]))
        lines.append(f"  stage {s}: {len(nodes)} ops ({what}), {nodes[0].name} .. {nodes[-1].name}")
    return lines

"""``Partition.describe``: where every parameter and op of the single-device graph went, and why, in
words. Lines that repeat for every layer of a model (names that differ only in layer numbers and node
ids) are said once, with ``*`` for the layer and how many there are."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from megaloop.frontend.placement import Partial, Replicate, Shard
from megaloop.parallel.axes import batch_class
from megaloop.parallel.shard import Part

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
    if plan is None:
        return f"Partition of {p.original.name!r} over {p.world_size} device(s)"
    if p.world_size == 1:
        head = f"Partition of {p.original.name!r}: one device, the program unsplit"
    else:
        head = f"Partition of {p.original.name!r} over {p.world_size} device(s): {plan.label} ({how(p)})"
    if pred is not None:
        alone = p.one_device
        versus = f" (one device: {alone.step_us:.1f} us)" if alone is not None and p.world_size > 1 else ""
        head += (
            f"\n  predicted {pred.step_us:.1f} us a step{versus}, {pred.exchanged_bytes / 2**20:.2f} MiB exchanged "
            f"a step, at most {max(pred.memory_bytes) / 2**30:.3f} GiB a device"
        )
        shares = work_shares(p)
        if shares and p.world_size > 1:
            head += "\n  work a rank, of one device's: " + ", ".join(f"{100 * x:.0f}%" for x in shares)
    return head


def summary(p: Any) -> str:
    """One line: the split, what it divides, its predicted step against one device's."""
    pred, alone = p.predicted, p.one_device
    if p.world_size == 1:
        splits = [c for c in p.candidates if c.predicted is not None and c.plan.mesh.size > 1]
        fastest = min(splits, key=lambda c: c.predicted.step_us, default=None)
        if fastest is None:
            return "one device"
        return (
            f"one device, no split predicted faster ({pred.step_us:.1f} us a step; the fastest split, "
            f"{fastest.plan.label}, {fastest.predicted.step_us:.1f} us)"
        )
    text = f"{p.plan.label} ({how(p)})"
    if pred is not None:
        text += f", {pred.step_us:.1f} us a step predicted"
        text += f" against {alone.step_us:.1f} us on one device" if alone is not None else ""
    return text


def how(p: Any) -> str:
    """What each kind of the plan divides, in words: "tensor parallel over 2: by weights"."""
    out = []
    for kind, size in zip(p.plan.kinds, p.plan.mesh.shape):
        if size > 1:
            out.append(f"{KIND_WORDS.get(kind, kind)} over {size}: {_divides(p, kind)}")
    return "; ".join(out)


def work_shares(p: Any) -> list[float]:
    """Each rank's work (its ops' tiles, no exchanges) as a fraction of the unsplit program's."""
    if p.predicted is None or p.one_device is None:
        return []
    whole = p.one_device.detail.get("work_us", [0.0])[0]
    mine = p.predicted.detail.get("work_us", [])
    return [w / whole for w in mine] if whole > 0 else []


def _divides(p: Any, kind: str) -> str:
    if kind == "pp":
        return "by layers" if any(line.count("layer") for line in _stage_lines(p)) else "by program order"
    if kind == "device":
        return "by branches"
    chosen = p.decisions.get(kind, {})
    n = p.plan.size(kind)
    cls, batch = batch_class(Part.whole(p.original), n)
    g = p.original
    positions = {cls(t, 1) for t in g.inputs.values() if t.ndim >= 2 and t.shape[1] > 1 and cls(t, 0) == batch}
    full = {name: tuple((0, s) for s in t.shape) for name, t in g.parameters.items()}
    stored_cut = any(
        info.kind == "parameter" and info.box != full[info.name] for part in p.parts for info in part.sources.values()
    )
    found: set[str] = set()
    for node, s in chosen.items():
        for t, x in (*zip(node.inputs, s.inputs), *zip(node.outputs, s.outputs)):
            if not isinstance(x, Shard):
                continue
            if cls(t, x.axis) == batch:
                found.add("sequences")
            elif t.node.op.name == "parameter" and stored_cut:  # (a slice of a whole one: features)
                found.add("weights")
            elif cls(t, x.axis) in positions:
                found.add("positions")
            else:
                found.add("features")
    if "weights" in found:  # (the activations a weight's cut makes: heads, features)
        found.discard("features")
    words = [w for w in ("sequences", "weights", "positions", "features") if w in found]
    return "by " + " and ".join(words) if words else "nothing cut: every rank runs the whole program"


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

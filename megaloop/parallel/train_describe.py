"""``TrainingSplit.describe`` and ``summary``: the split in words, as ``Partition.describe`` does for
a forward: the choice and its prediction, the candidates compared, each rank's memory by kind, the
gradient exchange's buckets, then the forward's own account."""

from __future__ import annotations

from typing import Any

KIND_WORDS = {
    "dp": "data parallel",
    "zero1": "data parallel, ZeRO-1 (optimizer states sharded)",
    "zero2": "data parallel, ZeRO-2 (gradients and optimizer states sharded)",
    "tp": "tensor parallel",
    "pp": "pipeline",
}


def _size(n: float) -> str:
    if n >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    if n >= 2**20:
        return f"{n / 2**20:.2f} MiB"
    return f"{n / 2**10:.1f} KiB"


def summary(split: Any) -> str:
    o = split.options
    kinds = "; ".join(f"{KIND_WORDS[k]} over {s}" for k, s in o.axes) or "one device"
    extra = []
    if o.micro_batches > 1:
        extra.append(f"{o.micro_batches} micro-batches")
    if o.recompute:
        extra.append("recomputing activations")
    more = f", {', '.join(extra)}" if extra else ""
    return (
        f"{o.strategy} ({kinds}{more}): {split.predicted.step_us:.1f} us a step predicted, "
        f"at most {_size(split.peak_bytes)} a rank"
    )


def describe(split: Any) -> str:
    o = split.options
    lines = [f"Training split of {split.original.name!r} over {split.world_size} device(s): {summary(split)}"]
    lines.append(f"  optimizer: {o.optimizer!r}; loss {o.loss!r} seeded 1/(ranks holding it) on each")
    lines += [f"  note: {n}" for n in split.notes]
    if split.candidates:
        lines += ["", "Candidates the cost model compared (step, most memory a rank):"]
        limit = split.memory_limit
        for c in split.candidates:
            mark = "*" if c.options == o else " "
            if c.predicted is None:
                lines.append(f"  {mark} {c.options.strategy:<16} {c.error}")
                continue
            fit = "" if limit is None or c.peak_bytes <= limit else f"  does not fit {_size(limit)}"
            lines.append(
                f"  {mark} {c.options.strategy:<16} {c.predicted.step_us:10.1f} us  {_size(c.peak_bytes):>10}{fit}"
            )
    lines += ["", "Memory a rank (parameters, gradients, optimizer states, activations at their peak, other state):"]
    for r, m in enumerate(split.memory):
        lines.append(
            f"  rank {r}: {_size(m.parameters)}, {_size(m.gradients)}, {_size(m.optimizer)}, {_size(m.activations)} "
            f"({_size(m.saved)} kept for the backward), {_size(m.other_state)}; total {_size(m.total)}"
        )
    if split.buckets:
        lines += ["", "Gradient exchange (in the order the backward makes them, each as soon as its gradients exist):"]
        how = {
            0: "all_reduce",
            1: "all_reduce, own shard updated, all_gather",
            2: "reduce_scatter, own shard updated, all_gather",
        }
        for b in split.buckets:
            names = ", ".join(p.name for p in b.pieces[:3]) + (
                f" and {len(b.pieces) - 3} more" if len(b.pieces) > 3 else ""
            )
            lines.append(f"  bucket {b.index}: ranks {list(b.group)}, {_size(b.nbytes)} ({how[o.zero]}): {names}")
    lines += ["", "The forward's split:", split.forward.describe()]
    return "\n".join(lines)

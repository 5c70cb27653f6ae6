"""Each rank's loop kernel written out for reading: its CUDA source and a table of its tasks (which op,
graph node and tile each is, where it runs and what it waits for). ``megaloop plan --dump DIR``."""

from __future__ import annotations

from pathlib import Path

from megaloop.codegen.kernel import generate
from megaloop.errors import MegaloopError
from megaloop.plan.model import Plan

TABLE_COLUMNS = ("task", "processor", "position", "sig", "op", "node", "tile", "box", "waits", "signal")


class DumpError(MegaloopError):
    """A dump that would replace files, or cannot be written."""


def dump_files(plan: Plan) -> list[str]:
    """The names ``dump`` writes, rank by rank: kernel source, then task table."""
    if plan.world_size == 1:
        return ["kernel.cu", "tasks.tsv"]
    return [name for r in range(plan.world_size) for name in (f"kernel_rank{r}.cu", f"tasks_rank{r}.tsv")]


def check_folder(folder: str | Path, force: bool = False) -> Path:
    """Refuse, before any work, a folder that is a file or holds a dump already (unless ``force``)."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise DumpError(f"dump: {folder} is a file; give a folder for the kernel source and task table")
    found = [*folder.glob("kernel*.cu"), *folder.glob("tasks*.tsv")] if folder.is_dir() else []
    existing = sorted(p.name for p in found)
    if existing and not force:
        raise DumpError(
            f"dump: {folder} already holds {', '.join(existing)}; pass --force (force=True) to replace them, "
            "or give another folder"
        )
    return folder


def dump(plan: Plan, folder: str | Path, *, force: bool = False) -> list[Path]:
    """Write each rank's kernel source and task table into ``folder`` (made if missing); refuses to
    replace an existing dump unless ``force``. Returns the paths written."""
    folder = check_folder(folder, force)
    paths = [folder / name for name in dump_files(plan)]
    folder.mkdir(parents=True, exist_ok=True)
    for rank in range(plan.world_size):
        program = generate(plan, rank)
        paths[2 * rank].write_text(program.source)
        paths[2 * rank + 1].write_text(task_table(plan, rank, [int(s) for s in program.tasks["sig"]]))
    return paths


def task_table(plan: Plan, rank: int, sigs: list[int]) -> str:
    """Tab-separated, one row a task in id order: its processor and place in that processor's list, its
    tile function (sig_N in the source), op, graph node, tile coordinates, output box, waits, counter."""
    rp = plan.ranks[rank]
    where = {tid: (p, k) for p, lst in enumerate(rp.processors) for k, tid in enumerate(lst)}
    rows = ["\t".join(TABLE_COLUMNS)]
    for t in rp.tasks:
        op = rp.ops[t.op]
        proc, pos = where.get(t.id, (-1, -1))
        box = " ".join(f"{lo}:{hi}" for lo, hi in zip(t.writes[0].box.lo, t.writes[0].box.hi)) if t.writes else ""
        waits = " ".join(_wait(w.rank, w.counter, w.lag, rank) for w in t.waits)
        tile = ",".join(str(c) for c in t.coords)
        cells = (t.id, proc, pos, f"sig_{sigs[t.id]}", op.op, op.name, tile, box, waits or "-", f"c{t.signal}")
        rows.append("\t".join(str(c) for c in cells))
    return "\n".join(rows) + "\n"


def _wait(on: int, counter: int, lag: int, rank: int) -> str:
    """A wait as the table writes it: c<counter>, r<rank>.c<counter> on another rank, @1 for lag 1."""
    return f"{f'r{on}.' if on != rank else ''}c{counter}{f'@{lag}' if lag else ''}"

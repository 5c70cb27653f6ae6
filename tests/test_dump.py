"""The readable kernel: `megaloop plan --dump DIR` (megaloop.codegen.dump) writes each rank's source
and a task table, refuses to replace a dump unasked, and the source (tidied, megaloop/codegen/tidy.py)
has no `x * 1`, `0 + x`, `x + 0`, one-trip loop or variable declared and never used."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import megaloop as ml
from megaloop.codegen.dump import DumpError, dump
from megaloop.codegen.tidy import tidy
from megaloop.models import LlamaConfig, build_llama
from megaloop.plan import make_plan

ROOT = Path(__file__).resolve().parents[1]
CFG = LlamaConfig(hidden=64, heads=4, kv_heads=2, intermediate=96, layers=2, max_seq=16, vocab=40)


def untidy(source: str) -> list[str]:
    """Lines of ``source`` with a pattern the dump must not have, each with what it is."""
    found = []
    lines = source.split("\n")
    code = [line.split("//", 1)[0] for line in lines]
    for n, line in enumerate(code, 1):
        for what, pattern in (
            ("* 1", r" \* 1(?![\w.])"),
            ("1 *", r"(?<=[(=,?:+-] )1 \* |\(1 \* "),
            ("0 +", r"(?<=[(=,?:] )0 \+ |\(0 \+ "),
            ("+ 0", r" \+ 0(?=[;),\]])|\+ 0 \* "),
            ("one-trip loop", r"for \((?:int|unsigned) (\w+) = 0; \1 < 1;"),
            ("unused marker", r"\(void\)\w+;|\[\[maybe_unused\]\]"),
        ):
            if re.search(pattern, line):
                found.append(f"{n}: {what}: {lines[n - 1].strip()}")
    # every name a `const` declaration introduces is read somewhere after it
    for n, line in enumerate(code):
        for name in re.findall(r"\bconst (?:[\w:<>]+\*? )+(\w+) = ", line):
            rest = line[line.index(f"{name} = ") + len(name) + 3 :] + "\n".join(code[n + 1 :])
            if not re.search(rf"(?<![\w.]){name}\b", rest):
                found.append(f"{n + 1}: unused {name}: {lines[n].strip()}")
    return found


@pytest.mark.parametrize("batch,tokens", [(1, 1), (2, 5)])
def test_dumped_llama_block_reads_clean(tmp_path: Path, batch: int, tokens: int) -> None:
    plan = make_plan(build_llama(CFG, batch, tokens), processors=8)
    paths = dump(plan, tmp_path / "dump")
    assert [p.name for p in paths] == ["kernel.cu", "tasks.tsv"]
    source = paths[0].read_text()
    bad = untidy(source)
    assert not bad, f"{len(bad)} untidy lines, the first: " + "\n".join(bad[:10])
    rows = [line.split("\t") for line in paths[1].read_text().splitlines()]
    header, rows = rows[0], rows[1:]
    assert header[:8] == ["task", "processor", "position", "sig", "op", "node", "tile", "box"]
    rp = plan.ranks[0]
    assert len(rows) == len(rp.tasks)
    for row, t in zip(rows, rp.tasks):
        op = rp.ops[t.op]
        assert row[4:7] == [op.op, op.name, ",".join(map(str, t.coords))]
        assert rp.processors[int(row[1])][int(row[2])] == t.id
        assert f"void {row[3]}(" in source


def test_tidy_keeps_meaning_where_it_cannot_prove_it() -> None:
    """The rewrites on made-up lines: each pattern goes, lookalikes stay."""
    got = tidy(
        [
            "const ml::i64 x = 0 + (ml::i64)i[0] * 1 + (ml::i64)i[1] * 16;",
            "y = a - 0 + b * 1.0f + c * 1LL + d * 16;",
            "#pragma unroll",
            "for (int u = 0; u < 1; ++u) {",
            "    if (e0 + u * blockDim.x >= total) break;",
            "    p[u] = q[u] + x1;",
            "}",
            "for (int k = 0; k < 1; ++k) {",
            "    if (a[k]) continue;",
            "    b[k] = 1;",
            "}",
            "[[maybe_unused]] const float* in3 = (const float*)(a.arena + off[3]);",
            "[[maybe_unused]] const float* in4 = (const float*)(a.arena + off[4]);",
            "z = in4[0];",
        ]
    )
    assert got == [
        "const ml::i64 x = (ml::i64)i[0] + (ml::i64)i[1] * 16;",
        "y = a - 0 + b * 1.0f + c * 1LL + d * 16;",
        "if (!(e0 >= total)) {",
        "    p[0] = q[0] + x1;",
        "}",
        "for (int k = 0; k < 1; ++k) {",
        "    if (a[k]) continue;",
        "    b[k] = 1;",
        "}",
        "const float* in4 = (const float*)(a.arena + off[4]);",
        "z = in4[0];",
    ]


def test_dump_refuses_to_replace_unless_forced(tmp_path: Path) -> None:
    g = ml.Graph("small")
    x = g.input("x", (4, 64), "float32")
    g.output("y", ml.hardswish(x))
    plan = make_plan(g, processors=4)
    dump(plan, tmp_path)
    with pytest.raises(DumpError, match=r"already holds kernel\.cu, tasks\.tsv; pass --force"):
        dump(plan, tmp_path)
    (tmp_path / "kernel.cu").write_text("stale")
    dump(plan, tmp_path, force=True)
    assert "megaloop_loop" in (tmp_path / "kernel.cu").read_text()
    with pytest.raises(DumpError, match="is a file"):
        dump(plan, tmp_path / "kernel.cu")


def test_megaloop_plan_dump_from_the_command_line(tmp_path: Path) -> None:
    def run(*extra: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "megaloop", "plan", "--processors", "8", "--dump", str(tmp_path / "d"), *extra]
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={"PYTHONPATH": str(ROOT)})

    first = run()
    assert first.returncode == 0, first.stderr
    assert (tmp_path / "d" / "kernel.cu").exists() and (tmp_path / "d" / "tasks.tsv").exists()
    again = run()
    assert again.returncode == 2 and "already holds kernel.cu, tasks.tsv; pass --force" in again.stderr
    assert run("--force").returncode == 0

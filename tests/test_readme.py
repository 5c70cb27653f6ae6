"""The README's Python examples run as written (documentation that cannot rot silently)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from megaloop.runtime import gpus

README = Path(__file__).parent.parent / "README.md"


def test_readme_examples_run() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) >= 3
    scope: dict = {}
    for block in blocks:
        if block.startswith("# needs a GPU") and not gpus()[0]:
            continue
        exec(compile(block, "README.md", "exec"), scope)
    assert scope["result"].outputs["y"].shape == (8, 512)
    assert len(scope["results"]) == 4
    assert scope["decode"].outputs["logits"].shape == (1, 1, 128256)


def test_the_first_command_runs(tmp_path) -> None:
    """The README's first command, as a newcomer runs it in a fresh clone (the install skipped: the
    suite runs from one; `megaloop` as `python -m megaloop` of this tree)."""
    first = re.search(r"```bash\n(.*?)\n", README.read_text()).group(1)
    steps = [shlex.split(step) for step in first.split("&&")]
    assert steps[0][:4] == ["python", "-m", "pip", "install"]
    assert [s[:2] for s in steps[1:]] == [["megaloop", "make-tiny-checkpoint"], ["megaloop", "generate"]]
    env = {**os.environ, "PYTHONPATH": str(README.parent), "MEGALOOP_CACHE": str(tmp_path / "cache")}
    for step in steps[1:]:
        proc = subprocess.run(
            [sys.executable, "-m", "megaloop", *step[1:]], cwd=tmp_path, env=env, capture_output=True, text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip(), "no text generated"
    assert re.search(r"on the (CPU|loop kernel)", proc.stderr), proc.stderr
    timing = r"prefill [\d.]+ ms \(first token after [\d.]+ s\); \d+ decode steps in [\d.]+ s: [\d.]+ ms/token"
    assert re.search(timing + r", [\d.]+ tokens/s", proc.stderr), proc.stderr

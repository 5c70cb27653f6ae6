"""The README's Python examples run as written (documentation that cannot rot silently)."""

from __future__ import annotations

import re
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

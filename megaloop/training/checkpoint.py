"""Checkpoints a training run writes: a folder in the Hugging Face layout that transformers'
``AutoModelForCausalLM.from_pretrained`` and ``megaloop generate`` both load.

- ``model.safetensors``: every weight under the source checkpoint's name, in the dtype the source
  stored it in (a 16-bit weight from its float32 master, rounded once); a tied LM head is not stored
  (the embedding is), as transformers saves it;
- the source folder's config.json, generation_config.json and tokenizer files, copied as they are;
- ``megaloop_training.json``: what the run did (steps, settings, each step's loss): it marks the folder
  as one a run wrote.

An output folder is never overwritten unless asked (``overwrite``): it must be missing or empty, or
``overwrite`` lets the run replace the files it writes (and remove the folder's other safetensors
files and index, which would otherwise be loaded with them). The source folder itself is refused.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from megaloop.errors import UsageError

MARKER = "megaloop_training.json"
WEIGHTS = "model.safetensors"
# the source folder's files a checkpoint carries over (besides the weights)
COPIED = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
)  # fmt: skip


def check_output(output: str | Path, source: str | Path | None, overwrite: bool) -> Path:
    """``output`` as a folder a run may write (module docstring), checked before any work."""
    out = Path(output)
    if out.exists() and not out.is_dir():
        raise UsageError(f"output {out} exists and is a file; give a folder")
    if source is not None and out.exists() and out.resolve() == Path(source).resolve():
        raise UsageError(
            f"output {out} is the checkpoint being trained (its weights are read while training); choose another folder"
        )
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise UsageError(
            f"output {out} is not empty; choose a new or empty folder, or pass --overwrite (overwrite=True) to "
            "replace the checkpoint files there"
        )
    if not out.parent.is_dir():
        raise UsageError(f"output {out}: its parent folder {out.parent} does not exist")
    return out


def save_checkpoint(
    folder: str | Path,
    weights: Mapping[str, np.ndarray],
    source: str | Path,
    record: Mapping[str, Any],
) -> Path:
    """Write ``weights`` (name -> array in the dtype to store) with the source folder's config and
    tokenizer files into ``folder`` (made if missing) and the run's ``record``."""
    from safetensors.numpy import save_file

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("*.safetensors"), *out.glob("*.safetensors.index.json")]:
        stale.unlink()
    arrays = {n: np.ascontiguousarray(w) for n, w in sorted(weights.items())}
    save_file(arrays, str(out / WEIGHTS), metadata={"format": "pt"})
    for name in COPIED:
        if (Path(source) / name).is_file():
            shutil.copyfile(Path(source) / name, out / name)
    (out / MARKER).write_text(json.dumps(record, indent=2) + "\n")
    return out

"""Llama-family checkpoints in the Hugging Face layout: a folder with ``config.json`` and safetensors
files (one ``model.safetensors``, or shards listed in ``model.safetensors.index.json``).

    cfg, params = load_llama("Meta-Llama-3-8B", max_seq=4096)
    graph = build_llama(cfg, batch=1, tokens=1)            # parameter names are the checkpoint's

safetensors is a small format (an 8-byte header length, a JSON header, raw little-endian data), read
here directly with numpy memory maps: no copy until a tensor is used, and bfloat16 (which numpy lacks)
comes back as ml_dtypes.bfloat16. Every parameter the model needs must be present with its shape;
anything else in the files is an error (a checkpoint of another architecture), except the rotary
tables some exporters add.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from megaloop.errors import CheckpointError
from megaloop.models.hf_config import llama_config
from megaloop.models.llama import LlamaConfig

DTYPES = {"BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype(np.float16), "F32": np.dtype(np.float32)}
NAMES = {v: k for k, v in DTYPES.items()}
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # tables some exporters store; megaloop computes them


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of one safetensors file, memory-mapped (read-only)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
    data = np.memmap(path, np.uint8, mode="r", offset=8 + n)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise CheckpointError(f"{path}: tensor {name!r} is {info.get('dtype')}; megaloop reads {sorted(DTYPES)}")
        start, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if end - start != int(np.prod(shape)) * dtype.itemsize or end > data.size:
            raise CheckpointError(
                f"{path}: tensor {name!r} {shape} has {end - start} bytes of data; the file is damaged"
            )
        out[name] = data[start:end].view(dtype).reshape(shape)
    return out


def write_safetensors(path: str | Path, tensors: Mapping[str, np.ndarray]) -> None:
    """Write tensors (float32, float16 or bfloat16 numpy arrays) as one safetensors file."""
    header: dict[str, Any] = {}
    at = 0
    arrays = {}
    for name, value in tensors.items():
        a = np.ascontiguousarray(value)
        if a.dtype not in NAMES:
            raise CheckpointError(f"write_safetensors: {name!r} is {a.dtype}; write float32, float16 or bfloat16")
        header[name] = {"dtype": NAMES[a.dtype], "shape": list(a.shape), "data_offsets": [at, at + a.nbytes]}
        arrays[name] = a
        at += a.nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for a in arrays.values():
            f.write(a.tobytes())


def load_llama(
    path: str | Path, *, max_seq: int | None = None, dtype: Any = None
) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
    """The model's configuration and its parameters (memory-mapped, in the stored dtype; megaloop
    rounds them to ``cfg.dtype`` when they are used). ``max_seq`` sizes the KV cache (default: the
    model's max_position_embeddings)."""
    folder = Path(path)
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{folder}: no readable config.json ({e})") from None
    cfg = llama_config(config, max_seq=max_seq, dtype=dtype)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"] if (folder / "model.safetensors").is_file() else []
        files = files or sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no safetensors files (model.safetensors or an index)")
    tensors: dict[str, np.ndarray] = {}
    for name in files:
        tensors.update(read_safetensors(folder / name))
    shapes = cfg.parameter_shapes()
    if cfg.tie_word_embeddings and "lm_head.weight" in tensors:
        _check_tied(folder, tensors)
    missing = [n for n in shapes if n not in tensors]
    if missing:
        hint = " (config.json's tie_word_embeddings is false)" if missing == ["lm_head.weight"] else ""
        raise CheckpointError(f"{folder}: {len(missing)} parameters missing, e.g. {missing[:3]}{hint}")
    wrong = [f"{n} {tensors[n].shape} (expected {shapes[n]})" for n in shapes if tensors[n].shape != shapes[n]]
    if wrong:
        raise CheckpointError(f"{folder}: parameters of the wrong shape, e.g. {wrong[:3]}")
    unknown = [n for n in tensors if n not in shapes and not n.endswith(IGNORED_SUFFIXES)]
    if unknown:
        raise CheckpointError(
            f"{folder}: tensors the Llama model does not use, e.g. {unknown[:3]}: a checkpoint of another architecture?"
        )
    return cfg, {n: tensors[n] for n in shapes}


def _check_tied(folder: Path, tensors: dict[str, np.ndarray]) -> None:
    """A tied checkpoint may store the LM head too, as long as it is the embedding (the model uses
    the embedding for both, as transformers does)."""
    head, embed = tensors.pop("lm_head.weight"), tensors.get("model.embed_tokens.weight")
    if embed is None or head.shape != embed.shape or not np.array_equal(head, embed):
        raise CheckpointError(
            f"{folder}: config.json ties the LM head to the embedding (tie_word_embeddings), but lm_head.weight "
            "differs from model.embed_tokens.weight; set tie_word_embeddings to false to use it"
        )

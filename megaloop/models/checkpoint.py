"""Llama-family checkpoints in the Hugging Face layout: a folder with ``config.json`` and safetensors
files (one ``model.safetensors``, or shards listed in ``model.safetensors.index.json``).

    cfg, params = load_llama("Meta-Llama-3-8B", max_seq=4096)
    graph = build_llama(cfg, batch=1, tokens=1)            # parameter names are the checkpoint's

safetensors is a small format (an 8-byte header length, a JSON header, raw little-endian data), read
here directly with numpy memory maps: no copy until a tensor is used, and bfloat16 (which numpy lacks)
comes back as ml_dtypes.bfloat16. Every parameter the model needs must be present with its shape;
anything else in the files is an error (a checkpoint of another architecture), except the rotary
tables some exporters add. So is a parameter stored in a dtype that is not a float megaloop converts
(integers, bools, float8: a quantized checkpoint, whose raw numbers are not the weights).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from megaloop.errors import CheckpointError
from megaloop.models.hf_config import family_of, llama_config, rope_interleaved
from megaloop.models.llama import LlamaConfig

DTYPES = {"BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype(np.float16), "F32": np.dtype(np.float32)}
NAMES = {v: k for k, v in DTYPES.items()}
# what read_safetensors reads besides the float parameters megaloop runs (the model refuses the rest by name)
READ_DTYPES = {
    **DTYPES,
    "F64": np.dtype(np.float64),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
# stored dtypes a parameter may have: rounded to the model's dtype when used (float64 through float32)
PARAMETER_DTYPES = ("BF16", "F16", "F32", "F64")
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # tables some exporters store; megaloop computes them
MAX_HEADER_BYTES = 100_000_000  # the safetensors format's own limit on the JSON header


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of one safetensors file, memory-mapped (read-only). A file that breaks the format
    (absurd or truncated header, entries without dtype, shape or data_offsets, offsets outside the data,
    overlapping or not matching the shape) is a CheckpointError naming the file and the field."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: {size} bytes, too short for a safetensors file (the file is damaged)")
            n = int.from_bytes(head, "little")
            if n > min(size - 8, MAX_HEADER_BYTES):
                raise CheckpointError(
                    f"{path}: the header length field says {n} bytes, but the file has {size - 8} after it "
                    f"(and the format allows at most {MAX_HEADER_BYTES}): not a safetensors file, or it is damaged"
                )
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e.strerror or e})") from None
    header = _parse_header(path, raw)
    data_bytes = size - 8 - n
    entries = [(name, _entry(path, name, info, data_bytes)) for name, info in header.items() if name != "__metadata__"]
    _check_overlaps(path, entries)
    data = np.memmap(path, np.uint8, mode="r", offset=8 + n) if data_bytes else np.zeros(0, np.uint8)
    return {name: data[start:end].view(dtype).reshape(shape) for name, (dtype, shape, start, end) in entries}


def _parse_header(path: Path, raw: bytes) -> dict[str, Any]:
    try:
        header = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise CheckpointError(
            f"{path}: header byte {e.start} is not UTF-8: not a safetensors file, or it is damaged"
        ) from None
    except json.JSONDecodeError as e:
        raise CheckpointError(
            f"{path}: the header is not JSON ({e.msg} at byte {e.pos}): the file is damaged"
        ) from None
    except RecursionError:
        raise CheckpointError(f"{path}: the header is JSON nested too deeply: not a safetensors file") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the header is a JSON {type(header).__name__}, not an object of tensor entries")
    meta = header.get("__metadata__")
    if meta is not None and not isinstance(meta, dict):
        raise CheckpointError(f"{path}: __metadata__ must be an object, got {type(meta).__name__}")
    return header


def _entry(path: Path, name: str, info: Any, data_bytes: int) -> tuple[np.dtype, tuple[int, ...], int, int]:
    """(dtype, shape, start, end) of one header entry, each field checked."""
    where = f"{path}: tensor {name!r}"
    if not isinstance(info, dict):
        raise CheckpointError(
            f"{where}: its entry is a {type(info).__name__}, not an object with dtype, shape and data_offsets"
        )
    for key in ("dtype", "shape", "data_offsets"):
        if key not in info:
            raise CheckpointError(f"{where}: the entry has no {key!r} (it has {sorted(info)})")
    dtype = READ_DTYPES.get(info["dtype"]) if isinstance(info["dtype"], str) else None
    if dtype is None:
        raise CheckpointError(f"{where}: dtype {info['dtype']!r:.40}; megaloop reads {sorted(READ_DTYPES)}")
    shape, offsets = info["shape"], info["data_offsets"]
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise CheckpointError(f"{where}: shape must be a list of ints >= 0, got {shape!r:.60}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
        raise CheckpointError(f"{where}: data_offsets must be [begin, end] (ints >= 0), got {offsets!r:.60}")
    start, end = offsets
    if start > end:
        raise CheckpointError(f"{where}: data_offsets [{start}, {end}] begin after they end: the file is damaged")
    if end > data_bytes:
        raise CheckpointError(
            f"{where}: data_offsets [{start}, {end}] lie outside the {data_bytes} bytes of data "
            "(the file is damaged: truncated?)"
        )
    need = math.prod(shape) * dtype.itemsize
    if end - start != need:
        raise CheckpointError(
            f"{where}: shape {shape} of {info['dtype']} needs {need} bytes, but data_offsets give {end - start}: "
            "the file is damaged"
        )
    return dtype, tuple(shape), start, end


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _check_overlaps(path: Path, entries: list[tuple[str, tuple[np.dtype, tuple[int, ...], int, int]]]) -> None:
    spans = sorted((start, end, name) for name, (_, _, start, end) in entries if end > start)
    reach, holder = 0, ""  # the furthest end so far, and whose
    for start, end, name in spans:
        if start < reach:
            raise CheckpointError(f"{path}: the data of tensors {holder!r} and {name!r} overlap: the file is damaged")
        if end > reach:
            reach, holder = end, name


def read_index(path: str | Path) -> list[str]:
    """The shard files a ``model.safetensors.index.json`` names (sorted, each once); CheckpointError
    naming the index and the field when it is not JSON, has no weight_map, or names files that are not
    in its folder."""
    path = Path(path)
    try:
        index = json.loads(path.read_bytes().decode("utf-8"))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read the index ({e.strerror or e})") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path}: the index is not JSON ({e})") from None
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
        found = sorted(index) if isinstance(index, dict) else type(index).__name__
        raise CheckpointError(f"{path}: the index needs a 'weight_map' object (tensor name -> file); found {found}")
    files = set()
    for tensor, file in index["weight_map"].items():
        name = Path(file) if isinstance(file, str) and file else None
        if name is None or name.is_absolute() or ".." in name.parts:
            raise CheckpointError(f"{path}: weight_map[{tensor!r}] must be a file name in the folder, got {file!r:.60}")
        if not (path.parent / name).is_file():
            raise CheckpointError(f"{path}: weight_map[{tensor!r}] names {file}, which is not in {path.parent}")
        files.add(file)
    return sorted(files)


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
    path: str | Path,
    *,
    max_seq: int | None = None,
    dtype: Any = None,
    allow_long_context: bool = False,
    allow_unknown_fields: bool = False,
) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
    """The model's configuration and its parameters (memory-mapped, in the stored dtype; megaloop
    rounds them to ``cfg.dtype`` when they are used). ``max_seq`` sizes the KV cache (default: the
    model's max_position_embeddings, past which only ``allow_long_context`` goes);
    ``allow_unknown_fields`` ignores config fields megaloop does not know (hf_config.llama_config).
    A checkpoint with ``rope_interleaved`` gets its q/k projections permuted (``deinterleave_rope``)."""
    folder = Path(path)
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{folder}: no readable config.json ({e})") from None
    interleaved = isinstance(config, dict) and rope_interleaved(config)
    if interleaved:
        config = {k: v for k, v in config.items() if k != "rope_interleaved"}
    cfg = llama_config(
        config, max_seq=max_seq, dtype=dtype, allow_long_context=allow_long_context,
        allow_unknown_fields=allow_unknown_fields,
    )  # fmt: skip
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = read_index(index)
    else:
        files = ["model.safetensors"] if (folder / "model.safetensors").is_file() else []
        files = files or sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no safetensors files (model.safetensors or an index)")
    tensors: dict[str, np.ndarray] = {}
    source: dict[str, str] = {}
    for name in files:
        part = read_safetensors(folder / name)
        tensors.update(part)
        source.update(dict.fromkeys(part, name))
    if family_of(config).fused:
        tensors = split_fused(folder, cfg, tensors, source)
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
    _check_dtypes(folder, cfg, {n: tensors[n] for n in shapes}, source)
    params = {n: tensors[n] for n in shapes}
    return cfg, deinterleave_rope(cfg, params) if interleaved else params


# fused projections (Phi-3) -> the parts megaloop's layer reads, by rows: name -> ((part, rows), ...)
def fused_parts(cfg: LlamaConfig) -> dict[str, tuple[tuple[str, int], ...]]:
    q, kv, f = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.intermediate
    return {
        "self_attn.qkv_proj": (("self_attn.q_proj", q), ("self_attn.k_proj", kv), ("self_attn.v_proj", kv)),
        "mlp.gate_up_proj": (("mlp.gate_proj", f), ("mlp.up_proj", f)),
    }


def split_fused(
    folder: Path, cfg: LlamaConfig, tensors: dict[str, np.ndarray], source: dict[str, str]
) -> dict[str, np.ndarray]:
    """Each layer's fused q/k/v and gate/up projections (weights and biases) split by rows into the
    parts megaloop's layer reads (views: nothing is copied); a fused tensor of the wrong size is a
    CheckpointError naming it and the sizes expected."""
    out = dict(tensors)
    for i in range(cfg.layers):
        for fused, parts in fused_parts(cfg).items():
            for suffix in ("weight", "bias"):
                name = f"model.layers.{i}.{fused}.{suffix}"
                if name not in out:
                    continue
                value = out.pop(name)
                rows = [n for _, n in parts]
                if value.ndim < 1 or value.shape[0] != sum(rows):
                    raise CheckpointError(
                        f"{folder / source[name]}: tensor {name!r} has shape {list(value.shape)}; it holds "
                        f"{' + '.join(p for p, _ in parts)} ({' + '.join(map(str, rows))} = {sum(rows)} rows)"
                    )
                at = 0
                for part, n in parts:
                    key = f"model.layers.{i}.{part}.{suffix}"
                    out[key], at = value[at : at + n], at + n
                    source[key] = source[name]
    return out


def _check_dtypes(folder: Path, cfg: LlamaConfig, params: dict[str, np.ndarray], source: dict[str, str]) -> None:
    """Every parameter stored as a float type megaloop converts to the model's dtype."""
    for name, value in params.items():
        stored = NAMES.get(value.dtype) or next((k for k, v in READ_DTYPES.items() if v == value.dtype), "?")
        if stored in PARAMETER_DTYPES:
            continue
        why = "float8 weights come with scales" if stored.startswith("F8") else "its raw numbers are not the weights"
        raise CheckpointError(
            f"{folder / source[name]}: tensor {name!r} is stored as {stored} ({value.dtype}), but megaloop expects "
            f"a float parameter ({', '.join(PARAMETER_DTYPES)}; the model computes in {cfg.dtype.name}): a quantized "
            f"checkpoint? ({why}). Load an unquantized (or dequantized) checkpoint"
        )


def deinterleave_rope(cfg: LlamaConfig, params: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Parameters of a model whose rope rotates adjacent pairs (2i, 2i+1) made into those of the same
    model with half-split pairs (i, i + head_dim/2), which megaloop builds: each head's q and k rows
    (and biases, and Qwen3's q/k norm weights) reordered evens first, then odds. The rotation of
    every pair and q.k are unchanged, so the model computes the same function."""
    hd = cfg.head_dim
    order = np.concatenate([np.arange(0, hd, 2), np.arange(1, hd, 2)])
    out = dict(params)
    for i in range(cfg.layers):
        attn = f"model.layers.{i}.self_attn."
        for proj, heads in (("q", cfg.heads), ("k", cfg.kv_heads)):
            for suffix in ("weight", "bias"):
                name = f"{attn}{proj}_proj.{suffix}"
                if name in out:
                    w = np.asarray(out[name])
                    out[name] = w.reshape(heads, hd, *w.shape[1:])[:, order].reshape(w.shape)
            name = f"{attn}{proj}_norm.weight"
            if name in out:
                out[name] = np.asarray(out[name])[order]
    return out


def _check_tied(folder: Path, tensors: dict[str, np.ndarray]) -> None:
    """A tied checkpoint may store the LM head too, as long as it is the embedding (the model uses
    the embedding for both, as transformers does)."""
    head, embed = tensors.pop("lm_head.weight"), tensors.get("model.embed_tokens.weight")
    if embed is None or head.shape != embed.shape or not np.array_equal(head, embed):
        raise CheckpointError(
            f"{folder}: config.json ties the LM head to the embedding (tie_word_embeddings), but lm_head.weight "
            "differs from model.embed_tokens.weight; set tie_word_embeddings to false to use it"
        )

"""Training data: text files tokenized with the checkpoint's tokenizer and packed into windows of
seq + 1 tokens (a step's tokens and, one further, its targets), grouped into batches.

Each file is one document: its tokens as the tokenizer encodes them (with the special tokens its
post-processor adds, a BOS for Llama 3), then the end-of-sequence token where the tokenizer has one,
so that documents are separated as in pretraining. The documents are concatenated in the order given
and cut into windows that do not overlap (a last piece shorter than a window is dropped); the windows
are shuffled with ``seed`` (the same seed, the same order) and grouped ``batch`` at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from megaloop.errors import UsageError
from megaloop.models.tokenizer import Tokenizer


def read_texts(files: Sequence[str | Path]) -> list[tuple[Path, str]]:
    """Every file's text (UTF-8), checked: a missing, unreadable, binary or empty file is an error
    naming it."""
    if not files:
        raise UsageError("training data: no files given (--data FILE...)")
    out = []
    for name in files:
        path = Path(name)
        if not path.is_file():
            what = "is a folder, not a file" if path.is_dir() else "does not exist"
            raise UsageError(f"training data: {path} {what}")
        try:
            text = path.read_bytes().decode("utf-8")
        except OSError as e:
            raise UsageError(f"training data: cannot read {path} ({e.strerror or e})") from None
        except UnicodeDecodeError as e:
            raise UsageError(
                f"training data: {path} is not UTF-8 text (byte {e.start} is {e.object[e.start]:#x}); give text files"
            ) from None
        out.append((path, text))
    return out


def tokenize(tokenizer: Tokenizer, files: Sequence[str | Path]) -> np.ndarray:
    """The files' tokens, one document after another (module docstring), as int64."""
    return tokenize_texts(tokenizer, [text for _, text in read_texts(files)])


def tokenize_texts(tokenizer: Tokenizer, texts: Sequence[str]) -> np.ndarray:
    """The texts' tokens, each text a document (module docstring), as int64."""
    eos = tokenizer.token_id(tokenizer.special_tokens.get("eos_token"))
    pieces = []
    for text in texts:
        ids = tokenizer.encode(text)
        if eos is not None and (not ids or ids[-1] != eos):
            ids = [*ids, eos]
        pieces.append(np.asarray(ids, np.int64))
    return np.concatenate(pieces) if pieces else np.zeros(0, np.int64)


def pack(tokens: np.ndarray, *, batch: int, seq: int, seed: int = 0, limit: int | None = None) -> np.ndarray:
    """The token stream as int64 [batches, batch, seq + 1]: windows that do not overlap, shuffled with
    ``seed``, ``batch`` a batch (at most ``limit`` batches: those a run reads). Fewer tokens than one
    batch is an error saying how many are needed."""
    tokens = np.asarray(tokens, np.int64).reshape(-1)
    width = seq + 1
    windows = tokens.size // width
    if windows < batch:
        raise UsageError(
            f"training data: {tokens.size} tokens make {windows} window(s) of seq + 1 = {width} tokens, fewer than "
            f"one batch of {batch} ({batch * width} tokens): give more text, or a smaller --batch or --seq"
        )
    order = np.random.default_rng(seed).permutation(windows)
    batches = windows // batch
    if limit is not None:
        batches = min(batches, limit)
    chosen = order[: batches * batch]
    return tokens[: windows * width].reshape(windows, width)[chosen].reshape(batches, batch, width)

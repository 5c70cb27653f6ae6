"""The folder megaloop keeps compiled kernels and plans in: where it is, how large it may grow,
what ``megaloop cache info`` shows and what ``megaloop cache clear`` removes.

``$MEGALOOP_CACHE`` (default ``$XDG_CACHE_HOME/megaloop``, else ``~/.cache/megaloop``) holds one
folder per kind of entry (KINDS): ``cubin/``, written by megaloop/runtime/compile.py, and ``plans/``,
by megaloop/plan/cache.py, which take their entries' names from here. They are declared in one place
so that every process knows them all: eviction weighs both, whichever this process imported. A
location that is a file or cannot be written is a CacheError naming the variable and the path.

The cache is capped at ``$MEGALOOP_CACHE_MAX_BYTES`` (default 2 GiB; "none" for no cap): after an
entry is written, the least recently used entries of every kind are removed until the total fits.
An entry's modification time is its last use: a hit touches it (access times are often not kept).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from megaloop.errors import CacheError

ENV = "MEGALOOP_CACHE"
MAX_ENV = "MEGALOOP_CACHE_MAX_BYTES"
DEFAULT_MAX_BYTES = 2 * 2**30
UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


@dataclass(frozen=True)
class Kind:
    """One kind of cache entry: its folder under the cache root, the names of its entries, and the
    names of the other files megaloop writes there (temporary files, older formats)."""

    folder: str
    what: str
    entry: re.Pattern[str]
    other: re.Pattern[str]


# <key>.<bytes>.<sha256 prefix>.cubin: the length and hash travel in the name (runtime/compile.py);
# besides: writers' temporary files and the unchecked <key>.cubin of earlier versions
CUBIN = Kind(
    "cubin",
    "compiled loop kernels",
    re.compile(r"^(?P<key>[0-9a-f]{64})\.(?P<size>[0-9]+)\.(?P<digest>[0-9a-f]{16})\.cubin$"),
    re.compile(r"^\.[0-9a-f]{16}\..*\.tmp$|^[0-9a-f]{64}\.cubin$"),
)
# <key>.plan; temporary files <key>.plan<random>.tmp (plan/cache.py)
PLANS = Kind("plans", "plans", re.compile(r"^[0-9a-f]{64}\.plan$"), re.compile(r"^[0-9a-f]{64}\.plan.+\.tmp$"))
KINDS = {k.folder: k for k in (CUBIN, PLANS)}


def root() -> Path:
    """The cache folder (which need not exist yet)."""
    base = os.environ.get(ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "megaloop"
    )
    return Path(base)


def where() -> str:
    """How the user set the location, for messages."""
    if os.environ.get(ENV):
        return f"{ENV}={os.environ[ENV]}"
    return f"{root()} (the default: {ENV} is not set)"


def folder(kind: Kind, *, create: bool = True) -> Path:
    """``kind``'s folder, made if ``create``; CacheError when it cannot be (a file in the way, no
    permission) or cannot be written."""
    path = root() / kind.folder
    if not create:
        return path
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise _in_the_way(path) from None
    except OSError as e:
        raise cache_error(f"cannot make the folder {path} ({e.strerror or e})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise cache_error(f"the folder {path} is not writable")
    return path


def _in_the_way(path: Path) -> CacheError:
    for parent in (path, *path.parents):
        if parent.exists() and not parent.is_dir():
            return cache_error(
                "that is a file, not a folder" if parent == root() else f"{parent} is a file, not a folder"
            )
    return cache_error(f"cannot make the folder {path}")


def cache_error(problem: str) -> CacheError:
    return CacheError(
        f"megaloop's cache at {where()}: {problem}. Set {ENV} to a folder megaloop may write (it makes it), "
        "or turn the cache off where the API offers it (use_cache=False, plan_cache=False)"
    )


def max_bytes() -> int | None:
    """The size cap in bytes (None: no cap), from $MEGALOOP_CACHE_MAX_BYTES: bytes, or a number with
    K, M, G or T (binary: 2 GiB = "2G"), or "none"."""
    text = os.environ.get(MAX_ENV, "").strip()
    if not text:
        return DEFAULT_MAX_BYTES
    if text.lower() in ("none", "unlimited"):
        return None
    found = re.fullmatch(r"([0-9]+(?:\.[0-9]*)?)\s*([kmgt]?)(?:i?b)?", text.lower())
    if found is None:
        raise CacheError(
            f"{MAX_ENV}={text!r}: expected a size in bytes such as 2147483648, 512M or 2G (binary units), or 'none'"
        )
    return int(float(found[1]) * UNITS[found[2]])


def touch(path: Path) -> None:
    """Mark an entry used now (its modification time); a read-only cache keeps its old times."""
    try:
        os.utime(path)
    except OSError:
        pass


@dataclass(frozen=True)
class Entry:
    kind: str
    path: Path
    bytes: int
    used: float  # modification time: the last write or hit


def entries() -> list[Entry]:
    """Every entry of every registered kind (files that are not entries are left out)."""
    out = []
    for kind in KINDS.values():
        for path, stat in _files(root() / kind.folder):
            if kind.entry.match(path.name):
                out.append(Entry(kind.folder, path, stat.st_size, stat.st_mtime))
    return out


def _files(path: Path) -> list[tuple[Path, os.stat_result]]:
    try:
        children = list(path.iterdir()) if path.is_dir() and not path.is_symlink() else []
    except OSError:
        return []
    out = []
    for child in children:
        try:
            stat = child.lstat()
        except OSError:
            continue
        out.append((child, stat))
    return out


def evict(keep: Path | None = None) -> list[Path]:
    """Remove the least recently used entries until the cache fits its cap (``keep``, the entry just
    written, stays even if it alone is larger); the removed paths."""
    cap = max_bytes()
    if cap is None:
        return []
    items = entries()
    total = sum(e.bytes for e in items)
    removed = []
    for e in sorted(items, key=lambda e: e.used):
        if total <= cap:
            break
        if keep is not None and e.path == keep:
            continue
        try:
            e.path.unlink()
        except FileNotFoundError:  # another process evicted it first
            pass
        except OSError:
            continue
        total -= e.bytes
        removed.append(e.path)
    return removed


@dataclass
class KindInfo:
    kind: str
    what: str
    folder: Path
    entries: int = 0
    bytes: int = 0
    oldest: float | None = None  # least recently used
    newest: float | None = None
    other_files: int = 0  # temporary files, older formats
    other_bytes: int = 0
    unknown: list[Path] = field(default_factory=list)  # files megaloop did not write


@dataclass
class CacheInfo:
    root: Path
    where: str
    exists: bool
    max_bytes: int | None
    kinds: list[KindInfo]
    unknown: list[Path]  # top-level files and folders that are not megaloop's

    @property
    def bytes(self) -> int:
        return sum(k.bytes + k.other_bytes for k in self.kinds)


def info() -> CacheInfo:
    """What the cache holds, by kind."""
    base = root()
    if base.exists() and not base.is_dir():
        raise cache_error("that is a file, not a folder")
    kinds = []
    for kind in sorted(KINDS.values(), key=lambda k: k.folder):
        k = KindInfo(kind.folder, kind.what, base / kind.folder)
        for path, stat in _files(k.folder):
            if kind.entry.match(path.name):
                k.entries += 1
                k.bytes += stat.st_size
                k.oldest = min(k.oldest or stat.st_mtime, stat.st_mtime)
                k.newest = max(k.newest or stat.st_mtime, stat.st_mtime)
            elif kind.other.match(path.name):
                k.other_files += 1
                k.other_bytes += stat.st_size
            else:
                k.unknown.append(path)
        kinds.append(k)
    return CacheInfo(base, where(), base.is_dir(), max_bytes(), kinds, _unknown_top_level(base))


def _unknown_top_level(base: Path) -> list[Path]:
    """What lies in the cache folder besides megaloop's own kind folders (a symlinked kind folder
    counts as unknown: clearing it would remove files elsewhere)."""
    return sorted(p for p, _ in _files(base) if p.name not in KINDS or p.is_symlink() or not p.is_dir())


@dataclass
class Cleared:
    files: int = 0
    bytes: int = 0
    kept: list[Path] = field(default_factory=list)  # files in a kind folder megaloop did not write


def clear(kinds: list[str] | None = None) -> Cleared:
    """Remove the entries (and megaloop's temporary files) of ``kinds`` (default: all). Refused,
    removing nothing, when the cache folder holds anything besides megaloop's own folders: it may be
    a folder the user keeps other things in. Files megaloop did not write stay (listed in ``kept``)."""
    base = root()
    if not base.exists():
        return Cleared()
    if not base.is_dir():
        raise cache_error("that is a file, not a folder; nothing was removed")
    unknown = _unknown_top_level(base)
    if unknown:
        names = ", ".join(p.name for p in unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
        raise CacheError(
            f"megaloop's cache at {where()}: the folder also holds {names}, which megaloop did not put there; "
            f"nothing was removed. megaloop clears only its own folders ({', '.join(sorted(KINDS))}): point {ENV} "
            "at a folder of megaloop's own, or remove what you do not need yourself"
        )
    bad = [k for k in kinds or () if k not in KINDS]
    if bad:
        raise CacheError(f"unknown cache kinds {bad}; the kinds are {sorted(KINDS)}")
    out = Cleared()
    for name in kinds or sorted(KINDS):
        kind = KINDS[name]
        for path, stat in _files(base / kind.folder):
            if not (kind.entry.match(path.name) or kind.other.match(path.name)):
                out.kept.append(path)
                continue
            try:
                path.unlink()  # a symlink is removed itself, never what it points at
            except FileNotFoundError:
                continue
            out.files += 1
            out.bytes += stat.st_size
        try:
            (base / kind.folder).rmdir()  # only when nothing is left in it
        except OSError:
            pass
    return out

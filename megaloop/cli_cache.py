"""``megaloop cache info`` and ``megaloop cache clear``: what the compiled-kernel and plan cache
holds (megaloop/diskcache.py), and removing it."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from megaloop import diskcache


def add_cache_command(sub: Any) -> None:
    """Add ``cache info`` and ``cache clear`` to megaloop's argparse subparsers."""
    cache = sub.add_parser(
        "cache",
        help="show or clear the cache of compiled kernels and plans",
        description=f"megaloop keeps compiled loop kernels and plans in ${diskcache.ENV} (default "
        f"~/.cache/megaloop), capped at ${diskcache.MAX_ENV} (default 2G; 'none': no cap), the least recently "
        "used entries removed first.",
    )
    actions = cache.add_subparsers(dest="action", required=True)
    info = actions.add_parser("info", help="where the cache is, and its entries by kind: count, bytes, last use")
    info.add_argument("--json", action="store_true", help="one JSON object instead of text")
    info.set_defaults(fn=cmd_cache_info)
    clear = actions.add_parser(
        "clear", help="remove the cache's entries (asks first unless --yes; only megaloop's own files)"
    )
    clear.add_argument("--yes", "-y", action="store_true", help="do not ask")
    clear.add_argument("--kind", action="append", choices=sorted(diskcache.KINDS), help="only this kind (repeatable)")
    clear.set_defaults(fn=cmd_cache_clear)


def count(n: int, what: str, many: str = "") -> str:
    return f"{n} {what}" if n == 1 else f"{n} {many or what + 's'}"


def size(n: int | None) -> str:
    if n is None:
        return "no cap"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def cmd_cache_info(args: argparse.Namespace) -> int:
    found = diskcache.info()
    if args.json:
        print(json.dumps(_as_json(found), indent=2))
        return 0
    print(f"megaloop cache: {found.where}" + ("" if found.exists else " (does not exist yet: nothing cached)"))
    for k in found.kinds:
        line = f"  {k.kind:<6} {k.what:<22} {count(k.entries, 'entry', 'entries'):>11} {size(k.bytes):>10}"
        if k.entries:
            line += f"  least recently used {age(k.oldest)}, last used {age(k.newest)}"
        print(line)
        if k.other_files:
            print(f"  {'':<6} {'':<22} {k.other_files:>5} temporary or outdated files, {size(k.other_bytes)}")
        for path in k.unknown:
            print(f"  {'':<6} not megaloop's (kept by clear): {path.name}")
    cap = found.max_bytes
    print(
        f"total {size(found.bytes)} of a {size(cap)} cap "
        f"({diskcache.MAX_ENV}{'=' + _env(diskcache.MAX_ENV) if _env(diskcache.MAX_ENV) else ' not set: the default'})"
    )
    if found.unknown:
        names = ", ".join(p.name for p in found.unknown[:5])
        print(f"the folder also holds {names}{' ...' if len(found.unknown) > 5 else ''}: not megaloop's; clear refuses")
    return 0


def _env(name: str) -> str:
    import os

    return os.environ.get(name, "")


def _as_json(found: diskcache.CacheInfo) -> dict[str, Any]:
    return {
        "root": str(found.root),
        "exists": found.exists,
        "max_bytes": found.max_bytes,
        "bytes": found.bytes,
        "kinds": {
            k.kind: {
                "entries": k.entries,
                "bytes": k.bytes,
                "least_recently_used": k.oldest,
                "last_used": k.newest,
                "other_files": k.other_files,
                "other_bytes": k.other_bytes,
                "unknown": [str(p) for p in k.unknown],
            }
            for k in found.kinds
        },
        "unknown": [str(p) for p in found.unknown],
    }


def cmd_cache_clear(args: argparse.Namespace) -> int:
    found = diskcache.info()
    if found.unknown:
        diskcache.clear(args.kind)  # refuses, naming what is there
    kinds = [k for k in found.kinds if args.kind is None or k.kind in args.kind]
    files = sum(k.entries + k.other_files for k in kinds)
    total = sum(k.bytes + k.other_bytes for k in kinds)
    if not files:
        print(f"megaloop cache: nothing to clear in {found.root}")
        return 0
    what = f"{count(files, 'file')} ({size(total)}) of {', '.join(k.kind for k in kinds)} from {found.root}"
    if not args.yes:
        if not sys.stdin.isatty():
            print(f"megaloop cache clear: this would remove {what}; pass --yes to do it", file=sys.stderr)
            return 2
        answer = input(f"remove {what}? [y/N] ").strip().lower()
        if answer not in ("y", "yes"):
            print("megaloop cache: nothing removed")
            return 1
    done = diskcache.clear(args.kind)
    print(f"megaloop cache: removed {count(done.files, 'file')} ({size(done.bytes)}) from {found.root}")
    for path in done.kept:
        print(f"  kept {path} (not megaloop's)")
    return 0


def age(seconds_since_epoch: float | None) -> str:
    """'2026-12-07 10:31 (3 h ago)' for messages."""
    if seconds_since_epoch is None:
        return "-"
    ago = max(0.0, time.time() - seconds_since_epoch)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if ago >= size:
            span = f"{ago / size:.0f} {unit} ago"
            break
    else:
        span = "just now"
    return f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(seconds_since_epoch))} ({span})"

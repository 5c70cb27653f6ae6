"""NVRTC compilation (through cuda.core) of generated loop kernels, with an on-disk cache.

Compiling to cubin needs no GPU, so CI checks every generated kernel for every supported
architecture. Cache entries are keyed by a hash of the source, the header library, the options, the
architecture and the NVRTC version, and carry their length and a hash of their bytes in their file
name (``entry_name``). They are written atomically (temporary file, fsync, rename); an entry whose
length, hash or ELF structure is wrong is removed and rebuilt before the driver sees it, and one the
driver refuses is rebuilt once (``compile_and_load``), then reported naming the entry. The folder,
its size cap and least-recently-used eviction are megaloop/diskcache.py's.
"""

from __future__ import annotations

import hashlib
import os
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from megaloop import diskcache
from megaloop.errors import MegaloopError

INCLUDE = Path(__file__).resolve().parent.parent / "codegen" / "include"
ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90a")


class CompileError(MegaloopError, RuntimeError):
    """NVRTC refused a generated kernel (a megaloop bug: please report it with the dumped source), or
    the driver refused its cubin twice."""


class CubinLoadError(CompileError):
    """The CUDA driver refused a cubin image (raised by the ``load`` of ``compile_and_load``)."""


T = TypeVar("T")


def cache_dir() -> Path:
    """``$MEGALOOP_CACHE/cubin``, made if need be (CacheError when it cannot be, naming the variable)."""
    return diskcache.folder(CUBIN)


def _headers_digest() -> str:
    h = hashlib.sha256()
    for path in sorted(INCLUDE.rglob("*.cuh")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _nvrtc_version() -> str:
    try:
        from cuda.bindings import nvrtc

        _, major, minor = nvrtc.nvrtcVersion()
        return f"{major}.{minor}"
    except Exception:
        return "unknown"


def _options(arch: str, extra: tuple[str, ...]) -> dict:
    return {
        "arch": arch,
        "std": "c++17",
        "include_path": [str(INCLUDE)],
        "name": "megaloop_loop.cu",
        "lineinfo": True,
        "extra": extra,
    }


def cache_key(source: str, arch: str, extra: tuple[str, ...] = ()) -> str:
    h = hashlib.sha256()
    for part in (source, arch, repr(sorted(_options(arch, extra).items())), _headers_digest(), _nvrtc_version()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def compile_cubin(
    source: str, arch: str = "sm_90a", *, use_cache: bool = True, max_registers: int | None = None
) -> bytes:
    """The cubin of ``source`` for ``arch`` (e.g. "sm_90a", "sm_80"); CompileError with NVRTC's log."""
    _check_arch(source, arch)
    key = cache_key(source, arch, _extra(max_registers))
    if use_cache:
        found = read_entry(key)
        if found is not None:
            return found[1]
    data = _nvrtc(source, arch, max_registers)
    if use_cache:
        store_entry(key, data)
    return data


def compile_and_load(
    source: str, arch: str, load: Callable[[bytes], T], *, max_registers: int | None = None
) -> tuple[bytes, T]:
    """The cubin of ``source`` (from the cache, or compiled) and ``load(cubin)``'s result. ``load``
    raises CubinLoadError when the driver refuses the image: a cached entry is then evicted and
    rebuilt once, and if the rebuilt cubin is refused too, CompileError names the entry."""
    _check_arch(source, arch)
    key = cache_key(source, arch, _extra(max_registers))
    found = read_entry(key)
    first = ""
    if found is not None:
        path, data = found
        try:
            return data, load(data)
        except CubinLoadError as e:
            first = f"{path.name} (read from the cache): {e}; "
            path.unlink(missing_ok=True)
    data = _nvrtc(source, arch, max_registers)
    path = store_entry(key, data)
    try:
        return data, load(data)
    except CubinLoadError as e:
        if path is not None:
            path.unlink(missing_ok=True)  # never served again
        where = path or cache_dir() / entry_name(key, data)
        raise CompileError(
            f"the CUDA driver refused the loop kernel's cubin, cache entry {where}: {first}rebuilt by NVRTC "
            f"{_nvrtc_version()} for {arch}, refused again: {e}. The entry has been removed; a driver older "
            "than this NVRTC cannot load its cubins (update the NVIDIA driver or install a matching "
            "nvidia-cuda-nvrtc)"
        ) from None


def _check_arch(source: str, arch: str) -> None:
    if arch not in ARCHS:
        raise CompileError(f"unsupported architecture {arch!r}; megaloop builds for {', '.join(ARCHS)}")
    if arch != "sm_90a" and "ml::wgmma_tile<" in source:
        raise CompileError(
            f"this loop kernel uses Hopper's warpgroup MMA (wgmma: its plan was made for sm_90), which a {arch} GPU "
            f"does not have; make the plan for this GPU (make_plan(..., arch={arch!r})) or switch the path off "
            "(tiles={'matmul': {'wgmma': 0}})"
        )


_IMPORTING = threading.Lock()


def _extra(max_registers: int | None) -> tuple[str, ...]:
    return () if max_registers is None else (f"maxrregcount={max_registers}",)


def _nvrtc(source: str, arch: str, max_registers: int | None) -> bytes:
    with _IMPORTING:  # two threads' first imports of cuda.core at once can see it half made
        from cuda.core import Program, ProgramOptions

    opts = ProgramOptions(
        arch=arch,
        std="c++17",
        include_path=[str(INCLUDE)],
        name="megaloop_loop.cu",
        lineinfo=True,
        max_register_count=max_registers,
    )
    try:
        code = Program(source, "c++", opts).compile("cubin").code
    except Exception as e:
        raise CompileError(f"NVRTC could not compile the loop kernel for {arch}:\n{e}") from None
    data = bytes(code)
    problem = cubin_problem(data)
    if problem:
        raise CompileError(f"NVRTC returned a malformed cubin for {arch} ({problem}): a toolchain fault")
    return data


def compile_many(
    sources: list[str],
    arch: str = "sm_90a",
    workers: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> list[bytes]:
    """``compile_cubin`` for several kernels at once, in worker processes (NVRTC compiles one kernel
    on one core; a plan's prefill and decode kernels, or a test's batch, need not wait in line).
    The results land in the on-disk cache too, so a LoopKernel made afterwards finds them there.
    ``progress(done, total)`` is called as kernels are ready (cached ones count as done at once)."""
    import concurrent.futures
    import multiprocessing

    unique = list(dict.fromkeys(sources))
    todo = [s for s in unique if cache_entry(s, arch) is None]
    total, done = len(unique), len(unique) - len(todo)
    if progress is not None:
        progress(done, total)
    workers = min(len(todo), workers or os.cpu_count() or 1)
    if workers > 1:
        # spawn, not fork: the parent may hold a CUDA context, which a forked child must not touch
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
            for future in concurrent.futures.as_completed([pool.submit(compile_cubin, s, arch) for s in todo]):
                future.result()
                done += 1
                if progress is not None:
                    progress(done, total)
    out = []
    for s in sources:
        cached = cache_entry(s, arch) is not None
        out.append(compile_cubin(s, arch))
        if not cached and progress is not None:
            done += 1
            progress(min(done, total), total)
    return out


def spills(source: str, arch: str = "sm_90a") -> dict[str, tuple[int, int]]:
    """Bytes of registers spilled to local memory (stores, loads) per function of the compiled
    source, from ptxas -v; functions that spill nothing are left out. A spill in a tile function is
    local-memory traffic on every task it runs: tests keep the Llama kernels at none. Not cached."""
    import io
    import re

    from cuda.core import Program, ProgramOptions

    opts = ProgramOptions(
        arch=arch, std="c++17", include_path=[str(INCLUDE)], name="megaloop_loop.cu", ptxas_options="-v"
    )
    log = io.StringIO()
    try:
        Program(source, "c++", opts).compile("cubin", logs=log)
    except Exception as e:
        raise CompileError(f"NVRTC could not compile the loop kernel for {arch}:\n{e}") from None
    out: dict[str, tuple[int, int]] = {}
    function = "?"
    for line in log.getvalue().splitlines():
        if "Function properties for " in line:
            function = line.split("Function properties for ")[1].strip()
        found = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if found and (int(found[1]) or int(found[2])):
            out[function] = (int(found[1]), int(found[2]))
    return out


# ---- cache entries ---------------------------------------------------------------------------------
# An entry is <key>.<bytes>.<sha256 prefix>.cubin: its length and hash travel in its name, so a file
# cut short, overwritten or half written is recognised before it reaches the driver (which took a
# truncated cubin for a valid one and crashed the process).
CUBIN = diskcache.CUBIN
ENTRY = CUBIN.entry
STALE_TEMP_S = 24 * 3600  # a temporary file this old is a writer killed mid-write


def entry_name(key: str, data: bytes) -> str:
    return f"{key}.{len(data)}.{hashlib.sha256(data).hexdigest()[:16]}.cubin"


def cache_entry(source: str, arch: str, max_registers: int | None = None) -> Path | None:
    """The cache entry holding ``source``'s cubin for ``arch`` (checked by length only), or None."""
    key = cache_key(source, arch, _extra(max_registers))
    for path in _candidates(key):
        found = ENTRY.match(path.name)
        try:
            if found and path.stat().st_size == int(found["size"]):
                return path
        except OSError:
            continue
    return None


def read_entry(key: str) -> tuple[Path, bytes] | None:
    """The valid entry for ``key`` and its bytes; entries that fail a check are removed."""
    for path in _candidates(key):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        problem = entry_problem(path.name, data)
        if problem is None:
            diskcache.touch(path)  # used now: the last to be evicted
            return path, data
        path.unlink(missing_ok=True)
    return None


def entry_problem(name: str, data: bytes) -> str | None:
    """Why the file ``name`` with contents ``data`` is not a valid cache entry (None: it is)."""
    found = ENTRY.match(name)
    if found is None:
        return "not an entry name (<key>.<bytes>.<sha256>.cubin)"
    if len(data) != int(found["size"]):
        return f"{len(data)} bytes where its name records {found['size']}"
    if hashlib.sha256(data).hexdigest()[:16] != found["digest"]:
        return "its bytes do not match the hash its name records"
    return cubin_problem(data)


def cubin_problem(data: bytes) -> str | None:
    """Why ``data`` is not a whole CUDA ELF image (None: the headers and sections lie in the file)."""
    if len(data) < 64 or data[:4] != b"\x7fELF":
        return "no ELF header"
    if data[4] != 2 or data[5] != 1:
        return "not a 64-bit little-endian ELF file"
    machine = struct.unpack_from("<H", data, 18)[0]
    if machine != EM_CUDA:
        return f"ELF machine {machine}, not CUDA ({EM_CUDA})"
    phoff, shoff = struct.unpack_from("<QQ", data, 32)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, 54)
    if phoff + phnum * phentsize > len(data) or shoff + shnum * shentsize > len(data):
        return f"its headers end past its {len(data)} bytes (cut short?)"
    if shnum and shentsize < 64:
        return f"section headers of {shentsize} bytes"
    for i in range(shnum):
        kind, _, _, offset, size = struct.unpack_from("<IQQQQ", data, shoff + i * shentsize + 4)
        if kind != SHT_NOBITS and offset + size > len(data):
            return f"section {i} ends at byte {offset + size}, past its {len(data)} bytes (cut short?)"
    return None


EM_CUDA, SHT_NOBITS = 190, 8


def _candidates(key: str) -> list[Path]:
    folder = cache_dir()
    try:
        names = sorted(p for p in folder.glob(f"{key}.*.cubin"))
    except OSError:
        return []
    (folder / f"{key}.cubin").unlink(missing_ok=True)  # the unchecked format of earlier versions
    return names


def store_entry(key: str, data: bytes) -> Path | None:
    """Write ``data`` as ``key``'s entry: a temporary file, flushed to disk, then renamed, so that a
    process killed at any point leaves either no entry or a whole one; then the cache is trimmed to
    its size cap. None when the write failed (a full disk: that only costs a recompile); CacheError
    when the folder cannot be written."""
    folder = cache_dir()
    path = folder / entry_name(key, data)
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{key[:16]}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                _write_temp(f, data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except PermissionError as e:
        raise diskcache.cache_error(f"cannot write in {folder} ({e.strerror or e})") from None
    except OSError:  # a full disk, or the entry cleared under us: that only costs a recompile
        return None
    _remove_stale_temps(folder)
    diskcache.evict(keep=path)
    return path


def _write_temp(f, data: bytes) -> None:
    f.write(data)


def _remove_stale_temps(folder: Path) -> None:
    """Temporary files of writers killed mid-write (live writers' files are younger)."""
    now = time.time()
    for tmp in folder.glob(".*.tmp"):
        try:
            if now - tmp.stat().st_mtime > STALE_TEMP_S:
                tmp.unlink()
        except OSError:
            pass

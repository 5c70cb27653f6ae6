"""NVRTC compilation (through cuda.core) of generated loop kernels, with an on-disk cache.

Compiling to cubin needs no GPU, so CI checks every generated kernel for every supported
architecture. Cache entries are keyed by a hash of the source, the header library, the options, the
architecture and the NVRTC version; they are written atomically (temporary file + rename), and an
entry that turns out unreadable or unloadable is rebuilt.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

from megaloop.errors import MegaloopError

INCLUDE = Path(__file__).resolve().parent.parent / "codegen" / "include"
ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90a")


class CompileError(MegaloopError, RuntimeError):
    """NVRTC refused a generated kernel (a megaloop bug: please report it with the dumped source)."""


def cache_dir() -> Path:
    root = os.environ.get("MEGALOOP_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "megaloop"
    )
    return Path(root) / "cubin"


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
    if arch not in ARCHS:
        raise CompileError(f"unsupported architecture {arch!r}; megaloop builds for {', '.join(ARCHS)}")
    if arch != "sm_90a" and "ml::wgmma_tile<" in source:
        raise CompileError(
            f"this loop kernel uses Hopper's warpgroup MMA (wgmma: its plan was made for sm_90), which a {arch} GPU "
            f"does not have; make the plan for this GPU (make_plan(..., arch={arch!r})) or switch the path off "
            "(tiles={'matmul': {'wgmma': 0}})"
        )
    if arch not in ("sm_90a", "sm_100a") and "ml::stage_rows(" in source:
        raise CompileError(
            f"this loop kernel copies weights with Hopper's bulk copy engine (tile switch stage_weights: its plan "
            f"was made for sm_90), which a {arch} GPU does not have; make the plan for this GPU "
            f"(make_plan(..., arch={arch!r})) or switch it off (tiles={{'matmul': {{'stage_weights': 0}}}})"
        )
    extra = () if max_registers is None else (f"maxrregcount={max_registers}",)
    path = cache_dir() / f"{cache_key(source, arch, extra)}.cubin"
    if use_cache and path.is_file():
        data = path.read_bytes()
        if data[:4] == b"\x7fELF":
            return data
        path.unlink(missing_ok=True)  # corrupt: rebuild
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
    if use_cache:
        _store(path, data)
    return data


def compile_many(sources: list[str], arch: str = "sm_90a", workers: int | None = None) -> list[bytes]:
    """``compile_cubin`` for several kernels at once, in worker processes (NVRTC compiles one kernel
    on one core; a plan's prefill and decode kernels, or a test's batch, need not wait in line).
    The results land in the on-disk cache too, so a LoopKernel made afterwards finds them there."""
    import concurrent.futures
    import multiprocessing

    todo = [s for s in dict.fromkeys(sources) if not (cache_dir() / f"{cache_key(s, arch)}.cubin").is_file()]
    workers = min(len(todo), workers or os.cpu_count() or 1)
    if workers > 1:
        # spawn, not fork: the parent may hold a CUDA context, which a forked child must not touch
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
            list(pool.map(compile_cubin, todo, [arch] * len(todo)))
    return [compile_cubin(s, arch) for s in sources]


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


def _store(path: Path, data: bytes) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only or full cache only costs a recompile

"""The cache folder of compiled kernels and plans (megaloop/diskcache.py): a location that cannot
be used is an error naming MEGALOOP_CACHE, the size cap evicts the least recently used entries of
every kind, and ``megaloop cache info|clear`` show and remove megaloop's own files only."""

from __future__ import annotations

import hashlib
import os
import time

import pytest

import megaloop as ml
from megaloop import diskcache
from megaloop.cli import main
from megaloop.errors import CacheError
from megaloop.plan.cache import load_or_make_plan, plan_cache_dir
from megaloop.runtime import compile as cc


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGALOOP_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("MEGALOOP_CACHE_MAX_BYTES", raising=False)
    return tmp_path / "cache"


def graph(n: int) -> ml.Graph:
    g = ml.Graph(f"g{n}")
    x = g.input("x", (16 * n,), ml.float32)
    g.output("y", x * 2.0 + 1.0)
    return g


def plan_entry(n: int):
    load_or_make_plan(graph(n), processors=2)
    return max(plan_cache_dir().glob("*.plan"), key=lambda p: p.stat().st_mtime_ns)


@pytest.fixture(scope="module")
def cubin() -> bytes:
    """A real cubin (entries are checked as ELF images when read)."""
    from megaloop.codegen import generate
    from megaloop.plan import make_plan

    return cc.compile_cubin(generate(make_plan(graph(1), processors=2)).source, "sm_80", use_cache=False)


def cubin_entry(cubin: bytes, n: int, padding: int = 0):
    """A kernel cache entry of its own key: ``cubin`` and ``padding`` bytes after it."""
    return cc.store_entry(hashlib.sha256(str(n).encode()).hexdigest(), cubin + bytes(padding))


def age(path, seconds_ago: float) -> None:
    t = time.time() - seconds_ago
    os.utime(path, (t, t))


# ---- where the cache is --------------------------------------------------------------------------------
def test_a_file_where_the_cache_goes_is_named(tmp_path, monkeypatch) -> None:
    """main: compile_cubin raised a bare NotADirectoryError and the plan cache said nothing."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file")
    for where in (blocker, blocker / "below"):
        monkeypatch.setenv("MEGALOOP_CACHE", str(where))
        for use in (lambda: cc.compile_cubin("// nothing", "sm_80"), lambda: load_or_make_plan(graph(1), processors=2)):
            with pytest.raises(CacheError) as info:
                use()
            message = str(info.value)
            assert f"MEGALOOP_CACHE={where}" in message and f"{blocker}" in message and "is a file" in message
            assert "Set MEGALOOP_CACHE to a folder" in message
    assert blocker.read_text() == "a file"
    _, hit = load_or_make_plan(graph(1), processors=2, use_cache=False)  # no cache: no error
    assert not hit


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes anywhere")
def test_an_unwritable_cache_is_named(root) -> None:
    (root / "plans").mkdir(parents=True)
    (root / "plans").chmod(0o500)
    try:
        with pytest.raises(CacheError, match=r"MEGALOOP_CACHE=.*not writable"):
            load_or_make_plan(graph(1), processors=2)
    finally:
        (root / "plans").chmod(0o700)


def test_a_cache_refused_writes_is_named(root, monkeypatch) -> None:
    """What an unwritable folder does (simulated: root writes anywhere): the folder check, then a
    write the file system refuses, each a CacheError naming the variable; a full disk is no error."""
    monkeypatch.setattr(diskcache.os, "access", lambda path, mode: False)
    with pytest.raises(CacheError, match=r"MEGALOOP_CACHE=.*plans is not writable"):
        load_or_make_plan(graph(1), processors=2)
    monkeypatch.undo()
    monkeypatch.setenv("MEGALOOP_CACHE", str(root))

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("tempfile.mkstemp", refuse)
    with pytest.raises(CacheError, match=r"MEGALOOP_CACHE=.*cannot write in .*plans \(Permission denied\)"):
        load_or_make_plan(graph(1), processors=2)
    with pytest.raises(CacheError, match=r"cannot write in .*cubin"):
        cc.store_entry("0" * 64, b"data")

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("tempfile.mkstemp", full)
    assert not load_or_make_plan(graph(1), processors=2)[1] and cc.store_entry("0" * 64, b"data") is None


def test_the_default_location_and_the_cap_setting(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("MEGALOOP_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert diskcache.root() == tmp_path / "megaloop" and "MEGALOOP_CACHE is not set" in diskcache.where()
    for text, value in [("", 2 * 2**30), ("1000", 1000), ("512M", 512 * 2**20), ("2G", 2 * 2**30), ("1.5k", 1536),
                        ("3GiB", 3 * 2**30), ("none", None), ("0", 0)]:  # fmt: skip
        monkeypatch.setenv("MEGALOOP_CACHE_MAX_BYTES", text)
        assert diskcache.max_bytes() == value, text
    for bad in ("lots", "-5", "2X"):
        monkeypatch.setenv("MEGALOOP_CACHE_MAX_BYTES", bad)
        with pytest.raises(CacheError, match=rf"MEGALOOP_CACHE_MAX_BYTES='{bad}'"):
            diskcache.max_bytes()


# ---- the size cap --------------------------------------------------------------------------------------
def test_the_least_recently_used_entries_go_first(root, monkeypatch, cubin) -> None:
    """Entries of both kinds; a hit makes an entry recent; a write over the cap removes the least
    recently used entries, never the one just written (main kept every entry forever)."""
    plans = [plan_entry(n) for n in (1, 2)]
    kernels = [cubin_entry(cubin, n) for n in (1, 2)]
    for i, path in enumerate([kernels[0], kernels[1], plans[0], plans[1]]):  # oldest first
        age(path, 1000 - 100 * i)
    total = sum(p.stat().st_size for p in plans + kernels)
    _, hit = load_or_make_plan(graph(1), processors=2)  # a hit: plans[0] is now the most recent
    assert hit and plans[0].stat().st_mtime > time.time() - 60
    assert cc.read_entry(kernels[0].name.split(".")[0]) is not None  # a kernel hit likewise
    assert kernels[0].stat().st_mtime > time.time() - 60  # order now: kernels[1], plans[1], plans[0], kernels[0]
    monkeypatch.setenv("MEGALOOP_CACHE_MAX_BYTES", str(total + 250))
    newest = cubin_entry(cubin, 3, padding=200)  # a kernel over the cap: the least recently used goes, kernels[1]
    assert not kernels[1].exists() and all(p.exists() for p in [plans[0], plans[1], kernels[0], newest])
    monkeypatch.setenv("MEGALOOP_CACHE_MAX_BYTES", str(newest.stat().st_size + kernels[0].stat().st_size + 300))
    newer = cubin_entry(cubin, 4)  # room for it and one more: the most recent of the others stays
    assert {e.path for e in diskcache.entries()} == {newer, newest}
    monkeypatch.setenv("MEGALOOP_CACHE_MAX_BYTES", "10")
    huge = cubin_entry(cubin, 5)
    assert [e.path for e in diskcache.entries()] == [huge]  # the entry just written stays, alone


def test_no_cap_keeps_everything(root, monkeypatch, cubin) -> None:
    monkeypatch.setenv("MEGALOOP_CACHE_MAX_BYTES", "none")
    for n in range(5):
        cubin_entry(cubin, n)
    assert len(diskcache.entries()) == 5


# ---- info and clear ------------------------------------------------------------------------------------
def populate(root, cubin: bytes):
    plans = [plan_entry(n) for n in (1, 2)]
    kernels = [cubin_entry(cubin, n) for n in (1, 2, 3)]
    age(kernels[0], 7200)
    (root / "cubin" / f".{'a' * 16}.xyz.tmp").write_bytes(b"half")  # a writer's temporary file
    return plans, kernels


def test_info_counts_entries_by_kind(root, cubin) -> None:
    plans, kernels = populate(root, cubin)
    (root / "cubin" / "notes.txt").write_text("mine")
    found = diskcache.info()
    kinds = {k.kind: k for k in found.kinds}
    assert found.root == root and found.exists and not found.unknown
    assert kinds["cubin"].entries == 3 and kinds["cubin"].bytes == 3 * len(cubin)
    assert kinds["cubin"].other_files == 1 and [p.name for p in kinds["cubin"].unknown] == ["notes.txt"]
    assert kinds["plans"].entries == 2 and kinds["plans"].bytes == sum(p.stat().st_size for p in plans)
    assert kinds["cubin"].oldest == pytest.approx(kernels[0].stat().st_mtime)
    assert kinds["cubin"].newest == pytest.approx(max(k.stat().st_mtime for k in kernels))


def test_clear_removes_megaloops_files_only(root, tmp_path, cubin) -> None:
    populate(root, cubin)
    (root / "cubin" / "notes.txt").write_text("mine")
    outside = tmp_path / "precious.cubin"
    outside.write_text("not the cache's")
    link = root / "cubin" / f"{'b' * 64}.4.{'c' * 16}.cubin"
    link.symlink_to(outside)  # an entry-named link: the link goes, never what it points at
    done = diskcache.clear(["plans"])
    assert done.files == 2 and not (root / "plans").exists() and len(diskcache.entries()) == 4
    done = diskcache.clear()
    assert done.files == 5 and [p.name for p in done.kept] == ["notes.txt"]
    assert (root / "cubin" / "notes.txt").read_text() == "mine" and outside.read_text() == "not the cache's"
    assert not diskcache.entries()


@pytest.mark.parametrize("intruder", ["file", "folder", "symlinked kind"])
def test_clear_refuses_a_folder_with_other_things_in_it(root, tmp_path, intruder: str, cubin) -> None:
    """MEGALOOP_CACHE pointed at a folder the user keeps other things in: nothing is removed."""
    populate(root, cubin)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / f"{'d' * 64}.plan").write_text("looks like an entry")
    if intruder == "file":
        (root / "thesis.tex").write_text("years of work")
    elif intruder == "folder":
        (root / "photos").mkdir()
    else:
        (root / "plans").rename(tmp_path / "old-plans")
        (root / "plans").symlink_to(elsewhere)
    before = sorted(p for p in root.rglob("*"))
    with pytest.raises(CacheError, match=r"also holds .*nothing was removed"):
        diskcache.clear()
    assert sorted(p for p in root.rglob("*")) == before and (elsewhere / f"{'d' * 64}.plan").exists()


def test_the_cache_command(root, capsys, monkeypatch, cubin) -> None:
    populate(root, cubin)
    assert main(["cache", "info"]) == 0
    out = capsys.readouterr().out
    assert f"MEGALOOP_CACHE={root}" in out and "3 entries" in out and "2 entries" in out and "least recently" in out
    assert "2.0 GiB cap" in out
    assert main(["cache", "info", "--json"]) == 0
    assert '"entries": 3' in capsys.readouterr().out
    monkeypatch.setattr("sys.stdin.isatty", lambda: False)
    assert main(["cache", "clear"]) == 2  # no terminal to ask: --yes needed
    assert "pass --yes" in capsys.readouterr().err and len(diskcache.entries()) == 5
    monkeypatch.setattr("sys.stdin.isatty", lambda: True)
    monkeypatch.setattr("builtins.input", lambda prompt: "n")
    assert main(["cache", "clear"]) == 1 and len(diskcache.entries()) == 5
    monkeypatch.setattr("builtins.input", lambda prompt: "y")
    assert main(["cache", "clear", "--kind", "plans"]) == 0 and len(diskcache.entries()) == 3
    assert main(["cache", "clear", "--yes"]) == 0
    assert "removed 4 files" in capsys.readouterr().out and not diskcache.entries()
    assert main(["cache", "clear", "--yes"]) == 0 and "nothing to clear" in capsys.readouterr().out
    (root / "thesis.tex").write_text("years of work")
    assert main(["cache", "clear", "--yes"]) == 2
    assert "thesis.tex" in capsys.readouterr().err and (root / "thesis.tex").exists()

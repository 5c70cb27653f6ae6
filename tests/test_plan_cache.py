"""The on-disk plan cache: the same graph and settings give back the same plan (the same kernel
source), anything else plans anew, and a damaged entry is planned again and replaced."""

from __future__ import annotations

import hashlib
import zlib

import pytest

from megaloop.codegen import generate
from megaloop.errors import CacheError
from megaloop.models import LlamaConfig, build_llama_generator
from megaloop.plan.cache import HEADER, load_or_make_plan, plan_cache_dir, plan_key
from megaloop.plan.model import Wait

CFG = LlamaConfig(hidden=64, heads=4, kv_heads=2, intermediate=128, layers=1, vocab=50, max_seq=32)


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGALOOP_CACHE", str(tmp_path))
    return tmp_path / "plans"


def entries(cache) -> list:
    return sorted(cache.glob("*.plan")) if cache.is_dir() else []


def test_a_cached_plan_is_the_same_plan(cache) -> None:
    plan, hit = load_or_make_plan(build_llama_generator(CFG, 2), processors=16)
    assert not hit and len(entries(cache)) == 1 and plan_cache_dir() == cache
    again, hit = load_or_make_plan(build_llama_generator(CFG, 2), processors=16)
    assert hit
    assert generate(again).source == generate(plan).source
    assert again.stats()[0].tasks == plan.stats()[0].tasks and again.estimated_ns == plan.estimated_ns
    state = again.ranks[0].graph.states["token"]
    assert state.node.op is plan.ranks[0].graph.states["token"].node.op  # the registry's OpDef, not a copy
    # tasks travel with their waits packed into bytes: every field and wait comes back as it was
    assert [t.__dict__ for t in again.ranks[0].tasks] == [t.__dict__ for t in plan.ranks[0].tasks]
    waits = [w for t in again.ranks[0].tasks for w in t.waits]
    assert len(waits) > 50 and all(type(w) is Wait and all(type(x) is int for x in w) for w in waits)


def test_other_graphs_or_settings_plan_anew(cache) -> None:
    load_or_make_plan(build_llama_generator(CFG, 2), processors=16)
    for graph, settings in [
        (build_llama_generator(CFG, 2), {"processors": 8}),
        (build_llama_generator(CFG, 2), {"processors": 16, "tiles": {"matmul": {"block_n": 32}}}),
        (build_llama_generator(CFG, 1), {"processors": 16}),
        (build_llama_generator(LlamaConfig(**{**CFG.__dict__, "rope_theta": 500000.0}), 2), {"processors": 16}),
    ]:
        _, hit = load_or_make_plan(graph, **settings)
        assert not hit
    assert len(entries(cache)) == 5
    key = plan_key(build_llama_generator(CFG, 2), {"processors": 16})
    assert key == plan_key(build_llama_generator(CFG, 2), {"processors": 16})
    assert key != plan_key(build_llama_generator(CFG, 2, "other-name"), {"processors": 16})


@pytest.mark.parametrize(
    "damage",
    [
        lambda b: b[: len(b) // 2],  # truncated
        lambda b: b[:-10] + bytes(x ^ 0xFF for x in b[-10:]),  # bytes flipped
        lambda b: b"not a plan at all",
        lambda b: HEADER + hashlib.sha256(b"junk").hexdigest().encode() + b"\njunk",  # a right digest, no pickle
        lambda b: b"",
    ],
)
def test_a_damaged_entry_is_planned_again(cache, damage) -> None:
    plan, _ = load_or_make_plan(build_llama_generator(CFG, 1), processors=16)
    (entry,) = entries(cache)
    good = entry.read_bytes()
    entry.write_bytes(damage(good))
    again, hit = load_or_make_plan(build_llama_generator(CFG, 1), processors=16)
    assert not hit and generate(again).source == generate(plan).source
    assert entry.read_bytes() == good  # replaced by a sound entry
    assert load_or_make_plan(build_llama_generator(CFG, 1), processors=16)[1]


def test_entries_are_compressed_and_the_uncompressed_format_is_planned_again(cache) -> None:
    plan, _ = load_or_make_plan(build_llama_generator(CFG, 2), processors=16)
    (entry,) = entries(cache)
    head, _, body = entry.read_bytes().partition(b"\n")
    pickled = zlib.decompress(body)
    print(f"entry {len(body)} bytes, its pickle {len(pickled)}")
    assert head.startswith(HEADER) and len(body) * 4 < len(pickled)
    # an entry of the format before (the pickle as it is, its digest) is not read: planned again
    entry.write_bytes(b"megaloop plan cache, sha256 " + hashlib.sha256(pickled).hexdigest().encode() + b"\n" + pickled)
    again, hit = load_or_make_plan(build_llama_generator(CFG, 2), processors=16)
    assert not hit and generate(again).source == generate(plan).source
    assert entry.read_bytes().startswith(HEADER)


def test_no_cache_or_an_unusable_one(cache, tmp_path, monkeypatch) -> None:
    _, hit = load_or_make_plan(build_llama_generator(CFG, 1), use_cache=False, processors=16)
    assert not hit and not entries(cache)
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache folder would go")
    monkeypatch.setenv("MEGALOOP_CACHE", str(blocker))
    with pytest.raises(CacheError, match=r"MEGALOOP_CACHE=.*file: that is a file, not a folder"):
        load_or_make_plan(build_llama_generator(CFG, 1), processors=16)
    plan, hit = load_or_make_plan(build_llama_generator(CFG, 1), use_cache=False, processors=16)
    assert not hit and plan.ranks

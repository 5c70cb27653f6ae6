"""KV caches: updates, masked writes, rope with the cache, paged pools."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

import megaloop as ml
from tests.op_table._base import Sample, rnd, row
from tests.op_table.attention import attention_ref
from tests.op_table.rope import rope_ref


def _cache_sample(rng: np.random.Generator) -> Sample:
    b, h, s, d = (int(v) for v in rng.integers(1, 6, 4))
    s += 4
    t = int(rng.integers(1, s + 1))
    return Sample([(b, h, s, d), (b, h, t, d), (b, t)], domains=("normal", "normal", ("distinct", s)))


def _cache_ref(cache, new, pos, **k):
    out = cache.clone()
    for bi in range(cache.shape[0]):
        out[bi].index_copy_(1, pos[bi], new[bi])
    return out


def _cache_sample_long(rng: np.random.Generator) -> Sample:
    """A prefill's worth of rows: the packed copy, several packs a thread."""
    b, h, s, d, t = 2, 3, 600, 64, 512
    return Sample([(b, h, s, d), (b, h, t, d), (b, t)], domains=("normal", "normal", ("distinct", s)))


for label, sampler in [("scatter", _cache_sample), ("long-prefill", _cache_sample_long)]:
    row(
        "kv_cache_update",
        label,
        lambda g, c, n, p: ml.kv_cache_update(c, n, p),
        _cache_ref,
        sampler,
        fixed={2: "int64"},
        states=(0,),
    )


def _masked_cache_sample(rng: np.random.Generator) -> Sample:
    """Positions and a mask: the masked-out tokens' positions become -1 (finished sequences)."""
    s = _cache_sample(rng) if rng.random() < 0.7 else _cache_sample_long(rng)
    return Sample([*s.shapes, s.shapes[2]], domains=(*s.domains, "bool"))


def _masked_cache_ref(cache, new, pos, mask, **k):
    out = cache.clone()
    for bi in range(cache.shape[0]):
        keep = mask[bi]
        out[bi].index_copy_(1, pos[bi][keep], new[bi][:, keep])
    return out


row(
    "kv_cache_update",
    "ignore-negative",
    lambda g, c, n, p, m: ml.kv_cache_update(c, n, ml.where(m, p, -1), ignore_negative=True),
    _masked_cache_ref,
    _masked_cache_sample,
    fixed={2: "int64", 3: "bool"},
    states=(0,),
)


# the key rotated at its slot's position and written into the cache in one op: decode's one token, a
# few tokens, a prefill's worth (several items a thread); partial rotary dims; both layouts
def _rope_cache_sample(rng: np.random.Generator) -> Sample:
    b, h = (int(v) for v in rng.integers(1, 4, 2))
    d = 2 * int(rng.integers(1, 33))
    s = int(rng.integers(4, 40)) if rng.random() < 0.8 else 600
    t = 1 if rng.random() < 0.4 else int(rng.integers(1, min(s, 520) + 1))
    kw = {
        "layout": str(rng.choice(["neox", "interleaved"])),
        "rotary_dim": None if rng.random() < 0.6 else 2 * int(rng.integers(1, d // 2 + 1)),
        "theta": float(rng.choice([10000.0, 500000.0])),
    }
    return Sample([(b, h, s, d), (b, h, t, d), (b, t)], kw, domains=("normal", "normal", ("distinct", s)))


row(
    "rope_kv_cache_update",
    "decode-and-prefill",
    lambda g, c, n, p, **kw: ml.rope_kv_cache_update(c, n, p, **kw),
    lambda c, n, p, dtype, **kw: _cache_ref(c, rnd(rope_ref(n, p[:, None, :], **kw), dtype), p),
    _rope_cache_sample,
    fixed={2: "int64"},
    states=(0,),
)


# the paged KV cache (a serving step's rows of any slots): a page table that is one permutation of the
# pool's pages (built from a flat row of distinct page ids), rows of random slots at distinct positions
# (some unused: -1), grouped-query heads, a sliding window, a head_dim not a power of two
def _paged_sample(update: bool) -> Callable[[np.random.Generator], Sample]:
    def draw(rng: np.random.Generator) -> Sample:
        slots, per_slot, page = int(rng.integers(1, 4)), int(rng.integers(1, 4)), int(rng.choice([1, 2, 4, 8]))
        pages = slots * per_slot + int(rng.integers(0, 4))
        hkv, group, d = int(rng.integers(1, 3)), int(rng.integers(1, 3)), int(rng.choice([4, 6, 16, 40]))
        b, t = (1, int(rng.integers(1, 7))) if update else (int(rng.integers(1, 3)), int(rng.integers(1, 5)))
        t = min(t, per_slot * page)
        kw = {"slots": slots, "per_slot": per_slot, "window": None if rng.random() < 0.6 else int(rng.integers(1, 6))}
        pos = ("distinct", per_slot * page)
        if update:
            shapes = [(pages, hkv, page, d), (b, hkv, t, d), (slots * per_slot,), (b, t), (b, t), (b, t)]
            domains = ("normal", "normal", ("distinct", pages), ("int", 0, slots), pos, "bool")
        else:
            shapes = [(b, hkv * group, t, d), (pages, hkv, page, d), (pages, hkv, page, d), (slots * per_slot,),
                      (b, t), (b, t), (b, t)]  # fmt: skip
            domains = ("normal", "normal", "normal", ("distinct", pages), ("int", 0, slots), pos, "bool")
        return Sample(shapes, kw, domains)

    return draw


def _paged_rows(slot, pos, used):
    return [(bi, ti) for bi in range(pos.shape[0]) for ti in range(pos.shape[1]) if used[bi, ti]]


def _paged_gather(pool, table_row):
    """A slot's keys (values) as one cache [1, kv_heads, pages_per_slot * page_size, dim]."""
    return pool[table_row].permute(1, 0, 2, 3).reshape(1, pool.shape[1], -1, pool.shape[3])


def _paged_attention_ref(q, kp, vp, table, slot, pos, used, *, slots, per_slot, window, dtype):
    table = table.reshape(slots, per_slot)
    out = torch.zeros(q.shape, dtype=torch.float64)
    for bi, ti in _paged_rows(slot, pos, used):
        row = table[slot[bi, ti]]
        k, v = _paged_gather(kp, row), _paged_gather(vp, row)
        qpos = pos[bi, ti].reshape(1, 1)
        out[bi, :, ti] = attention_ref(q[bi : bi + 1, :, ti : ti + 1], k, v, qpos, causal=True, window=window)[0, :, 0]
    return out


def _paged_update_ref(pool, new, table, slot, pos, used, *, slots, per_slot, window, dtype):
    table, page = table.reshape(slots, per_slot), pool.shape[2]
    out = pool.clone()
    for bi, ti in _paged_rows(slot, pos, used):
        p = int(pos[bi, ti])
        out[table[slot[bi, ti], p // page], :, p % page] = new[bi, :, ti]
    return out


row(
    "paged_attention",
    "rows-of-slots",
    lambda g, q, kp, vp, tab, sl, pos, used, slots, per_slot, window: ml.paged_attention(
        q, kp, vp, tab.reshape(slots, per_slot), sl, ml.where(used, pos, -1), window=window
    ),
    _paged_attention_ref,
    _paged_sample(update=False),
    fixed={3: "int64", 4: "int64", 5: "int64", 6: "bool"},
    reduce_len=lambda s: s.shapes[1][2] * s.kw["per_slot"] + s.shapes[0][3],
)
row(
    "paged_kv_cache_update",
    "rows-of-slots",
    lambda g, pool, new, tab, sl, pos, used, slots, per_slot, window: ml.paged_kv_cache_update(
        pool, new, tab.reshape(slots, per_slot), sl, ml.where(used, pos, -1)
    ),
    _paged_update_ref,
    _paged_sample(update=True),
    fixed={2: "int64", 3: "int64", 4: "int64", 5: "bool"},
    states=(0,),
)


# the key rotated at each row's position and written through the page table in one op: both layouts,
# partial rotary dims (head_dim even here)
def _rope_paged_sample(rng: np.random.Generator) -> Sample:
    base = _paged_sample(update=True)(rng)
    d = 2 * int(rng.choice([2, 3, 8, 20]))
    shapes = [(*base.shapes[0][:3], d), (*base.shapes[1][:3], d), *base.shapes[2:]]
    kw = {
        **base.kw,
        "layout": str(rng.choice(["neox", "interleaved"])),
        "rotary_dim": None if rng.random() < 0.6 else 2 * int(rng.integers(1, d // 2 + 1)),
        "theta": float(rng.choice([10000.0, 500000.0])),
    }
    return Sample(shapes, kw, base.domains)


def _rope_paged_ref(pool, new, table, slot, pos, used, *, dtype, layout, rotary_dim, theta, **kw):
    turned = rnd(rope_ref(new, pos.clamp(min=0)[:, None, :], layout=layout, rotary_dim=rotary_dim, theta=theta), dtype)
    return _paged_update_ref(pool, turned, table, slot, pos, used, dtype=dtype, **kw)


row(
    "rope_paged_kv_cache_update",
    "rows-of-slots",
    lambda g, pool, new, tab, sl, pos, used, slots, per_slot, window, **kw: ml.rope_paged_kv_cache_update(
        pool, new, tab.reshape(slots, per_slot), sl, ml.where(used, pos, -1), **kw
    ),
    _rope_paged_ref,
    _rope_paged_sample,
    fixed={2: "int64", 3: "int64", 4: "int64", 5: "bool"},
    states=(0,),
)

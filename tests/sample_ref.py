"""An independent implementation of ``sample``'s definition (megaloop.frontend.ops.sample) for the
tests: a row at a time in torch and Python integers (unbounded, so floors of products are plain
``>>``), thresholds from sorted values and unique values instead of megaloop's integer keys and
cumulative sums, Philox4x32-10 written out again. Only the definition's constants (the polynomial,
log2(e) in float32) are shared with megaloop."""

from __future__ import annotations

import torch

from megaloop.frontend.ops._sampling import EXP2_COEFFS, LOG2E

M32 = 0xFFFFFFFF


def philox(counter: tuple[int, int, int, int], key: tuple[int, int]) -> tuple[int, int, int, int]:
    """Philox4x32-10 (Salmon et al., SC'11) on Python ints."""
    c, (k0, k1) = list(counter), key
    for r in range(10):
        if r:
            k0, k1 = (k0 + 0x9E3779B9) & M32, (k1 + 0xBB67AE85) & M32
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k0, p1 & M32, (p0 >> 32) ^ c[3] ^ k1, p0 & M32]
    return c[0], c[1], c[2], c[3]


def draw(seed: int, offset: int) -> int:
    """The 64-bit uniform integer of (seed, offset)."""
    s, o = seed & (2**64 - 1), offset & (2**64 - 1)
    x0, x1, _, _ = philox((o & M32, o >> 32, 0, 0), (s & M32, s >> 32))
    return x0 | (x1 << 32)


def weights(e: torch.Tensor) -> list[int]:
    """Integer weights of float32 exponents e (base 2, <= 0): floor(P(f) 2^(40 + floor(e)))."""
    j = torch.floor(e)
    f = e - j
    p = torch.full_like(f, float(EXP2_COEFFS[-1]))
    for c in reversed(EXP2_COEFFS[:-1]):
        p = p * f + torch.tensor(float(c), dtype=torch.float32)
    p = p * f + torch.tensor(1.0, dtype=torch.float32)
    exact = p.double() * torch.pow(torch.tensor(2.0, dtype=torch.float64), (40 + j).double())  # 24 bits: exact
    return [0 if float(ei) < -40 else int(v) for ei, v in zip(e.tolist(), torch.floor(exact).tolist())]


def sample_row(
    x: torch.Tensor, seed: int, offset: int, temperature: float, top_k: int, top_p: float, min_p: float = 0.0
) -> int:
    """One row's token: ``x`` float32 [n]."""
    n = x.shape[0]
    nan = torch.isnan(x)
    if nan.any():
        return int(torch.nonzero(nan)[0])
    best = int(torch.argmax(x))  # the first largest (torch's documented choice)
    m = x[best]
    if not torch.isfinite(m) or temperature < 2.0**-126:
        return best
    c = torch.tensor(float(LOG2E), dtype=torch.float32) / torch.tensor(temperature, dtype=torch.float32)
    w = weights((x - m) * c)
    values = x.tolist()
    kept = [True] * n
    if 1 <= top_k < n:
        kth = float(torch.sort(x, descending=True).values[top_k - 1])
        kept = [v >= kth for v in values]
    p24 = round(top_p * 2**24)  # round half to even, as rint
    if p24 < 2**24:
        target = (sum(wi for wi, k in zip(w, kept) if k) * p24) >> 24
        mass, floor = 0, None
        for v in sorted({v for v, k in zip(values, kept) if k}, reverse=True):
            mass += sum(wi for wi, xv, k in zip(w, values, kept) if k and xv == v)
            if mass >= target:
                floor = v
                break
        kept = [k and v >= floor for v, k in zip(values, kept)]
    least = round(min_p * 2**24) * 2**16  # min-p: weights below min_p of the largest one's 2^40 dropped
    kept = [k and wi >= least for wi, k in zip(w, kept)]
    total = sum(wi for wi, k in zip(w, kept) if k)
    r = (draw(seed, offset) * total) >> 64
    running = 0
    for i, (wi, k) in enumerate(zip(w, kept)):
        running += wi if k else 0
        if running > r:
            return i
    raise AssertionError("the running sum never passed the draw")


def sample_ref(logits, seed, offset, temperature, top_k, top_p, min_p=None, **kw) -> torch.Tensor:
    """``sample`` of torch tensors (float64 logits holding the dtype's values, int64 / float64 parameters)."""
    rows = tuple(logits.shape[:-1])
    x = logits.reshape(-1, logits.shape[-1]).to(torch.float32)
    min_p = torch.zeros(()) if min_p is None else min_p
    params = [
        torch.broadcast_to(t, rows).reshape(-1).tolist() for t in (seed, offset, temperature, top_k, top_p, min_p)
    ]
    tokens = [
        sample_row(x[i], int(s), int(o), float(t), int(k), float(p), float(q))
        for i, (s, o, t, k, p, q) in enumerate(zip(*params))
    ]
    return torch.tensor(tokens, dtype=torch.int64).reshape(rows)


def keys(x: torch.Tensor) -> list[int]:
    """The definition's order keys of float32 x: the bits, complemented for negatives, the sign bit set
    for the others (-0.0 first made +0.0)."""
    u = ((x + 0.0).view(torch.int32).to(torch.int64) & M32).tolist()
    return [(~v & M32) if v >> 31 else v | 0x80000000 for v in u]


def as_int64(v: int) -> int:
    return v - 2**64 if v >= 2**63 else v


def sample_partial_ref(logits, temperature, *, splits: int, **kw) -> torch.Tensor:
    """sample_partial's summaries [..., ranges, 2 + 2L] (megaloop.frontend.ops.sample_split), a range at
    a time: total weight; bound (the (L+1)-th largest key) + 2^32 * count; (key * 2^32 + index, weight)."""
    from megaloop.frontend.ops.argmax_split import split_ranges
    from megaloop.frontend.ops.sample_split import candidates_for

    rows, n = tuple(logits.shape[:-1]), logits.shape[-1]
    ranges, chunk = split_ranges(n, splits)
    cand = candidates_for(ranges)
    x = logits.reshape(-1, n).to(torch.float32)
    t = torch.broadcast_to(temperature, rows).reshape(-1).tolist()
    out = torch.zeros((x.shape[0], ranges, 2 + 2 * cand), dtype=torch.int64)
    for r in range(x.shape[0]):
        m = x[r].max()
        if torch.isnan(x[r]).any() or not torch.isfinite(m) or not 2.0**-126 <= t[r] < float("inf"):
            continue
        c = torch.tensor(float(LOG2E), dtype=torch.float32) / torch.tensor(t[r], dtype=torch.float32)
        w, k = weights((x[r] - m) * c), keys(x[r])
        for q in range(ranges):
            seg = range(q * chunk, min(n, (q + 1) * chunk))
            bound = sorted((k[i] for i in seg), reverse=True)[cand] if len(seg) > cand else 0
            picked = [i for i in seg if k[i] > bound]
            out[r, q, 0] = sum(w[i] for i in seg)
            out[r, q, 1] = bound | (len(picked) << 32)
            for j, i in enumerate(picked):
                out[r, q, 2 + 2 * j] = as_int64((k[i] << 32) | i)
                out[r, q, 3 + 2 * j] = w[i]
    return out.reshape(*rows, ranges, 2 + 2 * cand)

"""The arithmetic that defines ``sample`` (megaloop.frontend.ops.sample), bit for bit, in numpy.

Every step is exact integer arithmetic or a correctly rounded float32 operation (+, -, *, /, floor),
never a library exp or log and never a float sum whose order could vary, so that the loop kernel
(megaloop/codegen/include/megaloop/sample.cuh, with __fadd_rn/__fmul_rn: no FMA contraction) and
this module give the same bits. The pieces:

- ``order_keys``: each logit's float32 bits as an unsigned integer that orders like the value (-0.0
  made +0.0 first, so that equal values have equal keys);
- ``weights``: w_i = floor(P(f) * 2^(40 + j)) for e = (x_i - max) * (log2(e) / T), j = floor(e),
  f = e - j, P a degree-6 polynomial for 2^f on [0, 1] (Horner in float32); w_i = 0 for e < -40.
  So w_i ~ 2^40 * exp((x_i - max) / T), the row's largest logit weighs exactly 2^40;
- ``philox4x32_10``: the counter-based generator of Salmon et al. (Random123's Philox4x32-10);
- ``mulhi64``: floor(a * b / 2^64) of two uint64s (a uniform 64-bit draw scaled to [0, b)).
"""

from __future__ import annotations

import numpy as np

U32 = np.uint64(0xFFFFFFFF)
LOG2E = np.float32(1.4426950408889634)  # log2(e) rounded to float32 (0x1.715476p+0)
WEIGHT_BITS = 40  # the largest logit's weight is 2^WEIGHT_BITS
CUTOFF = np.float32(-40.0)  # weights of e < CUTOFF (below 2^-40 of the largest) are 0
# 2^f ~ 1 + f * (C1 + f * (C2 + ... + f * C6)) on [0, 1]: within 8.7e-8 (1.46 float32 ulps) of it in
# float32 Horner evaluation (tests/test_sample.py checks every float32 of [0, 1]); P(0) = 1, P(1) = 2
EXP2_COEFFS = tuple(
    np.float32(float.fromhex(h))
    for h in ("0x1.62e42cp-1", "0x1.ebfd58p-3", "0x1.c68912p-5", "0x1.3d0b90p-7", "0x1.46d63ep-10", "0x1.c541e4p-13")
)
FLT_MIN = np.float32(2.0**-126)  # temperatures below it (0 and subnormals) pick the argmax
MAX_VOCAB = 1 << 22  # weights < 2^41 each: sums of fewer than 2^22 of them fit 63 bits
TOP_P_BITS = 24  # top_p counts in units of 2^-24
PHILOX_M = (np.uint64(0xD2511F53), np.uint64(0xCD9E8D57))
PHILOX_W = (np.uint64(0x9E3779B9), np.uint64(0xBB67AE85))


def order_keys(x: np.ndarray) -> np.ndarray:
    """uint32 keys of float32 ``x`` (no NaN) that order as the values do; -0.0 and +0.0 share one."""
    u = (x.astype(np.float32) + np.float32(0.0)).view(np.uint32)
    return np.where(u >> np.uint32(31), ~u, u | np.uint32(0x80000000)).astype(np.uint32)


def key_values(keys: np.ndarray) -> np.ndarray:
    """The float32 values of uint32 order keys (order_keys' inverse; -0.0 comes back as +0.0)."""
    k = np.asarray(keys, np.uint32)
    return np.where(k >> np.uint32(31), k & np.uint32(0x7FFFFFFF), ~k).astype(np.uint32).view(np.float32)


def exp2_poly(f: np.ndarray) -> np.ndarray:
    """P(f) ~ 2^f for float32 f in [0, 1], Horner's scheme, each step a rounded multiply then add."""
    p = np.full(f.shape, EXP2_COEFFS[-1], np.float32)
    for c in reversed(EXP2_COEFFS[:-1]):
        p = p * f + c
    return p * f + np.float32(1.0)


def weights(x: np.ndarray, m: np.ndarray, c: np.ndarray) -> np.ndarray:
    """uint64 weights of float32 logits ``x`` [rows, n] for rows' maxima ``m`` and scales ``c`` =
    LOG2E / T [rows] (finite, positive); see the module docstring."""
    with np.errstate(all="ignore"):  # x - m may overflow to -inf (its weight is then 0)
        e = (x - m[:, None]) * c[:, None]
    zero = ~(e >= CUTOFF)
    e = np.where(zero, np.float32(0.0), e)
    j = np.floor(e)
    p = exp2_poly(e - j)
    scale = ((np.int64(127 + WEIGHT_BITS) + j.astype(np.int64)) << 23).astype(np.int32).view(np.float32)
    w = (p * scale).astype(np.uint64)  # exact: a power-of-two scaling, truncated to an integer
    w[zero] = 0
    return w


def philox4x32_10(counter: tuple[np.ndarray, ...], key: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
    """Philox4x32-10 of uint64 arrays holding 32-bit words: 4 counter words, 2 key words -> 4 words."""
    c0, c1, c2, c3 = (np.asarray(w, np.uint64) & U32 for w in counter)
    k0, k1 = (np.asarray(w, np.uint64) & U32 for w in key)
    for r in range(10):
        if r:
            k0, k1 = (k0 + PHILOX_W[0]) & U32, (k1 + PHILOX_W[1]) & U32
        p0, p1 = PHILOX_M[0] * c0, PHILOX_M[1] * c2  # 32 x 32 bits: exact in 64
        c0, c1, c2, c3 = (p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & U32, (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & U32
    return c0, c1, c2, c3


def split_words(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """An int64 array's two's complement bits as (low, high) 32-bit words in uint64 arrays."""
    u = np.asarray(v, np.int64).view(np.uint64)
    return u & U32, u >> np.uint64(32)


def uniform64(seed: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """The uint64 draw of (seed, offset): words 0 and 1 of Philox4x32-10 with key (seed low, seed high)
    and counter (offset low, offset high, 0, 0)."""
    s0, s1 = split_words(seed)
    o0, o1 = split_words(offset)
    zero = np.zeros_like(o0)
    x0, x1, _, _ = philox4x32_10((o0, o1, zero, zero), (s0, s1))
    return x0 | (x1 << np.uint64(32))


def mulhi64(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """floor(a * b / 2^64) for uint64 arrays, in 32-bit limbs."""
    a, b = np.asarray(a, np.uint64), np.asarray(b, np.uint64)
    a0, a1, b0, b1 = a & U32, a >> np.uint64(32), b & U32, b >> np.uint64(32)
    t = a1 * b0 + ((a0 * b0) >> np.uint64(32))
    u = a0 * b1 + (t & U32)
    return a1 * b1 + (t >> np.uint64(32)) + (u >> np.uint64(32))


def top_p_target(mass: np.ndarray, p24: np.ndarray) -> np.ndarray:
    """floor(mass * p24 / 2^24) exactly, for uint64 mass < 2^63 and 0 <= p24 <= 2^24."""
    mass, p24 = np.asarray(mass, np.uint64), np.asarray(p24, np.uint64)
    hi, lo = mass >> np.uint64(TOP_P_BITS), mass & np.uint64((1 << TOP_P_BITS) - 1)
    return hi * p24 + ((lo * p24) >> np.uint64(TOP_P_BITS))


def top_p_units(top_p: np.ndarray) -> np.ndarray:
    """top_p (float32, in (0, 1]) in units of 2^-24, rounded to nearest even: int64 in [0, 2^24]."""
    return np.rint(np.asarray(top_p, np.float32) * np.float32(1 << TOP_P_BITS)).astype(np.int64)


def min_p_weight(min_p: np.ndarray) -> np.ndarray:
    """The least weight min-p keeps: floor(q24 * 2^40 / 2^24) = q24 * 2^16 for min_p (float32 in
    [0, 1]) in units of 2^-24, q24 = rint(min_p * 2^24); uint64 in [0, 2^40] (0: off)."""
    return top_p_units(min_p).astype(np.uint64) << np.uint64(WEIGHT_BITS - TOP_P_BITS)


def sample_rows(
    x: np.ndarray,
    seed: np.ndarray,
    offset: np.ndarray,
    temperature: np.ndarray,
    top_k: np.ndarray,
    top_p: np.ndarray,
    min_p: np.ndarray,
) -> np.ndarray:
    """The token of each row of float32 logits ``x`` [rows, n] for per-row parameters [rows] (valid
    ones: temperature finite >= 0, top_k >= 0, top_p in (0, 1], min_p in [0, 1]). The definition,
    step by step."""
    rows, n = x.shape
    first = np.argmax(x, axis=-1)  # the first largest, or the first NaN (numpy's argmax, and ml.argmax's)
    m = x[np.arange(rows), first]
    greedy = ~np.isfinite(m) | ~(temperature >= FLT_MIN)
    out = first.astype(np.int64)
    s = np.flatnonzero(~greedy)
    if not s.size:
        return out
    x, m, temperature = x[s], m[s], temperature[s].astype(np.float32)
    top_k, p24, min_w = top_k[s].astype(np.int64), top_p_units(top_p[s]), min_p_weight(min_p[s])
    keys = order_keys(x)
    w = weights(x, m, LOG2E / temperature)
    # top-k: every logit >= the k-th largest (ties at the boundary all kept); off for k = 0 or k >= n
    use_k = (top_k >= 1) & (top_k < n)
    ascending = np.sort(keys, axis=-1)
    kth = np.take_along_axis(ascending, np.where(use_k, n - top_k, 0)[:, None], -1)[:, 0]
    floor_key = np.where(use_k, kth, np.uint32(0))
    in_k = keys >= floor_key[:, None]
    # top-p: the largest key whose logits at or above it (within top-k) weigh >= top_p of top-k's weight
    use_p = p24 < (1 << TOP_P_BITS)
    order = np.argsort(keys, axis=-1, kind="stable")[:, ::-1]
    cum = np.cumsum(np.take_along_axis(np.where(in_k, w, np.uint64(0)), order, -1), axis=-1, dtype=np.uint64)
    target = top_p_target(cum[:, -1], p24)
    first_reaching = np.argmax(cum >= target[:, None], axis=-1)
    p_key = np.take_along_axis(np.take_along_axis(keys, order, -1), first_reaching[:, None], -1)[:, 0]
    floor_key = np.where(use_p, np.maximum(p_key, floor_key), floor_key)
    # min-p (after top-k and top-p): only tokens weighing at least min_p of the largest logit's 2^40
    kept = np.where((keys >= floor_key[:, None]) & (w >= min_w[:, None]), w, np.uint64(0))
    # the draw: uniform in [0, kept mass), the first index whose running sum of kept weights exceeds it
    running = np.cumsum(kept, axis=-1, dtype=np.uint64)
    r = mulhi64(uniform64(seed[s], offset[s]), running[:, -1])
    out[s] = np.argmax(running > r[:, None], axis=-1)
    return out

"""Attention's mask operand beyond the op table's rows (tests/op_table/attention.py: bool and additive masks of
several broadcast shapes with causal, window, softcap, on each tile path, the split and append forms,
against torch's scaled_dot_product_attention(attn_mask=)): the build errors name the mask, the fuse
stage's append form keeps it, and ml.attention takes transformers' padding mask as it is."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import megaloop as ml
from megaloop.errors import DtypeError, ShapeError


def _qkv(g: ml.Graph, b=2, hq=4, hkv=2, tq=3, tk=5, d=8, dtype="float32"):
    return (
        g.input("q", (b, hq, tq, d), dtype),
        g.input("k", (b, hkv, tk, d), dtype),
        g.input("v", (b, hkv, tk, d), dtype),
    )


@pytest.mark.parametrize(
    "shape, dtype, error, words",
    [
        ((2, 4, 3, 5), "int64", DtypeError, "mask must be bool (True: attend) or a float dtype"),
        ((2, 2, 3, 5), "bool", ShapeError, "mask [2,2,3,5] must broadcast to the scores"),
        ((3, 6), "float32", ShapeError, "[batch, heads, q_len, kv_len] = [2,4,3,5]"),
        ((1, 2, 4, 3, 5), "bool", ShapeError, "mask [1,2,4,3,5] must broadcast"),
    ],
)
def test_a_mask_that_does_not_fit_is_refused_by_name(shape, dtype, error, words) -> None:
    g = ml.Graph("bad-mask")
    q, k, v = _qkv(g)
    with pytest.raises(error, match=r"(?s)attention: .*" + _escape(words)):
        ml.attention(q, k, v, mask=g.input("m", shape, dtype))


def _escape(text: str) -> str:
    import re

    return re.escape(text)


def test_a_padding_mask_equals_torch_sdpa_with_it() -> None:
    """transformers' padded batch: a [batch, 1, 1, kv_len] bool mask (left padding) with causal
    attention, against SDPA with the same mask and the causal one combined."""
    rng = np.random.default_rng(0)
    b, h, t, d = 2, 2, 6, 16
    g = ml.Graph("padding")
    q, k, v = _qkv(g, b, h, h, t, t, d)
    pad = g.input("pad", (b, 1, 1, t), "bool")
    g.output("o", ml.attention(q, k, v, causal=True, mask=pad))
    feeds = {n: rng.standard_normal(x.shape).astype(np.float32) for n, x in g.inputs.items() if n != "pad"}
    feeds["pad"] = np.ones((b, 1, 1, t), bool)
    feeds["pad"][1, ..., :2] = False  # the second sequence is 2 tokens shorter
    got = ml.evaluate(g, feeds).outputs["o"]
    tq = {n: torch.from_numpy(feeds[n]).double() for n in ("q", "k", "v")}
    allowed = torch.from_numpy(feeds["pad"]) & torch.ones(t, t, dtype=torch.bool).tril()
    want = torch.nan_to_num(F.scaled_dot_product_attention(tq["q"], tq["k"], tq["v"], attn_mask=allowed)).numpy()
    err = np.abs(got - want).max()
    assert err < 64 * np.finfo(np.float32).eps * math.sqrt(t + d), f"worst {err:.3e}"
    assert np.all(got[1, :, :2] == 0)  # padding queries see no key: zeros, not NaN


def test_the_fused_append_form_keeps_the_mask() -> None:
    """A decode step's attention over the caches just written, with a mask: the fuse stage's
    attention_append carries it into the append form, and the result is the unfused one."""
    rng = np.random.default_rng(1)
    b, hq, hkv, tk, d = 2, 4, 2, 8, 16
    g = ml.Graph("append-mask")
    q, k_new, v_new = (g.input(n, (b, h, 1, d), "float32") for n, h in (("q", hq), ("k", hkv), ("v", hkv)))
    pos = g.input("pos", (b, 1), "int64")
    mask = g.input("mask", (b, 1, 1, tk), "float32")
    kc, vc = g.state("kc", (b, hkv, tk, d), "float32"), g.state("vc", (b, hkv, tk, d), "float32")
    rq = ml.rope(q, ml.reshape(pos, (b, 1, 1)))
    k_all = ml.kv_cache_update(kc, ml.rope(k_new, ml.reshape(pos, (b, 1, 1))), pos)
    v_all = ml.kv_cache_update(vc, v_new, pos)
    g.output("o", ml.attention(rq, k_all, v_all, causal=True, q_positions=pos, kv_splits=2, mask=mask))
    fused = ml.fuse(g)
    partial = [n for n in fused.nodes if n.op.name == "attention_partial"]
    assert len(partial) == 1 and "theta" in partial[0].attrs and partial[0].attrs.get("masked"), partial
    feeds = {n: rng.standard_normal(x.shape).astype(np.float32) for n, x in g.inputs.items()}
    feeds["pos"] = np.array([[5], [2]])
    feeds["mask"] = np.where(rng.random((b, 1, 1, tk)) < 0.3, -np.inf, rng.standard_normal((b, 1, 1, tk)))
    feeds["mask"] = feeds["mask"].astype(np.float32)
    state = {n: rng.standard_normal((b, hkv, tk, d)).astype(np.float32) for n in ("kc", "vc")}
    want = ml.evaluate(g, feeds, state=state).outputs["o"]
    got = ml.evaluate(fused, feeds, state=state).outputs["o"]
    err = np.abs(got - want).max()
    assert err < 16 * np.finfo(np.float32).eps * math.sqrt(tk + d), f"worst {err:.3e}"

"""Shared pieces of the lane-level emulators: plan -> LoopProgram, arena model, source parsing."""
import re
import sys

import numpy as np
import torch

sys.path.insert(0, "/work/main")
from megaloop.codegen import generate  # noqa: E402
from megaloop.plan import make_plan  # noqa: E402

F32 = np.float32


def round_to(dtype_name, a):
    t = torch.from_numpy(np.asarray(a, np.float64))
    tt = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype_name]
    return t.to(tt).to(torch.float64).numpy()


class Arena:
    """Values keyed by the byte offset where an element starts; counts of stores per element."""

    def __init__(self, nbytes):
        self.val = np.full(nbytes + 64, np.nan)
        self.writes = np.zeros(nbytes + 64, np.int32)
        self.written_by = {}

    def fill(self, base, itemsize, shape, strides, values):
        idx = np.indices(shape).reshape(len(shape), -1).T
        for i, v in zip(idx, values.reshape(-1)):
            self.val[base + int(np.dot(i, strides)) * itemsize] = v

    def read(self, base, itemsize, shape, strides):
        idx = np.indices(shape).reshape(len(shape), -1).T
        out = np.empty(len(idx))
        cnt = np.empty(len(idx), np.int32)
        for n, i in enumerate(idx):
            a = base + int(np.dot(i, strides)) * itemsize
            out[n] = self.val[a]
            cnt[n] = self.writes[a]
        return out.reshape(shape), cnt.reshape(shape)


def sig_text(source, sig):
    start = source.index(f"void sig_{sig}(")
    end = source.index("\n}\n", start)
    return source[start:end]


def cexpr(expr):
    """A generated C++ index expression as Python (o[...] indices, integer arithmetic)."""
    return expr.replace("(ml::i64)", "").strip()


def tensor_base(rp, tid):
    t = rp.tensors[tid]
    return rp.buffers[t.buffer].offset + t.offset * t.dtype.itemsize


def warp_sum(v):
    """ml::warp_sum over a (..., 32) float32 array of lanes: the xor butterfly."""
    v = v.astype(F32)
    lanes = np.arange(32)
    for o in (16, 8, 4, 2, 1):
        v = (v + v[..., lanes ^ o]).astype(F32)
    return v


def warp_max(v):
    v = v.astype(F32)
    lanes = np.arange(32)
    for o in (16, 8, 4, 2, 1):
        w = v[..., lanes ^ o]
        v = np.where((w > v) | np.isnan(w), w, v).astype(F32)
    return v


def block_sum(v):
    """ml::block_sum over (threads,) float32: warp sums, then warps added in order from 0.0f."""
    w = warp_sum(v.reshape(-1, 32))[:, 0]
    s = F32(0.0)
    for x in w:
        s = F32(s + x)
    return s


def block_max(v):
    w = warp_max(v.reshape(-1, 32))[:, 0]
    m = w[0]
    for x in w[1:]:
        m = x if (x > m or np.isnan(x)) else m
    return F32(m)

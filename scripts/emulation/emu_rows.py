"""(Mirrors the px/nx prefetch of 0d7e1bf; the ring of rows that replaced it is not mirrored yet.)
Lane-level emulation of the block-per-row path of rows() (softmax, log_softmax, layernorm, rmsnorm).

Mirrors the generated code of each op, reading its constants and index expressions from the generated
source: row_at (box_index over rowt), the px/nx pipeline (prefetch of row e+1 before row e's
reductions, px = nx at the end), pk < packs guards, block_sum/block_max (warp butterflies then warps in
order), and the stores. Checks every output element is stored exactly once, with values vs float64.
"""
import math
import re
import sys

import numpy as np

sys.path.insert(0, __import__("os").path.dirname(__file__))
from emu_common import (  # noqa: E402
    F32, Arena, block_max, block_sum, cexpr, generate, make_plan, round_to, sig_text, tensor_base,
)

import megaloop as ml  # noqa: E402

ROWS_OPS = ("softmax", "log_softmax", "layernorm", "rmsnorm")


def parse_block_path(text):
    m = re.search(r"if \((.*) && blockDim\.x >= (\d+)\) \{  // a block per row", text)
    if not m:
        return None
    start = m.start()
    end = text.index("return;", start)
    body = text[start:end]
    p = {
        "checks": re.findall(r"ml::aligned\((\w+), (\d+)\)", m.group(1)),
        "min_threads": int(m.group(2)),
        "axis": int(re.search(r"rowt\.hi\[(\d+)\] = rowt\.lo", text).group(1)),
        "nd": int(re.search(r"box_count<(\d+)>", body).group(1)),
        "xb": cexpr(re.search(r"\n\s+xb = (.+);", body).group(1)),
        "ob": cexpr(re.search(r"\n\s+ob = (.+);", body).group(1)),
        "held": int(re.search(r"px\[(\d+)\];", body).group(1)),
        "packs": set(int(v) for v in re.findall(r"pk [<>]=? (\d+)", body)),
        "width": set(int(v) for v in re.findall(r"load_pack<[\w:]+, (\d+)>", body)),
        "prefetch": "nx[" in body,
        "n_block_calls": len(re.findall(r"ml::block_(?:sum|max)\(", body)),
    }
    assert len(p["packs"]) == 1 and len(p["width"]) == 1, p
    p["packs"], p["width"] = p["packs"].pop(), p["width"].pop()
    return p


def box_index(lo, hi, nd, e):
    o = [0] * (nd + 1)
    for d in range(nd - 1, -1, -1):
        ext = hi[d] - lo[d]
        o[d] = lo[d] + e % ext
        e //= ext
    return o


def emulate_op(prog, rp, op, arena, threads):
    text = sig_text(prog.source, prog.tasks["sig"][[i for i, t in enumerate(prog.tasks) if t["op"] == op.id][0]])
    p = parse_block_path(text)
    if p is None:
        return None
    x_t = rp.tensors[op.inputs[0]]
    out_t = rp.tensors[op.outputs[0]]
    ops_off = prog.operand_offsets[op.id]
    n_in = len(op.inputs)
    names = [f"in{k}" for k in range(n_in)] + ["out0"]
    ptr = dict(zip(names, ops_off[: n_in + 1]))
    # the run-time dispatch: alignment and block size
    if not all(ptr[nm] % int(b) == 0 for nm, b in p["checks"]) or threads < p["min_threads"]:
        return "not taken"
    isz_x, isz_o = x_t.dtype.itemsize, out_t.dtype.itemsize
    n = x_t.shape[p["axis"]]
    W, packs, held = p["width"], p["packs"], p["held"]
    assert packs * W == n and held * threads >= packs, (packs, W, n, held, threads)
    eps = F32(op.attrs.get("eps", 0.0))
    absent = op.attrs.get("absent", ())
    wnames = ("weight", "bias") if op.op == "layernorm" else ("weight",)
    present = [nm for k, nm in enumerate(wnames, start=1) if k not in absent] if op.op in ("layernorm", "rmsnorm") else []
    params = {}
    for nm in present:
        k = present.index(nm) + 1
        t = rp.tensors[op.inputs[k]]
        base = ops_off[k]
        params[nm] = np.array([arena.val[base + j * t.strides[0] * t.dtype.itemsize] for j in range(n)], F32)
    tid = np.arange(threads)
    n_block_calls = 0
    for task in prog.tasks:
        if task["op"] != op.id:
            continue
        lo, hi = list(task["lo"]), list(task["hi"])
        rlo, rhi = lo[:], hi[:]
        rhi[p["axis"]] = rlo[p["axis"]] + 1
        nrows = math.prod(rhi[d] - rlo[d] for d in range(p["nd"]))

        def row_at(e):
            o = box_index(rlo, rhi, p["nd"], e)
            env = {"o": o}
            return eval(p["xb"], env), eval(p["ob"], env)

        def load_row(base):
            # px[u] for every thread: (threads, held, W) values, NaN-poisoned where not loaded
            v = np.full((threads, held, W), np.nan, F32)
            for u in range(held):
                pk = tid + u * threads
                ok = pk < packs
                for q in range(W):
                    addr = ptr["in0"] + (base + pk[ok] * W + q) * isz_x
                    v[ok, u, q] = arena.val[addr]
            return v

        xb, ob = row_at(0)
        px = load_row(xb)
        for e in range(nrows):
            if p["prefetch"]:
                nxb, nob = xb, ob
                nx = np.full_like(px, np.nan)  # uninitialised on the last row
                if e + 1 < nrows:
                    nxb, nob = row_at(e + 1)
                    nx = load_row(nxb)
            valid = (tid[:, None] + np.arange(held)[None, :] * threads) < packs  # (threads, held)
            vals = px  # (threads, held, W)
            mask = np.repeat(valid[:, :, None], W, axis=2)

            def thread_fold(fn, init):
                acc = np.full(threads, init, F32)
                for u in range(held):
                    for q in range(W):
                        m = valid[:, u]
                        acc[m] = fn(acc[m], vals[m, u, q])
                return acc

            if op.op in ("softmax", "log_softmax"):
                m = thread_fold(lambda a, v: np.where((v > a) | np.isnan(v), v, a).astype(F32), -np.inf)
                M = block_max(m)
                s = thread_fold(lambda a, v: (a + np.exp(v - M, dtype=F32)).astype(F32), 0.0)
                S = block_sum(s)
                n_block_calls += 2
                y = np.exp(vals - M, dtype=F32) / S if op.op == "softmax" else (vals - M) - F32(np.log(S))
            else:
                j = (tid[:, None, None] + np.arange(held)[None, :, None] * threads) * W + np.arange(W)[None, None, :]
                jj = np.clip(j, 0, n - 1)
                if op.op == "layernorm":
                    s = thread_fold(lambda a, v: (a + v).astype(F32), 0.0)
                    mean = F32(block_sum(s) / F32(n))
                    q2 = thread_fold(lambda a, v: (a + (v - mean) * (v - mean)).astype(F32), 0.0)
                    den = F32(np.sqrt(F32(block_sum(q2) / F32(n) + eps)))
                    n_block_calls += 2
                    y = (vals - mean) / den
                else:
                    q2 = thread_fold(lambda a, v: (a + v * v).astype(F32), 0.0)
                    den = F32(np.sqrt(F32(block_sum(q2) / F32(n) + eps)))
                    n_block_calls += 1
                    y = vals / den
                if "weight" in params:
                    y = y * params["weight"][jj]
                if "bias" in params:
                    y = y + params["bias"][jj]
            # stores
            for u in range(held):
                pk = tid + u * threads
                ok = pk < packs
                for q in range(W):
                    addr = ptr["out0"] + (ob + pk[ok] * W + q) * isz_o
                    arena.val[addr] = y[ok, u, q]
                    arena.writes[addr] += 1
            if p["prefetch"]:
                px, xb, ob = nx, nxb, nob
            elif e + 1 < nrows:
                xb, ob = row_at(e + 1)
                px = load_row(xb)
    return p


def reference(op, arrays, attrs):
    from megaloop.frontend.opdef import REGISTRY  # noqa

    return REGISTRY[op].reference(arrays, attrs)


def run_graph(g, processors, tiles=None, warps=8, seed=0, label=""):
    plan = make_plan(g, processors=processors, tiles=tiles or {}, warps=warps)
    rp = plan.ranks[0]
    prog = generate(plan)
    arena = Arena(rp.arena_bytes)
    rng = np.random.default_rng(seed)
    host = {}
    for name, t in rp.graph.inputs.items():
        tid = rp.tensor_of[t]
        pt = rp.tensors[tid]
        v = round_to(pt.dtype.name, rng.standard_normal(pt.shape) * 2.0)
        host[tid] = v
        arena.fill(tensor_base(rp, tid), pt.dtype.itemsize, pt.shape, pt.strides, v)
    results = []
    for op in rp.ops:
        if op.op not in ROWS_OPS:
            if op.op == "mul":  # softmax(x * 3): run the elementwise op in float64 (not under review)
                x = host[op.inputs[0]]
                y = round_to(rp.tensors[op.outputs[0]].dtype.name, x * op.attrs["scalars"][1])
                host[op.outputs[0]] = y
                ot = rp.tensors[op.outputs[0]]
                arena.fill(tensor_base(rp, op.outputs[0]), ot.dtype.itemsize, ot.shape, ot.strides, y)
                continue
            raise NotImplementedError(op.op)
        p = emulate_op(prog, rp, op, arena, prog.threads)
        ot = rp.tensors[op.outputs[0]]
        got, cnt = arena.read(tensor_base(rp, op.outputs[0]), ot.dtype.itemsize, ot.shape, ot.strides)
        ref = reference(op.op, [host[i] for i in op.inputs], op.attrs)
        host[op.outputs[0]] = round_to(ot.dtype.name, ref)
        if p is None or p == "not taken":
            results.append((label, op.name, "block path " + ("absent" if p is None else "not taken")))
            continue
        err = np.nanmax(np.abs(got - ref) / (1.0 + np.abs(ref)))
        ntasks = int(sum(t["op"] == op.id for t in prog.tasks))
        rows_per = sorted({int(np.prod([t["hi"][d] - t["lo"][d] for d in range(len(ot.shape)) if d != p["axis"]]))
                           for t in prog.tasks if t["op"] == op.id})
        ok = cnt.min() == 1 and cnt.max() == 1 and err < 5e-5 and not np.isnan(got).any()
        results.append((label, op.name, f"{ot.dtype.short}{list(ot.shape)} held={p['held']} prefetch={p['prefetch']} "
                        f"packs={p['packs']} tasks={ntasks} rows/task={rows_per} writes[min,max]=[{cnt.min()},{cnt.max()}] "
                        f"max_rel_err={err:.2e} {'OK' if ok else 'FAIL'}"))
    return results


def single(op, dtype, shape, axis=-1, weight=True, bias=True):
    g = ml.Graph(f"{op}-{dtype}-{'x'.join(map(str, shape))}")
    x = g.input("x", shape, dtype)
    if op == "softmax":
        y = ml.softmax(x, axis)
    elif op == "log_softmax":
        y = ml.log_softmax(x, axis)
    elif op == "rmsnorm":
        y = ml.rmsnorm(x, g.input("w", shape[-1:], dtype) if weight else None, eps=1e-6)
    else:
        w = g.input("w", shape[-1:], dtype) if weight else None
        b = g.input("b", shape[-1:], dtype) if bias else None
        y = ml.layernorm(x, w, b, eps=1e-5)
    g.output("y", y)
    return g


if __name__ == "__main__":
    from tests.test_codegen import long_rows_graph

    out = []
    out += run_graph(long_rows_graph(), processors=2, label="long_rows p=2")
    out += run_graph(long_rows_graph(), processors=132, label="long_rows p=132")
    cases = [
        # (op, dtype, shape, processors, tiles)
        ("rmsnorm", "bfloat16", (3, 5, 1024), 3, {"rmsnorm": {"elements": 3 * 1024}}),  # 3-D, tasks split axis 1: 3+2
        ("rmsnorm", "bfloat16", (7, 2048), 1, {"rmsnorm": {"elements": 5 * 2048}}),  # 5 + 2 rows
        ("rmsnorm", "float32", (13, 512), 1, None),  # 128 packs: threads 128.. idle
        ("softmax", "float16", (7, 13, 1032), 5, {"softmax": {"elements": 6 * 1032}}),  # 129 packs, held 1
        ("log_softmax", "float32", (11, 4100), 2, None),  # 1025 packs: held 5, one thread with a 5th pack
        ("layernorm", "bfloat16", (5, 16392), 1, None),  # 2049 packs: held 9 (no prefetch), thread 0 only in u=8
        ("layernorm", "float32", (6, 8192), 2, None),  # 2048 packs: held 8 exact
        ("layernorm", "float16", (4, 3, 1024), 1, None),  # no weight/bias variants below
        ("rmsnorm", "bfloat16", (1, 4096), 1, None),  # a single row (no next row)
        ("rmsnorm", "bfloat16", (9, 32768), 4, None),  # 16 packs a thread
    ]
    for op, dt, shape, procs, tiles in cases:
        out += run_graph(single(op, dt, shape), processors=procs, tiles=tiles, label=f"{op} p={procs}")
    out += run_graph(single("layernorm", "float16", (4, 3, 1024), weight=False), 1, label="ln no weight")
    out += run_graph(single("layernorm", "float16", (4, 3, 1024), bias=False), 1, label="ln no bias")
    out += run_graph(single("rmsnorm", "float32", (5, 2048), weight=False), 1, label="rms no weight")
    # softmax of a non-last axis takes no packed path: should report the block path absent
    out += run_graph(single("softmax", "float32", (1024, 6), axis=0), 1, label="softmax axis 0")
    # 512 threads per block
    out += run_graph(single("layernorm", "float32", (6, 8192)), 2, warps=16, label="ln warps=16")
    for r in out:
        print(" | ".join(r))

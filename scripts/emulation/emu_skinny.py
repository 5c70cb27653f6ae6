"""Lane-level emulation of _skinny (a warp per output column, all the tile's rows) and of the packed
warp-per-element path below it, from the generated source: per task, colt, for_box_warps, per-lane
accumulation order, K tails, nr break, warp_sum butterfly, store addresses. Checks: every output element
stored exactly once, skinny == packed bitwise per element, values vs float64."""
import math
import re
import sys

import numpy as np

sys.path.insert(0, __import__("os").path.dirname(__file__))
from emu_common import F32, Arena, cexpr, generate, make_plan, round_to, sig_text, tensor_base, warp_sum  # noqa: E402

import megaloop as ml  # noqa: E402


def parse(text):
    m = re.search(r"t\.hi\[(\d+)\] - t\.lo\[\d+\] <= (\d+)\) \{  // at most", text)
    if not m:
        return None
    s0 = m.start()
    s1 = text.index("return;", s0)
    sk = text[s0:s1]
    pk0 = text.index("// packed path", s1)
    pk1 = text.index("return;", pk0)
    pp = text[pk0:pk1]
    p = {"R": int(m.group(1)), "rows": int(m.group(2))}
    p["ab"] = cexpr(re.search(r"const ml::i64 ab = (.+);", sk).group(1))
    p["bb"] = cexpr(re.search(r"const ml::i64 bb = (.+);", sk).group(1))
    p["a_row"] = int(re.search(r"in0 \+ ab \+ \(ml::i64\)r \* (\d+) \+ (?:min\()?kk", sk).group(1))
    lm = re.search(r"for \(int k0 = lane \* (\d+); k0 < (\d+); k0 \+= (\d+) \* (\d+)\)", sk)
    p["W"], p["K"], p["packs"], p["step"] = map(int, lm.groups())
    st = re.search(r"ml::store\(out0 \+ (.+) \+ \(ml::i64\)r \* (\d+), s\);", sk)
    p["out_at"], p["out_row"] = cexpr(st.group(1)), int(st.group(2))
    p["acc_n"] = int(re.search(r"float acc\[(\d+)\];", sk).group(1))
    p["guards"] = re.findall(r"kk < (\d+)", sk)
    # the packed path
    q = {}
    q["ab"] = cexpr(re.search(r"const ml::i64 ab = (.+);", pp).group(1))
    q["bb"] = cexpr(re.search(r"const ml::i64 bb = (.+);", pp).group(1))
    lm = re.search(r"for \(int k0 = lane \* (\d+); k0 < (\d+); k0 \+= (\d+) \* (\d+)\)", pp)
    q["W"], q["K"], q["packs"], q["step"] = map(int, lm.groups())
    q["out_at"] = cexpr(re.search(r"ml::store\(out0 \+ (.+), acc\);", pp).group(1))
    p["packed"] = q
    return p


def dot(a, b):
    """ml::dot over packs (lanes, W): s = 0; s += a_i * b_i (fma), in float32."""
    s = np.zeros(a.shape[0], F32)
    for i in range(a.shape[1]):
        s = (s.astype(np.float64) + a[:, i].astype(np.float64) * b[:, i].astype(np.float64)).astype(F32)
    return s


def load_packs(arena, base_ptr, isz, offs, W):
    """(lanes, W) values at element offsets offs (lanes,) from the operand pointer."""
    out = np.empty((len(offs), W), F32)
    for q in range(W):
        out[:, q] = arena.val[base_ptr + (offs + q) * isz]
    return out


def lane_accumulate(arena, pa, pb, isz_a, isz_b, ab_rows, bb, W, K, packs, step):
    """Per lane, the sequence acc += dot(A pack, B pack) for each row in ab_rows: returns (rows, 32)."""
    lanes = np.arange(32)
    acc = np.zeros((len(ab_rows), 32), F32)
    for k0 in range(0, K + 32 * W, packs * step):  # k0 = lane * W + j * packs * step
        for u in range(packs):
            kk = lanes * W + k0 + u * step
            live = kk < K
            if not live.any():
                continue
            b = load_packs(arena, pb, isz_b, bb + kk[live], W)
            for r, ab in enumerate(ab_rows):
                a = load_packs(arena, pa, isz_a, ab + kk[live], W)
                acc[r, live] = (acc[r, live] + dot(a, b)).astype(F32)
    return acc


def box_index(lo, hi, nd, e):
    o = [0] * (nd + 1)
    for d in range(nd - 1, -1, -1):
        ext = hi[d] - lo[d]
        o[d] = lo[d] + e % ext
        e //= ext
    return o


def run_graph(g, processors, tiles=None, warps=8, seed=0, label=""):
    plan = make_plan(g, processors=processors, tiles=tiles or {}, warps=warps)
    rp = plan.ranks[0]
    prog = generate(plan)
    arena = Arena(rp.arena_bytes)
    rng = np.random.default_rng(seed)
    host = {}
    for name, t in list(rp.graph.inputs.items()) + list(getattr(rp.graph, "parameters", {}).items()):
        tid = rp.tensor_of[t]
        pt = rp.tensors[tid]
        v = round_to(pt.dtype.name, rng.standard_normal(pt.shape))
        host[tid] = v
        arena.fill(tensor_base(rp, tid), pt.dtype.itemsize, pt.shape, pt.strides, v)
    results = []
    for op in rp.ops:
        if op.op != "matmul":
            continue
        tasks = [t for t in prog.tasks if t["op"] == op.id]
        text = sig_text(prog.source, tasks[0]["sig"])
        p = parse(text)
        ot = rp.tensors[op.outputs[0]]
        at, bt = (rp.tensors[i] for i in op.inputs)
        if p is None:
            results.append((label, op.name, f"{ot.dtype.short}{list(ot.shape)} no skinny path (tile {op.attrs})"))
            continue
        if "ml::mma_tile" in text and "blockDim.x ==" in text:
            results.append((label, op.name, f"{ot.dtype.short}{list(ot.shape)}: tensor-core path first (rows {p['rows']})"))
            continue
        off = prog.operand_offsets[op.id]
        pa, pb, po = (int(v) for v in off[:3])
        assert pa % 16 == 0 and pb % 16 == 0
        nd = len(ot.shape)
        R = p["R"]
        assert R == nd - 2
        threads = prog.threads
        warps_n = threads // 32
        bit_mismatch = 0
        nr_seen = set()
        for t in tasks:
            lo, hi = list(t["lo"]), list(t["hi"])
            nr = hi[R] - lo[R]
            assert nr <= p["rows"]
            nr_seen.add(nr)
            clo, chi = lo[:], hi[:]
            chi[R] = clo[R] + 1
            total = math.prod(chi[d] - clo[d] for d in range(nd))
            for w in range(warps_n):
                for e in range(w, total, warps_n):
                    o = box_index(clo, chi, nd, e)
                    env = {"o": o}
                    ab, bb = eval(p["ab"], env), eval(p["bb"], env)
                    rows_ab = [ab + r * p["a_row"] for r in range(min(nr, p["acc_n"]))]
                    acc = lane_accumulate(arena, pa, pb, at.dtype.itemsize, bt.dtype.itemsize, rows_ab, bb,
                                          p["W"], p["K"], p["packs"], p["step"])
                    s = warp_sum(acc)[:, 0]
                    q = p["packed"]
                    for r in range(min(nr, p["acc_n"])):
                        addr = po + (eval(p["out_at"], env) + r * p["out_row"]) * ot.dtype.itemsize
                        arena.val[addr] = s[r]
                        arena.writes[addr] += 1
                        # the packed path's value for element (row lo + r, this column)
                        o2 = list(o)
                        o2[R] = o[R] + r
                        env2 = {"o": o2}
                        assert eval(q["out_at"], env2) * ot.dtype.itemsize + po == addr
                        acc2 = lane_accumulate(arena, pa, pb, at.dtype.itemsize, bt.dtype.itemsize,
                                               [eval(q["ab"], env2)], eval(q["bb"], env2), q["W"], q["K"],
                                               q["packs"], q["step"])
                        s2 = warp_sum(acc2)[0, 0]
                        if s2.view(np.uint32) != s[r].view(np.uint32):
                            bit_mismatch += 1
        got, cnt = arena.read(tensor_base(rp, op.outputs[0]), ot.dtype.itemsize, ot.shape, ot.strides)
        A = arena.read(tensor_base(rp, op.inputs[0]), at.dtype.itemsize, at.shape, at.strides)[0]
        B = arena.read(tensor_base(rp, op.inputs[1]), bt.dtype.itemsize, bt.shape, bt.strides)[0]
        if op.attrs["transpose_a"]:
            A = np.swapaxes(A, -1, -2)
        if op.attrs["transpose_b"]:
            B = np.swapaxes(B, -1, -2)
        ref = np.matmul(A, B)
        host[op.outputs[0]] = round_to(ot.dtype.name, ref)
        err = np.max(np.abs(got - ref)) / (1 + np.max(np.abs(ref)))
        ok = cnt.min() == 1 and cnt.max() == 1 and err < 1e-5 and bit_mismatch == 0
        results.append((label, op.name, f"{ot.dtype.short}{list(ot.shape)} <- {list(at.shape)}{list(at.strides)} x "
                        f"{list(bt.shape)}{list(bt.strides)} rows_hint={p['rows']} nr={sorted(nr_seen)} packs={p['packs']} "
                        f"tasks={len(tasks)} writes[min,max]=[{cnt.min()},{cnt.max()}] bit_mismatch={bit_mismatch} "
                        f"err={err:.1e} {'OK' if ok else 'FAIL'}"))
    return results


if __name__ == "__main__":
    from tests.test_codegen import few_row_matmul_graph

    out = []
    quick = len(sys.argv) > 1

    def g_custom():
        g = ml.Graph("skinny-custom")
        # batch broadcast: A batched, weights shared (2-D B)
        x = g.input("xa", (3, 5, 72), "bfloat16")
        g.output("ya", ml.matmul(x, g.parameter("wa", (40, 72), "bfloat16"), transpose_b=True))
        # A 2-D, B batched
        x2 = g.input("xb", (6, 48), "float32")
        g.output("yb", ml.matmul(x2, g.parameter("wb", (2, 24, 48), "float32"), transpose_b=True))
        # A batch axis of 1 broadcast against B's 2
        x3 = g.input("xc", (1, 4, 16), "bfloat16")
        g.output("yc", ml.matmul(x3, g.parameter("wc", (2, 20, 16), "bfloat16"), transpose_b=True))
        # transpose_a with a K-contiguous view (A stored [M, K], passed as [K, M] transposed)
        xt = g.input("xt", (9, 24), "float32")
        g.output("yt", ml.matmul(xt.transpose(), g.parameter("wt", (30, 24), "float32").transpose(), transpose_a=True))
        # K smaller than a lane's pack stride (lanes >= 1 idle), and K = one pack
        x5 = g.input("xk", (3, 16), "bfloat16")
        g.output("yk", ml.matmul(x5, g.parameter("wk", (33, 16), "bfloat16"), transpose_b=True))
        x6 = g.input("xk1", (4, 8), "bfloat16")
        g.output("yk1", ml.matmul(x6, g.parameter("wk1", (10, 8), "bfloat16"), transpose_b=True))
        # many rows, small block_m: 16 + 16 + 5 row tiles (rows hint 16, nr 5 on the last)
        x7 = g.input("xm", (37, 2056), "bfloat16")
        g.output("ym", ml.matmul(x7, g.parameter("wm", (24, 2056), "bfloat16"), transpose_b=True))
        return g

    out += run_graph(g_custom(), 16, {"matmul": {"block_m": 16}}, label="custom")
    for r in out:
        print(" | ".join(r), flush=True)
    out = []
    if not quick:
        out += run_graph(few_row_matmul_graph("bfloat16"), 132, {"matmul": {"tensor_cores": 1}}, label="few_row bf16 tc")
        out += run_graph(few_row_matmul_graph("float32"), 132, label="few_row f32")
    for r in out:
        print(" | ".join(r))

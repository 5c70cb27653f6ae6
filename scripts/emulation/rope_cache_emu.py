"""The generated tile functions of rope_kv_cache_update and of rope then kv_cache_update, compiled with
g++ against mock.h (a block's threads run one after another; fmaf/fma correctly rounded as FFMA/DFMA,
16-bit stores rounded to nearest even) and run on the same arena with guard bytes: the caches must be
equal byte for byte, nothing outside the cache written, and the values the reference's. Written by a
review of 1747bfe; `python scripts/emulation/rope_cache_emu.py` (from the repository root) runs the
cases (dtypes, layouts, partial rotary dims, token counts, strided views, int32 positions, fewer threads)
and the NaN-payload and bad-position cases; it needs g++, no GPU."""
import hashlib
import os
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repository root
WORK = os.path.join(tempfile.gettempdir(), "megaloop-rope-cache-emu")
os.makedirs(WORK, exist_ok=True)
import megaloop as ml
from megaloop.codegen.emit import Operand, rope, kv_update, rope_kv_update
from megaloop.dtypes import as_dtype

NP = {"bfloat16": np.uint16, "float16": np.uint16, "float32": np.float32, "int64": np.int64, "int32": np.int32}

def fn(name, body):
    return f"void {name}(const ml::Args& a, const ml::Task& t, int tid, const ml::i64* off, ml::u64 k, int proc) {{\n" + "\n".join("    " + l for l in body) + "\n}\n"

def run(case):
    dt, layout, rd, theta, scaling = case["dtype"], case["layout"], case["rd"], case["theta"], case["scaling"]
    b, h, s, d, t = case["b"], case["h"], case["s"], case["d"], case["t"]
    threads = case.get("threads", 256)
    D = as_dtype(dt); it = D.itemsize
    # new: a [b, t, h, d] buffer viewed as [b, h, t, d] (or custom strides)
    new_strides = case.get("new_strides", (t * h * d, d, h * d, 1))
    new_elems = case.get("new_elems", b * t * h * d)
    pos_strides = case.get("pos_strides", (t, 1))
    pos_elems = case.get("pos_elems", b * t)
    posdt = case.get("posdt", "int64")
    cache = Operand(D, (b, h, s, d), (h * s * d, s * d, d, 1))
    new = Operand(D, (b, h, t, d), new_strides)
    pos = Operand(as_dtype(posdt), (b, t), pos_strides)
    rot = Operand(D, (b, h, t, d), (h * t * d, t * d, d, 1))
    attrs = {"rotary_dim": rd, "layout": layout, "theta": theta, "scaling": scaling}
    hints = {"threads": threads, "elements": case.get("elements", 8192)}
    src = ['#include "mock.h"', "namespace F {", fn("fused", rope_kv_update("f", dict(attrs), cache, new, pos, cache)), "}",
           "namespace R {", fn("rope", rope("r", {**attrs, "codegen": hints}, new, Operand(pos.dtype, (b, 1, t), (pos_strides[0], 0, pos_strides[1])), rot)), "}",
           "namespace K {", fn("kv", kv_update("k", {"codegen": hints}, cache, rot, pos, cache)), "}"]
    # arena: [cache | new | pos | rot], 256-byte aligned regions, with 4 KiB guards
    G = 4096
    sizes = [b * h * s * d * it, new_elems * it, pos_elems * 8, b * h * t * d * it]
    offs, at = [], G
    for sz in sizes:
        offs.append(at); at += (sz + 255) // 256 * 256 + G
    arena_size = at
    main = f"""
#include <fstream>
int main(int argc, char** argv) {{
    std::vector<char> arena({arena_size});
    std::ifstream(argv[1], std::ios::binary).read(arena.data(), {arena_size});
    ml::u64 abort_flag = 0; ml::Args a{{arena.data(), &abort_flag}};
    const bool fused = argv[2][0] == '1';
    blockDim.x = {threads};
    const ml::i64 off_f[4] = {{{offs[0]}, {offs[1]}, {offs[2]}, {offs[0]}}};
    const ml::i64 off_r[3] = {{{offs[1]}, {offs[2]}, {offs[3]}}};
    const ml::i64 off_k[4] = {{{offs[0]}, {offs[3]}, {offs[2]}, {offs[0]}}};
    for (int bi = 0; bi < {b}; ++bi) for (int hi = 0; hi < {h}; ++hi) {{
        ml::Task t{{}}; t.lo[0] = bi; t.lo[1] = hi; t.hi[0] = bi + 1; t.hi[1] = hi + 1;
        if (fused) {{
            t.hi[2] = {s}; t.hi[3] = {d};
            for (unsigned x = 0; x < {threads}; ++x) {{ threadIdx.x = x; F::fused(a, t, 0, off_f, 0, 0); }}
        }} else {{
            t.hi[2] = {t}; t.hi[3] = {d};
            for (unsigned x = 0; x < {threads}; ++x) {{ threadIdx.x = x; R::rope(a, t, 0, off_r, 0, 0); }}
        }}
    }}
    if (!fused) for (int bi = 0; bi < {b}; ++bi) for (int hi = 0; hi < {h}; ++hi) {{
        ml::Task t{{}}; t.lo[0] = bi; t.lo[1] = hi; t.hi[0] = bi + 1; t.hi[1] = hi + 1; t.hi[2] = {s}; t.hi[3] = {d};
        for (unsigned x = 0; x < {threads}; ++x) {{ threadIdx.x = x; K::kv(a, t, 0, off_k, 0, 0); }}
    }}
    std::ofstream(argv[3], std::ios::binary).write(arena.data(), {arena_size});
    printf("fails %d abort %llu info %lld %lld\\n", ml::fails, abort_flag, ml::first_info[3], ml::first_info[4]);
}}
"""
    code = "\n".join(src) + main
    tag = hashlib.md5(code.encode()).hexdigest()[:10]
    cpp, exe = f"{WORK}/k_{tag}.cpp", f"{WORK}/k_{tag}"
    open(cpp, "w").write(code)
    if not os.path.exists(exe):
        r = subprocess.run(["g++", "-O1", "-std=c++17", "-ffp-contract=off", "-march=x86-64-v3", "-w", f"-I{HERE}", cpp, "-o", exe], capture_output=True, text=True)
        if r.returncode:
            print(r.stderr[:3000]); raise SystemExit(1)
    rng = np.random.default_rng(case.get("seed", 0))
    arena = np.zeros(arena_size, np.uint8)
    arena[:] = 0xAB  # guards and padding
    def put(k, arr):
        raw = arr.tobytes(); arena[offs[k]:offs[k] + len(raw)] = np.frombuffer(raw, np.uint8)
    def fl(n):
        x = rng.standard_normal(n).astype(np.float32)
        return ml.dtypes.round_to(x, getattr(ml, dt)) if dt != "float32" else x
    put(0, fl(b * h * s * d)); nb = fl(new_elems)
    if 'nan' in case:
        nb = nb.copy(); v = nb.view(np.uint16) if nb.dtype.itemsize == 2 else nb.view(np.uint32); v[::7] = case['nan']
    put(1, nb)
    posv = np.stack([rng.choice(s, t, replace=False) for _ in range(b)]).astype(np.int64)
    if "bad" in case:
        posv[case["bad"]] = case["badval"]
    pbuf = np.zeros(pos_elems, np.int64)
    for bi in range(b):
        for ti in range(t):
            pbuf[bi * pos_strides[0] + ti * pos_strides[1]] = posv[bi, ti]
    put(2, pbuf.astype(posdt))
    inp = f"{WORK}/in_{tag}.bin"; arena.tofile(inp)
    outs = []
    for fused in "10":
        o = f"{WORK}/out_{tag}_{fused}.bin"
        r = subprocess.run([exe, inp, fused, o], capture_output=True, text=True, timeout=120)
        outs.append((np.fromfile(o, np.uint8), r.stdout.strip(), r.returncode, r.stderr[-300:]))
    (fa, fmsg, frc, ferr), (ua, umsg, urc, uerr) = outs
    cs = slice(offs[0], offs[0] + sizes[0])
    res = {"fused_msg": fmsg, "apart_msg": umsg, "rc": (frc, urc)}
    res["cache_equal"] = bool(np.array_equal(fa[cs], ua[cs]))
    # nothing outside the cache region changed by the fused run
    mask = np.ones(arena_size, bool); mask[cs] = False
    res["fused_outside_untouched"] = bool(np.array_equal(fa[mask], arena[mask]))
    # compare to megaloop's reference
    if "bad" not in case:
        cache0 = np.frombuffer(arena[cs].tobytes(), NP[dt])
        newbuf = np.frombuffer(arena[offs[1]:offs[1] + sizes[1]].tobytes(), NP[dt])
        def asml(x):
            return x.view(getattr(ml, dt).np) if dt != "float32" else x
        newv = np.lib.stride_tricks.as_strided(asml(newbuf), (b, h, t, d), tuple(x * it for x in new_strides)).copy()
        g = ml.Graph("c"); c = g.state("cache", (b, h, s, d), dt); n = g.input("new", (b, h, t, d), dt); p = g.input("pos", (b, t), "int64")
        ml.rope_kv_cache_update(c, n, p, **attrs)
        want = ml.evaluate(g, {"new": newv, "pos": posv}, None, {"cache": asml(cache0).reshape(b, h, s, d)}).state["cache"]
        got = asml(np.frombuffer(fa[cs].tobytes(), NP[dt])).reshape(b, h, s, d)
        w64, g64 = want.astype(np.float64), got.astype(np.float64)
        res["max_abs_vs_ref"] = float(np.max(np.abs(w64 - g64)))
        res["bits_eq_ref_frac"] = float(np.mean(want.view(np.uint8).reshape(-1) == got.view(np.uint8).reshape(-1)))
    return res



def main() -> None:
    sc = {"type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    cases = []
    for dt in ["bfloat16", "float16", "float32"]:
        for layout in ["neox", "interleaved"]:
            for rd, d in [(64, 64), (32, 64), (2, 6), (128, 128), (16, 48)]:
                for t in [1, 3, 37]:
                    cases.append(dict(dtype=dt, layout=layout, rd=rd, theta=500000.0 if rd != 2 else 10000.0, scaling=sc if layout == "neox" else None, b=2, h=3, s=64, d=d, t=t, seed=len(cases)))
    # contiguous new [b, h, t, d]
    cases.append(dict(dtype="bfloat16", layout="neox", rd=64, theta=1e4, scaling=None, b=2, h=3, s=64, d=64, t=5, new_strides=(3*5*64, 5*64, 64, 1)))
    # strided last dim (every other element) and odd row stride
    cases.append(dict(dtype="bfloat16", layout="interleaved", rd=32, theta=1e4, scaling=None, b=2, h=3, s=64, d=48, t=4, new_strides=(3*4*97*2, 4*97*2, 97*2, 2), new_elems=2*3*4*97*2))
    # positions int32, strided (transposed [t, b])
    cases.append(dict(dtype="bfloat16", layout="neox", rd=64, theta=1e4, scaling=None, b=2, h=3, s=64, d=64, t=7, posdt="int32", pos_strides=(1, 2), pos_elems=14))
    # fewer threads (multiple e0 rounds), prefill-sized
    cases.append(dict(dtype="bfloat16", layout="neox", rd=64, theta=5e5, scaling=sc, b=1, h=2, s=600, d=64, t=512, threads=128))
    cases.append(dict(dtype="bfloat16", layout="interleaved", rd=96, theta=5e5, scaling=None, b=1, h=2, s=600, d=128, t=513, threads=96))
    bad = 0
    for c in cases:
        r = run(c)
        ok = r["cache_equal"] and r["fused_outside_untouched"] and r["rc"] == (0, 0) and r.get("max_abs_vs_ref", 0) < 1
        if not ok:
            bad += 1
            print("MISMATCH", {k: v for k, v in c.items() if k != "scaling"}, r)
    print(len(cases), "cases,", bad, "mismatches")
    # NaN payloads in the dims past rotary_dim are copied as stored (and rotated NaNs as rope rounds them)
    for rd in (64, 32):
        nan_case = dict(dtype="bfloat16", layout="neox", rd=rd, theta=1e4, scaling=None, b=1, h=8, s=16, d=64, t=1)
        r = run({**nan_case, "nan": 0xFFC1, "new_strides": (8 * 64, 64, 8 * 64, 1)})
        bad += not (r["cache_equal"] and r["fused_outside_untouched"])
        print("NaN payloads, rotary_dim", rd, {k: r[k] for k in ("cache_equal", "fused_outside_untouched")})
    # a bad position: reported (the fused and the two-op kernels alike), nothing written outside the cache
    for badval in (-1, 64, 1 << 40, -(1 << 62)):
        for t in (1, 40):
            case = dict(dtype="bfloat16", layout="neox", rd=32, theta=1e4, scaling=None, b=2, h=3, s=64, d=64, t=t)
            r = run({**case, "bad": (1, t - 1), "badval": badval, "threads": 32})
            ok = r["cache_equal"] and r["fused_outside_untouched"] and r["fused_msg"].startswith("fails") and "fails 0" not in r["fused_msg"]
            bad += not ok
            print("bad position", badval, "tokens", t, "ok" if ok else r)
    print("FAIL" if bad else "OK", bad, "mismatches")


if __name__ == "__main__":
    main()

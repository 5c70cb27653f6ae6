import sys, time, traceback
import numpy as np
import ml_dtypes
import megaloop as ml
from megaloop.plan import make_plan
from megaloop.codegen import generate
from megaloop.frontend.ops.attention_split import _partial_reference, attention_partial as ap_direct
sys.path.insert(0, __import__("os").path.dirname(__file__))
from split_attention_emu import extract_split_block, parse, emulate_tile, layout, normalized

NP = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}


def ulps(a, b):
    a = a.astype(np.float32).view(np.int32).astype(np.int64)
    b = b.astype(np.float32).view(np.int32).astype(np.int64)
    a = np.where(a < 0, -(a & 0x7FFFFFFF), a)
    b = np.where(b < 0, -(b & 0x7FFFFFFF), b)
    return np.abs(a - b)


def case(rng, params, shapes_seen, stats):
    dt = params["dtype"]
    b, hkv, group, tq, tk, d = (params[x] for x in ("b", "hkv", "group", "tq", "tk", "d"))
    hq = hkv * group
    g = ml.Graph("t")
    extra_k = params.get("extra_k", 0)
    q = g.input("q", (b, hq, tq, d), dt)
    kf = g.input("k", (b, hkv, tk + extra_k, d), dt)
    vf = g.input("v", (b, hkv, tk + extra_k, d), dt)
    k = kf[:, :, :tk] if extra_k else kf
    v = vf[:, :, :tk] if extra_k else vf
    qp_t = g.input("qp", (b, tq), ml.int64) if params["qpos"] else None
    ln_t = g.input("ln", (b,), ml.int64) if params["lens"] else None
    if params.get("direct"):
        y = ap_direct(q, k, v, splits=params["splits"], causal=params["causal"], scale=params.get("scale"))
    else:
        y = ml.attention(q, k, v, causal=params["causal"], q_positions=qp_t, kv_lengths=ln_t,
                         window=params["window"], kv_splits=params["splits"], scale=params.get("scale"))
    g.output("y", y)
    plan = make_plan(g, processors=params["procs"], warps=params["warps"])
    prog = generate(plan)
    rp = plan.ranks[0]
    ops = [o for o in rp.ops if o.op == "attention_partial"]
    if not ops:
        stats["no_partial"] += 1
        return
    (op,) = ops
    qa = (rng.standard_normal((b, hq, tq, d)) * params["amp"]).astype(NP[dt])
    ka = (rng.standard_normal((b, hkv, tk, d)) * params["amp"]).astype(NP[dt])
    va = rng.standard_normal((b, hkv, tk, d)).astype(NP[dt])
    arrays = [qa, ka, va]
    if params["qpos"]:
        arrays.append(rng.integers(-3, tk + 3, (b, tq)).astype(np.int64))
    if params["lens"]:
        arrays.append(rng.integers(0, tk + 1, (b,)).astype(np.int64))
    ref = _partial_reference(arrays, op.attrs)
    ins = [rp.tensors[t] for t in op.inputs]
    outt = rp.tensors[op.outputs[0]]
    bufs = {}
    for s, (t, arr) in enumerate(zip(ins, arrays)):
        assert tuple(t.shape) == arr.shape, (t.shape, arr.shape)
        if arr.dtype == np.int64:
            bufs[s] = layout(arr, t.strides, 0)
        else:
            bufs[s] = layout(arr.astype(np.float32), t.strides, np.nan)
    osize = 1 + sum((n - 1) * s for n, s in zip(outt.shape, outt.strides))
    opidx = np.indices(outt.shape)
    oflat = sum(opidx[dd] * outt.strides[dd] for dd in range(len(outt.shape)))
    tasks = [t for t in prog.tasks if t["op"] == op.id]
    assert tasks, "no tasks"
    sig = int(tasks[0]["sig"])
    assert all(int(t["sig"]) == sig for t in tasks)
    lines = extract_split_block(prog.source, sig)
    shapes_seen.setdefault(normalized(lines), []).append(params)
    P = parse(lines)
    # the constants the source was given agree with the plan's operands
    assert P.D == d and P.qs == tuple(ins[0].strides[:3]) and P.ks == tuple(ins[1].strides[:2])
    assert P.kj == ins[1].strides[2] and P.vj == ins[2].strides[2] and P.vs == tuple(ins[2].strides[:2])
    assert P.os == tuple(outt.strides[:4]) and P.od == outt.strides[4]
    assert P.group == group
    warps = prog.threads // 32
    assert warps == params["warps"]
    shared_floats = prog.shared_bytes // 4
    assert shared_floats >= warps * (d + 2)
    total_counts = np.zeros(osize, np.int64)
    out = np.full(osize, np.nan, np.float32)
    log = []
    for t in tasks:
        nd = len(outt.shape)
        lo, hi = [int(x) for x in t["lo"][:nd]], [int(x) for x in t["hi"][:nd]]
        counts = np.zeros(osize, np.int64)
        info = emulate_tile(P, warps, lo, hi, bufs, out, counts, shared_floats, log)
        stats["split_hist"][(info["pairs"], info["split"])] = stats["split_hist"].get((info["pairs"], info["split"]), 0) + 1
        inbox = np.ones(outt.shape, bool)
        for dd in range(nd):
            ax = opidx[dd]
            inbox &= (ax >= lo[dd]) & (ax < hi[dd])
        c = counts[oflat]
        if not (np.all(c[inbox] == 1) and np.all(c[~inbox] == 0)) or counts.sum() != inbox.sum():
            raise AssertionError(f"write coverage wrong for tile lo={lo} hi={hi}: "
                                 f"in-box counts {np.unique(c[inbox])}, out-of-box {c[~inbox].sum()}")
        total_counts += counts
    assert not log, log
    assert np.all(total_counts[oflat] == 1)
    got = out[oflat]
    D = d
    # m: -inf pattern exact, finite values: ulp distance
    gm, rm = got[..., D], ref[..., D]
    if not np.array_equal(np.isneginf(gm), np.isneginf(rm)) or not np.all(np.isfinite(gm) | np.isneginf(gm)):
        raise AssertionError(f"m -inf pattern differs: got {gm.ravel()[:20]} ref {rm.ravel()[:20]}")
    fin = np.isfinite(rm)
    mu = ulps(gm[fin], rm[fin]).max() if fin.any() else 0
    qf, kf_ = qa.astype(np.float64), ka.astype(np.float64)
    bound = np.einsum("bhgqd,bhkd->bhgqk", np.abs(qf.reshape(b, hkv, group, tq, d)), np.abs(kf_)).max(-1, initial=0)
    bound = bound.reshape(b, hq, tq)[..., None] * abs(float(op.attrs["scale"])) + 1e-30
    merr = np.where(fin, np.abs(gm - np.where(fin, rm, 0)) / bound, 0).max()
    stats["m_abs_rel_to_bound"] = max(stats.get("m_abs_rel_to_bound", 0), float(merr))
    stats["m_ulps"] = max(stats["m_ulps"], int(mu))
    stats["m_exact"] += int(np.sum(gm[fin] == rm[fin]))
    stats["m_total"] += int(fin.sum())
    # l
    gl, rl = got[..., D + 1], ref[..., D + 1]
    lerr = np.abs(gl - rl) / np.maximum(np.abs(rl), 1e-30)
    lerr = np.where((gl == 0) & (rl == 0), 0, lerr)
    stats["l_rel"] = max(stats["l_rel"], float(lerr.max()))
    # acc: relative to l * max|v| bound
    ga, ra = got[..., :D], ref[..., :D]
    vmax = np.abs(va.astype(np.float32)).max() if va.size else 1
    scale_ = np.maximum(rl, 1e-30)[..., None] * vmax
    aerr = np.abs(ga - ra) / scale_
    aerr = np.where((ga == 0) & (ra == 0), 0, aerr)
    stats["acc_rel"] = max(stats["acc_rel"], float(aerr.max()))
    # m tolerance: a few ulps (dot summation order differs from einsum)
    if merr > 1e-5 or lerr.max() > 1e-4 or aerr.max() > 1e-4:
        raise AssertionError(f"numeric mismatch: m ulps {mu}, l rel {lerr.max():.3g}, acc rel {aerr.max():.3g}")
    stats["cases"] += 1
    stats["tiles"] += len(tasks)


def random_params(rng):
    dt = rng.choice(["bfloat16", "float16", "bfloat16", "float16", "float32"])
    width = 16 // (2 if dt != "float32" else 4)
    ds = [x for x in (8, 16, 32, 64, 128, 256) if (x // width) and 32 % (x // width) == 0 and x % width == 0]
    d = int(rng.choice(ds + [64, 128, 64, 128]))
    tk = int(rng.integers(1, 90))
    causal = bool(rng.integers(0, 4) > 0)
    p = dict(dtype=dt, b=int(rng.integers(1, 3)), hkv=int(rng.integers(1, 3)),
             group=int(rng.choice([1, 2, 3, 4, 8])), tq=int(rng.integers(1, 5)) if rng.integers(0, 10) else int(rng.integers(5, 80)), tk=tk, d=d,
             splits=int(rng.integers(1, 9)), causal=causal,
             window=int(rng.integers(1, tk + 3)) if causal and rng.integers(0, 2) else None,
             qpos=bool(rng.integers(0, 2)), lens=bool(rng.integers(0, 2)),
             procs=int(rng.choice([1, 4, 16, 132])), warps=8, amp=float(rng.choice([0.3, 1.0, 3.0])),
             extra_k=int(rng.choice([0, 0, 0, 5])))
    if not causal:
        p["qpos"] = False
    if rng.integers(0, 8) == 0:
        p.update(direct=True, qpos=False, lens=False, window=None)
    return p


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    seed = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    warps_choices = [int(x) for x in sys.argv[3].split(",")] if len(sys.argv) > 3 else [8]
    rng = np.random.default_rng(seed)
    stats = dict(cases=0, tiles=0, no_partial=0, m_ulps=0, m_exact=0, m_total=0, l_rel=0.0, acc_rel=0.0, split_hist={})
    shapes = {}
    fails = []
    t0 = time.time()
    for it in range(n):
        p = random_params(rng)
        p["warps"] = int(rng.choice(warps_choices))
        try:
            case(rng, p, shapes, stats)
        except Exception as e:
            fails.append((p, repr(e)[:300]))
            if len(fails) <= 5:
                print("FAIL", p, repr(e)[:300])
    print({k: v for k, v in stats.items() if k != "split_hist"})
    print("pairs,split histogram:", dict(sorted(stats["split_hist"].items())))
    print("distinct split-block variants:", len(shapes), "failures:", len(fails), f"{time.time()-t0:.0f}s")
    import pickle
    pickle.dump(shapes, open(f"/tmp/split_attention_shapes_{seed}.pkl", "wb"))

import sys, numpy as np
sys.path.insert(0, __import__("os").path.dirname(__file__))
import split_attention_run as run
base = dict(dtype="bfloat16", b=1, hkv=1, group=1, tq=1, tk=9, d=64, splits=4, causal=False, window=None,
            qpos=False, lens=False, procs=1, warps=8, amp=1.0, extra_k=0)
cases = [
 dict(direct=True, tk=9, splits=4),                       # last range empty
 dict(direct=True, tk=2, splits=5, group=3, tq=3),        # ranges 2..4 empty
 dict(direct=True, tk=9, splits=4, causal=True, tq=4),
 dict(lens=True, causal=True, tk=40, splits=5, tq=4, group=8, hkv=2, b=2),   # 32 pairs, 4 rounds
 dict(qpos=True, causal=True, window=3, tk=50, splits=7, tq=4, group=4, procs=132),
 dict(dtype="float16", d=256, tk=33, splits=3, causal=True, lens=True, tq=2, group=2),  # LPK 32, KPW 1
 dict(dtype="bfloat16", d=8, tk=77, splits=2, causal=True, qpos=True, tq=3),            # LPK 1, KPW 32
 dict(dtype="float32", d=4, tk=30, splits=3, tq=2),                                      # LPK 1 f32
 dict(dtype="float32", d=128, tk=70, splits=3, tq=1, group=3, causal=True, window=20),   # LPK 32 f32
 dict(tk=1000, splits=4, tq=1, group=1, procs=1),                                        # long pieces, split 8
 dict(tk=1000, splits=3, tq=1, group=2, lens=True, causal=True, window=100, procs=1),
 dict(extra_k=16, tk=64, splits=4, tq=2, group=2, causal=True, qpos=True, lens=True),
]
for i, c in enumerate(cases):
    p = {**base, **c}
    for seed in range(5):
        rng = np.random.default_rng(seed)
        stats = dict(cases=0, tiles=0, no_partial=0, m_ulps=0, m_exact=0, m_total=0, l_rel=0.0, acc_rel=0.0, split_hist={})
        run.case(rng, p, {}, stats)
    print(i, "ok", stats["tiles"], "tiles", dict(stats["split_hist"]), f"l {stats['l_rel']:.2g} acc {stats['acc_rel']:.2g}")

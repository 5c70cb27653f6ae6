"""Tuning experiment, not a benchmark: rmsnorm and softmax at bench/memory_bound.py's shape under
variants of the block-per-row path (warp groups a block, ring size, partial accumulators, tasks per
processor), as fractions of the device copy bandwidth measured in the same run (median of 5 timed runs
of 10 iterations each). Writes $OUT/row_variants.json.

    PYTHONPATH=. python scripts/row_variants.py      # on a GPU machine (about two minutes)

Measured on an H200 (7274749, whole block a row): warps 8 best (16: rmsnorm 0.61-0.65, 32: 0.24);
ring depth 2-8 and 1-8 tasks a processor within a few percent of each other once rows stream through
shared memory. At 3be946a/764330b (groups of warps, emit_rows.ROW_GROUP_LIMITS): rmsnorm one group
0.80-0.85, two groups of 8 packs 0.83-0.86, four of 16 packs 0.80; softmax one group 0.67-0.69, two
groups of 8 packs (exps kept) 0.78-0.80, four groups of 16 packs with one slot each 0.85, with two
slots each 0.82-0.845; slot loop not unrolled 0.5-2 % slower. Run-to-run spread about 2-3 %.
With balanced tiles (f7b9909; 460653c/26ae4ea, three runs): 8 tasks a processor rmsnorm 0.815-0.834,
softmax 0.82-0.857; 4: 0.831-0.864 / 0.842-0.887; 3: 0.839-0.887 / 0.849-0.857; 2: 0.83 / 0.83; 16:
0.835 / 0.836; a ring of 4 rows 0.871 / 0.843, of 10 (12 asked, shared memory caps it) 0.851 / 0.844.
At d511ebd (one run, the experiment's code not kept): rows copied in under L2's evict_first policy
rmsnorm 0.812 / softmax 0.796, copied in and stored under it 0.866-0.890 / 0.859-0.863, against
0.856-0.867 / 0.870-0.879 without it: no gain (unlike the decode step's weights, scripts/decode_variants.py)."""

import json
import os

import numpy as np

import megaloop as ml
import megaloop.codegen.emit_rows as emit
from bench.common import commit, device_name
import megaloop.frontend.ops._tilings as tilings
from bench.memory_bound import COLS, ROWS, copy_bandwidth, loop_time

DEFAULTS = {
    k: getattr(emit, k)
    for k in ("ROW_GROUPS", "ROW_RING_BYTES",
              "ROW_RING_ROWS", "ROW_ACCUMULATORS", "SOFTMAX_KEPT_EXPS", "ROW_SLOTS_UNROLLED", "ROW_GROUP_LIMITS")
}
WAVES = tilings.ROWS.params["waves"]
VARIANTS = {
    "default": {},
    "waves4": {"waves": 4},
    "waves3": {"waves": 3},
    "default_again": {},
    "waves4_again": {"waves": 4},
    "waves3_again": {"waves": 3},
}


def run(op: str, variant: dict) -> float:
    for k, v in DEFAULTS.items():
        setattr(emit, k, variant.get(k, v))
    if "waves" in variant:
        w = variant["waves"]
        tilings.ROWS.params["waves"] = {a: w for a in WAVES}
    else:
        tilings.ROWS.params["waves"] = WAVES
    g = ml.Graph(op)
    a = g.input("a", (ROWS, COLS), ml.bfloat16)
    w = g.input("w", (COLS,), ml.bfloat16)
    g.output("y", ml.rmsnorm(a, w) if op == "rmsnorm" else ml.softmax(a, -1))
    rng = np.random.default_rng(0)
    feeds = {"a": rng.standard_normal((ROWS, COLS), dtype=np.float32), "w": rng.standard_normal(COLS, dtype=np.float32)}
    return 2 * ROWS * COLS * 2 / loop_time(g, feeds)


copy = copy_bandwidth()
res = {"experiment": "row_variants", "device": device_name(), "commit": commit(), "copy_GBps": copy / 1e9}
for name, variant in VARIANTS.items():
    for op in ("rmsnorm", "softmax"):
        if name.startswith("softmax_") and op == "rmsnorm":
            continue
        try:
            frac = run(op, variant) / copy
        except Exception as e:  # a variant that does not build is reported, the others still run
            print(op, name, "failed", str(e)[:300], flush=True)
            continue
        res[f"{op}_{name}"] = round(frac, 3)
        print(op, name, round(frac, 3), flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "row_variants.json"), "w"), indent=1)

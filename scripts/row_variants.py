"""Tuning experiment, not a benchmark: rmsnorm and softmax at bench/memory_bound.py's shape under
variants of the block-per-row path (tasks per processor, rows in the shared-memory ring, warps per
block), as fractions of the device copy bandwidth measured in the same run. Writes $OUT/row_variants.json.

    PYTHONPATH=. python scripts/row_variants.py      # on a GPU machine (about a minute)

Measured on an H200 (7274749): warps 8 best (16: rmsnorm 0.61-0.65, 32: 0.24); ring depth 2-8 and
1-8 tasks a processor within a few percent of each other once rows stream through shared memory."""
import json, os, time
import numpy as np
import megaloop as ml
import megaloop.codegen.emit as emit
import megaloop.frontend.ops._tilings as tilings
from bench.memory_bound import ROWS, COLS, copy_bandwidth
from megaloop.plan import make_plan
from megaloop.runtime.loop import LoopKernel


def run(op, waves, ring, warps):
    tilings.ROWS.params["waves"] = {a: waves for a in tilings.ROWS.params["waves"]}
    emit.ROW_RING_ROWS = ring
    g = ml.Graph(op)
    a = g.input("a", (ROWS, COLS), ml.bfloat16)
    w = g.input("w", (COLS,), ml.bfloat16)
    g.output("y", ml.rmsnorm(a, w) if op == "rmsnorm" else ml.softmax(a, -1))
    rng = np.random.default_rng(0)
    feeds = {"a": rng.standard_normal((ROWS, COLS), dtype=np.float32), "w": rng.standard_normal(COLS, dtype=np.float32)}
    with LoopKernel(make_plan(g, processors=132, warps=warps)) as k:
        k.run(feeds, iterations=2)
        t0 = time.perf_counter()
        k.start(10)
        k.wait()
        s = (time.perf_counter() - t0) / 10
    return 2 * ROWS * COLS * 2 / s


copy = copy_bandwidth()
res = {"copy_GBps": copy / 1e9}
for op in ("rmsnorm", "softmax"):
    for waves, ring, warps in [(8, 8, 8), (8, 8, 16), (8, 4, 16), (2, 8, 16), (8, 8, 32)]:
        try:
            bw = run(op, waves, ring, warps)
        except Exception as e:
            print(op, waves, ring, warps, "failed", str(e)[:200], flush=True)
            continue
        res[f"{op}_waves{waves}_ring{ring}_warps{warps}"] = round(bw / copy, 3)
        print(op, waves, ring, warps, round(bw / copy, 3), flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "row_variants.json"), "w"), indent=1)

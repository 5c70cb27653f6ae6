"""Tuning experiment, not a benchmark: the dependent Llama decode step (bench/llama_layer.py's layer at
hidden 2048 and 4096) under variants of the emitters' constants (the few-row tensor-core matmul's L2
policy for weights), microseconds per step (median of 5 timed
runs of 200 steps). Writes $OUT/decode_variants.json. MEGALOOP_BENCH_MATMUL="skinny_mma=0" runs the
same variants on the warp-per-element matmul path; DECODE_SEQUENCES=4 decodes 4 sequences at once
(a tile for the rows of all of them; MEGALOOP_BENCH_MATMUL="fold_batch=0": a tile per sequence).

    PYTHONPATH=. python scripts/decode_variants.py [variant ...]     # on a GPU machine

Measured on an H200 (e02e999, us at hidden 2048 / 4096): default 75.9 / 147.6 and 75.8 / 149.3;
weights without the evict_first policy 99.2 / 163.5; the same loads as asm volatile without a policy
98.4 / 161.2; the warp-per-element path 77.9 / 145.9 (another run). (The split-key attention's keys in
flight, a variant until 5f6029e: 4 steps 74.7 / 153.2 against 73.5 / 153.1 at 1; 8 steps 80.8 / 165.3.)
4 sequences (9e65d89): fold_batch=1 85.0 / 156.3, fold_batch=0 147.7 / 395.8 (made the default).
L2 prefetch of the next tasks' weights (a variant at addbeac, taken out): docs/runtime.md.
9cde193 (one run): sibling matmuls sharing the processors and small elementwise ops in several tiles
70.1 / 147.1; the first alone 75.4 / 145.9; neither 75.8 / 147.9; both with silu_mul 67.5 / 142.3
(made the default); 4 sequences 82.4 / 156.3 against 85.0 / 154.3 without either.
111ccac: default 68.7, 67.5 / 143.7, 142.9; stage_weights 77.0 / 142.7 (4 sequences 103.2 against 79.0,
80.9); slot_waits128 69.6 / 144.7: neither made the default (docs/runtime.md).
d8d9541: default 70.9, 69.4 / 143.3, 143.2; keys4 69.5 / 145.9; keys8 72.9 / 150.6; a_shared 84.1 / 169.6
(the key ring and A in shared memory: taken out again, see emit_attention.py and emit_matmul.py).
2813a05: default 70.5, 70.9 / 142.4, 143.2; poll64 69.5 / 140.9; poll0 70.1 / 140.1; slot_waits128
70.3 / 141.7; poll0_slots128 68.8 / 141.7: none made the default (within the noise).
3a58a32 / 2cc241c (the fused norms then the default; bench/results/decode_variants.json): fused_norms
65.4, 67.0, 66.9, 65.7 / 140.7, 139.7, 140.8, 141.4 against the norms apart 65.8, 68.0 / 138.3, 137.6;
4 sequences 81.1 / 158.9 against 79.8 / 148.2; fused_prefetch2k 66.5 / 140.9, fused_prefetch8k 66.3 /
161.0, fused_warp_norms 71.4 / 148.2 (4 sequences 80.5 / 157.5): the norms stay apart by default.
51975fe: default 65.6, 64.6 / 139.4, 140.1; fused_norms (half a round of weights issued before the
norm) 65.1 / 142.9; fused_serial 67.0 / 141.3."""

import json
import os
import sys

import numpy as np

import megaloop.codegen.emit_fused_matmul as emit_fused_matmul
import megaloop.codegen.emit_matmul as emit_matmul
import megaloop.codegen.kernel as kernel
import megaloop.models.llama as llama
from bench.common import commit, device_name, matmul_tiles, resident_seconds
from bench.llama_layer import CONTEXT, dependent_decode_graph, layer_config
from megaloop.models import random_parameters
from megaloop.plan import make_plan
from megaloop.runtime.loop import LoopKernel

SEQUENCES = int(os.environ.get("DECODE_SEQUENCES", "1"))  # batched decode: e.g. 4 (fold_batch=1, the default, or 0)
MODULES = {
    "SKINNY_MMA_STREAM_WEIGHTS": emit_matmul,
    "SLOT_WAITS": kernel,
    "POLL_SLEEP_NS": kernel,
    "NORM_UNDER_WEIGHTS": emit_fused_matmul,
    "FUSE_DECODE_NORMS": llama,
    "FUSE_DECODE_SILU": llama,
}
SMALL_OPS = ("add", "mul", "silu", "silu_mul")
DEFAULTS = {k: getattr(m, k) for k, m in MODULES.items()}
VARIANTS = {
    "default": {},
    "no_stream": {"SKINNY_MMA_STREAM_WEIGHTS": False},
    # the split-key attention keeps 4 (8) steps of keys in flight, a ring of 32-bit words
    # the skinny tiles' rows of A copied into shared memory first, 16 (or 8) units of B in flight a warp
    # tile switches (docs/plan-format.md): matmuls each sized for all the processors; small elementwise
    # ops in one tile
    "no_share": {"tiles": {"matmul": {"share": 0}}},
    "no_split_small": {"tiles": {op: {"split_small": 0} for op in SMALL_OPS}},
    # weights copied into shared memory by the copy engine during the tasks' waits (megaloop/stage.cuh)
    "stage_weights": {"tiles": {"matmul": {"stage_weights": 1}}},
    # every wait of a decode step's tasks copied into the slot ahead (megaloop/loop.cuh SLOT_WAITS)
    "slot_waits128": {"SLOT_WAITS": 128},
    # the longest sleep between two polls of a wait's counters (megaloop/loop.cuh; 256 ns by default)
    "poll64": {"POLL_SLEEP_NS": 64},
    "poll0": {"POLL_SLEEP_NS": 0},
    "poll0_slots128": {"POLL_SLEEP_NS": 0, "SLOT_WAITS": 128},
    # q/k/v and gate/up norming their own rows (rmsnorm_matmul; llama.FUSE_DECODE_NORMS); the
    # fused_warp_norms and fused_prefetch variants measured in the docstring are taken out
    "fused_norms": {"FUSE_DECODE_NORMS": True},
    # the down projection making silu(gate) * up itself (silu_mul_matmul), with and without the norms
    "fused_silu": {"FUSE_DECODE_SILU": True},
    "fused_silu_serial": {"FUSE_DECODE_SILU": True, "NORM_UNDER_WEIGHTS": False},
    "fused_both": {"FUSE_DECODE_SILU": True, "FUSE_DECODE_NORMS": True},
    # the norm, a barrier, then the matmul (before the first weights went out ahead of the norm)
    "fused_serial": {"FUSE_DECODE_NORMS": True, "NORM_UNDER_WEIGHTS": False},
    "default_again": {},
}


def step_us(hidden: int, variant: dict) -> float:
    for k, v in DEFAULTS.items():
        setattr(MODULES[k], k, variant.get(k, v))
    tiles = matmul_tiles()
    for op, params in variant.get("tiles", {}).items():
        tiles[op] = {**tiles.get(op, {}), **params}
    cfg = layer_config(hidden, 1)
    params = random_parameters(cfg, seed=0)
    x = np.random.default_rng(1).standard_normal((SEQUENCES, 1, hidden)).astype(np.float32)
    plan = make_plan(dependent_decode_graph(cfg, x, "auto"), processors=132, tiles=tiles)
    with LoopKernel(plan, params) as k:
        k.run({"positions": np.full((SEQUENCES, 1), CONTEXT)}, iterations=3)
        return resident_seconds(k, 200) * 1e6


names = sys.argv[1:] or list(VARIANTS)
res = {"experiment": "decode_variants", "device": device_name(), "commit": commit(), "sequences": SEQUENCES}
res["matmul_tiles"] = matmul_tiles()["matmul"]
for name in names:
    for hidden in (2048, 4096):
        us = step_us(hidden, VARIANTS[name])
        res[f"{name}_h{hidden}_us"] = round(us, 1)
        print(name, hidden, round(us, 1), flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "decode_variants.json"), "w"), indent=1)

"""Tuning experiment, not a benchmark: the dependent Llama decode step (bench/llama_layer.py's layer at
hidden 2048 and 4096) under variants of the plan's tile switches and kernel options
(megaloop.plan.KernelOptions), microseconds per step (median of 5 timed runs of 200 steps). Writes
$OUT/decode_variants.json. MEGALOOP_BENCH_MATMUL="skinny_mma=0" runs the same variants on the
warp-per-element matmul path; DECODE_SEQUENCES=4 decodes 4 sequences at once.

    PYTHONPATH=. python scripts/decode_variants.py [variant ...]     # on a GPU machine

Every variant measured so far, and what was taken out after losing: docs/experiments.md."""

import json
import os
import sys

import numpy as np

from bench.common import commit, device_name, matmul_tiles, resident_seconds
from bench.llama_layer import CONTEXT, dependent_decode_graph, layer_config
from megaloop.models import random_parameters
from megaloop.plan import FuseOptions, KernelOptions, make_plan
from megaloop.runtime.loop import LoopKernel

SEQUENCES = int(os.environ.get("DECODE_SEQUENCES", "1"))  # batched decode: e.g. 4 (fold_batch=1, the default, or 0)
SMALL_OPS = ("add", "mul", "silu", "silu_mul")
VARIANTS = {
    "default": {},
    # tile switches (docs/plan-format.md): matmuls each sized for all the processors; small elementwise
    # ops in one tile
    "no_share": {"tiles": {"matmul": {"share": 0}}},
    "no_split_small": {"tiles": {op: {"split_small": 0} for op in SMALL_OPS}},
    # every wait of a decode step's tasks copied into the slot ahead (KernelOptions.slot_waits)
    "slot_waits128": {"options": {"slot_waits": 128}},
    # the longest sleep between two polls of a wait's counters (KernelOptions.poll_sleep_ns)
    "poll64": {"options": {"poll_sleep_ns": 64}},
    "poll0": {"options": {"poll_sleep_ns": 0}},
    "poll0_slots128": {"options": {"poll_sleep_ns": 0, "slot_waits": 128}},
    # decode matmul weights through global loads, not the weight ring (KernelOptions.weight_ring_slots)
    "no_ring": {"options": {"weight_ring_slots": 0}},
    "ring16": {"options": {"weight_ring_slots": 16}},
    "ring16x8k": {"options": {"weight_ring_slots": 16, "weight_ring_slot_bytes": 8192}},
    # the ring's copies issued by a loader warp, in order or oldest free slot first, at most 48 / 32 /
    # 64 KB in flight (KernelOptions.weight_ring_loader, weight_ring_loader_bytes)
    "loader_in_order": {"options": {"weight_ring_loader": 1}},
    "loader": {"options": {"weight_ring_loader": 2}},
    "loader32k": {"options": {"weight_ring_loader": 2, "weight_ring_loader_bytes": 32768}},
    "loader64k": {"options": {"weight_ring_loader": 2, "weight_ring_loader_bytes": 65536}},
    "loader_ring12": {"options": {"weight_ring_loader": 2, "weight_ring_slots": 12}},
    # small ops made by the projections' tiles (the plan's FuseOptions, docs/fuse.md): the norms
    # (rmsnorm_linear tiles norming their own rows), silu(gate) * up in the gate/up tiles' epilogue
    # (swiglu_linear), both; each without attention's append form
    "apart": {"fusion": "-rmsnorm_linear,-swiglu_linear,-attention_append,-split_k_linear"},
    "norms_inside": {"fusion": "-swiglu_linear,-attention_append,-split_k_linear"},
    "swiglu": {"fusion": "-rmsnorm_linear,-attention_append,-split_k_linear"},
    "default_again": {},
}


def step_us(hidden: int, variant: dict) -> float:
    tiles = matmul_tiles()
    for op, params in variant.get("tiles", {}).items():
        tiles[op] = {**tiles.get(op, {}), **params}
    cfg = layer_config(hidden, 1)
    params = random_parameters(cfg, seed=0)
    x = np.random.default_rng(1).standard_normal((SEQUENCES, 1, hidden)).astype(np.float32)
    options = KernelOptions(**variant.get("options", {}))
    fusion = FuseOptions.parse(variant.get("fusion", "all"))
    graph = dependent_decode_graph(cfg, x, "auto")
    plan = make_plan(graph, processors=132, tiles=tiles, options=options, fusion=fusion)
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

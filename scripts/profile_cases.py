"""Where the time goes in the benchmark cases: runs each case with the kernel's per-task stamps on and
prints, per op, the number of tasks, the mean and longest task, and the op's window (first start to last
end) in one steady iteration, plus the gap each processor spent waiting before its tasks. Without a GPU
it prints the cost model's estimate instead (marked as such). Traces and PNGs go to $OUT (or /tmp).

    PYTHONPATH=. python scripts/profile_cases.py decode2048 prefill2048 gemm4096
"""

from __future__ import annotations

import os
import sys
from dataclasses import fields
from pathlib import Path

import numpy as np

import megaloop as ml
from bench.common import matmul_tiles
from bench.llama_layer import CONTEXT, layer_config
from megaloop.models import build_llama, random_parameters
from megaloop.plan import FuseOptions, KernelOptions, make_plan
from megaloop.runtime import gpus, trace


def llama_case(hidden: int, tokens: int, kv_splits: int | str | None = "auto", sequences: int = 1):
    cfg = layer_config(hidden, tokens)  # the benchmark's layer
    start = CONTEXT if tokens == 1 else 0
    rng = np.random.default_rng(1)
    feeds = {
        "hidden": rng.standard_normal((sequences, tokens, hidden)).astype(np.float32),
        "positions": np.tile(np.arange(start, start + tokens), (sequences, 1)),
    }
    graph = build_llama(cfg, sequences, tokens, kv_splits=kv_splits)
    return graph, random_parameters(cfg, seed=0), feeds


def gemm_case(n: int):
    g = ml.Graph(f"gemm{n}")
    a = g.input("a", (n, n), ml.bfloat16)
    w = g.input("w", (n, n), ml.bfloat16)
    g.output("y", ml.matmul(a, w, transpose_b=True))
    rng = np.random.default_rng(0)
    return g, {}, {k: rng.standard_normal((n, n), dtype=np.float32) for k in ("a", "w")}


def rows_case(op: str, rows: int = 8192, cols: int = 8192):
    """bench/memory_bound.py's row ops on a quarter of its rows (128 MiB a tensor): per-task times of
    the block-per-row path (how long one task's 31 rows take, and what the processors wait for)."""
    g = ml.Graph(f"{op}{cols}")
    x = g.input("a", (rows, cols), ml.bfloat16)
    w = g.input("w", (cols,), ml.bfloat16)
    g.output("y", ml.rmsnorm(x, w) if op == "rmsnorm" else ml.softmax(x, -1))
    rng = np.random.default_rng(0)
    return (
        g,
        {},
        {"a": rng.standard_normal((rows, cols), dtype=np.float32), "w": rng.standard_normal(cols, dtype=np.float32)},
    )


def preset_config(name: str = "llama3.2-1b", max_seq: int = 256):
    """The CLI's preset ``name`` (megaloop.cli.PRESETS) with a context of ``max_seq``."""
    from megaloop.cli import PRESETS

    base = PRESETS[name]
    return type(base)(**{**base.__dict__, "max_seq": max_seq})


def chain_case(op: str, n: int = 5504, length: int = 12):
    """``length`` dependent one-task ops of a decode step's size in a small kernel: whether a small task's
    1-4 us in the decode layer are its own (the same here) or its surroundings' (cold code, caches)."""
    g = ml.Graph(f"{op}-chain")
    x = g.input("x", (1, n), ml.bfloat16)
    for _ in range(length):
        x = ml.silu(x) if op == "silu" else ml.add(x, x)
    g.output("y", x)
    return g, {}, {"x": np.random.default_rng(0).standard_normal((1, n), dtype=np.float32)}


def prefill_case():
    """bench/generate.py's prefill: the 1B-shaped model over a 128-token prompt, every position's logits."""
    cfg = preset_config()
    rng = np.random.default_rng(1)
    feeds = {"tokens": rng.integers(0, cfg.vocab, (1, 128)), "positions": np.arange(128)[None]}
    return build_llama(cfg, 1, 128), random_parameters(cfg, seed=0), feeds


def generate_case(splits: int | str | None = "auto", preset: str = "llama3.2-1b"):
    """bench/generate.py's self-feeding Llama-3.2-1B-shaped generator (16 layers, the LM head, the argmax)
    at position 128 of 256: the whole decode step that the benchmark times per token."""
    from megaloop.models import build_llama_generator

    cfg = preset_config(preset)
    state = {"token": np.array([[17]]), "position": np.array([[128]])}
    graph = build_llama_generator(cfg, 1, kv_splits=splits)
    return graph, random_parameters(cfg, seed=0), {}, state


def serve_decode_case(position: int = 192):
    """The serving engine's one-row decode step (megaloop/serving/step.py's decode_1 program, planned
    alone) with one live greedy slot at ``position`` of 512: what the engine's batch-1 step costs in
    its own tiles, beside generate1b's (docs/serving.md, "Measured")."""
    from megaloop.serving.step import StepShape, build_serving_programs

    cfg = preset_config(max_seq=512)
    shape = StepShape(slots=1, chunk=32, page_size=16, pages=32, max_seq=512)
    graph = build_serving_programs(cfg, shape, (), (1,))["decode_1"]
    col = (1, 1)
    state = {
        "sequence": np.random.default_rng(1).integers(0, cfg.vocab, (1, 512)),
        "length": np.full(col, position),  # the slot feeds its last token: one row a step
        "cursor": np.full(col, position - 1),
        "limit": np.full(col, 512),
        "temperature": np.zeros(col, np.float32),
        "page_table": np.arange(32, dtype=graph.states["page_table"].dtype.np).reshape(1, 32),
    }
    return graph, random_parameters(cfg, seed=0), {}, state


CASES = {
    "decode2048": lambda: llama_case(2048, 1),
    "decode2048_unsplit": lambda: llama_case(2048, 1, None),
    "decode4096": lambda: llama_case(4096, 1),
    "decode2048x4": lambda: llama_case(2048, 1, sequences=4),  # 4 sequences at once
    "decode4096x4": lambda: llama_case(4096, 1, sequences=4),
    "prefill2048": lambda: llama_case(2048, 512),
    "prefill4096": lambda: llama_case(4096, 512),
    "gemm4096": lambda: gemm_case(4096),
    "generate1b": generate_case,  # the whole 16-layer step with the LM head and argmax
    "generate1b_noappend": generate_case,  # without attention's append form (FUSION)
    "generate8b": lambda: generate_case(preset="llama3-8b"),  # bench/generate --shape 8b's step
    "prefill1b": prefill_case,  # bench/generate's 128-token prefill
    "serve_decode1": serve_decode_case,  # the serving engine's batch-1 decode step (decode_1) alone
    "silu_chain": lambda: chain_case("silu"),
    "add_chain": lambda: chain_case("add", 2048),
    "rmsnorm8192": lambda: rows_case("rmsnorm"),
    "softmax8192": lambda: rows_case("softmax"),
}
# the graph rewrites a case is planned with, where not all of them (FuseOptions.parse; PROFILE_FUSION
# overrides every case's: "-split_k_linear", "none")
FUSION = {"generate1b_noappend": "-attention_append"}


def report(name: str, tl: trace.Timeline, out: Path) -> None:
    rp = tl.rp
    k = tl.times_ns.shape[0] - 1  # the last iteration: steady state
    t = tl.times_ns[k]
    base = t[:, 0].min()
    print(f"== {name}: {tl.source}; iteration {k}: {(t[:, 1].max() - base) / 1e3:.1f} us")
    print(trace.format_summary(tl))
    wait = np.zeros(len(rp.tasks))
    for lst in rp.processors:
        prev = base
        for tid in lst:
            wait[tid] = t[tid, 0] - prev
            prev = t[tid, 1]
    rows: dict[str, list[int]] = {}
    for task in rp.tasks:
        rows.setdefault(rp.ops[task.op].name, []).append(task.id)
    print(f"  {'op':<34}{'tasks':>6}{'from us':>9}{'to us':>9}{'mean us':>9}{'max us':>9}{'wait us':>9}")
    for op, ids in sorted(rows.items(), key=lambda r: t[r[1], 0].min()):
        d = t[ids, 1] - t[ids, 0]
        print(
            f"  {op:<34}{len(ids):>6}{(t[ids, 0].min() - base) / 1e3:>9.1f}{(t[ids, 1].max() - base) / 1e3:>9.1f}"
            f"{d.mean() / 1e3:>9.2f}{d.max() / 1e3:>9.2f}{wait[ids].mean() / 1e3:>9.2f}"
        )
    print(trace.format_critical_path(tl))
    trace.save_chrome_trace(tl, out / f"{name}.trace.json")
    np.savez_compressed(out / f"{name}.stamps.npz", times_ns=tl.times_ns)  # for analyses done elsewhere
    try:
        trace.save_png(tl, out / f"{name}.png")
    except trace.TraceError as e:
        print(f"no PNG: {e}")


def main() -> None:
    out = Path(os.environ.get("OUT", "/tmp/profile_cases"))
    out.mkdir(parents=True, exist_ok=True)
    found, _ = gpus()
    tiles = matmul_tiles()  # the defaults, or MEGALOOP_BENCH_MATMUL's settings
    # PROFILE_TILES="attention.q_block=128,rmsnorm.waves=4": other ops' tile parameters, to compare
    for item in filter(None, os.environ.get("PROFILE_TILES", "").split(",")):
        key, _, value = item.partition("=")
        op, _, param = key.strip().partition(".")
        tiles.setdefault(op, {})[param] = int(value)
    # PROFILE_OPTIONS="slot_waits=128,poll_sleep_ns=0": the plan's kernel options (KernelOptions)
    options = {}
    for item in filter(None, os.environ.get("PROFILE_OPTIONS", "").split(",")):
        key, _, value = item.partition("=")
        options[key.strip()] = int(value)
    try:
        kernel_options = KernelOptions(**options)
    except TypeError as e:
        raise SystemExit(f"PROFILE_OPTIONS: {e}; the options are {[f.name for f in fields(KernelOptions)]}") from None
    for name in sys.argv[1:] or list(CASES):
        g, params, feeds, *state = CASES[name]()  # (a case that starts from a state gives it fourth)
        fusion = FuseOptions.parse(os.environ.get("PROFILE_FUSION") or FUSION.get(name, "all"))
        processors = found[0].sm_count if found else 132
        plan = make_plan(g, processors=processors, tiles=tiles, options=kernel_options, fusion=fusion)
        if found:
            from megaloop.runtime.loop import LoopKernel

            with LoopKernel(plan, params, state[0] if state else None, profile_iterations=4) as kern:
                kern.run(feeds, iterations=4)
                tl = trace.measured_timeline(plan, kern.profile_ns(), f"measured on {found[0].name}")
        else:
            tl = trace.estimated_timeline(plan, iterations=2)
        report(name, tl, out)


if __name__ == "__main__":
    main()

"""Where planning time goes for the Llama-3.1-8B shape that ``megaloop generate`` plans
(bench/generate_checkpoint.py's checkpoint and prompt): the prefill and the generator graph, each
planned once with ``make_plan`` while the planner's phases are timed, then (``--cprofile``) the
functions that took longest.

    PYTHONPATH=. python scripts/profile_plan.py                     # both graphs, phase times
    PYTHONPATH=. python scripts/profile_plan.py --graphs prefill --cprofile 25
    PYTHONPATH=. python scripts/profile_plan.py --shape 1b --tokens 64 --max-seq 128

The phases are found by wrapping the planner's step functions for the duration of one call (the
planner itself has no timing switch); a phase nested in another is counted in both.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import importlib
import io
import pstats
import time
from collections import defaultdict
from collections.abc import Iterator

from megaloop.models.llama import LlamaConfig, build_llama_generator, build_llama_prefill
from megaloop.plan import make_plan

SHAPES = {  # bench/generate_checkpoint.py's shapes, as the checkpoint loader makes them
    "1b": dict(hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8, head_dim=64, vocab=128256,
               tie_word_embeddings=True),
    "8b": dict(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, head_dim=128, vocab=128256),
}  # fmt: skip
ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}  # fmt: skip

# (module, function, phase name): the planner's steps, outermost first
PHASES = [
    ("megaloop.plan.build", "place_buffers", "place buffers"),
    ("megaloop.plan.build", "make_tasks", "tasks"),
    ("megaloop.plan.build", "build_access_table", "access table"),
    ("megaloop.plan.build", "find_orderings", "orderings"),
    ("megaloop.plan.build", "requirements", "requirements"),
    ("megaloop.plan.build", "list_schedule", "schedule"),
    ("megaloop.plan.build", "link", "link"),
    ("megaloop.plan.build", "hb_order", "  hb order"),
    ("megaloop.plan.build", "derive_waits", "  derive waits"),
    ("megaloop.plan.build", "verify_plan", "verify"),
    ("megaloop.plan.verify", "build_access_table", "  access table"),
    ("megaloop.plan.verify", "find_orderings", "  orderings"),
    ("megaloop.plan.verify", "_check_structure", "  structure"),
    ("megaloop.plan.verify", "_check_memory", "  memory"),
    ("megaloop.plan.verify", "_flat_waits", "  waits"),
    ("megaloop.plan.verify", "_levels", "  levels"),
    ("megaloop.plan.verify", "_clocks", "  clocks"),
]


@contextlib.contextmanager
def timed_phases(times: dict[str, float]) -> Iterator[None]:
    """Wrap each PHASES function (as its caller's module sees it) so that its time adds to ``times``."""
    saved = []
    for module_name, fn_name, phase in PHASES:
        module = importlib.import_module(module_name)
        fn = getattr(module, fn_name, None)
        if fn is None:  # an older planner, without this step
            continue

        def wrapper(*args, _fn=fn, _phase=phase, **kwargs):
            t0 = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                times[_phase] += time.perf_counter() - t0

        saved.append((module, fn_name, fn))
        setattr(module, fn_name, wrapper)
    try:
        yield
    finally:
        for module, fn_name, fn in saved:
            setattr(module, fn_name, fn)


def graphs(shape: str, tokens: int, max_seq: int) -> dict:
    cfg = LlamaConfig(**SHAPES[shape], max_seq=max_seq, rope_theta=500000.0, rope_scaling=ROPE)
    return {
        "prefill": lambda: build_llama_prefill(cfg, 1, tokens),
        "generator": lambda: build_llama_generator(cfg, 1, sampling=False, eos_ids=(128255,)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    ap.add_argument("--graphs", default="prefill,generator")
    ap.add_argument("--tokens", type=int, default=64, help="the prefill's padded prompt tokens")
    ap.add_argument("--max-seq", type=int, default=256, help="the KV cache's positions")
    ap.add_argument("--processors", type=int, default=132)
    ap.add_argument("--cprofile", type=int, default=0, metavar="N", help="also print the N costliest functions")
    args = ap.parse_args()
    builders = graphs(args.shape, args.tokens, args.max_seq)
    for name in args.graphs.split(","):
        t0 = time.perf_counter()
        graph = builders[name]()
        built = time.perf_counter() - t0
        times: dict[str, float] = defaultdict(float)
        profiler = cProfile.Profile() if args.cprofile else None
        with timed_phases(times):
            t0 = time.perf_counter()
            if profiler:
                profiler.enable()
            plan = make_plan(graph, processors=args.processors)
            if profiler:
                profiler.disable()
            total = time.perf_counter() - t0
        tasks = sum(len(rp.tasks) for rp in plan.ranks)
        print(f"{args.shape} {name}: {tasks} tasks, graph {built:.2f} s, make_plan {total:.2f} s"
              + (" (under cProfile)" if profiler else ""))  # fmt: skip
        for _, _, phase in PHASES:
            if phase in times:
                print(f"  {phase:<18} {times[phase]:7.2f} s")
        if profiler:
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(args.cprofile)
            print(out.getvalue())


if __name__ == "__main__":
    main()

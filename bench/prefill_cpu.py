"""The CPU prefill alone: ``ml.Generator`` (backend "cpu") against transformers' forward pass on the
same checkpoint and prompt, in one process, the two interleaved call by call, wall time and the
process's CPU time (one thread: CPU time is what another session's load disturbs least), and
megaloop's time per op of its prefill graph (``--ops``). ``--activations auto,numpy``: megaloop with
each of those ``cpu_activations`` choices (the first is "megaloop", the others "megaloop_CHOICE"), all
interleaved with transformers.

    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 python -m bench.prefill_cpu --shapes 135m --dtypes checkpoint,float32

The checkpoints are bench.generate_cpu's (random weights of published shapes, saved by
transformers). transformers computes the last position's logits only (``logits_to_keep=1``, what
its ``generate`` does). Results: bench/results/NAME.json.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import time
from pathlib import Path
from typing import Any

from bench.common import write
from bench.generate_cpu import SHAPES, describe_machine, make_checkpoint


def _clocks(fn: Any) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def per_op(gen: Any, ids: list[int], runs: int) -> dict[str, float]:
    """CPU ms a prefill spends in each op (its FastGraph's steps timed, medians over ``runs``)."""
    backend = next(iter(gen._backends.values()))
    graph = backend.runs[0]
    spent: dict[str, list[float]] = collections.defaultdict(list)
    steps = list(graph._steps)

    def timed(kernel: Any, name: str) -> Any:
        def run(arrays: Any) -> Any:
            t0 = time.process_time()
            out = kernel(arrays)
            spent[name][-1] += time.process_time() - t0
            return out

        return run

    graph._steps = [(timed(k, n.op.name), i, o) for (k, i, o), n in zip(steps, graph.nodes)]
    try:
        for _ in range(runs):
            for values in spent.values():
                values.append(0.0)
            for node in graph.nodes:  # (an op first seen in this run)
                spent.setdefault(node.op.name, [0.0])
            gen.generate(ids, max_new_tokens=1)
    finally:
        graph._steps = steps
    ops = {name: round(1e3 * statistics.median(v), 1) for name, v in spent.items()}
    return dict(sorted(ops.items(), key=lambda kv: -kv[1]))


def measure(folder: Path, dtype: str, prompt: int, calls: int, ops: bool, activations: list[str]) -> dict:
    import torch
    import transformers

    import megaloop as ml

    kw = {} if dtype == "checkpoint" else {"dtype": getattr(torch, dtype)}
    names = ["megaloop" if i == 0 else f"megaloop_{a}" for i, a in enumerate(activations)]
    gens = {n: ml.Generator(folder, backend="cpu", dtype=None if dtype == "checkpoint" else dtype, eos_token_ids=(),
                            progress=False, cpu_activations=a) for n, a in zip(names, activations)}  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, **kw).eval()
    ids = [(7 * i + 5) % 512 for i in range(prompt)]
    tokens = torch.tensor([ids])
    times: dict[str, list[tuple[float, float]]] = {n: [] for n in [*names, "transformers"]}
    stats: dict[str, Any] = {}
    for call in range(calls + 1):  # (the first call of each: setup, not counted)
        for name, gen in gens.items():
            m = _clocks(lambda n=name, g=gen: stats.__setitem__(n, g.generate(ids, max_new_tokens=1).stats))
            if call:
                times[name].append((stats[name].prefill_s, m[1]))
        with torch.no_grad():
            t = _clocks(lambda: model(tokens, logits_to_keep=1))
        if call:
            times["transformers"].append(t)
    out: dict[str, Any] = {"backend": stats["megaloop"].backend}
    out.update({f"backend_{n[9:]}": stats[n].backend for n in names[1:]})
    for name, pairs in times.items():
        out[name] = {"wall_ms": round(1e3 * statistics.median(p[0] for p in pairs), 1),
                     "cpu_ms": round(1e3 * statistics.median(p[1] for p in pairs), 1),
                     "wall_ms_all": [round(1e3 * p[0], 1) for p in pairs],
                     "cpu_ms_all": [round(1e3 * p[1], 1) for p in pairs]}  # fmt: skip
    for name in names:
        for clock in ("wall_ms", "cpu_ms"):
            key = f"speedup_{clock[:-3]}" + ("" if name == "megaloop" else f"_{name[9:]}")
            out[key] = round(out["transformers"][clock] / out[name][clock], 3)
    if ops:
        out["megaloop_ops_cpu_ms"] = per_op(gens["megaloop"], ids, 3)
    out["load_average"] = os.getloadavg()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="135m")
    ap.add_argument("--dir", default="/tmp/megaloop-cpu-checkpoints", type=Path)
    ap.add_argument("--dtypes", default="checkpoint,float32", help="checkpoint: each system's default")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--calls", type=int, default=5, help="timed calls of each system (after one untimed)")
    ap.add_argument("--ops", action="store_true", help="also megaloop's CPU time per op")
    ap.add_argument("--activations", default="auto", help="megaloop's cpu_activations choices to time")
    ap.add_argument("--name", default="prefill_cpu")
    args = ap.parse_args()
    results: dict = {"machine": describe_machine(), "threads": os.environ.get("OMP_NUM_THREADS"),
                     "prompt_tokens": args.prompt, "calls": args.calls, "cases": []}  # fmt: skip
    for shape in args.shapes.split(","):
        folder = make_checkpoint(shape, args.dir / f"{SHAPES[shape][0]}-{shape}")
        for dtype in args.dtypes.split(","):
            choices = args.activations.split(",")
            case = {"shape": shape, "dtype": dtype,
                    **measure(folder, dtype, args.prompt, args.calls, args.ops, choices)}  # fmt: skip
            m, t = case["megaloop"], case["transformers"]
            others = "".join(f"; {a}: CPU {case['megaloop_' + a]['cpu_ms']:.0f} ms ({case['speedup_cpu_' + a]}x)"
                             for a in choices[1:])  # fmt: skip
            print(f"{shape} {dtype} prompt {args.prompt}: megaloop {m['wall_ms']:.0f} ms (CPU {m['cpu_ms']:.0f}), "
                  f"transformers {t['wall_ms']:.0f} ms (CPU {t['cpu_ms']:.0f}): {case['speedup_wall']}x wall, "
                  f"{case['speedup_cpu']}x CPU{others}; load {case['load_average'][0]:.1f}", flush=True)  # fmt: skip
            results["cases"].append(case)
            write(args.name, results, quiet=True)


if __name__ == "__main__":
    main()

"""Where a one-shot ``megaloop generate`` on the CPU spends its time from the process's start to its
first token and first decode steps: timestamps of each phase (imports, loading, the graphs, torch's
import, the prefill's setup, the prefill, the decode's setup and its first steps), and what the
weights' background thread did (megaloop.reference.ahead), in fresh processes, medians.

    python -m bench.start_cpu --shapes 0.5b --dtypes checkpoint,float32 --repeats 3

Each process wraps a few of the CPU backend's methods to note when they end (profiling only; the
work is the same). The checkpoints are bench.generate_cpu's. Results: bench/results/NAME.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.common import write
from bench.generate_cpu import ROOT, SHAPES, _env, describe_machine, make_checkpoint

# One run: prints "RESULT {...}": each mark's seconds from the process's start, and the background jobs
RUN = """
import time
T0 = time.perf_counter()
marks = {}
def mark(what):
    marks.setdefault(what, time.perf_counter() - T0)
import sys, threading, resource
import megaloop as ml
mark("import megaloop")
from megaloop.reference import fast
from megaloop.generation import backends
ahead = getattr(__import__("megaloop.reference", fromlist=["ahead"]), "ahead", None)
importing = fast._import_quietly
def imported():
    importing()
    mark("torch imported (thread)")
fast._import_quietly = imported
def after(cls, name, label):
    f = getattr(cls, name)
    def wrapped(*a, **k):
        out = f(*a, **k)
        mark(label)
        return out
    setattr(cls, name, wrapped)
after(backends.CpuBackend, "__init__", "graphs built")
after(backends.CpuBackend, "setup_prefill", "prefill set up")
after(backends.CpuBackend, "prefill", "prefill done")
after(backends.CpuBackend, "setup_generator", "decode set up")
after(backends.CpuBackend, "advance", "first decode step")
jobs = []
if ahead is not None:
    run = ahead.Ahead._run
    def timed(job):
        t = time.perf_counter()
        run(job)
        jobs.append((threading.current_thread().name, "packed" if "packed" in job.what else "float32",
                     t - T0, time.perf_counter() - T0))
    ahead.Ahead._run = staticmethod(timed)
folder, dtype = sys.argv[1], sys.argv[2]
gen = ml.Generator(folder, backend="cpu", dtype=None if dtype == "checkpoint" else dtype, eos_token_ids=(),
                   progress=False)
mark("model loaded")
s = gen.generate([(7 * i + 5) % 512 for i in range(int(sys.argv[3]))], max_new_tokens=3).stats
summary = {}
for thread in {j[0] for j in jobs}:
    for kind in ("packed", "float32"):
        mine = [j for j in jobs if j[:2] == (thread, kind)]
        if mine:
            where = "worker" if thread.startswith("megaloop") else "caller"
            summary[f"{kind} ({where})"] = {"jobs": len(mine), "busy_s": sum(j[3] - j[2] for j in mine),
                                           "from_s": min(j[2] for j in mine), "to_s": max(j[3] for j in mine)}
ru = resource.getrusage(resource.RUSAGE_SELF)
print("RESULT " + json.dumps({"marks": marks, "setup": s.setup, "prefill_s": s.prefill_s, "jobs": summary,
                              "cpu_user_s": ru.ru_utime, "cpu_sys_s": ru.ru_stime}))
""".replace("import sys, threading", "import json, sys, threading")


def run_once(folder: Path, dtype: str, prompt: int, tree: Path) -> dict:
    cmd = [sys.executable, "-c", RUN, str(folder), dtype, str(prompt)]
    env = {**_env(1), "PYTHONPATH": str(tree)}  # (the megaloop to time: this one, or another checkout's)
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tree, env=env, timeout=900)
    lines = [line[len("RESULT ") :] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"a run failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def median_marks(runs: list[dict]) -> dict[str, float]:
    names = dict.fromkeys(k for r in runs for k in r["marks"])
    return {k: round(statistics.median(r["marks"][k] for r in runs if k in r["marks"]), 3) for k in names}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="0.5b")
    ap.add_argument("--dir", default="/tmp/megaloop-cpu-checkpoints", type=Path)
    ap.add_argument("--dtypes", default="checkpoint,float32")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--name", default="start_cpu")
    ap.add_argument("--tree", default=ROOT, type=Path, help="the megaloop checkout to time (default: this one)")
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=args.tree)
    results: dict = {"machine": describe_machine(), "prompt_tokens": args.prompt, "tree": str(args.tree),
                     "tree_commit": commit.stdout.strip(), "cases": []}  # fmt: skip
    for shape in args.shapes.split(","):
        folder = make_checkpoint(shape, args.dir / f"{SHAPES[shape][0]}-{shape}")
        for dtype in args.dtypes.split(","):
            runs = []
            for _ in range(args.repeats):
                runs.append(run_once(folder, dtype, args.prompt, args.tree))
                time.sleep(1)
            marks = median_marks(runs)
            results["cases"].append({"shape": shape, "dtype": dtype, "marks_s": marks, "runs": runs})
            order = sorted(marks.items(), key=lambda kv: kv[1])
            print(f"{shape} {dtype}: " + ", ".join(f"{k} {v:.2f}" for k, v in order))
            for r in runs:
                print(f"    setup {r['setup']} jobs {json.dumps(r['jobs'])}", flush=True)
    results["machine"]["load_average_after"] = os.getloadavg()
    write(args.name, results, quiet=True)


if __name__ == "__main__":
    main()

"""``megaloop generate``'s CPU path against transformers' ``generate`` on the same CPU and checkpoint:
first-token latency (prompt to first token, warm; and from a process's start, imports and loading
included, to its first call's first token) and decode tokens/s, greedy, both made to generate
exactly --new-tokens tokens; megaloop with each --cpu-products choice of --products (its
--cpu-activations "auto": "auto" runs the prefill in torch form where torch is installed, "numpy"
the numpy path throughout).

    python -m bench.generate_cpu                          # 135M shape, both dtypes, 1 and 2 threads
    python -m bench.generate_cpu --shapes 0.5b --threads 2 --name generate_cpu_0.5b

The checkpoints are random-weight models of published shapes (SmolLM2-135M's Llama; Qwen2.5-0.5B's
Qwen2, biases included) made and saved by transformers in bfloat16, written once into --dir. Each run is a fresh
process (one system, one thread count: OMP_NUM_THREADS and OPENBLAS_NUM_THREADS set for both), the
runs of the two systems interleaved, and each figure is the median over --repeats runs: the machine
may be shared with other work. Results: bench/results/generate_cpu*.json (--name).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import write

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {  # (family, transformers config fields)
    "135m": ("llama", dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0)),
    "0.5b": ("qwen2", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, rope_theta=1000000.0)),
}  # fmt: skip

# One run of one system in its own process: prints a JSON line "RESULT {...}". "start_to_first_token_s":
# from before the imports to the first call's first token (what a one-shot command waits).
MEGALOOP_RUN = """
import time
started = time.perf_counter()
import json, sys
import megaloop as ml
folder, dtype, prompt, new, calls, products = sys.argv[1:7]
prompt, new, calls = int(prompt), int(new), int(calls)
t0 = time.perf_counter()
dtype = None if dtype == "checkpoint" else dtype
gen = ml.Generator(folder, backend="cpu", dtype=dtype, eos_token_ids=(), progress=False, cpu_products=products)
load = time.perf_counter() - t0
ids = [(7 * i + 5) % 512 for i in range(prompt)]
out = []
for _ in range(calls):
    call = time.perf_counter()
    s = gen.generate(ids, max_new_tokens=new).stats
    assert s.new_tokens == new, s.summary()
    counted = gen.progress.seconds.get("load", 0.0) if not out else 0.0  # (the first call's counts the load)
    out.append({"first_token_s": s.prefill_s, "decode_tokens_per_s": s.tokens_per_s, "setup": s.setup,
                "backend": s.backend, "start_to_first_token_s": call - started + s.first_token_s - counted})
print("RESULT " + json.dumps({"load_s": load, "calls": out}))
"""

TRANSFORMERS_RUN = """
import time
started = time.perf_counter()
import json, sys
import torch, transformers
folder, dtype, prompt, new, calls = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
t0 = time.perf_counter()
kw = {} if dtype == "checkpoint" else {"dtype": getattr(torch, dtype)}
model = transformers.AutoModelForCausalLM.from_pretrained(folder, **kw).eval()
load = time.perf_counter() - t0

class Clock(transformers.generation.streamers.BaseStreamer):
    def __init__(self): self.times = []
    def put(self, value): self.times.append(time.perf_counter())
    def end(self): pass

ids = torch.tensor([[(7 * i + 5) % 512 for i in range(prompt)]])
out = []
for _ in range(calls):
    clock = Clock()
    with torch.no_grad():
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, eos_token_id=None, pad_token_id=0, streamer=clock)
    ticks = clock.times[1:]  # (the first put is the prompt)
    assert len(ticks) == new, len(ticks)
    out.append({"first_token_s": ticks[0] - t0, "decode_tokens_per_s": (new - 1) / (ticks[-1] - ticks[0]),
                "start_to_first_token_s": ticks[0] - started})
print("RESULT " + json.dumps({"load_s": load, "dtype": str(next(model.parameters()).dtype), "calls": out}))
"""


def make_checkpoint(shape: str, folder: Path) -> Path:
    """The shape's random Llama saved by transformers in bfloat16 (once: reused when it is there)."""
    import torch
    import transformers

    if (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file():
        return folder
    t0 = time.perf_counter()
    family, fields = SHAPES[shape]
    config, model_class = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[family]  # fmt: skip
    cfg = config(max_position_embeddings=8192, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=0, **fields)
    torch.manual_seed(0)
    model = model_class(cfg).to(torch.bfloat16)
    with torch.no_grad():  # a trained model's scale: transformers' 0.02 init gives all but flat logits
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif p.ndim == 1:  # (qwen2's biases)
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]))
    model.save_pretrained(folder)
    tiny = Path(tempfile.mkdtemp())
    subprocess.run([sys.executable, "-m", "megaloop", "make-tiny-checkpoint", str(tiny)], check=True, cwd=ROOT,
                   env=_env(1), capture_output=True)  # fmt: skip
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, folder / name)
    print(f"{shape}: saved a random checkpoint to {folder} in {time.perf_counter() - t0:.1f} s", flush=True)
    return folder


def _env(threads: int) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": str(threads), "OPENBLAS_NUM_THREADS": str(threads),
            "MKL_NUM_THREADS": str(threads)}  # fmt: skip


def run_once(script: str, folder: Path, dtype: str, threads: int, prompt: int, new: int, calls: int,
             products: str = "") -> dict:  # fmt: skip
    cmd = [sys.executable, "-c", script, str(folder), dtype, str(prompt), str(new), str(calls), products]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=_env(threads), timeout=1800)
    wall = time.perf_counter() - t0
    lines = [line[len("RESULT ") :] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"a run failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return {**json.loads(lines[-1]), "process_wall_s": wall}


def summarize(runs: list[dict]) -> dict:
    """Medians over the runs: the first call of a process (cold) and the later calls (warm)."""
    cold = [r["calls"][0] for r in runs]
    warm = [c for r in runs for c in r["calls"][1:]]

    def med(xs: list[float]) -> float:
        return round(statistics.median(xs), 4)

    out = {
        "runs": len(runs),
        "load_s": med([r["load_s"] for r in runs]),
        "start_to_first_token_s": med([c["start_to_first_token_s"] for c in cold]),
        "first_token_s": med([c["first_token_s"] for c in warm]),
        "decode_tokens_per_s": med([c["decode_tokens_per_s"] for c in warm]),
        "first_token_s_all": [round(c["first_token_s"], 4) for c in warm],
        "decode_tokens_per_s_all": [round(c["decode_tokens_per_s"], 2) for c in warm],
    }
    if "setup" in cold[0]:  # (megaloop's: the first call's setup phases and prefill, where its start went)
        phases = dict.fromkeys(k for c in cold for k in c["setup"])
        out["cold_setup_s"] = {k: med([c["setup"].get(k, 0.0) for c in cold]) for k in phases}
        out["cold_prefill_s"] = med([c["first_token_s"] for c in cold])
    if "dtype" in runs[0]:
        out["torch_dtype"] = runs[0]["dtype"]
    if "backend" in warm[0]:
        out["backend"] = warm[0]["backend"]
    return out


def describe_machine() -> dict:
    """The CPU (model, cores, the flags that choose kernels), memory, the libraries' versions, and the
    load average (the machine may be shared: other work slows both systems)."""
    import numpy
    import torch
    import transformers

    info = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
        info["cpu"] = next(line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name"))
        flags = set(next(line for line in text.splitlines() if line.startswith("flags")).split())
        info["cpu_flags"] = sorted(flags & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "fma"})
        info["memory_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (OSError, StopIteration, ValueError):
        pass
    blas = numpy.show_config(mode="dicts").get("Build Dependencies", {}).get("blas", {})
    return {"cpus": os.cpu_count(), **info, "python": sys.version.split()[0], "numpy": numpy.__version__,
            "numpy_blas": f"{blas.get('name')} {blas.get('version')}", "torch": torch.__version__,
            "transformers": transformers.__version__, "load_average": os.getloadavg()}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="135m")
    ap.add_argument("--dir", default="/tmp/megaloop-cpu-checkpoints", type=Path)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--dtypes", default="checkpoint,float32", help="checkpoint: each system's default")
    ap.add_argument("--prompts", default="256", help="prompt lengths in tokens")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--calls", type=int, default=2, help="generate calls a process (the first is the cold one)")
    ap.add_argument("--repeats", type=int, default=3, help="processes per system and setting")
    ap.add_argument("--name", default="generate_cpu", help="the results file's name (bench/results/NAME.json)")
    ap.add_argument("--products", default="auto,numpy", help="megaloop's --cpu-products choices to run")
    args = ap.parse_args()
    machine = describe_machine()
    results: dict = {"machine": machine, "new_tokens": args.new_tokens, "calls": args.calls, "repeats": args.repeats,
                     "cases": []}  # fmt: skip
    for shape in args.shapes.split(","):
        folder = make_checkpoint(shape, args.dir / f"{SHAPES[shape][0]}-{shape}")
        for threads in map(int, args.threads.split(",")):
            for dtype in args.dtypes.split(","):
                for prompt in map(int, args.prompts.split(",")):
                    # megaloop's products choices (float32 weights: numpy's only), then transformers
                    systems = [f"megaloop-{p}" for p in (args.products.split(",") if dtype != "float32" else ["auto"])]
                    runs: dict[str, list] = {name: [] for name in [*systems, "transformers"]}
                    for _ in range(args.repeats):  # interleaved: a change in the machine's load hits all
                        for name in runs:
                            script, products = (TRANSFORMERS_RUN, "") if name == "transformers" else (
                                MEGALOOP_RUN, name.split("-", 1)[1])  # fmt: skip
                            runs[name].append(run_once(script, folder, dtype, threads, prompt, args.new_tokens,
                                                       args.calls, products))  # fmt: skip
                    case = {"shape": shape, "threads": threads, "dtype": dtype, "prompt_tokens": prompt,
                            **{name: summarize(r) for name, r in runs.items()}}  # fmt: skip
                    t = case["transformers"]
                    for name in systems:
                        m = case[name]
                        m["decode_speedup"] = round(m["decode_tokens_per_s"] / t["decode_tokens_per_s"], 3)
                        m["first_token_speedup"] = round(t["first_token_s"] / m["first_token_s"], 3)
                        m["start_to_first_token_speedup"] = round(
                            t["start_to_first_token_s"] / m["start_to_first_token_s"], 3
                        )
                        print(f"{shape} threads {threads} {dtype} prompt {prompt} {name}: decode "
                              f"{m['decode_tokens_per_s']:.1f} tok/s vs {t['decode_tokens_per_s']:.1f} "
                              f"({m['decode_speedup']}x); first token {1e3 * m['first_token_s']:.0f} vs "
                              f"{1e3 * t['first_token_s']:.0f} ms ({m['first_token_speedup']}x); from the start "
                              f"{m['start_to_first_token_s']:.2f} vs {t['start_to_first_token_s']:.2f} s",
                              flush=True)  # fmt: skip
                    results["cases"].append(case)
                    results["machine"]["load_average_after"] = os.getloadavg()
                    write(args.name, results, quiet=True)  # after each case: a run cut short keeps its cases


if __name__ == "__main__":
    main()

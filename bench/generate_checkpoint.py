"""``megaloop generate`` on checkpoints transformers saved: Llama-3.2-1B- and Llama-3.1-8B-shaped
(random weights of a trained model's scale, bfloat16, sharded safetensors, transformers 5's layout),
each run as a user runs it (a fresh ``python -m megaloop generate`` process), cold (empty plan and
kernel caches) and then warm: wall time, folder to first token, setup phases, prefill, per-token
latency, tokens/s. For the 1B shape, the first 16 greedy tokens are checked against transformers'
``generate``, both in float32.

    python -m bench.generate_checkpoint                 # both shapes, the check; ~5 min on an H200
    python -m bench.generate_checkpoint --shapes 1b --dir /tmp/ckpt --new-tokens 64

The checkpoints are written once into --dir (default /tmp/megaloop-checkpoints) and reused. The
tokenizer is the tiny checkpoint's (megaloop make-tiny-checkpoint): its ids are valid in any vocabulary
of 512 or more, and ids past it decode to nothing. Results: bench/results/generate_checkpoint.json.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import write

ROOT = Path(__file__).resolve().parent.parent
LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192, "rope_theta": 500000.0}  # fmt: skip
SHAPES = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
               rope_parameters={**LLAMA3_ROPE, "factor": 32.0}),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
               rope_parameters={**LLAMA3_ROPE, "factor": 8.0}),
}  # fmt: skip
PROMPT = (
    "A loop kernel is one program that stays on the GPU and runs every operator of a model. Each processor "
    "walks its own list of tasks and waits on counters instead of barriers, so that the next token"
)
SUMMARY = re.compile(
    r"prefill (?P<prefill_ms>[\d.]+) ms \(first token after (?P<first_token_s>[\d.]+) s\); (?P<steps>\d+) decode "
    r"steps in (?P<decode_s>[\d.]+) s: (?P<ms_per_token>[\d.]+) ms/token, (?P<tokens_per_s>[\d.]+) tokens/s"
    r"(; setup (?P<setup>.*))?"
)


def make_checkpoint(shape: str, folder: Path, device: str = "cuda") -> Path:
    """The shape's random Llama saved by transformers (once: reused when its config is there); the
    weights are drawn on ``device`` (an 8B model's take seconds on the GPU, minutes on the CPU)."""
    import torch
    import transformers

    if (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file():
        return folder
    t0 = time.perf_counter()
    cfg = transformers.LlamaConfig(vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
                                   bos_token_id=0, eos_token_id=128255, **SHAPES[shape])  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = transformers.LlamaForCausalLM(cfg)
        finally:
            torch.set_default_dtype(default)
        with torch.no_grad():  # a trained model's scale: transformers' 0.02 init gives all but flat logits
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1 + 0.1 * torch.randn_like(p))
                else:
                    p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]))
    model.save_pretrained(folder, max_shard_size="4GB")
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    tiny = Path(tempfile.mkdtemp())
    subprocess.run([sys.executable, "-m", "megaloop", "make-tiny-checkpoint", str(tiny)], check=True, cwd=ROOT,
                   env=_env(tiny / "cache"), capture_output=True)  # fmt: skip
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, folder / name)
    print(f"{shape}: saved a random checkpoint to {folder} in {time.perf_counter() - t0:.1f} s", flush=True)
    return folder


def _env(cache: Path) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "MEGALOOP_CACHE": str(cache)}


def run_generate(folder: Path, cache: Path, new_tokens: int, extra: tuple[str, ...] = ()) -> dict:
    """One ``python -m megaloop generate`` process: its wall time and the numbers it printed."""
    prompt = folder / "prompt.txt"
    prompt.write_text(PROMPT)
    cmd = [sys.executable, "-m", "megaloop", "generate", "--model", str(folder), "--prompt-file", str(prompt),
           "--max-new-tokens", str(new_tokens), "--backend", "gpu", "--no-progress", *extra]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=_env(cache), timeout=900)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"megaloop generate failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    match = SUMMARY.search(proc.stderr)
    if match is None:
        raise SystemExit(f"no timing line in megaloop generate's output:\n{proc.stderr[-2000:]}")
    out = {"process_wall_s": round(wall, 2)}
    out.update({k: float(v) for k, v in match.groupdict().items() if k != "setup" and v is not None})
    for item in filter(None, (match["setup"] or "").split(", ")):
        name, seconds, _ = item.rsplit(" ", 2)  # "upload generator 2.1 s"
        out[f"setup_{name.replace(' ', '_')}_s"] = float(seconds)
    print(f"  {proc.stderr.strip().splitlines()[-1]}  [process {wall:.1f} s]", flush=True)
    return out


def check_tokens(folder: Path, cache: Path, count: int = 16) -> dict:
    """The first ``count`` greedy tokens of transformers and of megaloop's loop kernel, both float32."""
    import torch
    import transformers

    os.environ["MEGALOOP_CACHE"] = str(cache)
    import megaloop as ml

    gen = ml.Generator(folder, backend="gpu", dtype="float32", eos_token_ids=(), progress=False)
    ids = gen.encode(PROMPT)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()
    prompt = torch.tensor([ids], device="cuda")
    with torch.no_grad():  # the mask given: else generate masks every id equal to pad_token_id (BOS here)
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=count,
                             do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
    want = out[0, len(ids) :].tolist()
    del model
    torch.cuda.empty_cache()  # before the loop kernels take the GPU
    got = gen.generate(ids, max_new_tokens=count)
    same = next((i for i, (a, b) in enumerate(zip(got[0].tokens, want)) if a != b), len(want))
    print(f"  float32 greedy: megaloop {got[0].tokens}\n                  transformers {want}", flush=True)
    return {"tokens_equal": got[0].tokens == want, "first_difference": same, "megaloop": got[0].tokens,
            "transformers": want, "float32_summary": got.stats.summary()}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="1b,8b")
    ap.add_argument("--dir", default="/tmp/megaloop-checkpoints", type=Path)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--skip-check", action="store_true", help="no float32 comparison with transformers")
    args = ap.parse_args()
    results: dict = {"prompt": PROMPT, "new_tokens": args.new_tokens, "shapes": {}}
    for shape in args.shapes.split(","):
        folder = make_checkpoint(shape, args.dir / f"llama-{shape}")
        cache = Path(tempfile.mkdtemp(prefix=f"megaloop-cache-{shape}-"))  # cold: nothing planned or compiled
        print(f"{shape}: cold", flush=True)
        entry = {"cold": run_generate(folder, cache, args.new_tokens)}
        print(f"{shape}: warm", flush=True)
        entry["warm"] = run_generate(folder, cache, args.new_tokens)
        if shape == "1b" and not args.skip_check:
            entry["float32_check"] = check_tokens(folder, cache)
        results["shapes"][shape] = entry
    write("generate_checkpoint", results)
    if any(not e.get("float32_check", {}).get("tokens_equal", True) for e in results["shapes"].values()):
        print("FAIL: megaloop's float32 tokens differ from transformers'", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()

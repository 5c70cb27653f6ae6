"""Training throughput and loss curves: megaloop's loop kernel (one training step = one loop
iteration, many steps a run) against PyTorch eager and torch.compile on the same GPU, the same
initialisation and the same batches.

    python -m bench.train                  # ~125M Llama shape, batch 8x512 and 1x512, 200 steps each
    python -m bench.train --smoke          # tiny sizes on the CPU (a check that the script runs)

The model: a Llama shape (hidden 768, 12 layers, 12 heads, intermediate 2048, vocabulary 32000; about
125M parameters with untied embeddings), random-initialised by transformers (seed 0) and saved with
save_pretrained in bfloat16, with a byte-level BPE trained on the text. The text: the Python standard
library's own .py files (every machine has them), each file a document, packed into windows of
seq + 1 tokens and shuffled with seed 0 (megaloop.training.data): megaloop and torch read the same
windows in the same order.

The three systems train in mixed precision: megaloop bf16 weights with float32 masters and moments;
torch float32 weights under autocast(bfloat16), fused AdamW. Same AdamW settings (lr 3e-4, betas
(0.9, 0.95), weight decay 0.1 on matrices), warmup 10 steps then cosine to 3e-5, gradients clipped
at 1.0. tokens/s counts steps after the first 10 (torch.compile's compile and the caches warm);
megaloop's runs exclude its setup (plan, compile, upload). Loss curves are compared as the mean
absolute difference of 10-step means, relative to torch eager's loss (bf16 runs drift apart step by
step, so a per-step bound would measure chaos, not correctness). Results: bench/results/train.json.
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.common import write

FULL = dict(hidden=768, layers=12, heads=12, intermediate=2048, vocab=32000)
SMOKE = dict(hidden=64, layers=2, heads=4, intermediate=128, vocab=512)
TEXT_BYTES = 8_000_000  # the BPE learns from this much of the text (all of it is tokenized)


def stdlib_text(limit: int | None = None) -> list[str]:
    """The standard library's .py files, sorted by path (at most ``limit`` bytes of them)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out, size = [], 0
    for path in sorted(root.rglob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        out.append(text)
        size += len(text)
        if limit and size >= limit:
            break
    return out


def make_checkpoint(folder: Path, shape: dict, texts: list[str], dtype: str) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=shape["vocab"], special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    sample, size = [], 0
    for t in texts:
        sample.append(t)
        size += len(t)
        if size > TEXT_BYTES:
            break
    tok.train_from_iterator(sample, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text('{"eos_token": "<|endoftext|>"}\n')
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"], num_key_value_heads=shape["heads"],
        max_position_embeddings=1024, tie_word_embeddings=False, rms_norm_eps=1e-5,
    )  # fmt: skip
    LlamaForCausalLM(cfg).to(getattr(torch, dtype)).save_pretrained(folder)


def torch_run(folder: Path, windows: np.ndarray, steps: int, opt, *, compiled: bool, device: str, amp: bool) -> dict:
    """Losses and tokens/s of the same training in PyTorch (eager, or the model under torch.compile)."""
    import torch
    from transformers import LlamaForCausalLM, get_cosine_with_min_lr_schedule_with_warmup

    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").to(device)
    params = dict(model.named_parameters())
    groups = [
        {"params": [p for p in params.values() if p.ndim > 1], "weight_decay": opt.weight_decay},
        {"params": [p for p in params.values() if p.ndim == 1], "weight_decay": 0.0},
    ]
    adam = torch.optim.AdamW(groups, lr=opt.lr, betas=opt.betas, eps=opt.eps, fused=device == "cuda")
    sched = get_cosine_with_min_lr_schedule_with_warmup(adam, opt.warmup, steps, min_lr=opt.min_lr)
    forward = torch.compile(model) if compiled else model
    data = torch.from_numpy(windows).to(device)
    vocab = model.config.vocab_size
    losses, marks = [], []
    for s in range(steps):
        window = data[s % len(data)]
        with torch.autocast(device, dtype=torch.bfloat16, enabled=amp):
            logits = forward(window[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab), window[:, 1:].reshape(-1))
        adam.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(params.values()), opt.max_norm)
        adam.step()
        sched.step()
        losses.append(loss.detach())
        if device == "cuda":
            torch.cuda.synchronize()
        marks.append(time.perf_counter())
    skip = min(10, steps - 1)
    seconds = marks[-1] - marks[skip - 1] if skip else marks[-1]
    tokens = windows.shape[1] * (windows.shape[2] - 1) * (steps - skip)
    return {"losses": [float(x) for x in losses], "tokens_per_s": tokens / seconds}


def bench_trainer(folder: Path, texts: list[str], batch: int, seq: int, steps: int, backend: str):
    """(the Trainer, the tokens, its windows) of one shape's run (scripts/precompile.py plans the same)."""
    import megaloop as ml

    opt = ml.OptimizerSettings(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, warmup=min(10, steps - 1), min_lr=3e-5)
    settings = ml.TrainSettings(steps=steps, batch=batch, seq=seq, optimizer=opt, backend=backend, steps_per_run=steps)
    trainer = ml.Trainer(folder, settings, progress=False)
    tokens = document_tokens(trainer, texts, steps * batch * (seq + 1))
    return trainer, tokens, trainer.windows(tokens)


def say(text: str) -> None:
    """A phase's time on stderr, so that a run cut short still says where its time went."""
    print(text, file=sys.stderr, flush=True)


def document_tokens(trainer, texts: list[str], needed: int) -> np.ndarray:
    """The texts' tokens (megaloop.training.data), enough of the texts for ``needed`` tokens."""
    from megaloop.training.data import tokenize_texts

    tokenizer, pieces, count = trainer.tokenizer(), [], 0
    for start in range(0, len(texts), 16):
        pieces.append(tokenize_texts(tokenizer, texts[start : start + 16]))
        count += pieces[-1].size
        if count >= needed * 1.1:
            break
    return np.concatenate(pieces)


def compare(ours: list[float], ref: list[float], window: int = 10) -> float:
    """Mean |difference| of the curves' window means, relative to the reference's mean loss."""
    n = len(ref) // window * window or len(ref)
    a = np.asarray(ours[:n]).reshape(-1, min(window, n)).mean(1)
    b = np.asarray(ref[:n]).reshape(-1, min(window, n)).mean(1)
    return float(np.mean(np.abs(a - b)) / np.mean(np.abs(b)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU, a few steps, no torch.compile")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--shapes", default="8x512,1x512", help="batch x seq, comma-separated")
    ap.add_argument("--dir", default=None, help="where the checkpoint goes (default: a temporary folder)")
    ap.add_argument("--name", default=None, help="results file name (default train, or train_smoke)")
    args = ap.parse_args()

    smoke, started = args.smoke, time.perf_counter()
    shape, steps = (SMOKE, 3) if smoke else (FULL, args.steps)
    shapes = [(2, 32)] if smoke else [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    backend, device = ("cpu", "cpu") if smoke else ("gpu", "cuda")
    dtype = "float32" if smoke else "bfloat16"
    texts = stdlib_text(300_000 if smoke else None)
    folder = Path(args.dir or tempfile.mkdtemp()) / "llama-bench"
    if not (folder / "model.safetensors").is_file():
        make_checkpoint(folder, shape, texts, dtype)
    say(f"text and checkpoint ready: {time.perf_counter() - started:.0f} s")
    runs = []
    for batch, seq in shapes:
        trainer, tokens, windows = bench_trainer(folder, texts, batch, seq, steps, backend)
        opt = trainer.settings.optimizer
        t0 = time.perf_counter()
        result = trainer.train(windows)
        say(f"{batch}x{seq}: megaloop set up and trained in {time.perf_counter() - t0:.0f} s")
        t0 = time.perf_counter()
        eager = torch_run(folder, windows, steps, opt, compiled=False, device=device, amp=not smoke)
        say(f"{batch}x{seq}: torch eager in {time.perf_counter() - t0:.0f} s")
        systems = {"megaloop": {"losses": result.losses, "tokens_per_s": result.tokens_per_second, "mfu": result.mfu}}
        systems["torch_eager"] = eager
        if not smoke:
            t0 = time.perf_counter()
            systems["torch_compile"] = torch_run(folder, windows, steps, opt, compiled=True, device=device, amp=True)
            say(f"{batch}x{seq}: torch.compile in {time.perf_counter() - t0:.0f} s")
        torch_runs = {k: v for k, v in systems.items() if k != "megaloop"}
        best = max(v["tokens_per_s"] for v in torch_runs.values())
        run = {
            "batch": batch, "seq": seq, "steps": steps, "tokens": int(tokens.size), "systems": systems,
            "megaloop_over_best_torch": result.tokens_per_second / best,
            "loss_curve_difference": {k: compare(result.losses, v["losses"]) for k, v in torch_runs.items()},
        }  # fmt: skip
        print(f"{batch}x{seq}: " + ", ".join(f"{k} {v['tokens_per_s']:,.0f} tok/s" for k, v in systems.items()),
              file=sys.stderr)  # fmt: skip
        runs.append(run)
    shape_info = {**shape, "parameters": sum(int(np.prod(s)) for s in trainer.cfg.parameter_shapes().values())}
    write(args.name or ("train_smoke" if smoke else "train"), {"model": shape_info, "dtype": dtype, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())

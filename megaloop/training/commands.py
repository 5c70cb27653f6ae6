"""``megaloop train``: fine-tune a checkpoint folder on text files with ``Trainer`` (registered by
megaloop/cli.py through ``add_train_command``). The progress bar (loss, tokens/s, model FLOP
utilisation) and notes go to stderr; the summary line to stdout."""

from __future__ import annotations

import argparse
from typing import Any

from megaloop.argtypes import at_least
from megaloop.errors import UsageError

SCHEDULES = ("cosine", "linear", "constant")


def _number(low: float, strict: bool = False):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (value > low if strict else value >= low) or value != value or value in (float("inf"), float("-inf")):
            raise argparse.ArgumentTypeError(f"must be a finite number {'>' if strict else '>='} {low:g}, got {text}")
        return value

    parse.__name__ = f"number {'>' if strict else '>='} {low:g}"
    return parse


def _gpu_list(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GPU numbers joined by commas (0,0,1,1), got {text!r}") from None
    if any(g < 0 for g in out):
        raise argparse.ArgumentTypeError(f"GPU numbers are >= 0, got {text!r}")
    return out


def add_train_command(sub: Any) -> None:
    """Add ``train`` to megaloop's argparse subparsers."""
    p = sub.add_parser(
        "train",
        help="fine-tune a Hugging Face checkpoint folder on text files",
        description="Fine-tune a checkpoint folder (Llama, Mistral, Qwen2/3, ...) on text files: each file a document, "
        "tokenized with the checkpoint's tokenizer and packed into windows of --seq + 1 tokens. One training step is "
        "one iteration of the loop kernel (forward, backward, AdamW); the checkpoint written to --output loads in "
        "transformers and megaloop generate. Without a GPU it trains on the CPU, slowly.",
    )
    p.add_argument("--model", required=True, metavar="DIR", help="the checkpoint folder to start from")
    p.add_argument("--data", required=True, nargs="+", metavar="FILE", help="text files (UTF-8), one document each")
    p.add_argument("--output", required=True, metavar="DIR", help="where the checkpoint goes (a new or empty folder)")
    p.add_argument("--steps", required=True, type=at_least(1), metavar="N", help="optimizer steps")
    p.add_argument("--batch", type=at_least(1), default=8, metavar="N", help="windows a micro-batch (default 8)")
    p.add_argument("--seq", type=at_least(1), default=512, metavar="N", help="tokens a window (default 512)")
    p.add_argument("--lr", type=_number(0.0), default=3e-4, metavar="X", help="peak learning rate (default 3e-4)")
    p.add_argument("--min-lr", type=_number(0.0), default=0.0, metavar="X", help="the schedule's end (default 0)")
    p.add_argument("--schedule", choices=SCHEDULES, default="cosine", help="decay after warmup (default cosine)")
    p.add_argument("--warmup", type=at_least(0), default=0, metavar="N", help="linear warmup steps from 0 (default 0)")
    p.add_argument("--weight-decay", type=_number(0.0), default=0.0, metavar="X", help="AdamW's, on matrices (0)")
    p.add_argument("--max-grad-norm", type=_number(0.0), default=1.0, metavar="X", help="clip (0: off; default 1)")
    p.add_argument("--grad-accum", type=at_least(1), default=1, metavar="K", help="micro-batches a step (default 1)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], help="compute dtype (default: the checkpoint's)")
    p.add_argument(
        "--backend", default="auto", choices=["auto", "gpu", "cpu", "reference"],
        help="auto: the GPU if there is one, else cpu (the fast CPU path, slow); reference: the numpy definition",
    )  # fmt: skip
    p.add_argument("--devices", type=at_least(1), default=1, metavar="N", help="ranks to split the step over (1)")
    p.add_argument(
        "--strategy", default="auto", metavar="NAME",
        help="how: auto (the cost model picks), dp, zero1, zero2, tp, pp, or axes with sizes: pp2xtp2, zero2_2xtp2",
    )  # fmt: skip
    p.add_argument("--micro-batches", type=at_least(1), metavar="M", help="a pipeline's chains (default one a stage)")
    p.add_argument("--recompute", action="store_true", help="recompute each layer's activations in its backward")
    p.add_argument(
        "--gpus", type=_gpu_list, metavar="LIST",
        help="the GPU of each rank, e.g. 0,0 (ranks sharing GPU 0); default rank r on GPU r",
    )  # fmt: skip
    p.add_argument("--save-every", type=at_least(1), metavar="K", help="also checkpoint every K steps (checkpoint-K/)")
    p.add_argument("--seed", type=at_least(0), default=0, metavar="N", help="orders the data's windows (default 0)")
    p.add_argument("--overwrite", action="store_true", help="write into a non-empty --output folder")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(fn=cmd_train)


def cmd_train(args: argparse.Namespace) -> int:
    from megaloop.runtime.device import gpus
    from megaloop.training.graph import OptimizerSettings
    from megaloop.training.trainer import Trainer, TrainSettings

    backend = args.backend if args.backend != "auto" else ("gpu" if gpus()[0] else "cpu")
    optimizer = OptimizerSettings(
        lr=args.lr, min_lr=min(args.min_lr, args.lr), schedule=args.schedule, warmup=args.warmup,
        weight_decay=args.weight_decay, max_norm=args.max_grad_norm or None, accumulate=args.grad_accum,
    )  # fmt: skip
    progress = False if args.no_progress else None
    try:
        settings = TrainSettings(
            steps=args.steps, batch=args.batch, seq=args.seq, optimizer=optimizer, dtype=args.dtype, backend=backend,
            devices=args.devices, strategy=args.strategy, micro_batches=args.micro_batches, recompute=args.recompute,
            gpus=args.gpus, save_every=args.save_every, seed=args.seed,
        )  # fmt: skip
        trainer = Trainer(args.model, settings, output=args.output, overwrite=args.overwrite, progress=progress)
        result = trainer.train(args.data)
    except UsageError as e:
        raise UsageError(f"megaloop train: {e}") from None
    mfu = f"{100 * result.mfu:.1f}%" if result.mfu is not None else "n/a"
    where = "" if result.split == "1 device" else f" ({result.split})"
    print(
        f"trained {len(result.losses)} steps on {backend}{where}: "
        f"loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}, "
        f"{result.tokens_per_second:,.0f} tokens/s, MFU {mfu}; checkpoint in {result.output}"
    )
    return 0

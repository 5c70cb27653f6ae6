"""The commands ``megaloop generate`` and ``megaloop make-tiny-checkpoint`` (registered by
megaloop/cli.py through ``add_commands``).

generate writes the generated text to stdout as it comes (nothing else: it can be piped) and the
backend, timings and setup to stderr. With --batch-file (one prompt per line) the prompts run as
one batch and stdout gets one JSON object per prompt, in order.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from megaloop.errors import MegaloopError


def add_commands(sub: Any) -> None:
    """Add the subcommands to megaloop's argparse subparsers."""
    gen = sub.add_parser(
        "generate",
        help="generate text from a Hugging Face checkpoint folder (Llama, Mistral, Qwen2, Qwen3)",
        description="Generate text from a checkpoint folder: config.json, safetensors, tokenizer.json. The text "
        "goes to stdout as it is generated; the backend and timings to stderr.",
    )
    gen.add_argument("--model", required=True, metavar="DIR", help="the checkpoint folder")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="the prompt")
    src.add_argument("--prompt-file", metavar="FILE", help="the prompt from a file ('-': stdin), less a last newline")
    src.add_argument(
        "--batch-file", metavar="FILE", help="one prompt per line, run as one batch; prints a JSON line per prompt"
    )
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the checkpoint's chat template")
    gen.add_argument("--max-new-tokens", type=_positive, default=128, metavar="N", help="default 128")
    gen.add_argument("--temperature", type=_non_negative, default=0.0, help="0 (the default): greedy")
    gen.add_argument("--top-k", type=_non_negative_int, default=0, metavar="K", help="0 (the default): off")
    gen.add_argument("--top-p", type=_probability, default=1.0, metavar="P", help="1 (the default): off")
    gen.add_argument("--seed", type=int, default=0, help="the same seed, the same tokens (batch prompt i: seed + i)")
    gen.add_argument("--backend", default="auto", choices=["auto", "gpu", "cpu"], help="auto: a GPU if there is one")
    gen.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], help="default: the checkpoint's")
    gen.add_argument("--max-seq", type=_positive, metavar="N", help="cap the context (default: the model's)")
    gen.add_argument(
        "--allow-long-context",
        action="store_true",
        help="let --max-seq pass the model's context (max_position_embeddings), at your own risk",
    )
    gen.add_argument(
        "--allow-unknown-config-fields", action="store_true",
        help="load a config.json with fields megaloop does not know, as if they were absent (at your own risk)",
    )  # fmt: skip
    gen.add_argument(
        "--devices", type=_positive, default=1, metavar="N", help="split the model over N devices (default 1)"
    )
    gen.add_argument(
        "--strategy", default="auto", choices=["auto", "tp", "pp", "dp"],
        help="how --devices splits it: tensor, pipeline or data (the prompts) parallel; auto: the cost model picks",
    )  # fmt: skip
    gen.add_argument("--no-progress", action="store_true", help="no progress bars")
    gen.set_defaults(fn=cmd_generate)
    tiny = sub.add_parser(
        "make-tiny-checkpoint",
        help="write a small random Llama with a real tokenizer, to try megaloop generate on",
        description="Write a tiny random-weight Llama checkpoint (config.json, model.safetensors, tokenizer.json, "
        "tokenizer_config.json with a chat template) into DIR. Its text is noise: the weights are random.",
    )
    tiny.add_argument("dir", metavar="DIR")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--force", action="store_true", help="overwrite other files of those names in DIR")
    tiny.set_defaults(fn=cmd_make_tiny_checkpoint)


def _positive(text: str) -> int:
    return _number(text, int, lambda v: v >= 1, "an integer >= 1")


def _non_negative_int(text: str) -> int:
    return _number(text, int, lambda v: v >= 0, "an integer >= 0")


def _non_negative(text: str) -> float:
    return _number(text, float, lambda v: v >= 0, "a number >= 0")


def _probability(text: str) -> float:
    return _number(text, float, lambda v: 0 < v <= 1, "a number in (0, 1]")


def _number(text: str, kind: type, ok: Any, what: str) -> Any:
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not ok(value):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def _read(path: str, what: str) -> str:
    try:
        return sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise SystemExit(f"megaloop generate: cannot read {what} {path}: {e}") from None


def cmd_generate(args: argparse.Namespace) -> int:
    from megaloop.generation.generator import Generator

    if args.batch_file is not None:
        prompts: Any = [line for line in _read(args.batch_file, "the batch file").splitlines() if line.strip()]
        if not prompts:
            raise SystemExit(f"megaloop generate: {args.batch_file} holds no prompts (one a line)")
    else:
        prompts = args.prompt if args.prompt is not None else _read(args.prompt_file, "the prompt file")
        prompts = prompts.removesuffix("\n")  # an editor's final newline is not part of the prompt
    progress = False if args.no_progress else None
    gen = Generator(
        args.model, backend=args.backend, dtype=args.dtype, max_seq=args.max_seq, progress=progress,
        devices=args.devices, strategy=args.strategy, allow_long_context=args.allow_long_context,
        allow_unknown_fields=args.allow_unknown_config_fields,
    )  # fmt: skip
    print(f"megaloop generate: {args.model} on {_backend_line(gen)}", file=sys.stderr)
    batch = args.batch_file is not None

    def show(index: int, text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    result = gen.generate(
        prompts,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        chat=args.chat,
        on_text=None if batch else show,
    )
    if batch:
        for i, (prompt, c) in enumerate(zip(prompts, result)):
            line = {"index": i, "prompt": prompt, "text": c.text, "tokens": c.tokens, "finish_reason": c.finish_reason}
            print(json.dumps(line, ensure_ascii=False))
    else:
        print()
    print(f"megaloop generate: {result.stats.summary()}", file=sys.stderr)
    if result.stats.split:
        print(f"megaloop generate: {result.stats.split}", file=sys.stderr)
    return 0


def _backend_line(gen: Any) -> str:
    if gen.backend == "gpu":
        return f"the loop kernel ({gen.reason})"
    return f"the CPU reference ({gen.reason})"


def cmd_make_tiny_checkpoint(args: argparse.Namespace) -> int:
    from megaloop.models.tiny import make_tiny_checkpoint

    try:
        folder = make_tiny_checkpoint(args.dir, seed=args.seed, overwrite=args.force)
    except OSError as e:
        raise MegaloopError(f"cannot write the tiny checkpoint into {args.dir}: {e}") from None
    print(f"wrote a tiny random Llama checkpoint to {folder} (try: megaloop generate --model {folder} --prompt Hi)")
    return 0

"""The commands ``megaloop generate`` and ``megaloop make-tiny-checkpoint`` (registered by
megaloop/cli.py through ``add_commands``).

generate writes what was generated to stdout (nothing else: it can be piped) and the backend,
settings, timings and setup to stderr (-q: nothing but errors; -v: more). One prompt and one sequence
stream as plain text as they come (with --logprobs, a table of the tokens after it); a batch file
(one prompt a line: megaloop.generation.batch_file) or --n > 1 give one JSON object per sequence.
Ctrl-C stops at once: the text so far, a newline, the timings, exit status 130.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from megaloop.errors import MegaloopError, UsageError

SAMPLING_FLAGS = (  # (flag, GenerationSettings field, argparse type name, help)
    ("--temperature", "temperature", "non_negative", "0: greedy (default: generation_config.json's, else 0)"),
    ("--top-k", "top_k", "non_negative_int", "keep the K likeliest tokens (0: off)"),
    ("--top-p", "top_p", "probability", "keep the likeliest tokens up to this probability (1: off)"),
    ("--min-p", "min_p", "unit", "drop tokens less likely than P times the likeliest (0: off)"),
    ("--repetition-penalty", "repetition_penalty", "positive_number", "transformers' (1: off; greedy too)"),
    ("--presence-penalty", "presence_penalty", "number", "OpenAI's (0: off)"),
    ("--frequency-penalty", "frequency_penalty", "number", "OpenAI's (0: off)"),
)


def add_commands(sub: Any) -> None:
    """Add the subcommands to megaloop's argparse subparsers."""
    gen = sub.add_parser(
        "generate",
        help="generate text from a Hugging Face checkpoint folder (Llama, Mistral, Qwen2, Qwen3)",
        description="Generate text from a checkpoint folder: config.json, safetensors, tokenizer.json. The text "
        "goes to stdout as it is generated; the backend and timings to stderr. Settings not given come from the "
        "checkpoint's generation_config.json (said on stderr), then megaloop's defaults (greedy, 128 tokens).",
    )
    gen.add_argument("--model", required=True, metavar="DIR", help="the checkpoint folder")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="the prompt")
    src.add_argument("--prompt-file", metavar="FILE", help="the prompt from a file ('-': stdin), less a last newline")
    src.add_argument("--messages", metavar="FILE", help="a conversation: a JSON list of {role, content} (chat)")
    src.add_argument(
        "--batch-file", metavar="FILE", help="one prompt per line (a text, or a JSON object with its own settings), "
        "run as one batch; prints a JSON line per sequence",
    )  # fmt: skip
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the checkpoint's chat template")
    gen.add_argument("--system", metavar="TEXT", help="a system prompt (implies --chat)")
    gen.add_argument("--max-new-tokens", type=_positive, metavar="N", help="default: generation_config.json's or 128")
    for flag, _, kind, text in SAMPLING_FLAGS:
        gen.add_argument(flag, type=PARSERS[kind], metavar="X", help=text)
    gen.add_argument("--seed", type=_integer, metavar="N", help="any integer (mod 2^64); without one, one is drawn")
    gen.add_argument("--stop", action="append", metavar="TEXT", help="end a sequence at this text (repeatable)")
    gen.add_argument("--n", type=_positive, metavar="N", help="sequences per prompt (default 1)")
    gen.add_argument("--logprobs", type=_logprobs, metavar="N", help="each token's log-probability and N alternatives")
    gen.add_argument("--skip-bad-lines", action="store_true", help="skip a batch file's bad lines (say which)")
    gen.add_argument(
        "--backend", default="auto", choices=["auto", "gpu", "cpu", "reference"],
        help="auto: a GPU if there is one, else cpu; reference: the numpy definition the others are tested against "
        "(slow)",
    )  # fmt: skip
    gen.add_argument(
        "--cpu-products", default="auto", choices=["auto", "numpy", "torch"],
        help="the CPU's products: numpy's float32 BLAS, or a prefill's bfloat16 products by torch; auto: torch's for "
        "a prefill's large bfloat16 weights, where it is installed and the CPU has bfloat16 dot products",
    )  # fmt: skip
    gen.add_argument(
        "--cpu-activations", default="auto", choices=["auto", "numpy", "torch"],
        help="the CPU prefill's values between ops: numpy's float32, or torch tensors of the model's dtype (every op "
        "torch's where it has a kernel); auto: torch where it is installed and faster, unless --cpu-products numpy",
    )  # fmt: skip
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
    talk = gen.add_mutually_exclusive_group()
    talk.add_argument("-q", "--quiet", action="store_true", help="only what was generated (errors still on stderr)")
    talk.add_argument("-v", "--verbose", action="store_true", help="more detail on stderr")
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


def _number(text: str, kind: type, ok: Any, what: str) -> Any:
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or (kind is float and value != value) or not ok(value):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def _positive(text: str) -> int:
    return _number(text, int, lambda v: v >= 1, "an integer >= 1")


def _integer(text: str) -> int:
    return _number(text, int, lambda v: True, "an integer")


def _logprobs(text: str) -> int:
    return _number(text, int, lambda v: 0 <= v <= 20, "an integer in [0, 20]")


PARSERS = {
    "non_negative": lambda t: _number(t, float, lambda v: 0 <= v < float("inf"), "a number >= 0"),
    "non_negative_int": lambda t: _number(t, int, lambda v: v >= 0, "an integer >= 0"),
    "probability": lambda t: _number(t, float, lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "unit": lambda t: _number(t, float, lambda v: 0 <= v <= 1, "a number in [0, 1]"),
    "positive_number": lambda t: _number(t, float, lambda v: 0 < v < float("inf"), "a number > 0"),
    "number": lambda t: _number(t, float, lambda v: abs(v) < float("inf"), "a finite number"),
}


class Reporter:
    """What goes to stderr: ``note`` unless -q, ``detail`` with -v only."""

    def __init__(self, quiet: bool, verbose: bool) -> None:
        self.quiet, self.verbose = quiet, verbose

    def note(self, text: str) -> None:
        if not self.quiet:
            print(f"megaloop generate: {text}", file=sys.stderr, flush=True)

    def detail(self, text: str) -> None:
        if self.verbose:
            print(f"megaloop generate: {text}", file=sys.stderr, flush=True)


def cmd_generate(args: argparse.Namespace) -> int:
    from megaloop.generation.generator import GenerationInterrupted, Generator
    from megaloop.generation.settings import as_seed_word, reduced

    say = Reporter(args.quiet, args.verbose)
    if args.seed is not None and reduced(args.seed):
        say.note(f"--seed {args.seed} is reduced mod 2^64 to {args.seed % 2**64} (seeds are 64-bit words)")
    if args.seed is not None:
        args.seed = as_seed_word(args.seed)
    lines, prompts, per_prompt = _prompts(args, say)
    progress = False if (args.no_progress or args.quiet) else None
    gen = Generator(
        args.model, backend=args.backend, dtype=args.dtype, max_seq=args.max_seq, progress=progress,
        devices=args.devices, strategy=args.strategy, allow_long_context=args.allow_long_context,
        allow_unknown_fields=args.allow_unknown_config_fields, cpu_products=args.cpu_products,
        cpu_activations=args.cpu_activations,
    )  # fmt: skip
    say.note(f"{args.model} on {_backend_line(gen)}")
    overridden = {field for flag, field, _, _ in SAMPLING_FLAGS if getattr(args, field) is not None}
    overridden |= {"max_new_tokens"} if args.max_new_tokens is not None else set()
    shown = [text for name, text in gen.defaults.shown.items() if name not in overridden]
    if shown:
        say.note("from generation_config.json: " + ", ".join(shown) + " (flags and batch-file fields win)")
    say.detail(f"end-of-sequence tokens {list(gen.eos_token_ids)}")
    stream = lines is None and (args.n or 1) == 1
    out = _Output(gen, stream)
    kw = {field: getattr(args, field) for _, field, _, _ in SAMPLING_FLAGS}
    try:
        result = gen.generate(
            prompts, max_new_tokens=args.max_new_tokens, seed=args.seed, stop=args.stop, n=args.n,
            logprobs=args.logprobs, settings=per_prompt, on_text=out.text if stream else None, **kw,
        )  # fmt: skip
    except GenerationInterrupted as e:
        out.finish(e.result, lines, args)
        _report(say, e.result, args)
        say.note("interrupted")
        return 130
    out.finish(result, lines, args)
    _report(say, result, args)
    return 0


def _prompts(args: argparse.Namespace, say: Reporter) -> tuple[list | None, Any, Any]:
    """(the batch file's lines or None, the prompts for generate, their per-prompt settings or None)."""
    from megaloop.generation.batch_file import read_batch_file, read_file
    from megaloop.generation.requests import chat_messages, check_messages
    from megaloop.generation.settings import GenerationError

    chat = args.chat or args.system is not None
    if args.batch_file is not None:
        lines = read_batch_file(read_file(args.batch_file, "the batch file"), args.batch_file, args.skip_bad_lines,
                                say.note)  # fmt: skip
        prompts = []
        for line in lines:
            prompt, system = line.prompt, line.system if line.system is not None else args.system
            wants_chat = (line.chat if line.chat is not None else chat) or system is not None
            if not isinstance(prompt, list) or (prompt and isinstance(prompt[0], dict)):  # text or conversation
                if wants_chat or not isinstance(prompt, str):
                    try:
                        prompt = chat_messages(prompt, system, f"{args.batch_file} line {line.line}")
                    except GenerationError as e:
                        raise UsageError(f"megaloop generate: {e}") from None
            prompts.append(prompt)
        return lines, prompts, [line.settings for line in lines]
    if args.messages is not None:
        try:
            messages = json.loads(read_file(args.messages, "the conversation file").decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UsageError(f"megaloop generate: {args.messages} is not a JSON conversation ({e})") from None
        try:
            return None, chat_messages(check_messages(messages, args.messages), args.system, args.messages), None
        except GenerationError as e:
            raise UsageError(f"megaloop generate: {e}") from None
    if args.prompt is not None:
        text = args.prompt
    else:
        try:
            text = read_file(args.prompt_file, "the prompt file").decode("utf-8")
        except UnicodeDecodeError as e:
            raise UsageError(f"megaloop generate: {args.prompt_file} is not UTF-8 text ({e})") from None
        text = text.removesuffix("\n")  # an editor's final newline is not part of the prompt
    return None, (chat_messages(text, args.system, "--prompt") if chat else text), None


class _Output:
    """stdout: the streamed text of one sequence (then a newline, and a logprobs table where asked),
    or one JSON object per sequence."""

    def __init__(self, gen: Any, stream: bool) -> None:
        self.gen, self.stream, self.wrote = gen, stream, False

    def text(self, index: int, piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()
        self.wrote = True

    def finish(self, result: Any, lines: list | None, args: argparse.Namespace) -> None:
        if self.stream:
            print()
            if result.completions and result[0].logprobs is not None:
                print(self._table(result[0].logprobs))
            return
        for c in result:
            line = {"index": c.index}
            if lines is not None:
                line.update(line=lines[c.index].line, prompt=lines[c.index].prompt)
            if (args.n or 1) > 1 or (lines is not None and lines[c.index].settings.n):
                line["sample"] = c.sample
            line.update(text=c.text, tokens=c.tokens, finish_reason=c.finish_reason)
            if c.stop is not None:
                line["stop"] = c.stop
            if c.seed is not None:
                line["seed"] = c.seed
            if c.logprobs is not None:
                line["logprobs"] = [self._entry(e) for e in c.logprobs]
            print(json.dumps(line, ensure_ascii=False), flush=True)

    def _piece(self, token: int) -> str:
        return self.gen.tokenizer.decode([token], skip_special_tokens=False) if self.gen.tokenizer else str(token)

    def _entry(self, e: Any) -> dict:
        top = [{"token": t, "text": self._piece(t), "logprob": round(lp, 6)} for t, lp in e.top]
        return {"token": e.token, "text": self._piece(e.token), "logprob": round(e.logprob, 6), "top": top}

    def _table(self, entries: list) -> str:
        rows = ["token\tlogprob\tlikeliest (token: logprob)"]
        for e in entries:
            top = "  ".join(f"{json.dumps(self._piece(t), ensure_ascii=False)}: {lp:.4f}" for t, lp in e.top)
            rows.append(f"{json.dumps(self._piece(e.token), ensure_ascii=False)}\t{e.logprob:.4f}\t{top}")
        return "\n".join(rows)


def _report(say: Reporter, result: Any, args: argparse.Namespace) -> None:
    stats = result.stats
    say.note(stats.summary())
    if stats.split:
        say.note(stats.split)
    if stats.seed is not None:
        how = f"drawn: --seed {stats.seed} repeats this run" if stats.seed_drawn else "sequence r draws with seed + r"
        say.note(f"seed {stats.seed} ({how})")
    for c in result:
        seed = f", seed {c.seed}" if c.seed is not None else ""
        stop = f" ({c.stop!r})" if c.stop is not None else ""
        say.detail(f"sequence {c.index}.{c.sample}: {len(c.tokens)} tokens, {c.finish_reason}{stop}{seed}")


def _backend_line(gen: Any) -> str:
    what = {"gpu": "the loop kernel", "cpu": "the CPU (numpy and BLAS)", "reference": "the CPU reference"}
    return f"{what[gen.backend]} ({gen.reason})"


def cmd_make_tiny_checkpoint(args: argparse.Namespace) -> int:
    from megaloop.models.tiny import make_tiny_checkpoint

    try:
        folder = make_tiny_checkpoint(args.dir, seed=args.seed, overwrite=args.force)
    except OSError as e:
        raise MegaloopError(f"cannot write the tiny checkpoint into {args.dir}: {e}") from None
    print(f"wrote a tiny random Llama checkpoint to {folder} (try: megaloop generate --model {folder} --prompt Hi)")
    return 0

"""The command ``megaloop serve`` (registered by megaloop/cli.py through ``add_serve_command``): an
OpenAI-compatible HTTP server for a checkpoint folder (megaloop/serving/server.py)."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import Any

from megaloop.errors import MegaloopError


def _at_least(low: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"expected an int >= {low}, got {text!r}")
        return value

    parse.__name__ = f"int >= {low}"
    return parse


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value


def add_serve_command(sub: Any) -> None:
    """Add ``serve`` to megaloop's argparse subparsers."""
    p = sub.add_parser(
        "serve",
        help="serve a checkpoint folder over the OpenAI HTTP API (continuous batching, paged KV)",
        description="Serve a checkpoint folder (config.json, safetensors, tokenizer.json) over the OpenAI HTTP API: "
        "/v1/completions, /v1/chat/completions (streaming as server-sent events), /v1/models, /health. Requests "
        "share one resident step over --max-slots sequence slots; more wait (up to --max-queue, then 429). "
        "Ctrl-C or SIGTERM lets the running requests finish (up to --drain-timeout s), then stops. Needs the "
        "serve extra: pip install 'megaloop[serve]'.",
    )
    p.add_argument("--model", required=True, metavar="DIR", help="the checkpoint folder")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=_at_least(0), default=8000, help="default 8000")
    p.add_argument("--served-model-name", metavar="NAME", help="the model's name in the API (default: the folder's)")
    p.add_argument("--max-slots", type=_at_least(1), default=8, metavar="N", help="requests run at once (default 8)")
    p.add_argument("--chunk", type=_at_least(1), default=32, metavar="C",
                   help="prompt tokens a slot feeds in one step at most (default 32)")  # fmt: skip
    p.add_argument("--page-size", type=_at_least(1), default=16, metavar="P", help="positions a KV page holds")
    p.add_argument("--pages", type=_at_least(1), metavar="N", help="KV pages (default: every slot can fill max-seq)")
    p.add_argument("--max-seq", type=_at_least(1), metavar="N",
                   help="the longest prompt + completion (default: the model's context, at most 2048)")  # fmt: skip
    p.add_argument("--max-queue", type=_at_least(1), default=256, metavar="N",
                   help="requests that may wait for a slot; more get 429 (default 256)")  # fmt: skip
    p.add_argument("--drain-timeout", type=_seconds, default=30.0, metavar="S",
                   help="on SIGINT/SIGTERM, how long running requests may take to finish (default 30)")  # fmt: skip
    p.add_argument("--backend", default="auto", choices=["auto", "gpu", "cpu", "reference"],
                   help="auto: a GPU if there is one; reference: the CPU reference (the definition, slow)")  # fmt: skip
    p.add_argument("--devices", type=_at_least(1), default=1, metavar="N", help="devices to split the step over")
    p.add_argument("--strategy", default="auto", choices=["auto", "tp", "pp", "dp"],
                   help="how --devices splits it (ml.parallelize; auto: the cost model picks)")  # fmt: skip
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], help="default: the checkpoint's")
    p.add_argument("--no-progress", action="store_true", help="no progress bars while loading")
    p.set_defaults(fn=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    say = lambda text: print(text, file=sys.stderr, flush=True)
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise SystemExit(
            f"megaloop serve: needs FastAPI and uvicorn ({e.name} is not installed): pip install 'megaloop[serve]'"
        ) from None
    from megaloop.serving.engine import Engine
    from megaloop.serving.server import serve

    folder = Path(args.model)
    name = args.served_model_name or folder.resolve().name
    try:
        engine = Engine(
            folder, max_slots=args.max_slots, chunk=args.chunk, page_size=args.page_size, pages=args.pages,
            max_seq=args.max_seq, backend=args.backend, max_queue=args.max_queue, dtype=args.dtype,
            progress=False if args.no_progress else None, devices=args.devices, strategy=args.strategy,
        )  # fmt: skip
    except MegaloopError as e:
        raise SystemExit(f"megaloop serve: {e}") from None
    if engine.backend_name in ("cpu", "reference"):
        why = "asked for" if engine.reason == "asked for" else f"no GPU: {engine.reason}"
        say(f"megaloop serve: running on {engine.step.description} ({why})")
    else:
        say(f"megaloop serve: running on {engine.description}")
    shape = engine.shape
    say(f"megaloop serve: {shape.slots} slots, chunks of {shape.chunk}, {shape.pages} KV pages of {shape.page_size} "
        f"positions, up to {shape.max_seq} positions a sequence, {args.max_queue} requests may wait")  # fmt: skip
    signalled = serve(engine, name, args.host, args.port, args.drain_timeout, say)
    how = f" ({signal.Signals(signalled).name}: the running requests drained)" if signalled else ""
    say(f"megaloop serve: stopped{how}")
    return 0

"""The ``megaloop`` command.

megaloop demo     build a small Llama-style transformer, run prefill + decode steps, check them
megaloop plan     plan a Llama-family model for the loop kernel and print the plan's statistics
megaloop ops      list the op set with each op's documentation
megaloop info     versions, GPUs, and which backend ``demo`` would use
"""

from __future__ import annotations

import argparse
import platform
import sys
import time

import numpy as np

import megaloop as ml
from megaloop.frontend.opdef import REGISTRY
from megaloop.models import LlamaConfig, build_llama, random_parameters
from megaloop.runtime import gpus


def _backend_line() -> str:
    found, reason = gpus()
    if found:
        names = ", ".join(f"{g.name} ({g.arch}, {g.sm_count} SMs)" for g in found)
        return f"GPUs: {names}. The loop-kernel backend is not built yet, so this run uses the CPU reference backend."
    return f"No GPU ({reason}): running on the CPU reference backend."


def cmd_demo(args: argparse.Namespace) -> int:
    cfg = LlamaConfig(
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        intermediate=args.intermediate,
        layers=args.layers,
        max_seq=args.prompt + args.decode,
        vocab=args.vocab,
        dtype=args.dtype,
    )
    print(
        f"megaloop {ml.__version__} demo: Llama-style decoder, {cfg.layers} layers, hidden {cfg.hidden}, "
        f"{cfg.heads} heads / {cfg.kv_heads} kv heads, SwiGLU {cfg.intermediate}, vocab {cfg.vocab}, {cfg.dtype.name}"
    )
    print(_backend_line())
    prefill = build_llama(cfg, args.batch, args.prompt, "prefill")
    decode = build_llama(cfg, args.batch, 1, "decode")
    if args.summary:
        print(prefill.summary())
    else:
        print(prefill.summary().splitlines()[0])
    params = random_parameters(cfg, seed=args.seed)
    rng = np.random.default_rng(args.seed)
    prompt = rng.integers(0, cfg.vocab, (args.batch, args.prompt))
    positions = np.broadcast_to(np.arange(args.prompt), (args.batch, args.prompt))

    # The same program once more in float32, as a yardstick for the chosen dtype's rounding.
    cfg32 = LlamaConfig(**{**cfg.__dict__, "dtype": ml.float32})
    graphs32 = (build_llama(cfg32, args.batch, args.prompt), build_llama(cfg32, args.batch, 1))

    t0 = time.perf_counter()
    out = ml.evaluate(prefill, {"tokens": prompt, "positions": positions}, params)
    ref = ml.evaluate(graphs32[0], {"tokens": prompt, "positions": positions}, params)
    print(f"prefill {args.batch}x{args.prompt} tokens: {1e3 * (time.perf_counter() - t0):.1f} ms (both dtypes)")
    generated = []
    state, state32 = out.state, ref.state
    token = out.outputs["logits"][:, -1].astype(np.float32).argmax(-1)
    worst = 0.0
    for step in range(args.decode):
        generated.append(token)
        pos = np.full((args.batch, 1), args.prompt + step)
        feeds = {"tokens": token[:, None], "positions": pos}
        out = ml.evaluate(decode, feeds, params, state)
        ref = ml.evaluate(graphs32[1], feeds, params, state32)
        state, state32 = out.state, ref.state
        a = out.outputs["logits"].astype(np.float64)
        b = ref.outputs["logits"].astype(np.float64)
        worst = max(worst, float(np.linalg.norm(a - b) / np.linalg.norm(b)))
        token = out.outputs["logits"][:, -1].astype(np.float32).argmax(-1)
    print(f"decoded {args.decode} tokens per sequence: {np.stack(generated, 1).tolist()}")
    print(f"{cfg.dtype.name} logits vs the float32 run of the same program: worst relative L2 error {worst:.2e}")
    limit = 50 * cfg.dtype.eps
    if not worst < limit:
        print(f"FAIL: error above {limit:.1e}")
        return 1
    print("OK")
    return 0


PRESETS = {
    "tiny": LlamaConfig(hidden=256, heads=8, kv_heads=2, intermediate=688, layers=2, vocab=1000, max_seq=512),
    "llama3.2-1b": LlamaConfig(
        hidden=2048, heads=32, kv_heads=8, intermediate=8192, layers=16, vocab=128256, rope_theta=500000.0, max_seq=4096
    ),
    "llama3-8b": LlamaConfig(
        hidden=4096,
        heads=32,
        kv_heads=8,
        intermediate=14336,
        layers=32,
        vocab=128256,
        rope_theta=500000.0,
        max_seq=4096,
    ),
}


def _tile_overrides(items: list[str]) -> dict[str, dict[str, int]]:
    """``matmul:block_m=64`` (op or node name, then parameter=value) into the planner's overrides."""
    out: dict[str, dict[str, int]] = {}
    for item in items:
        try:
            name, setting = item.rsplit(":", 1)
            key, value = setting.split("=")
            out.setdefault(name, {})[key] = int(value)
        except ValueError:
            raise SystemExit(
                f"megaloop plan: --tile {item!r}: expected NAME:PARAM=INT, e.g. matmul:block_m=64"
            ) from None
    return out


def cmd_plan(args: argparse.Namespace) -> int:
    from megaloop.plan import make_plan
    from megaloop.plan.stats import format_stats

    cfg = PRESETS[args.preset]
    t0 = time.perf_counter()
    graph = build_llama(cfg, args.batch, args.tokens, f"{args.preset}-{args.batch}x{args.tokens}")
    t1 = time.perf_counter()
    plan = make_plan(
        graph, processors=args.processors, arch=args.arch, tiles=_tile_overrides(args.tile), reuse=not args.no_reuse
    )
    t2 = time.perf_counter()
    print(
        f"{args.preset}: {cfg.layers} layers, hidden {cfg.hidden}, batch {args.batch} x {args.tokens} tokens; "
        f"graph {len(graph.nodes)} nodes built in {t1 - t0:.2f} s, planned and verified in {t2 - t1:.2f} s"
    )
    print(format_stats(plan, plan.stats()))
    if args.save:
        plan.save(args.save)
        print(f"saved {args.save}")
    return 0


def cmd_ops(args: argparse.Namespace) -> int:
    by_cat: dict[str, list[str]] = {}
    for op in REGISTRY.values():
        by_cat.setdefault(op.category, []).append(op.name)
    for cat, names in by_cat.items():
        print(f"{cat}:")
        for name in names:
            op = REGISTRY[name]
            print(f"  {name:<16} {op.doc}")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    import cuda.core
    import ml_dtypes

    print(
        f"megaloop {ml.__version__}, Python {platform.python_version()}, numpy {np.__version__}, "
        f"ml_dtypes {ml_dtypes.__version__}, cuda.core {cuda.core.__version__}"
    )
    print(f"{len(REGISTRY)} ops registered")
    print(_backend_line())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megaloop", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="build and run a small Llama-style transformer")
    demo.add_argument("--hidden", type=int, default=256)
    demo.add_argument("--heads", type=int, default=8)
    demo.add_argument("--kv-heads", type=int, default=2)
    demo.add_argument("--intermediate", type=int, default=688)
    demo.add_argument("--layers", type=int, default=2)
    demo.add_argument("--vocab", type=int, default=1000)
    demo.add_argument("--batch", type=int, default=2)
    demo.add_argument("--prompt", type=int, default=16, help="prompt tokens per sequence")
    demo.add_argument("--decode", type=int, default=8, help="tokens to generate")
    demo.add_argument("--dtype", default="bfloat16", choices=[d.name for d in ml.FLOAT_DTYPES])
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--summary", action="store_true", help="print the whole graph")
    demo.set_defaults(fn=cmd_demo)
    plan = sub.add_parser("plan", help="plan a Llama-family model and print statistics")
    plan.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    plan.add_argument("--batch", type=int, default=1)
    plan.add_argument("--tokens", type=int, default=1, help="tokens per sequence in one step (1: decode)")
    plan.add_argument("--processors", type=int, default=132, help="thread blocks (132 SMs on an H200)")
    plan.add_argument("--arch", default="sm_90", choices=["sm_80", "sm_86", "sm_89", "sm_90"])
    plan.add_argument(
        "--tile",
        action="append",
        default=[],
        metavar="NAME:PARAM=INT",
        help="override a tile parameter, e.g. matmul:block_m=64 (repeatable)",
    )
    plan.add_argument("--no-reuse", action="store_true", help="give every intermediate its own memory")
    plan.add_argument("--save", metavar="PLAN.json", help="write the plan as JSON")
    plan.set_defaults(fn=cmd_plan)
    sub.add_parser("ops", help="list the op set").set_defaults(fn=cmd_ops)
    sub.add_parser("info", help="versions and GPUs").set_defaults(fn=cmd_info)
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except ml.MegaloopError as e:
        print(f"megaloop: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

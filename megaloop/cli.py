"""The ``megaloop`` command.

megaloop demo     build a small Llama-style transformer, run prefill + decode steps, check them
megaloop plan     plan a Llama-family model for the loop kernel and print the plan's statistics
megaloop profile  per-task timeline of a model's loop kernel: Chrome trace JSON, PNG, summary by op
megaloop ops      list the op set with each op's documentation
megaloop info     versions, GPUs, and which backend ``demo`` would use
megaloop generate              text from a Hugging Face checkpoint folder (megaloop/generation/commands.py)
megaloop make-tiny-checkpoint  a small random Llama with a real tokenizer, to try generate on
megaloop cache info|clear      the compiled-kernel and plan cache (megaloop/cli_cache.py)
megaloop serve                 the OpenAI HTTP API for a checkpoint folder (megaloop/serving/commands.py)
megaloop train                 fine-tune a checkpoint folder on text files (megaloop/training/commands.py)
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import threading
import time
from pathlib import Path

import numpy as np

import megaloop as ml
from megaloop.argtypes import at_least
from megaloop.cli_cache import add_cache_command
from megaloop.errors import MegaloopError, UsageError
from megaloop.frontend.opdef import REGISTRY
from megaloop.generation.commands import add_commands
from megaloop.models import LlamaConfig, build_llama, build_llama_generator, random_parameters
from megaloop.runtime import gpus
from megaloop.serving.commands import add_serve_command
from megaloop.training.commands import add_train_command

COUNT = at_least(1)


def _writable_file(command: str, path: Path, force: bool) -> None:
    """Refuse, before any work, a file that cannot be written or would replace one unasked."""
    if not path.parent.is_dir():
        raise UsageError(f"megaloop {command}: cannot write {path}: the folder {path.parent} does not exist")
    if path.is_dir():
        raise UsageError(f"megaloop {command}: {path} is a folder; give a file name")
    if path.exists() and not force:
        raise UsageError(f"megaloop {command}: {path} exists; pass --force to replace it")


class _CpuSteps:
    """Prefill, then decode steps, on the CPU reference (the KV cache carried between graphs)."""

    def __init__(self, prefill: ml.Graph, decode: ml.Graph, params: dict) -> None:
        self.graphs, self.params, self.state = (prefill, decode), params, None

    def step(self, which: int, feeds: dict) -> np.ndarray:
        out = ml.evaluate(self.graphs[which], feeds, self.params, self.state)
        self.state = out.state
        return out.outputs["logits"]

    def snapshot(self) -> dict:
        return dict(self.state)

    def generate(self, graph: ml.Graph, start: dict, n: int) -> dict:
        return ml.evaluate(graph, {}, self.params, start, iterations=n).state

    def close(self) -> None:
        pass


class _GpuSteps:
    """The same on the GPU: one resident loop kernel per graph; the prefill kernel's KV cache is
    handed to the decode kernel, which then runs one iteration per generated token."""

    def __init__(self, prefill: ml.Graph, decode: ml.Graph, params: dict, gpu) -> None:
        from megaloop.codegen import generate
        from megaloop.plan import make_plan
        from megaloop.runtime.compile import compile_many

        t0 = time.perf_counter()
        self.plans = [make_plan(g, processors=gpu.sm_count, arch=gpu.plan_arch) for g in (prefill, decode)]
        t1 = time.perf_counter()
        self.programs = [generate(p) for p in self.plans]
        compile_many([p.source for p in self.programs], gpu.arch)  # both at once (cached on disk)
        print(
            f"planned both graphs for {gpu.sm_count} processors in {t1 - t0:.1f} s, compiled their loop kernels "
            f"in {time.perf_counter() - t1:.1f} s"
        )
        self.params, self.kernel, self.which, self.gpu = params, None, -1, gpu

    def step(self, which: int, feeds: dict) -> np.ndarray:
        from megaloop.runtime.loop import LoopKernel

        if which != self.which:  # switch kernels: the cache moves over
            state = None
            if self.kernel is not None:
                state = self.kernel.state()
                self.kernel.stop()
            self.kernel, self.which = (
                LoopKernel(self.plans[which], self.params, state, program=self.programs[which]),
                which,
            )
        return self.kernel.run(feeds)["logits"]

    def snapshot(self) -> dict:
        return self.kernel.state()

    def generate(self, graph: ml.Graph, start: dict, n: int) -> dict:
        """All n tokens in one run: the loop kernel feeds itself (no host work between tokens)."""
        from megaloop.plan import make_plan
        from megaloop.runtime.loop import LoopKernel

        if self.kernel is not None:
            self.kernel.stop()
            self.kernel, self.which = None, -1
        plan = make_plan(graph, processors=self.gpu.sm_count, arch=self.gpu.plan_arch)
        with LoopKernel(plan, self.params, start) as k:
            k.run(iterations=1)  # compile and warm up; then again from the start, timed
            k.set_state(start)
            t0 = time.perf_counter()
            k.run(iterations=n)
            self.generate_seconds = time.perf_counter() - t0
            return k.state()

    def close(self) -> None:
        if self.kernel is not None:
            self.kernel.stop()


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
    found, reason = gpus()
    if args.backend == "gpu" and not found:
        print(f"megaloop demo: --backend gpu, but there is no GPU ({reason})", file=sys.stderr)
        return 2
    on_gpu = bool(found) and args.backend != "cpu"
    if on_gpu:
        print(f"GPU: {found[0].name} ({found[0].arch}, {found[0].sm_count} SMs): running on the loop kernel")
    else:
        print(f"running on the CPU reference backend ({reason or 'asked for'})")
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

    # The same program in float32 on the CPU reference, as a yardstick for the chosen dtype's rounding
    # (and, on a GPU, for the loop kernel).
    cfg32 = LlamaConfig(**{**cfg.__dict__, "dtype": ml.float32})
    yardstick = _CpuSteps(build_llama(cfg32, args.batch, args.prompt), build_llama(cfg32, args.batch, 1), params)
    if not on_gpu:
        return _demo_run(args, cfg, _CpuSteps(prefill, decode, params), yardstick, prompt, positions)
    try:
        return _demo_run(args, cfg, _GpuSteps(prefill, decode, params, found[0]), yardstick, prompt, positions)
    except MegaloopError as e:
        if args.backend == "gpu":
            raise
        # the newcomer's first command must work: say what failed, then show the CPU reference run
        print(f"the loop kernel failed ({type(e).__name__}: {e}); running on the CPU reference instead")
        yardstick = _CpuSteps(build_llama(cfg32, args.batch, args.prompt), build_llama(cfg32, args.batch, 1), params)
        return _demo_run(args, cfg, _CpuSteps(prefill, decode, params), yardstick, prompt, positions)


def _demo_run(args, cfg: LlamaConfig, steps, yardstick, prompt: np.ndarray, positions: np.ndarray) -> int:
    """Prefill, host-driven decode steps checked against the float32 yardstick, then the same tokens
    from the self-feeding generator in one run."""
    try:
        t0 = time.perf_counter()
        feeds = {"tokens": prompt, "positions": positions}
        logits = steps.step(0, feeds)
        after_prefill = steps.snapshot()
        t1 = time.perf_counter()
        worst = _relative_error(logits, yardstick.step(0, feeds))
        print(f"prefill {args.batch}x{args.prompt} tokens: {1e3 * (t1 - t0):.1f} ms (first run includes compiling)")
        generated = []
        token = logits[:, -1].astype(np.float32).argmax(-1)
        t0 = time.perf_counter()
        for step in range(args.decode):
            generated.append(token)
            feeds = {"tokens": token[:, None], "positions": np.full((args.batch, 1), args.prompt + step)}
            logits = steps.step(1, feeds)
            worst = max(worst, _relative_error(logits, yardstick.step(1, feeds)))
            token = logits[:, -1].astype(np.float32).argmax(-1)
        print(f"decoded {args.decode} tokens per sequence in {time.perf_counter() - t0:.2f} s (with the yardstick)")
        print(f"  {np.stack(generated, 1).tolist()}")
        # the same tokens again, the model feeding itself: one run of `decode` loop iterations
        first = generated[0][:, None]
        start = {**after_prefill, "token": first, "position": np.full((args.batch, 1), args.prompt)}
        looped = steps.generate(build_llama_generator(cfg, args.batch), start, args.decode)
        again = looped["generated"][:, 0, args.prompt : args.prompt + args.decode, 0].astype(np.int64)
        same = np.array_equal(again, np.stack(generated, 1))
        took = getattr(steps, "generate_seconds", None)
        print(
            f"self-feeding loop ({args.decode} iterations in one run"
            + (f", {1e6 * took / args.decode:.0f} us per token" if took else "")
            + f"): {'the same tokens' if same else 'DIFFERENT tokens: ' + str(again.tolist())}"
        )
    finally:
        steps.close()
    if not same:
        print("FAIL: the self-feeding loop chose other tokens than the host-driven steps")
        return 1
    print(f"{cfg.dtype.name} logits vs the float32 CPU run of the same program: worst relative L2 error {worst:.2e}")
    limit = 50 * cfg.dtype.eps
    if not worst < limit:
        print(f"FAIL: error above {limit:.1e}")
        return 1
    print("OK")
    return 0


def _relative_error(got: np.ndarray, ref: np.ndarray) -> float:
    a, b = got.astype(np.float64), ref.astype(np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


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


def _tile_overrides(items: list[str], command: str = "plan") -> dict[str, dict[str, int]]:
    """``matmul:block_m=64`` (op or node name, then parameter=value) into the planner's overrides."""
    out: dict[str, dict[str, int]] = {}
    for item in items:
        try:
            name, setting = item.rsplit(":", 1)
            key, value = setting.split("=")
            out.setdefault(name, {})[key] = int(value)
        except ValueError:
            raise UsageError(
                f"megaloop {command}: --tile {item!r}: expected NAME:PARAM=INT, e.g. matmul:block_m=64"
            ) from None
    return out


def _fusion(text: str, command: str) -> ml.FuseOptions:
    """--fusion's rules (docs/fuse.md), or an exit naming the option."""
    try:
        return ml.FuseOptions.parse(text)
    except ml.MegaloopError as e:
        raise SystemExit(f"megaloop {command}: --fusion {text!r}: {e}") from None


def cmd_plan(args: argparse.Namespace) -> int:
    from megaloop.codegen.dump import check_folder, dump
    from megaloop.plan import make_plan
    from megaloop.plan.stats import format_stats

    cfg = PRESETS[args.preset]
    if args.save:
        _writable_file("plan", Path(args.save), args.force)
    if args.dump:
        check_folder(args.dump, args.force)
    fusion = _fusion(args.fusion, "plan")
    print(f"megaloop plan: planning {args.preset} (Ctrl-C stops)", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    graph = build_llama(cfg, args.batch, args.tokens, f"{args.preset}-{args.batch}x{args.tokens}")
    t1 = time.perf_counter()
    graphs = graph
    if args.devices is not None or args.mesh is not None:
        from megaloop.cli_parallel import partition_for_cli

        graphs = partition_for_cli(graph, args, fusion)
        t1 = time.perf_counter()
    tiles = _tile_overrides(args.tile)
    plan = make_plan(
        graphs, processors=args.processors, arch=args.arch, tiles=tiles, reuse=not args.no_reuse, fusion=fusion
    )
    t2 = time.perf_counter()
    print(
        f"{args.preset}: {cfg.layers} layers, hidden {cfg.hidden}, batch {args.batch} x {args.tokens} tokens; "
        f"graph {len(graph.nodes)} nodes built in {t1 - t0:.2f} s, planned and verified in {t2 - t1:.2f} s"
        + (f" ({plan.world_size} ranks)" if plan.world_size > 1 else "")
    )
    print(format_stats(plan, plan.stats()))
    if args.save:
        plan.save(args.save, overwrite=args.force)
        print(f"saved {args.save}")
    if args.dump:
        print("dumped " + ", ".join(str(p) for p in dump(plan, args.dump, force=args.force)))
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


def cmd_profile(args: argparse.Namespace) -> int:
    from megaloop.plan import make_plan
    from megaloop.runtime import trace

    cfg = PRESETS[args.preset]
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"megaloop profile: --out {out} is a file; give a folder for trace.json and timeline.png")
    for name in ("trace.json", "timeline.png"):
        if (out / name).exists() and not args.force:
            raise UsageError(f"megaloop profile: {out / name} exists; pass --force to replace it, or another --out")
    found, reason = gpus()
    on_gpu = bool(found) and not args.estimate
    processors = args.processors or (found[0].sm_count if found else 132)
    arch = found[0].plan_arch if found else "sm_90"
    graph = build_llama(cfg, args.batch, args.tokens, f"{args.preset}-{args.batch}x{args.tokens}")
    t0 = time.perf_counter()
    tiles, fusion = _tile_overrides(args.tile, "profile"), _fusion(args.fusion, "profile")
    plan = make_plan(graph, processors=processors, arch=arch, tiles=tiles, fusion=fusion)
    print(
        f"{args.preset}: planned {len(plan.ranks[0].tasks)} tasks on {processors} processors in "
        f"{time.perf_counter() - t0:.1f} s"
    )
    if on_gpu:
        from megaloop.runtime.loop import LoopKernel

        rng = np.random.default_rng(0)
        feeds = {
            "tokens": rng.integers(0, cfg.vocab, (args.batch, args.tokens)),
            "positions": np.broadcast_to(np.arange(args.tokens), (args.batch, args.tokens)),
        }
        with LoopKernel(plan, random_parameters(cfg, seed=0), profile_iterations=args.iterations) as k:
            k.run(feeds, iterations=args.iterations)
            stamps = k.profile_ns()
        tl = trace.measured_timeline(plan, stamps, f"measured on {found[0].name}")
    else:
        if not found:
            print(f"no GPU ({reason}): showing the cost model's estimate, not a measurement")
        tl = trace.estimated_timeline(plan, iterations=args.iterations)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"megaloop profile: cannot make the folder {out} for the results: {e}") from None
    print(trace.format_summary(tl))
    print(trace.format_critical_path(tl))
    print(f"wrote {trace.save_chrome_trace(tl, out / 'trace.json')} (open in https://ui.perfetto.dev)")
    try:
        print(f"wrote {trace.save_png(tl, out / 'timeline.png')}")
    except trace.TraceError as e:
        print(f"no PNG: {e}")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    import cuda.core
    import ml_dtypes

    print(
        f"megaloop {ml.__version__}, Python {platform.python_version()}, numpy {np.__version__}, "
        f"ml_dtypes {ml_dtypes.__version__}, cuda.core {cuda.core.__version__}"
    )
    print(f"{len(REGISTRY)} ops registered")
    found, reason = gpus()
    if found:
        names = ", ".join(f"{g.name} ({g.arch}, {g.sm_count} SMs)" for g in found)
        print(f"GPUs: {names}; demo and profile run on the loop kernel")
    else:
        print(f"No GPU ({reason}): demo runs on the CPU reference backend, profile shows estimates")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megaloop", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"megaloop {ml.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="build and run a small Llama-style transformer")
    demo.add_argument("--hidden", type=COUNT, default=256)
    demo.add_argument("--heads", type=COUNT, default=8)
    demo.add_argument("--kv-heads", type=COUNT, default=2)
    demo.add_argument("--intermediate", type=COUNT, default=688)
    demo.add_argument("--layers", type=COUNT, default=2)
    demo.add_argument("--vocab", type=COUNT, default=1000)
    demo.add_argument("--batch", type=COUNT, default=2)
    demo.add_argument("--prompt", type=COUNT, default=16, help="prompt tokens per sequence")
    demo.add_argument("--decode", type=COUNT, default=8, help="tokens to generate")
    demo.add_argument("--dtype", default="bfloat16", choices=[d.name for d in ml.FLOAT_DTYPES])
    demo.add_argument("--seed", type=at_least(0), default=0)
    demo.add_argument("--summary", action="store_true", help="print the whole graph")
    demo.add_argument(
        "--backend", default="auto", choices=["auto", "gpu", "cpu"], help="auto: the loop kernel when there is a GPU"
    )
    demo.set_defaults(fn=cmd_demo)
    plan = sub.add_parser("plan", help="plan a Llama-family model and print statistics")
    plan.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    plan.add_argument("--batch", type=COUNT, default=1)
    plan.add_argument("--tokens", type=COUNT, default=1, help="tokens per sequence in one step (1: decode)")
    plan.add_argument("--processors", type=COUNT, default=132, help="thread blocks (132 SMs on an H200)")
    plan.add_argument("--arch", default="sm_90", choices=["sm_80", "sm_86", "sm_89", "sm_90"])
    plan.add_argument(
        "--tile",
        action="append",
        default=[],
        metavar="NAME:PARAM=INT",
        help="override a tile parameter, e.g. matmul:block_m=64 (repeatable)",
    )
    fusion_help = "graph rewrites (docs/fuse.md): all, none, -RULE,+RULE,... (the default ones less, more) or RULE,..."
    plan.add_argument("--fusion", default="all", metavar="RULES", help=fusion_help)
    plan.add_argument("--no-reuse", action="store_true", help="give every intermediate its own memory")
    plan.add_argument("--devices", type=COUNT, help="split the model over this many GPUs (ml.parallelize)")
    plan.add_argument("--mesh", metavar="AxB", help="a device mesh, e.g. 2x8: two nodes of eight GPUs")
    plan.add_argument(
        "--strategy", default="auto", help="auto, tp, pp, dp, device, or a kind per mesh axis: node=pp,gpu=tp"
    )
    plan.add_argument("--save", metavar="PLAN.json", help="write the plan as JSON")
    plan.add_argument(
        "--dump", metavar="DIR", help="write each rank's kernel source and task table (op, node, tile) there"
    )
    plan.add_argument("--force", action="store_true", help="replace the --save file or --dump files if they exist")
    plan.set_defaults(fn=cmd_plan)
    profile = sub.add_parser("profile", help="per-task timeline of a model's loop kernel (trace JSON + PNG)")
    profile.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    profile.add_argument("--batch", type=COUNT, default=1)
    profile.add_argument("--tokens", type=COUNT, default=1, help="tokens per sequence in one step (1: decode)")
    profile.add_argument(
        "--processors", type=COUNT, default=None, help="thread blocks (default: the GPU's SMs, or 132)"
    )
    profile.add_argument("--iterations", type=COUNT, default=3, help="iterations to record")
    profile.add_argument("--tile", action="append", default=[], metavar="NAME:PARAM=INT", help="as for plan")
    profile.add_argument("--fusion", default="all", metavar="RULES", help="as for plan")
    profile.add_argument("--estimate", action="store_true", help="the cost model's timeline even with a GPU")
    profile.add_argument("--out", default="megaloop-profile", help="folder for trace.json and timeline.png")
    profile.add_argument("--force", action="store_true", help="replace trace.json and timeline.png in --out")
    profile.set_defaults(fn=cmd_profile)
    sub.add_parser("ops", help="list the op set").set_defaults(fn=cmd_ops)
    sub.add_parser("info", help="versions and GPUs").set_defaults(fn=cmd_info)
    add_commands(sub)
    add_cache_command(sub)
    add_serve_command(sub)
    add_train_command(sub)
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except KeyboardInterrupt:  # Ctrl-C: at once, no traceback (generate prints what it had itself)
        return _interrupted(args.command, argv is None)
    except UsageError as e:
        print(e, file=sys.stderr)
        return 2
    except ml.MegaloopError as e:
        print(f"megaloop: {type(e).__name__}: {e}", file=sys.stderr)
        return 2 if _is_usage(e) else 1
    except BrokenPipeError:  # stdout closed early (megaloop ops | head): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush at exit
        return 1


def _is_usage(e: MegaloopError) -> bool:
    """Whether what the user asked for cannot be done as written (exit status 2: arguments, the files
    and folders named); any other megaloop error is a failure while running (1: the loop kernel, a
    compile, a data error, a plan that would race)."""
    from megaloop.codegen.dump import DumpError
    from megaloop.generation.settings import GenerationError
    from megaloop.models.tokenizer import ChatTemplateError
    from megaloop.runtime.trace import TraceError

    usage = (ml.errors.GraphBuildError, ml.errors.CheckpointError, ml.errors.EvaluationError, ml.errors.PlanFormatError)
    usage += (ml.errors.CacheError,)  # the cache's location or cap as the user set them
    return isinstance(e, (*usage, UsageError, GenerationError, ChatTemplateError, DumpError, TraceError))

INTERRUPTED = 130  # 128 + SIGINT, as shells report a command Ctrl-C stopped


def _interrupted(command: str, whole_process: bool) -> int:
    """The exit status of a Ctrl-C; as the process's own command, threads still compiling are not
    waited for."""
    sys.stdout.flush()
    print(f"\nmegaloop {command}: interrupted", file=sys.stderr, flush=True)
    if whole_process and any(t.is_alive() and not t.daemon for t in threading.enumerate()[1:]):
        os._exit(INTERRUPTED)
    return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())

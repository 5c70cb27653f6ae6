"""Serving a Llama-3.2-1B-shaped checkpoint with megaloop.Engine on the loop kernel, against
``Generator.generate`` on static batches in the same run: throughput, time to first token (TTFT) and
time per output token (TPOT), p50 and p99, for 1, 8 and 32 concurrent clients.

    python -m bench.serve                                  # ~5 min on an H200 (cold plan and compile)
    python -m bench.serve --clients 1 8 --requests 4 --dir /tmp/ckpt

Each client sends ``--requests`` requests one after another (a prompt of --prompt tokens, then
--new-tokens tokens, greedy; no end-of-sequence id, so that every request makes them all): TTFT
is the submit to the first token, TPOT the time from the first token to the last over
the tokens after the first, throughput all clients' tokens over the wall time. The Generator runs
the same prompts as static batches of the clients' count (its prefill for TTFT, its ms/token for
TPOT). The engine runs twice: with --slots slots (the serving configuration) and, for the batch-1
figure, with one slot (its step has --chunk rows, the Generator's decode one). The Generator runs
first: two loop kernels cannot be resident together on one GPU. Results: bench/results/serve.json.
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

import numpy as np

from bench.common import write
from bench.generate_checkpoint import PROMPT, make_checkpoint


def percentiles(values: list[float]) -> dict[str, float]:
    a = np.asarray(values, np.float64) * 1e3
    return {"p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99)), "mean_ms": float(a.mean())}


def prompt_ids(gen, tokens: int, index: int) -> list[int]:
    """A prompt of ``tokens`` ids (the tiny tokenizer's text, repeated), its first id varied a client."""
    ids = gen.tokenizer.encode(PROMPT * (1 + tokens // 20))[:tokens]
    ids[1] = 100 + index % 300
    return ids


def run_engine(engine, gen, clients: int, requests: int, prompt: int, new: int) -> dict:
    ttft, tpot, made = [], [], []
    errors: list[BaseException] = []

    def client(c: int) -> None:
        try:
            for r in range(requests):
                ids = prompt_ids(gen, prompt, c * requests + r)
                t0 = time.perf_counter()
                req = engine.submit(ids, max_tokens=new, temperature=0.0)
                first = last = None
                for delta in req:
                    now = time.perf_counter()
                    if delta.tokens and first is None:
                        first = now
                    last = now
                count = len(req.result().tokens)
                ttft.append(first - t0)
                if count > 1:
                    tpot.append((last - first) / (count - 1))
                made.append(count)
        except BaseException as e:  # (reported by the main thread)
            errors.append(e)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return {
        "clients": clients,
        "requests": clients * requests,
        "tokens": int(sum(made)),
        "wall_s": wall,
        "tokens_per_s": sum(made) / wall,
        "ttft": percentiles(ttft),
        "tpot": percentiles(tpot),
        "steps": engine.steps,
    }


def run_generator(gen, clients: int, requests: int, prompt: int, new: int) -> dict:
    """Static batches of ``clients`` prompts, ``requests`` of them."""
    ttft, tpot, made, wall = [], [], 0, 0.0
    for r in range(requests):
        batch = [prompt_ids(gen, prompt, c * requests + r) for c in range(clients)]
        t0 = time.perf_counter()
        out = gen.generate(batch, max_new_tokens=new)
        wall += time.perf_counter() - t0
        ttft.append(out.stats.prefill_s)
        if out.stats.per_token_s:
            tpot.append(out.stats.per_token_s)
        made += sum(len(c.tokens) for c in out)
    return {"clients": clients, "requests": clients * requests, "tokens": made, "wall_s": wall,
            "tokens_per_s": made / wall, "ttft": percentiles(ttft), "tpot": percentiles(tpot)}  # fmt: skip


def main() -> None:
    import megaloop as ml
    from megaloop.serving.engine import Engine

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/megaloop-checkpoints/1b"))
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--requests", type=int, default=3, help="requests a client sends, one after another")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=32)
    ap.add_argument("--max-seq", type=int, default=512)
    args = ap.parse_args()
    folder = make_checkpoint("1b", args.dir)
    # the random model's end-of-sequence id never ends a request early: every one makes new_tokens tokens
    gen = ml.Generator(folder, backend="gpu", max_seq=args.max_seq, eos_token_ids=[])
    gen.generate(prompt_ids(gen, args.prompt, 0), max_new_tokens=4)  # plans and kernels into the caches
    generator = {str(c): run_generator(gen, c, args.requests, args.prompt, args.new_tokens) for c in args.clients}
    results: dict = {"shape": "Llama-3.2-1B", "prompt_tokens": args.prompt, "new_tokens": args.new_tokens,
                     "generator_static_batches": generator}  # fmt: skip
    for name, slots in (("engine", args.slots), ("engine_one_slot", 1)):
        t0 = time.perf_counter()
        engine = Engine(gen, backend="gpu", max_slots=slots, chunk=args.chunk, max_seq=args.max_seq)
        setup = time.perf_counter() - t0
        engine.generate([prompt_ids(gen, args.prompt, 0)], max_tokens=4)  # warm
        runs = {}
        for c in args.clients if slots > 1 else [1]:
            runs[str(c)] = run_engine(engine, gen, c, args.requests, args.prompt, args.new_tokens)
            print(name, c, runs[str(c)], flush=True)
        results[name] = {"slots": slots, "chunk": args.chunk, "rows_a_step": engine.shape.rows, "setup_s": setup,
                         "device": engine.description, "runs": runs}  # fmt: skip
        engine.close()
    one = results["engine_one_slot"]["runs"]["1"]["tpot"]["p50_ms"]
    results["batch1_tpot_vs_generator"] = one / generator["1"]["tpot"]["p50_ms"] if "1" in generator else None
    write("serve", results)


if __name__ == "__main__":
    main()

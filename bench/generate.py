"""End-to-end greedy generation with a Llama-3.2-1B-shaped model (random weights, bf16, batch 1):
a 128-token prompt, then 128 new tokens. megaloop: the prefill kernel, then the self-feeding
generator (megaloop.models.build_llama_generator), all 128 tokens in ONE run of the resident loop
kernel; then the same with sampling (ml.sample in the generator's ranges of the vocabulary; SAMPLING's
variants). PyTorch: the same model, one decode step per token, eager, its kernels captured in a CUDA graph
(cuBLAS products, no compiler), and torch.compile mode="reduce-overhead" at the same context length;
and transformers' own generate with a static cache and the compiled forward, the same weights.
Per-token latency, same run."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import numpy as np
import torch
import torch.nn.functional as F

from bench.common import cuda_graph, resident_seconds, time_torch, write
from megaloop.cli import PRESETS
from megaloop.models import build_llama, build_llama_generator, random_parameters
from megaloop.models.llama import auto_kv_splits
from megaloop.plan import FuseOptions, KernelOptions, make_plan
from megaloop.runtime.loop import LoopKernel

PROMPT, NEW = 128, 128
# sampling variants (one plan: the parameters are states): a random-weight model's logits are nearly
# flat, so top-p alone keeps most of the vocabulary and the combine computes each row whole (its slow
# path), while temperature alone, or top-k before top-p, are settled by the ranges' candidates
SAMPLING = {
    "temperature": {"temperature": 0.7, "top_k": 0, "top_p": 1.0},
    "top_k_top_p": {"temperature": 0.7, "top_k": 50, "top_p": 0.9},
    "top_p": {"temperature": 0.7, "top_k": 0, "top_p": 0.9},
}
KV_SPLITS = os.environ.get("GENERATE_KV_SPLITS", "auto")  # a number, "auto" or "none"
# --compare-loader: the weight ring's loader warp in order (1) and oldest free slot first (2), at caps of
# 32 / 48 / 64 KB in flight, with 12 slots, then the default again (its drift within the run);
# KernelOptions as JSON, as --compare-options
LOADER_COMPARE = (
    '{"weight_ring_loader": 1}',
    '{"weight_ring_loader": 2, "weight_ring_loader_bytes": 32768}',
    '{"weight_ring_loader": 2}',
    '{"weight_ring_loader": 2, "weight_ring_loader_bytes": 65536}',
    '{"weight_ring_loader": 2, "weight_ring_slots": 12}',
    "{}",
)

# --compare-lanes: the decode attention tile of lanes over keys (KernelOptions.decode_attention), then the
# default again (its drift within the run); KernelOptions as JSON, as --compare-options
LANES_COMPARE = ('{"decode_attention": 1}', "{}")


def _splits() -> int | str | None:
    return None if KV_SPLITS == "none" else KV_SPLITS if KV_SPLITS == "auto" else int(KV_SPLITS)


class TorchModel(torch.nn.Module):
    """The same weights and math as megaloop's graph, a static KV cache, one decode step."""

    def __init__(self, cfg, params: dict) -> None:
        super().__init__()
        self.cfg = cfg
        self.p = {k: torch.tensor(v, dtype=torch.bfloat16, device="cuda") for k, v in params.items()}
        shape = (cfg.layers, 1, cfg.kv_heads, cfg.max_seq, cfg.head_dim)
        self.k = torch.randn(shape, dtype=torch.bfloat16, device="cuda") * 0.1
        self.v = torch.randn(shape, dtype=torch.bfloat16, device="cuda") * 0.1
        hd = cfg.head_dim
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64, device="cuda") / hd))
        ang = torch.arange(cfg.max_seq, device="cuda", dtype=torch.float64)[:, None] * inv
        self.cos = torch.cat([ang, ang], -1).cos().to(torch.bfloat16)
        self.sin = torch.cat([ang, ang], -1).sin().to(torch.bfloat16)

    def forward(self, token: torch.Tensor, pos: int) -> torch.Tensor:
        """The next token after ``token`` at ``pos`` (one decode step)."""
        return self.logits(token, pos).argmax(-1)

    def logits(self, token: torch.Tensor, pos: int) -> torch.Tensor:
        """Every position's logits for ``token`` [T] at positions pos..pos+T-1 (T > 1 from position 0:
        a prefill, causal over the prompt)."""
        cfg, p, hd = self.cfg, self.p, self.cfg.head_dim
        t = token.shape[0]
        x = p["model.embed_tokens.weight"][token][None]  # [1, t, hidden]
        cos, sin = self.cos[pos : pos + t], self.sin[pos : pos + t]

        def rot(z):
            return z * cos + torch.cat([-z[..., hd // 2 :], z[..., : hd // 2]], -1) * sin

        for i in range(cfg.layers):
            w = lambda n, i=i: p[f"model.layers.{i}.{n}"]
            h = F.rms_norm(x, (cfg.hidden,), w("input_layernorm.weight"), cfg.rms_eps)
            q = rot((h @ w("self_attn.q_proj.weight").T).view(1, t, cfg.heads, hd).transpose(1, 2))
            k = rot((h @ w("self_attn.k_proj.weight").T).view(1, t, cfg.kv_heads, hd).transpose(1, 2))
            v = (h @ w("self_attn.v_proj.weight").T).view(1, t, cfg.kv_heads, hd).transpose(1, 2)
            self.k[i, :, :, pos : pos + t] = k
            self.v[i, :, :, pos : pos + t] = v
            o = F.scaled_dot_product_attention(
                q, self.k[i, :, :, : pos + t], self.v[i, :, :, : pos + t], enable_gqa=True, is_causal=t > 1
            )
            x = x + o.transpose(1, 2).reshape(1, t, -1) @ w("self_attn.o_proj.weight").T
            h = F.rms_norm(x, (cfg.hidden,), w("post_attention_layernorm.weight"), cfg.rms_eps)
            gate, up = h @ w("mlp.gate_proj.weight").T, h @ w("mlp.up_proj.weight").T
            x = x + (F.silu(gate) * up) @ w("mlp.down_proj.weight").T
        x = F.rms_norm(x, (cfg.hidden,), p["model.norm.weight"], cfg.rms_eps)
        return x @ p["lm_head.weight"].T


def torch_side(cfg, params: dict, compile_step: bool = True) -> dict:
    model = TorchModel(cfg, params)
    token = torch.tensor([5], device="cuda")
    with torch.no_grad():
        eager = time_torch(lambda: model(token, PROMPT)) * 1e6
        # the best launch-based pipeline without a compiler: the eager step's kernels (cuBLAS products)
        # captured once in a CUDA graph and replayed, one step a replay
        replayed = time_torch(cuda_graph(lambda: model(token, PROMPT)).replay, warmup=5, repeat=50) * 1e6
        graphed = float("nan")
        if compile_step:
            compiled = torch.compile(lambda: model(token, PROMPT), mode="reduce-overhead")
            graphed = time_torch(compiled, warmup=5, repeat=30) * 1e6
        prompt = torch.randint(0, cfg.vocab, (PROMPT,), device="cuda")  # the prefill, every position's logits
        prefill = time_torch(lambda: model.logits(prompt, 0)) * 1e3
    return {
        "torch_eager_us_per_token": eager,
        "torch_cuda_graph_us_per_token": replayed,
        "torch_compile_us_per_token": graphed,
        "torch_eager_prefill_ms": prefill,
    }


def transformers_side(cfg, params: dict) -> dict:
    """transformers' greedy generate with a static cache, which generate compiles itself (its
    documented fast path; a forward compiled by hand kept CUDA-graph outputs past their replay), the
    same weights: (time for NEW tokens - time for 1) / (NEW - 1), medians of 3 after 2 warm-ups."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_eps, rope_theta=cfg.rope_theta,
        max_position_embeddings=PROMPT + NEW, tie_word_embeddings=False, dtype="bfloat16",
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    missing, unexpected = model.load_state_dict({k: torch.tensor(v, dtype=torch.bfloat16) for k, v in params.items()})
    assert not unexpected and not missing, (missing, unexpected)
    model.generation_config.cache_implementation = "static"
    ids = torch.randint(0, cfg.vocab, (1, PROMPT), device="cuda")
    mask = torch.ones_like(ids)

    def seconds(n: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    with torch.no_grad():
        for _ in range(2):
            seconds(NEW)
        full, one = np.median([seconds(NEW) for _ in range(3)]), np.median([seconds(1) for _ in range(3)])
    return {
        "transformers_version": transformers.__version__,
        "transformers_compiled": bool(getattr(model, "_compiled_call", None)),
        "transformers_static_compiled_us_per_token": float((full - one) / (NEW - 1) * 1e6),
    }


SHAPES = {"1b": ("llama3.2-1b", "generate"), "8b": ("llama3-8b", "generate_8b")}  # preset, result name


def _greedy(plan, params: dict, start: dict) -> tuple[float, np.ndarray]:
    """Seconds for NEW greedy tokens from ``start`` (after one warm-up step), and the tokens."""
    with LoopKernel(plan, params, start) as k:
        k.run(iterations=1)
        k.set_state(start)
        t0 = time.perf_counter()
        k.run(iterations=NEW)
        seconds = time.perf_counter() - t0
        return seconds, k.state()["generated"][0, 0, PROMPT : PROMPT + NEW, 0].astype(np.int64)


def _prefill_plan(cfg, fusion: FuseOptions):
    """The prompt's step (every position's logits) as bench/generate times it."""
    graph = build_llama(cfg, 1, PROMPT)
    return make_plan(graph, processors=132, tiles={"matmul": {"tensor_cores": 1}}, fusion=fusion)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    ap.add_argument("--skip-transformers", action="store_true", help="no transformers generate (minutes of compile)")
    ap.add_argument("--skip-torch-compile", action="store_true", help="no torch.compile step (a minute of compile)")
    ap.add_argument("--options", default="{}", help="the generator plan's KernelOptions, as JSON")
    ap.add_argument("--fusion", default="all", help="the generator's rewrites (FuseOptions.parse): all, none, -x,+y")
    ap.add_argument("--compare", nargs="*", default=[], help="more FuseOptions to time the greedy generator with")
    ap.add_argument(
        "--compare-options", nargs="*", default=[], help="more KernelOptions (JSON) to time the greedy generator with"
    )
    ap.add_argument("--compare-loader", action="store_true", help="time the LOADER_COMPARE options too")
    ap.add_argument("--compare-lanes", action="store_true", help="time the LANES_COMPARE options too")
    ap.add_argument("--compare-prefill", nargs="*", default=[], help="more FuseOptions to time the prefill with")
    args = ap.parse_args()
    fusion = FuseOptions.parse(args.fusion)
    options = KernelOptions(**json.loads(args.options))
    preset, name = SHAPES[args.shape]
    base = PRESETS[preset]
    cfg = type(base)(**{**base.__dict__, "max_seq": PROMPT + NEW})
    params = random_parameters(cfg, seed=0)
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, cfg.vocab, (1, PROMPT))
    results: dict = {"model": f"{preset} shape, random weights, bf16", "prompt": PROMPT, "new_tokens": NEW}
    results["options"] = dataclasses.asdict(options)
    results["fusion"] = fusion.to_dict()

    results.update(torch_side(cfg, params, not args.skip_torch_compile))
    torch.cuda.empty_cache()  # before the loop kernels take the GPU

    t0 = time.perf_counter()
    prefill_plan = _prefill_plan(cfg, FuseOptions())
    gen_graph = build_llama_generator(cfg, 1, kv_splits=_splits())
    gen_plan = make_plan(gen_graph, processors=132, options=options, fusion=fusion)
    results["plan_s"] = time.perf_counter() - t0
    sampling = build_llama_generator(cfg, 1, kv_splits=_splits(), sampling=True)
    sampling_plan = make_plan(sampling, processors=132, options=options, fusion=fusion)
    with LoopKernel(prefill_plan, params) as k:
        feeds = {"tokens": prompt, "positions": np.arange(PROMPT)[None]}
        logits = k.run(feeds)["logits"]
        t0 = time.perf_counter()
        k.run(feeds)  # what a caller of run() waits for: the inputs written, the step, every position's logits read
        results["loop_prefill_with_logits_read_ms"] = (time.perf_counter() - t0) * 1e3
        # the step alone, its inputs in place (run again: it writes the same KV cache rows with the same values)
        results["loop_prefill_ms"] = resident_seconds(k, 1) * 1e3
        state = k.state()
    for text in args.compare_prefill:  # the same prefill with other rewrites (-split_k_linear), in this run
        with LoopKernel(_prefill_plan(cfg, FuseOptions.parse(text)), params) as k:
            other = k.run(feeds)["logits"]
            entry = {"ms": resident_seconds(k, 1) * 1e3, "logits_max_diff": float(np.abs(other - logits).max())}
        results.setdefault("compare_prefill", {})[text] = entry
        print("prefill", text, entry, flush=True)
    start = {**state, "token": logits[:, -1].astype(np.float32).argmax(-1)[:, None], "position": np.array([[PROMPT]])}
    seconds, tokens = _greedy(gen_plan, params, start)
    for text in args.compare:  # the same greedy generation with other rewrites, in this run
        plan = make_plan(gen_graph, processors=132, options=options, fusion=FuseOptions.parse(text))
        s, toks = _greedy(plan, params, start)
        entry = {"us_per_token": s / NEW * 1e6, "first_tokens": toks[:16].tolist()}
        entry["same_tokens"] = bool(np.array_equal(toks, tokens))  # all NEW of them as the default's
        results.setdefault("compare", {})[text] = entry
        print(text, results["compare"][text], flush=True)
    compare_options = [*args.compare_options, *(LOADER_COMPARE if args.compare_loader else ())]
    compare_options += LANES_COMPARE if args.compare_lanes else ()
    for text in compare_options:  # the same greedy generation with other kernel options, in this run
        plan = make_plan(gen_graph, processors=132, options=KernelOptions(**json.loads(text)))
        s, toks = _greedy(plan, params, start)
        entry = {"us_per_token": s / NEW * 1e6, "first_tokens": toks[:16].tolist()}
        entry["same_tokens"] = bool(np.array_equal(toks, tokens))  # all NEW of them as the default's
        results.setdefault("compare_options", {})[text] = entry
        print(text, entry, flush=True)
    with LoopKernel(sampling_plan, params, start) as k:
        for variant, values in SAMPLING.items():
            dtypes = {"temperature": np.float32, "top_k": np.int64, "top_p": np.float32}
            sampled = {**start, **{n: np.full((1, 1), v, dtypes[n]) for n, v in values.items()}}
            sampled["seed"] = np.ones((1, 1), np.int64)
            k.set_state(sampled)
            k.run(iterations=1)
            k.set_state(sampled)
            t0 = time.perf_counter()
            k.run(iterations=NEW)
            results[f"loop_sampling_{variant}_us_per_token"] = (time.perf_counter() - t0) / NEW * 1e6
            results[f"sampled_{variant}_first_tokens"] = (
                k.state()["generated"][0, 0, PROMPT : PROMPT + 16, 0].astype(int).tolist()
            )
        results["sampling"] = SAMPLING
    results["loop_us_per_token"] = seconds / NEW * 1e6
    results["loop_tokens_per_s"] = NEW / seconds
    results["speedup_vs_torch_eager"] = results["torch_eager_us_per_token"] / results["loop_us_per_token"]
    results["speedup_vs_torch_compile"] = results["torch_compile_us_per_token"] / results["loop_us_per_token"]
    results["speedup_vs_torch_cuda_graph"] = results["torch_cuda_graph_us_per_token"] / results["loop_us_per_token"]
    results["first_tokens"] = tokens[:16].tolist()
    results["kv_splits"] = auto_kv_splits(cfg, 1, 1) if _splits() == "auto" else _splits()
    print(results, flush=True)
    write(name, results)  # transformers' compile takes minutes: the loop kernel's numbers first
    if args.skip_transformers:
        return
    try:
        results.update(transformers_side(cfg, params))
        ratio = results["transformers_static_compiled_us_per_token"] / results["loop_us_per_token"]
        results["speedup_vs_transformers_static_compiled"] = ratio
    except Exception as e:  # say why this one is missing
        results["transformers_error"] = f"{type(e).__name__}: {e}"[:500]
    print(results, flush=True)
    write(name, results)


if __name__ == "__main__":
    main()

"""One Llama-style decoder layer (hidden 2048 and 4096), batch 1: decode (1 token over a 512-token
cache) and prefill (512 tokens); and decode for 4 sequences at once (``decode_batch4``). Loop kernel
vs PyTorch eager vs torch.compile(mode="reduce-overhead"), same weights, bf16, CUDA-event medians (the
loop kernel: wall time over many resident iterations).

Decode is timed twice on the loop kernel: ``loop_kernel_us`` with the same input every step (a block
may start step k + 1 before step k ends elsewhere: the first ops of a step do not need the last ones
of the previous), and ``loop_kernel_dependent_us`` with each step's input the previous step's output
(a state): no overlap, as consecutive layers or tokens of a model. The ratios use the dependent one."""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.nn.functional as F

import megaloop as ml
from bench.common import matmul_tiles, resident_seconds, time_torch, write
from megaloop.models import LlamaConfig, build_llama, random_parameters
from megaloop.models.llama import auto_kv_splits, decoder_layer_parts
from megaloop.plan import make_plan
from megaloop.runtime.loop import LoopKernel

CONTEXT = 512


class TorchLayer(torch.nn.Module):
    def __init__(self, cfg: LlamaConfig, params: dict, sequences: int = 1, device: str = "cuda") -> None:
        super().__init__()
        self.cfg = cfg
        p = {k: torch.tensor(v, dtype=torch.bfloat16, device=device) for k, v in params.items()}
        self.p = p
        shape = (sequences, cfg.kv_heads, cfg.max_seq, cfg.head_dim)
        self.k_cache = torch.zeros(shape, dtype=torch.bfloat16, device=device)
        self.v_cache = torch.zeros_like(self.k_cache)
        hd = cfg.head_dim
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64, device=device) / hd))
        ang = torch.arange(cfg.max_seq, device=device, dtype=torch.float64)[:, None] * inv
        self.cos = torch.cat([ang, ang], -1).cos().to(torch.bfloat16)
        self.sin = torch.cat([ang, ang], -1).sin().to(torch.bfloat16)

    def forward(self, x: torch.Tensor, start: int) -> torch.Tensor:
        cfg, p, hd = self.cfg, self.p, self.cfg.head_dim
        b, t, _ = x.shape
        w = lambda n: p[f"model.layers.0.{n}"]
        h = F.rms_norm(x, (cfg.hidden,), w("input_layernorm.weight"), cfg.rms_eps)
        q = (h @ w("self_attn.q_proj.weight").T).view(b, t, cfg.heads, hd).transpose(1, 2)
        k = (h @ w("self_attn.k_proj.weight").T).view(b, t, cfg.kv_heads, hd).transpose(1, 2)
        v = (h @ w("self_attn.v_proj.weight").T).view(b, t, cfg.kv_heads, hd).transpose(1, 2)
        cos, sin = self.cos[start : start + t], self.sin[start : start + t]

        def rot(z):
            return z * cos + torch.cat([-z[..., hd // 2 :], z[..., : hd // 2]], -1) * sin

        q, k = rot(q), rot(k)
        self.k_cache[:, :, start : start + t] = k
        self.v_cache[:, :, start : start + t] = v
        kk, vv = self.k_cache[:, :, : start + t], self.v_cache[:, :, : start + t]
        o = F.scaled_dot_product_attention(q, kk, vv, is_causal=t > 1, enable_gqa=True)
        x = x + o.transpose(1, 2).reshape(b, t, -1) @ w("self_attn.o_proj.weight").T
        h = F.rms_norm(x, (cfg.hidden,), w("post_attention_layernorm.weight"), cfg.rms_eps)
        return (
            x
            + (F.silu(h @ w("mlp.gate_proj.weight").T) * (h @ w("mlp.up_proj.weight").T)) @ w("mlp.down_proj.weight").T
        )


def layer_config(hidden: int, tokens: int) -> LlamaConfig:
    """One Llama-3-style layer of this width (head 128, 4 query heads per KV head), a cache for the
    context and the step's tokens."""
    return LlamaConfig(
        hidden=hidden,
        heads=hidden // 128,
        kv_heads=max(1, hidden // 512),
        intermediate=int(hidden * 2.6875),
        layers=1,
        max_seq=CONTEXT + tokens,
        vocab=None,
    )


def dependent_decode_graph(cfg: LlamaConfig, x0: np.ndarray, kv_splits: int | str | None) -> ml.Graph:
    """The decode step of build_llama (one layer, the final norm) with ``hidden`` a state that each
    step's output replaces (in place: the final norm writes it, no copy); x0 [sequences, 1, hidden].
    Plain, as build_llama's: make_plan fuses it (its ``fusion`` options)."""
    g = ml.Graph("llama-layer-dependent")
    positions = g.input("positions", (x0.shape[0], 1), "int64")
    x = g.state("hidden", (x0.shape[0], 1, cfg.hidden), cfg.dtype, init=x0)
    h, update = decoder_layer_parts(g, cfg, x, None, positions, 0, kv_splits)
    y = ml.rmsnorm(h + update, g.parameter("model.norm.weight", (cfg.hidden,), cfg.dtype), eps=cfg.rms_eps)
    g.output("hidden", y)
    g.assign(x, y)
    return g


def bench_case(
    hidden: int, tokens: int, compile_too: bool, kv_splits: int | str | None = "auto", sequences: int = 1
) -> dict:
    cfg = layer_config(hidden, tokens)
    params = random_parameters(cfg, seed=0)
    layer_params = {k: v for k, v in params.items() if k.startswith("model.layers.")}
    start = CONTEXT if tokens == 1 else 0
    g = build_llama(cfg, sequences, tokens, kv_splits=kv_splits)
    # the reference graph has a final norm; the layer alone is what torch times, so time the full
    # graph (one extra rmsnorm, negligible) on both sides by adding it to torch too
    rng = np.random.default_rng(1)
    x = rng.standard_normal((sequences, tokens, hidden)).astype(np.float32)
    pos = np.tile(np.arange(start, start + tokens), (sequences, 1))
    out: dict = {"sequences": sequences}
    out["kv_splits"] = auto_kv_splits(cfg, sequences, tokens) if kv_splits == "auto" else kv_splits
    tiles = matmul_tiles()
    out["matmul_tiles"] = tiles["matmul"]
    iters = 200 if tokens == 1 else 10
    with LoopKernel(make_plan(g, processors=132, tiles=tiles), params) as k:
        k.run({"hidden": x, "positions": pos}, iterations=3)
        out["loop_kernel_us"] = resident_seconds(k, iters) * 1e6
    if tokens == 1:
        plan = make_plan(dependent_decode_graph(cfg, x, kv_splits), processors=132, tiles=tiles)
        assert not any(op.name.startswith("assign:") for op in plan.ranks[0].ops), "the dependent step copies its state"
        with LoopKernel(plan, params) as k:
            k.run({"positions": pos}, iterations=3)
            out["loop_kernel_dependent_us"] = resident_seconds(k, iters) * 1e6
    layer = TorchLayer(cfg, layer_params, sequences)
    final = torch.tensor(params["model.norm.weight"], dtype=torch.bfloat16, device="cuda")
    xt = torch.tensor(x, dtype=torch.bfloat16, device="cuda")

    def eager():
        with torch.no_grad():
            return F.rms_norm(layer(xt, start), (hidden,), final, cfg.rms_eps)

    out["torch_eager_us"] = time_torch(eager) * 1e6
    if compile_too:
        compiled = torch.compile(eager, mode="reduce-overhead")
        out["torch_compile_us"] = time_torch(compiled, warmup=5, repeat=30) * 1e6
    loop = out.get("loop_kernel_dependent_us", out["loop_kernel_us"])  # PyTorch's steps run in order
    out["speedup_vs_eager"] = out["torch_eager_us"] / loop
    if "torch_compile_us" in out:
        out["speedup_vs_compile"] = out["torch_compile_us"] / loop
    return out


def main() -> None:
    compile_too = os.environ.get("MEGALOOP_BENCH_COMPILE", "1") == "1"
    results = {}
    for hidden in (2048, 4096):
        for tokens, label in ((1, "decode"), (512, "prefill512")):
            results[f"hidden{hidden}_{label}"] = bench_case(hidden, tokens, compile_too and tokens == 1)
            print(label, hidden, results[f"hidden{hidden}_{label}"], flush=True)
        # decode without splitting the cache into key ranges (one attention tile per query head)
        results[f"hidden{hidden}_decode_unsplit"] = bench_case(hidden, 1, False, kv_splits=None)
        print("decode unsplit", hidden, results[f"hidden{hidden}_decode_unsplit"], flush=True)
        # batched decode: the matmuls' tiles take the rows of all 4 sequences (tile switch fold_batch)
        results[f"hidden{hidden}_decode_batch4"] = bench_case(hidden, 1, compile_too, sequences=4)
        print("decode batch 4", hidden, results[f"hidden{hidden}_decode_batch4"], flush=True)
    write("llama_layer", results)


if __name__ == "__main__":
    main()

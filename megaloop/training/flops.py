"""Model FLOP utilisation: the FLOPs a step's tokens need by the model's arithmetic (not what an
implementation happens to execute) over what the device could do in that time.

Per token, forward and backward: 6 N for the N weights of the products (the LM head's included,
the embedding lookup's not), and 6 L d seq / 2 for causal attention's two products (L layers, d the
query heads' width), as PaLM's appendix B counts them. The peaks are the vendors' dense figures.
"""

from __future__ import annotations

from megaloop.models.llama import LlamaConfig

# dense peak TFLOP/s per GPU: (16-bit tensor cores, float32 on the CUDA cores)
PEAK_TFLOPS = {"H200": (989.0, 67.0), "H100": (989.0, 67.0), "A100": (312.0, 19.5), "L40S": (362.0, 91.6)}


def model_flops_per_token(cfg: LlamaConfig, seq: int) -> float:
    shapes = cfg.parameter_shapes()
    products = sum(s[0] * s[1] for n, s in shapes.items() if len(s) == 2 and n != "model.embed_tokens.weight")
    if cfg.vocab is not None and cfg.tie_word_embeddings:
        products += cfg.vocab * cfg.hidden  # the head reads the embedding
    attention = cfg.layers * cfg.heads * (cfg.head_dim or 0) * seq
    return 6.0 * products + 6.0 * attention


def peak_flops(device_name: str, dtype_name: str) -> float | None:
    """The device's peak FLOP/s for the model's dtype, or None where megaloop does not know it."""
    for key, (half, single) in PEAK_TFLOPS.items():
        if key in device_name:
            return 1e12 * (single if dtype_name == "float32" else half)
    return None

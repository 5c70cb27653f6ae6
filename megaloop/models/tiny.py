"""``make_tiny_checkpoint``: a small random Llama in the Hugging Face layout, with a real tokenizer,
for trying ``megaloop generate`` without downloading anything.

The folder holds what a transformers ``save_pretrained`` would: config.json (in the layout of the
installed transformers, 5.x when there is none), generation_config.json, model.safetensors
(bfloat16, random weights: the text it generates is noise), and tokenizer.json (a byte-level BPE
trained here with the tokenizers library on the text below) with tokenizer_config.json (special
tokens and a chat template). The same call always writes the same bytes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import ml_dtypes

from megaloop.errors import CheckpointError
from megaloop.models.llama import LlamaConfig, random_parameters

BOS, EOS, START, END, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|start|>", "<|end|>", "<|pad|>"
SPECIALS = [BOS, EOS, START, END, PAD]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('the tiny model knows the roles system, user and assistant, not ' + message['role']) }}"
    "{% endif %}"
    "<|start|>{{ message['role'] }}\n{{ message['content'] | trim }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
)
# The tokenizer's training text (written for megaloop; a few scripts so that merges span them).
CORPUS = """\
A loop kernel is one program that stays on the GPU and runs every operator of a model.
Each processor walks its own list of tasks and waits on counters instead of barriers.
The host rings a doorbell, the kernel runs an iteration, and the doorbell rings again.
Tokens come out one at a time: the model reads its own last token and writes the next one.
A prompt is split into tokens, the tokens become vectors, and the vectors pass through layers.
Attention looks back over the cache of keys and values; the MLP mixes what it found.
Once upon a time a small model learned nothing at all, because its weights were random.
It still answered every question, politely and at great speed, with words in no order.
Numbers too: 1, 2, 3, 10, 42, 128, 4096, 3.14159, and 2026-12-02.
Bonjour, ça va ? Grüße aus der Schleife. Hola, ¿qué tal? Привет, мир.
你好，世界。循环内核一直在运行。こんにちは、世界。 🙂 🚀 ✨
def loop(tokens): return [t + 1 for t in tokens]  # code has its own shapes of words
"""
TINY = LlamaConfig(hidden=64, heads=4, kv_heads=2, intermediate=192, layers=2, max_seq=2048, vocab=None,
                   rope_theta=10000.0, rms_eps=1e-5, tie_word_embeddings=True)  # fmt: skip


def train_tokenizer(vocab_size: int = 512) -> Any:
    """A byte-level BPE (as Llama 3 and Qwen2 use) trained on CORPUS, BOS added to every encoding."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    return tok


def _transformers_major() -> int:
    """The major version of the installed transformers (not imported), 5 without one."""
    from importlib import metadata

    try:
        return int(metadata.version("transformers").split(".")[0])
    except (metadata.PackageNotFoundError, ValueError):
        return 5


def _config(cfg: LlamaConfig, ids: dict[str, int], major: int) -> dict[str, Any]:
    rope = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    layout = {"rope_parameters": rope, "dtype": "bfloat16"} if major >= 5 else {
        "rope_theta": cfg.rope_theta, "rope_scaling": None, "torch_dtype": "bfloat16"}  # fmt: skip
    out = {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": ids[BOS], "eos_token_id": ids[EOS], "head_dim": cfg.head_dim, "hidden_act": "silu",
        "hidden_size": cfg.hidden, "initializer_range": 0.02, "intermediate_size": cfg.intermediate,
        "max_position_embeddings": cfg.max_seq, "mlp_bias": False, "model_type": "llama",
        "num_attention_heads": cfg.heads, "num_hidden_layers": cfg.layers, "num_key_value_heads": cfg.kv_heads,
        "pad_token_id": ids[PAD], "pretraining_tp": 1, "rms_norm_eps": cfg.rms_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings, "use_cache": True, "vocab_size": cfg.vocab, **layout,
    }  # fmt: skip
    return dict(sorted(out.items()))


def _tokenizer_config(ids: dict[str, int]) -> dict[str, Any]:
    added = {str(ids[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                           "single_word": False, "special": True} for t in SPECIALS}  # fmt: skip
    return {
        "added_tokens_decoder": added,
        "bos_token": BOS,
        "eos_token": END,
        "pad_token": PAD,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": TINY.max_seq,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def tiny_files(seed: int = 0) -> dict[str, bytes]:
    """Every file of the tiny checkpoint: name -> content."""
    from safetensors.numpy import save

    tok = train_tokenizer()
    ids = {t: tok.token_to_id(t) for t in SPECIALS}
    cfg = LlamaConfig(**{**TINY.__dict__, "vocab": tok.get_vocab_size()})
    params = {n: v.astype(ml_dtypes.bfloat16) for n, v in random_parameters(cfg, seed=seed).items()}
    major = _transformers_major()
    generation = {"bos_token_id": ids[BOS], "eos_token_id": [ids[END], ids[EOS]], "pad_token_id": ids[PAD]}

    def text(obj: Any) -> bytes:
        return (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode()

    return {
        "config.json": text(_config(cfg, ids, major)),
        "generation_config.json": text(generation),
        "model.safetensors": save(dict(sorted(params.items())), metadata={"format": "pt"}),
        "tokenizer.json": tok.to_str(pretty=True).encode(),
        "tokenizer_config.json": text(_tokenizer_config(ids)),
    }


def make_tiny_checkpoint(folder: str | Path, *, seed: int = 0, overwrite: bool = False) -> Path:
    """Write the tiny checkpoint into ``folder`` (made if missing). A folder that already holds it
    (the same bytes) is left as it is; other files there are never overwritten unless asked."""
    folder = Path(folder)
    files = tiny_files(seed)
    if folder.exists() and not folder.is_dir():
        raise CheckpointError(f"{folder} exists and is not a folder")
    clash = [n for n, data in files.items() if (folder / n).exists() and (folder / n).read_bytes() != data]
    if clash and not overwrite:
        raise CheckpointError(
            f"{folder} already has {', '.join(clash)}, not the tiny checkpoint's: choose another folder "
            "(or overwrite them: --force)"
        )
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        path = folder / name
        if not (path.exists() and path.read_bytes() == data):
            path.write_bytes(data)
    return folder

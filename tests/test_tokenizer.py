"""megaloop's Tokenizer against transformers' AutoTokenizer on the same folder (a byte-level BPE
trained here with the tokenizers library): encode/decode round trips, special tokens, chat templates
(multi-turn, a system message, named templates, raise_exception) rendered alike, and streaming
detokenization that adds up to decode without ever splitting a character."""

from __future__ import annotations

import json

import pytest

from megaloop.models.tokenizer import ChatTemplateError, Tokenizer

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>", "<unk>"]
TEXT = [
    "The loop kernel runs every operator of the model, one task after another.",
    "Grüße, ça va? 你好世界 🙂🚀 — naïve café, 3.14159 and 2026-12-02.",
    "def f(x):\n    return x ** 2  # squares\n\n\ttabs and   spaces",
]
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are helpful.<|im_end|>\n{% endif %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] | trim }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS_TEMPLATE = (
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
)
CHATS = [
    [{"role": "user", "content": "Hi there"}],
    [
        {"role": "system", "content": "  Answer in French.  "},
        {"role": "user", "content": "What is a loop kernel?"},
        {"role": "assistant", "content": "Un noyau qui boucle."},
        {"role": "user", "content": "Merci! 🙂"},
    ],
]


def train() -> tokenizers.Tokenizer:
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TEXT * 3, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    return tok


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Saved by transformers itself (the installed version's files, e.g. chat_template.jinja)."""
    folder = tmp_path_factory.mktemp("tok")
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=train(), bos_token="<s>", eos_token="<|im_end|>", unk_token="<unk>", pad_token="</s>",
        chat_template=TEMPLATE,
    )
    hf.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 3]}))
    return folder


@pytest.fixture(scope="module")
def handwritten(tmp_path_factory):
    """tokenizer_config.json as older saves wrote it: AddedToken dicts, add_bos/add_eos_token, a list
    of named templates; tokenizer.json without a post-processor."""
    folder = tmp_path_factory.mktemp("tok4")
    tok = train()
    data = json.loads(tok.to_str())
    data["post_processor"] = None
    (folder / "tokenizer.json").write_text(json.dumps(data))
    def added(t: str) -> dict:
        return {"__type": "AddedToken", "content": t, "lstrip": False, "normalized": False, "rstrip": False,
                "single_word": False, "special": True}  # fmt: skip

    config = {
        "bos_token": added("<s>"),
        "eos_token": added("</s>"),
        "unk_token": added("<unk>"),
        "add_bos_token": True,
        "add_eos_token": True,
        "chat_template": [{"name": "default", "template": TEMPLATE}, {"name": "tool_use", "template": TOOLS_TEMPLATE}],
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("layout", ["saved", "handwritten"])
def test_encode_decode_as_transformers(layout, request) -> None:
    folder = request.getfixturevalue(layout)
    ours, theirs = Tokenizer.from_folder(folder), transformers.AutoTokenizer.from_pretrained(folder)
    for text in [*TEXT, "<|im_start|>user\nhi<|im_end|>", "</s> and <s> inside text", "", " leading space"]:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == theirs.encode(text, add_special_tokens=special), (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
        assert ours.decode(ours.encode(text, False), skip_special_tokens=False) == text  # byte-level: lossless
    assert ours.bos_token_id == theirs.bos_token_id
    assert theirs.eos_token_id in ours.eos_token_ids
    if layout == "saved":  # generation_config's list first, then the tokenizer's own
        assert ours.eos_token_ids == (1, 3)


@pytest.mark.parametrize("layout", ["saved", "handwritten"])
def test_chat_template_as_transformers(layout, request) -> None:
    folder = request.getfixturevalue(layout)
    ours, theirs = Tokenizer.from_folder(folder), transformers.AutoTokenizer.from_pretrained(folder)
    for chat in CHATS:
        for prompt in (True, False):
            want = theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=prompt)
            got = ours.apply_chat_template(chat, add_generation_prompt=prompt)
            assert got == want
            assert ours.encode(got, add_special_tokens=False) == theirs.apply_chat_template(
                chat, add_generation_prompt=prompt, tokenize=True, return_dict=False
            )
    assert "<|im_start|>system\nAnswer in French.<|im_end|>" in ours.apply_chat_template(CHATS[1])
    with pytest.raises(ChatTemplateError, match="unknown role robot"):
        ours.apply_chat_template([{"role": "robot", "content": "beep"}])


def test_named_templates_and_tools(handwritten) -> None:
    ours, theirs = Tokenizer.from_folder(handwritten), transformers.AutoTokenizer.from_pretrained(handwritten)
    tools = [{"type": "function", "function": {"name": "add", "description": "Adds — « ça »", "parameters": {}}}]
    want = theirs.apply_chat_template(CHATS[0], tools=tools, tokenize=False)
    assert ours.apply_chat_template(CHATS[0], tools=tools) == want
    assert "« ça »" in want  # tojson keeps non-ASCII as is (transformers' tojson, not jinja's)
    with pytest.raises(ChatTemplateError, match="no chat template named 'nope'"):
        ours.apply_chat_template(CHATS[0], template="nope")


def test_streaming_never_splits_a_character(saved) -> None:
    tok = Tokenizer.from_folder(saved)
    for text in TEXT:
        ids = tok.encode(text, add_special_tokens=True) + [tok.token_id("<|im_end|>")]
        stream = tok.stream()
        pieces = [stream.push(i) for i in ids]
        assert "".join(pieces) + stream.flush() == tok.decode(ids)
        assert all("\ufffd" not in p for p in pieces), pieces
    llama = tok.encode("a🦙b", add_special_tokens=False)  # not in the training text: one token a byte
    assert len(llama) >= 4  # the emoji is at least two tokens
    stream = tok.stream()
    assert [stream.push(i) for i in llama] == ["a", *[""] * (len(llama) - 3), "🦙", "b"] and stream.flush() == ""
    stream = tok.stream()  # a sequence cut inside a character: the rest comes out at the end
    assert "".join(stream.push(i) for i in llama[:3]) == "a" and "a" + stream.flush() == tok.decode(llama[:3])


def test_missing_or_broken_files(tmp_path) -> None:
    from megaloop.errors import CheckpointError

    with pytest.raises(CheckpointError, match=r"no tokenizer\.json"):
        Tokenizer.from_folder(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"tokenizer\.json"):
        Tokenizer.from_folder(tmp_path)
    (tmp_path / "tokenizer.json").write_text(train().to_str())
    (tmp_path / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="expected a JSON object"):
        Tokenizer.from_folder(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer.from_folder(tmp_path).apply_chat_template(CHATS[0])

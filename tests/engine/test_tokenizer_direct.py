"""engine.tokenizer.Tokenizer encodes through tokenizers' Rust object directly, around
transformers' wrapper, and the ids are exactly transformers' own: on varied text, special tokens
written in it, the chat template's output, with and without the added tokens (a BOS that a
post-processor adds), and where a tokenizer.json asks for truncation. A tokenizer class that
encodes its own way keeps transformers' path."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from engine.files import default_model_path  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402

TEXTS = [
    "The capital of France is", "Hello world", " leading space", "trailing space ", "  ", "", "\n", "\n\n\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "<|endoftext|>", "a<|endoftext|>b",
    "<|im_sta", "<|im_start|", "<|im_start|><|im_start|>", "<<|im_end|>>",
    "émojis 🎉 and\ttabs\n\nnewlines", "日本語のテキストと中文", "Привет, мир", "\u200b zero width \ufeff",
    "def f(x):\n    return x ** 2  # squared\n", "1234567890 3.14159 -42 1e-9", "   \t  mixed \r\n line ends",
    "word " * 300, "https://example.com/a?b=c&d=e#f", "\\u00e9 not unicode", "\x00\x01 control",
]
MESSAGES = [
    [{"role": "user", "content": "Name a colour."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <|im_end|> there"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "émojis 🎉\n\nand more"}],
]


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    return Tokenizer.from_model_path(default_model_path())


@pytest.fixture(scope="module")
def with_bos(smollm2: Tokenizer) -> Tokenizer:
    """SmolLM2's vocabulary with a post-processor that adds BOS, and a tokenizer.json truncation
    of 4 tokens (transformers turns it off for an encode that asks none)."""
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    rust = own_copy(smollm2)
    bos = rust.token_to_id("<|im_start|>")
    rust.post_processor = TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos)])
    rust.enable_truncation(4)
    hf = PreTrainedTokenizerFast(tokenizer_object=rust, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                 chat_template=smollm2._tok.chat_template)
    return Tokenizer(hf)


def own_copy(tokenizer: Tokenizer):
    """A Rust tokenizer of the same vocabulary, not the shared object: transformers sets flags on it."""
    from tokenizers import Tokenizer as RustTokenizer

    return RustTokenizer.from_str(tokenizer._tok.backend_tokenizer.to_str())


def transformers_ids(tokenizer: Tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    return list(tokenizer._tok.encode(text, add_special_tokens=add_special_tokens))


@pytest.mark.parametrize("name", ["smollm2", "with_bos"])
def test_prompt_ids_are_transformers_ids(request, name):
    tokenizer = request.getfixturevalue(name)
    assert tokenizer._rust is not None  # the direct path is the one tested
    for text in TEXTS:
        for add in (True, False):
            ids = tokenizer.encode(text, add_special_tokens=add)
            assert ids == transformers_ids(tokenizer, text, add), (text, add)
            assert all(type(i) is int for i in ids)
        assert tokenizer.encode_plain(text) == transformers_ids(tokenizer, text, False)


def test_special_tokens_in_text_are_single_ids_and_bos_is_added(with_bos):
    bos = with_bos._tok.convert_tokens_to_ids("<|im_start|>")
    end = with_bos._tok.convert_tokens_to_ids("<|im_end|>")
    ids = with_bos.encode("hi<|im_end|>")
    assert ids[0] == bos and ids[-1] == end
    assert with_bos.encode("hi<|im_end|>", add_special_tokens=False) == ids[1:]
    assert len(with_bos.encode("word " * 50)) > 4  # the file's truncation is not applied


@pytest.mark.parametrize("name", ["smollm2", "with_bos"])
def test_chat_ids_are_transformers_ids_of_the_rendered_template(request, name):
    tokenizer = request.getfixturevalue(name)
    for messages in MESSAGES:
        rendered = tokenizer.render_chat(messages)
        assert "<|im_start|>assistant" in rendered
        assert tokenizer.encode_chat(messages) == transformers_ids(tokenizer, rendered, False)
        # what transformers' own tokenizing chat template gives
        assert tokenizer.encode_chat(messages) == list(tokenizer._tok.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def test_a_tokenizer_class_that_encodes_its_own_way_keeps_transformers_path(smollm2):
    from transformers import PreTrainedTokenizerFast

    class Shouting(PreTrainedTokenizerFast):
        def _encode_plus(self, text, *args, **kwargs):
            return super()._encode_plus(text.upper(), *args, **kwargs)

    hf = Shouting(tokenizer_object=own_copy(smollm2), eos_token="<|im_end|>")
    tokenizer = Tokenizer(hf)
    assert tokenizer._rust is None
    assert tokenizer.encode("hello") == smollm2.encode("HELLO") != smollm2.encode("hello")


def test_split_special_tokens_keeps_transformers_path(smollm2):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=own_copy(smollm2), eos_token="<|im_end|>",
                                 split_special_tokens=True)
    tokenizer = Tokenizer(hf)
    assert tokenizer._rust is None
    assert len(tokenizer.encode("<|im_end|>")) > 1  # spelled out, as the tokenizer asks

"""A worker's restart opens SmolLM2's converted tokenizer without transformers, and it gives the
ids, text and end tokens that transformers' own tokenizer gives; the API reads the same entry."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from engine.tokenizer import Tokenizer, TokenizerFile, _cache_folder

TEXTS = ["Hello world", " leading space", "<|im_start|>user\nhi<|im_end|>\n", "émojis 🎉 and\ttabs\n\nnewlines",
         "def f(x):\n    return x ** 2  # squared", "  ", ""]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def converted(smollm2, tmp_path_factory):
    """(the tokenizer transformers built, the cache folder it left: `--data-dir`/cache)."""
    cache = tmp_path_factory.mktemp("data") / "cache"
    first = Tokenizer.from_model_path(smollm2.path, smollm2.gguf.eos_token_ids(), cache_dir=cache, chat=False)
    return first, cache


def test_a_restart_opens_the_saved_tokenizer_and_it_agrees_with_transformers(smollm2, converted):
    first, cache = converted
    assert not isinstance(first._tok, TokenizerFile)  # nothing saved yet: transformers converted it
    again = Tokenizer.from_model_path(smollm2.path, smollm2.gguf.eos_token_ids(), cache_dir=cache, chat=False)
    assert isinstance(again._tok, TokenizerFile)

    assert again.eos_token_ids == first.eos_token_ids and again.vocab_size == first.vocab_size == 49152
    assert again.has_chat_template
    for text in TEXTS:
        assert again.encode(text) == first.encode(text)
    assert again.encode_chat(MESSAGES) == first.encode_chat(MESSAGES)  # transformers, loaded on demand
    every_seventh = list(range(0, first.vocab_size, 7)) + [0, 1, 2, first.vocab_size - 1]
    for start in range(0, len(every_seventh), 64):
        ids = every_seventh[start : start + 64]
        assert again.decode(ids) == first.decode(ids)


def test_the_saved_tokenizer_opens_without_importing_transformers(smollm2, converted):
    _, cache = converted
    program = (
        "import sys; from engine.tokenizer import Tokenizer; "
        f"t = Tokenizer.from_model_path({str(smollm2.path)!r}, cache_dir={str(cache)!r}, chat=False); "
        "print(t.decode(t.encode('Hello world')), 'transformers' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["Hello", "world", "False"]


def test_a_config_transformers_acts_upon_is_left_to_transformers(smollm2, converted, tmp_path):
    _, cache = converted
    folder = tmp_path / "entry"
    shutil.copytree(_cache_folder(smollm2.path, cache), folder)
    assert TokenizerFile.open(folder) is not None
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    assert TokenizerFile.open(folder) is None
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "tokenizer.json").write_text("{ damaged")
    assert TokenizerFile.open(folder) is None


def test_the_api_reads_the_tokenizer_the_worker_converted(smollm2, converted, monkeypatch):
    from transformers import AutoTokenizer

    from api.app import load_model_facts
    from api.settings import ApiSettings

    first, cache = converted
    opened = []
    real = AutoTokenizer.from_pretrained.__func__

    def from_pretrained(cls, *args, **kwargs):
        opened.append(kwargs.get("gguf_file"))
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", classmethod(from_pretrained))
    tokenizer, name, _defaults, _cap = load_model_facts(ApiSettings(data_dir=cache.parent), None)
    assert opened == [None]  # the saved folder, not a conversion from the GGUF
    assert name == "SmolLM2-135M-Instruct" and tokenizer.encode_chat(MESSAGES) == first.encode_chat(MESSAGES)


def _tokenizer_fields_as(arch: str, source, path) -> None:
    """A GGUF holding only SmolLM2's tokenizer metadata, under another architecture's name."""
    from gguf import GGUFValueType, GGUFWriter

    writer = GGUFWriter(path, arch)
    for key, value in source.file.fields.items():
        if key.startswith("tokenizer."):
            if isinstance(value, list):
                kind = GGUFValueType.STRING if isinstance(value[0], str) else GGUFValueType.INT32
                writer.add_array(key, value) if kind == GGUFValueType.STRING else writer.add_array(key, [int(v) for v in value])
            elif isinstance(value, str):
                writer.add_string(key, value)
            elif isinstance(value, bool):
                writer.add_bool(key, value)
            else:
                writer.add_uint32(key, int(value))
    writer.add_block_count(1)
    writer.add_context_length(512)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()


@pytest.mark.parametrize("arch", ["llama", "qwen3moe", "gemma3"])  # one per tokenizer class and rename
def test_a_gguf_converts_to_the_tokenizer_autotokenizer_builds(smollm2, arch, tmp_path):
    # The conversion skips AutoTokenizer's config step (9 s of a fresh start, issue 24): the class
    # it picks by the file's architecture and the ids it gives must be AutoTokenizer's own.
    from transformers import AutoTokenizer

    from engine.gguf_loader import _SUPPORTED
    from engine.tokenizer import _gguf_tokenizer

    assert arch in _SUPPORTED
    path = tmp_path / f"{arch}-tokenizer.gguf"
    _tokenizer_fields_as(arch, smollm2.gguf, path)
    ours = _gguf_tokenizer(path, None)
    reference = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    assert type(ours) is type(reference)
    assert ours.special_tokens_map == reference.special_tokens_map and len(ours) == len(reference)
    for text in TEXTS:
        assert ours.encode(text) == reference.encode(text), text
        assert ours.decode(ours.encode(text)) == reference.decode(reference.encode(text))
    assert ours.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False) == \
        reference.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)

"""Text <-> token ids, from the model's own files (GGUF metadata or an HF folder).

No torch import here: the API process tokenizes prompts to know their length. transformers is
imported lazily, inside `from_model_path`, so importing this module stays cheap; a GGUF's
tokenizer converted on an earlier start opens without it (`TokenizerFile`)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Sequence

from engine.files import is_gguf


GGUF_TOOL_TEMPLATE = "tokenizer.chat_template.tool_use"  # a GGUF's named template for requests with tools


class Tokenizer:
    def __init__(self, hf_tokenizer: Any, extra_eos_ids: Sequence[int] = (), tool_template: str | None = None) -> None:
        self._tok = hf_tokenizer
        self.tool_template = tool_template  # rendered instead of the chat template when tools are given
        eos = {int(i) for i in extra_eos_ids}
        if hf_tokenizer.eos_token_id is not None:
            eos.add(int(hf_tokenizer.eos_token_id))
        # Chat models end a turn with an end-of-turn token that is not always the declared eos.
        for name in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<end_of_turn>", "<|end|>"):
            token_id = hf_tokenizer.convert_tokens_to_ids(name)
            if isinstance(token_id, int) and token_id != hf_tokenizer.unk_token_id:
                eos.add(token_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.vocab_size: int = len(hf_tokenizer)
        self._rust = _rust_encoder(hf_tokenizer)  # None: every encode goes through transformers

    @classmethod
    def from_model_path(cls, path: str | Path, extra_eos_ids: Sequence[int] = (),
                        cache_dir: str | Path | None = None, chat: bool = True) -> "Tokenizer":
        """`extra_eos_ids`: end ids the caller already knows (the engine passes the GGUF's eos/eot
        ids from the file it parsed anyway). `cache_dir`: keep a GGUF's converted tokenizer there.
        `chat` False: the caller (the worker) turns ids into text and renders no chat template, so
        a GGUF's tokenizer converted by an earlier start opens without transformers, whose import
        is ~1 s of a restart; `encode_chat` still works, loading transformers when first called."""
        path = Path(path)
        if not chat and cache_dir is not None and is_gguf(path):
            saved = TokenizerFile.open(_cache_folder(path, cache_dir))
            if saved is not None:
                return cls(saved, extra_eos_ids)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the hub
        from transformers import AutoTokenizer

        if is_gguf(path):
            return cls(_gguf_tokenizer(path, cache_dir), extra_eos_ids, _gguf_tool_template(path, cache_dir))
        hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
        return cls(hf, [*extra_eos_ids, *_config_eos_ids(path)])

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A completion prompt; BOS is added when the model's tokenizer adds it (add_special_tokens)."""
        if self._rust is not None:
            return self._rust.encode(text, add_special_tokens=add_special_tokens).ids
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def special_tokens(self) -> dict[str, str]:
        """eos_token, bos_token, pad_token: the names the tokenizer declares (GET /tokenizer_info)."""
        names = {}
        for name in ("eos_token", "bos_token", "pad_token"):
            value = getattr(self._tok, name, None)
            if isinstance(value, str):
                names[name] = value
        return names

    @property
    def chat_template(self) -> str | None:
        return self._tok.chat_template or None

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None, **template_kwargs: Any) -> list[int]:
        """The model's chat template, ending with the assistant's turn opened. tools: OpenAI's
        tool objects, for a template that renders them; template_kwargs reach the template
        (`chat_template_kwargs`, e.g. enable_thinking)."""
        return self.encode(self.render_chat(messages, tools, **template_kwargs), add_special_tokens=False)

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None, **template_kwargs: Any) -> str:
        if not self._tok.chat_template:
            raise ValueError("this model has no chat template; use a completion prompt instead")
        if tools and self.tool_template:
            template_kwargs = {**template_kwargs, "chat_template": self.tool_template}
        text = self._tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False,
                                             **template_kwargs)
        # The template writes BOS itself where the model wants one; the ids add no second.
        return text

    def encode_plain(self, text: str) -> list[int]:
        """Text's ids with no BOS or other added tokens (a marker such as </think>)."""
        return self.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def piece(self, token_id: int) -> tuple[str, bytes]:
        """One token as logprobs show it: its text and its own bytes. A token that holds part of
        a UTF-8 character decodes to U+FFFD; its bytes then come from the vocabulary entry
        (byte-level BPE's byte alphabet, or SentencePiece's <0xNN> byte tokens)."""
        text = self._tok.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text, text.encode()
        name = self._tok.convert_ids_to_tokens(token_id)
        if isinstance(name, str):
            if len(name) == 6 and name.startswith("<0x") and name.endswith(">"):
                return text, bytes([int(name[3:5], 16)])
            table = _byte_alphabet()
            if all(c in table for c in name):
                return text, bytes(table[c] for c in name)
        return text, text.encode()

    @property
    def has_chat_template(self) -> bool:
        return bool(self._tok.chat_template)

    @property
    def chat_template(self) -> str | None:
        """The template requests with tools are rendered by (shapes/parsing.py reads the format from it)."""
        if self.tool_template:
            return self.tool_template
        template = self._tok.chat_template
        return template if isinstance(template, str) else None

    @property
    def response_template(self) -> dict | None:
        """The model's own response_template (tokenizer_config.json), which transformers' response
        parsing reads its answers by (shapes/parsing.py); None where it declares none."""
        template = getattr(self._tok, "response_template", None)
        return template if isinstance(template, dict) else None

    def json(self) -> str:
        """The tokenizer as tokenizers' JSON (engine/grammar.py builds llguidance's from it)."""
        rust = getattr(self._tok, "backend_tokenizer", None) or getattr(self._tok, "_rust")
        return rust.to_str()


class TokenizerFile:
    """A tokenizer that transformers saved (tokenizer.json, tokenizer_config.json), opened with
    `tokenizers` alone. For ids and text transformers' fast tokenizer is that same Rust object, so
    the two agree wherever the config holds nothing transformers adds on top (`open` checks);
    the chat template is rendered by transformers, loaded on first use."""

    # config entries that change no id and no text (special tokens are named, not defined, here)
    PLAIN = frozenset({"backend", "bos_token", "eos_token", "pad_token", "unk_token", "is_local",
                       "local_files_only", "model_max_length", "tokenizer_class", "chat_template",
                       "clean_up_tokenization_spaces"})

    def __init__(self, folder: Path, rust: Any, config: dict) -> None:
        self.folder = folder
        self._rust = rust
        self._full: Any = None
        self.unk_token_id: int | None = self._id(config.get("unk_token"))
        self.eos_token_id: int | None = self._id(config.get("eos_token"))
        template = folder / "chat_template.jinja"
        self.chat_template: str | None = template.read_text() if template.is_file() else config.get("chat_template")

    @classmethod
    def open(cls, folder: Path) -> "TokenizerFile | None":
        """None where transformers must open it: no such entry, or a config it acts upon."""
        try:
            config = json.loads((folder / "tokenizer_config.json").read_text())
            if set(config) - cls.PLAIN or config.get("clean_up_tokenization_spaces") or \
                    config.get("backend", "tokenizers") != "tokenizers":
                return None
            from tokenizers import Tokenizer as RustTokenizer

            return cls(folder, RustTokenizer.from_file(str(folder / "tokenizer.json")), config)
        except Exception:  # missing, damaged or unreadable: transformers converts it again
            return None

    def _id(self, token: str | dict | None) -> int | None:
        name = token.get("content") if isinstance(token, dict) else token
        return None if name is None else self._rust.token_to_id(name)

    def convert_tokens_to_ids(self, name: str) -> int | None:
        found = self._rust.token_to_id(name)
        return self.unk_token_id if found is None else found  # as transformers answers an unknown token

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._rust.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._rust.decode(ids, skip_special_tokens=skip_special_tokens)

    def __len__(self) -> int:
        return self._rust.get_vocab_size(with_added_tokens=True)

    def convert_ids_to_tokens(self, token_id: int) -> str | None:
        return self._rust.id_to_token(token_id)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        if self._full is None:
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            from transformers import AutoTokenizer

            self._full = AutoTokenizer.from_pretrained(self.folder, local_files_only=True)
        return self._full.apply_chat_template(*args, **kwargs)


def _rust_encoder(hf_tokenizer: Any) -> Any:
    """tokenizers' Rust tokenizer to encode with directly, where that gives transformers' ids, else None.

    transformers' fast `encode` is that Rust object's `encode_batch` of one text inside Python
    (argument checks, truncation and padding set again, a BatchEncoding built and taken apart):
    2x the direct call for a 12-token prompt (33 against 17 µs, `bench.tokenize_speed`;
    docs/bench-log.md, 2026-12-03), a few percent of the API's CPU for each one-token request.
    It is the same object, so the ids agree
    when the wrapper does nothing else: its own `encode`, not a subclass's that changes the text
    or the ids, special tokens matched as such (split_special_tokens off), and no truncation or
    padding, which transformers turns off on the backend before each call (done here once: this
    Tokenizer owns its HF tokenizer, and nothing turns them back on)."""
    if isinstance(hf_tokenizer, TokenizerFile):
        return hf_tokenizer._rust  # opened by tokenizers alone: no wrapper to go around
    try:
        from transformers import TokenizersBackend
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    except ImportError:
        return None
    cls = type(hf_tokenizer)
    if not isinstance(hf_tokenizer, TokenizersBackend) or cls.encode is not PreTrainedTokenizerBase.encode or \
            cls._encode_plus is not TokenizersBackend._encode_plus or hf_tokenizer.split_special_tokens:
        return None
    rust = hf_tokenizer.backend_tokenizer
    rust.no_truncation()
    rust.no_padding()
    rust.encode_special_tokens = False
    return rust


_BYTE_ALPHABET: dict[str, int] = {}


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte -> the byte (GPT-2's table, from transformers)."""
    if not _BYTE_ALPHABET:
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        _BYTE_ALPHABET.update({char: byte for byte, char in bytes_to_unicode().items()})
    return _BYTE_ALPHABET


# llama.cpp's architecture names where transformers' model type differs (as transformers' own
# GGUF loading renames them), to find the tokenizer class AutoTokenizer would choose.
_MODEL_TYPES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gemma3": "gemma3_text", "gpt-oss": "gpt_oss",
                "minimax-m2": "minimax_m2"}


def _gguf_tokenizer_class(path: Path) -> Any:
    """The tokenizer class AutoTokenizer picks for this GGUF, found without its config step.

    AutoTokenizer(gguf_file=...) builds the whole model config first, with gguf's GGUFReader
    walking all 49k vocabulary strings as numpy views: ~95 % of a fresh start's 9 s conversion
    (the tokenizer itself is built by transformers' fast metadata reader in ~0.4 s). The class only
    depends on the model type, which the file's header names (tests/engine/test_tokenizer_file.py
    checks the choice against AutoTokenizer for every architecture the engine loads)."""
    from transformers import TokenizersBackend
    from transformers.integrations.gguf import read_gguf_metadata
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name

    metadata, _ = read_gguf_metadata(str(path))  # string arrays (the vocabulary) skipped, not read
    arch = str(metadata["general.architecture"])
    # transformers' own rename: a llama-architecture file named exactly "mistral" is a Mistral
    model_type = "mistral" if arch == "llama" and metadata.get("general.name") == "mistral" else _MODEL_TYPES.get(arch, arch)
    name = TOKENIZER_MAPPING_NAMES.get(model_type)
    found = tokenizer_class_from_name(name) if name else None
    return found if found is not None else TokenizersBackend


def _gguf_tokenizer(path: Path, cache_dir: str | Path | None) -> Any:
    """transformers builds a GGUF's tokenizer from its vocabulary and merges (~0.5 s for SmolLM2's
    49k tokens, see `_gguf_tokenizer_class`); the result saved as tokenizer.json opens in ~0.1 s
    (`TokenizerFile`) and without transformers. The cache entry is keyed by the file's path, size
    and modification time, so a changed file converts again."""
    from transformers import AutoTokenizer

    def convert() -> Any:
        return _gguf_tokenizer_class(path).from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)

    if cache_dir is None:
        return convert()
    folder = _cache_folder(path, cache_dir)
    if (folder / "tokenizer.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(folder, local_files_only=True)
        except (OSError, ValueError):  # a damaged entry: convert again
            pass
    hf = convert()
    partial = folder.with_name(folder.name + f".tmp{os.getpid()}")
    try:
        hf.save_pretrained(partial)
        shutil.rmtree(folder, ignore_errors=True)
        partial.rename(folder)  # whole or absent: another process may be reading the cache
    except OSError:
        shutil.rmtree(partial, ignore_errors=True)
    return hf


def _gguf_tool_template(path: Path, cache_dir: str | Path | None) -> str | None:
    """The GGUF's `tokenizer.chat_template.tool_use`, where the file has one (llama.cpp's name)."""
    from engine.gguf_file import GGUFFile

    value = GGUFFile(path, cache_dir).fields.get(GGUF_TOOL_TEMPLATE)
    return value if isinstance(value, str) and value else None


def _cache_folder(path: Path, cache_dir: str | Path) -> Path:
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return Path(cache_dir) / "tokenizers" / f"{path.stem}-{key}"


def _config_eos_ids(path: Path) -> list[int]:
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        file = path / name
        if not file.is_file():
            continue
        value = json.loads(file.read_text()).get("eos_token_id")
        if isinstance(value, int):
            ids.append(value)
        elif isinstance(value, list):
            ids.extend(int(v) for v in value)
    return ids

"""Text <-> token ids, from the model's own files (GGUF metadata or an HF folder).

No torch import here: the API process tokenizes prompts to know their length. transformers is
imported lazily, inside `from_model_path`, so importing this module stays cheap."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Sequence

from engine.files import is_gguf


class Tokenizer:
    def __init__(self, hf_tokenizer: Any, extra_eos_ids: Sequence[int] = ()) -> None:
        self._tok = hf_tokenizer
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

    @classmethod
    def from_model_path(cls, path: str | Path, extra_eos_ids: Sequence[int] = ()) -> "Tokenizer":
        """`extra_eos_ids`: end ids the caller already knows (the engine passes the GGUF's eos/eot
        ids from the reader it opened anyway; reading the GGUF a second time here costs seconds)."""
        path = Path(path)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the hub
        from transformers import AutoTokenizer

        if is_gguf(path):
            # Slow (~6 s for SmolLM2): transformers parses the whole GGUF with GGUFReader.
            hf = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
            return cls(hf, extra_eos_ids)
        hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
        return cls(hf, [*extra_eos_ids, *_config_eos_ids(path)])

    def encode(self, text: str) -> list[int]:
        """A completion prompt; BOS is added when the model's tokenizer adds it."""
        return list(self._tok.encode(text))

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """The model's chat template, ending with the assistant's turn opened."""
        if not self._tok.chat_template:
            raise ValueError("this model has no chat template; use a completion prompt instead")
        text = self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        # The template writes BOS itself where the model wants one; do not add a second.
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return bool(self._tok.chat_template)


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

"""Bodies of POST /tokenize and /detokenize (vLLM's and llama-server's shapes), so a client can
count its context before it sends a prompt."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shapes.requests import ChatMessage
from shapes.text import require_unicode


class TokenizeRequest(BaseModel):
    """Text (`prompt`, tokenized as a completion prompt is) or `messages` (through the chat
    template, ending with the assistant's turn opened, as a chat request is): one of the two."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True  # prompt: the tokenizer's own (BOS where the model wants one), as completions

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, body: Any) -> Any:
        return require_unicode(body)

    @model_validator(mode="after")
    def _one_of_them(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int  # the context a prompt and its answer share


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    """GET /tokenizer_info (vLLM's): what a client-side tokenizer needs, e.g. lm-eval's remote one."""

    eos_token: str | None
    bos_token: str | None
    pad_token: str | None
    chat_template: str | None
    model_max_length: int

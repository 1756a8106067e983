"""What travels through Redis: a queued request and the events of its output stream."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Union


_NOT_PARAMS = ("id", "priority", "prompt")  # QueuedRequest fields stored on their own, not in `params`


@dataclass(frozen=True)
class QueuedRequest:
    id: str
    priority: int
    prompt: list[int]  # token ids, tokenized by the API
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: list[tuple[int, float]] = field(default_factory=list)  # (token id, bias)
    grammar: str | None = None  # llguidance grammar text the answer must follow (shapes/constraints.py)
    grammar_after: str | None = None  # the grammar starts once the answer has written this (</think>)
    logprobs: int | None = None  # each answer token's logprob and this many likeliest (None: none)
    echo: bool = False  # the answer starts with the prompt's text
    prompt_logprobs: int | None = None  # with echo: the prompt tokens' logprobs too, None: none
    n: int = 1  # answers (choices) from one read of the prompt, each in a slot of its own (docs/api.md, "n")

    def choice_seed(self, choice: int) -> int | None:
        """Answer `choice` of n draws with seed + choice (wrapped into the seeds' range), so each
        answer is the one a single request with that seed gives; no seed, no seed for any."""
        if self.seed is None or choice == 0:
            return self.seed
        return (self.seed + choice + 2**63) % (2**64 + 2**63) - 2**63

    def params_json(self) -> str:
        # not asdict(): it deep-copies the prompt, a tenth of a millisecond per enqueue
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self) if f.name not in _NOT_PARAMS})

    @classmethod
    def from_hash(cls, h: dict[str, str]) -> "QueuedRequest":
        return cls(
            id=h["id"],
            priority=int(h["priority"]),
            prompt=json.loads(h["prompt"]),
            **json.loads(h["params"]),
        )


@dataclass(frozen=True)
class Scored:
    """One token's log-probability as an answer shows it: its text and UTF-8 bytes, and the
    likeliest tokens at its position as (text, logprob, bytes), largest first. The prompt's first
    token has no logprob (None): nothing comes before it."""

    token: str
    logprob: float | None
    bytes: list[int]
    top: list[tuple[str, float, list[int]]] | None = None

    def wire(self) -> list:
        return [self.token, self.logprob, self.bytes, self.top]

    @classmethod
    def from_wire(cls, item: list) -> "Scored":
        token, logprob, raw, top = item
        return cls(token, logprob, raw, None if top is None else [(t, lp, b) for t, lp, b in top])


@dataclass(frozen=True)
class Token:
    text: str
    token_ids: list[int]
    logprobs: list[Scored] = field(default_factory=list)  # one per id, when the request asked
    # echo: the event of the prompt's text, with its tokens' logprobs when asked ([] when not)
    prompt_logprobs: list[Scored] | None = None
    choice: int = 0  # which of the request's n answers it belongs to


@dataclass(frozen=True)
class Done:
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    completion_tokens: int
    choice: int = 0  # the answer it ends: a request of n answers ends at its n-th Done, one per choice


@dataclass(frozen=True)
class Failed:
    message: str
    code: str = "engine_error"


Event = Union[Token, Done, Failed]


def text(value: bytes | str) -> str:
    """Replies come as bytes or str depending on the client's decode_responses."""
    return value.decode() if isinstance(value, bytes) else value


def decoded(reply: dict) -> dict[str, str]:
    """A hash (HGETALL) or stream entry's fields as str -> str, whatever the client decodes."""
    return {text(name): text(value) for name, value in reply.items()}


def events(entries: list) -> list[tuple[str, "Event"]]:
    """Stream entries (XRANGE, or one stream of an XREAD) as (entry id, event)."""
    return [(text(entry_id), parse_event(decoded(fields))) for entry_id, fields in entries]


def event_fields(event: Event) -> dict[str, str]:
    """Flat string fields of one stream entry, readable in redis-cli (XRANGE). `choice` only
    where it is not 0: a request of one answer reads as it always did."""
    fields = _event_fields(event)
    if getattr(event, "choice", 0):
        fields["choice"] = str(event.choice)
    return fields


def _event_fields(event: Event) -> dict[str, str]:
    if isinstance(event, Token):
        fields = {"type": "token", "text": event.text, "ids": ",".join(map(str, event.token_ids))}
        if event.logprobs:
            fields["logprobs"] = json.dumps([s.wire() for s in event.logprobs], separators=(",", ":"))
        if event.prompt_logprobs is not None:
            fields["prompt_logprobs"] = json.dumps([s.wire() for s in event.prompt_logprobs], separators=(",", ":"))
        return fields
    if isinstance(event, Done):
        return {
            "type": "done",
            "finish_reason": event.finish_reason,
            "prompt_tokens": str(event.prompt_tokens),
            "completion_tokens": str(event.completion_tokens),
        }
    return {"type": "error", "message": event.message, "code": event.code}


def parse_event(fields: dict[str, str]) -> Event:
    kind = fields.get("type")
    if kind == "token":
        ids = fields.get("ids", "")
        logprobs = [Scored.from_wire(x) for x in json.loads(fields["logprobs"])] if fields.get("logprobs") else []
        prompt = fields.get("prompt_logprobs")
        return Token(fields.get("text", ""), [int(i) for i in ids.split(",") if i], logprobs,
                     None if prompt is None else [Scored.from_wire(x) for x in json.loads(prompt)],
                     int(fields.get("choice", 0)))
    if kind == "done":
        return Done(fields["finish_reason"], int(fields["prompt_tokens"]), int(fields["completion_tokens"]),
                    int(fields.get("choice", 0)))
    return Failed(fields.get("message", "unknown error"), fields.get("code", "engine_error"))

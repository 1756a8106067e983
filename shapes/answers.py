"""How each generation endpoint words its answer (a `Shape`): whole, or as stream chunks. The
API streams with them; the batch job words each line's result with them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pydantic import BaseModel

from shapes.requests import ChatCompletionRequest, CompletionRequest, GenerationBody
from shapes.responses import (
    AssistantMessage, ChatChoice, ChatCompletion, ChatCompletionChunk, ChunkChoice, Delta, TextChoice,
    TextCompletion, Usage,
)


@dataclass(frozen=True)
class Job:
    """One accepted request, as its answer refers to it."""

    id: str
    created: int
    model: str
    priority: int
    include_usage: bool


@dataclass(frozen=True)
class Answer:
    text: str
    finish_reason: str
    usage: Usage


class Shape(Protocol):
    def opening(self, job: Job) -> BaseModel | None: ...
    def chunk(self, job: Job, text: str | None, finish_reason: str | None) -> BaseModel: ...
    def usage_chunk(self, job: Job, usage: Usage) -> BaseModel: ...
    def whole(self, job: Job, answer: Answer) -> BaseModel: ...


class ChatShape:
    def opening(self, job: Job) -> ChatCompletionChunk:
        return self._chunk(job, [ChunkChoice(delta=Delta(role="assistant", content=""))])

    def chunk(self, job: Job, text: str | None, finish_reason: str | None) -> ChatCompletionChunk:
        return self._chunk(job, [ChunkChoice(delta=Delta(content=text), finish_reason=finish_reason)])

    def usage_chunk(self, job: Job, usage: Usage) -> ChatCompletionChunk:
        return self._chunk(job, [], usage)

    def whole(self, job: Job, answer: Answer) -> ChatCompletion:
        return ChatCompletion(
            id=job.id, created=job.created, model=job.model, usage=answer.usage,
            choices=[ChatChoice(message=AssistantMessage(content=answer.text), finish_reason=answer.finish_reason)],
        )

    @staticmethod
    def _chunk(job: Job, choices: list[ChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=job.id, created=job.created, model=job.model, choices=choices, usage=usage)


class CompletionShape:
    def opening(self, job: Job) -> None:
        return None

    def chunk(self, job: Job, text: str | None, finish_reason: str | None) -> TextCompletion:
        return self._body(job, [TextChoice(text=text or "", finish_reason=finish_reason)])

    def usage_chunk(self, job: Job, usage: Usage) -> TextCompletion:
        return self._body(job, [], usage)

    def whole(self, job: Job, answer: Answer) -> TextCompletion:
        return self._body(job, [TextChoice(text=answer.text, finish_reason=answer.finish_reason)], answer.usage)

    @staticmethod
    def _body(job: Job, choices: list[TextChoice], usage: Usage | None = None) -> TextCompletion:
        return TextCompletion(id=job.id, created=job.created, model=job.model, choices=choices, usage=usage)


@dataclass(frozen=True)
class Endpoint:
    """A generation endpoint: its path, its request schema, how it words answers, its id prefix."""

    path: str
    schema: type[GenerationBody]
    shape: Shape
    id_prefix: str


CHAT = Endpoint("/v1/chat/completions", ChatCompletionRequest, ChatShape(), "chatcmpl")
COMPLETIONS = Endpoint("/v1/completions", CompletionRequest, CompletionShape(), "cmpl")
ENDPOINTS = {endpoint.path: endpoint for endpoint in (CHAT, COMPLETIONS)}

"""How each generation endpoint words its answer (a `Shape`): whole, or as stream chunks. The
API streams with them; the batch job words each line's result with them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pydantic import BaseModel

from shapes.parsing import AnswerSplitter, Parts, Reading, split_whole
from queues.records import Scored
from shapes.requests import ChatCompletionRequest, CompletionRequest, GenerationBody
from shapes.responses import (
    AssistantMessage, ChatChoice, ChatCompletion, ChatCompletionChunk, ChatLogprobs, ChatTokenLogprob, ChunkChoice,
    CompletionLogprobs, Delta, FunctionCallOut, TextChoice, TextCompletion, ToolCallOut, TopLogprob, Usage,
)


@dataclass(frozen=True)
class Job:
    """One accepted request, as its answer refers to it."""

    id: str
    created: int
    model: str
    priority: int
    include_usage: bool
    reading: Reading = Reading()  # how its text splits into thinking, content and tool calls
    n: int = 1  # its answers (choices): the stream ends at the n-th Done (shapes/choices.py)

    @property
    def call_id_prefix(self) -> str:
        return "call_" + self.id.rsplit("-", 1)[-1][:12]


@dataclass(frozen=True)
class Answer:
    text: str
    finish_reason: str
    usage: Usage
    logprobs: list[Scored] | None = None  # the echoed prompt's tokens, then the answer's, when asked


class Wording(Protocol):
    """One stream's chunks, from its text as it comes (it may hold text back until it is certain)."""

    def text(self, text: str, logprobs: list[Scored] | None = None, offset: int = 0) -> list[BaseModel]:
        """`logprobs`: the tokens' behind this text, `offset` the characters of token text before them."""
    def end(self, finish_reason: str) -> list[BaseModel]: ...


class Shape(Protocol):
    def opening(self, job: Job) -> BaseModel | None: ...
    def chunk(self, job: Job, text: str | None, finish_reason: str | None,
              logprobs: list[Scored] | None = None, offset: int = 0) -> BaseModel:
        """`logprobs`: this chunk's tokens', `offset` the characters of token text before them."""
    def usage_chunk(self, job: Job, usage: Usage) -> BaseModel: ...
    def whole(self, job: Job, answer: Answer) -> BaseModel: ...
    def wording(self, job: Job) -> Wording: ...


class PlainWording:
    def __init__(self, shape: Shape, job: Job) -> None:
        self.shape, self.job = shape, job

    def text(self, text: str, logprobs: list[Scored] | None = None, offset: int = 0) -> list[BaseModel]:
        return [self.shape.chunk(self.job, text, None, logprobs, offset)] if text or logprobs else []

    def end(self, finish_reason: str) -> list[BaseModel]:
        return [self.shape.chunk(self.job, None, finish_reason)]


def _finish(parts_calls: int, finish_reason: str) -> str:
    """A stopped answer that called tools finished with "tool_calls" (as OpenAI's do)."""
    return "tool_calls" if parts_calls and finish_reason == "stop" else finish_reason


class ChatPartsWording:
    """A chat stream split by shapes/parsing.py: reasoning, content and tool-call deltas."""

    def __init__(self, shape: "ChatShape", job: Job) -> None:
        self.shape, self.job = shape, job
        self.splitter = AnswerSplitter(job.reading, job.call_id_prefix)

    def text(self, text: str, logprobs: list[Scored] | None = None, offset: int = 0) -> list[BaseModel]:
        chunks = self._chunks(self.splitter.push(text))
        if logprobs:  # on the first chunk of this text, or on a chunk of their own while text is held back
            first = chunks[0] if chunks else self.shape.delta_chunk(self.job, Delta())
            first.choices[0].logprobs = chat_logprobs(logprobs)
            chunks = chunks or [first]
        return chunks

    def end(self, finish_reason: str) -> list[BaseModel]:
        chunks = self._chunks(self.splitter.finish())
        reason = _finish(self.splitter.num_calls, finish_reason)
        return [*chunks, self.shape.delta_chunk(self.job, Delta(), reason)]

    def _chunks(self, parts: Parts) -> list[BaseModel]:
        job, shape = self.job, self.shape
        chunks: list[BaseModel] = []
        if parts.reasoning:
            chunks.append(shape.delta_chunk(job, Delta(reasoning_content=parts.reasoning, reasoning=parts.reasoning)))
        if parts.content:
            chunks.append(shape.delta_chunk(job, Delta(content=parts.content)))
        for call in parts.tool_calls:  # id and name first, then the arguments
            chunks.append(shape.delta_chunk(job, Delta(tool_calls=[ToolCallOut(
                index=call.index, id=call.id, type="function", function=FunctionCallOut(name=call.name))])))
            chunks.append(shape.delta_chunk(job, Delta(tool_calls=[ToolCallOut(
                index=call.index, function=FunctionCallOut(arguments=call.arguments))])))
        return chunks


class ChatShape:
    def opening(self, job: Job) -> ChatCompletionChunk:
        return self._chunk(job, [ChunkChoice(delta=Delta(role="assistant", content=""))])

    def chunk(self, job: Job, text: str | None, finish_reason: str | None,
              logprobs: list[Scored] | None = None, offset: int = 0) -> ChatCompletionChunk:
        return self._chunk(job, [ChunkChoice(delta=Delta(content=text), finish_reason=finish_reason,
                                             logprobs=chat_logprobs(logprobs))])

    def usage_chunk(self, job: Job, usage: Usage) -> ChatCompletionChunk:
        return self._chunk(job, [], usage)

    def delta_chunk(self, job: Job, delta: Delta, finish_reason: str | None = None) -> ChatCompletionChunk:
        return self._chunk(job, [ChunkChoice(delta=delta, finish_reason=finish_reason)])

    def wording(self, job: Job) -> Wording:
        return PlainWording(self, job) if job.reading.is_plain else ChatPartsWording(self, job)

    def whole(self, job: Job, answer: Answer) -> ChatCompletion:
        if job.reading.is_plain:
            message, reason = AssistantMessage(content=answer.text), answer.finish_reason
        else:
            parts = split_whole(answer.text, job.reading, job.call_id_prefix)
            calls = [ToolCallOut(id=c.id, type="function", function=FunctionCallOut(name=c.name, arguments=c.arguments))
                     for c in parts.tool_calls]
            message = AssistantMessage(content=parts.content or (None if calls else ""), tool_calls=calls or None,
                                       reasoning_content=parts.reasoning or None, reasoning=parts.reasoning or None)
            reason = _finish(len(calls), answer.finish_reason)
        return ChatCompletion(
            id=job.id, created=job.created, model=job.model, usage=answer.usage,
            choices=[ChatChoice(message=message, finish_reason=reason, logprobs=chat_logprobs(answer.logprobs))],
        )

    @staticmethod
    def _chunk(job: Job, choices: list[ChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=job.id, created=job.created, model=job.model, choices=choices, usage=usage)


class CompletionShape:
    def opening(self, job: Job) -> None:
        return None

    def chunk(self, job: Job, text: str | None, finish_reason: str | None,
              logprobs: list[Scored] | None = None, offset: int = 0) -> TextCompletion:
        return self._body(job, [TextChoice(text=text or "", finish_reason=finish_reason,
                                           logprobs=completion_logprobs(logprobs, offset))])

    def usage_chunk(self, job: Job, usage: Usage) -> TextCompletion:
        return self._body(job, [], usage)

    def wording(self, job: Job) -> Wording:
        return PlainWording(self, job)

    def whole(self, job: Job, answer: Answer) -> TextCompletion:
        choice = TextChoice(text=answer.text, finish_reason=answer.finish_reason,
                            logprobs=completion_logprobs(answer.logprobs, 0))
        return self._body(job, [choice], answer.usage)

    @staticmethod
    def _body(job: Job, choices: list[TextChoice], usage: Usage | None = None) -> TextCompletion:
        return TextCompletion(id=job.id, created=job.created, model=job.model, choices=choices, usage=usage)


def chat_logprobs(entries: list[Scored] | None) -> ChatLogprobs | None:
    if not entries:
        return None
    return ChatLogprobs(content=[
        ChatTokenLogprob(token=e.token, logprob=e.logprob if e.logprob is not None else 0.0, bytes=e.bytes,
                         top_logprobs=[TopLogprob(token=t, logprob=lp, bytes=b) for t, lp, b in e.top or []])
        for e in entries])


def completion_logprobs(entries: list[Scored] | None, offset: int) -> CompletionLogprobs | None:
    """`offset`: characters of token text before these entries (text_offset counts token text)."""
    if not entries:
        return None
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return CompletionLogprobs(
        tokens=[e.token for e in entries], token_logprobs=[e.logprob for e in entries],
        top_logprobs=[None if e.top is None else {t: lp for t, lp, _b in e.top} for e in entries],
        text_offset=offsets)


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

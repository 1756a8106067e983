"""Response bodies of the generation endpoints and /v1/models, in OpenAI's shapes."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, field_serializer, model_serializer

FinishReason = Literal["stop", "length", "tool_calls"]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> "Usage":
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class FunctionCallOut(BaseModel):
    name: str | None = None
    arguments: str = ""  # JSON text (a stream sends it in fragments)


class ToolCallOut(BaseModel):
    """OpenAI's `tool_calls` entry: whole in a message; in a stream, first with index, id, type
    and name, then with argument fragments under the same index."""

    index: int | None = None  # a stream's only
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None  # a thinking model's thoughts (DeepSeek's name)
    reasoning: str | None = None  # the same (vLLM's newer name)
    tool_calls: list[ToolCallOut] | None = None

    @model_serializer(mode="wrap")
    def _without_absent_parts(self, handler: Any) -> dict:
        # content stays even when null (a tool call's message); the rest only when there is some
        body = handler(self)
        return {k: v for k, v in body.items() if v is not None or k == "content"}


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None
    refusal: None = None


class CompletionLogprobs(BaseModel):
    """Completions' (legacy) shape: parallel lists; a prompt's first token has null entries."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason | None
    logprobs: ChatLogprobs | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: FinishReason | None = None
    logprobs: ChatLogprobs | None = None

    @field_serializer("delta")
    def _delta_without_nulls(self, delta: Delta) -> dict:
        # OpenAI sends {"content": "..."} and, in the finish chunk, {}: absent, not null.
        return delta.model_dump(exclude_none=True)  # (a tool call's empty first arguments stay: "")


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class TextChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: FinishReason | None = None
    logprobs: CompletionLogprobs | None = None


class TextCompletion(BaseModel):
    """Both the whole answer and each stream chunk of /v1/completions (OpenAI uses one shape)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "strata"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class RequestObject(BaseModel):
    """A request looked up by id (GET /v1/requests/{id}; the 202 of a background request):
    its status and, once finished, the whole answer as its endpoint words it; once failed,
    cancelled or expired, the error its endpoint would have answered."""

    id: str
    object: Literal["strata.request"] = "strata.request"
    endpoint: str  # /v1/chat/completions or /v1/completions
    model: str
    created: int
    priority: int
    status: str  # waiting, running, finished, failed, cancelled, expired (queues/lifecycle.py)
    response: ChatCompletion | TextCompletion | None = None
    error: dict | None = None  # {"message", "type", "param", "code"}

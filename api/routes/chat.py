"""POST /v1/chat/completions"""

from __future__ import annotations

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import Response

from api import generation
from api.deps import KeyDep, ServicesDep, TokenizerLike
from api.errors import ApiError
from api.generation import Answer, Job
from api.schemas import (
    AssistantMessage, ChatChoice, ChatCompletion, ChatCompletionChunk, ChatCompletionRequest,
    ChunkChoice, Delta, Usage,
)

router = APIRouter(tags=["chat"])


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


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request, services: ServicesDep, key: KeyDep) -> Response:
    generation.check_body(body, services, key)
    prompt = await anyio.to_thread.run_sync(chat_prompt, body, services.tokenizer)
    queued = generation.build_request(
        generation.new_request_id("chatcmpl"), body, prompt, services.settings, param="messages", key=key
    )
    return await generation.answer(request, services, queued, ChatShape(), body, key)


def chat_prompt(body: ChatCompletionRequest, tokenizer: TokenizerLike) -> list[int]:
    """The prompt's token ids (blocking: call it in a thread). Also used for batch lines."""
    # "developer" is OpenAI's newer name for "system"; chat templates know the old one.
    messages = [
        {"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages
    ]
    try:
        return tokenizer.encode_chat(messages)
    except ValueError as error:  # no chat template, or the template refused the messages
        raise ApiError(400, str(error), param="messages", code="invalid_value") from None

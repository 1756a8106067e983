"""POST /v1/completions"""

from __future__ import annotations

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import Response

from api import generation
from api.deps import KeyDep, ServicesDep, TokenizerLike
from api.errors import ApiError
from api.generation import Answer, Job
from api.schemas import CompletionRequest, TextChoice, TextCompletion, Usage

router = APIRouter(tags=["completions"])


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


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request, services: ServicesDep, key: KeyDep) -> Response:
    generation.check_body(body, services, key)
    prompt = await anyio.to_thread.run_sync(completion_prompt, body, services.tokenizer)
    queued = generation.build_request(
        generation.new_request_id("cmpl"), body, prompt, services.settings, param="prompt", key=key
    )
    return await generation.answer(request, services, queued, CompletionShape(), body, key)


def completion_prompt(body: CompletionRequest, tokenizer: TokenizerLike) -> list[int]:
    """The prompt's token ids (blocking: call it in a thread). Also used for batch lines."""
    text = body.prompt_text()
    if text is None:
        raise ApiError(400, "prompt must be a string or a list holding exactly one string.",
                       param="prompt", code="unsupported_value")
    return tokenizer.encode(text)

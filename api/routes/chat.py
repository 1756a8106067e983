"""POST /v1/chat/completions"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from api import completions
from api.deps import KeyDep, ServicesDep
from shapes.answers import CHAT
from shapes.requests import ChatCompletionRequest

router = APIRouter(tags=["chat"])


@router.post(CHAT.path, response_model=None)
async def chat_completions(
    body: ChatCompletionRequest, request: Request, services: ServicesDep, key: KeyDep
) -> Response:
    return await completions.generate(request, services, body, CHAT, key)

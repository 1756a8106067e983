"""POST /v1/completions"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from api import completions
from api.deps import KeyDep, ServicesDep
from shapes.answers import COMPLETIONS
from shapes.requests import CompletionRequest

router = APIRouter(tags=["completions"])


@router.post(COMPLETIONS.path, response_model=None)
async def create_completion(body: CompletionRequest, request: Request, services: ServicesDep, key: KeyDep) -> Response:
    return await completions.generate(request, services, body, COMPLETIONS, key)

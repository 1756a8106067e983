"""POST /v1/completions"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from api import generation
from api.deps import KeyDep, ServicesDep
from shapes.answers import COMPLETIONS
from shapes.requests import CompletionRequest

router = APIRouter(tags=["completions"])


@router.post(COMPLETIONS.path, response_model=None)
async def completions(body: CompletionRequest, request: Request, services: ServicesDep, key: KeyDep) -> Response:
    return await generation.generate(request, services, body, COMPLETIONS, key)

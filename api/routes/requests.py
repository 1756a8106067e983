"""GET /v1/requests/{id}, GET /v1/requests/{id}/events (re-attach), POST /v1/requests/{id}/cancel"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Request
from fastapi.responses import JSONResponse, Response

from api import requests
from api.deps import KeyDep, ServicesDep

router = APIRouter(tags=["requests"])


@router.get("/v1/requests/{request_id}", response_model=None)
async def get_request(request_id: str, services: ServicesDep, key: KeyDep) -> Response:
    found = await requests.lookup(services, request_id, key)
    return JSONResponse(found.model_dump(mode="json"), headers={"x-request-id": request_id})


@router.get("/v1/requests/{request_id}/events", response_model=None)
async def request_events(
    request_id: str, request: Request, services: ServicesDep, key: KeyDep,
    after: str | None = None, last_event_id: Annotated[str | None, Header()] = None,
) -> Response:
    # an EventSource that reconnects sends Last-Event-ID itself: it wins over ?after=
    return await requests.reattach(request, services, request_id, key, last_event_id or after)


@router.post("/v1/requests/{request_id}/cancel", response_model=None)
async def cancel_request(request_id: str, services: ServicesDep, key: KeyDep) -> Response:
    found = await requests.cancel(services, request_id, key)
    return JSONResponse(found.model_dump(mode="json"), headers={"x-request-id": request_id})

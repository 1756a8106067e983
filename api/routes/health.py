"""GET /health: 200 while Redis answers, 503 otherwise (for load balancers and compose)."""

from __future__ import annotations

import asyncio

import redis.exceptions
from fastapi import APIRouter
from fastapi.responses import JSONResponse

from api.deps import RedisDep

router = APIRouter(tags=["health"])

PING_TIMEOUT_S = 2.0


@router.get("/health")
async def health(client: RedisDep) -> JSONResponse:
    try:
        await asyncio.wait_for(client.ping(), PING_TIMEOUT_S)
    except (redis.exceptions.RedisError, OSError, TimeoutError) as error:
        return JSONResponse({"status": "unavailable", "reason": f"redis: {error}"}, status_code=503)
    return JSONResponse({"status": "ok"})

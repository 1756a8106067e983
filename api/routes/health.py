"""GET /health: 200 {"status": "ok"} when the model is being served, else 503 with a reason:

- Redis does not answer (within PING_TIMEOUT_S);
- requests are waiting and no worker of the model has made progress for `health_stall_s`.

While live workers build their compiled decode step in the background (a fresh data folder),
serving eagerly meanwhile, the body says so by worker id:
`"decode_step": {"<worker>": "compiling the decode step, serving eager meanwhile: 40 %"}`.

A worker's progress is its heartbeat: the worker writes it from inside its loop (never from a
separate thread) at least every `heartbeat_s` while the loop turns, so a worker that died, was
stopped, or hangs inside an engine call stops it. The model's last progress is its newest
heartbeat (the `strata:models` score, kept after a worker leaves), or this process's start
when no worker ever beat. With nothing waiting, no worker is needed: healthy."""

from __future__ import annotations

import asyncio

import redis.exceptions
from fastapi import APIRouter
from fastapi.responses import JSONResponse

from api.deps import REPLICA_HEADER, ServicesDep
from queues.membership import live_states, queue_health

router = APIRouter(tags=["health"])

PING_TIMEOUT_S = 2.0


@router.get("/health")
async def health(services: ServicesDep) -> JSONResponse:
    now = services.intake.clock()
    try:
        waiting, beat_ms = await asyncio.wait_for(queue_health(services.redis, services.model_name), PING_TIMEOUT_S)
        states = await asyncio.wait_for(live_states(services.redis, services.model_name, now,
                                                    int(services.settings.worker_live_s * 1000)), PING_TIMEOUT_S)
    except (redis.exceptions.RedisError, OSError, TimeoutError) as error:
        return unavailable(f"redis: {error or type(error).__name__}")
    since_ms = now - max(beat_ms or 0, services.started_ms)
    if waiting and since_ms > services.settings.health_stall_s * 1000:
        return unavailable(
            f"stalled: {waiting} requests waiting and no worker of {services.model_name} "
            f"has made progress for {since_ms / 1000:.1f} s (health_stall_s={services.settings.health_stall_s:g})"
        )
    steps = {worker: state.decode_step_words() for worker, state in states if state.decode_step == "compiling"}
    return JSONResponse({"status": "ok"} | ({"decode_step": steps} if steps else {}),
                        headers={REPLICA_HEADER: services.replica})


def unavailable(reason: str) -> JSONResponse:
    return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)

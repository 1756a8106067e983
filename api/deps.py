"""The objects a route needs, built once by the app's lifespan and handed to routes as typed
dependencies. Nothing else is shared between requests."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Annotated

import redis.asyncio as aioredis
from fastapi import Depends, Request

from api.api_keys import ApiKey, KeyRing, bearer_token
from api.cancels import Cancels
from api.fit import Fit
from api.settings import ApiSettings
from api.shared_reader import SharedReader
from queues.intake import Intake
from shapes.errors import ApiError
from shapes.rules import Rules

REPLICA_HEADER = "x-strata-replica"  # which API process answered: replicas may share one port


@dataclass(frozen=True)
class Services:
    settings: ApiSettings
    redis: aioredis.Redis
    intake: Intake
    rules: Rules  # the served model, its tokenizer and --ctx: what a body is checked against
    started_s: int
    cancels: Cancels  # a client gone: its request is cancelled, later if Redis is away
    fit: Fit  # the ctx and KV pool the live workers publish (--max-model-len / the model's until one has)
    reader: SharedReader  # one XREAD for every answer this process follows
    keys: KeyRing | None = None  # None: no keys file, the server is open
    started_ms: int = 0  # on the intake's clock: /health's reference before any worker beat
    replica: str = ""  # this API process, <host>-<pid>: answers name it (x-strata-replica) when several share a port
    _rules_now: dict[tuple[int, int | None, int | None], Rules] = field(default_factory=dict, repr=False, compare=False)

    @property
    def model_name(self) -> str:
        return self.rules.model_name

    async def rules_now(self) -> Rules:
        """The rules with the context, the KV pool and the slots the workers serve now (one copy
        per change of them, not one per request)."""
        ctx, pool, slots = await self.fit.limits()
        made = self._rules_now.get((ctx, pool, slots))
        if made is None:
            made = replace(self.rules, ctx=ctx, pool_tokens=pool, slots=slots)
            self._rules_now.clear()
            self._rules_now[(ctx, pool, slots)] = made
        return made


# The dependencies are async although they wait for nothing: FastAPI runs a plain `def` dependency
# in its thread pool, a thread hop per dependency per request (bench/load.py's profile).


async def get_services(request: Request) -> Services:
    # The lifespan yields {"services": ...}; Starlette copies it into each request's state.
    return request.state.services


async def get_settings(services: Annotated[Services, Depends(get_services)]) -> ApiSettings:
    return services.settings


async def get_api_key(request: Request, services: Annotated[Services, Depends(get_services)]) -> ApiKey | None:
    """The caller's key (`Authorization: Bearer <key>`); None when the server has no keys file.
    With keys, a missing or unknown key is refused (401 invalid_api_key)."""
    if services.keys is None:
        return None
    token = bearer_token(request.headers.get("authorization"))
    key = services.keys.find(token) if token else None
    if key is None:
        raise ApiError(
            401,
            "Missing API key: send 'Authorization: Bearer <key>'." if token is None else "Incorrect API key provided.",
            code="invalid_api_key", type="invalid_request_error", headers={"WWW-Authenticate": "Bearer"},
        )
    return key


ServicesDep = Annotated[Services, Depends(get_services)]
SettingsDep = Annotated[ApiSettings, Depends(get_settings)]
KeyDep = Annotated[ApiKey | None, Depends(get_api_key)]

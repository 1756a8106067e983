"""The objects a route needs, built once by the app's lifespan and handed to routes as typed
dependencies. Nothing else is shared between requests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Protocol

import redis.asyncio as aioredis
from fastapi import Depends, Request

from api.settings import ApiSettings
from queues.intake import Intake


class TokenizerLike(Protocol):
    """What the API needs of engine.tokenizer.Tokenizer (tests pass a small fake)."""

    def encode(self, text: str) -> list[int]: ...
    def encode_chat(self, messages: list[dict]) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class Services:
    settings: ApiSettings
    redis: aioredis.Redis
    intake: Intake
    tokenizer: TokenizerLike
    model_name: str
    started_s: int


def get_services(request: Request) -> Services:
    # The lifespan yields {"services": ...}; Starlette copies it into each request's state.
    return request.state.services


def get_settings(services: Annotated[Services, Depends(get_services)]) -> ApiSettings:
    return services.settings


def get_intake(services: Annotated[Services, Depends(get_services)]) -> Intake:
    return services.intake


def get_redis(services: Annotated[Services, Depends(get_services)]) -> aioredis.Redis:
    return services.redis


ServicesDep = Annotated[Services, Depends(get_services)]
SettingsDep = Annotated[ApiSettings, Depends(get_settings)]
IntakeDep = Annotated[Intake, Depends(get_intake)]
RedisDep = Annotated[aioredis.Redis, Depends(get_redis)]

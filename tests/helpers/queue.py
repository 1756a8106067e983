"""Enqueueing from synchronous tests, through the API's own path (Intake)."""

from __future__ import annotations

import asyncio
import zlib
from typing import Callable

import redis.asyncio as aioredis

from queues.intake import Intake
from queues.records import QueuedRequest

MODEL = "fake"  # the model name the fake-engine tests queue under


def enqueue(redis_url: str, clock: Callable[[], int], rid: str, *, priority: int = 0, max_tokens: int = 3,
            prompt_len: int = 4, timeout_ms: int | None = None, max_waiting: int = 0) -> int:
    """Enqueue through the API's own path (Intake) at the test's clock; how many wait ahead."""

    async def go() -> int:
        client = aioredis.Redis.from_url(redis_url)
        try:
            request = QueuedRequest(id=rid, priority=priority, prompt=distinct_prompt(rid, prompt_len),
                                    max_tokens=max_tokens)
            intake = Intake(client, MODEL, clock=clock, max_waiting=max_waiting)
            return await intake.enqueue(request, queue_timeout_ms=timeout_ms)
        finally:
            await client.aclose()

    return asyncio.run(go())


class Submit:
    """Enqueue through the API's own path (Intake), from synchronous tests."""

    def __init__(self, redis_url: str) -> None:
        self.redis_url = redis_url

    def __call__(self, rid: str, priority: int = 0, prompt_len: int = 4, max_tokens: int = 3,
                 prompt: list[int] | None = None, **kw) -> None:
        async def go() -> None:
            client = aioredis.Redis.from_url(self.redis_url)
            try:
                await Intake(client, MODEL).enqueue(
                    QueuedRequest(id=rid, priority=priority, prompt=prompt or distinct_prompt(rid, prompt_len),
                                  max_tokens=max_tokens, **kw)
                )
            finally:
                await client.aclose()

        asyncio.run(go())


def distinct_prompt(rid: str, length: int) -> list[int]:
    """Token ids no other request's prompt starts with, so no slot's cached prefix is reused
    unless a test means it to be."""
    start = 1 + (zlib.crc32(rid.encode()) % 100_000) * 10_000
    return list(range(start, start + length))

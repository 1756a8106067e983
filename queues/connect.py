"""One way for every process to reach Redis: clients that retry a command across a dropped
connection (Redis restarting), and a wait for a Redis that is still starting."""

from __future__ import annotations

import logging
import time

import anyio
import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

log = logging.getLogger("strata.redis")

# Redis is gone for now (restarting, network): the caller waits and tries again.
UNAVAILABLE = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)


def _options(retry: type) -> dict:
    return dict(
        socket_connect_timeout=5,
        health_check_interval=30,
        retry=retry(ExponentialBackoff(cap=1.0, base=0.05), retries=3),
        retry_on_error=list(UNAVAILABLE),
    )


def connect(url: str, *, within_s: float = 20.0, decode_responses: bool = True) -> redis.Redis:
    """A synchronous client, once Redis answers (it may still be starting)."""
    client = redis.Redis.from_url(url, decode_responses=decode_responses, **_options(Retry))
    deadline = time.monotonic() + within_s
    delay = 0.1
    while True:
        try:
            client.ping()
            return client
        except (*UNAVAILABLE, OSError):
            if time.monotonic() >= deadline:
                raise
            log.warning("waiting for Redis at %s", url)
            time.sleep(delay)
            delay = min(delay * 2, 2.0)


def connect_async(url: str) -> aioredis.Redis:
    """An asyncio client; `await wait_until_up(client, s)` before relying on it."""
    return aioredis.Redis.from_url(url, **_options(AsyncRetry))


async def wait_until_up(client: aioredis.Redis, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    delay = 0.1
    while True:
        try:
            await client.ping()
            return
        except (*UNAVAILABLE, OSError):
            if time.monotonic() >= deadline:
                raise
            log.warning("waiting for Redis (%s)", client)
            await anyio.sleep(delay)
            delay = min(delay * 2, 2.0)

"""The API over real HTTP (uvicorn in a thread), a real Redis, and the fake-engine worker, all on
one virtual clock: queue times, heartbeats and stalls are exact and nothing sleeps."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

import httpx
import pytest
import redis.asyncio as aioredis

from api.app import create_app
from api.settings import ApiSettings
from engine.fake import VirtualClock
from queues.intake import Intake
from queues.records import QueuedRequest
from tests.helpers.api import FakeTokenizer
from tests.helpers.http import serve_app
from tests.helpers.workers import MODEL, make_worker  # noqa: F401 - make_worker re-exported

__all__ = ["MODEL", "make_worker", "enqueue", "metric_samples"]


@contextmanager
def serve(settings: ApiSettings, clock: Callable[[], int] | None) -> Iterator[str]:
    with serve_app(create_app(settings, tokenizer=FakeTokenizer(), clock=clock)) as base_url:
        yield base_url


@pytest.fixture
def start_api(redis_url: str) -> Iterator[Callable[..., httpx.Client]]:
    """start_api(clock=None, **settings) -> an httpx client on a fresh server for model "fake"."""
    with ExitStack() as stack:

        def start(clock: Callable[[], int] | None = None, **overrides) -> httpx.Client:
            fields = dict(redis_url=redis_url, served_model_name=MODEL, ctx=4096, default_max_tokens=3)
            fields.update(overrides)
            base = stack.enter_context(serve(ApiSettings(**fields), clock))
            return stack.enter_context(httpx.Client(base_url=base, timeout=10))

        yield start


@pytest.fixture
def clock() -> VirtualClock:
    return VirtualClock(now_ms=1_000_000)


def enqueue(redis_url: str, clock: Callable[[], int], rid: str, priority: int = 0, prompt_len: int = 4,
            max_tokens: int = 3) -> None:
    """Enqueue through the API's own path (Intake) on the test's clock."""

    async def go() -> None:
        client = aioredis.Redis.from_url(redis_url)
        try:
            request = QueuedRequest(id=rid, priority=priority, prompt=list(range(1, prompt_len + 1)),
                                    max_tokens=max_tokens)
            await Intake(client, MODEL, clock=clock).enqueue(request)
        finally:
            await client.aclose()

    asyncio.run(go())


def metric_samples(http: httpx.Client) -> dict[tuple[str, frozenset], float]:
    """/metrics parsed with prometheus_client's own parser: (sample name, labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    response = http.get("/metrics")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }

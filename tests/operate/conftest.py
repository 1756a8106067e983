"""The API over real HTTP (uvicorn in a thread), a real Redis, and the fake-engine worker, all on
one virtual clock: queue times, heartbeats and stalls are exact and nothing sleeps."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

import httpx
import pytest

from api.app import create_app
from api.settings import ApiSettings
from engine.fake import VirtualClock
from tests.helpers.api import FakeTokenizer
from tests.helpers.http import serve_app
from tests.helpers.workers import MODEL


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

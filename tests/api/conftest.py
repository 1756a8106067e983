"""A real uvicorn server on a free port, a real Redis, and a test that plays the worker."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack

import httpx
import pytest
import redis

from api.settings import ApiSettings
from tests.helpers.api import MODEL, FakeTokenizer, Worker, serve


@pytest.fixture
def start_api(redis_url: str) -> Iterator[Callable[..., str]]:
    """start_api(**settings) -> base URL of a fresh server (model "tiny", ctx 64 by default)."""
    with ExitStack() as stack:

        def start(tokenizer=FakeTokenizer(), **overrides) -> str:
            fields = dict(redis_url=redis_url, served_model_name=MODEL, ctx=64, default_max_tokens=16)
            fields.update(overrides)
            return stack.enter_context(serve(ApiSettings(**fields), tokenizer))

        yield start


@pytest.fixture
def api(start_api) -> str:
    return start_api()


@pytest.fixture
def http(api: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=api, timeout=10) as client:
        yield client


@pytest.fixture
def worker(redis_client: redis.Redis) -> Worker:
    return Worker(redis_client)

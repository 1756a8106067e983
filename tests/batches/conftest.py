"""The start_stack fixture: the real stack for batches (tests/helpers/batches.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack

import httpx
import pytest
import redis

from api.settings import ApiSettings
from tests.helpers.batches import MODEL, BatchWorkerProcess, Stack, fake_worker, serve_api


@pytest.fixture
def start_stack(redis_url: str) -> Iterator[Callable[..., Stack]]:
    """start_stack(slots=, step_s=, batch_worker=True, api=dict(...), **batch worker settings)."""
    with ExitStack() as stack:

        def start(*, slots: int = 2, step_s: float = 0.0, worker: bool = True, batch_worker: bool = True,
                  api: dict | None = None, **batch_settings: object) -> Stack:
            fields = dict(redis_url=redis_url, served_model_name=MODEL, ctx=512, default_max_tokens=8)
            fields.update(api or {})
            base_url = stack.enter_context(serve_api(ApiSettings(**fields)))
            client = redis.Redis.from_url(redis_url, decode_responses=True)
            stack.callback(client.close)
            http = stack.enter_context(httpx.Client(base_url=base_url, timeout=30))
            if worker:
                stack.enter_context(fake_worker(redis_url, slots, step_s))
            if batch_worker:
                process = BatchWorkerProcess(redis_url, **batch_settings)
                stack.callback(process.stop)
            return Stack(base_url, redis_url, client, http)

        yield start

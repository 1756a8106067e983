"""A real uvicorn server on a free port, a real Redis, and a test that plays the worker."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

import httpx
import pytest
import redis

from api.app import create_app
from api.settings import ApiSettings
from queues.keys import Keys
from queues.records import Event, event_fields
from tests.conftest import serve_app

MODEL = "tiny"


class FakeTokenizer:
    """One token per character: prompt lengths are easy to reason about."""

    eos_token_ids = frozenset({0})

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def encode_chat(self, messages: list[dict]) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"
        return self.encode(text)

    def decode(self, ids: list[int]) -> str:
        return "".join(map(chr, ids))


@contextmanager
def serve(settings: ApiSettings, tokenizer=None) -> Iterator[str]:
    with serve_app(create_app(settings, tokenizer=tokenizer)) as base_url:
        yield base_url


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


class Worker:
    """Plays a worker: finds waiting requests and writes their output events."""

    def __init__(self, client: redis.Redis, model: str = MODEL) -> None:
        self.client = client
        self.keys = Keys(model)

    def waiting(self) -> list[str]:
        return [m.split(":", 1)[1] for m in self.client.zrange(self.keys.waiting, 0, -1)]

    def wait_for(self, count: int, timeout_s: float = 10) -> list[str]:
        deadline = time.monotonic() + timeout_s
        while len(ids := self.waiting()) < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"expected {count} waiting, have {ids}")
            time.sleep(0.01)
        return ids

    def record(self, request_id: str) -> dict[str, str]:
        return self.client.hgetall(self.keys.req(request_id))

    def prompt(self, request_id: str) -> list[int]:
        return json.loads(self.record(request_id)["prompt"])

    def publish(self, request_id: str, *events: Event) -> list[str]:
        return [self.client.xadd(self.keys.out(request_id), event_fields(e)) for e in events]


@pytest.fixture
def worker(redis_client: redis.Redis) -> Worker:
    return Worker(redis_client)

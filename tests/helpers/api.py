"""The API's tests: a one-token-per-character tokenizer, a real server for some settings, a
stand-in worker that writes output events by hand, and readers of the answers and error bodies."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import redis

from api.app import create_app
from api.settings import ApiSettings
from queues.keys import Keys, Member
from queues.records import Event, event_fields
from tests.helpers.http import serve_app, sse

MODEL = "tiny"
CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]


class FakeTokenizer:
    """One token per character: prompt lengths are easy to reason about."""

    eos_token_ids = frozenset({0})
    vocab_size = 0x110000  # every code point: token ids past it are refused at the door, as a real vocabulary's


    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def encode_chat(self, messages: list[dict]) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"
        return self.encode(text)

    def decode(self, ids: list[int]) -> str:
        # a lone surrogate is no text (UTF-8 cannot carry it): U+FFFD, as a real tokenizer's lossy decode
        return "".join("\ufffd" if 0xD800 <= i <= 0xDFFF else chr(i) for i in ids)


@contextmanager
def serve(settings: ApiSettings, tokenizer=None) -> Iterator[str]:
    with serve_app(create_app(settings, tokenizer=tokenizer)) as base_url:
        yield base_url


class Worker:
    """Plays a worker: finds waiting requests and writes their output events."""

    def __init__(self, client: redis.Redis, model: str = MODEL) -> None:
        self.client = client
        self.keys = Keys(model)

    def waiting(self) -> list[str]:
        return [Member.parse(m).id for m in self.client.zrange(self.keys.waiting, 0, -1)]

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


def sse_events(response: httpx.Response) -> list[dict]:
    """Each SSE event as {"id": ..., "data": ...}; comments skipped."""
    return list(sse(response.iter_lines()))


def assert_error(response: httpx.Response, status: int, *, code=None, param=None):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    if code is not None:
        assert body["error"]["code"] == code
    if param is not None:
        assert body["error"]["param"] == param
    return body["error"]


def assert_still_serves(http: httpx.Client, worker):
    assert http.get("/health").json() == {"status": "ok"}
    with http.stream("POST", CHAT, json={"messages": HI, "stream": True, "priority": 3}) as response:
        assert response.status_code == 200
        request_id = response.headers["x-request-id"]
        assert worker.wait_for(1) == [request_id]
        assert worker.record(request_id)["priority"] == "3"

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

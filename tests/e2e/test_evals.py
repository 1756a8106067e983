"""The evaluation battery's API end to end (issue 29): a real worker on the default engine
(the SmolLM2 GGUF in bf16 with int4 linears, two slots, eager), a real API and Redis."""

from __future__ import annotations

import os
from collections.abc import Iterator

import httpx
import pytest
import redis

from queues.keys import models_key
from queues.server import EmbeddedRedis, free_port
from tests.e2e.conftest import EAGER, MODEL, Stack, healthy, start, stop, wait_until

pytestmark = pytest.mark.smollm2

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    server = EmbeddedRedis(tmp_path_factory.mktemp("evals-redis"), appendonly=False).start()
    port = free_port()
    env = {**os.environ, "STRATA_REDIS_URL": server.url, "STRATA_PORT": str(port), "STRATA_PARALLEL": "2",
           "STRATA_PREFILL_CHUNK": "64", "STRATA_CTX": "1024", "STRATA_THREADS": "2", **EAGER}
    env.pop("REDIS_URL", None)
    env.pop("STRATA_DTYPE", None)  # the default engine
    worker, api = start("worker", env), start("api", env)
    client = redis.Redis.from_url(server.url, decode_responses=True)
    stack = Stack(f"http://127.0.0.1:{port}", server.url, client, worker, api)
    try:
        wait_until(lambda: client.zscore(models_key(), MODEL) is not None, "the worker's heartbeat")
        wait_until(lambda: healthy(stack.base_url), "the API")
        yield stack
    finally:
        stop(api)
        stop(worker)
        client.close()
        server.stop()


def _answer_ids(stack: Stack, response: httpx.Response) -> list[int]:
    """The token ids the worker streamed for this answer (its Redis output stream)."""
    entries = stack.redis.xrange(stack.keys.out(response.headers["x-request-id"]))
    return [int(i) for _, fields in entries if fields.get("type") == "token" for i in fields["ids"].split(",") if i]


def _chat(stack: Stack, **body) -> httpx.Response:
    response = httpx.post(f"{stack.base_url}/v1/chat/completions", timeout=120,
                          json={"messages": QUESTION, "max_tokens": 12, "temperature": 0, **body})
    assert response.status_code == 200, response.text
    return response


def test_banned_tokens_never_appear_in_a_real_answer(stack: Stack):
    plain = _chat(stack)
    banned = sorted(set(_answer_ids(stack, plain)))
    assert banned
    biased = _chat(stack, logit_bias={str(t): -100 for t in banned})
    ids = _answer_ids(stack, biased)
    assert ids and not set(ids) & set(banned)
    assert biased.json()["choices"][0]["message"]["content"] != plain.json()["choices"][0]["message"]["content"]


def test_sampling_controls_are_bounded_at_the_door(stack: Stack):
    for field, value in [("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0),
                         ("min_p", 1.5), ("logit_bias", {"12": 101}), ("logit_bias", {"x": 1}),
                         ("logit_bias", {"999999": -100})]:
        response = httpx.post(f"{stack.base_url}/v1/chat/completions", timeout=30,
                              json={"messages": QUESTION, field: value})
        assert response.status_code == 400, (field, value, response.text)
        assert response.json()["error"]["param"] == field, response.json()

"""The three queue policies end to end: a real `strata worker` started with `--reserve 1:10
--aging-s 30`, a real `strata api`, real HTTP and the real SmolLM2 file. A battery request keeps
the one unreserved slot decoding; the next battery request waits although the reserved slot is
free; an alert takes that slot; a request with a short queue_timeout gets 408."""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis

from queues.keys import Keys, models_key
from queues.server import EmbeddedRedis, free_port
from queues.worker_state import WorkerState
from tests.e2e.conftest import EAGER, MODEL, healthy, start, stop, wait_until

K = Keys(MODEL)


@pytest.fixture(scope="module")
def policed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, redis.Redis]]:
    server = EmbeddedRedis(tmp_path_factory.mktemp("e2e-policies"), appendonly=False).start()
    port = free_port()
    env = {**os.environ, "STRATA_REDIS_URL": server.url, "STRATA_PORT": str(port), "STRATA_DTYPE": "float32",
           "STRATA_PREFILL_CHUNK": "64", "STRATA_CTX": "1024", "STRATA_THREADS": "2", **EAGER}
    env.pop("REDIS_URL", None)
    worker = start("worker", env, "--parallel", "2", "--reserve", "1:10", "--aging-s", "30")
    api = start("api", env)
    client = redis.Redis.from_url(server.url, decode_responses=True)
    try:
        wait_until(lambda: client.zscore(models_key(), MODEL) is not None, "the worker's heartbeat")
        wait_until(lambda: healthy(f"http://127.0.0.1:{port}"), "the API")
        yield f"http://127.0.0.1:{port}", client
    finally:
        stop(api)
        stop(worker)
        client.close()
        server.stop()


def ask(base_url: str, content: str, priority: int, max_tokens: int, **extra) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "priority": priority,
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}
    return httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=900)  # a loaded 2-core machine is slow, not wrong


def test_reserve_aging_and_deadlines_through_http(policed):
    base_url, client = policed
    assert client.hget(K.policy, "aging_s") == "30.0"
    worker_id = client.zrange(K.workers, 0, -1)[0]
    assert WorkerState.from_hash(client.hgetall(K.worker(worker_id))).reserved == {1: 10}
    with ThreadPoolExecutor(4) as pool:
        first = pool.submit(ask, base_url, "Count slowly from one to a thousand.", 0, 160)
        wait_until(lambda: client.zcard(K.running) == 1, "the first battery request's claim", 60)
        second = pool.submit(ask, base_url, "List every prime below ten thousand.", 0, 8)
        wait_until(lambda: client.zcard(K.waiting) == 1, "the second battery request to queue", 60)

        impatient = ask(base_url, "Name a colour.", 0, 4, queue_timeout=0.5)
        assert impatient.status_code == 408, impatient.text
        assert impatient.json()["error"]["code"] == "queue_timeout"

        alert = ask(base_url, "Disk /var is 97% full on db-3. Summarize.", 10, 4)
        assert alert.status_code == 200, alert.text
        alert_id = alert.headers["x-request-id"]
        assert client.hget(K.req(alert_id), "slot") == "1"
        assert client.zcard(K.waiting) == 1  # the second battery request still waits for slot 0
        assert first.result().status_code == 200 and second.result().status_code == 200
    records = {r: client.hgetall(K.req(r)) for r in (alert_id, impatient.headers["x-request-id"])}
    assert records[impatient.headers["x-request-id"]]["status"] == "expired"
    assert records[alert_id]["status"] == "finished"

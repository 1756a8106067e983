"""queue_timeout over real HTTP on one virtual clock: a request nobody claims in time gets 408
queue_timeout (whole) or an SSE error event then [DONE] (stream), expired by the API itself with
no worker alive; counted in /metrics by priority; the header, the key's default and maximum;
bad values are a 400."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from queues.keys import Keys, Member
from tests.helpers.api import metric_samples
from tests.helpers.workers import MODEL, make_worker

K = Keys(MODEL)
ALERTS = "sk-alerts-3f9a7c1e5b"
KEYS_YAML = f"""
keys:
  - name: alerts
    key: "{ALERTS}"
    default_queue_timeout: 5
    max_queue_timeout: 10
"""


def body(**extra) -> dict:
    return {"prompt": "hi", "max_tokens": 2, **extra}


def wait_until(check, clock) -> None:  # noqa: ANN001
    """Real waiting for the server thread to reach a state; never a time assertion."""
    import time

    for _ in range(400):
        if check():
            return
        time.sleep(0.025)
    raise AssertionError("the server never got there")


def waiting_ids(redis_client) -> list[str]:
    return [Member.parse(m).id for m in redis_client.zrange(K.waiting, 0, -1)]


def test_nobody_claims_it_in_time_408_and_counted(start_api, redis_client, clock):
    http = start_api(clock=clock)
    with ThreadPoolExecutor(1) as pool:
        # the client waits as long as the test may (wait_until's 10 s, then 20 s): its own 10 s read
        # timeout ran out first once on a loaded machine
        pending = pool.submit(http.post, "/v1/completions", json=body(queue_timeout=2, priority=5), timeout=40)
        wait_until(lambda: len(waiting_ids(redis_client)) == 1, clock)
        rid = waiting_ids(redis_client)[0]
        assert redis_client.hget(K.req(rid), "queue_deadline_ms") == str(clock() + 2000)
        clock.advance(1999)
        with pytest.raises(TimeoutError):
            pending.result(timeout=0.6)  # not yet
        clock.advance(1)
        response = pending.result(timeout=20)
    assert response.status_code == 408
    error = response.json()["error"]
    assert (error["code"], error["type"], error["param"]) == ("queue_timeout", "timeout_error", "queue_timeout")
    assert "2 s" in error["message"] and response.headers["x-request-id"] == rid
    assert redis_client.hget(K.req(rid), "status") == "expired" and waiting_ids(redis_client) == []
    samples = metric_samples(http)
    assert samples[("strata_requests_ended_total", frozenset({"model": MODEL, "priority": "5", "status": "expired"}.items()))] == 1


def test_a_stream_gets_an_error_event_then_done(start_api, redis_client, clock):
    http = start_api(clock=clock)
    with http.stream("POST", "/v1/completions", json=body(stream=True),
                     headers={"x-strata-queue-timeout": "1.5"}) as response:
        assert response.status_code == 200 and response.headers["x-strata-queue-timeout"] == "1.5"
        lines = response.iter_lines()
        assert next(lines) == ": accepted"  # the stream has started: an error can only be an event now
        clock.advance(1500)
        rest = [line for line in lines if line.startswith("data: ")]
    assert json.loads(rest[0][6:])["error"]["code"] == "queue_timeout"
    assert rest[1:] == ["data: [DONE]"]


def test_claimed_in_time_it_is_served(start_api, redis_client, clock):
    http = start_api(clock=clock)
    worker = make_worker(redis_client, slots=1, clock=clock)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(http.post, "/v1/completions", json=body(queue_timeout=1), timeout=40)
        wait_until(lambda: len(waiting_ids(redis_client)) == 1, clock)
        clock.advance(999)
        for _ in range(5):
            worker.step()
        clock.advance(10_000)
        response = pending.result(timeout=20)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("extra, headers, param", [
    ({"queue_timeout": -1}, {}, "queue_timeout"),
    ({"queue_timeout": 0}, {}, "queue_timeout"),
    ({"queue_timeout": "soon"}, {}, "queue_timeout"),
    ({"queue_timeout": 1e9}, {}, "queue_timeout"),
    ({}, {"x-strata-queue-timeout": "soon"}, "x-strata-queue-timeout"),
    ({}, {"x-strata-queue-timeout": "-3"}, "x-strata-queue-timeout"),
    ({}, {"x-strata-queue-timeout": "nan"}, "x-strata-queue-timeout"),
])
def test_bad_values_are_a_400(start_api, redis_client, extra, headers, param):
    http = start_api()
    response = http.post("/v1/completions", json=body(**extra), headers=headers)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert redis_client.zcard(K.waiting) == 0


def test_the_keys_default_and_maximum(start_api, tmp_path, redis_client):
    path = tmp_path / "keys.yaml"
    path.write_text(KEYS_YAML)
    http = start_api(keys_file=str(path))

    def ask(**extra) -> httpx.Response:
        with http.stream("POST", "/v1/completions", json=body(stream=True, **extra),
                         headers={"Authorization": f"Bearer {ALERTS}"}) as response:
            return response

    default = ask()
    assert default.headers["x-strata-queue-timeout"] == "5" and "x-strata-queue-timeout-lowered" not in default.headers
    capped = ask(queue_timeout=60)
    assert capped.headers["x-strata-queue-timeout"] == "10"
    assert capped.headers["x-strata-queue-timeout-lowered"] == "60->10"
    assert ask(queue_timeout=0.5).headers["x-strata-queue-timeout"] == "0.5"
    record = redis_client.hgetall(K.req(capped.headers["x-request-id"]))
    assert int(record["queue_deadline_ms"]) - int(record["enqueued_ms"]) == 10_000

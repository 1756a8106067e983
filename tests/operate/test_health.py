"""/health fails when requests wait and no worker makes progress, or Redis is gone; /v1/models
lists the model only while one of its workers is live. One virtual clock, no sleeps."""

from __future__ import annotations

import httpx

from queues.server import EmbeddedRedis
from tests.helpers.queue import enqueue
from tests.helpers.workers import MODEL, make_worker


def models(http: httpx.Client) -> list[str]:
    return [m["id"] for m in http.get("/v1/models").json()["data"]]


def test_health_fails_when_the_only_worker_stopped_with_requests_waiting(start_api, redis_url, redis_client, clock):
    http = start_api(clock=clock, health_stall_s=5)
    worker = make_worker(redis_client, slots=1, clock=clock)
    enqueue(redis_url, clock, "busy", max_tokens=1000)
    worker.step()  # claims "busy" and beats
    enqueue(redis_url, clock, "waits")
    assert http.get("/health").json() == {"status": "ok"}
    worker.stop()  # gives "busy" back: two wait, nobody serves them
    assert worker.clock() - 1_000_000 < 5000
    clock.now_ms = worker.clock() + 4000
    assert http.get("/health").status_code == 200  # not yet stalled_s
    clock.advance(2000)
    response = http.get("/health")
    assert response.status_code == 503
    body = response.json()
    assert body["status"] == "unavailable" and body["reason"].startswith("stalled: 2 requests waiting")

    make_worker(redis_client, slots=1, clock=clock, worker_id="w2").step()  # a new worker progresses
    assert http.get("/health").status_code == 200


def test_health_with_nothing_waiting_needs_no_worker(start_api, clock):
    http = start_api(clock=clock, health_stall_s=5)
    clock.advance(60_000)
    assert http.get("/health").json() == {"status": "ok"}


def test_a_busy_worker_that_keeps_stepping_is_healthy(start_api, redis_url, redis_client, clock):
    http = start_api(clock=clock, health_stall_s=5)
    worker = make_worker(redis_client, slots=1, clock=clock, decode_ms_per_step=1000)
    enqueue(redis_url, clock, "long", max_tokens=50)
    enqueue(redis_url, clock, "next")
    for _ in range(20):  # 20 virtual seconds of decoding while "next" waits
        worker.step()
        assert http.get("/health").status_code == 200
    assert clock() - 1_000_000 > 10_000


def test_health_fails_when_redis_is_unreachable(start_api, tmp_path):
    server = EmbeddedRedis(data_dir=tmp_path, appendonly=False).start()
    try:
        http = start_api(redis_url=server.url)
        assert http.get("/health").status_code == 200
    finally:
        server.stop()
    response = http.get("/health")
    assert response.status_code == 503
    assert response.json()["reason"].startswith("redis:")


def test_models_lists_the_model_only_while_a_worker_is_live(start_api, redis_client, clock):
    http = start_api(clock=clock, worker_live_s=10)
    assert models(http) == []
    assert http.get(f"/v1/models/{MODEL}").status_code == 404
    worker = make_worker(redis_client, slots=1, clock=clock)
    worker.step()  # heartbeat
    assert models(http) == [MODEL]
    assert http.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    clock.advance(10_001)  # no heartbeat for longer than worker_live_s: a hung or dead worker
    assert models(http) == []
    assert http.get(f"/v1/models/{MODEL}").status_code == 404
    worker.step()
    assert models(http) == [MODEL]
    worker.stop()  # a clean stop leaves at once
    assert models(http) == []
    # requests for the configured model are still accepted: they wait for a worker
    with http.stream("POST", "/v1/completions", json={"prompt": "x", "stream": True}) as response:
        assert response.status_code == 200


def test_health_and_models_say_a_worker_serves_eagerly_while_its_compiled_step_builds(start_api, redis_client, clock):
    from engine.protocol import DecodePath

    http = start_api(clock=clock, health_stall_s=5)
    worker = make_worker(redis_client, slots=1, clock=clock, path=DecodePath("compiling", 40))
    worker.step()  # beats
    assert http.get("/health").json() == {
        "status": "ok", "decode_step": {"w1": "compiling the decode step, serving eager meanwhile: 40 %"}}
    assert models(http) == [MODEL]  # served meanwhile: listed at once
    worker.engine.path = DecodePath("compiled")
    clock.advance(2000)
    worker.step()
    assert http.get("/health").json() == {"status": "ok"}

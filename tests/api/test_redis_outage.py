"""Redis going away: /health says 503, a request gets 503 in the error shape, and both recover
when Redis is back, without restarting the API."""

import json
import threading
import time

import httpx
import pytest
import redis

from queues.records import Done, Token
from queues.server import EmbeddedRedis
from tests.helpers.api import Worker


def test_health_and_requests_follow_redis(start_api, tmp_path):
    server = EmbeddedRedis(data_dir=tmp_path, appendonly=False).start()
    try:
        base = start_api(redis_url=server.url)
        with httpx.Client(base_url=base, timeout=20) as http:
            assert http.get("/health").status_code == 200
            server.stop()
            assert http.get("/health").status_code == 503
            response = http.post("/v1/completions", json={"prompt": "x"})
            assert response.status_code == 503
            assert response.json()["error"]["code"] == "queue_unavailable"
            server = EmbeddedRedis(data_dir=tmp_path, port=server.port, appendonly=False).start()
            assert http.get("/health").json() == {"status": "ok"}
            with http.stream("POST", "/v1/completions", json={"prompt": "x", "stream": True}) as streamed:
                assert streamed.status_code == 200
    finally:
        server.stop()


class Outage:
    """A Redis that can crash and come back on the same port and files, a test playing the
    worker, and one streaming request through a real API."""

    def __init__(self, start_api, tmp_path, redis_wait_s: float) -> None:
        self.tmp_path = tmp_path
        self.server = EmbeddedRedis(data_dir=tmp_path, appendonly=True).start()
        self.client = redis.Redis.from_url(self.server.url, decode_responses=True)
        self.worker = Worker(self.client)
        self.lines: list[str] = []
        base = start_api(redis_url=self.server.url, redis_wait_s=redis_wait_s)
        self.thread = threading.Thread(target=self._stream, args=(base,))
        self.thread.start()
        (self.rid,) = self.worker.wait_for(1)

    def _stream(self, base: str) -> None:
        with httpx.stream("POST", f"{base}/v1/completions", timeout=60, json={"prompt": "x", "stream": True}) as r:
            self.lines.append(f"status {r.status_code}")
            self.lines.extend(line for line in r.iter_lines() if line.startswith("data: "))

    def crash(self) -> None:
        self.server.process.kill()  # no goodbye
        self.server.process.wait()

    def restart(self) -> None:
        self.server = EmbeddedRedis(data_dir=self.tmp_path, port=self.server.port, appendonly=True).start()

    def close(self) -> None:
        self.client.close()
        self.server.stop()


@pytest.fixture
def outage(start_api, tmp_path):
    made: list[Outage] = []

    def make(redis_wait_s: float) -> Outage:
        made.append(Outage(start_api, tmp_path, redis_wait_s))
        return made[-1]

    yield make
    for o in made:
        o.close()


def test_a_stream_waits_out_a_redis_restart_and_continues(outage):
    o = outage(redis_wait_s=30)
    o.worker.publish(o.rid, Token("a", [97]))
    o.crash()
    time.sleep(1.5)  # the stream keeps waiting
    o.restart()
    o.worker.publish(o.rid, Token("b", [98]), Done("stop", 1, 2))
    o.thread.join(30)
    assert o.lines[0] == "status 200" and o.lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in o.lines[1:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "ab"
    assert not any("error" in c for c in chunks)
    assert o.worker.record(o.rid)["status"] == "waiting"  # not cancelled: the answer was read whole


def test_past_redis_wait_s_a_stream_ends_with_unavailable_and_the_cancel_arrives_later(outage):
    o = outage(redis_wait_s=1)
    o.crash()
    o.thread.join(30)
    assert o.lines[-1] == "data: [DONE]"
    error = json.loads(o.lines[-2][6:])["error"]
    assert (error["code"], error["type"]) == ("unavailable", "service_unavailable")
    o.restart()
    deadline = time.monotonic() + 20
    while o.worker.record(o.rid).get("status") != "cancelled":  # delivered once Redis is back
        assert time.monotonic() < deadline, o.worker.record(o.rid)
        time.sleep(0.1)
    assert o.client.zcard(o.worker.keys.waiting) == 0

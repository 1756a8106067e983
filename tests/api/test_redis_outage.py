"""Redis going away: /health says 503, a request gets 503 in the error shape, and both recover
when Redis is back, without restarting the API."""

import json
import threading
import time

import httpx
import redis

from queues.records import Done, Token
from queues.server import EmbeddedRedis
from tests.api.conftest import Worker


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


def _stream_in_thread(base: str, out: list[str]) -> threading.Thread:
    def run() -> None:
        with httpx.stream("POST", f"{base}/v1/completions", timeout=60,
                          json={"prompt": "x", "stream": True}) as r:
            out.append(f"status {r.status_code}")
            out.extend(line for line in r.iter_lines() if line.startswith("data: "))

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _kill(server: EmbeddedRedis) -> None:
    server.process.kill()  # no goodbye: as if it crashed
    server.process.wait()


def test_a_stream_waits_out_a_redis_restart_and_continues(start_api, tmp_path):
    server = EmbeddedRedis(data_dir=tmp_path, appendonly=True).start()
    client = redis.Redis.from_url(server.url, decode_responses=True)
    try:
        base = start_api(redis_url=server.url, redis_wait_s=30)
        worker = Worker(client)
        lines: list[str] = []
        thread = _stream_in_thread(base, lines)
        (rid,) = worker.wait_for(1)
        worker.publish(rid, Token("a", [97]))
        _kill(server)
        time.sleep(1.5)  # the stream keeps waiting
        server = EmbeddedRedis(data_dir=tmp_path, port=server.port, appendonly=True).start()
        worker.publish(rid, Token("b", [98]), Done("stop", 1, 2))
        thread.join(30)
        assert lines[0] == "status 200" and lines[-1] == "data: [DONE]"
        chunks = [json.loads(line[6:]) for line in lines[1:-1]]
        assert "".join(c["choices"][0]["text"] for c in chunks) == "ab"
        assert not any("error" in c for c in chunks)
        assert worker.record(rid)["status"] == "waiting"  # not cancelled: the answer was read whole
    finally:
        client.close()
        server.stop()


def test_past_redis_wait_s_a_stream_ends_with_unavailable_and_the_cancel_arrives_later(start_api, tmp_path):
    server = EmbeddedRedis(data_dir=tmp_path, appendonly=True).start()
    client = redis.Redis.from_url(server.url, decode_responses=True)
    try:
        base = start_api(redis_url=server.url, redis_wait_s=1)
        worker = Worker(client)
        lines: list[str] = []
        thread = _stream_in_thread(base, lines)
        (rid,) = worker.wait_for(1)
        _kill(server)
        thread.join(30)
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2][6:])["error"]
        assert (error["code"], error["type"]) == ("unavailable", "service_unavailable")
        server = EmbeddedRedis(data_dir=tmp_path, port=server.port, appendonly=True).start()
        deadline = time.monotonic() + 20
        while worker.record(rid).get("status") != "cancelled":  # delivered once Redis is back
            assert time.monotonic() < deadline, worker.record(rid)
            time.sleep(0.1)
        assert client.zcard(worker.keys.waiting) == 0
    finally:
        client.close()
        server.stop()

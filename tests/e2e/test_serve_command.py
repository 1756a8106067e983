"""`strata serve` on a fresh data folder: embedded Redis, API and worker from one command, and a
clean stop on SIGTERM."""

from __future__ import annotations


import httpx
import pytest
import redis

from queues.server import free_port
from queues.settings import environ_without_settings
from tests.e2e.conftest import MODEL, healthy, start, stop, wait_until

pytestmark = pytest.mark.smollm2


def test_serve_starts_everything_answers_and_stops_cleanly(tmp_path):
    port = free_port()
    data = tmp_path / "data"
    env = environ_without_settings()
    serve = start("serve", env, "--port", str(port), "--data-dir", str(data), "--parallel", "2", "--threads", "2")
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: healthy(base), "the API", 180)
        # a fresh data folder: the worker compiles its decode step ahead of time first (~1-2 min)
        wait_until(lambda: MODEL in [m["id"] for m in httpx.get(f"{base}/v1/models").json()["data"]], "the model", 400)
        r = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
            "model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] > 0
        assert (data / "redis.url").read_text().startswith("redis://127.0.0.1:")
        assert any(p.name.startswith("appendonly") for p in data.iterdir())  # persistence is on
        embedded = redis.Redis.from_url((data / "redis.url").read_text())
        assert embedded.config_get("appendfsync") == {"appendfsync": "everysec"}  # --redis-fsync's default
        embedded.close()
    finally:
        code = stop(serve, 60)
    assert code == 0
    assert not (data / "redis.url").exists()
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{base}/health", timeout=1)

"""Redis going away: /health says 503, a request gets 503 in the error shape, and both recover
when Redis is back, without restarting the API."""

import httpx

from queues.server import EmbeddedRedis


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

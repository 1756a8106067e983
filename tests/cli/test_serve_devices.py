"""`strata serve --devices cpu,cpu`: two workers share one queue, and one that dies comes back."""

from __future__ import annotations

import os
import signal

from concurrent.futures import ThreadPoolExecutor

import httpx
import redis

from queues.keys import Keys
from queues.server import free_port
from tests.e2e.conftest import healthy, start, stop, wait_until


def live_workers(client: redis.Redis, model: str) -> list[str]:
    k = Keys(model)
    return [w for w in client.zrange(k.workers, 0, -1) if client.exists(k.worker(w))]


def test_two_cpu_workers_share_the_queue_and_a_killed_one_restarts(tiny_model, redis_url, redis_client):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("STRATA_")}
    env.update(REDIS_URL=redis_url, STRATA_RESTART_DELAY_S="0.2", STRATA_THREADS="1", STRATA_COMPILE="0")
    serve = start("serve", env, "--devices", "cpu,cpu", "--port", str(port), "--model", str(tiny_model),
                  "--parallel", "1")
    model = tiny_model.name
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: healthy(base) and len(live_workers(redis_client, model)) == 2, "two workers", 120)
        first, second = sorted(live_workers(redis_client, model))
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda i: httpx.post(f"{base}/v1/completions", timeout=60, json={
                "model": model, "prompt": f"hello {i}", "max_tokens": 200, "ignore_eos": True}).json(), range(4)))
        served_by = {redis_client.hget(Keys(model).req(a["id"]), "worker") for a in answers}
        assert served_by == {first, second}  # one queue, both workers pulling from it
        pid = int(first.split("-")[-2])
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: len(live_workers(redis_client, model)) == 2 and first not in live_workers(redis_client, model),
                   "the killed worker to be replaced", 120)
        assert second in live_workers(redis_client, model)
        r = httpx.post(f"{base}/v1/completions", timeout=60, json={"model": model, "prompt": "again", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        assert stop(serve, 60) == 0

"""Clients that leave without detach: 200 streams dropped at random points (before the first
token, or after a few) against the real API and a real worker loop over the fake engine (wall
clock, a real pause per decode step). Every one ends `cancelled`, nothing stays held or waiting,
every slot is free again, and the worker still answers."""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from queues.keys import Keys
from tests.helpers.batches import MODEL, fake_worker
from tests.helpers.http import sse

DROPS = 200
SLOTS = 4


def test_200_random_disconnects_leak_no_slot(start_api, redis_url, redis_client):
    keys = Keys(MODEL)
    rng = random.Random(200)
    points = [rng.randint(0, 5) for _ in range(DROPS)]
    with fake_worker(redis_url, slots=SLOTS, step_s=0.01) as worker:
        base_url = start_api(ctx=512, default_max_tokens=16)

        def drop_after(seen: int) -> str:
            # 300 steps of 10 ms: no answer can finish before its client leaves
            body = {"messages": [{"role": "user", "content": f"Count to {seen}."}], "max_tokens": 300,
                    "stream": True}
            with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=60) as response:
                assert response.status_code == 200
                texts = 0
                for event in sse(response.iter_lines()) if seen else ():
                    if event["data"] == "[DONE]":
                        break
                    texts += any(c["delta"].get("content") for c in json.loads(event["data"])["choices"])
                    if texts == seen:
                        break
                return response.headers["x-request-id"]  # leaving the block drops the connection

        with ThreadPoolExecutor(16) as pool:
            ids = list(pool.map(drop_after, points))
        assert len(set(ids)) == DROPS

        deadline = time.monotonic() + 60
        while True:
            with redis_client.pipeline(transaction=False) as pipe:
                for request_id in ids:
                    pipe.hget(keys.req(request_id), "status")
                statuses = pipe.execute()
            if set(statuses) == {"cancelled"} and redis_client.zcard(keys.running) == 0 and worker.describe().slots_busy == 0:
                break
            assert time.monotonic() < deadline, (sorted(set(statuses)), redis_client.zcard(keys.running))
            time.sleep(0.05)
        assert redis_client.zcard(keys.waiting) == 0
        # the worker still answers, from a free slot
        answer = httpx.post(f"{base_url}/v1/chat/completions", timeout=60,
                            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3

"""The API plans what fits against the ctx the live workers publish, not only its own --ctx."""

from __future__ import annotations

import json
import threading
import time

import httpx

from queues.membership import Membership
from queues.records import Done
from queues.worker_state import WorkerState
from tests.helpers.api import MODEL


def ask(base: str, prompt: str, max_tokens: int | None = None) -> httpx.Response:
    body = {"prompt": prompt, **({"max_tokens": max_tokens} if max_tokens else {})}
    return httpx.post(f"{base}/v1/completions", json=body, timeout=10)


def test_a_prompt_that_fits_the_api_but_not_the_live_workers_is_refused(start_api, redis_client, worker):
    Membership(redis_client, MODEL, "small").heartbeat(WorkerState(ctx=32), int(time.time() * 1000), ttl_s=30)
    base = start_api(ctx=64)
    r = ask(base, "x" * 40)  # 40 tokens: room under --ctx 64, none on a worker of 32
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded" and "context is 32 tokens" in error["message"]


def test_the_answer_is_cut_to_what_the_workers_can_hold(start_api, redis_client, worker):
    Membership(redis_client, MODEL, "small").heartbeat(WorkerState(ctx=32), int(time.time() * 1000), ttl_s=30)
    base = start_api(ctx=64)
    answers: list[httpx.Response] = []
    asking = threading.Thread(target=lambda: answers.append(ask(base, "x" * 20, max_tokens=30)))
    asking.start()
    (rid,) = worker.wait_for(1)
    assert json.loads(worker.record(rid)["params"])["max_tokens"] == 12  # 32 - 20, not 64 - 20
    worker.publish(rid, Done("length", 20, 0))
    asking.join(10)
    assert answers[0].status_code == 200


def test_without_a_live_worker_the_api_uses_its_own_ctx(start_api, worker):
    base = start_api(ctx=64)
    r = ask(base, "x" * 70)
    assert r.status_code == 400 and "context is 64 tokens" in r.json()["error"]["message"]


def test_the_api_ctx_stays_a_cap_beside_larger_workers(start_api, redis_client, worker):
    Membership(redis_client, MODEL, "big").heartbeat(WorkerState(ctx=4096), int(time.time() * 1000), ttl_s=30)
    base = start_api(ctx=64)
    r = ask(base, "x" * 70)
    assert r.status_code == 400 and "context is 64 tokens" in r.json()["error"]["message"]


def test_n_above_the_largest_live_worker_slots_is_refused(start_api, redis_client, worker):
    now = int(time.time() * 1000)
    Membership(redis_client, MODEL, "small").heartbeat(WorkerState(ctx=256, slots_total=2), now, ttl_s=30)
    Membership(redis_client, MODEL, "big").heartbeat(WorkerState(ctx=256, slots_total=4), now, ttl_s=30)
    base = start_api(ctx=256)
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "n": 5, "max_tokens": 2}, timeout=10)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "n" and "at most 4" in error["message"]
    assert worker.waiting() == []


def test_a_prompt_beyond_the_live_workers_pool_is_refused_naming_both_numbers(start_api, redis_client, worker):
    # a worker whose requests may hold 4096 tokens but whose KV pool is 3 blocks of 16
    state = WorkerState(ctx=4096, kv_block=16, blocks_total=3)
    Membership(redis_client, MODEL, "pooled").heartbeat(state, int(time.time() * 1000), ttl_s=30)
    base = start_api(ctx=4096)
    r = ask(base, "x" * 50)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["message"] == ("The KV pool holds 48 tokens; the prompt has 50, which leaves no room for an answer.")
    answers: list[httpx.Response] = []
    asking = threading.Thread(target=lambda: answers.append(ask(base, "x" * 20, max_tokens=100)))
    asking.start()
    (rid,) = worker.wait_for(1)
    assert json.loads(worker.record(rid)["params"])["max_tokens"] == 28  # the pool's 48 - 20
    worker.publish(rid, Done("length", 20, 0))
    asking.join(10)
    assert answers[0].status_code == 200


def test_requests_arriving_during_a_fit_read_share_it(monkeypatch):
    # 20 requests arrive while the workers' facts are being read: one read, every one of them its
    # answer; the next read only once the facts are older than the ttl. A read that fails leaves
    # the facts stale and the next request in line reads again.
    import anyio

    from api.fit import Fit
    from queues import membership

    reads, now = [], [0]

    async def live_facts(client, model, now_ms, within_ms):
        reads.append(now_ms)
        await anyio.sleep(0.02)
        if len(reads) == 3:
            raise ConnectionError("redis went away")
        return 300, 4096, 4

    monkeypatch.setattr(membership, "live_facts", live_facts)
    fit = Fit(None, "m", fallback=256, live_within_ms=10_000, clock=lambda: now[0], ttl_ms=2000)

    async def main():
        got = []

        async def one():
            got.append(await fit.limits())
        async with anyio.create_task_group() as tg:
            for _ in range(20):
                tg.start_soon(one)
        assert got == [(256, 4096, 4)] * 20 and reads == [0]  # the cap stays a cap beside a larger ctx
        now[0] = 1999
        assert await fit.limits() == (256, 4096, 4) and reads == [0]
        now[0] = 2000
        assert await fit.limits() == (256, 4096, 4) and reads == [0, 2000]
        now[0] = 4000
        try:
            await fit.limits()
        except ConnectionError:
            pass
        else:
            raise AssertionError("the failed read was not raised")
        assert await fit.limits() == (256, 4096, 4) and reads == [0, 2000, 4000, 4000]

    anyio.run(main)

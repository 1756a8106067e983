"""queues/ against a real Redis: every state change of a request."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from queues.claims import Claims
from queues.intake import Intake
from queues.keys import Keys
from queues.records import Done, Token
from queues.scripts import QueueError, QueueRefused

MODEL = "m"


def request(rid: str, priority: int = 0, prompt=(1, 2, 3), **kw):
    from queues.records import QueuedRequest

    return QueuedRequest(id=rid, priority=priority, prompt=list(prompt), max_tokens=8, **kw)


def enqueue(redis_url: str, *requests, **intake_kw) -> list:
    async def go():
        client = aioredis.Redis.from_url(redis_url)
        intake = Intake(client, MODEL, **intake_kw)
        out = []
        for r in requests:
            try:
                out.append(await intake.enqueue(r))
            except QueueRefused as refused:
                out.append(refused.code)
        await client.aclose()
        return out

    return asyncio.run(go())


def cancel(redis_url: str, rid: str) -> str:
    """The API's cancel (client gone), from a synchronous test."""

    async def go() -> str:
        client = aioredis.Redis.from_url(redis_url)
        status = await Intake(client, MODEL).cancel(rid)
        await client.aclose()
        return status

    return asyncio.run(go())


def test_waiting_order_is_priority_then_arrival(redis_url, redis_client):
    enqueue(redis_url, *(request(f"r{i}", p) for i, p in enumerate([0, 5, 0, 9, 5])))
    members = redis_client.zrange(Keys(MODEL).waiting, 0, -1, withscores=True)
    assert [m.split(":")[1] for m, _ in members] == ["r3", "r1", "r4", "r0", "r2"]
    assert [s for _, s in members] == [-9, -5, -5, 0, 0]
    head = Claims(redis_client, MODEL, "w1").head(2)
    assert [(w.id, w.priority) for w in head] == [("r3", 9), ("r1", 5)]


def test_claim_is_atomic_with_its_lease_and_records_the_order(redis_url, redis_client):
    enqueue(redis_url, request("a", 1), request("b", 2))
    k = Keys(MODEL)
    w1, w2 = Claims(redis_client, MODEL, "w1", lease_ms=1000), Claims(redis_client, MODEL, "w2")
    head = w1.head()[0]
    claimed = w1.claim(head, slot=0, now_ms=5000)
    assert claimed.request.id == "b" and claimed.request.prompt == [1, 2, 3] and claimed.attempts == 1
    assert w2.claim(head, slot=0, now_ms=5000) is None  # already taken: never twice
    assert redis_client.zscore(k.running, "b") == 6000
    assert redis_client.zrange(k.waiting, 0, -1) == [w1.head()[0].member]
    h = redis_client.hgetall(k.req("b"))
    assert (h["status"], h["worker"], h["slot"], h["claim_seq"]) == ("running", "w1", "0", "1")
    second = w2.claim(w2.head()[0], slot=3, now_ms=5001)
    assert second.claim_seq == 2


def test_report_streams_tokens_renews_and_sees_cancels(redis_url, redis_client):
    enqueue(redis_url, request("a"), request("b"))
    w = Claims(redis_client, MODEL, "w1", lease_ms=1000)
    for slot in (0, 1):
        w.claim(w.head()[0], slot, now_ms=0)
    cancelled = w.report([("a", Token("Hi", [7])), ("b", Token("", [8]))], ["a", "b"], now_ms=100)
    assert cancelled == set()
    k = Keys(MODEL)
    assert redis_client.zscore(k.running, "a") == 1100
    assert [f for _, f in redis_client.xrange(k.out("a"))] == [{"type": "token", "text": "Hi", "ids": "7"}]

    assert cancel(redis_url, "b") == "running"
    assert w.report([], ["a", "b"], now_ms=200) == {"b"}


def test_finish_ends_once_and_only_for_the_owner(redis_url, redis_client):
    enqueue(redis_url, request("a"))
    w = Claims(redis_client, MODEL, "w1", retention_s=60)
    w.claim(w.head()[0], 0, now_ms=0)
    other = Claims(redis_client, MODEL, "w2")
    assert not other.finish("a", Done("stop", 3, 1), "finished", 1, now_ms=10)
    assert w.finish("a", Done("stop", 3, 1), "finished", 1, now_ms=10)
    assert not w.finish("a", Done("stop", 3, 1), "finished", 1, now_ms=11)
    k = Keys(MODEL)
    h = redis_client.hgetall(k.req("a"))
    assert (h["status"], h["finish_reason"], h["completion_tokens"]) == ("finished", "stop", "1")
    assert redis_client.zcard(k.running) == 0
    entries = redis_client.xrange(k.out("a"))
    assert [f["type"] for _, f in entries] == ["done"]
    assert 0 < redis_client.ttl(k.req("a")) <= 60


def test_expired_lease_goes_back_to_its_original_place(redis_url, redis_client):
    enqueue(redis_url, request("first", 5), request("later", 5))
    dead = Claims(redis_client, MODEL, "dead", lease_ms=1000)
    dead.claim(dead.head()[0], 0, now_ms=0)
    dead.report([("first", Token("x", [42]))], ["first"], now_ms=10)
    enqueue(redis_url, request("newer", 5))
    alive = Claims(redis_client, MODEL, "alive")
    assert alive.requeue_expired(now_ms=500) == []  # lease still good
    assert alive.requeue_expired(now_ms=1011) == ["first"]
    assert [w.id for w in alive.head(3)] == ["first", "later", "newer"]
    claimed = alive.claim(alive.head()[0], 2, now_ms=1100)
    assert claimed.attempts == 2
    assert alive.resumed("first").token_ids == [42] and alive.resumed("first").text == "x"
    # the dead worker cannot end what is no longer its own
    assert not dead.finish("first", Done("stop", 3, 1), "finished", 1, now_ms=1200)


def test_give_back_on_a_clean_stop(redis_url, redis_client):
    enqueue(redis_url, request("a", 1))
    w = Claims(redis_client, MODEL, "w1", lease_ms=60_000)
    w.claim(w.head()[0], 0, now_ms=0)
    assert w.give_back(["a"], now_ms=10) == ["a"]
    assert redis_client.hget(Keys(MODEL).req("a"), "status") == "waiting"


def test_cancel_while_waiting_leaves_the_queue(redis_url, redis_client):
    enqueue(redis_url, request("a"))

    assert cancel(redis_url, "a") == "waiting"
    k = Keys(MODEL)
    assert redis_client.zcard(k.waiting) == 0
    assert redis_client.hget(k.req("a"), "status") == "cancelled"


def test_a_full_queue_sheds_low_priorities_first(redis_url, redis_client):
    out = enqueue(redis_url, request("a", 0), request("b", 0), request("c", 0), request("d", 9),
                  request("e", -1), max_waiting=2)
    assert out == [0, 1, QueueError.QUEUE_FULL, 0, QueueError.QUEUE_FULL]
    out = enqueue(redis_url, request("f", 9), max_waiting=2, hard_limit=3)
    assert out == [QueueError.QUEUE_FULL]


def test_duplicate_ids_are_refused(redis_url):
    assert enqueue(redis_url, request("a"), request("a")) == [0, QueueError.DUPLICATE]

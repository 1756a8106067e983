"""queues/ against a real Redis: every state change of a request."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from queues.claims import Claims, Held, Verdict
from queues.intake import Intake
from queues.keys import Keys
from queues.lifecycle import RequestStatus
from queues.membership import Membership
from queues.records import Done, Token
from queues.scripts import QueueError, QueueRefused
from queues.worker_state import WorkerState

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
    claimed = w1.claim(head, now_ms=5000)
    assert claimed.request.id == "b" and claimed.request.prompt == [1, 2, 3] and claimed.attempts == 1
    assert w2.claim(head, now_ms=5000) is None  # already taken: never twice
    assert redis_client.zscore(k.running, "b") == 6000
    assert redis_client.zrange(k.waiting, 0, -1) == [w1.head()[0].member]
    h = redis_client.hgetall(k.req("b"))
    assert (h["status"], h["worker"], h["slot"], h["claim_seq"]) == ("running", "w1", "", "1")
    second = w2.claim(w2.head()[0], now_ms=5001)
    assert second.claim_seq == 2


def held(claimed, slot=None, tokens=(), generated=0, **kw) -> Held:
    return Held(claimed.request.id, claimed.claim_seq, claimed.request.priority, generated, list(tokens), slot, **kw)


def test_report_streams_tokens_records_the_slot_renews_and_sees_cancels(redis_url, redis_client):
    enqueue(redis_url, request("a"), request("b"))
    w = Claims(redis_client, MODEL, "w1", lease_ms=1000)
    a, b = (w.claim(w.head()[0], now_ms=0) for _ in range(2))
    verdict = w.report([held(a, slot=1, tokens=[Token("Hi", [7])], generated=1, first_token=True),
                        held(b, slot=0, tokens=[Token("", [8])], generated=1)], now_ms=100)
    assert verdict == Verdict(frozenset(), frozenset())
    k = Keys(MODEL)
    assert redis_client.zscore(k.running, "a") == 1100
    assert [f for _, f in redis_client.xrange(k.out("a"))] == [{"type": "token", "text": "Hi", "ids": "7"}]
    h = redis_client.hgetall(k.req("a"))
    assert (h["slot"], h["first_token_ms"], h["completion_tokens"]) == ("1", "100", "1")
    assert redis_client.hget(k.req("b"), "slot") == "0"

    assert cancel(redis_url, "b") == "running"
    assert w.report([held(a, generated=1), held(b, generated=1)], now_ms=200).cancelled == {"b"}
    assert redis_client.hget(k.req("a"), "slot") == "1"  # written once, when it was claimed


def test_a_give_way_is_noted_on_the_request_and_counted_by_priority(redis_url, redis_client):
    enqueue(redis_url, request("long", 3))
    w = Claims(redis_client, MODEL, "w1")
    long = w.claim(w.head()[0], now_ms=0)
    w.report([held(long, gave_way_to="short")], now_ms=50)
    h = redis_client.hgetall(Keys(MODEL).req("long"))
    assert (h["yields"], h["parked_ms"], h["gave_way_to"]) == ("1", "50", "short")
    assert redis_client.hget(Keys(MODEL).metrics, "give_ways:3") == "1"


def test_finish_ends_once_and_only_for_the_claim_holder(redis_url, redis_client):
    enqueue(redis_url, request("a"))
    w = Claims(redis_client, MODEL, "w1", retention_s=60)
    a = w.claim(w.head()[0], now_ms=0)
    other = Claims(redis_client, MODEL, "w2")
    done = Done("stop", 3, 1)
    assert not other.finish("a", a.claim_seq, done, RequestStatus.FINISHED, 1, now_ms=10)
    assert not w.finish("a", a.claim_seq + 1, done, RequestStatus.FINISHED, 1, now_ms=10)  # not that claim
    assert w.finish("a", a.claim_seq, done, RequestStatus.FINISHED, 1, now_ms=10)
    assert not w.finish("a", a.claim_seq, done, RequestStatus.FINISHED, 1, now_ms=11)
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
    first = dead.claim(dead.head()[0], now_ms=0)
    dead.report([held(first, tokens=[Token("x", [42])], generated=1)], now_ms=10)
    enqueue(redis_url, request("newer", 5))
    alive = Claims(redis_client, MODEL, "alive")
    assert alive.requeue_expired(now_ms=500) == []  # lease still good
    assert alive.requeue_expired(now_ms=1011) == ["first"]
    assert [w.id for w in alive.head(3)] == ["first", "later", "newer"]
    claimed = alive.claim(alive.head()[0], now_ms=1100)
    assert claimed.attempts == 2
    assert alive.resumed("first")[0].token_ids == [42] and alive.resumed("first")[0].text == "x"
    # the frozen worker comes back: it cannot write into, renew or end what is no longer its own
    k = Keys(MODEL)
    verdict = dead.report([held(first, tokens=[Token("y", [43])], generated=2, first_token=True)], now_ms=1200)
    assert verdict.lost == {"first"}
    assert [f["ids"] for _, f in redis_client.xrange(k.out("first"))] == ["42"]
    assert redis_client.zscore(k.running, "first") == 1100 + 15_000  # the new claim's lease, untouched
    assert "first_token_ms" not in redis_client.hgetall(k.req("first"))
    assert not dead.finish("first", first.claim_seq, Done("stop", 3, 1), RequestStatus.FINISHED, 1, now_ms=1200)
    assert redis_client.hget(k.req("first"), "status") == "running"


def test_a_request_that_loses_too_many_claims_fails_as_worker_lost(redis_url, redis_client):
    enqueue(redis_url, request("poison", 2))
    k = Keys(MODEL)
    w = Claims(redis_client, MODEL, "w", lease_ms=10, max_attempts=3, retention_s=60)
    for attempt in range(1, 4):
        assert w.claim(w.head()[0], now_ms=100 * attempt).attempts == attempt
        assert w.requeue_expired(now_ms=100 * attempt + 11) == ["poison"]
    h = redis_client.hgetall(k.req("poison"))
    assert (h["status"], h["finish_reason"], h["claims_lost"]) == ("failed", "worker_lost", "3")
    assert redis_client.zcard(k.waiting) == 0 and redis_client.zcard(k.running) == 0
    last = redis_client.xrange(k.out("poison"))[-1][1]
    assert (last["type"], last["code"]) == ("error", "worker_lost")
    assert redis_client.hget(k.metrics, "requests:2:failed") == "1"


def test_a_cancel_sent_while_its_worker_was_gone_ends_it_instead_of_requeueing(redis_url, redis_client):
    enqueue(redis_url, request("a"))
    w = Claims(redis_client, MODEL, "w", lease_ms=10)
    w.claim(w.head()[0], now_ms=0)
    assert cancel(redis_url, "a") == "running"
    assert w.requeue_expired(now_ms=11) == ["a"]
    k = Keys(MODEL)
    assert redis_client.hget(k.req("a"), "status") == "cancelled"
    assert redis_client.zcard(k.waiting) == 0
    assert redis_client.xrange(k.out("a"))[-1][1]["code"] == "cancelled"


def test_give_back_on_a_clean_stop_is_not_a_lost_claim(redis_url, redis_client):
    enqueue(redis_url, request("a", 1))
    w = Claims(redis_client, MODEL, "w1", lease_ms=60_000, max_attempts=1)
    a = w.claim(w.head()[0], now_ms=0)
    assert w.give_back([("a", a.claim_seq + 1)], now_ms=10) == []  # not its claim
    assert w.give_back([("a", a.claim_seq)], now_ms=10) == ["a"]
    h = redis_client.hgetall(Keys(MODEL).req("a"))
    assert h["status"] == "waiting" and "claims_lost" not in h


def test_claims_of_a_dead_worker_on_this_host_come_back_without_waiting_for_the_lease(redis_url, redis_client):
    enqueue(redis_url, request("a", 1), request("b", 1), request("c", 1))
    dead, frozen = Claims(redis_client, MODEL, "dead", lease_ms=60_000), Claims(redis_client, MODEL, "frozen")
    dead.claim(dead.head()[0], now_ms=0)
    frozen.claim(frozen.head()[0], now_ms=0)
    Membership(redis_client, MODEL, "dead").heartbeat(WorkerState(device="cpu"), now_ms=0, ttl_s=60)
    heir = Claims(redis_client, MODEL, "heir")
    assert heir.reclaim_from_dead(lambda worker: worker == "dead", now_ms=5) == ["a"]
    assert Membership(redis_client, MODEL, "heir").forget_dead(lambda worker: worker == "dead") == ["dead"]
    k = Keys(MODEL)
    assert [w.id for w in heir.head(3)] == ["a", "c"]  # its original place
    assert redis_client.hget(k.req("a"), "claims_lost") == "1"
    assert redis_client.hget(k.req("b"), "status") == "running"  # alive (or frozen): its lease decides
    assert not redis_client.exists(k.worker("dead")) and redis_client.zscore(k.workers, "dead") is None


def test_a_dead_worker_that_holds_nothing_leaves_the_workers_set(redis_url, redis_client):
    """Its leases ran out (and were requeued) before its heir looked: it still goes."""
    gone, alive = Membership(redis_client, MODEL, "gone"), Membership(redis_client, MODEL, "alive")
    gone.heartbeat(WorkerState(device="cpu"), now_ms=0, ttl_s=60)
    alive.heartbeat(WorkerState(device="cpu"), now_ms=0, ttl_s=60)
    assert Claims(redis_client, MODEL, "alive").reclaim_from_dead(lambda worker: worker == "gone", now_ms=5) == []
    assert alive.forget_dead(lambda worker: worker == "gone") == ["gone"]
    k = Keys(MODEL)
    assert redis_client.zrange(k.workers, 0, -1) == ["alive"] and not redis_client.exists(k.worker("gone"))


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

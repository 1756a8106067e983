"""Queue deadlines (queue_timeout) in Redis and through the worker loop, on one virtual clock:
a request not claimed by its deadline leaves the queue atomically, is never claimed afterwards
(claim.lua refuses it), gets a queue_timeout error event, and is counted by priority."""

from __future__ import annotations



from engine.fake import VirtualClock
from queues.claims import Claims, Waiting
from queues.keys import Keys, Member
from queues.records import parse_event
from tests.helpers.queue import enqueue
from tests.helpers.workers import MODEL, make_worker, run_until_idle

K = Keys(MODEL)




def head(redis_client) -> Waiting:
    member, score = redis_client.zrange(K.waiting, 0, 0, withscores=True)[0]
    return Waiting.of(member, str(int(-score)))


def last_event(redis_client, rid: str) -> dict:
    return redis_client.xrange(K.out(rid))[-1][1]


def test_enqueue_records_the_deadline_and_a_claim_in_time_clears_it(redis_client, redis_url):
    clock = VirtualClock(now_ms=5000)
    enqueue(redis_url, clock, "r", timeout_ms=300)
    assert redis_client.hget(K.req("r"), "queue_deadline_ms") == "5300"
    assert redis_client.zrange(K.deadlines, 0, -1, withscores=True) == [("r", 5300.0)]
    claims = Claims(redis_client, MODEL, "w1")
    assert claims.claim(head(redis_client), 5299) is not None
    assert redis_client.zcard(K.deadlines) == 0
    assert claims.expire_overdue(10_000) == []
    assert redis_client.hget(K.req("r"), "status") == "running"


def test_a_worker_racing_past_the_deadline_cannot_claim_it_it_expires(redis_client, redis_url):
    clock = VirtualClock(now_ms=5000)
    enqueue(redis_url, clock, "late", timeout_ms=300, priority=4)
    enqueue(redis_url, clock, "next")
    claims = Claims(redis_client, MODEL, "w1", retention_s=60)
    stale = head(redis_client)  # read before the deadline...
    assert claims.claim(stale, 5300) is None  # ...claimed at it: refused
    h = redis_client.hgetall(K.req("late"))
    assert (h["status"], h["finish_reason"], h["finished_ms"]) == ("expired", "queue_timeout", "5300")
    assert "worker" not in h and "claim_seq" not in h
    event = parse_event(last_event(redis_client, "late"))
    assert (event.code, "0.3 s" in event.message) == ("queue_timeout", True)
    assert [Member.parse(m).id for m in redis_client.zrange(K.waiting, 0, -1)] == ["next"]
    assert redis_client.zcard(K.deadlines) == 0
    assert redis_client.hget(K.metrics, "requests:4:expired") == "1"
    assert 0 < redis_client.ttl(K.req("late")) <= 60
    assert claims.claim(stale, 5301) is None  # and never afterwards
    assert redis_client.hget(K.metrics, "requests:4:expired") == "1"  # counted once


def test_the_sweep_expires_what_is_due_only_and_drops_stale_entries(redis_client, redis_url):
    clock = VirtualClock(now_ms=0)
    enqueue(redis_url, clock, "due", timeout_ms=100)
    enqueue(redis_url, clock, "later", timeout_ms=900)
    enqueue(redis_url, clock, "claimed", timeout_ms=100)
    enqueue(redis_url, clock, "forever")
    claims = Claims(redis_client, MODEL, "w1")
    member = next(m for m in redis_client.zrange(K.waiting, 0, -1) if m.endswith(":claimed"))
    assert claims.claim(Waiting(member, "claimed", 0, 0), 50)
    redis_client.zadd(K.deadlines, {"claimed": 100})  # as if a claim had raced the enqueue
    assert claims.expire_overdue(99) == []
    assert claims.expire_overdue(100) == ["due"]
    assert redis_client.zrange(K.deadlines, 0, -1) == ["later"]  # claimed's entry dropped
    assert claims.expire_overdue(100_000) == ["later"]
    assert [Member.parse(m).id for m in redis_client.zrange(K.waiting, 0, -1)] == ["forever"]
    assert redis_client.hget(K.req("claimed"), "status") == "running"


def test_a_requeued_request_is_not_expired_its_deadline_was_for_its_first_wait(redis_client, redis_url):
    clock = VirtualClock(now_ms=0)
    enqueue(redis_url, clock, "r", timeout_ms=100)
    claims = Claims(redis_client, MODEL, "w1")
    claimed = claims.claim(head(redis_client), 10)
    assert claims.give_back([("r", claimed.claim_seq)], 20) == ["r"]
    assert claims.expire_overdue(1000) == []
    assert claims.claim(head(redis_client), 1000) is not None  # past the deadline, yet claimed: it had its slot


def test_the_worker_loop_serves_the_patient_and_expires_the_impatient(redis_client, redis_url):
    clock = VirtualClock(now_ms=0)
    worker = make_worker(redis_client, slots=1, clock=clock)
    enqueue(redis_url, clock, "long", max_tokens=300)  # 10 ms per token: the slot is busy ~3 s
    worker.step()
    enqueue(redis_url, clock, "impatient", timeout_ms=1500, priority=5)
    enqueue(redis_url, clock, "patient", priority=5)
    run_until_idle(worker)
    impatient = redis_client.hgetall(K.req("impatient"))
    deadline = int(impatient["queue_deadline_ms"])
    assert impatient["status"] == "expired"
    # the heartbeat's sweep (every 1000 ms) expired it within one beat of its deadline
    assert deadline <= int(impatient["finished_ms"]) < deadline + 1000
    patient = redis_client.hgetall(K.req("patient"))
    assert (patient["status"], patient["claim_seq"]) == ("finished", "2")
    assert redis_client.zcard(K.deadlines) == 0 and redis_client.zcard(K.waiting) == 0

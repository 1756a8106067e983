"""Aging (--aging-s S): the waiting score (enqueued - epoch)/S - priority, so ZRANGE reads in
service order at every instant and nothing rescores; requeue keeps the place; shedding counts
what is served before; the loop's claim order; give-way still by the requests' own priorities;
reserved slots look past an aged head. One virtual clock, a real Redis."""

from __future__ import annotations


import pytest

from engine.fake import VirtualClock
from queues.claims import Claims
from queues.keys import Keys, Member
from queues.membership import Membership
from queues.scripts import QueueError, QueueRefused
from tests.helpers.queue import enqueue
from tests.helpers.workers import MODEL, make_worker, run_until_idle
from workers.scheduler import Policy, Reserve

K = Keys(MODEL)




def queue(redis_client) -> list[tuple[str, float]]:
    return [(Member.parse(m).id, s) for m, s in redis_client.zrange(K.waiting, 0, -1, withscores=True)]


def work_until(worker, clock: VirtualClock, ms: int) -> None:
    """Let the worker step (its decodes move the clock) until `ms`: its leases stay renewed."""
    while clock() < ms:
        assert worker.step(), "the worker went idle"


def claim_order(redis_client, rids) -> list[str]:
    return sorted(rids, key=lambda r: int(redis_client.hget(K.req(r), "claim_seq")))


def test_the_score_is_age_over_s_minus_priority_and_zrange_is_service_order(redis_client, redis_url):
    clock = VirtualClock(now_ms=10_000)
    claims = Claims(redis_client, MODEL, "w1")
    Membership(redis_client, MODEL, "w1").set_aging(2.0, clock())  # the epoch: 10 000 ms
    assert redis_client.hgetall(K.policy) == {"aging_s": "2.0", "aging_epoch_ms": "10000"}
    enqueue(redis_url, clock, "old-low", priority=0)   # 0/2 - 0 = 0
    clock.advance(3000)
    enqueue(redis_url, clock, "mid", priority=1)       # 3/2 - 1 = 0.5
    enqueue(redis_url, clock, "high", priority=3)      # 3/2 - 3 = -1.5
    clock.advance(1000)
    enqueue(redis_url, clock, "new-low", priority=0)   # 4/2 - 0 = 2
    assert queue(redis_client) == [("high", -1.5), ("old-low", 0.0), ("mid", 0.5), ("new-low", 2.0)]
    # the same order as effective priority p + waited/S at this instant (t = 14 s):
    # high 3 + 1/2 = 3.5, old-low 0 + 4/2 = 2, mid 1 + 1/2 = 1.5, new-low 0
    assert [(w.id, w.priority) for w in claims.head(4)] == [("high", 3), ("old-low", 0), ("mid", 1), ("new-low", 0)]
    assert redis_client.hget(K.req("mid"), "score") == "0.5"


def test_a_requeued_request_goes_back_to_its_aged_place(redis_client, redis_url):
    clock = VirtualClock(now_ms=0)
    claims = Claims(redis_client, MODEL, "w1")
    Membership(redis_client, MODEL, "w1").set_aging(1.0, 0)
    enqueue(redis_url, clock, "first", priority=0)
    clock.advance(500)
    enqueue(redis_url, clock, "second", priority=0)
    claimed = claims.claim(claims.head()[0], clock())
    clock.advance(5000)
    enqueue(redis_url, clock, "late-high", priority=4)  # 5.5 - 4 = 1.5: after both
    assert claims.give_back([("first", claimed.claim_seq)], clock()) == ["first"]
    assert queue(redis_client) == [("first", 0.0), ("second", 0.5), ("late-high", 1.5)]


def test_shedding_counts_what_is_served_before_it_now(redis_client, redis_url):
    clock = VirtualClock(now_ms=0)
    Membership(redis_client, MODEL, "w1").set_aging(1.0, 0)
    for i in range(2):
        enqueue(redis_url, clock, f"low{i}", priority=0)
    clock.advance(10_000)
    # a priority 5 now scores 10 - 5 = 5: both lows (score 0) are served before it
    with pytest.raises(QueueRefused) as refused:
        enqueue(redis_url, clock, "p5", priority=5, max_waiting=2)
    assert refused.value.code is QueueError.QUEUE_FULL
    assert enqueue(redis_url, clock, "p20", priority=20, max_waiting=2) == 0  # -10: ahead of both


def test_without_aging_the_score_is_minus_priority_and_set_aging_none_turns_it_off(redis_client, redis_url):
    clock = VirtualClock(now_ms=7000)
    Membership(redis_client, MODEL, "w1").set_aging(3.0, 0)
    assert Membership(redis_client, MODEL, "w1").set_aging(None, 0) == 3.0
    enqueue(redis_url, clock, "a", priority=2)
    clock.advance(10_000)
    enqueue(redis_url, clock, "b", priority=1)
    assert queue(redis_client) == [("a", -2.0), ("b", -1.0)]


def test_the_loop_serves_an_aged_low_before_a_fresh_high(redis_client, redis_url):
    clock = VirtualClock(now_ms=0)
    worker = make_worker(redis_client, slots=1, clock=clock, policy=Policy(aging_s=1.0))
    enqueue(redis_url, clock, "busy", max_tokens=400)  # the slot is busy for ~4 s (10 ms a token)
    worker.step()
    enqueue(redis_url, clock, "low", priority=0)       # score ~0.01
    work_until(worker, clock, 2500)
    enqueue(redis_url, clock, "high", priority=3)      # ~2.5 - 3 < low's: high first
    work_until(worker, clock, 3500)
    enqueue(redis_url, clock, "high2", priority=3)     # ~3.5 - 3 > low's: low first
    run_until_idle(worker)
    assert claim_order(redis_client, ["busy", "low", "high", "high2"]) == ["busy", "high", "low", "high2"]


def test_aging_never_makes_a_read_give_way_to_a_lower_priority(redis_client, redis_url):
    clock = VirtualClock(now_ms=0)
    worker = make_worker(redis_client, slots=2, chunk=100, clock=clock, policy=Policy(aging_s=0.001))
    enqueue(redis_url, clock, "p5-long", priority=5, prompt_len=1000)
    worker.step()
    enqueue(redis_url, clock, "p0-short", priority=0, prompt_len=10)  # aged far above 5 within ms
    run_until_idle(worker)
    # it got the free slot at once, but the lines go by the requests' own priorities (rule 4)
    assert worker.read_log == [("p5-long", 100)] * 10 + [("p0-short", 10)]


def test_a_free_reserved_slot_looks_past_an_aged_head_for_its_tier(redis_client, redis_url):
    clock = VirtualClock(now_ms=0)
    worker = make_worker(redis_client, slots=2, clock=clock,
                         policy=Policy(aging_s=1.0, reserve=(Reserve(1, 10),)))
    enqueue(redis_url, clock, "busy", max_tokens=2000)  # slot 0 busy ~20 s
    worker.step()
    enqueue(redis_url, clock, "old-low", priority=0)
    work_until(worker, clock, 2000)
    enqueue(redis_url, clock, "alert", priority=10, max_tokens=1100)  # ~2 - 10 = -8; runs ~11 s
    enqueue(redis_url, clock, "mid", priority=5)     # ~2 - 5 = -3: ahead of old-low, below the reserve
    worker.step()
    assert worker.slots[1].request.id == "alert"
    assert [rid for rid, _ in queue(redis_client)] == ["mid", "old-low"]
    work_until(worker, clock, 12_000)
    enqueue(redis_url, clock, "alert2", priority=10)  # ~12 - 10 = 2: now behind mid and old-low
    assert [rid for rid, _ in queue(redis_client)] == ["mid", "old-low", "alert2"]
    while worker.slots[1].request and worker.slots[1].request.id == "alert":
        worker.step()
    worker.step()  # the reserved slot is free again: it passes mid and old-low for alert2
    assert worker.slots[1].request.id == "alert2"
    run_until_idle(worker)
    assert claim_order(redis_client, ["busy", "mid", "old-low", "alert", "alert2"]) == [
        "busy", "alert", "alert2", "mid", "old-low"]


def test_aging_s_must_be_a_positive_number():
    from pydantic import ValidationError

    from workers.settings import WorkerSettings

    assert WorkerSettings(aging_s="2.5").aging_s == 2.5
    assert WorkerSettings().aging_s is None
    for bad in (0, -1, "soon"):
        with pytest.raises(ValidationError, match="aging_s"):
            WorkerSettings(aging_s=bad)

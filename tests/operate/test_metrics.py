"""/metrics after a known run: exact counts by priority label, histogram sample counts and sums
equal to what the request hashes say, gauges read live; and the priority label rule."""

from __future__ import annotations

import asyncio
import math

import pytest
import redis.asyncio as aioredis

from api.prometheus import PriorityLabels
from queues.intake import Intake
from queues.keys import Keys
from queues.lifecycle import RequestStatus
from tests.helpers.api import metric_samples
from tests.helpers.queue import enqueue
from tests.helpers.workers import MODEL, make_worker
from tests.helpers.workers import run_until_idle

K = Keys(MODEL)
LABELS = PriorityLabels([-10, 0, 5, 10])


def cancel(redis_url: str, rid: str) -> str:
    async def go() -> str:
        client = aioredis.Redis.from_url(redis_url)
        try:
            return await Intake(client, MODEL).cancel(rid)
        finally:
            await client.aclose()

    return asyncio.run(go())


def value(samples, name, **labels) -> float:
    return samples.get((name, frozenset({"model": MODEL, **labels}.items())), 0.0)


def test_the_priority_label_rule_is_bounded():
    assert LABELS.labels == ["<-10", "-10", "-9..-1", "0", "1..4", "5", "6..9", "10", ">10"]
    cases = {-1000: "<-10", -11: "<-10", -10: "-10", -9: "-9..-1", -1: "-9..-1", 0: "0", 3: "1..4",
             5: "5", 6: "6..9", 10: "10", 11: ">10", 10**9: ">10"}
    assert {p: LABELS.label(p) for p in cases} == cases
    assert PriorityLabels([0, 2]).labels == ["<0", "0", "1", "2", ">2"]
    assert PriorityLabels([]).labels == ["all"]
    assert LABELS.bounds()[0] == (-math.inf, -11) and LABELS.bounds()[-1] == (11, math.inf)


def test_metrics_after_a_known_run(start_api, redis_url, redis_client, clock):
    http = start_api(clock=clock)
    worker = make_worker(redis_client, slots=2, chunk=100, clock=clock)
    enqueue(redis_url, clock, "long", priority=0, prompt_len=1000)
    worker.step()  # long reads its first chunk
    enqueue(redis_url, clock, "urgent", priority=5, prompt_len=1000)
    worker.step()  # urgent takes the other slot; long gives way and is parked
    for rid, priority in [("a", -3), ("b", -3), ("c", 7), ("d", 20), ("e", 0), ("f", -50)]:
        enqueue(redis_url, clock, rid, priority=priority)

    live = metric_samples(http)
    waiting = {label: value(live, "strata_requests_waiting", priority=label) for label in LABELS.labels}
    assert waiting == {"<-10": 1, "-10": 0, "-9..-1": 2, "0": 1, "1..4": 0, "5": 0, "6..9": 1, "10": 0, ">10": 1}
    running = {label: value(live, "strata_requests_running", priority=label) for label in LABELS.labels}
    assert running == {**dict.fromkeys(LABELS.labels, 0), "0": 1, "5": 1}
    assert value(live, "strata_worker_slots_total", worker="w1") == 2
    assert value(live, "strata_worker_slots_busy", worker="w1") == 2
    assert value(live, "strata_worker_reads_in_progress", worker="w1") == 1
    assert value(live, "strata_worker_reads_parked", worker="w1") == 1
    assert value(live, "strata_workers_live") == 1
    assert value(live, "strata_give_ways_total", priority="0") == 1
    # every label's counters exist from the start, at 0, so rate() sees a label's first event too
    for name in ("strata_give_ways_total", "strata_prompt_tokens_total", "strata_completion_tokens_total"):
        assert all((name, frozenset({"model": MODEL, "priority": label}.items())) in live for label in LABELS.labels)
    assert value(live, "strata_give_ways_total", priority="10") == 0

    run_until_idle(worker)
    done = metric_samples(http)
    finished = {"<-10": 1, "-9..-1": 2, "0": 2, "5": 1, "6..9": 1, ">10": 1}
    for label in LABELS.labels:
        assert value(done, "strata_requests_waiting", priority=label) == 0
        assert value(done, "strata_requests_running", priority=label) == 0
        assert value(done, "strata_requests_ended_total", priority=label, status="finished") == finished.get(label, 0)
    assert value(done, "strata_prompt_tokens_total", priority="0") == 1000 + 4
    assert value(done, "strata_prompt_tokens_total", priority="5") == 1000
    assert value(done, "strata_prompt_tokens_total", priority="-9..-1") == 8
    assert value(done, "strata_completion_tokens_total", priority="0") == 6

    records = {rid: redis_client.hgetall(K.req(rid)) for rid in ["long", "urgent", "a", "b", "c", "d", "e", "f"]}
    yields = {}
    for r in records.values():
        label = LABELS.label(int(r["priority"]))
        yields[label] = yields.get(label, 0) + int(r.get("yields", 0))
    assert sum(yields.values()) == worker.give_ways >= 1
    for label in LABELS.labels:
        assert value(done, "strata_give_ways_total", priority=label) == yields.get(label, 0)

    timings = {
        "strata_queue_time_seconds": lambda r: int(r["claimed_ms"]) - int(r["enqueued_ms"]),
        "strata_time_to_first_token_seconds": lambda r: int(r["first_token_ms"]) - int(r["enqueued_ms"]),
        "strata_request_latency_seconds": lambda r: int(r["finished_ms"]) - int(r["enqueued_ms"]),
    }
    for name, ms in timings.items():
        for label in LABELS.labels:
            mine = [ms(r) for r in records.values() if LABELS.label(int(r["priority"])) == label]
            assert value(done, f"{name}_count", priority=label) == len(mine)
            assert value(done, f"{name}_sum", priority=label) == pytest.approx(sum(mine) / 1000)
            if mine:
                assert value(done, f"{name}_bucket", priority=label, le="+Inf") == len(mine)
                assert value(done, f"{name}_bucket", priority=label, le="0.01") == sum(m <= 10 for m in mine)
                assert value(done, f"{name}_bucket", priority=label, le="1.0") == sum(m <= 1000 for m in mine)
    # a virtual clock: the long reads take seconds of virtual time, so the buckets spread
    assert value(done, "strata_request_latency_seconds_bucket", priority="0", le="0.01") == 0


def test_a_request_ended_twice_is_counted_once(redis_client, redis_url, clock):
    """A worker whose lease ran out cannot finish (finish.lua writes nothing): no double count."""
    enqueue(redis_url, clock, "x", priority=2)
    worker = make_worker(redis_client, slots=1, clock=clock)
    run_until_idle(worker)
    claim_seq = int(redis_client.hget(K.req("x"), "claim_seq"))
    assert not worker.claims.finish("x", claim_seq, None, RequestStatus.CANCELLED, 0, clock())
    fields = redis_client.hgetall(K.metrics)
    assert fields["requests:2:finished"] == "1" and "requests:2:cancelled" not in fields


def test_a_running_request_cancelled_by_its_client_counts_as_cancelled(start_api, redis_url, redis_client, clock):
    http = start_api(clock=clock)
    enqueue(redis_url, clock, "gone", priority=5, max_tokens=100)
    worker = make_worker(redis_client, slots=1, clock=clock)
    worker.step()
    assert cancel(redis_url, "gone") == "running"  # the client left: the API's own cancel
    run_until_idle(worker)
    samples = metric_samples(http)
    assert value(samples, "strata_requests_ended_total", priority="5", status="cancelled") == 1
    assert value(samples, "strata_requests_ended_total", priority="5", status="finished") == 0
    assert value(samples, "strata_request_latency_seconds_count", priority="5") == 0


def test_reserved_slots_total_and_busy_per_worker(start_api, redis_url, redis_client, clock):
    from workers.scheduler import Policy, Reserve

    http = start_api(clock=clock)
    worker = make_worker(redis_client, slots=4, chunk=100, clock=clock,
                         policy=Policy(reserve=(Reserve(1, 10), Reserve(1, 5))))
    enqueue(redis_url, clock, "a", priority=0, max_tokens=50)
    enqueue(redis_url, clock, "alert", priority=10, max_tokens=50)
    enqueue(redis_url, clock, "b", priority=0, max_tokens=50)
    enqueue(redis_url, clock, "c", priority=0, max_tokens=50)
    worker.step()
    worker.upkeep.publish(worker.describe(), clock())
    live = metric_samples(http)
    assert value(live, "strata_worker_reserved_slots_total", worker="w1") == 2
    assert value(live, "strata_worker_reserved_slots_busy", worker="w1") == 0  # alert got slot 0
    assert value(live, "strata_requests_waiting", priority="0") == 2  # b, c: only reserved slots are free
    enqueue(redis_url, clock, "mid", priority=5, max_tokens=50)
    worker.step()
    worker.upkeep.publish(worker.describe(), clock())
    live = metric_samples(http)
    assert value(live, "strata_worker_reserved_slots_busy", worker="w1") == 1
    assert value(live, "strata_worker_slots_busy", worker="w1") == 4 - 1


def test_waiting_by_priority_with_aging_reads_the_priorities_not_the_scores(start_api, redis_url, redis_client, clock):
    from queues.membership import Membership

    http = start_api(clock=clock)
    Membership(redis_client, MODEL, "w1").set_aging(1.0, clock())
    for rid, priority in [("a", 0), ("b", 5), ("c", -3)]:
        enqueue(redis_url, clock, rid, priority=priority)
        clock.advance(4000)  # scores 0, -1, 11: nothing like -priority
    live = metric_samples(http)
    waiting = {label: value(live, "strata_requests_waiting", priority=label) for label in LABELS.labels}
    assert waiting == {**dict.fromkeys(LABELS.labels, 0), "0": 1, "5": 1, "-9..-1": 1}


def test_the_kv_pool_of_each_worker(start_api, redis_url, redis_client, clock):
    http = start_api(clock=clock)
    worker = make_worker(redis_client, slots=2, chunk=16, clock=clock, kv_tokens=128, kv_block=16)
    enqueue(redis_url, clock, "big", prompt_len=60, max_tokens=20)  # 5 of the 8 blocks
    worker.step()
    enqueue(redis_url, clock, "bigger", prompt_len=60, max_tokens=40)  # 7: waits for 4 more
    worker.step()
    worker.upkeep.run(clock(), worker.describe())
    live = metric_samples(http)
    got = {name: value(live, f"strata_worker_kv_blocks_{name}", worker="w1")
           for name in ("total", "free", "cached", "shared", "short")}
    assert got == {"total": 8, "free": 3, "cached": 2, "shared": 0, "short": 4}  # 2 chunks of 16 read: 2 blocks keyed

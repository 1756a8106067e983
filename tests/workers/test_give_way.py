"""Rules 2-8 through the real worker loop, a real Redis and the fake engine's virtual clock."""

from __future__ import annotations

from engine.fake import VirtualClock
from queues.keys import Keys
from tests.helpers.workers import MODEL, make_worker, run_until_idle
from workers.scheduler import Policy

K = Keys(MODEL)


def first_token_ms(redis_client, rid: str) -> int:
    return int(redis_client.hget(K.req(rid), "first_token_ms"))


def record(redis_client, rid: str) -> dict:
    return redis_client.hgetall(K.req(rid))


def test_the_first_free_slot_goes_to_the_higher_priority(redis_client, submit):
    submit("a", max_tokens=5)
    submit("b", max_tokens=9)
    worker = make_worker(redis_client, slots=2)
    worker.step()
    worker.step()
    assert {s.request.id for s in worker.slots} == {"a", "b"}
    submit("low", priority=0)
    submit("high", priority=5)
    run_until_idle(worker)
    seq = {r: int(record(redis_client, r)["claim_seq"]) for r in ("low", "high")}
    assert seq["high"] < seq["low"]


def test_a_long_read_gives_way_to_a_higher_priority_and_resumes_without_recompute(redis_client, submit):
    submit("long", priority=0, prompt_len=1000)
    worker = make_worker(redis_client, slots=2, chunk=100)
    worker.step()
    submit("urgent", priority=5, prompt_len=1000)
    run_until_idle(worker)
    assert worker.read_log == [("long", 100)] + [("urgent", 100)] * 10 + [("long", 100)] * 9
    assert worker.engine.prompt_tokens_read() == 2000  # the parked read did not start over
    assert first_token_ms(redis_client, "urgent") < first_token_ms(redis_client, "long")
    long = record(redis_client, "long")
    assert (long["yields"], long["gave_way_to"], long["status"]) == ("1", "urgent", "finished")
    assert redis_client.hget(K.worker("w1"), "give_ways") == "1"


def test_no_way_given_to_a_much_shorter_lower_priority(redis_client, submit):
    submit("long", priority=5, prompt_len=1000)
    worker = make_worker(redis_client, slots=2, chunk=100)
    worker.step()
    submit("short", priority=0, prompt_len=3)
    run_until_idle(worker)
    assert worker.read_log == [("long", 100)] * 10 + [("short", 3)]


def test_far_apart_chunk_boundaries_give_no_way_to_a_lower_priority(redis_client, submit):
    submit("long", priority=5, prompt_len=1600)
    worker = make_worker(redis_client, slots=2, chunk=800)
    worker.step()
    submit("short", priority=0, prompt_len=3)
    run_until_idle(worker)
    assert worker.read_log == [("long", 800), ("long", 800), ("short", 3)]


def test_within_one_level_only_a_prompt_under_half_as_long(redis_client, submit):
    submit("long", prompt_len=1000)
    worker = make_worker(redis_client, slots=3, chunk=100)
    worker.step()
    submit("half", prompt_len=500)
    worker.step()
    assert worker.read_log[-1] == ("long", 100)
    submit("under", prompt_len=499)
    run_until_idle(worker)
    assert worker.read_log[2:7] == [("under", 100)] * 4 + [("under", 99)]
    assert worker.read_log[7:15] == [("long", 100)] * 8  # then long, which came before half
    assert record(redis_client, "long")["yields"] == "1"


def test_yields_max_caps_the_give_ways_of_one_read(redis_client, submit):
    submit("long", prompt_len=1000)
    worker = make_worker(redis_client, slots=3, chunk=100, policy=Policy(yields_max=1))
    worker.step()
    submit("p5", priority=5, prompt_len=100)
    worker.step()
    worker.step()  # p5 read; long resumes at the next boundary
    assert worker.read_log == [("long", 100), ("p5", 100), ("long", 100)]
    submit("p9", priority=9, prompt_len=100)
    run_until_idle(worker)
    assert worker.read_log[3:] == [("long", 100)] * 8 + [("p9", 100)]
    assert record(redis_client, "long")["yields"] == "1"


def test_no_give_way_with_prefill_preempt_off(redis_client, submit):
    submit("long", prompt_len=300)
    worker = make_worker(redis_client, slots=2, chunk=100, policy=Policy(prefill_preempt=False))
    worker.step()
    submit("urgent", priority=9, prompt_len=100)
    run_until_idle(worker)
    assert worker.read_log == [("long", 100)] * 3 + [("urgent", 100)]


def test_long_long_short_with_mixed_priorities_and_few_slots_finishes(redis_client, submit):
    submit("long-low", priority=0, prompt_len=600, max_tokens=4)
    worker = make_worker(redis_client, slots=2, chunk=100)
    worker.step()
    submit("long-mid", priority=5, prompt_len=600, max_tokens=4)
    worker.step()
    submit("short-high", priority=9, prompt_len=10, max_tokens=4)  # no slot: waits in Redis
    for _ in range(3):
        worker.step()
    # the parked read keeps the lines moving while short-high waits for a slot
    run_until_idle(worker)
    statuses = {r: record(redis_client, r)["status"] for r in ("long-low", "long-mid", "short-high")}
    assert statuses == {"long-low": "finished", "long-mid": "finished", "short-high": "finished"}
    assert worker.engine.prompt_tokens_read() == 1210
    assert all(s.is_free for s in worker.slots) and redis_client.zcard(K.running) == 0


def trace(redis_client, submit, priority: int) -> tuple[list, list]:
    arrivals = [("a", 700), ("b", 300), ("c", 200), ("d", 900), ("e", 100)]
    worker = make_worker(redis_client, slots=3, chunk=100, worker_id=f"w{priority}")
    for rid, length in arrivals:
        submit(f"{rid}{priority}", priority=priority, prompt_len=length, max_tokens=3)
        worker.step()
    run_until_idle(worker)
    worker.stop()  # leaves: no longer listed as an idle worker for the next run
    order = sorted((int(record(redis_client, f"{r}{priority}")["claim_seq"]), r) for r, _ in arrivals)
    return [r for _, r in order], [(rid[:-1], n) for rid, n in worker.read_log]


def test_all_at_one_priority_is_first_come_first_served_plus_half_as_long(redis_client, submit):
    claims0, reads0 = trace(redis_client, submit, 0)
    claims7, reads7 = trace(redis_client, submit, 7)
    assert claims0 == claims7 == ["a", "b", "c", "d", "e"]  # first come, first served
    assert reads0 == reads7
    # b (300) and c (200) are under half of a (700): a gives way to each at a chunk boundary,
    # and resumes first (it came first) once they are read; e (100) is under half of d (900)
    assert reads0 == ([("a", 100)] + [("b", 100)] * 3 + [("a", 100)] + [("c", 100)] * 2
                      + [("a", 100)] * 5 + [("d", 100), ("e", 100)] + [("d", 100)] * 8)


def test_two_workers_the_newcomer_lands_on_the_idle_one(redis_client, submit):
    clock = VirtualClock()
    busy = make_worker(redis_client, slots=2, chunk=100, worker_id="busy", clock=clock)
    idle = make_worker(redis_client, slots=2, chunk=100, worker_id="idle", clock=clock)
    idle.step()  # nothing to do: it says it is idle
    submit("long", priority=0, prompt_len=1000)
    busy.step()
    submit("urgent", priority=9, prompt_len=100)
    busy.step()  # a free slot here, but the lines are busy and the other worker is idle
    idle.step()
    assert record(redis_client, "urgent")["worker"] == "idle"
    for _ in range(20):
        busy.step()
        idle.step()
    assert "yields" not in record(redis_client, "long")
    assert busy.read_log == [("long", 100)] * 10 and idle.read_log == [("urgent", 100)]

"""Reserved slots (--reserve N:P): pure slot choice, the worker loop over the fake engine and a
real Redis (which slot, in which order, what the worker hash says), and the settings' errors."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from queues.keys import Keys
from queues.worker_state import WorkerState
from tests.helpers.workers import MODEL, make_worker, run_until_idle
from workers import scheduler
from workers.scheduler import Policy, Reserve
from workers.settings import WorkerSettings
from workers.slot import Phase, Slot

K = Keys(MODEL)
TIERS = (Reserve(1, 10), Reserve(1, 5))


def slots_of(n: int, reserve=TIERS, busy: tuple[int, ...] = ()) -> list[Slot]:
    floors = scheduler.slot_floors(n, reserve)
    return [Slot(i, Phase.DECODING if i in busy else Phase.FREE, min_priority=f) for i, f in enumerate(floors)]


def record(redis_client, rid: str) -> dict:
    return redis_client.hgetall(K.req(rid))


# -- tier 1: which slots a priority may take --------------------------------------------------

def test_reserved_slots_are_the_last_with_the_highest_tier_last():
    assert scheduler.slot_floors(4, TIERS) == [None, None, 5, 10]
    assert scheduler.slot_floors(4, (Reserve(2, 3),)) == [None, None, 3, 3]
    assert scheduler.slot_floors(2, ()) == [None, None]
    with pytest.raises(ValueError):
        scheduler.slot_floors(2, (Reserve(3, 1),))


def test_a_request_below_every_tier_never_takes_a_reserved_slot():
    slots = slots_of(4, busy=(0, 1))
    assert scheduler.free_slot(slots, [1, 2], Policy(), priority=4) is None
    assert not scheduler.can_admit(slots, 4)
    assert scheduler.can_admit(slots, 5)


def test_unreserved_first_then_the_lowest_tier_it_qualifies_for():
    policy = Policy(reserve=TIERS)
    assert scheduler.free_slot(slots_of(4), [1, 2], policy, priority=12).index == 0
    assert scheduler.free_slot(slots_of(4, busy=(0, 1)), [1, 2], policy, priority=12).index == 2
    assert scheduler.free_slot(slots_of(4, busy=(0, 1, 2)), [1, 2], policy, priority=12).index == 3
    assert scheduler.free_slot(slots_of(4, busy=(0, 1, 2)), [1, 2], policy, priority=7) is None


def test_rule_9_applies_within_the_allowed_slots():
    # the reserved slot holds the whole conversation, but a priority-0 turn may not go there
    slots = slots_of(3, reserve=(Reserve(1, 10),))
    slots[0].cached, slots[0].last_used = [9, 9], 1
    slots[1].cached, slots[1].last_used = [1, 2, 3], 5
    slots[2].cached = [1, 2, 3, 4, 5]
    assert scheduler.free_slot(slots, [1, 2, 3, 4, 5, 6], Policy(), priority=0).index == 1
    slots[1].phase = Phase.DECODING
    assert scheduler.free_slot(slots, [1, 2, 3, 4, 5, 6], Policy(), priority=0).index == 0
    assert scheduler.free_slot(slots, [1, 2, 3, 4, 5, 6], Policy(), priority=10).index == 0


# -- tier 2: the worker loop ------------------------------------------------------------------

def test_the_alert_takes_the_reserved_slot_while_the_battery_waits(redis_client, submit):
    for i in range(4):
        submit(f"b{i}", priority=-5, prompt_len=20, max_tokens=200)
    worker = make_worker(redis_client, slots=3, chunk=100, policy=Policy(reserve=(Reserve(1, 10),)))
    for _ in range(5):
        worker.step()
    assert [s.request.id if s.request else None for s in worker.slots] == ["b0", "b1", None]
    assert redis_client.zcard(K.waiting) == 2  # b2, b3 wait although slot 2 is free
    state = WorkerState.from_hash(redis_client.hgetall(K.worker("w1")))
    assert (state.reserved, state.reserved_busy) == ({2: 10}, 0)
    assert redis_client.zscore(K.idle, "w1") is None  # a free reserved slot is not "idle"

    submit("alert", priority=10, prompt_len=30, max_tokens=3)
    arrived = worker.clock()
    worker.step()
    alert = record(redis_client, "alert")
    assert (alert["slot"], int(alert["claimed_ms"])) == ("2", arrived)
    # claimed at once, and its first token out right after its own read (30 ms), before the
    # battery's decode step in the same turn
    assert int(alert["first_token_ms"]) - arrived == 30
    assert worker.engine.calls[-1].kind == "decode" and worker.engine.calls[-1].at_ms == arrived + 40
    worker.upkeep.publish(worker.describe(), worker.clock())
    assert WorkerState.from_hash(redis_client.hgetall(K.worker("w1"))).reserved_busy == 1

    run_until_idle(worker)
    order = sorted(("b0", "b1", "alert", "b2", "b3"), key=lambda r: int(record(redis_client, r)["claim_seq"]))
    assert order == ["b0", "b1", "alert", "b2", "b3"]
    assert {r: record(redis_client, r)["slot"] for r in ("b2", "b3")} == {"b2": "0", "b3": "1"}
    assert all(record(redis_client, r)["status"] == "finished" for r in order)


def test_tiers_each_takes_the_lowest_tier_it_qualifies_for(redis_client, submit):
    for rid in ("a", "b", "c"):
        submit(rid, priority=0, prompt_len=10, max_tokens=50)
    worker = make_worker(redis_client, slots=4, chunk=100, policy=Policy(reserve=TIERS))
    worker.step()
    submit("mid", priority=7, prompt_len=10, max_tokens=50)
    submit("top", priority=12, prompt_len=10, max_tokens=50)
    submit("top2", priority=11, prompt_len=10, max_tokens=5)
    worker.step()
    # top (12) takes the >=5 slot and leaves the >=10 one to top2 (11); mid (7) finds none
    assert [s.request.id if s.request else None for s in worker.slots] == ["a", "b", "top", "top2"]
    for _ in range(8):
        worker.step()
    assert worker.slots[3].is_free and record(redis_client, "mid")["status"] == "waiting"  # not >= 10
    run_until_idle(worker)
    order = sorted(("a", "b", "c", "mid", "top", "top2"), key=lambda r: int(record(redis_client, r)["claim_seq"]))
    assert order == ["a", "b", "top", "top2", "mid", "c"]
    # when a and b end, mid prefers an unreserved slot to its tier's, and c takes the other
    assert (record(redis_client, "mid")["slot"], record(redis_client, "c")["slot"]) == ("0", "1")


def test_a_high_priority_read_in_a_reserved_slot_still_follows_the_lines(redis_client, submit):
    submit("long", priority=0, prompt_len=1000, max_tokens=2)
    worker = make_worker(redis_client, slots=2, chunk=100, policy=Policy(reserve=(Reserve(1, 10),)))
    worker.step()
    submit("alert", priority=10, prompt_len=300, max_tokens=2)
    run_until_idle(worker)
    assert worker.read_log == [("long", 100)] + [("alert", 100)] * 3 + [("long", 100)] * 9
    assert record(redis_client, "long")["gave_way_to"] == "alert"


# -- settings -------------------------------------------------------------------------------

def test_reserve_settings_parse_tiers_and_refuse_bad_values(monkeypatch):
    assert WorkerSettings(reserve=["1:10", "1:5"]).reserve_tiers() == TIERS
    assert WorkerSettings(reserve="1:10,1:5").reserve_tiers() == TIERS
    monkeypatch.setenv("STRATA_RESERVE", "2:8")
    assert WorkerSettings().reserve_tiers() == (Reserve(2, 8),)
    for bad, says in [(["9:5"], "keeps 9 slots but the worker has 4"), (["x"], "expected N:P"),
                      (["0:5"], "at least 1"), (["1:5", "1:5"], "one tier per priority"), (["1:high"], "expected N:P")]:
        with pytest.raises(ValidationError, match=says):
            WorkerSettings(reserve=bad)

"""Rule 4's last sentence through two real worker loops on one virtual clock and a real Redis: a
newcomer that would make a read give way (or wait for the lines) goes to a worker whose lines
and a slot are free, when there is one; a worker with free lines takes it itself."""

from __future__ import annotations

from engine.fake import VirtualClock
from queues.keys import Keys
from tests.helpers.workers import MODEL, make_worker

K = Keys(MODEL)


def holders(worker) -> set[str]:
    return {s.request.id for s in worker.slots if s.request}


def test_a_newcomer_goes_to_the_idle_worker_rather_than_making_a_read_give_way(redis_client, submit):
    clock = VirtualClock()
    busy = make_worker(redis_client, slots=2, chunk=100, worker_id="busy", clock=clock)
    idle = make_worker(redis_client, slots=2, chunk=100, worker_id="idle", clock=clock)
    assert not idle.step()  # nothing to do: it says so
    assert redis_client.zscore(K.idle, "idle") is not None
    submit("long", prompt_len=1000)
    busy.step()  # its lines are busy with long now
    submit("urgent", priority=5, prompt_len=300)
    busy.step()
    assert holders(busy) == {"long"} and busy.read_log == [("long", 100)] * 2  # long did not give way
    idle.step()
    assert holders(idle) == {"urgent"} and idle.read_log == [("urgent", 100)]
    assert redis_client.zscore(K.idle, "idle") is None  # its lines are busy now


def test_with_no_idle_worker_the_read_gives_way_here(redis_client, submit):
    clock = VirtualClock()
    busy = make_worker(redis_client, slots=2, chunk=100, worker_id="busy", clock=clock)
    other = make_worker(redis_client, slots=1, chunk=100, worker_id="other", clock=clock)
    submit("elsewhere", prompt_len=1000)
    other.step()  # its only slot is taken: not idle
    submit("long", prompt_len=1000)
    busy.step()
    submit("urgent", priority=5, prompt_len=100)
    busy.step()
    assert holders(busy) == {"long", "urgent"}
    assert busy.read_log == [("long", 100), ("urgent", 100)]


def test_a_worker_with_free_lines_takes_the_newcomer_although_another_is_idle(redis_client, submit):
    clock = VirtualClock()
    first = make_worker(redis_client, slots=2, worker_id="first", clock=clock)
    second = make_worker(redis_client, slots=2, worker_id="second", clock=clock)
    first.step()
    second.step()
    assert redis_client.zrange(K.idle, 0, -1) == ["first", "second"]
    submit("a", prompt_len=4)
    first.step()
    assert holders(first) == {"a"}

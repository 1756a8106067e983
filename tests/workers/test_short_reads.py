"""Several short reads in one step (issue 29 item 6): the lines carry whole short prompts up to
the chunk's token budget, in priority order, never skipping one that does not fit; a step's
admissions are claimed, and its tokens and ends written, in a number of round trips that does not
grow with how many requests it carries. The real loop over the fake engine, a real Redis, the
virtual clock: exact."""

from __future__ import annotations

import redis

from queues.keys import Keys
from tests.helpers.queue import distinct_prompt
from tests.helpers.workers import MODEL, make_worker, run_until_idle

K = Keys(MODEL)


def events(redis_client, rid):
    return [f for _, f in redis_client.xrange(K.out(rid))]


def test_short_prompts_share_one_step_in_priority_order(redis_client, submit):
    for rid, priority in [("a", 0), ("b", 5), ("c", 0), ("d", 9)]:
        submit(rid, priority, prompt_len=3, max_tokens=1)
    worker = make_worker(redis_client, slots=4, chunk=16)
    assert worker.step()
    assert worker.read_log == [("d", 3), ("b", 3), ("a", 3), ("c", 3)]  # 9, 5, then 0 first come first served
    for rid in "abcd":
        assert [e["type"] for e in events(redis_client, rid)] == ["token", "done"]
        assert redis_client.hget(K.req(rid), "status") == "finished"
    # 3 virtual ms a read, one after the other; the step's one report carries every first token
    assert [int(redis_client.hget(K.req(r), "first_token_ms")) for r in "dbac"] == [12] * 4
    assert all(s.is_free for s in worker.slots) and worker.steps == 1


def test_a_read_that_does_not_fit_whole_waits_and_nobody_behind_skips_it(redis_client, submit):
    submit("first", 5, prompt_len=10, max_tokens=1)
    submit("ten", 3, prompt_len=10, max_tokens=1)
    submit("two", 1, prompt_len=2, max_tokens=1)
    worker = make_worker(redis_client, slots=3, chunk=16)
    worker.step()
    assert worker.read_log == [("first", 10)]  # 6 tokens left: "ten" does not fit, "two" may not skip it
    worker.step()
    assert worker.read_log == [("first", 10), ("ten", 10), ("two", 2)]


def test_a_long_read_holds_the_lines_in_chunks_and_gives_way_as_ever(redis_client, submit):
    submit("long", 0, prompt_len=40, max_tokens=1)
    submit("short", 0, prompt_len=4, max_tokens=1)
    worker = make_worker(redis_client, slots=2, chunk=16)
    run_until_idle(worker)
    # both admitted in one step: the long read first (first come); at its first chunk boundary it
    # gives way to the one under half as long (rule 4), whose read ends with 12 tokens of the
    # budget left: not the 24 the long read still has, so that one goes on next step
    assert worker.read_log == [("long", 16), ("short", 4), ("long", 16), ("long", 8)]
    assert worker.give_ways == 1


class Counting(redis.Connection):
    """A connection that counts its round trips: each send is one (a pipeline sends once)."""

    sends = 0

    def send_packed_command(self, command, check_health=True):  # noqa: ANN001
        Counting.sends += 1
        return super().send_packed_command(command, check_health)


def round_trips_of_a_step(redis_url, submit, count: int) -> int:
    client = redis.Redis(connection_pool=redis.ConnectionPool.from_url(redis_url, connection_class=Counting,
                                                                        decode_responses=True))
    client.flushdb()
    for i in range(count):
        submit(f"r{i}", prompt=distinct_prompt(f"r{count}-{i}", 2), max_tokens=1)
    worker = make_worker(client, slots=count, chunk=64)
    worker.upkeep.run(worker.clock(), worker.describe())  # the heartbeat is not what is counted
    Counting.sends = 0
    assert worker.step()
    sends = Counting.sends
    assert all(s.is_free for s in worker.slots)
    assert [client.hget(K.req(f"r{i}"), "status") for i in range(count)] == ["finished"] * count
    client.close()
    return sends


def test_the_round_trips_of_a_step_do_not_grow_with_its_requests(redis_url, submit):
    round_trips_of_a_step(redis_url, submit, 1)  # Redis loads the scripts: not a step's cost
    two, sixteen = round_trips_of_a_step(redis_url, submit, 2), round_trips_of_a_step(redis_url, submit, 16)
    assert two == sixteen
    # the head with its priorities (head.lua); is another worker idle; the claims; the report with
    # every finish; the idle signal. Reads that end within the step leave the worker hash alone.
    assert sixteen == 5

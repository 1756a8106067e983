"""A worker that lost its claim writes nothing more; no request takes a worker down. The real
worker loop over the fake engine, a real Redis and one virtual clock shared by the workers."""

from __future__ import annotations

from engine.fake import VirtualClock
from queues.keys import Keys
from tests.helpers.queue import distinct_prompt
from tests.helpers.workers import MODEL, make_worker, run_until_idle

K = Keys(MODEL)


def events(redis_client, rid):
    return [f for _, f in redis_client.xrange(K.out(rid))]


def token_ids(evs):
    return [int(i) for e in evs if e["type"] == "token" for i in e["ids"].split(",") if i]


def test_a_worker_frozen_past_its_lease_writes_nothing_when_it_wakes(redis_client, submit):
    prompt = distinct_prompt("shared", 12)
    submit("ref", prompt=prompt, max_tokens=10)
    run_until_idle(make_worker(redis_client, worker_id="ref"))
    undisturbed = events(redis_client, "ref")

    clock = VirtualClock()
    submit("a", prompt=prompt, max_tokens=10)
    frozen = make_worker(redis_client, slots=1, worker_id="frozen", clock=clock)
    for _ in range(4):
        frozen.step()  # the prompt in 2 chunks (the last samples a token), 2 decode steps; SIGSTOP
    assert len(token_ids(events(redis_client, "a"))) == 3

    clock.advance(5_000)  # past its 1 s lease
    heir = make_worker(redis_client, slots=1, worker_id="heir", clock=clock)
    for _ in range(3):
        heir.step()  # takes the request back, re-reads prompt + 3 tokens, streams on
    assert redis_client.hget(K.req("a"), "worker") == "heir"

    frozen.step()  # SIGCONT: it decodes its stale slot and reports
    assert all(s.is_free for s in frozen.slots)  # dropped at once
    run_until_idle(heir)
    frozen.step()
    got = events(redis_client, "a")
    assert token_ids(got) == token_ids(undisturbed) and len(token_ids(got)) == 10
    assert got[-1]["type"] == "done" and [e["type"] for e in got].count("done") == 1
    assert got[-1] == undisturbed[-1]
    h = redis_client.hgetall(K.req("a"))
    assert (h["status"], h["worker"], h["attempts"], h["claims_lost"]) == ("finished", "heir", "2", "1")
    assert redis_client.hget(K.metrics, "requests:0:finished") == "2"  # ref and a, each once


def test_a_request_that_cannot_start_fails_alone_and_the_worker_goes_on(redis_client, submit):
    worker = make_worker(redis_client, slots=2)
    begin = worker.engine.begin

    def picky(slot, params, keep=0):
        if params.seed == 2**64:
            raise RuntimeError("Overflow when unpacking long")  # what torch.manual_seed says
        return begin(slot, params, keep)

    worker.engine.begin = picky
    submit("bad", seed=2**64, max_tokens=4)
    submit("good", max_tokens=4)
    run_until_idle(worker)
    bad, good = events(redis_client, "bad"), events(redis_client, "good")
    assert [e["type"] for e in bad] == ["error"] and bad[0]["code"] == "engine_error"
    assert "Overflow" in bad[0]["message"]
    assert redis_client.hget(K.req("bad"), "status") == "failed"
    assert [e["type"] for e in good] == ["token"] * 4 + ["done"]
    assert redis_client.hget(K.metrics, "requests:0:failed") == "1"
    assert all(s.is_free for s in worker.slots) and redis_client.zcard(K.running) == 0


def test_a_request_that_keeps_breaking_steps_fails_after_max_attempts(redis_client, submit):
    """An error no handler expected: the step's claims go back as lost, the worker lives on; the
    request that causes it fails as worker_lost on its third claim, the others finish."""
    worker = make_worker(redis_client, slots=2)
    position = worker.engine.position

    def breaks(slot: int) -> int:  # asked once the read of the prompt ends, outside any handler
        if worker.slots[slot].request.id == "poison":
            raise KeyError("a bug")
        return position(slot)

    worker.engine.position = breaks
    submit("poison", priority=1, max_tokens=4)
    submit("fine", max_tokens=4)
    for _ in range(200):
        worker.turn()
        if redis_client.zcard(K.waiting) + redis_client.zcard(K.running) == 0:
            break
    poison = redis_client.hgetall(K.req("poison"))
    assert (poison["status"], poison["finish_reason"], poison["claims_lost"]) == ("failed", "worker_lost", "3")
    assert events(redis_client, "poison")[-1]["code"] == "worker_lost"
    fine = events(redis_client, "fine")
    assert [e["type"] for e in fine] == ["token"] * 4 + ["done"]
    assert all(s.is_free for s in worker.slots)

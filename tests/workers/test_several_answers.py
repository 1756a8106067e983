"""`n` answers of one request (issue 29): the prompt read once in one slot, its cache copied into
the sibling slots, each answer with its own derived seed, admitted together. The real worker loop
over the fake engine, a real Redis, the virtual clock: exact."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from engine.fake import VirtualClock
from queues.intake import Intake
from queues.keys import Keys
from tests.helpers.queue import distinct_prompt
from tests.helpers.workers import MODEL, make_worker, run_until_idle

K = Keys(MODEL)


def events(redis_client, rid):
    return [f for _, f in redis_client.xrange(K.out(rid))]


def answer_ids(evs, choice: int) -> list[int]:
    return [int(i) for e in evs if e["type"] == "token" and int(e.get("choice", 0)) == choice
            for i in e["ids"].split(",") if i]


def test_n_answers_read_the_prompt_once_and_each_is_the_single_request_of_its_seed(redis_client, submit):
    prompt = distinct_prompt("n", 20)
    submit("three", prompt=prompt, max_tokens=5, seed=40, temperature=0.8, n=3)
    worker = make_worker(redis_client, slots=4, chunk=8)
    run_until_idle(worker)
    assert worker.read_log == [("three", 8), ("three", 8), ("three", 4)]  # one read, in chunks
    forks = [c for c in worker.engine.calls if c.kind == "fork"]
    assert [c.slots for c in forks] == [(0, 1, 2)]
    got = events(redis_client, "three")
    answers = [answer_ids(got, i) for i in range(3)]
    assert all(len(a) == 5 for a in answers) and len({tuple(a) for a in answers}) == 3
    dones = [e for e in got if e["type"] == "done"]
    assert sorted(int(d.get("choice", 0)) for d in dones) == [0, 1, 2]
    assert all(d["completion_tokens"] == "5" and d["prompt_tokens"] == "20" for d in dones)
    h = redis_client.hgetall(K.req("three"))
    assert (h["status"], h["completion_tokens"], h["n"]) == ("finished", "15", "3")
    assert all(s.is_free for s in worker.slots)

    for choice in range(3):  # each answer is the single request with seed 40 + choice
        rid = f"single{choice}"
        submit(rid, prompt=prompt, max_tokens=5, seed=40 + choice, temperature=0.8)
        run_until_idle(make_worker(redis_client, slots=1, worker_id=f"w-{rid}"))
        assert answer_ids(events(redis_client, rid), 0) == answers[choice]


def test_n_answers_are_admitted_together_and_nobody_behind_overtakes(redis_client, submit):
    submit("long", max_tokens=6)
    worker = make_worker(redis_client, slots=3)
    worker.step()  # "long" takes slot 0: two slots stay free
    submit("pair3", prompt_len=4, max_tokens=2, n=3)
    submit("small", prompt_len=4, max_tokens=2)
    for _ in range(3):
        worker.step()
        # the n=3 head waits for three free slots; "small" behind it waits too
        assert [s.request.id if s.request else None for s in worker.slots] == ["long", None, None]
    run_until_idle(worker)
    seq = {rid: int(redis_client.hget(K.req(rid), "claim_seq")) for rid in ("long", "pair3", "small")}
    assert seq["long"] < seq["pair3"] < seq["small"]
    assert redis_client.hget(K.req("pair3"), "status") == "finished"
    assert [e["type"] for e in events(redis_client, "pair3")].count("done") == 3


def test_an_answer_that_ends_first_frees_its_slot_and_the_request_ends_with_the_last(redis_client, submit):
    prompt = distinct_prompt("stop", 6)
    submit("probe", prompt=prompt, max_tokens=4, seed=8)  # what answer 1 (seed 7 + 1) writes
    run_until_idle(make_worker(redis_client, slots=1, worker_id="probe"))
    second = answer_ids(events(redis_client, "probe"), 0)[1]
    submit("two", prompt=prompt, max_tokens=4, seed=7, n=2, stop=[f" t{second}"])
    worker = make_worker(redis_client, slots=2)
    busy = []
    while worker.step():
        busy.append(sum(not s.is_free for s in worker.slots))
        if redis_client.hget(K.req("two"), "status") == "finished":
            break
    got = events(redis_client, "two")
    dones = [(int(e.get("choice", 0)), e["finish_reason"]) for e in got if e["type"] == "done"]
    assert dones == [(1, "stop"), (0, "length")]  # answer 1 ended first, the request with answer 0
    assert 1 in busy  # answer 1's slot was free while answer 0 still decoded
    assert got[-1]["type"] == "done" and got[-1].get("choice", "0") == "0"
    h = redis_client.hgetall(K.req("two"))
    assert int(h["completion_tokens"]) == len(answer_ids(got, 0)) + 2  # answer 1: its token and the stop's


def test_cancelling_a_request_of_n_answers_frees_all_its_slots(redis_client, submit, redis_url):
    submit("many", max_tokens=1000, n=3)
    worker = make_worker(redis_client, slots=3)
    worker.step()
    worker.step()
    assert all(s.request and s.request.id == "many" for s in worker.slots)

    async def cancel() -> None:
        client = aioredis.Redis.from_url(redis_url)
        await Intake(client, MODEL).cancel("many")
        await client.aclose()

    asyncio.run(cancel())
    worker.step()
    assert all(s.is_free for s in worker.slots)
    assert redis_client.hget(K.req("many"), "status") == "cancelled"


def test_n_answers_resumed_after_their_worker_died_end_once_as_undisturbed(redis_client, submit):
    """A worker dies with answer 1 of three ended (its stop string) and the others part-way: the
    heir reads the prompt for each unfinished answer and replays that answer's own tokens (their
    caches part after the prompt: no fork), the ended one frees its slot, and every answer ends
    once with the tokens of the undisturbed run (each seeded stream goes on: seed + i)."""
    prompt = distinct_prompt("resume-n", 12)
    submit("probe", prompt=prompt, max_tokens=10, seed=41, temperature=0.8)  # answer 1's seed
    run_until_idle(make_worker(redis_client, slots=1, worker_id="probe"))
    stop = [f" t{answer_ids(events(redis_client, 'probe'), 0)[1]}"]  # answer 1 ends at its second token
    body = dict(prompt=prompt, max_tokens=10, seed=40, temperature=0.8, n=3, stop=stop)
    submit("calm", **body)
    run_until_idle(make_worker(redis_client, slots=3, worker_id="calm"))
    calm = events(redis_client, "calm")

    clock = VirtualClock()
    submit("lost", **body)
    dying = make_worker(redis_client, slots=3, worker_id="dying", clock=clock)
    while not any(e["type"] == "done" for e in events(redis_client, "lost")):
        dying.step()
    dying.step()  # one more token for the two answers left, then the worker is gone
    streamed = events(redis_client, "lost")
    assert [int(e.get("choice", 0)) for e in streamed if e["type"] == "done"] == [1]
    assert all(0 < len(answer_ids(streamed, c)) < 10 for c in (0, 2))
    clock.advance(5_000)  # past its lease: the request goes back to the queue
    heir = make_worker(redis_client, slots=3, worker_id="heir", clock=clock)
    heir.claims.requeue_expired(clock())
    run_until_idle(heir)

    got = events(redis_client, "lost")
    for choice in range(3):
        assert answer_ids(got, choice) == answer_ids(calm, choice), choice
    dones = [e for e in got if e["type"] == "done"]
    assert sorted(int(d.get("choice", 0)) for d in dones) == [0, 1, 2]  # each answer ends once
    assert got[-1]["type"] == "done" and not [e for e in got if e["type"] == "error"]
    assert sorted((d.get("choice", "0"), d["finish_reason"]) for d in dones) == sorted(
        (d.get("choice", "0"), d["finish_reason"]) for d in calm if d["type"] == "done")
    h, reference = redis_client.hgetall(K.req("lost")), redis_client.hgetall(K.req("calm"))
    assert (h["status"], h["completion_tokens"]) == ("finished", reference["completion_tokens"])
    assert heir.read_log == [("lost", 8), ("lost", 4), ("lost", 8), ("lost", 4)]  # answers 0 and 2: the prompt each
    kinds = [(c.kind, c.tokens) for c in heir.engine.calls if c.kind in ("fork", "replay")]
    assert kinds == [("replay", len(answer_ids(streamed, 0))), ("replay", len(answer_ids(streamed, 2)))]
    assert all(s.is_free for s in heir.slots)
